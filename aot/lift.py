"""Stage 3 — lift: turn the lowered host launcher of one entry into a pure-Python launcher module.

The host function of a ``@cute.jit`` entry is straight-line integer code over its arguments plus calls
to a few CUDA shims. The lifter interprets it abstractly: a value is a constant, a residual
expression over the arguments, a pointer into a modelled memory region, or an aggregate. Constant
control flow is followed (the attribute-array loops unroll), error checks on shim results follow the
success side, and a branch on a run-time value is accepted only when one side is an error path (it
becomes a check that raises). Every launch is captured: kernel, grid, block, shared memory, stream,
launch attributes and the bytes of every kernel parameter. What is constant goes into the module as
data; only the residual arithmetic is emitted as code.

The per-device setup function (``cuda_load_to_device``) is lifted the same way into ``setup(dattr,
kattr, set_attr)``: which kernel attributes the JIT sets, from which device/kernel attributes.

Fails closed: an op, call, type or branch it does not understand raises :class:`LiftError` naming
it and its line in host.mlir.

Public function: :func:`lift` (host.mlir text -> launcher source). Artifact: ``launcher.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import ir
from .errors import LiftError

__all__ = ["lift", "cubin_param_layout", "LAUNCH_ATTRS"]

# CUDA launch attribute ids the runtime knows how to set (value layout: i32 fields at byte 0, 4, 8).
LAUNCH_ATTRS = {2: "cooperative", 4: "cluster_dim", 6: "programmatic_stream_serialization", 11: "preferred_cluster_dim"}
_MAX_STEPS = 500_000
_PACK = {1: "B", 2: "H", 4: "I", 8: "Q"}
_ICMP = {0: "==", 1: "!=", 2: "slt", 3: "sle", 4: "sgt", 5: "sge", 6: "<", 7: "<=", 8: ">", 9: ">="}
_SIGNED = {"slt": "<", "sle": "<=", "sgt": ">", "sge": ">="}


# --- abstract values -----------------------------------------------------------------------------


@dataclass(frozen=True)
class K:  # constant integer, stored unsigned
    v: int
    bits: int


@dataclass(frozen=True)
class S:  # residual expression, bound to a local name in the emitted code
    name: str
    bits: int
    status: bool = False  # result of a shim call (a CUDA status)
    okwhen: object = None  # for icmp(status, 0): the truth value that means success


@dataclass(frozen=True)
class B:  # constant bytes (string constants)
    data: bytes


@dataclass(frozen=True)
class P:  # pointer into a modelled region
    region: "Region"
    off: int


@dataclass(frozen=True)
class A:  # aggregate (struct / array value)
    items: tuple


@dataclass(frozen=True)
class KH:  # a kernel handle, named by its kernel global
    glob: str


@dataclass(frozen=True)
class PI:  # a host-memory pointer cast to an integer: only an inttoptr back is understood
    ptr: object


class _Poison:
    def __repr__(self):
        return "poison"


POISON = _Poison()


class Region:
    """Memory of one alloca or global: offset -> (size, scalar value)."""

    def __init__(self, name, size):
        self.name, self.size, self.fields = name, size, {}

    def __repr__(self):
        return f"<{self.name}>"

    def store(self, off, size, value, where):
        if off < 0 or off + size > self.size:
            raise LiftError(f"{where}: store of {size} bytes at offset {off} outside {self.name} ({self.size} bytes)")
        for o in list(self.fields):
            s, _ = self.fields[o]
            if o < off + size and off < o + s:
                if off <= o and o + s <= off + size:
                    del self.fields[o]
                else:
                    raise LiftError(f"{where}: store [{off}, {off + size}) partly overlaps an earlier store [{o}, {o + s}) in {self.name}")
        self.fields[off] = (size, value)

    def load(self, off, size, where):
        f = self.fields.get(off)
        if f is None:
            for o, (s, _) in self.fields.items():
                if o < off + size and off < o + s:
                    raise LiftError(f"{where}: load [{off}, {off + size}) straddles a stored field [{o}, {o + s}) in {self.name}")
            return POISON
        if f[0] != size:
            raise LiftError(f"{where}: load of {size} bytes at {off} reads a {f[0]}-byte field in {self.name}")
        return f[1]


def _mask(bits):
    return (1 << bits) - 1


def _flatten(t, value, base=0):
    """(offset, size, scalar value) for every scalar of ``value`` laid out as type ``t``."""
    if isinstance(t, (ir.Int, ir.Float, ir.Ptr)):
        return [(base, ir.sizeof(t), value)]
    if isinstance(value, B):
        return [(base, ir.sizeof(t), value)]
    if value is POISON:
        return []
    if isinstance(t, ir.Struct):
        if not isinstance(value, A):
            raise LiftError(f"storing {value!r} as struct {t}")
        out = []
        for ft, off, v in zip(t.fields, ir.field_offsets(t), value.items):
            out += _flatten(ft, v, base + off)
        return out
    if isinstance(t, ir.Array):
        if not isinstance(value, A):
            raise LiftError(f"storing {value!r} as array {t}")
        step = ir.sizeof(t.elem) if t.n == 0 else ir.sizeof(t) // t.n
        out = []
        for i, v in enumerate(value.items):
            out += _flatten(t.elem, v, base + i * step)
        return out
    raise LiftError(f"cannot store type {t}")


# --- the interpreter -----------------------------------------------------------------------------


@dataclass
class Launch:
    kernel: str  # kernel global name
    dims: tuple  # 8 values: grid xyz, block xyz, smem, stream
    attrs: list  # [(id, {offset: K})]
    params: list  # [(type, Region)]


class _Lifter:
    def __init__(self, module: ir.Module):
        self.m = module
        self.lines = []  # (target, code, deps, effect)
        self.n = 0
        self.launches = []
        self.kernels = {}  # kernel global -> symbol
        self.globals = {}
        self.steps = 0
        self.functions = []  # module-level helper functions (run-time arithmetic regions)
        self.nregion = 0
        self.nloop = 0
        self.nif = 0
        self.headers = []  # loops being interpreted: an if/else must rejoin inside their body
        self.env = {}
        self.label = None
        self.regions = []  # every modelled host region, to prove loop bodies leave outer memory alone

    # residual code
    def emit(self, code, bits, deps, status=False, okwhen=None):
        self.n += 1
        name = f"v{self.n}"
        self.lines.append((name, code, deps, False))
        return S(name, bits, status, okwhen)

    def effect(self, code, deps):
        self.lines.append((None, code, deps, True))

    def glob(self, name, where):
        r = self.globals.get(name)
        if r is None:
            g = self.m.globals.get(name)
            if g is None:
                raise LiftError(f"{where}: unknown global @{name}")
            r = Region(f"@{name}", 1 << 40)
            if "value" in g.props and g.props["value"].startswith('"'):
                data = ir.attr_bytes(g.props["value"])
                r.size = len(data)
                r.fields[0] = (len(data), B(data))
            elif name.startswith("kernels_kernel_"):
                r.size = 8
                r.fields[0] = (8, KH(name))
            self.globals[name] = r
            self.regions.append(r)
        return r

    def run(self, func: ir.Func, args: list):
        env = {}
        outer_env, self.env = self.env, env
        for (nm, _), v in zip(func.args, args):
            env[nm] = v
        res = self.run_blocks(func, env, func.entry)
        self.env = outer_env
        return res

    def run_blocks(self, func, env, label, stop=None):
        """Interpret from ``label``; return the function's result, or ("stop", vals) on a branch to ``stop``."""
        while True:
            self.label = label
            block = func.blocks[label]
            nxt = None
            for op in block.ops:
                self.steps += 1
                if self.steps > _MAX_STEPS:
                    raise LiftError(f"{op.where()}: host code did not finish within {_MAX_STEPS} steps (a loop on a run-time value?)")
                res = self.step(op, env, func)
                if isinstance(res, tuple) and res[0] == "jump":
                    nxt = res[1:]
                    break
                if isinstance(res, tuple) and res[0] == "return":
                    return res[1]
            if nxt is None:
                raise LiftError(f"block {label} of {func.name} has no terminator")
            target, vals = nxt
            if stop is not None and target == stop:
                return ("stop", vals)
            blk = func.blocks.get(target)
            if blk is None:
                raise LiftError(f"{func.name}: branch to unknown block {target}")
            for (nm, _), v in zip(blk.args, vals):
                env[nm] = v
            label = target

    def val(self, env, name, op):
        try:
            return env[name]
        except KeyError:
            raise LiftError(f"{op.where()}: use of {name} before definition") from None

    def step(self, op: ir.Op, env, func):
        n = op.name
        ops = [self.val(env, o, op) for o in op.operands]
        r = op.results[0] if op.results else None
        if n == "llvm.mlir.constant":
            env[r] = self.constant(op)
        elif n == "llvm.mlir.zero":
            t = op.result_type
            env[r] = K(0, 64 if isinstance(t, ir.Ptr) else t.bits) if isinstance(t, (ir.Ptr, ir.Int)) else POISON
        elif n in ("llvm.mlir.poison", "llvm.mlir.undef"):
            env[r] = POISON
        elif n == "llvm.mlir.addressof":
            env[r] = P(self.glob(ir.attr_sym(op.prop("global_name")), op.where()), 0)
        elif n == "llvm.alloca":
            count = ops[0]
            if not isinstance(count, K):
                raise LiftError(f"{op.where()}: alloca with a run-time count")
            t = ir.parse_type(op.prop("elem_type"))
            reg = Region(f"alloca {r} ({op.prop('elem_type')})", ir.sizeof(t) * count.v)
            self.regions.append(reg)
            # a kernel parameter's slot in the param buffer keeps the alloca's alignment (a TMA
            # descriptor is 64-byte aligned; the cubin's KPARAM_INFO check confirms it)
            reg.align = max(ir.alignof(t), ir.attr_int(op.prop("alignment")) if "alignment" in op.props else 1)
            env[r] = P(reg, 0)
        elif n == "llvm.getelementptr":
            env[r] = self.gep(op, ops)
        elif n == "llvm.store":
            v, p = ops
            if not isinstance(p, P):
                raise LiftError(f"{op.where()}: store through a pointer the lifter does not model ({p!r})")
            for off, size, x in _flatten(op.operand_types[0], v):
                p.region.store(p.off + off, size, x, op.where())
        elif n == "llvm.load":
            p = ops[0]
            if not isinstance(p, P):
                raise LiftError(f"{op.where()}: load through a pointer the lifter does not model ({p!r})")
            env[r] = self.load(op.result_type, p, op.where())
        elif n == "llvm.insertvalue":
            agg, v = ops
            pos = ir.attr_ints(op.prop("position"))
            env[r] = self.insert(agg, pos, v, op.result_type)
        elif n == "llvm.extractvalue":
            v = ops[0]
            for i in ir.attr_ints(op.prop("position")):
                if not isinstance(v, A):
                    raise LiftError(f"{op.where()}: extractvalue from {v!r}")
                v = v.items[i]
            env[r] = v
        elif n in _BINOPS:
            env[r] = self.binop(op, n, ops)
        elif n == "llvm.icmp":
            env[r] = self.icmp(op, ops)
        elif n == "llvm.select":
            c, a, b = ops
            if isinstance(c, K):
                env[r] = a if c.v else b
            else:
                a, b = self.scalar(a, op), self.scalar(b, op)
                env[r] = self.emit(f"({self.x(a)} if {c.name} else {self.x(b)})", op.result_type.bits, [c, a, b])
        elif n in ("llvm.zext", "llvm.sext", "llvm.trunc"):
            env[r] = self.cast(op, n, ops[0])
        elif n in ("llvm.ptrtoint", "llvm.inttoptr", "llvm.bitcast", "llvm.addrspacecast"):
            v = ops[0]
            if n == "llvm.ptrtoint" and isinstance(v, (P, KH)):
                v = PI(v)  # the TMA descriptor copy round-trips its alloca through an integer
            elif n == "llvm.inttoptr" and isinstance(v, PI):
                v = v.ptr
            elif isinstance(v, (P, KH, PI)) and n in ("llvm.ptrtoint", "llvm.inttoptr"):
                raise LiftError(f"{op.where()}: {n} of a host-memory pointer")
            env[r] = v
        elif n == "llvm.br":
            return ("jump", op.successors[0], ops)
        elif n == "llvm.cond_br":
            return self.cond_br(op, ops, func)
        elif n == "llvm.return":
            return ("return", ops[0] if ops else None)
        elif n == "llvm.call":
            res = self.call(op, ops)
            if r is not None:
                env[r] = res
        elif n in ("llvm.intr.trap", "llvm.unreachable"):
            raise LiftError(f"{op.where()}: the host code traps on this path")
        else:
            raise LiftError(f"{op.where()}: op {n} is not understood by the lifter; teach aot/lift.py (and aot/verify.py) its semantics")
        return None

    def constant(self, op):
        raw = op.prop("value")
        t = op.result_type
        if raw.startswith('"'):
            return B(ir.attr_bytes(raw))
        if isinstance(t, ir.Int):
            return K(ir.attr_int(raw) & _mask(t.bits), t.bits)
        if isinstance(t, ir.Vector):
            return A(tuple(K(x & _mask(t.elem.bits), t.elem.bits) for x in ir.attr_dense(raw, t.n)))
        if isinstance(t, ir.Float) and t.bits == 32:  # kept as its bit pattern, like f32 arguments
            return K(ir.attr_f32_bits(raw), 32)
        raise LiftError(f"{op.where()}: constant {raw[:60]!r} of type {t}")

    def gep(self, op, ops):
        base, dyn = ops[0], list(ops[1:])
        if isinstance(base, (K, S)) and isinstance(op.operand_types[0], ir.Ptr) and op.operand_types[0].space == 1:
            return self.device_gep(op, base, dyn)
        if not isinstance(base, P):
            raise LiftError(f"{op.where()}: getelementptr on {base!r}")
        t = ir.parse_type(op.prop("elem_type"))
        off = 0
        for depth, raw in enumerate(ir.attr_ints(op.prop("rawConstantIndices"))):
            if raw == -2147483648:
                v = dyn.pop(0)
                if not isinstance(v, K):
                    raise LiftError(f"{op.where()}: getelementptr with a run-time index into host memory")
                idx = v.v - (1 << v.bits) if v.v >> (v.bits - 1) else v.v
            else:
                idx = raw
            if depth == 0:
                off += idx * ir.sizeof(t)
                cur = t
            elif isinstance(cur, ir.Struct):
                off += ir.field_offsets(cur)[idx]
                cur = cur.fields[idx]
            elif isinstance(cur, ir.Array):
                off += idx * ir.sizeof(cur.elem)
                cur = cur.elem
            else:
                raise LiftError(f"{op.where()}: getelementptr index into scalar {cur}")
        return P(base.region, base.off + off)

    def device_gep(self, op, base, dyn):
        """Address arithmetic on a device (addrspace 1) pointer argument, e.g. workspace + offset."""
        t = ir.parse_type(op.prop("elem_type"))
        tys = list(op.operand_types[1:])
        const, terms, deps, cur = 0, [], [base], t
        for depth, raw in enumerate(ir.attr_ints(op.prop("rawConstantIndices"))):
            if depth == 0:
                step = ir.sizeof(t)
            elif isinstance(cur, ir.Array):
                step = ir.sizeof(cur.elem)
            elif isinstance(cur, ir.Struct):
                step = None
            else:
                raise LiftError(f"{op.where()}: getelementptr index into scalar {cur}")
            if raw == -2147483648:
                v, vt = self.scalar(dyn.pop(0), op), tys.pop(0)
                if step is None:
                    raise LiftError(f"{op.where()}: getelementptr with a run-time struct field index")
                if isinstance(v, K):
                    const += (v.v - (1 << v.bits) if v.v >> (v.bits - 1) else v.v) * step
                else:
                    terms.append(f"sx({v.name}, {vt.bits}) * {step}")
                    deps.append(v)
                idx = None
            else:
                idx = raw
                const += ir.field_offsets(cur)[raw] if step is None else raw * step
            if depth > 0:
                cur = cur.fields[idx] if isinstance(cur, ir.Struct) else cur.elem
        if isinstance(base, K) and not terms:
            return K((base.v + const) & _mask(64), 64)
        expr = " + ".join([self.x(base)] + terms + ([str(const)] if const else []))
        return self.emit(f"(({expr}) & 0xffffffffffffffff)", 64, deps)

    def load(self, t, p, where):
        if isinstance(t, (ir.Int, ir.Float, ir.Ptr)):
            return p.region.load(p.off, ir.sizeof(t), where)
        if isinstance(t, ir.Struct):
            return A(tuple(self.load(ft, P(p.region, p.off + o), where) for ft, o in zip(t.fields, ir.field_offsets(t))))
        if isinstance(t, ir.Array):
            f = p.region.fields.get(p.off)
            if f is not None and isinstance(f[1], B) and f[0] == ir.sizeof(t):
                return f[1]
            return A(tuple(self.load(t.elem, P(p.region, p.off + i * ir.sizeof(t.elem)), where) for i in range(t.n)))
        raise LiftError(f"{where}: load of type {t}")

    def insert(self, agg, pos, v, t):
        if agg is POISON:
            n = len(t.fields) if isinstance(t, ir.Struct) else t.n
            agg = A(tuple(POISON for _ in range(n)))
        items = list(agg.items)
        if len(pos) == 1:
            items[pos[0]] = v
        else:
            sub_t = t.fields[pos[0]] if isinstance(t, ir.Struct) else t.elem
            items[pos[0]] = self.insert(items[pos[0]], pos[1:], v, sub_t)
        return A(tuple(items))

    def scalar(self, v, op):
        if isinstance(v, (K, S)):
            return v
        raise LiftError(f"{op.where()}: arithmetic on {v!r}")

    def x(self, v):
        return str(v.v) if isinstance(v, K) else v.name

    def binop(self, op, n, ops):
        a, b = (self.scalar(v, op) for v in ops)
        bits = op.result_type.bits
        if isinstance(a, K) and isinstance(b, K):
            return K(_fold(n, a.v, b.v, bits, op), bits)
        fn, needs = _BINOPS[n]
        return self.emit(f"{fn}({self.x(a)}, {self.x(b)}, {bits})" if needs else fn.format(a=self.x(a), b=self.x(b), m=hex(_mask(bits))), bits, [a, b])

    def icmp(self, op, ops):
        a, b = (self.scalar(v, op) for v in ops)
        pred = _ICMP[ir.attr_int(op.prop("predicate"))]
        bits = op.operand_types[0].bits if isinstance(op.operand_types[0], ir.Int) else 64
        if isinstance(a, K) and isinstance(b, K):
            return K(int(_cmp(pred, a.v, b.v, bits)), 1)
        okwhen = None
        st, other = (a, b) if isinstance(a, S) and a.status else (b, a)
        if isinstance(st, S) and st.status and isinstance(other, K) and other.v == 0 and pred in ("==", "!="):
            okwhen = pred == "=="
        if pred in _SIGNED:
            code = f"(sx({self.x(a)}, {bits}) {_SIGNED[pred]} sx({self.x(b)}, {bits}))"
        else:
            code = f"({self.x(a)} {pred} {self.x(b)})"
        return self.emit(code, 1, [a, b], okwhen=okwhen)

    def cast(self, op, n, v):
        v = self.scalar(v, op)
        src = op.operand_types[0].bits
        dst = op.result_type.bits
        if isinstance(v, K):
            if n == "llvm.sext" and v.v >> (src - 1):
                return K((v.v - (1 << src)) & _mask(dst), dst)
            return K(v.v & _mask(dst), dst)
        if n == "llvm.zext":
            return S(v.name, dst)
        if n == "llvm.trunc":
            return self.emit(f"({v.name} & {hex(_mask(dst))})", dst, [v])
        return self.emit(f"(sx({v.name}, {src}) & {hex(_mask(dst))})", dst, [v])

    def cond_br(self, op, ops, func):
        c = ops[0]
        seg = ir.attr_ints(op.prop("operandSegmentSizes"))
        tvals, fvals = ops[1 : 1 + seg[1]], ops[1 + seg[1] :]
        t, f = op.successors
        if isinstance(c, K):
            return ("jump", t, tvals) if c.v else ("jump", f, fvals)
        if not isinstance(c, S):
            raise LiftError(f"{op.where()}: branch on {c!r}")
        if c.okwhen is not None:  # error check on a shim's status: follow success
            return ("jump", t, tvals) if c.okwhen else ("jump", f, fvals)
        t_err, f_err = _is_error_path(func, t), _is_error_path(func, f)
        if t_err and not f_err:
            self.effect(f"if {c.name}: raise LaunchError({_err_text(op, func, t)!r})", [c])
            return ("jump", f, fvals)
        if f_err and not t_err:
            self.effect(f"if not {c.name}: raise LaunchError({_err_text(op, func, f)!r})", [c])
            return ("jump", t, tvals)
        # a run-time branch into pure integer arithmetic that rejoins (e.g. fast-divmod set-up loops):
        # emitted as a small Python function of its inputs, returning the values at the join
        join, region, why = _pure_region(func, op, t, f)
        if join is not None:
            return self.region_call(op, func, c, (t, tvals), (f, fvals), join, region)
        body = _natural_loop(func, self.label)
        if t in body and f not in body:
            return self.loop(op, func, c, (t, tvals), (f, fvals))
        join, region = _join(func, t, f)
        if join is not None and self.label not in region and not body and not region & set(self.headers):
            return self.branch(op, func, c, (t, tvals), (f, fvals), join)
        raise LiftError(f"{op.where()}: branch on a run-time value ({c.name}) where neither side is an error path, and the region it "
                        f"opens is not pure arithmetic ({why}), a loop with launches, or an if/else whose arms rejoin; the lifter only "
                        f"follows host code whose control flow it can reproduce")

    def branch(self, op, func, c, tside, fside, join):
        """A run-time if/else whose arms rejoin (a kernel launched only for some extents): emitted as a
        Python if/else. Each arm is interpreted once; the join's block arguments become variables the
        arms assign. Like a loop body, an arm must leave host memory allocated before it alone."""
        env = self.env
        self.nif += 1
        outs = []
        for i, (_, ty) in enumerate(func.blocks[join].args):
            t = ir.parse_type(ty)
            if not isinstance(t, ir.Int):
                raise LiftError(f"{op.where()}: the arms of a run-time branch join with a {t}, not an integer")
            outs.append(S(f"J{self.nif}_{i}", t.bits))
        before = {id(r): dict(r.fields) for r in self.regions}
        arms = []
        for label, vals in (tside, fside):
            outer_lines, self.lines = self.lines, []
            if label != join:
                for (an, _), v in zip(func.blocks[label].args, vals):
                    env[an] = v
                res = self.run_blocks(func, env, label, stop=join)
                if not (isinstance(res, tuple) and res[0] == "stop"):
                    raise LiftError(f"{op.where()}: an arm of a run-time branch returns instead of reaching block {join}")
                vals = res[1]
            for o, v in zip(outs, vals):
                if not isinstance(v, (K, S)):
                    raise LiftError(f"{op.where()}: an arm of a run-time branch yields {v!r} at block {join}")
                self.effect(f"{o.name} = {self.x(v)}", [v])
            arms.append(self.lines)
            self.lines = outer_lines
        for r in self.regions:
            if id(r) in before and r.fields != before[id(r)]:
                raise LiftError(f"{op.where()}: an arm of a run-time branch writes {r.name}, allocated before the branch; the lifter only "
                                f"lifts arms whose memory is their own")
        self.lines.append((None, (f"if {c.name}:", arms[0]), [c] + [d for _, _, deps, _ in arms[0] for d in deps], True))
        self.lines.append((None, ("else:", arms[1]), [d for _, _, deps, _ in arms[1] for d in deps], True))
        return ("jump", join, outs)

    def loop(self, op, func, c, body, exit_):
        """A loop whose header branches on a run-time value (e.g. waves over S_q, with launches in
        the body): emitted as a Python while loop. The body is interpreted once with the header's
        block arguments as loop variables; it must not write host memory allocated before the loop."""
        header = self.label
        hblock = func.blocks[header]
        env = self.env
        self.nloop += 1
        lv = []
        for i, (an, ty) in enumerate(hblock.args):
            t = ir.parse_type(ty)
            if not isinstance(t, ir.Int):
                raise LiftError(f"{op.where()}: loop variable {an} is a {t}, not an integer")
            cur = env[an]
            if not isinstance(cur, (K, S)):
                raise LiftError(f"{op.where()}: loop variable {an} starts as {cur!r}")
            lv.append(S(f"L{self.nloop}_{i}", t.bits))
        if lv:
            self.effect(f"{', '.join(v.name for v in lv)} = {', '.join(self.x(env[an]) for an, _ in hblock.args)}", [env[an] for an, _ in hblock.args])
        before = {id(r): dict(r.fields) for r in self.regions}
        outer_lines, self.lines = self.lines, []
        for (an, _), v in zip(hblock.args, lv):
            env[an] = v
        for o in hblock.ops[:-1]:  # the header again, now over the loop variables
            self.step(o, env, func)
        cond = self.val(env, op.operands[0], op)
        if isinstance(cond, K):
            raise LiftError(f"{op.where()}: the loop condition folds to a constant over the loop variables")
        self.effect(f"if not {cond.name}: break", [cond])
        seg = ir.attr_ints(op.prop("operandSegmentSizes"))
        bvals = [self.val(env, x, op) for x in op.operands[1 : 1 + seg[1]]]
        for (an, _), v in zip(func.blocks[body[0]].args, bvals):
            env[an] = v
        self.headers.append(header)
        res = self.run_blocks(func, env, body[0], stop=header)
        self.headers.pop()
        if not (isinstance(res, tuple) and res[0] == "stop"):
            raise LiftError(f"{op.where()}: the loop body returns instead of looping back")
        nxt = res[1]
        for v in nxt:
            if not isinstance(v, (K, S)):
                raise LiftError(f"{op.where()}: a loop variable's next value is {v!r}")
        if lv:
            self.effect(f"{', '.join(v.name for v in lv)} = {', '.join(self.x(v) for v in nxt)}", list(nxt))
        for r in self.regions:
            if id(r) in before and r.fields != before[id(r)]:
                raise LiftError(f"{op.where()}: the loop body writes {r.name}, allocated before the loop; the lifter only lifts loops whose memory is their own")
        inner, self.lines = self.lines, outer_lines
        self.lines.append((None, ("while True:", inner), [d for _, _, deps, _ in inner for d in deps], True))
        self.label = header
        # after the loop: the exit edge's values, computed by the last (failing) header evaluation
        fvals = [self.val(env, x, op) for x in op.operands[1 + seg[1] :]]
        return ("jump", exit_[0], fvals)

    def region_call(self, op, func, c, tside, fside, join, region):
        env_names = {}
        params, args = [], []

        def outer(name):
            # a value the region reads but does not define: constant literal or a residual passed in
            v = self.env[name]
            if isinstance(v, K):
                return str(v.v)
            if not isinstance(v, S):
                raise LiftError(f"{op.where()}: the run-time region reads {name} = {v!r}, not an integer")
            if name not in env_names:
                env_names[name] = f"x{len(params)}"
                params.append(env_names[name])
                args.append(v)
            return env_names[name]

        src = _region_source(func, region, join, tside, fside, outer)
        self.nregion += 1
        fname = f"_region{self.nregion}"
        self.functions.append(f"def {fname}(c, {', '.join(params)}):\n" + src if params else f"def {fname}(c):\n" + src)
        call = self.emit(f"{fname}({', '.join([c.name] + [a.name for a in args])})", 0, [c, *args])
        outs = []
        for i, (_, ty) in enumerate(func.blocks[join].args):
            t = ir.parse_type(ty)
            if not isinstance(t, ir.Int):
                raise LiftError(f"{op.where()}: the run-time region yields a {t}, not an integer")
            outs.append(self.emit(f"{call.name}[{i}]", t.bits, [call]))
        return ("jump", join, outs)

    def call(self, op, ops):
        callee = ir.attr_sym(op.prop("callee"))
        h = getattr(self, "shim" + callee, None)
        if h is not None:
            return h(op, ops)
        f = self.m.funcs.get(callee)
        if f is not None and f.blocks:
            return self.run(f, ops)
        raise LiftError(f"{op.where()}: call to @{callee} is not understood by the lifter (known shims: {sorted(s[4:] for s in dir(self) if s.startswith('shim_'))})")

    # --- shims: launch path
    def shim_cudaLaunchKernelEx(self, op, ops):
        cfgp, kernel, params = ops
        w = op.where()
        if not isinstance(kernel, KH):
            raise LiftError(f"{w}: launch of {kernel!r}, not a kernel loaded by cuda_load")
        cfg_t = ir.parse_type("!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>")
        cfg = self.load(cfg_t, cfgp, w)
        dims = [*cfg.items[0].items, *cfg.items[1].items, cfg.items[2], cfg.items[3]]
        for i, d in enumerate(dims):
            if not isinstance(d, (K, S)):
                raise LiftError(f"{w}: launch config field {i} is {d!r}")
        nattr = cfg.items[5]
        if not isinstance(nattr, K):
            raise LiftError(f"{w}: the number of launch attributes depends on run-time values")
        attrs = []
        ap = cfg.items[4]
        for i in range(nattr.v):
            base = P(ap.region, ap.off + 72 * i)
            aid = base.region.load(base.off, 4, w)
            if not isinstance(aid, K) or aid.v not in LAUNCH_ATTRS:
                raise LiftError(f"{w}: launch attribute {aid!r} is not one the runtime can set (known: {LAUNCH_ATTRS})")
            vals = {}
            for o, (s, v) in base.region.fields.items():
                if base.off + 8 <= o < base.off + 72:
                    if not isinstance(v, K):
                        raise LiftError(f"{w}: launch attribute {LAUNCH_ATTRS[aid.v]} has a run-time value")
                    vals[o - base.off - 8] = (s, v.v)
            attrs.append((aid.v, vals))
        if not isinstance(params, P):
            raise LiftError(f"{w}: kernel params are {params!r}")
        plist = []
        nparams = params.region.size // 8
        for i in range(nparams):
            pp = params.region.load(params.off + 8 * i, 8, w)
            if not isinstance(pp, P):
                raise LiftError(f"{w}: kernel param {i} points to {pp!r}")
            plist.append(pp)
        self.launches.append(Launch(kernel.glob, tuple(dims), attrs, plist))
        deps = [d for d in dims if isinstance(d, S)] + [v for pr in plist for _, (_, v) in pr.region.fields.items() if isinstance(v, S)]
        self.lines.append((None, ("LAUNCH", len(self.launches) - 1), deps, True))
        return self.emit("0", 32, [], status=True)

    # --- shims: per-device setup (cuda_load_to_device)
    def shim_cudaDeviceGetAttribute(self, op, ops):
        out, attr, _dev = ops
        if not isinstance(attr, K):
            raise LiftError(f"{op.where()}: device attribute id is a run-time value")
        v = self.emit(f"dattr({attr.v})", 32, [])
        out.region.store(out.off, 4, v, op.where())
        return self.emit("0", 32, [], status=True)

    def shim_cudaLibraryGetKernel(self, op, ops):
        gptr, _lib, name = ops
        data = name.region.fields.get(name.off)
        if not isinstance(gptr, P) or data is None or not isinstance(data[1], B):
            raise LiftError(f"{op.where()}: cudaLibraryGetKernel with a kernel name the lifter cannot read")
        sym = data[1].data.split(b"\0")[0].decode()
        glob = gptr.region.name[1:]
        self.kernels[glob] = sym
        gptr.region.store(0, 8, KH(glob), op.where())
        return self.emit("0", 32, [], status=True)

    def shim_cuKernelGetAttribute(self, op, ops):
        out, attr, kernel, _dev = ops
        if not isinstance(attr, K) or not isinstance(kernel, KH):
            raise LiftError(f"{op.where()}: cuKernelGetAttribute on run-time values")
        v = self.emit(f"kattr({self.kernel_sym(kernel, op)!r}, {attr.v})", 32, [])
        out.region.store(out.off, 4, v, op.where())
        return self.emit("0", 32, [], status=True)

    def shim_cudaKernelSetAttributeForDevice(self, op, ops):
        kernel, attr, value, _dev = ops
        if not isinstance(attr, K) or not isinstance(kernel, KH):
            raise LiftError(f"{op.where()}: kernel attribute set on run-time values")
        value = self.scalar(value, op)
        self.effect(f"set_attr({self.kernel_sym(kernel, op)!r}, {attr.v}, sx({self.x(value)}, 32))", [value])
        return self.emit("0", 32, [], status=True)

    def kernel_sym(self, kernel, op):
        if kernel.glob not in self.kernels:
            raise LiftError(f"{op.where()}: kernel @{kernel.glob} used before cudaLibraryGetKernel")
        return self.kernels[kernel.glob]

    # --- emission
    def live_code(self, roots, indent="    ", launch_code=None, lines=None):
        """Code of the lines that matter (effects, launches, what they read); loop bodies are kept whole."""
        lines = self.lines if lines is None else lines
        need = {v.name for v in roots if isinstance(v, S)}
        keep = []
        for tgt, code, deps, eff in reversed(lines):
            if eff or tgt in need:
                keep.append((tgt, code))
                need.update(d.name for d in deps if isinstance(d, S))
        out = []
        for tgt, code in reversed(keep):
            if isinstance(code, tuple) and code[0] == "LAUNCH":
                out += [f"{indent}{ln}" for ln in launch_code[code[1]]]
            elif isinstance(code, tuple):
                head, inner = code
                out.append(f"{indent}{head}")
                out += self.live_code([], indent + "    ", launch_code, [(t, c, d, True) for t, c, d, _ in inner]) or [f"{indent}    pass"]
            else:
                out.append(f"{indent}{tgt} = {code}" if tgt else f"{indent}{code}")
        return out


_BINOPS = {
    "llvm.fmul": ("f32mul", True),  # host-side scale folding (softmax_scale * log2(e)), on bit patterns
    "llvm.add": ("(({a} + {b}) & {m})", False),
    "llvm.sub": ("(({a} - {b}) & {m})", False),
    "llvm.mul": ("(({a} * {b}) & {m})", False),
    "llvm.and": ("({a} & {b})", False),
    "llvm.or": ("({a} | {b})", False),
    "llvm.xor": ("({a} ^ {b})", False),
    "llvm.shl": ("shl", True),
    "llvm.lshr": ("lshr", True),
    "llvm.ashr": ("ashr", True),
    "llvm.udiv": ("udiv", True),
    "llvm.urem": ("urem", True),
    "llvm.sdiv": ("sdiv", True),
    "llvm.srem": ("srem", True),
}


def _fold(n, a, b, bits, op):
    from .runtime import lifted as L

    try:
        if n in ("llvm.add", "llvm.sub", "llvm.mul", "llvm.and", "llvm.or", "llvm.xor"):
            f = {"llvm.add": a + b, "llvm.sub": a - b, "llvm.mul": a * b, "llvm.and": a & b, "llvm.or": a | b, "llvm.xor": a ^ b}[n]
            return f & _mask(bits)
        return getattr(L, _BINOPS[n][0])(a, b, bits)
    except Exception as e:
        raise LiftError(f"{op.where()}: constant {n} is undefined ({e})") from None


def _cmp(pred, a, b, bits):
    if pred in _SIGNED:
        def sx(v):
            return v - (1 << bits) if v >> (bits - 1) else v
        a, b, pred = sx(a), sx(b), _SIGNED[pred]
    return {"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[pred]


def _is_error_path(func, label, seen=None):
    """A block that, through unconditional branches only, ends in trap/unreachable."""
    seen = seen or set()
    if label in seen:
        return False
    seen.add(label)
    for op in func.blocks[label].ops:
        if op.name in ("llvm.intr.trap", "llvm.unreachable"):
            return True
        if op.name == "llvm.br":
            return _is_error_path(func, op.successors[0], seen)
        if op.name in ("llvm.cond_br", "llvm.return"):
            return False
    return False


_PURE = {"llvm.mlir.constant", "llvm.icmp", "llvm.select", "llvm.zext", "llvm.sext", "llvm.trunc", "llvm.br", "llvm.cond_br", *_BINOPS}


def _succs(func, label):
    term = func.blocks[label].ops[-1]
    return list(term.successors) if term.name in ("llvm.br", "llvm.cond_br") else []


def _natural_loop(func, header):
    """Blocks of the natural loop(s) with this header: those that reach a back edge into it without
    passing through it (empty when nothing loops back)."""
    preds = {}
    for b in func.blocks:
        for x in _succs(func, b):
            preds.setdefault(x, []).append(b)
    # back edges: from blocks the header dominates (no path from the entry that avoids the header
    # reaches them)
    latches = [p for p in preds.get(header, []) if _reaches(func, header, p) and not _reaches(func, func.entry, p, avoid=header)]
    body, todo = {header}, list(latches)
    while todo:
        b = todo.pop()
        if b in body:
            continue
        body.add(b)
        todo += preds.get(b, [])
    return body if latches else set()


def _reaches(func, start, target, avoid=None):
    """Whether ``target`` can be reached from block ``start`` (without passing block ``avoid``)."""
    seen, todo = {avoid}, [start]
    while todo:
        b = todo.pop()
        if b == target:
            return True
        if b in seen:
            continue
        seen.add(b)
        todo += _succs(func, b)
    return False


def _abnormal_exit(func, label):
    """An error path (trap), or a block that only returns a status some call produced (a failed launch)."""
    if _is_error_path(func, label):
        return True
    ops = func.blocks[label].ops
    if len(ops) == 1 and ops[0].name == "llvm.return" and len(ops[0].operands) == 1:
        v = ops[0].operands[0]
        return any(o.name == "llvm.call" and v in o.results for b in func.blocks.values() for o in b.ops)
    return False


def _join(func, t, f, skip_errors=True):
    """(join, blocks between) for the paths from ``t`` and ``f``: their nearest common post-dominator
    (immediate post-dominators by the iterative set formulation), error exits left out unless
    ``skip_errors`` is false; (None, None) when they never rejoin."""
    labels = list(func.blocks)
    bad = {b for b in labels if _abnormal_exit(func, b)} if skip_errors else set()
    succ = {b: [x for x in _succs(func, b) if x not in bad] for b in labels}
    pdom = {b: set(labels) for b in labels}
    for b in labels:
        if not succ[b]:
            pdom[b] = {b}
    changed = True
    while changed:
        changed = False
        for b in labels:
            if not succ[b]:
                continue
            new = {b} | set.intersection(*(pdom[x] for x in succ[b]))
            if new != pdom[b]:
                pdom[b], changed = new, True
    cands = pdom[t] & pdom[f]
    join = next((j for j in cands if cands <= pdom[j]), None)
    if join is None:
        return None, None
    region, todo = set(), [t, f]
    while todo:
        b = todo.pop()
        if b == join or b in region:
            continue
        region.add(b)
        todo += succ[b]
    return join, region


def _pure_region(func, op, t, f):
    """(join, blocks, None) when the paths from a run-time branch rejoin at one block and run only
    pure integer ops until then; else (None, None, why)."""
    join, region = _join(func, t, f, skip_errors=False)
    if join is None:
        return None, None, "its paths never rejoin"
    for b in region:
        for o in func.blocks[b].ops:
            if o.name not in _PURE:
                return None, None, f"{o.name} at host.mlir line {o.line}"
            if o.name == "llvm.mlir.constant" and not isinstance(o.result_type, ir.Int):
                return None, None, f"a non-integer constant at host.mlir line {o.line}"
    return join, region, None


def _region_source(func, region, join, tside, fside, outer):
    """Python source of a state machine over ``region``: block by block, returns the join's arguments."""
    def name(v):
        return "r" + v.lstrip("%").replace("#", "_")

    defined = {a for b in region for a, _ in func.blocks[b].args} | {r for b in region for o in func.blocks[b].ops for r in o.results}

    def val(v):
        return name(v) if v in defined else outer(v)

    order = sorted(region, key=list(func.blocks).index)
    ids = {b: i for i, b in enumerate(order)}

    def goto(target, vals, ind):
        if target == join:
            return [f"{ind}return ({''.join(val(v) + ', ' for v in vals)})"]
        lines = [f"{ind}b = {ids[target]}"]
        names = [name(an) for an, _ in func.blocks[target].args]
        if names:  # one tuple assignment: block arguments are assigned in parallel
            lines.append(f"{ind}{', '.join(names)} = {', '.join(val(v) for v in vals)}")
        return lines

    body = ["    steps = 0"]
    (t, tv), (f, fv) = tside, fside
    body += ["    if c:", *goto(t, tv, "        "), "    else:", *goto(f, fv, "        ")]
    body += ["    while True:", "        steps += 1", "        if steps > 1000000:",
             "            raise LaunchError('a run-time loop of the host code did not finish')"]
    for b in order:
        body.append(f"        {'if' if b == order[0] else 'elif'} b == {ids[b]}:")
        ind = "            "
        for o in func.blocks[b].ops:
            a = [val(x) for x in o.operands]
            r = name(o.results[0]) if o.results else None
            if o.name == "llvm.mlir.constant":
                body.append(f"{ind}{r} = {ir.attr_int(o.prop('value')) & _mask(o.result_type.bits)}")
            elif o.name in _BINOPS:
                bits = o.result_type.bits
                fn, needs = _BINOPS[o.name]
                body.append(f"{ind}{r} = " + (f"{fn}({a[0]}, {a[1]}, {bits})" if needs else fn.format(a=a[0], b=a[1], m=hex(_mask(bits)))))
            elif o.name == "llvm.icmp":
                pred = _ICMP[ir.attr_int(o.prop("predicate"))]
                bits = o.operand_types[0].bits
                cmp = f"sx({a[0]}, {bits}) {_SIGNED[pred]} sx({a[1]}, {bits})" if pred in _SIGNED else f"{a[0]} {pred} {a[1]}"
                body.append(f"{ind}{r} = int({cmp})")
            elif o.name == "llvm.select":
                body.append(f"{ind}{r} = {a[1]} if {a[0]} else {a[2]}")
            elif o.name == "llvm.zext":
                body.append(f"{ind}{r} = {a[0]}")
            elif o.name == "llvm.trunc":
                body.append(f"{ind}{r} = {a[0]} & {hex(_mask(o.result_type.bits))}")
            elif o.name == "llvm.sext":
                body.append(f"{ind}{r} = sx({a[0]}, {o.operand_types[0].bits}) & {hex(_mask(o.result_type.bits))}")
            elif o.name == "llvm.br":
                body += goto(o.successors[0], o.operands, ind)
            elif o.name == "llvm.cond_br":
                seg = ir.attr_ints(o.prop("operandSegmentSizes"))
                tv_, fv_ = o.operands[1 : 1 + seg[1]], o.operands[1 + seg[1] :]
                body += [f"{ind}if {a[0]}:", *goto(o.successors[0], tv_, ind + "    "), f"{ind}else:", *goto(o.successors[1], fv_, ind + "    ")]
    return "\n".join(body) + "\n"


def _err_text(op, func, label):
    return f"the host code of this kernel takes its error path at host.mlir line {op.line} (block {label} of {func.name}); the arguments are outside what the kernel supports"


# --- entry point ---------------------------------------------------------------------------------


def cubin_param_layout(cubin: bytes) -> dict:
    """kernel symbol -> [(offset, size)] of its parameters, from the cubin's EIATTR_KPARAM_INFO."""
    from .cubin import read_cubin

    return {k.name: [(p.offset, p.size) for p in k.params] for k in read_cubin(cubin).kernels}


def lift(host_mlir: str, entry_function: str, title: str = "", param_layout: dict | None = None) -> str:
    """Lift ``entry_function`` of ``host_mlir`` (generic form) into launcher module source.

    ``param_layout`` maps kernel symbol -> [(offset, size)] of its parameters, from the cubin.
    """
    m = ir.parse_module(host_mlir)
    if entry_function not in m.funcs:
        raise LiftError(f"host module has no function {entry_function!r} (has: {sorted(m.funcs)})")

    # per-device setup: cuda_load_to_device(library**, device)
    setup = _Lifter(m)
    if "cuda_load_to_device" not in m.funcs:
        raise LiftError("host module has no cuda_load_to_device; cannot learn the kernel set-up the JIT performs")
    lib = Region("library handle", 8)
    lib.fields[0] = (8, S("library", 64))
    setup.run(m.funcs["cuda_load_to_device"], [P(lib, 0), S("device", 32)])
    kernels = dict(setup.kernels)

    main = _Lifter(m)
    main.kernels = kernels
    f = m.funcs[entry_function]
    args, arg_spec, norm = [], [], []
    for i, (nm, ty) in enumerate(f.args):
        t = ir.parse_type(ty)
        v, spec = _arg_value(t, f"a{i}", main)
        args.append(v)
        arg_spec += spec
    for name, kind in arg_spec:
        if kind == "f32":
            norm.append(f"    {name} = f32bits({name})")
        elif kind.startswith("i") and kind != "i64":
            norm.append(f"    {name} &= {hex(_mask(int(kind[1:])))}")
    main.run(f, args)
    if not main.launches:
        raise LiftError(f"{entry_function} launches no kernel")
    return _emit(title, arg_spec, norm, setup, main, kernels, param_layout)


def _arg_value(t, name, lifter):
    if isinstance(t, ir.Ptr):
        return S(name, 64), [(name, "ptr")]
    if isinstance(t, ir.Int):
        return S(name, t.bits), [(name, f"i{t.bits}")]
    if isinstance(t, ir.Float) and t.bits == 32:
        # passed as its bit pattern: the host code only moves it into kernel parameters (a float op
        # on it would be an unknown op and fail closed)
        return S(name, 32), [(name, "f32")]
    if isinstance(t, ir.Struct):
        items, spec = [], []
        for j, ft in enumerate(t.fields):
            v, s = _arg_value(ft, f"{name}_{j}", lifter)
            items.append(v)
            spec += s
        return A(tuple(items)), spec
    raise LiftError(f"entry argument {name} has type {t}, which the lifter does not pass")


def _emit(title, arg_spec, norm, setup, main, kernels, param_layout):
    launches_meta, structs, launch_code = [], [], {}
    for li, L in enumerate(main.launches):
        if L.kernel not in kernels:
            raise LiftError(f"launch {li} uses kernel global {L.kernel} that cuda_load_to_device never loads")
        offs, size, template, writes, unwritten = [], 0, bytearray(), [], []
        layout = param_layout.get(kernels[L.kernel]) if param_layout is not None else None
        if layout is not None and [s for _, s in layout] != [pr.region.size for pr in L.params]:
            raise LiftError(f"launch {li}: the host code passes parameters of sizes {[pr.region.size for pr in L.params]}, the cubin's kernel takes {[s for _, s in layout]}")
        for pi, pr in enumerate(L.params):
            # param buffer layout: the cubin's EIATTR_KPARAM_INFO when given (a TMA descriptor's
            # offset depends on where the arch's constant bank puts the params), else natural alignment
            psize = pr.region.size
            if layout is not None:
                size = layout[pi][0]
            else:
                align = _region_align(pr.region)
                size = (size + align - 1) // align * align
            offs.append((size, psize))
            template.extend(b"\0" * (size + psize - len(template)))
            covered = bytearray(psize)
            for o, (s, v) in sorted(pr.region.fields.items()):
                if isinstance(v, K):
                    template[size + o : size + o + s] = v.v.to_bytes(s, "little")
                elif isinstance(v, S):
                    if s not in _PACK:
                        raise LiftError(f"launch {li}: a {s}-byte run-time field in a kernel parameter")
                    writes.append((size + o, s, v))
                elif v is POISON:
                    continue
                else:
                    raise LiftError(f"launch {li}: kernel parameter holds {v!r}, which cannot be passed to a GPU")
                covered[o : o + s] = b"\1" * s
            unwritten.append([i for i, c in enumerate(covered) if not c])
            size += psize
        runs = _pack_runs(li, writes)
        structs += [ln for ln in runs if ln.startswith("_S")]
        dims = [str(d.v) if isinstance(d, K) else d.name for d in L.dims]
        launch_code[li] = [ln.strip() for ln in runs if not ln.startswith("_S")] + [f"emit({li}, ({', '.join(dims)},))"]
        launches_meta.append({
            "kernel": kernels[L.kernel],
            "params": offs,
            "param_bytes": size,
            "template": bytes(template).hex(),
            "never_written": unwritten,
            "attrs": [[aid, sorted([o, s, v] for o, (s, v) in vals.items())] for aid, vals in L.attrs],
        })
    body = main.live_code([], launch_code=launch_code)
    loops = any(isinstance(code, tuple) and code[0] != "LAUNCH" for _, code, _, _ in main.lines)
    args = ", ".join(n for n, _ in arg_spec)
    bufs = ", ".join(f"p{i}" for i in range(len(main.launches)))
    src = [
        f'"""Lifted launcher: {title}. Generated by aot.lift from host.mlir; do not edit."""',
        "from struct import Struct",
        "from aot.runtime.lifted import LaunchError, f32bits, f32mul, sx, shl, lshr, ashr, udiv, urem, sdiv, srem  # noqa: F401",
        "",
        f"ARGS = {tuple(arg_spec)!r}",
        f"KERNELS = {tuple(sorted(set(kernels.values())))!r}",
        f"LAUNCHES = {tuple(launches_meta)!r}",
        f"LOOPS = {loops!r}  # a launch site may fire more than once per call (its bytes are snapshotted)",
        "",
        "",
        "def setup(dattr, kattr, set_attr):",
        '    """Per-device kernel set-up the JIT performs in cuda_load_to_device."""',
        *(setup.live_code([]) or ["    pass"]),
        "",
        *[ln for fn in main.functions for ln in ("", fn)],
        "",
        *structs,
        "",
        "",
        f"def launch(emit, {bufs}, {args}):",
        '    """Write each launch site\'s run-time parameter bytes and call emit(site, (grid xyz, block xyz, smem, stream)), in the JIT\'s order."""',
        *norm,
        *body,
        "",
    ]
    return "\n".join(src)


def _region_align(region):
    return getattr(region, "align", 8)


def _pack_runs(li, writes):
    """Group run-time parameter fields into contiguous runs, one Struct.pack_into per run."""
    writes = sorted(writes, key=lambda w: w[0])
    runs, cur = [], []
    for w in writes:
        if cur and cur[-1][0] + cur[-1][1] == w[0]:
            cur.append(w)
        else:
            if cur:
                runs.append(cur)
            cur = [w]
    if cur:
        runs.append(cur)
    out = []
    for ri, run in enumerate(runs):
        fmt = "<" + "".join(_PACK[s] for _, s, _ in run)
        out.append(f"_S{li}_{ri} = Struct({fmt!r})")
        out.append(f"    _S{li}_{ri}.pack_into(p{li}, {run[0][0]}, {', '.join(v.name for _, _, v in run)})")
    return out
