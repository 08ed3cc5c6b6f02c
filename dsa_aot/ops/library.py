"""The ops as PyTorch custom ops: ``torch.ops.dsa_aot.<name>``, declared by each family's op module.

Each op module lists ``TORCH_OPS = {name: (schema, impl, fake[, autograd])}``: the schema (what the
op mutates is annotated, so functionalization and ``torch.compile`` know it), the implementation (the
module's own function, on torch's current stream), the fake (output shapes for fake / meta tensors, so
the op traces under ``torch.compile(fullgraph=True)`` and shape propagation) and, for a differentiable
op, ``(setup_context, backward)``: its autograd formula (``torch.library.register_autograd``).
:func:`register` registers every registered family's ops once per process; ``import dsa_aot.library``
calls it, and so does the first :func:`call` of a differentiable op.
"""

from __future__ import annotations

import importlib
import re
import threading

__all__ = ["NAMESPACE", "register", "declarations", "call"]

NAMESPACE = "dsa_aot"
_LOCK = threading.Lock()
_LIB = None
_OPS: dict = {}  # name -> torch.ops.dsa_aot.<name>, once registered
_NAMES: list = []  # every registered op's name, sorted
_TYPE_ERROR = re.compile(r"Expected a value of type '([^']+)' for argument '(\w+)' but instead found type '(\w+)'")


def declarations() -> dict:
    """{name: (schema, impl, fake[, (setup_context, backward)])} of every registered family: its declared ops with an
    allocating form (both forms, ``<namespace>_<op>`` and ``..._into``) and its op module's own ``TORCH_OPS`` (composites)."""
    from ..policy.families import FAMILIES
    from . import declare

    out = {}
    for family, fam in FAMILIES.items():
        mod = importlib.import_module(f"dsa_aot.ops.{family}")
        decls = dict(getattr(mod, "TORCH_OPS", {}))
        for op in declare.OPS:
            if op.family == family and op.alloc_sig is not None and op.made is not None:
                decls |= op.torch_ops(fam.namespace, *op.made)
        for name, decl in decls.items():
            if name in out:
                raise ImportError(f"torch op {NAMESPACE}::{name} is declared by dsa_aot.ops.{family} and by another family")
            out[name] = decl
    return out


def register() -> list:
    """Register every op under ``torch.ops.dsa_aot`` (once per process); return their names."""
    global _LIB
    with _LOCK:
        if _LIB is None:
            import torch

            lib = torch.library.Library(NAMESPACE, "DEF")
            decls = declarations()  # (each declared op's schemas are derived here: once)
            for name, (schema, impl, fake, *autograd) in decls.items():
                lib.define(name + schema)
                # CPU too: a CPU tensor reaches the op's own validation (InputError), not a missing kernel
                lib.impl(name, impl, "CUDA")
                lib.impl(name, impl, "CPU")
                torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
                if autograd:
                    setup_context, backward = autograd[0]
                    torch.library.register_autograd(f"{NAMESPACE}::{name}", backward, setup_context=setup_context, lib=lib)
            _LIB = lib
            _NAMES.extend(sorted(decls))
        return list(_NAMES)


def call(name: str, *args):
    """``torch.ops.dsa_aot.<name>(*args)``, the ops registered first if they are not yet: how the
    differentiable ops (``dsa_aot.csa.compressor``, ``dsa_aot.dsa.sparse_attention``) enter the dispatcher, so
    that autograd, ``torch.compile`` and CUDA graphs see one op. Once the ops are registered this is a
    lookup ``torch.compile`` traces through; registering cannot be traced, so a first call inside
    ``torch.compile`` needs ``import dsa_aot.library`` first (RuntimeError saying so otherwise).

    Every value of the right Python type reaches the op's own checks (an InputError listing every
    problem); an argument of a type the schema cannot carry is refused by the dispatcher before the op
    runs, and that refusal is an InputError too (the op module's other entry points raise InputError
    for it, and so does this)."""
    import torch

    op = _OPS.get(name)
    if op is None:
        if _LIB is None:
            if torch.compiler.is_compiling():  # registering is no graph op: dynamo cannot trace it
                raise RuntimeError(f"torch.ops.{NAMESPACE} is not registered yet: import dsa_aot.library (or call {name} once outside "
                                   f"torch.compile) before torch.compile traces a function that calls it")
            register()
        op = _OPS[name] = getattr(getattr(torch.ops, NAMESPACE), name)
    if torch.compiler.is_compiling():  # types are fixed at trace time: a wrong one fails the trace
        return op(*args)
    try:
        return op(*args)
    except RuntimeError as e:
        m = _TYPE_ERROR.search(str(e)) if str(e).startswith(f"{NAMESPACE}::{name}()") else None
        if m is None:
            raise
        expected, arg, got = m.groups()
    from .checks import input_error

    raise input_error([f"{arg}: a {got} (expected {expected})"])
