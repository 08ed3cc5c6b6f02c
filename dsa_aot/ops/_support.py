"""What the op modules share: the device and arch a call runs on, lookups, streams, input validation,
allocation, and the host-argument forms of tensors the lifted launchers take."""

from __future__ import annotations

import contextlib
import numbers

from ..errors import InputError
from ..runtime import device as _device, driver as _driver, index as _index_mod  # modules: they do nothing at import

__all__ = [
    "arch_of", "arch_or_refuse", "sm_count_of", "target_sm_count", "require", "launcher", "lookup",  # devices and entries
    "stream_handle", "alloc_on", "allocate", "memset0",  # streams and memory
    "check", "scalar_f32", "integer", "one_of", "flag", "aliasing", "overlapping", "input_error", "block_scales",  # validation
    "signature", "footprint", "recheck", "recheck_ptrs",  # the fast paths
    "writes_only",  # torch.library fakes
    "cast_into", "f32_scalar",  # steps two families share: the fp32 -> bf16 cast out of a workspace, a plan's fp32 scalar
    "tensor_args", "flat_args", "row_major", "cute_args",  # host-function arguments
]  # fmt: skip


# --- device, arch, entries ---------------------------------------------------------------------------


def _index():
    return _index_mod.index()


def arch_of(dev: int) -> str:
    """The arch of the build's cubins GPU ``dev`` runs (ArchMismatchError, naming what to add, otherwise)."""
    return _index().arch_for(dev)


def sm_count_of(dev: int) -> int:
    return _device.device(dev).sm_count


def arch_or_refuse(problems, dev: int):
    """(arch, whether it is an SM100-family arch) of GPU ``dev``; (None, False) with the problem
    appended when the build has no cubins for it."""
    from ..errors import ArchMismatchError
    from ..policy.arch import is_sm100

    try:
        arch = arch_of(dev)
    except ArchMismatchError as e:
        problems.append(str(e))
        return None, False
    return arch, is_sm100(arch)


def target_sm_count(dev: int) -> int:
    """The SM count GPU ``dev``'s cubins of the ops that bake it in were built for (persistent grids): the
    GPU's own; ArchMismatchError naming the [[target]] to add when the build has no such target."""
    return _index().target_sm_count(arch_of(dev), sm_count_of(dev))


def _find(ix, family, op, key, dev, hint=""):
    """The entry of (family, op, key) for GPU ``dev``: its arch, then the target of its SM count (the
    nearest, for an op whose family's policy says its cubins do not depend on it)."""
    from ..policy.families import family_policy

    return ix.find(family, op, key, arch_of(dev), hint, sms=sm_count_of(dev), exact=op in family_policy(family).SM_COUNT_OPS)


def require(family: str, kernels: dict, dev: int, hints=None) -> None:
    """Check that the build ships an entry for every (op, key) of ``kernels`` (role -> (op, key)) on GPU
    ``dev``: KernelNotFoundError / ArchMismatchError naming what to add, before anything is allocated."""
    ix = _index()
    for role, (op, key) in kernels.items():
        _find(ix, family, op, key, dev, (hints or {}).get(role, ""))


def launcher(family: str, op: str, key: dict, dev: int, hint: str = ""):
    """The entry serving (family, op, key) on GPU ``dev``, loaded there: call it with the host function's arguments.

    ``.entry`` is its index record (derived key fields included)."""
    ix = _index()
    return ix.loaded(_find(ix, family, op, key, dev, hint), dev)


# --- streams --------------------------------------------------------------------------------------------

_raw_stream = None
_U64 = (1 << 64) - 1


def _stream_int(stream):
    """A torch.cuda.Stream (-> (handle, its device)), a cuda-python CUstream or a raw int handle (-> (handle, None));
    None for anything else."""
    if hasattr(stream, "cuda_stream") and hasattr(stream, "device"):
        return stream.cuda_stream, getattr(stream.device, "index", None)
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream, None
    if type(stream).__name__ == "CUstream":  # cuda.bindings.driver.CUstream
        return int(stream), None
    return None


def stream_handle(stream, dev: int) -> int:
    """The raw handle kernels go to: ``stream`` (checked: a stream of GPU ``dev``), or torch's current
    stream of ``dev`` when None. InputError before anything runs otherwise.

    A raw handle's device is asked of the driver (cuStreamGetCtx), which trusts it to be a live stream,
    as a launch on it would: on the H200 a made-up handle (0xdead0, 3) crashed the process there, while
    2**64-1 came back CUDA_ERROR_INVALID_HANDLE. Range and type are checked here; liveness cannot be."""
    global _raw_stream
    if stream is None:
        if _raw_stream is None:
            import torch

            _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (lambda d: torch.cuda.current_stream(d).cuda_stream)
        return _raw_stream(dev)
    got = _stream_int(stream)
    if got is None or not 0 <= got[0] <= _U64:
        raise input_error([f"stream={stream!r} (expected None, a torch.cuda.Stream, a cuda-python CUstream or a raw stream handle)"])
    handle, sdev = got
    if sdev is not None:
        if sdev != dev:
            raise input_error([f"stream: a stream of cuda:{sdev}, but the tensors are on cuda:{dev} (use a stream of cuda:{dev})"])
        return handle
    if not _device.stream_on(handle, dev):
        raise input_error([f"stream=0x{handle:x}: not a stream of cuda:{dev}, the tensors' device (another device's stream, or not a live stream)"])
    return handle


_NO_SWITCH = contextlib.nullcontext()


def alloc_on(stream, dev: int):
    """Make ``stream`` (None: torch's current stream of GPU ``dev``) torch's current stream, on ``dev``:
    allocations and the torch ops of a wrapper (casts, zeroing) then follow the kernels launched on it,
    whatever the current device. (``stream`` was checked by :func:`stream_handle`.)

    A raw handle is not wrapped blindly: ``torch.cuda.ExternalStream(0)`` does not name the legacy
    default stream, it hands back an unrelated stream (measured on the H200, torch 2.11), and a cast
    queued there raced the GEMM it was meant to follow.
    """
    import torch

    if stream is None:  # no device switch when the current device is already the tensors'
        return _NO_SWITCH if torch.cuda.current_device() == dev else torch.cuda.device(dev)
    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    handle = _stream_int(stream)[0]
    if torch.cuda.current_stream(dev).cuda_stream == handle:
        return torch.cuda.device(dev)
    if handle == 0:
        return torch.cuda.stream(torch.cuda.default_stream(dev))
    return torch.cuda.stream(torch.cuda.ExternalStream(handle, device=torch.device("cuda", dev)))


# --- validation (collect every problem, raise once, before anything is touched) ----------------------


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


def lookup(cache: dict, key):
    """``cache.get(key)``, None for an unhashable key (the full validation then says what is wrong)."""
    try:
        return cache.get(key) if key is not None else None
    except TypeError:
        return None


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


def max_lengths(cu_q, cu_k, max_q, max_k, stream):
    """The longest THD segments where the caller gave none, read back as upstream's wrappers do (a
    synchronisation); an InputError under graph capture."""
    import torch

    def ok(t):
        return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.is_cuda and t.dtype == torch.int32 and t.ndim == 1 and t.numel() >= 1

    if not (ok(cu_q) and ok(cu_k)):
        return max_q, max_k  # the validation says what is wrong
    if torch.cuda.is_current_stream_capturing():
        raise input_error(["under CUDA-graph capture pass max_seqlen_q and max_seqlen_k: reading them from cu_seqlens_q / cu_seqlens_k needs a "
                           "device synchronisation (upstream's .item())"])
    with alloc_on(stream, cu_q.device.index):
        got = [int((c[1:] - c[:-1]).max().item()) if c.numel() > 1 else 0 for c in (cu_q, cu_k)]
    return (got[0] if max_q is None else max_q), (got[1] if max_k is None else max_k)


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


def footprint(ts, writes, masks=None, sizes=None) -> list:
    """What a cached validation keeps so that :func:`recheck` can redo the per-call checks on integers:
    each tensor's byte size (None: 0; ``sizes`` {index: bytes} overrides, e.g. the workspace bytes
    used), its alignment mask (default 15), the indices of the tensors the op writes, and the last
    pointers that passed (the validated call's own)."""
    nbytes = [0 if t is None else t.numel() * t.element_size() for t in ts]
    for i, n in (sizes or {}).items():
        if ts[i] is not None:
            nbytes[i] = n
    return [tuple(nbytes), tuple(masks or (15,) * len(ts)), tuple(writes), tuple(0 if t is None else t.data_ptr() for t in ts)]


def recheck(ts, foot):
    """The checks a call's signature does not prove, made per call on its data pointers (see
    :func:`recheck_ptrs`): the pointers of ``ts`` when they pass, else None."""
    return recheck_ptrs(tuple([0 if t is None else t.data_ptr() for t in ts]), foot)


def recheck_ptrs(ptrs, foot):
    """``ptrs`` (a call's data pointers, 0 for an absent tensor) when each is aligned to its mask and no
    written tensor overlaps another's bytes; else None (the full validation then runs and says what is
    wrong). ``foot``: from :func:`footprint` at validation.

    The same pointers as the last call that passed (a training loop's usual case) pass at once: sizes,
    masks and pointers are all the checks read. Threads may race on that memo; it only ever holds a
    tuple that passed."""
    nbytes, masks, writes, last = foot
    if ptrs == last:
        return ptrs
    for p, m in zip(ptrs, masks):
        if p & m:
            return None
    for i in writes:
        a0, n = ptrs[i], nbytes[i]
        if n:
            a1 = a0 + n
            for j, b0 in enumerate(ptrs):
                if j != i and nbytes[j] and b0 < a1 and a0 < b0 + nbytes[j]:
                    return None
    foot[3] = ptrs
    return ptrs


def input_error(problems):
    e = InputError(f"{len(problems)} invalid input(s), nothing was launched:\n" + "\n".join(f"  - {p}" for p in problems))
    e.problems = list(problems)  # a composite op adds its own to a part's (dsa_aot.dsa.sparse_attention)
    return e


def signature(ts, extra):
    """What full validation of a call depends on, except data pointers and per-call scalars: (type,
    shape, dtype, device, layout, contiguity) per tensor (None allowed) plus ``extra``; None when an
    argument is not a tensor (the full validation reports it)."""
    try:
        # scalars keyed with their type: 2.0 == 2 and True == 1 hash alike, and are not the same argument
        return tuple(None if t is None else (type(t), t.shape, t.dtype, t.device, t.layout, t.is_contiguous()) for t in ts) + tuple(
            (type(x), x) for x in extra)
    except (AttributeError, RuntimeError, TypeError):
        return None


# --- host-function arguments ---------------------------------------------------------------------------


def row_major(shape) -> list:
    """Strides of a compact row-major buffer of ``shape``."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return stride[::-1]


def tensor_args(t, ptr):
    """A contiguous tensor as the JIT host code takes it: pointer (``ptr``: the tensor's, as a plan
    records it), extents (i32), every stride but the unit innermost one (i64)."""
    return (ptr, *t.shape, *t.stride()[:-1])


def flat_args(ptr, shape):
    """A device pointer viewed as a compact row-major ``shape``, in the form of :func:`tensor_args`."""
    return (ptr, *shape, *row_major(shape)[:-1])


def cute_args(ptr, shape, dynamic, fully_dynamic=False):
    """A row-major buffer as a compiled host function takes it: pointer, its dynamic extents (the modes
    in ``dynamic``), then its dynamic strides: every stride but the unit one when the tensor type is
    fully dynamic (wide mode), else those that span a dynamic extent (compact types)."""
    stride = row_major(shape)
    last = max(dynamic, default=-1)
    strides = [stride[i] for i in range(len(shape) - 1) if fully_dynamic or i < last]
    return (ptr, *(shape[i] for i in dynamic), *strides)


def memset0(ptr, nbytes, stream, dev, word=0):
    """Fill ``nbytes`` at device address ``ptr`` of GPU ``dev`` on ``stream`` with zeros, or with the
    32-bit ``word`` repeated (``nbytes`` a multiple of 4; e.g. 0xFF800000, fp32 -inf)."""
    if nbytes:
        d = _driver.drv()
        pushed = _device.push_if_needed(dev)
        try:
            words = nbytes % 4 == 0
            err = (d.cuMemsetD32Async(ptr, word, nbytes // 4, stream) if words else d.cuMemsetD8Async(ptr, 0, nbytes, stream))[0]
            if err:
                _driver.check((err,), "cuMemsetD32Async" if words else "cuMemsetD8Async")
        finally:
            if pushed:
                d.cuCtxPopCurrent()


def cast_into(d_index_k, workspace, shape, stream, dev, offset=0):
    """The trailing fp32 -> bf16 cast upstream does with torch, on the launch stream (``stream`` is
    the caller's argument: None means torch's current stream of ``dev``, which is where the kernels went
    and where torch runs an op on ``dev``'s tensors whatever the current device: no switch needed)."""
    import torch

    n = shape[0] * shape[1] * shape[2]
    acc = None
    if offset % 4 == 0:  # the fewest torch ops (each is ~1 µs of host time)
        try:  # view(dtype) needs the workspace's size and storage offset in whole fp32s
            acc = workspace.view(torch.float32)[offset // 4 : offset // 4 + n]
        except RuntimeError:
            pass
    if acc is None:
        acc = workspace[offset : offset + 4 * n].view(torch.float32)
    if stream is None:
        d_index_k.view(-1).copy_(acc)
    else:
        with alloc_on(stream, dev):
            d_index_k.view(-1).copy_(acc)


def f32_scalar(name, v) -> tuple:
    """``(v,)``: the one per-call fp32 scalar of a plan (InputError unless :func:`scalar_f32` accepts it)."""
    problems = []
    x = scalar_f32(problems, name, v)
    if problems:
        raise input_error(problems)
    return (x,)


def allocate(fn):
    """Run ``fn()`` (torch allocations of an op's outputs / workspace); a failed allocation is an aot error."""
    import torch

    try:
        return fn()
    except (torch.OutOfMemoryError, RuntimeError) as e:
        raise alloc_failed(e) from None


def alloc_failed(e):
    """The aot error for a failed allocation of an op's outputs or workspace (``e``: torch's)."""
    from ..errors import OutOfMemoryError

    return OutOfMemoryError(f"allocating the op's outputs or workspace failed ({str(e).splitlines()[0][:200]}); nothing was launched. "
                            f"Pass preallocated outputs to the *_into form, or free memory")


def writes_only(*args, **kwargs):
    """The torch.library fake of an ``_into`` op: it returns nothing (its schema marks what it writes)."""
    return None
