"""Devices as the runtime sees them: an index, its compute capability and SM count, and its arch.

Read through the driver (cuda-python), once per device; nothing here imports torch.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from ..errors import ArchMismatchError, InputError
from ..policy.arch import best_arch
from .driver import check, drv

__all__ = ["Device", "device_index", "device"]


class Device(NamedTuple):  # not a frozen dataclass: that is built with exec at import, on every first call
    index: int
    name: str
    capability: tuple
    sm_count: int


def device_index(dev) -> int:
    """None (the current CUDA device), an int, ``'cuda'`` / ``'cuda:N'`` or a torch.device -> N."""
    if dev is None:
        return _current()
    if isinstance(dev, bool):
        raise InputError(f"device={dev!r} (expected None, an int, 'cuda:N' or a torch.device)")
    if isinstance(dev, int):
        return dev
    text = str(dev)
    if text == "cuda":
        return _current()
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise InputError(f"device={dev!r} (expected None, an int, 'cuda:N' or a torch.device)")


def _current() -> int:
    d = drv()
    check(d.cuInit(0), "cuInit")
    err, dev = d.cuCtxGetDevice()
    return int(dev) if int(err) == 0 else 0  # no current context: device 0, as torch's default


_INFO: dict = {}
_LOCK = threading.Lock()


def device(index: int) -> Device:
    """What the runtime needs to know of GPU ``index`` (cached)."""
    info = _INFO.get(index)
    if info is None:
        with _LOCK:
            info = _INFO.get(index)
            if info is None:
                info = _INFO[index] = _query(index)
    return info


def _query(index: int) -> Device:
    d = drv()
    check(d.cuInit(0), "cuInit")
    count = check(d.cuDeviceGetCount(), "cuDeviceGetCount")
    if not 0 <= index < count:
        raise InputError(f"device {index}: this machine has {count} CUDA device(s)")
    dev = check(d.cuDeviceGet(index), "cuDeviceGet")
    A = d.CUdevice_attribute
    major = check(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute")
    minor = check(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute")
    sms = check(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "cuDeviceGetAttribute")
    name = check(d.cuDeviceGetName(64, dev), "cuDeviceGetName")
    name = name.split(b"\0")[0].decode(errors="replace") if isinstance(name, bytes) else str(name)
    return Device(index, name, (int(major), int(minor)), int(sms))


def arch_of(info: Device, available) -> str:
    """The build's best arch for this GPU; ArchMismatchError (what the build has, what to add) otherwise."""
    arch = best_arch(info.capability, available)
    if arch is None:
        cap = f"{info.capability[0]}.{info.capability[1]}"
        raise ArchMismatchError(
            f"GPU {info.index} ({info.name}, compute capability {cap}) has no cubins in this build (the build has: "
            f"{', '.join(sorted(available)) or 'nothing'}). Add a [[target]] for it to the manifest and rebuild"
        )
    return arch


_CTX: dict = {}


def primary_context(index: int):
    """The primary context of GPU ``index`` (retained once per process, as torch's)."""
    ctx = _CTX.get(index)
    if ctx is None:
        device(index)  # initialises the driver and checks the index (outside the lock: it takes it too)
        with _LOCK:
            ctx = _CTX.get(index)
            if ctx is None:
                d = drv()
                ctx = _CTX[index] = check(d.cuDevicePrimaryCtxRetain(check(d.cuDeviceGet(index), "cuDeviceGet")), "cuDevicePrimaryCtxRetain")
    return ctx


def push_if_needed(index: int) -> bool:
    """Make GPU ``index``'s primary context current in this thread if another is; True when it was
    pushed (the caller pops it: ``cuCtxPopCurrent``). The cheap form of :class:`on_device` for hot paths."""
    ctx = _CTX.get(index)
    if ctx is None:
        ctx = primary_context(index)
    d = drv()
    if int(d.cuCtxGetCurrent()[1]) == int(ctx):
        return False
    check(d.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    return True


class on_device:
    """Make GPU ``index``'s primary context current in this thread for a block (pushed only when another is)."""

    __slots__ = ("ctx", "pushed")

    def __init__(self, index: int):
        self.ctx = primary_context(index)

    def __enter__(self):
        d = drv()
        _, cur = d.cuCtxGetCurrent()
        self.pushed = int(cur) != int(self.ctx)
        if self.pushed:
            check(d.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        return self

    def __exit__(self, *exc):
        if self.pushed:
            drv().cuCtxPopCurrent()
        return False


# Handles every context understands as "this context's default stream": the legacy and per-thread defaults.
DEFAULT_STREAMS = (0, 1, 2)


def stream_on(handle: int, index: int) -> bool:
    """Whether raw stream ``handle`` can carry work for GPU ``index``: a default-stream handle, or a stream
    of that device's primary context. False for a stream of another device or a handle the driver rejects.
    ``handle`` must be a live stream or a default-stream handle: the driver dereferences it."""
    if handle in DEFAULT_STREAMS:
        return True
    d = drv()
    err, ctx = d.cuStreamGetCtx(d.CUstream(handle))
    return int(err) == 0 and int(ctx) == int(primary_context(index))
