"""dsa-aot: cuDNN frontend CuTe DSL kernels, compiled ahead of time, launched with cuda-python.

Importing ``aot`` does nothing but define names: ops load their cubins on first use (or at
``aot.runtime.preload()``). ``aot.csa`` holds the CSA compressor ops.
"""

__version__ = "0.1.0"

from . import errors  # noqa: F401  (stdlib only)

__all__ = ["csa", "runtime", "errors"]


def __getattr__(name):
    if name in ("csa", "runtime"):
        import importlib

        return importlib.import_module(f"aot.{name}")
    raise AttributeError(name)
