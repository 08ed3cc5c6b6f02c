"""dsa-aot: cuDNN frontend CuTe DSL kernels, compiled ahead of time, launched with cuda-python.

Importing ``dsa_aot`` does nothing but define names: ops load their cubins on first use (or at
``dsa_aot.runtime.preload()``). ``dsa_aot.csa`` holds the CSA compressor ops, ``dsa_aot.dsa`` the DeepSeek sparse
attention ops, ``dsa_aot.errors`` the exceptions (one root, :class:`dsa_aot.errors.AotError`), ``dsa_aot.policy``
the pure upstream rules both the build and the ops follow; ``import dsa_aot.library`` registers the ops
as ``torch.ops.dsa_aot.*``.

Layout by when code runs: ``dsa_aot.policy`` (pure), ``dsa_aot.ops`` and ``dsa_aot.runtime`` (run time),
``dsa_aot.toolchain`` (build time; in a source checkout only, the wheel does not ship it).
"""

__version__ = "0.1.0"

__all__ = ["csa", "dsa", "runtime", "errors", "policy", "library"]


def __getattr__(name):
    if name in __all__:
        import importlib

        return importlib.import_module(f"dsa_aot.{name}")
    raise AttributeError(f"module 'dsa_aot' has no attribute {name!r}")
