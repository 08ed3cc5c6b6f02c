"""What the op modules share: the device and arch a call runs on, lookups, streams, input validation,
allocation, and the host-argument forms of tensors the lifted launchers take."""

from __future__ import annotations

import contextlib

from ..errors import InputError

__all__ = [
    "arch_of", "sm_count_of", "target_sm_count", "launcher", "stream_handle", "check", "overlapping", "overlaps_rest", "misaligned", "input_error",
    "alloc_on",
    "signature", "tensor_args", "flat_args", "row_major", "cute_args", "memset0",
]  # fmt: skip


# --- device, arch, entries ---------------------------------------------------------------------------


def _index():
    from ..runtime.index import index

    return index()


def arch_of(dev: int) -> str:
    """The arch of the build's cubins GPU ``dev`` runs (ArchMismatchError, naming what to add, otherwise)."""
    return _index().arch_for(dev)


def sm_count_of(dev: int) -> int:
    from ..runtime.device import device

    return device(dev).sm_count


def target_sm_count(arch: str) -> int:
    """The SM count the build's target for ``arch`` declared (persistent grids are baked with it)."""
    return _index().target_sm_count(arch)


def launcher(family: str, op: str, key: dict, dev: int, hint: str = ""):
    """The entry serving (family, op, key) on GPU ``dev``, loaded there: call it with the host function's arguments.

    ``.entry`` is its index record (derived key fields included)."""
    ix = _index()
    return ix.loaded(ix.find(family, op, key, arch_of(dev), hint), dev)


# --- streams --------------------------------------------------------------------------------------------

_raw_stream = None


def _stream_int(stream) -> int:
    """A torch.cuda.Stream, a cuda-python CUstream or a raw handle -> the raw handle."""
    return stream.cuda_stream if hasattr(stream, "cuda_stream") else int(stream)


def stream_handle(stream, dev: int) -> int:
    """The raw handle kernels go to: ``stream``, or torch's current stream of ``dev`` when None."""
    global _raw_stream
    if stream is not None:
        return _stream_int(stream)
    if _raw_stream is None:
        import torch

        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _raw_stream(dev)


def alloc_on(stream):
    """Make ``stream`` (None: leave the current one) torch's current stream: allocations and the torch
    ops of a wrapper (casts, zeroing) then follow the kernels launched on it.

    A raw handle is not wrapped blindly: ``torch.cuda.ExternalStream(0)`` does not name the legacy
    default stream, it hands back an unrelated stream (measured on the H200, torch 2.11), and a cast
    queued there raced the GEMM it was meant to follow.
    """
    import torch

    if stream is None:
        return contextlib.nullcontext()
    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    handle = _stream_int(stream)
    if torch.cuda.current_stream().cuda_stream == handle:
        return contextlib.nullcontext()
    if handle == 0:
        return torch.cuda.stream(torch.cuda.default_stream())
    return torch.cuda.stream(torch.cuda.ExternalStream(handle))


# --- validation (collect every problem, raise once, before anything is touched) ----------------------


def check(problems, t, name, shape, dtype, dev, align):
    """Append to ``problems`` what is wrong with tensor ``t`` against the expected shape, dtype, device,
    contiguity and base alignment."""
    import torch

    if not isinstance(t, torch.Tensor):
        problems.append(f"{name}: got {type(t).__name__} (expected a torch.Tensor)")
        return
    if tuple(t.shape) != tuple(shape):
        problems.append(f"{name}: shape {tuple(t.shape)} (expected {tuple(shape)})")
    if t.dtype != dtype:
        problems.append(f"{name}: dtype {t.dtype} (expected {dtype})")
    if t.device.type != "cuda" or (dev is not None and t.device.index != dev):
        problems.append(f"{name}: on {t.device} (expected cuda:{dev}, the device of the first input)")
    if not t.is_contiguous():
        problems.append(f"{name}: strides {tuple(t.stride())} (expected contiguous; call .contiguous())")
    if t.data_ptr() % align:
        problems.append(f"{name}: data pointer 0x{t.data_ptr():x} is not {align}-byte aligned (expected a {align}-byte aligned base; clone() the tensor)")


def overlapping(workspace, need, tensors):
    """Indices of the tensors (None allowed) whose bytes overlap the first ``need`` bytes of workspace."""
    w0 = workspace.data_ptr()
    w1 = w0 + need
    return [i for i, t in enumerate(tensors) if t is not None and t.numel() and w0 < t.data_ptr() + t.numel() * t.element_size() and t.data_ptr() < w1]


def overlaps_rest(workspace, need, ts):
    """Fast-path re-check: do the first ``need`` bytes of ``workspace`` (the last of ``ts``) overlap the others?"""
    return bool(overlapping(workspace, need, ts[:-1]))


def misaligned(ts, mask=15):
    """Whether any tensor of ``ts`` (None allowed) has a data pointer with a bit of ``mask`` set."""
    return any(t is not None and t.data_ptr() & mask for t in ts)


def input_error(problems):
    return InputError(f"{len(problems)} invalid input(s), nothing was launched:\n" + "\n".join(f"  - {p}" for p in problems))


def signature(ts, extra):
    """What full validation of a call depends on, except data pointers: (shape, dtype, device,
    contiguity) per tensor (None allowed) plus ``extra``; None when an argument is not a tensor."""
    try:
        return tuple(None if t is None else (t.shape, t.dtype, t.get_device(), t.is_contiguous()) for t in ts) + extra
    except AttributeError:  # not tensors: the full validation reports them
        return None


# --- host-function arguments ---------------------------------------------------------------------------


def row_major(shape) -> list:
    """Strides of a compact row-major buffer of ``shape``."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return stride[::-1]


def tensor_args(t):
    """A contiguous tensor as the JIT host code takes it: pointer, extents (i32), every stride but the
    unit innermost one (i64)."""
    return (t.data_ptr(), *t.shape, *t.stride()[:-1])


def flat_args(t, shape):
    """A contiguous tensor (or a raw device pointer) viewed as a compact row-major ``shape``, in the
    form of :func:`tensor_args`."""
    return (t if isinstance(t, int) else t.data_ptr(), *shape, *row_major(shape)[:-1])


def cute_args(ptr, shape, dynamic, fully_dynamic=False):
    """A row-major buffer as a compiled host function takes it: pointer, its dynamic extents (the modes
    in ``dynamic``), then its dynamic strides: every stride but the unit one when the tensor type is
    fully dynamic (wide mode), else those that span a dynamic extent (compact types)."""
    stride = row_major(shape)
    last = max(dynamic, default=-1)
    strides = [stride[i] for i in range(len(shape) - 1) if fully_dynamic or i < last]
    return (ptr, *(shape[i] for i in dynamic), *strides)


def memset0(ptr, nbytes, stream):
    """Zero ``nbytes`` at device address ``ptr`` on ``stream`` (32-bit words when they fit)."""
    from ..runtime.driver import check as ok, drv

    if nbytes:
        d = drv()
        if nbytes % 4 == 0:
            ok(d.cuMemsetD32Async(ptr, 0, nbytes // 4, stream), "cuMemsetD32Async")
        else:
            ok(d.cuMemsetD8Async(ptr, 0, nbytes, stream), "cuMemsetD8Async")
