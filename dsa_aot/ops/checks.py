"""Argument validation the op modules share: each check appends what is wrong to ``problems``, and the call raises
once (:func:`input_error`), before anything is touched."""

from __future__ import annotations

import numbers

from ..errors import InputError

__all__ = ["check", "scalar_f32", "integer", "one_of", "flag", "block_scales", "thd_batch", "int32_extents", "workspace_problems", "overlapping", "aliasing",
           "input_error", "f32_scalar"]


_FLT_MAX = 3.4028234663852886e38


def scalar_f32(problems, name, v, positive=False) -> float:
    """``v`` as the fp32 scalar a kernel receives: a real number, finite and representable in fp32
    (and > 0 with ``positive``); appends the problem otherwise (and returns 0.0)."""
    if type(v) is float and -_FLT_MAX <= v <= _FLT_MAX and (v > 0.0 or not positive):  # the common case, without the ABC check
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        problems.append(f"{name}={v!r} (expected a real number)")
        return 0.0
    x = float(v)
    if not (abs(x) <= _FLT_MAX):  # also NaN
        problems.append(f"{name}={v!r} (expected a finite value representable in fp32, |x| <= 3.4e38)")
        return 0.0
    if positive and not x > 0.0:
        problems.append(f"{name}={v!r} (expected > 0)")
    return x


def integer(problems, name, v, lo, hi) -> int:
    """``v`` as an int in [lo, hi] (bools refused); appends the problem otherwise."""
    if isinstance(v, bool) or not isinstance(v, int):
        problems.append(f"{name}={v!r} (expected an integer in [{lo}, {hi}])")
        return lo
    if not lo <= v <= hi:
        problems.append(f"{name}={v!r} (expected an integer in [{lo}, {hi}])")
    return v


def one_of(problems, name, v, allowed):
    """``v`` if it is one of ``allowed`` (compared by type and value: 4.0 is not 4, True is not 1)."""
    if not any(type(v) is type(a) and v == a for a in allowed):
        problems.append(f"{name}={v!r} (expected one of {', '.join(repr(a) for a in allowed)})")
    return v


def flag(problems, name, v) -> bool:
    """``v`` as a bool: True / False (or 0 / 1)."""
    if v is True or v is False or (type(v) is int and v in (0, 1)):
        return bool(v)
    problems.append(f"{name}={v!r} (expected True or False)")
    return False


def check(problems, t, name, shape, dtype, dev, align, layout=True, device=True):
    """Append to ``problems`` what is wrong with tensor ``t`` against the expected shape, dtype, device,
    layout, contiguity and base alignment (``layout=False``: not contiguity and alignment, for the
    inputs an allocating form copies first, as upstream does; ``device=False``: not the device, its
    problem said already)."""
    import torch

    if not isinstance(t, torch.Tensor):
        problems.append(f"{name}: got {type(t).__name__} (expected a torch.Tensor)")
        return
    if t.layout != torch.strided:
        problems.append(f"{name}: layout {t.layout} (expected a dense torch.strided tensor)")
        return
    if tuple(t.shape) != tuple(shape):
        problems.append(f"{name}: shape {tuple(t.shape)} (expected {tuple(shape)})")
    if t.dtype != dtype:
        problems.append(f"{name}: dtype {t.dtype} (expected {dtype})")
    if device and (t.device.type != "cuda" or (dev is not None and t.device.index != dev)):
        problems.append(f"{name}: on {t.device} (expected cuda:{dev}, the device of the first input)")
    if not layout:
        return
    if not t.is_contiguous():
        problems.append(f"{name}: strides {tuple(t.stride())} (expected contiguous; call .contiguous())")
    if t.data_ptr() % align:
        problems.append(f"{name}: data pointer 0x{t.data_ptr():x} is not {align}-byte aligned (expected a {align}-byte aligned base; clone() the tensor)")


def block_scales(problems, precision, varlen, b, s_q, s_k, heads, dev, q_scale, k_scale, cu_q_scale, cu_k_scale, layout=True, dim=128):
    """Append what is wrong with the e8m0 block scales of a block-scaled (mxfp8 / mxfp4) SM100 call (the
    indexer forward, the dense indexer and attention score recomputes read the same layout) against
    upstream's packed layout, one KV head and ``heads`` q heads packed per q row, ``dim`` the logical head
    dim (its scales, one per 32 values, padded to a multiple of 4 columns: 4 at D128, 16 at D512): BSHD
    q_scale (B, ceil128(S_q * heads), cols) and k_scale (B, ceil128(S_k), cols), no scale-padded offsets;
    THD both (1, a multiple of 128 rows, cols) with ``cu_seqlens_q_scale_padded`` /
    ``cu_seqlens_k_scale_padded`` (int32, B + 1: each segment's rows padded to 128; their values are the
    kernel's to read). ``b``: None where the batch is unknown (a malformed cu_seqlens, reported by its own
    check); ``layout=False`` as :func:`check`'s."""
    import torch

    e8 = torch.float8_e8m0fnu
    groups = -(-dim // 32)
    cols = -(-groups // 4) * 4  # upstream's sf_groups_padded at sf_vec_size 32
    if q_scale is None or k_scale is None:
        problems.append(f"precision={precision!r} requires q_scale and k_scale")
    elif varlen:
        for name, t in (("q_scale", q_scale), ("k_scale", k_scale)):
            rows = t.shape[1] if isinstance(t, torch.Tensor) and t.ndim == 3 else -1
            check(problems, t, name, (1, rows if rows >= 0 and rows % 128 == 0 else "a multiple of 128", cols), e8, dev, 16, layout)
    else:
        check(problems, q_scale, "q_scale", (b, -(-s_q * heads // 128) * 128, cols), e8, dev, 16, layout)
        check(problems, k_scale, "k_scale", (b, -(-s_k // 128) * 128, cols), e8, dev, 16, layout)
    if varlen:
        for name, t in (("cu_seqlens_q_scale_padded", cu_q_scale), ("cu_seqlens_k_scale_padded", cu_k_scale)):
            if t is None:
                problems.append(f"{name}: THD {precision} needs the scales' padded segment offsets (int32, batch + 1)")
            elif b is not None:
                check(problems, t, name, (b + 1,), torch.int32, dev, 16, layout)
    elif cu_q_scale is not None or cu_k_scale is not None:
        problems.append("cu_seqlens_q_scale_padded / cu_seqlens_k_scale_padded: only with THD mxfp8 / mxfp4 (SM100)")


def thd_batch(problems, varlen, cu_q, cu_k, max_q, max_k, dev, layout=True):
    """The THD arguments of an op, checked: with ``varlen``, cu_seqlens_q / cu_seqlens_k (1-D int32 on
    GPU ``dev``, batch + 1 offsets, the same shape) and the caller's max_seqlen_q / max_seqlen_k; without,
    no max_seqlen. Returns the batch (None without a valid cu_seqlens); problems appended."""
    import torch

    b = None
    if not varlen:
        for name, v in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
            if v is not None:
                problems.append(f"{name}={v!r}: only with cu_seqlens_q / cu_seqlens_k (THD)")
        return None
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(t, torch.Tensor) or t.ndim != 1 or t.numel() < 1:
            problems.append(f"{name}: THD needs cu_seqlens_q and cu_seqlens_k, 1-D int32 CUDA tensors of batch + 1 offsets; got "
                            f"{getattr(t, 'shape', type(t).__name__)}")
        else:
            check(problems, t, name, t.shape, torch.int32, dev, 16, layout=layout)
            b = t.shape[0] - 1
    if isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor) and cu_q.shape != cu_k.shape:
        problems.append(f"cu_seqlens_q {tuple(cu_q.shape)} and cu_seqlens_k {tuple(cu_k.shape)}: must have the same shape")
    for name, v in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if v is None:
            problems.append(f"{name}: THD needs max_seqlen_q and max_seqlen_k (the longest segments; nothing is read back from the device)")
        else:
            integer(problems, name, v, 0, 2**31 - 1)
    return b


def int32_extents(problems, *named):
    """Each (what, n) of ``named`` whose n does not fit the kernels' int32 indexing appended as a problem."""
    problems.extend(f"{what} = {n} (expected < 2**31: the kernels index with int32)" for what, n in named if n >= 2**31)


def workspace_problems(workspace, need, dev, named, sizer, align=16) -> list:
    """What is wrong with a caller's ``workspace`` for ``need`` bytes on GPU ``dev``: missing, not a 1-D
    uint8 tensor there, too small, or its first ``need`` bytes overlapping one of ``named`` ((name,
    tensor or None) pairs). ``sizer``: the public function that sizes it, named in the messages; ``align``:
    the base alignment the kernels need."""
    import torch

    if workspace is None:
        return [f"workspace: missing ({need} uint8 bytes needed; see {sizer})"]
    wp = []
    n = workspace.numel() if isinstance(workspace, torch.Tensor) else -1
    check(wp, workspace, "workspace", (n,), torch.uint8, dev, align)
    if not wp and n < need:
        wp.append(f"workspace: {n} bytes (expected at least {need}; see {sizer})")
    if not wp:
        for i in overlapping(workspace, need, [t for _, t in named]):
            wp.append(f"workspace: its first {need} bytes overlap {named[i][0]}")
    return wp


def overlapping(workspace, need, tensors):
    """Indices of the tensors (None allowed) whose bytes overlap the first ``need`` bytes of workspace."""
    w0 = workspace.data_ptr()
    w1 = w0 + need
    return [i for i, t in enumerate(tensors) if t is not None and t.numel() and w0 < t.data_ptr() + t.numel() * t.element_size() and t.data_ptr() < w1]


def aliasing(outputs, inputs):
    """Problems for every output (name, tensor) whose bytes overlap another output's or an input's (None allowed)."""
    out = []
    seen = list(inputs)
    for name, t in outputs:
        if t is None:
            continue
        for other, u in seen:
            if u is not None and u.numel() and t.numel() and _overlap(t, u):
                out.append(f"{name}: overlaps {other} (outputs must not alias the inputs or each other)")
        seen.append((name, t))
    return out


def _overlap(t, u) -> bool:
    a0, b0 = t.data_ptr(), u.data_ptr()
    return a0 < b0 + u.numel() * u.element_size() and b0 < a0 + t.numel() * t.element_size()


def input_error(problems):
    e = InputError(f"{len(problems)} invalid input(s), nothing was launched:\n" + "\n".join(f"  - {p}" for p in problems))
    e.problems = list(problems)  # a composite op adds its own to a part's (dsa_aot.dsa.sparse_attention)
    return e


def f32_scalar(name, v) -> tuple:
    """``(v,)``: the one per-call fp32 scalar of a plan (InputError unless :func:`scalar_f32` accepts it)."""
    problems = []
    x = scalar_f32(problems, name, v)
    if problems:
        raise input_error(problems)
    return (x,)
