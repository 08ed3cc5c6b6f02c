"""The ops as PyTorch custom ops: ``torch.ops.dsa_aot.<name>``, declared by each family's op module.

Each op module lists ``TORCH_OPS = {name: (schema, impl, fake)}``: the schema (what the op mutates is
annotated, so functionalization and ``torch.compile`` know it), the implementation (the module's own
function, on torch's current stream) and the fake (output shapes for fake / meta tensors, so the op
traces under ``torch.compile(fullgraph=True)`` and shape propagation). :func:`register` registers
every registered family's ops once per process; ``import aot.library`` calls it.
"""

from __future__ import annotations

import importlib
import threading

__all__ = ["NAMESPACE", "register", "declarations"]

NAMESPACE = "dsa_aot"
_LOCK = threading.Lock()
_LIB = None


def declarations() -> dict:
    """{name: (schema, impl, fake)} of every registered family's op module."""
    from ..policy.families import FAMILIES

    out = {}
    for family in FAMILIES:
        for name, decl in getattr(importlib.import_module(f"aot.ops.{family}"), "TORCH_OPS", {}).items():
            if name in out:
                raise ImportError(f"torch op {NAMESPACE}::{name} is declared by aot.ops.{family} and by another family")
            out[name] = decl
    return out


def register() -> list:
    """Register every op under ``torch.ops.dsa_aot`` (once per process); return their names."""
    global _LIB
    with _LOCK:
        if _LIB is None:
            import torch

            lib = torch.library.Library(NAMESPACE, "DEF")
            for name, (schema, impl, fake) in declarations().items():
                lib.define(name + schema)
                # CPU too: a CPU tensor reaches the op's own validation (InputError), not a missing kernel
                lib.impl(name, impl, "CUDA")
                lib.impl(name, impl, "CPU")
                torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
            _LIB = lib
        return sorted(declarations())
