"""Run-time ops, one module per kernel family (``dsa_aot.ops.<family>``), with cudnn's signatures.

They import the policy and the runtime, never the toolchain, and do nothing at import (torch is
imported inside the calls). The public namespaces ``dsa_aot.csa`` and ``dsa_aot.dsa`` re-export them by the
family registry (:data:`dsa_aot.policy.families.FAMILIES`).
"""

__all__ = ["export"]


def export(namespace: str, into: dict) -> list:
    """Serve the public names of the op modules registered under ``namespace`` from the module whose globals
    are ``into`` (its ``__getattr__`` and ``__dir__``), each op module imported the first time one of its
    names is used: a fresh process that calls one op imports one op module (the nine DSA op modules took
    32-40 ms to import on the 2-core build machine, one 10 ms). Returns the names (its ``__all__``)."""
    import importlib

    from ..policy.families import FAMILIES

    owner: dict = {}
    for family, fam in FAMILIES.items():
        if fam.namespace == namespace:
            for n in fam.exports:
                if owner.setdefault(n, family) != family:
                    raise ImportError(f"dsa_aot.{namespace}: {n} is exported by dsa_aot.ops.{family} and by dsa_aot.ops.{owner[n]}")

    def __getattr__(name):
        family = owner.get(name)
        if family is None:
            raise AttributeError(f"module 'dsa_aot.{namespace}' has no attribute {name!r}")
        mod = importlib.import_module(f"dsa_aot.ops.{family}")
        for n in FAMILIES[family].exports:  # the module's names, bound here once
            into[n] = getattr(mod, n)
        return into[name]

    into["__getattr__"] = __getattr__
    into["__dir__"] = lambda: sorted(set(into) | set(owner))
    return list(owner)
