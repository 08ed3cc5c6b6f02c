"""Stage 3 — lift: turn the lowered host launcher of one entry into a pure-Python launcher module.

The host function of a ``@cute.jit`` entry is straight-line integer code over its arguments plus calls
to a few CUDA shims. The lifter interprets it abstractly: a value is a constant, a residual
expression over the arguments, a pointer into a modelled memory region, or an aggregate. Constant
control flow is followed (the attribute-array loops unroll), error checks on shim results follow the
success side, and a branch on a run-time value is accepted only when one side is an error path (it
becomes a check that raises) or when the launcher can reproduce it as Python: pure integer arithmetic
that rejoins, a loop around launches, an if/else whose arms rejoin. Every launch is captured: kernel, grid, block, shared memory, stream,
launch attributes and the bytes of every kernel parameter. What is constant goes into the module as
data; only the residual arithmetic is emitted as code.

The per-device setup function (``cuda_load_to_device``) is lifted the same way into ``setup(dattr,
kattr, set_attr)``: which kernel attributes the JIT sets, from which device/kernel attributes.

Fails closed: an op, call, type or branch it does not understand raises :class:`LiftError` naming
it and its line in host.mlir.

Public functions: :func:`lift` (host.mlir text -> launcher source; artifact: ``launcher.py``) and
:func:`cubin_param_layout` (the cubin's parameter layout, which ``lift`` checks launches against).

Modules: ``values`` (the abstract values and host memory), ``arith`` (op spelling and constant
folding), ``interp`` (the abstract interpreter and the CUDA shim models), ``control`` (branches,
loops and run-time regions), ``emit`` (the launcher module).
"""

from __future__ import annotations

from .. import ir
from ...errors import LiftError
from .emit import emit_module, entry_args
from .interp import Interpreter
from .values import P, Region, S

__all__ = ["lift", "cubin_param_layout"]


def cubin_param_layout(cubin: bytes) -> dict:
    """kernel symbol -> [(offset, size)] of its parameters, from the cubin's EIATTR_KPARAM_INFO."""
    from ..cubin import read_cubin

    return {k.name: [(p.offset, p.size) for p in k.params] for k in read_cubin(cubin).kernels}


def lift(host_mlir: str, entry_function: str, title: str = "", param_layout: dict | None = None, literals: dict | None = None) -> str:
    """Lift ``entry_function`` of ``host_mlir`` (generic form) into launcher module source.

    ``param_layout`` maps kernel symbol -> [(offset, size)] of its parameters, from the cubin.
    ``literals`` maps a launcher argument name -> the value the spec compiled in for it: a value the
    host code holds as a constant (upstream bakes it in per compile, the cubin does not depend on it)
    becomes an argument appended to ``ARGS``, ``f32`` for a float, ``i32`` for an int (a grid extent
    upstream sizes from the device). Each must occur in the host code exactly once (a float by its bit
    pattern, an int as an i32 constant: the spec compiles a value no other constant has) and reach the
    launches as it is: a float into kernel parameters only (a float op on it is unknown and fails
    closed), an int into a launch's dimensions or parameters.
    """
    m = ir.parse_module(host_mlir)
    if entry_function not in m.funcs:
        raise LiftError(f"host module has no function {entry_function!r} (has: {sorted(m.funcs)})")
    setup = _setup(m)
    main = Interpreter(m)
    main.kernels = dict(setup.kernels)
    f = m.funcs[entry_function]
    args, arg_spec = entry_args(f)
    main.literals = _literal_bits(literals or {}, arg_spec)
    main.run(f, args)
    if not main.launches:
        raise LiftError(f"{entry_function} launches no kernel")
    for (kind, bits), name in main.literals.items():
        what = f"fp32 bits {bits:#010x}" if kind == "f32" else f"i32 value {bits}"
        if (kind, bits) not in main.literals_seen:
            raise LiftError(f"literal {name} ({what}) does not occur in {entry_function}: the spec compiled another value")
        if len(main.literals_seen[kind, bits]) > 1:
            raise LiftError(f"literal {name}: {len(main.literals_seen[kind, bits])} constants have its {what} (host.mlir lines "
                            f"{sorted(main.literals_seen[kind, bits])}): compile the spec with a value no other constant shares")
        if not _in_params(main, name) and not (kind == "i32" and any(isinstance(d, S) and d.name == name for L in main.launches for d in L.dims)):
            raise LiftError(f"literal {name} is not stored into a kernel parameter{' or launch dimension' if kind == 'i32' else ''} as it is: "
                            f"the launcher cannot pass it")
        arg_spec.append((name, kind))
    return emit_module(title, arg_spec, setup, main, main.kernels, param_layout)


def _literal_bits(literals, arg_spec):
    """{(kind, bits): name}, kind "f32" (the value's fp32 bits) or "i32" (an int's value); refuses names that
    clash with the entry's arguments and values that share bits."""
    from ..verify import f32bits

    out = {}
    names = {n for n, _ in arg_spec}
    for name, value in literals.items():
        if name in names or not name.isidentifier():
            raise LiftError(f"literal name {name!r} is not a fresh identifier")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, int) and not 0 < value < 1 << 31):
            raise LiftError(f"literal {name}: {value!r} is neither a float nor an int in [1, 2**31)")
        key = ("f32", f32bits(value)) if isinstance(value, float) else ("i32", value)
        if key in out:
            raise LiftError(f"literals {out[key]} and {name} have the same {'fp32 bits' if key[0] == 'f32' else 'i32 value'} {key[1]:#010x}: "
                            f"the launcher could not tell them apart")
        out[key] = name
    return out


def _in_params(main, name):
    return any(isinstance(v, S) and v.name == name for L in main.launches for pr in L.params for _, v in pr.region.fields.values())


def _setup(m):
    """Interpret the per-device setup, cuda_load_to_device(library**, device): it loads the kernels
    (kernel global -> symbol) and sets their attributes."""
    setup = Interpreter(m)
    if "cuda_load_to_device" not in m.funcs:
        raise LiftError("host module has no cuda_load_to_device; cannot learn the kernel set-up the JIT performs")
    lib = Region("library handle", 8)
    lib.fields[0] = (8, S("library", 64))
    setup.run(m.funcs["cuda_load_to_device"], [P(lib, 0), S("device", 32)])
    return setup
