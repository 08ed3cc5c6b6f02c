"""What the op modules share: per-device state, stream handles, input validation, allocation."""

from __future__ import annotations

# --- device state ------------------------------------------------------------------------------------


class _DevState:
    __slots__ = ("arch", "sm_count", "cap")

    def __init__(self, dev):
        import torch

        from .runtime.registry import device_arches

        props = torch.cuda.get_device_properties(dev)
        self.cap = (props.major, props.minor)
        self.sm_count = props.multi_processor_count
        have = _index().arches
        ok = [a for a in device_arches(self.cap) if a in have]
        if not ok:
            from .errors import ArchMismatchError

            raise ArchMismatchError(
                f"GPU {dev} ({props.name}, compute capability {self.cap[0]}.{self.cap[1]}) has no cubins in this build "
                f"(the build has: {', '.join(have)}). Add a [[target]] for it to the manifest and rebuild"
            )
        self.arch = ok[0]


_STATES: dict = {}


def _state(dev) -> _DevState:
    s = _STATES.get(dev)
    if s is None:
        s = _STATES[dev] = _DevState(dev)
    return s


def _index():
    from .runtime.registry import index

    return index()


_raw_stream = None


def _stream_int(stream) -> int:
    """A torch.cuda.Stream, a cuda-python CUstream or a raw handle -> the raw handle."""
    return stream.cuda_stream if hasattr(stream, "cuda_stream") else int(stream)


def _stream_handle(stream, dev):
    global _raw_stream
    if stream is not None:
        return _stream_int(stream)
    if _raw_stream is None:
        import torch

        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _raw_stream(dev)


# --- validation (collect every problem, raise once, before anything is touched) ----------------------


def _check(problems, t, name, shape, dtype, dev, align):
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


def _overlapping(workspace, need, tensors):
    """Indices of the tensors (None allowed) whose bytes overlap the first ``need`` bytes of workspace."""
    w0 = workspace.data_ptr()
    w1 = w0 + need
    return [i for i, t in enumerate(tensors) if t is not None and t.numel() and w0 < t.data_ptr() + t.numel() * t.element_size() and t.data_ptr() < w1]


def _input_error(problems):
    from .errors import InputError

    return InputError(f"{len(problems)} invalid input(s), nothing was launched:\n" + "\n".join(f"  - {p}" for p in problems))


def _alloc_on(stream):
    """Make ``stream`` (None: leave the current one) torch's current stream: allocations and the torch
    ops of a wrapper (casts, zeroing) then follow the kernels launched on it.

    A raw handle is not wrapped blindly: ``torch.cuda.ExternalStream(0)`` does not name the legacy
    default stream, it hands back an unrelated stream (measured on the H200, torch 2.11), and a cast
    queued there raced the GEMM it was meant to follow.
    """
    import contextlib

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
