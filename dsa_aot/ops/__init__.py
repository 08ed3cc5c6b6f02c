"""Run-time ops, one module per kernel family (``dsa_aot.ops.<family>``), with cudnn's signatures.

They import the policy and the runtime, never the toolchain, and do nothing at import (torch is
imported inside the calls). The public namespaces ``dsa_aot.csa`` and ``dsa_aot.dsa`` re-export them by the
family registry (:data:`dsa_aot.policy.families.FAMILIES`).
"""

__all__ = ["export"]


def export(namespace: str, into: dict) -> list:
    """Copy the public names of every op module registered under ``namespace`` into ``into``; return them."""
    import importlib

    from ..policy.families import FAMILIES

    names = []
    for family, fam in FAMILIES.items():
        if fam.namespace == namespace:
            mod = importlib.import_module(f"dsa_aot.ops.{family}")
            for n in mod.__all__:
                if n in into and into[n] is not getattr(mod, n):
                    raise ImportError(f"dsa_aot.{namespace}: {n} is exported by dsa_aot.ops.{family} and by another family's op module")
                into[n] = getattr(mod, n)
            names += mod.__all__
    return names
