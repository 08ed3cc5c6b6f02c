"""The GPU side an op call shares: the device and arch it runs on, the shipped entries it resolves, the stream it
launches on, and torch work and allocations on that stream."""

from __future__ import annotations

import contextlib

from ..runtime import device as _device, driver as _driver, index as _index_mod  # modules: they do nothing at import
from .checks import input_error

__all__ = ["arch_of", "arch_or_refuse", "sm_count_of", "target_sm_count", "require", "launcher", "stream_handle", "alloc_on", "allocate",
           "alloc_failed", "max_lengths", "memset0", "cast_into"]


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
