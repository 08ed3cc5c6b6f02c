"""dsa-aot: cuDNN frontend CuTe DSL kernels, compiled ahead of time, launched with cuda-python.

Importing ``aot`` does nothing but define names: ops load their cubins on first use (or at
``aot.runtime.preload()``). ``aot.csa`` holds the CSA compressor ops, ``aot.dsa`` the DeepSeek sparse
attention ops, ``aot.errors`` the exceptions (one root, :class:`aot.errors.AotError`), ``aot.policy``
the pure upstream rules both the build and the ops follow; ``import aot.library`` registers the ops
as ``torch.ops.dsa_aot.*``.

Layout by when code runs: ``aot.policy`` (pure), ``aot.ops`` and ``aot.runtime`` (run time),
``aot.toolchain`` (build time; in a source checkout only, the wheel does not ship it).
"""

__version__ = "0.1.0"

__all__ = ["csa", "dsa", "runtime", "errors", "policy", "library"]


def __getattr__(name):
    if name in __all__:
        import importlib

        return importlib.import_module(f"aot.{name}")
    raise AttributeError(f"module 'aot' has no attribute {name!r}")
