"""A stand-in for the CUDA driver and for CUDA tensors, for CPU tests of the runtime and the ops.

Never the proof that a kernel runs (the GPU tests are); it lets CI drive the real ops, the real
runtime and the real lifted launchers end to end and see every driver call they make:

* :class:`Driver` answers the calls the runtime makes (as ``cuda.bindings.driver`` does, with its
  types) for ``devices`` fake GPUs (capability 9.0, 132 SMs): primary contexts and a per-thread
  current-context stack, streams that belong to a device, memsets and launches. A launch records the
  kernel, the grid/block/shared-memory/stream it was given, the device of the current context and the
  bytes of every parameter, read through the void** array at that moment (what the driver copies),
  and releases the GIL first, so other threads run in the middle of a call.
* :func:`cuda_tensor` makes a CPU tensor that presents as a CUDA tensor of a given device: the ops
  validate it and pass its (real, aligned) data pointer on.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
import time
from dataclasses import dataclass

import torch
from cuda.bindings import driver as real

CAPABILITY, SM_COUNT = (9, 0), 132


@dataclass
class Launch:
    kernel: str
    dims: tuple  # grid xyz, block xyz, shared memory, stream
    device: int  # the device of the context current at the launch
    params: bytes


class Driver:
    """The driver calls the runtime makes, recorded."""

    def __init__(self, devices=2, capability=CAPABILITY, sm_count=SM_COUNT):
        self.devices, self.capability, self.sm_count = devices, capability, sm_count
        self.launches: list[Launch] = []
        self.memsets: list[tuple] = []
        self.lock = threading.Lock()
        self.local = threading.local()
        self.streams = {}  # handle -> device
        self.kernels = {}  # handle -> (symbol, param sizes)
        self._next = 0x7000
        # the types cuda-python gives (and checks assignments to)
        for name in ("CUlaunchConfig", "CUlaunchAttribute", "CUlaunchAttributeID", "CUfunction", "CUdevice_attribute", "CUfunction_attribute",
                     "CUstream", "CUcontext"):
            setattr(self, name, getattr(real, name))

    # --- devices and contexts
    def ctx_of(self, dev):
        return real.CUcontext(0x1000 + dev)

    def dev_of(self, ctx):
        return int(ctx) - 0x1000

    def _stack(self):
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    def set_current(self, dev):
        """What torch.cuda.set_device does to the calling thread (None: no current context)."""
        stack = self._stack()
        stack[:] = [] if dev is None else [self.ctx_of(dev)]

    def cuInit(self, flags):
        return (0,)

    def cuDeviceGetCount(self):
        return (0, self.devices)

    def cuDeviceGet(self, i):
        return (0, i) if 0 <= i < self.devices else (101, None)  # CUDA_ERROR_INVALID_DEVICE

    def cuDeviceGetName(self, n, dev):
        return (0, f"stand-in GPU {dev}".encode())

    def cuDeviceGetAttribute(self, attr, dev):
        A = real.CUdevice_attribute
        return (0, {A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: self.capability[0], A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: self.capability[1],
                    A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: self.sm_count}.get(attr, 232448))

    def cuDevicePrimaryCtxRetain(self, dev):
        return (0, self.ctx_of(int(dev)))

    def cuCtxGetCurrent(self):
        stack = self._stack()
        return (0, stack[-1] if stack else real.CUcontext(0))

    def cuCtxGetDevice(self):
        stack = self._stack()
        return (0, self.dev_of(stack[-1])) if stack else (201, None)  # CUDA_ERROR_INVALID_CONTEXT

    def cuCtxPushCurrent(self, ctx):
        self._stack().append(ctx)
        return (0,)

    def cuCtxPopCurrent(self):
        return (0, self._stack().pop())

    # --- streams and memory
    def new_stream(self, dev) -> int:
        with self.lock:
            self._next += 0x10
            self.streams[self._next] = dev
            return self._next

    def cuStreamGetCtx(self, stream):
        dev = self.streams.get(int(stream))
        if dev is not None:
            return (0, self.ctx_of(dev))
        # measured on the H200: 2**64-1 -> CUDA_ERROR_INVALID_HANDLE; a made-up handle (0xdead0) crashes the process
        assert int(stream) == (1 << 64) - 1, f"cuStreamGetCtx({int(stream):#x}): the real driver would crash on a handle that is not a stream"
        return (400, None)

    def _current_device(self):
        stack = self._stack()
        return self.dev_of(stack[-1]) if stack else None

    def cuMemsetD32Async(self, ptr, value, n, stream):
        self.memsets.append((int(ptr), 4 * n, int(stream), self._current_device(), int(value)))
        return (0,)

    def cuMemsetD8Async(self, ptr, value, n, stream):
        self.memsets.append((int(ptr), n, int(stream), self._current_device(), int(value)))
        return (0,)

    # --- libraries and kernels
    def cuLibraryLoadData(self, data, *a):
        return (0, ("library", hashlib.sha256(bytes(data)).hexdigest()))

    def cuLibraryGetKernel(self, lib, sym):
        with self.lock:
            self._next += 0x10
            self.kernels[self._next] = (lib[1], sym.decode())
            return (0, self._next)

    def cuKernelGetAttribute(self, attr, kernel, dev):
        return (0, 0)

    def cuKernelSetAttribute(self, attr, value, kernel, dev):
        return (0,)

    def cuLaunchKernelEx(self, cfg, f, params_addr, extra):
        time.sleep(0)  # release the GIL in the middle of the call, as the real driver does
        cubin, symbol = self.kernels[int(f)]
        sizes = self.param_sizes[cubin, symbol]  # by cubin too: entries share kernel names with different parameters
        ptrs = (ctypes.c_void_p * max(1, len(sizes))).from_address(params_addr)
        data = b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))
        dims = (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ, cfg.sharedMemBytes, int(cfg.hStream))
        self.launches.append(Launch(symbol, dims, self._current_device(), data))
        return (0,)

    def cuGetErrorName(self, err):
        return (0, f"CUDA_ERROR_{int(err)}".encode())

    def cuGetErrorString(self, err):
        return (0, b"stand-in driver error")


def install(monkeypatch, index, devices=2, capability=CAPABILITY, sm_count=SM_COUNT) -> Driver:
    """Put a stand-in driver in place of cuda-python for the runtime (and its per-process caches):
    ``devices`` GPUs of ``capability`` (default 9.0, the H200's; (10, 0) for an SM100 build)."""
    from dsa_aot.runtime import device, driver, index as index_mod, loaded

    d = Driver(devices, capability, sm_count)
    d.param_sizes = {(e["sha256"], k): v for e in index.entries for k, v in e["params"].items()}
    for mod in (driver, device, loaded):
        monkeypatch.setattr(mod, "drv", lambda: d)
    monkeypatch.setattr(device, "_INFO", {})
    monkeypatch.setattr(device, "_CTX", {})
    monkeypatch.setattr(index_mod, "_INDEX", index)
    d.set_current(0)
    return d


def cuda_tensor(t: torch.Tensor, device: int = 0) -> torch.Tensor:
    """``t`` (CPU storage) presenting as a tensor on cuda:``device``."""
    cls = _CLASSES.get(device)
    if cls is None:

        class OnDevice(torch.Tensor):
            @property
            def is_cuda(self):
                return True

            @property
            def device(self):
                return torch.device("cuda", device)

            def get_device(self):
                return device

        cls = _CLASSES[device] = OnDevice
    return torch.Tensor._make_subclass(cls, t)


_CLASSES: dict = {}


def contents(t: torch.Tensor) -> bytes:
    """The bytes of a (stand-in CUDA) tensor's storage span."""
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())
