"""The abstract interpreter: runs a host function over abstract values, recording residual code.

Each op either folds (its operands are constants, or it moves memory the lifter models) or becomes
one residual line ``(target, code, deps, effect)``; :meth:`Interpreter.live_code` keeps the lines
that effects and launches read. Calls go to a shim model (``shim_*``) or into the callee's body.
"""

from __future__ import annotations

from .. import ir
from ...errors import LiftError
from ...policy.launch import LAUNCH_ATTRS
from .arith import BINOPS, ICMP, SIGNED, compare, fold
from .control import ControlFlow
from .values import A, B, K, KH, P, PI, POISON, Launch, Region, S, flatten, mask, signed

_MAX_STEPS = 500_000
_INDEX_DYNAMIC = -2147483648  # a getelementptr raw index taken from the next dynamic operand

# op name -> handler method; a handler returns the op's result (control flow is handled in step)
_HANDLERS = {
    "llvm.mlir.constant": "op_constant",
    "llvm.mlir.zero": "op_zero",
    "llvm.mlir.poison": "op_poison",
    "llvm.mlir.undef": "op_poison",
    "llvm.mlir.addressof": "op_addressof",
    "llvm.alloca": "op_alloca",
    "llvm.getelementptr": "op_gep",
    "llvm.store": "op_store",
    "llvm.load": "op_load",
    "llvm.insertvalue": "op_insertvalue",
    "llvm.extractvalue": "op_extractvalue",
    **{n: "op_binop" for n in BINOPS},
    "llvm.icmp": "op_icmp",
    "llvm.select": "op_select",
    **{n: "op_cast" for n in ("llvm.zext", "llvm.sext", "llvm.trunc")},
    **{n: "op_ptrcast" for n in ("llvm.ptrtoint", "llvm.inttoptr", "llvm.bitcast", "llvm.addrspacecast")},
    "llvm.call": "op_call",
    "llvm.intr.trap": "op_trap",
    "llvm.unreachable": "op_trap",
    "llvm.intr.assume": "op_assume",
}


class Interpreter(ControlFlow):
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
        self.literals = {}  # ("f32", bit pattern) or ("i32", value) -> launcher argument name (lift's ``literals``)
        self.literals_seen = {}  # that key -> host.mlir lines of the constants that hold it

    # --- residual code

    def emit(self, code, bits, deps, status=False, okwhen=None):
        self.n += 1
        name = f"v{self.n}"
        self.lines.append((name, code, deps, False))
        return S(name, bits, status, okwhen)

    def effect(self, code, deps):
        self.lines.append((None, code, deps, True))

    def x(self, v):
        return str(v.v) if isinstance(v, K) else v.name

    def scalar(self, v, op):
        if isinstance(v, (K, S)):
            return v
        raise LiftError(f"{op.where()}: arithmetic on {v!r}")

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
            elif isinstance(code, tuple):  # a nested block: every line in it runs, so all are effects
                head, inner = code
                out.append(f"{indent}{head}")
                out += self.live_code([], indent + "    ", launch_code, [(t, c, d, True) for t, c, d, _ in inner]) or [f"{indent}    pass"]
            else:
                out.append(f"{indent}{tgt} = {code}" if tgt else f"{indent}{code}")
        return out

    # --- running functions

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
            target, vals = self.run_block(func, env, label)
            if target is None:  # the function returned vals
                return vals
            if stop is not None and target == stop:
                return ("stop", vals)
            blk = func.blocks.get(target)
            if blk is None:
                raise LiftError(f"{func.name}: branch to unknown block {target}")
            for (nm, _), v in zip(blk.args, vals):
                env[nm] = v
            label = target

    def run_block(self, func, env, label):
        """Run one block: (successor, its arguments), or (None, the returned value)."""
        for op in func.blocks[label].ops:
            self.steps += 1
            if self.steps > _MAX_STEPS:
                raise LiftError(f"{op.where()}: host code did not finish within {_MAX_STEPS} steps (a loop on a run-time value?)")
            res = self.step(op, env, func)
            if isinstance(res, tuple) and res[0] in ("jump", "return"):
                return res[1:] if res[0] == "jump" else (None, res[1])
        raise LiftError(f"block {label} of {func.name} has no terminator")

    def val(self, env, name, op):
        try:
            return env[name]
        except KeyError:
            raise LiftError(f"{op.where()}: use of {name} before definition") from None

    def step(self, op: ir.Op, env, func):
        n = op.name
        ops = [self.val(env, o, op) for o in op.operands]
        if n == "llvm.br":
            return ("jump", op.successors[0], ops)
        if n == "llvm.cond_br":
            return self.cond_br(op, ops, func)
        if n == "llvm.return":
            return ("return", ops[0] if ops else None)
        handler = _HANDLERS.get(n)
        if handler is None:
            raise LiftError(f"{op.where()}: op {n} is not understood by the lifter; teach dsa_aot/toolchain/lift/ (and "
                            f"dsa_aot/toolchain/verify.py) its semantics")
        res = getattr(self, handler)(op, ops)
        if op.results:
            env[op.results[0]] = res
        return None

    # --- op handlers: values

    def op_constant(self, op, ops):
        raw = op.prop("value")
        t = op.result_type
        if raw.startswith('"'):
            return B(ir.attr_bytes(raw))
        if isinstance(t, ir.Int):
            v = ir.attr_int(raw) & mask(t.bits)
            if t.bits == 32 and ("i32", v) in self.literals:  # an int the host code bakes in but the launcher takes per call
                self.literals_seen.setdefault(("i32", v), set()).add(op.line)
                return S(self.literals["i32", v], 32)
            return K(v, t.bits)
        if isinstance(t, ir.Vector):
            return A(tuple(K(x & mask(t.elem.bits), t.elem.bits) for x in ir.attr_dense(raw, t.n)))
        if isinstance(t, ir.Float) and t.bits == 32:  # kept as its bit pattern, like f32 arguments
            bits = ir.attr_f32_bits(raw)
            if ("f32", bits) in self.literals:  # a value the host code bakes in but the launcher takes per call
                self.literals_seen.setdefault(("f32", bits), set()).add(op.line)
                return S(self.literals["f32", bits], 32)
            return K(bits, 32)
        raise LiftError(f"{op.where()}: constant {raw[:60]!r} of type {t}")

    def op_zero(self, op, ops):
        t = op.result_type
        return K(0, 64 if isinstance(t, ir.Ptr) else t.bits) if isinstance(t, (ir.Ptr, ir.Int)) else POISON

    def op_poison(self, op, ops):
        return POISON

    def op_insertvalue(self, op, ops):
        agg, v = ops
        return self.insert(agg, ir.attr_ints(op.prop("position")), v, op.result_type)

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

    def op_extractvalue(self, op, ops):
        v = ops[0]
        for i in ir.attr_ints(op.prop("position")):
            if not isinstance(v, A):
                raise LiftError(f"{op.where()}: extractvalue from {v!r}")
            v = v.items[i]
        return v

    def op_binop(self, op, ops):
        a, b = (self.scalar(v, op) for v in ops)
        bits = op.result_type.bits
        if isinstance(a, K) and isinstance(b, K):
            return K(fold(op.name, a.v, b.v, bits, op.where()), bits)
        fn, needs = BINOPS[op.name]
        return self.emit(f"{fn}({self.x(a)}, {self.x(b)}, {bits})" if needs else fn.format(a=self.x(a), b=self.x(b), m=hex(mask(bits))), bits, [a, b])

    def op_icmp(self, op, ops):
        a, b = (self.scalar(v, op) for v in ops)
        pred = ICMP[ir.attr_int(op.prop("predicate"))]
        bits = op.operand_types[0].bits if isinstance(op.operand_types[0], ir.Int) else 64
        if isinstance(a, K) and isinstance(b, K):
            return K(int(compare(pred, a.v, b.v, bits)), 1)
        # status == 0 / status != 0 on a shim's result: cond_br follows the side this says is success
        okwhen = None
        st, other = (a, b) if isinstance(a, S) and a.status else (b, a)
        if isinstance(st, S) and st.status and isinstance(other, K) and other.v == 0 and pred in ("==", "!="):
            okwhen = pred == "=="
        if pred in SIGNED:
            code = f"(sx({self.x(a)}, {bits}) {SIGNED[pred]} sx({self.x(b)}, {bits}))"
        else:
            code = f"({self.x(a)} {pred} {self.x(b)})"
        return self.emit(code, 1, [a, b], okwhen=okwhen)

    def op_select(self, op, ops):
        c, a, b = ops
        if isinstance(c, K):
            return a if c.v else b
        a, b = self.scalar(a, op), self.scalar(b, op)
        return self.emit(f"({self.x(a)} if {c.name} else {self.x(b)})", op.result_type.bits, [c, a, b])

    def op_cast(self, op, ops):
        n, v = op.name, self.scalar(ops[0], op)
        src = op.operand_types[0].bits
        dst = op.result_type.bits
        if isinstance(v, K):
            return K((signed(v.v, src) if n == "llvm.sext" else v.v) & mask(dst), dst)
        if n == "llvm.zext":  # values are unsigned already: the same residual, wider
            return S(v.name, dst)
        if n == "llvm.trunc":
            return self.emit(f"({v.name} & {hex(mask(dst))})", dst, [v])
        return self.emit(f"(sx({v.name}, {src}) & {hex(mask(dst))})", dst, [v])

    def op_ptrcast(self, op, ops):
        n, v = op.name, ops[0]
        if n == "llvm.ptrtoint" and isinstance(v, (P, KH)):
            return PI(v)  # the TMA descriptor copy round-trips its alloca through an integer
        if n == "llvm.inttoptr" and isinstance(v, PI):
            return v.ptr
        if isinstance(v, (P, KH, PI)) and n in ("llvm.ptrtoint", "llvm.inttoptr"):
            raise LiftError(f"{op.where()}: {n} of a host-memory pointer")
        return v

    def op_trap(self, op, ops):
        raise LiftError(f"{op.where()}: the host code traps on this path")

    def op_assume(self, op, ops):
        """``llvm.intr.assume(true) ["align"(ptr, n)]``, what a pointer with an ``assumed_align`` lowers to: the
        host code may rely on ``ptr`` being a multiple of ``n`` (anything else is undefined), so the launcher
        refuses one that is not (a constant one is checked here). Any other assumption is refused."""
        bundle = (op.prop("op_bundle_tags"), op.prop("op_bundle_sizes"))
        if bundle != ('["align"]', "array<i32: 2>") or len(ops) != 3 or ops[0] != K(1, 1) or not isinstance(ops[2], K):
            raise LiftError(f"{op.where()}: llvm.intr.assume other than a pointer's alignment {bundle} is not understood by the lifter")
        ptr, n = self.scalar(ops[1], op), ops[2].v
        if n <= 0 or n & (n - 1):
            raise LiftError(f"{op.where()}: llvm.intr.assume of an alignment {n} that is not a power of two")
        if isinstance(ptr, K):
            if ptr.v % n:
                raise LiftError(f"{op.where()}: the host code assumes the constant {ptr.v:#x} aligned to {n} bytes")
            return None
        self.effect(f"if {ptr.name} & {n - 1}: raise LaunchError({f'a pointer the kernels assume aligned to {n} bytes is not ({op.where()})'!r})", [ptr])
        return None

    # --- op handlers: memory

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
            elif name.startswith("kernels_kernel_") or name in self.kernels:  # filled by cudaLibraryGetKernel in cuda_load_to_device
                # (its name is the kernel's symbol after "kernels_"; cudnn's MoE kernels' symbols start "cudnn_kernel_")
                r.size = 8
                r.fields[0] = (8, KH(name))
            self.globals[name] = r
            self.regions.append(r)
        return r

    def op_addressof(self, op, ops):
        return P(self.glob(ir.attr_sym(op.prop("global_name")), op.where()), 0)

    def op_alloca(self, op, ops):
        count = ops[0]
        if not isinstance(count, K):
            raise LiftError(f"{op.where()}: alloca with a run-time count")
        t = ir.parse_type(op.prop("elem_type"))
        reg = Region(f"alloca {op.results[0]} ({op.prop('elem_type')})", ir.sizeof(t) * count.v)
        self.regions.append(reg)
        # a kernel parameter's slot in the param buffer keeps the alloca's alignment (a TMA
        # descriptor is 64-byte aligned; the cubin's KPARAM_INFO check confirms it)
        reg.align = max(ir.alignof(t), ir.attr_int(op.prop("alignment")) if "alignment" in op.props else 1)
        return P(reg, 0)

    def op_store(self, op, ops):
        v, p = ops
        if not isinstance(p, P):
            raise LiftError(f"{op.where()}: store through a pointer the lifter does not model ({p!r})")
        for off, size, x in flatten(op.operand_types[0], v):
            p.region.store(p.off + off, size, x, op.where())

    def op_load(self, op, ops):
        p = ops[0]
        if not isinstance(p, P):
            raise LiftError(f"{op.where()}: load through a pointer the lifter does not model ({p!r})")
        return self.load(op.result_type, p, op.where())

    def load(self, t, p, where):
        if isinstance(t, (ir.Int, ir.Float, ir.Ptr)):
            return p.region.load(p.off, ir.sizeof(t), where)
        if isinstance(t, ir.Struct):
            return A(tuple(self.load(ft, P(p.region, p.off + o), where) for ft, o in zip(t.fields, ir.field_offsets(t))))
        if isinstance(t, ir.Array):
            f = p.region.fields.get(p.off)
            if f is not None and isinstance(f[1], B) and f[0] == ir.sizeof(t):  # a whole string constant
                return f[1]
            return A(tuple(self.load(t.elem, P(p.region, p.off + i * ir.sizeof(t.elem)), where) for i in range(t.n)))
        raise LiftError(f"{where}: load of type {t}")

    def op_gep(self, op, ops):
        base, dyn = ops[0], list(ops[1:])
        if isinstance(base, (K, S)) and isinstance(op.operand_types[0], ir.Ptr) and op.operand_types[0].space == 1:
            return self.device_gep(op, base, dyn)
        if not isinstance(base, P):
            raise LiftError(f"{op.where()}: getelementptr on {base!r}")
        idx = []
        for raw in ir.attr_ints(op.prop("rawConstantIndices")):
            if raw == _INDEX_DYNAMIC:
                v = dyn.pop(0)
                if not isinstance(v, K):
                    raise LiftError(f"{op.where()}: getelementptr with a run-time index into host memory")
                raw = signed(v.v, v.bits)
            idx.append(raw)
        try:
            return P(base.region, base.off + ir.gep_offset(ir.parse_type(op.prop("elem_type")), idx))
        except ValueError as e:
            raise LiftError(f"{op.where()}: {e}") from None

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
                step = None  # a field: its offset, which needs a constant index
            else:
                raise LiftError(f"{op.where()}: getelementptr index into scalar {cur}")
            if raw == _INDEX_DYNAMIC:
                v, vt = self.scalar(dyn.pop(0), op), tys.pop(0)
                if step is None:
                    raise LiftError(f"{op.where()}: getelementptr with a run-time struct field index")
                if isinstance(v, K):
                    const += signed(v.v, v.bits) * step
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
            return K((base.v + const) & mask(64), 64)
        expr = " + ".join([self.x(base)] + terms + ([str(const)] if const else []))
        return self.emit(f"(({expr}) & 0xffffffffffffffff)", 64, deps)

    # --- calls

    def op_call(self, op, ops):
        callee = ir.attr_sym(op.prop("callee"))
        h = getattr(self, "shim" + callee, None)
        if h is not None:
            return h(op, ops)
        f = self.m.funcs.get(callee)
        if f is not None and f.blocks:
            return self.run(f, ops)
        raise LiftError(f"{op.where()}: call to @{callee} is not understood by the lifter (known shims: {sorted(s[4:] for s in dir(self) if s.startswith('shim_'))})")

    def ok(self):
        """A shim's CUDA status: success, as a residual so status checks are recognised (okwhen)."""
        return self.emit("0", 32, [], status=True)

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
        attrs = [self.launch_attr(cfg.items[4], i, w) for i in range(nattr.v)]
        if not isinstance(params, P):
            raise LiftError(f"{w}: kernel params are {params!r}")
        plist = []
        for i in range(params.region.size // 8):
            pp = params.region.load(params.off + 8 * i, 8, w)
            if not isinstance(pp, P):
                raise LiftError(f"{w}: kernel param {i} points to {pp!r}")
            plist.append(pp)
        self.launches.append(Launch(kernel.glob, tuple(dims), attrs, plist))
        deps = [d for d in dims if isinstance(d, S)] + [v for pr in plist for _, (_, v) in pr.region.fields.items() if isinstance(v, S)]
        self.lines.append((None, ("LAUNCH", len(self.launches) - 1), deps, True))
        return self.ok()

    def launch_attr(self, ap, i, w):
        """(id, {value offset: (size, constant)}) of the i-th 72-byte CUlaunchAttribute at ``ap``."""
        base = P(ap.region, ap.off + 72 * i)
        aid = base.region.load(base.off, 4, w)
        if not isinstance(aid, K) or aid.v not in LAUNCH_ATTRS:
            raise LiftError(f"{w}: launch attribute {aid!r} is not one the runtime can set (known: {LAUNCH_ATTRS})")
        vals = {}
        for o, (s, v) in base.region.fields.items():
            if base.off + 8 <= o < base.off + 72:  # the value union follows the id and its padding
                if not isinstance(v, K):
                    raise LiftError(f"{w}: launch attribute {LAUNCH_ATTRS[aid.v]} has a run-time value")
                vals[o - base.off - 8] = (s, v.v)
        return (aid.v, vals)

    # --- shims: per-device setup (cuda_load_to_device)

    def shim_cudaDeviceGetAttribute(self, op, ops):
        out, attr, _dev = ops
        if not isinstance(attr, K):
            raise LiftError(f"{op.where()}: device attribute id is a run-time value")
        v = self.emit(f"dattr({attr.v})", 32, [])
        out.region.store(out.off, 4, v, op.where())
        return self.ok()

    def shim_cudaLibraryGetKernel(self, op, ops):
        gptr, _lib, name = ops
        data = name.region.fields.get(name.off)
        if not isinstance(gptr, P) or data is None or not isinstance(data[1], B):
            raise LiftError(f"{op.where()}: cudaLibraryGetKernel with a kernel name the lifter cannot read")
        sym = data[1].data.split(b"\0")[0].decode()
        glob = gptr.region.name[1:]
        self.kernels[glob] = sym
        gptr.region.store(0, 8, KH(glob), op.where())
        return self.ok()

    def shim_cuKernelGetAttribute(self, op, ops):
        out, attr, kernel, _dev = ops
        if not isinstance(attr, K) or not isinstance(kernel, KH):
            raise LiftError(f"{op.where()}: cuKernelGetAttribute on run-time values")
        v = self.emit(f"kattr({self.kernel_sym(kernel, op)!r}, {attr.v})", 32, [])
        out.region.store(out.off, 4, v, op.where())
        return self.ok()

    def shim_cudaKernelSetAttributeForDevice(self, op, ops):
        kernel, attr, value, _dev = ops
        if not isinstance(attr, K) or not isinstance(kernel, KH):
            raise LiftError(f"{op.where()}: kernel attribute set on run-time values")
        value = self.scalar(value, op)
        self.effect(f"set_attr({self.kernel_sym(kernel, op)!r}, {attr.v}, sx({self.x(value)}, 32))", [value])
        return self.ok()

    def kernel_sym(self, kernel, op):
        if kernel.glob not in self.kernels:
            raise LiftError(f"{op.where()}: kernel @{kernel.glob} used before cudaLibraryGetKernel")
        return self.kernels[kernel.glob]
