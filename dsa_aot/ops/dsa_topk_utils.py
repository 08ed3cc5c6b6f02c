"""DSA top-k index utilities: cudnn's local_to_global_wrapper and compactify_wrapper, from shipped cubins.

``local_to_global`` maps local top-k ids to global KV ids (``b * seqlen_k + id``, or ``cu_seqlens_k[b]
+ id`` for THD rows of batch b; a negative id becomes -1; the result is int32). ``compactify`` moves
each row's non-negative ids to its front in their order, fills the rest with -1 and returns the count
per row. Which entry serves a call is :mod:`dsa_aot.policy.dsa_topk_utils` (upstream's own compile keys).
"""

from __future__ import annotations

from ..policy import dsa_topk_utils as policy
from ._support import (aliasing, alloc_on, allocate, check, footprint, input_error, integer, launcher, require, stream_handle, tensor_args,
                       writes_only)
from .outputs import Outputs
from .plan import ALLOC, Plan, Recorder, cached, compile_call, fresh, probe_for, remember, remembered

__all__ = ["local_to_global", "local_to_global_into", "compactify", "compactify_into", "LocalToGlobal", "Compactify"]

FAMILY = policy.FAMILY
_I32 = 2**31 - 1
_L2G_THREADS = 256  # LocalToGlobalTopK's threads_per_cta: grid.y = ceil(K / 256) must stay <= 65535
_MAX_GRID_Y = 65535
_L2G: dict = {}
_CMP: dict = {}
_L2G_TENSORS = ("global_indices", "local_indices", "cu_seqlens_q", "cu_seqlens_k")
_CMP_TENSORS = ("indices_out", "topk_length", "indices")


def _is_tensor(t) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and t.layout == torch.strided


# --- local_to_global ---------------------------------------------------------------------------------


def _inputs_l2g(local_indices, cu_seqlens_q, cu_seqlens_k):
    """(problems, dev, varlen) of local_to_global's inputs."""
    import torch

    problems, dev = [], None
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if not _is_tensor(local_indices) or local_indices.dtype not in (torch.int32, torch.int64):
        problems.append(f"local_indices: expected a dense int32 or int64 CUDA tensor, got {getattr(local_indices, 'dtype', type(local_indices).__name__)}")
    elif local_indices.ndim != (2 if varlen else 3):
        problems.append(f"local_indices: shape {tuple(local_indices.shape)} (expected {'(total_q, K) with cu_seqlens' if varlen else '(B, S_q, K)'})")
    else:
        dev = local_indices.device.index if local_indices.device.type == "cuda" else None
        check(problems, local_indices, "local_indices", local_indices.shape, local_indices.dtype, dev, 16)
        k = local_indices.shape[-1]
        rows = local_indices.numel() // k if k else 0
        if rows > _I32 or -(-k // _L2G_THREADS) > _MAX_GRID_Y:
            problems.append(f"local_indices: {rows} rows of {k} ids (the kernel takes at most {_I32} rows of {_MAX_GRID_Y * _L2G_THREADS} ids)")
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            problems.append("cu_seqlens_q and cu_seqlens_k: THD needs both (or neither, for (B, S_q, K) indices)")
        else:
            for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
                if not _is_tensor(t) or t.ndim != 1 or t.numel() < 1:
                    problems.append(f"{name}: expected a 1-D int32 CUDA tensor of batch + 1 offsets, got {getattr(t, 'shape', type(t).__name__)}")
                else:
                    check(problems, t, name, t.shape, torch.int32, dev, 16)
            if _is_tensor(cu_seqlens_q) and _is_tensor(cu_seqlens_k) and cu_seqlens_q.shape != cu_seqlens_k.shape:
                problems.append(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)}: must have the same shape")
    return problems, dev, varlen


def _seqlen_k(seqlen_k) -> tuple:
    """The per-call scalar (an Int32 of the kernel): InputError unless an integer in [0, 2**31 - 1]."""
    problems = []
    integer(problems, "seqlen_k", seqlen_k, 0, _I32)
    if problems:
        raise input_error(problems)
    return (seqlen_k,)


def _plan_local_to_global(global_indices, local_indices, seqlen_k, cu_seqlens_q=None, cu_seqlens_k=None):
    """Validate a local_to_global call and compile what it does (:class:`dsa_aot.ops.plan.Call`); ``seqlen_k``
    is a per-call scalar (the plan's default)."""
    import torch

    problems, dev, varlen = _inputs_l2g(local_indices, cu_seqlens_q, cu_seqlens_k)
    integer(problems, "seqlen_k", seqlen_k, 0, _I32)
    if not problems:
        check(problems, global_indices, "global_indices", local_indices.shape, torch.int32, dev, 16)
    if not problems:
        problems += aliasing((("global_indices", global_indices),),
                             (("local_indices", local_indices), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)))
    if problems:
        raise input_error(problems)
    ts = (global_indices, local_indices, cu_seqlens_q, cu_seqlens_k)
    rec = Recorder(len(ts), 1)
    p = rec.p
    if local_indices.numel():  # no rows or no ids: nothing to write
        dtype = "int32" if local_indices.dtype == torch.int32 else "int64"
        le = launcher(FAMILY, *policy.local_to_global_kernel(dtype, varlen), dev)
        cu = (*tensor_args(cu_seqlens_q, p[2]), *tensor_args(cu_seqlens_k, p[3])) if varlen else ()
        rec.launch(le, *tensor_args(local_indices, p[1]), *tensor_args(global_indices, p[0]), rec.x[0], *cu, rec.s)
    foot = footprint(ts, writes=(0,))
    return compile_call("dsa_topk_utils.local_to_global", rec, dev, ts, foot, (seqlen_k,), _seqlen_k)


def local_to_global_into(global_indices, local_indices, seqlen_k, cu_seqlens_q=None, cu_seqlens_k=None, stream=None):
    """``local_to_global`` into caller-provided int32 ``global_indices`` of the input's shape
    (capture-safe from the first call; allocates nothing). Returns ``global_indices``."""
    ts = (global_indices, local_indices, cu_seqlens_q, cu_seqlens_k)
    call, p = cached(_L2G, ts, (), lambda: _plan_local_to_global(*ts[:2], seqlen_k, *ts[2:]))
    call.run(p, stream_handle(stream, call.dev), _seqlen_k(seqlen_k), ts, stream)
    return global_indices


def local_to_global(local_indices, seqlen_k, cu_seqlens_q=None, cu_seqlens_k=None, stream=None):
    """cudnn's local_to_global_wrapper: returns ``{'indices'}``, int32 of ``local_indices``' shape
    ((B, S_q, K), or (total_q, K) with ``cu_seqlens_q`` / ``cu_seqlens_k``)."""
    import torch

    ins = (local_indices, cu_seqlens_q, cu_seqlens_k)
    hit = remembered(_L2G, ALLOC, ins, ())  # inputs like the last validated call's, aligned
    if hit is not None:
        dev, box = hit[0]
        x = _seqlen_k(seqlen_k)
    else:
        problems, dev, varlen = _inputs_l2g(local_indices, cu_seqlens_q, cu_seqlens_k)
        integer(problems, "seqlen_k", seqlen_k, 0, _I32)
        if problems:
            raise input_error(problems)
        x = (seqlen_k,)
        stream_handle(stream, dev)  # refuse a bad stream, and a missing entry, before allocating
        if local_indices.numel():
            require(FAMILY, {"main": policy.local_to_global_kernel("int32" if local_indices.dtype == torch.int32 else "int64", varlen)}, dev)
        box = [None]  # the _into call, once known (plan.fresh)
        remember(_L2G, ALLOC, (), probe_for(ins, dev, footprint(ins, writes=())), (dev, box))
    s = stream_handle(stream, dev)
    with alloc_on(stream, dev):
        out = allocate(lambda: torch.empty(local_indices.shape, dtype=torch.int32, device=local_indices.device))
    ts = (out, *ins)
    call, p = fresh(box, _L2G, ts, (), lambda: _plan_local_to_global(out, local_indices, seqlen_k, cu_seqlens_q, cu_seqlens_k))
    call.run(p, s, x, ts, stream)
    return Outputs(indices=out)


class LocalToGlobal(Plan):
    """``LocalToGlobal(global_indices, local_indices, seqlen_k, cu_seqlens_q=None, cu_seqlens_k=None)``;
    ``execute(global_indices, local_indices, cu_seqlens_q=None, cu_seqlens_k=None, stream=None, seqlen_k=...)``
    (``seqlen_k`` defaults to the plan's; see :class:`dsa_aot.ops.plan.Plan`)."""

    _build = staticmethod(_plan_local_to_global)
    _tensors = _L2G_TENSORS
    _scalars = ("seqlen_k",)


# --- compactify --------------------------------------------------------------------------------------


def _cols_hint(cols) -> str:
    return f" (compactify compiles one cubin per top-k width; this call's rows hold {cols} ids)"


def _plan_compactify(indices_out, topk_length, indices):
    """Validate a compactify call on 2-D ``indices`` and compile what it does."""
    import torch

    problems, dev = [], None
    if not _is_tensor(indices) or indices.ndim != 2:
        problems.append(f"indices: expected a 2-D (rows, cols) int32 CUDA tensor, got {getattr(indices, 'shape', type(indices).__name__)}")
    else:
        dev = indices.device.index if indices.device.type == "cuda" else None
        check(problems, indices, "indices", indices.shape, torch.int32, dev, 16)
        if indices.shape[0] > _I32:
            problems.append(f"indices: {indices.shape[0]} rows (the kernel takes at most {_I32})")
    if not problems:
        rows, cols = indices.shape
        check(problems, indices_out, "indices_out", (rows, cols), torch.int32, dev, 16)
        check(problems, topk_length, "topk_length", (rows,), torch.int32, dev, 16)
    if not problems:
        problems += aliasing((("indices_out", indices_out), ("topk_length", topk_length)), (("indices", indices),))
    if problems:
        raise input_error(problems)
    ts = (indices_out, topk_length, indices)
    rec = Recorder(len(ts))
    p = rec.p
    rows, cols = indices.shape
    if rows and cols:
        le = launcher(FAMILY, *policy.compactify_kernel(cols), dev, _cols_hint(cols))
        rec.launch(le, *tensor_args(indices, p[2]), *tensor_args(indices_out, p[0]), *tensor_args(topk_length, p[1]), rows, rec.s)
    elif rows:  # rows of no ids: every count is 0

        def zero(ts, stream):
            with alloc_on(stream, dev):
                ts[1].zero_()

        rec.then(zero)
    foot = footprint(ts, writes=(0, 1))
    return compile_call("dsa_topk_utils.compactify", rec, dev, ts, foot)


def compactify_into(indices_out, topk_length, indices, stream=None):
    """``compactify`` of contiguous 2-D ``indices`` (rows, cols) into caller-provided ``indices_out``
    (rows, cols) and ``topk_length`` (rows,), both int32 (capture-safe; allocates nothing)."""
    ts = (indices_out, topk_length, indices)
    call, p = cached(_CMP, ts, (), lambda: _plan_compactify(*ts))
    call.run(p, stream_handle(stream, call.dev), call.x, ts, stream)
    return indices_out, topk_length


def compactify(indices, stream=None):
    """cudnn's compactify_wrapper: returns ``{'indices', 'topk_length'}``. ``indices``: int32 (rows, cols)
    or (B, S, cols), flattened to (B * S, cols) as upstream does (a non-contiguous input is copied
    first, on the launch stream, as upstream does)."""
    import torch

    hit = remembered(_CMP, ALLOC, (indices,), ())  # a contiguous input like the last validated call's, aligned
    if hit is not None:
        dev, box = hit[0]
        s = stream_handle(stream, dev)
        x = indices.view(-1, indices.shape[-1]) if indices.ndim == 3 else indices
        with alloc_on(stream, dev):
            out, length = allocate(lambda: (torch.empty_like(x), torch.empty(x.shape[0], dtype=torch.int32, device=x.device)))
        ts = (out, length, x)
        call, p = fresh(box, _CMP, ts, (), lambda: _plan_compactify(*ts))
        call.run(p, s, call.x, ts, stream)
        return Outputs(indices=out, topk_length=length)
    problems = []
    if not _is_tensor(indices) or indices.dtype != torch.int32 or indices.ndim not in (2, 3) or indices.device.type != "cuda":
        problems.append(f"indices: expected a 2-D or 3-D int32 CUDA tensor, got {getattr(indices, 'dtype', type(indices).__name__)} "
                        f"{tuple(getattr(indices, 'shape', ()))} on {getattr(indices, 'device', None)}")
        raise input_error(problems)
    dev = indices.device.index
    stream_handle(stream, dev)  # refuse a bad stream, and a missing entry, before allocating
    if indices.numel():
        require(FAMILY, {"main": policy.compactify_kernel(indices.shape[-1])}, dev, {"main": _cols_hint(indices.shape[-1])})

    def copy():  # what upstream launches on: contiguous (a copy on the launch stream if needed)
        with alloc_on(stream, dev):
            return indices.contiguous()

    x = indices if indices.is_contiguous() else allocate(copy)
    x = x.reshape(x.shape[0] * x.shape[1], x.shape[2]) if x.ndim == 3 else x  # (rows, cols): a view (also when cols is 0)
    check(problems, x, "indices", x.shape, torch.int32, dev, 16)
    if problems:
        raise input_error(problems)

    def outputs():
        with alloc_on(stream, dev):
            return torch.empty_like(x), torch.empty(x.shape[0], dtype=torch.int32, device=x.device)

    out, length = allocate(outputs)
    compactify_into(out, length, x, stream)
    if indices.is_contiguous() and x.numel():  # no copy was made: a repeat of this call may skip the checks above
        remember(_CMP, ALLOC, (), probe_for((indices,), dev, footprint((indices,), writes=())), (dev, [None]))
    return Outputs(indices=out, topk_length=length)


class Compactify(Plan):
    """``Compactify(indices_out, topk_length, indices)``; ``execute(indices_out, topk_length, indices,
    stream=None)`` (see :class:`dsa_aot.ops.plan.Plan`)."""

    _build = staticmethod(_plan_compactify)
    _tensors = _CMP_TENSORS


# --- torch.library (dsa_aot.library registers these as torch.ops.dsa_aot.<name>: schema, CUDA impl, fake) ---


def _t_l2g(local_indices, seqlen_k, cu_seqlens_q=None, cu_seqlens_k=None):
    return local_to_global(local_indices, seqlen_k, cu_seqlens_q, cu_seqlens_k)["indices"]


def _f_l2g(local_indices, seqlen_k, cu_seqlens_q=None, cu_seqlens_k=None):
    import torch

    return local_indices.new_empty(local_indices.shape, dtype=torch.int32)


def _t_l2g_into(global_indices, local_indices, seqlen_k, cu_seqlens_q=None, cu_seqlens_k=None):
    local_to_global_into(global_indices, local_indices, seqlen_k, cu_seqlens_q, cu_seqlens_k)


def _t_cmp(indices):
    return tuple(compactify(indices))


def _f_cmp(indices):
    cols = indices.shape[-1]
    rows = indices.numel() // cols if cols else (indices.shape[0] * (indices.shape[1] if indices.ndim == 3 else 1))
    return indices.new_empty((rows, cols)), indices.new_empty((rows,))


def _t_cmp_into(indices_out, topk_length, indices):
    compactify_into(indices_out, topk_length, indices)


TORCH_OPS = {
    "dsa_local_to_global": ("(Tensor local_indices, int seqlen_k, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None) -> Tensor", _t_l2g, _f_l2g),
    "dsa_local_to_global_into": ("(Tensor(a!) global_indices, Tensor local_indices, int seqlen_k, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None) -> ()",
                                 _t_l2g_into, writes_only),
    "dsa_compactify": ("(Tensor indices) -> (Tensor, Tensor)", _t_cmp, _f_cmp),
    "dsa_compactify_into": ("(Tensor(a!) indices_out, Tensor(b!) topk_length, Tensor indices) -> ()", _t_cmp_into, writes_only),
}  # fmt: skip
