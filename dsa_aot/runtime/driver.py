"""The only module that talks to the CUDA driver (cuda-python). Every call goes through ``check``."""

from __future__ import annotations

import functools

from ..errors import LaunchError

__all__ = ["drv", "check"]


@functools.lru_cache(maxsize=1)
def drv():
    """cuda.bindings.driver, imported on first use (nothing happens at ``import dsa_aot``)."""
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
