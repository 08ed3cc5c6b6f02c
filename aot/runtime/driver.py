"""The only module that talks to the CUDA driver. Every call goes through ``check``.

Everything goes through cuda-python except the hot path's three calls (:func:`fast`): a launch through
``cuda.bindings.driver.cuLaunchKernelEx`` took 4.6 us on the H200's host, most of it converting Python
objects and building the result enum; the same driver function called through ctypes, on the config
struct cuda-python already holds (``CUlaunchConfig.getPtr()``), takes a fraction of that
(bench/host_floor.py prints both).
"""

from __future__ import annotations

import ctypes
import functools
import os

from ..errors import LaunchError

__all__ = ["drv", "check", "fast"]


@functools.lru_cache(maxsize=1)
def drv():
    """cuda.bindings.driver, imported on first use (nothing happens at ``import aot``)."""
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise LaunchError(f"cuda-python is not importable ({e}). Install it: pip install 'cuda-bindings>=12.8'") from None
    return driver


def check(result, what: str):
    """Unpack a cuda-python result tuple; raise LaunchError naming the call and the driver's error."""
    err = result[0]
    if int(err) != 0:
        d = drv()
        _, name = d.cuGetErrorName(err)
        _, desc = d.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else name
        desc = desc.decode() if isinstance(desc, bytes) else desc
        raise LaunchError(f"{what} failed: {name} ({desc})")
    return result[1] if len(result) == 2 else result[1:]


class _Fast:
    """cuLaunchKernelEx, cuMemsetD32Async and cuMemsetD8Async of the libcuda cuda-python loaded, through
    ctypes: plain ints in, the CUresult as an int out (0: success; :func:`check` it with ``drv().CUresult``).
    The per-thread-default-stream variants when cuda-python uses them (its own environment switch)."""

    def __init__(self):
        drv()
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:  # pragma: no cover - cuda-python loads the same library
            raise LaunchError(f"cannot load libcuda.so.1 ({e}); is the NVIDIA driver installed?") from None
        ptds = os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0")
        vp, u32, u64, size = ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint64, ctypes.c_size_t

        def fn(name, argtypes):
            f = getattr(lib, name + ("_ptsz" if ptds else ""))
            f.argtypes, f.restype = argtypes, ctypes.c_int
            return f

        self.launch = fn("cuLaunchKernelEx", (vp, vp, vp, vp))  # (CUlaunchConfig*, CUfunction, void** params, void** extra)
        self.memset32 = fn("cuMemsetD32Async", (u64, u32, size, vp))  # (CUdeviceptr, value, count, stream)
        self.memset8 = fn("cuMemsetD8Async", (u64, ctypes.c_ubyte, size, vp))


@functools.lru_cache(maxsize=1)
def fast() -> _Fast:
    """The hot path's driver calls (see the module docstring), loaded on first use."""
    return _Fast()
