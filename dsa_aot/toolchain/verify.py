"""Stage 4 — verify: check a lifted launcher against an independent concrete interpreter and the cubin.

The concrete interpreter runs the same host.mlir with concrete arguments on a byte-addressed memory
(every alloca and global gets an address; loads and stores move bytes), exactly as the JIT's host
code would run, and records each launch as the driver would see it: kernel, grid, block, shared
memory, stream, attribute bytes and, for every kernel parameter, the bytes at its pointer (sizes taken
from the cubin's own EIATTR_KPARAM_INFO table, not from the lifter). It shares only the parser and the
LLVM type layout with the lifter.

Checks per entry (any failure raises :class:`VerifyError`):
  (a) on >= 50 random argument sets, the lifted ``launch`` gives the same launches, byte for byte,
      except bytes the JIT never writes; the lifted ``setup`` makes the same attribute calls;
  (b) every parameter's offset and size in the launcher equal the cubin's parameter table;
  (c) the fatbin embedded in the host module (global ``kernels_binary``) contains the shipped cubin.

Public function: :func:`verify` -> dict report (artifact: ``verify.json``).
"""

from __future__ import annotations

import random
import struct

from . import ir
from .cubin import read_cubin
from ..errors import LaunchError, VerifyError

__all__ = ["verify", "run_concrete", "load_launcher"]

_ALLOCA_BASE, _GLOBAL_BASE, _STRIDE = 0x7F0000000000, 0x7E0000000000, 1 << 24


class _TooLong(Exception):
    pass


class _Trap(Exception):
    pass


class _Machine:
    """Concrete interpreter of the host module's LLVM dialect subset."""

    def __init__(self, module, shims, max_steps=2_000_000):
        self.m, self.shims = module, shims
        self.max_steps = max_steps
        self.mem = {}  # base -> [bytearray, written mask]
        self.nalloca = 0
        self.gaddr = {}
        self.steps = 0
        self.literals = {}  # ("f32", constant bits) / ("i32", value) the spec compiled in -> the bits this run uses instead

    # memory
    def region(self, addr, size):
        base = addr - addr % _STRIDE
        r = self.mem.get(base)
        if r is None or addr - base + size > len(r[0]):
            raise VerifyError(f"concrete interpreter: access of {size} bytes at {addr:#x} outside any allocation")
        return r, addr - base

    def read(self, addr, size):
        (buf, _), o = self.region(addr, size)
        return bytes(buf[o : o + size])

    def write(self, addr, data):
        (buf, mask), o = self.region(addr, len(data))
        buf[o : o + len(data)] = data
        mask[o : o + len(data)] = b"\1" * len(data)

    def alloc(self, size, base_space=_ALLOCA_BASE):
        self.nalloca += 1
        base = base_space + self.nalloca * _STRIDE
        self.mem[base] = [bytearray(size), bytearray(size)]
        return base

    def global_addr(self, name):
        if name not in self.gaddr:
            g = self.m.globals[name]
            raw = g.props.get("value", "")
            data = ir.attr_bytes(raw) if raw.startswith('"') else b""
            a = self.alloc(max(8, len(data)), _GLOBAL_BASE)
            if data:
                self.write(a, data)
            self.gaddr[name] = a
        return self.gaddr[name]

    # values <-> bytes
    def encode(self, t, v):
        if isinstance(t, (ir.Int, ir.Float, ir.Ptr)):  # floats travel as their bit patterns
            n = ir.sizeof(t)
            return None if v is None else (v & ((1 << (8 * n)) - 1)).to_bytes(n, "little")
        if isinstance(v, bytes):
            return v
        out = bytearray(ir.sizeof(t))
        if v is None:
            return None
        if isinstance(t, ir.Struct):
            parts = zip(t.fields, ir.field_offsets(t), v)
        else:
            parts = ((t.elem, i * ir.sizeof(t.elem), x) for i, x in enumerate(v))
        for ft, o, x in parts:
            b = self.encode(ft, x)
            if b is not None:
                out[o : o + len(b)] = b
        return bytes(out)

    def store(self, t, v, addr):
        """Store field by field: struct padding and undefined (poison) fields stay unwritten."""
        if v is None:
            return
        if isinstance(t, (ir.Struct, ir.Array)) and not isinstance(v, bytes):
            if isinstance(t, ir.Struct):
                parts = zip(t.fields, ir.field_offsets(t), v)
            else:
                parts = ((t.elem, i * ir.sizeof(t.elem), x) for i, x in enumerate(v))
            for ft, o, x in parts:
                self.store(ft, x, addr + o)
            return
        self.write(addr, self.encode(t, v))

    def decode(self, t, b, mask=None):
        """Bytes -> value; a scalar no store ever wrote is undefined (None) and stays unwritten
        when stored again (the JIT copies TMA descriptors whose upper half it never fills)."""
        if isinstance(t, (ir.Int, ir.Float, ir.Ptr)):
            n = ir.sizeof(t)
            if mask is not None and not any(mask[:n]):
                return None
            if mask is not None and not all(mask[:n]):
                raise VerifyError(f"concrete interpreter: load of a partly written {t}")
            return int.from_bytes(b[:n], "little")
        if isinstance(t, ir.Struct):
            return [self.decode(ft, b[o:], None if mask is None else mask[o:]) for ft, o in zip(t.fields, ir.field_offsets(t))]
        step = ir.sizeof(t.elem)
        return [self.decode(t.elem, b[i * step :], None if mask is None else mask[i * step :]) for i in range(t.n)]

    def run(self, fname, args):
        f = self.m.funcs[fname]
        env = {nm: v for (nm, _), v in zip(f.args, args)}
        label = f.entry
        while True:
            jump = None
            for op in f.blocks[label].ops:
                self.steps += 1
                if self.steps > self.max_steps:
                    raise _TooLong(f"concrete interpreter: more than {self.max_steps} steps (a run-time loop with a huge trip count)")
                out = self.op(op, env)
                if out is not None:
                    if out[0] == "ret":
                        return out[1]
                    jump = out
                    break
            _, label, vals = jump
            for (nm, _), v in zip(f.blocks[label].args, vals):
                env[nm] = v

    def op(self, op, env):
        n = op.name
        a = [env[o] for o in op.operands]
        r = op.results[0] if op.results else None
        if n == "llvm.mlir.constant":
            raw = op.props["value"]
            t = op.result_type
            if raw.startswith('"'):
                env[r] = ir.attr_bytes(raw)
            elif isinstance(t, ir.Vector):
                env[r] = [x & ((1 << t.elem.bits) - 1) for x in ir.attr_dense(raw, t.n)]
            elif isinstance(t, ir.Float):
                b = ir.attr_f32_bits(raw)
                env[r] = self.literals.get(("f32", b), b)
            else:
                v = ir.attr_int(raw) & ((1 << t.bits) - 1)
                env[r] = self.literals.get(("i32", v), v) if t.bits == 32 else v
        elif n == "llvm.mlir.zero":
            env[r] = 0
        elif n in ("llvm.mlir.poison", "llvm.mlir.undef"):
            env[r] = None
        elif n == "llvm.mlir.addressof":
            env[r] = self.global_addr(ir.attr_sym(op.props["global_name"]))
        elif n == "llvm.alloca":
            env[r] = self.alloc(ir.sizeof(ir.parse_type(op.props["elem_type"])) * a[0])
        elif n == "llvm.getelementptr":
            dyn, idx = iter(zip(a[1:], op.operand_types[1:])), []
            for raw in ir.attr_ints(op.props["rawConstantIndices"]):
                if raw == -2147483648:  # a dynamic index: the next operand, signed at its own width
                    v, vt = next(dyn)
                    raw = _s(v, vt.bits)
                idx.append(raw)
            env[r] = a[0] + ir.gep_offset(ir.parse_type(op.props["elem_type"]), idx)
        elif n == "llvm.store":
            self.store(op.operand_types[0], a[0], a[1])
        elif n == "llvm.load":
            t = op.result_type
            (_, mask), o = self.region(a[0], ir.sizeof(t))
            env[r] = self.decode(t, self.read(a[0], ir.sizeof(t)), bytes(mask[o : o + ir.sizeof(t)]))
        elif n == "llvm.insertvalue":
            t = op.result_type
            agg = a[0] if a[0] is not None else _empty(t)
            env[r] = _insert(agg, ir.attr_ints(op.props["position"]), a[1])
        elif n == "llvm.extractvalue":
            v = a[0]
            for i in ir.attr_ints(op.props["position"]):
                v = v[i]
            env[r] = v
        elif n in _ARITH:
            bits = op.result_type.bits
            env[r] = _ARITH[n](a[0], a[1], bits) & ((1 << bits) - 1)
        elif n == "llvm.icmp":
            bits = op.operand_types[0].bits if isinstance(op.operand_types[0], ir.Int) else 64
            env[r] = int(_icmp(ir.attr_int(op.props["predicate"]), a[0], a[1], bits))
        elif n == "llvm.select":
            env[r] = a[1] if a[0] else a[2]
        elif n == "llvm.zext":
            env[r] = a[0]
        elif n == "llvm.trunc":
            env[r] = a[0] & ((1 << op.result_type.bits) - 1)
        elif n == "llvm.sext":
            sb = op.operand_types[0].bits
            env[r] = _s(a[0], sb) & ((1 << op.result_type.bits) - 1)
        elif n in ("llvm.ptrtoint", "llvm.inttoptr", "llvm.bitcast", "llvm.addrspacecast"):
            env[r] = a[0]
        elif n == "llvm.br":
            return ("jmp", op.successors[0], a)
        elif n == "llvm.cond_br":
            seg = ir.attr_ints(op.props["operandSegmentSizes"])
            if a[0]:
                return ("jmp", op.successors[0], a[1 : 1 + seg[1]])
            return ("jmp", op.successors[1], a[1 + seg[1] :])
        elif n == "llvm.return":
            return ("ret", a[0] if a else None)
        elif n == "llvm.call":
            callee = ir.attr_sym(op.props["callee"])
            if callee in self.shims:
                res = self.shims[callee](self, *a)
            elif self.m.funcs.get(callee) and self.m.funcs[callee].blocks:
                res = self.run(callee, a)
            else:
                raise VerifyError(f"concrete interpreter: call to unknown @{callee}")
            if r is not None:
                env[r] = res
        elif n in ("llvm.intr.trap", "llvm.unreachable"):
            raise _Trap(f"line {op.line}")
        elif n == "llvm.intr.assume":  # a pointer's alignment (the only assumption the lifter accepts): undefined if false
            if op.props.get("op_bundle_tags") != '["align"]' or len(a) != 3:
                raise VerifyError(f"concrete interpreter: llvm.intr.assume at line {op.line} is not a pointer's alignment")
            if not a[0] or a[1] % a[2]:
                raise _Trap(f"line {op.line}: a pointer assumed aligned to {a[2]} bytes is not")
        else:
            raise VerifyError(f"concrete interpreter: op {n} at line {op.line} is not implemented")
        return None


def _empty(t):
    if isinstance(t, ir.Struct):
        return [_empty(f) if isinstance(f, (ir.Struct, ir.Array)) else None for f in t.fields]
    return [_empty(t.elem) if isinstance(t.elem, (ir.Struct, ir.Array)) else None for _ in range(t.n)]


def _insert(agg, pos, v):
    agg = list(agg)
    agg[pos[0]] = v if len(pos) == 1 else _insert(agg[pos[0]], pos[1:], v)
    return agg


def _s(v, bits):
    return v - (1 << bits) if v >> (bits - 1) else v


def _sdiv(a, b, bits):
    x, y = _s(a, bits), _s(b, bits)
    if y == 0 or (x == -(1 << (bits - 1)) and y == -1):
        raise _Trap("undefined sdiv")
    return (abs(x) // abs(y)) * (1 if (x < 0) == (y < 0) else -1)  # C: truncate toward zero


def _srem(a, b, bits):
    x, y = _s(a, bits), _s(b, bits)
    if y == 0 or (x == -(1 << (bits - 1)) and y == -1):
        raise _Trap("undefined srem")
    return x - y * _sdiv(a, b, bits)


def _udiv(a, b, bits):
    if b == 0:
        raise _Trap("udiv by zero")
    return a // b


def _urem(a, b, bits):
    if b == 0:
        raise _Trap("urem by zero")
    return a % b


def _shift(kind):
    def f(a, b, bits):
        if b >= bits:
            raise _Trap("oversized shift")
        if kind == "shl":
            return a << b
        if kind == "lshr":
            return a >> b
        return _s(a, bits) >> b

    return f


def _fmul32(a, b, n):
    """fp32 multiply through ctypes (C float arithmetic), independent of the launcher helpers."""
    import ctypes

    fa = ctypes.c_float.from_buffer_copy(a.to_bytes(4, "little")).value
    fb = ctypes.c_float.from_buffer_copy(b.to_bytes(4, "little")).value
    return int.from_bytes(bytes(ctypes.c_float(fa * fb)), "little")


_ARITH = {
    "llvm.fmul": _fmul32,
    "llvm.add": lambda a, b, n: a + b,
    "llvm.sub": lambda a, b, n: a - b,
    "llvm.mul": lambda a, b, n: a * b,
    "llvm.and": lambda a, b, n: a & b,
    "llvm.or": lambda a, b, n: a | b,
    "llvm.xor": lambda a, b, n: a ^ b,
    "llvm.sdiv": _sdiv,
    "llvm.srem": _srem,
    "llvm.udiv": _udiv,
    "llvm.urem": _urem,
    "llvm.shl": _shift("shl"),
    "llvm.lshr": _shift("lshr"),
    "llvm.ashr": _shift("ashr"),
}


def _icmp(p, a, b, bits):
    if p in (2, 3, 4, 5):
        a, b = _s(a, bits), _s(b, bits)
    return [a == b, a != b, a < b, a <= b, a > b, a >= b, a < b, a <= b, a > b, a >= b][p]


# --- running the JIT's host code concretely ------------------------------------------------------


def run_concrete(module, entry_function, args, kparams, dattr, kattr, max_steps=2_000_000, max_launches=None, literals=None):
    """Run cuda_load_to_device then ``entry_function`` on concrete ``args`` (``literals``: ("f32", constant
    bits) or ("i32", constant value) -> the bits to run with instead, the lift's literal arguments).

    Returns (setup_calls, launches); a launch is a dict with kernel, dims, attrs, params (bytes and
    written masks, per the cubin's KPARAM table of that kernel). Raises _Trap on an error path.
    """
    handles, setup_calls, launches = {}, [], []

    def get_dev_attr(mc, out, attr, dev):
        mc.write(out, struct.pack("<i", dattr(attr)))
        return 0

    def get_kernel(mc, gaddr, lib, name):
        (buf, _), o = mc.region(name, 1)
        sym = bytes(buf[o:]).split(b"\0")[0].decode()
        h = 0x5000 + len(handles)
        handles[h] = sym
        mc.write(gaddr, struct.pack("<Q", h))
        return 0

    def kern_attr(mc, out, attr, k, dev):
        mc.write(out, struct.pack("<i", kattr(handles[k], attr)))
        return 0

    def set_attr(mc, k, attr, value, dev):
        setup_calls.append((handles[k], attr, _s(value, 32)))
        return 0

    def launch(mc, cfg, k, params):
        c = mc.read(cfg, 56)
        gx, gy, gz, bx, by, bz, smem, stream, attrs, nattr = struct.unpack("<6iqQQi4x", c)
        alist = []
        for i in range(nattr):
            base = attrs + 72 * i
            (aid,) = struct.unpack("<i", mc.read(base, 4))
            (buf, mask), o = mc.region(base + 8, 64)
            alist.append((aid, bytes(buf[o : o + 64]), bytes(mask[o : o + 64])))
        sym = handles[k]
        plist = []
        for i, (_, size) in enumerate(kparams[sym]):
            (pp,) = struct.unpack("<Q", mc.read(params + 8 * i, 8))
            (buf, mask), o = mc.region(pp, size)
            plist.append((bytes(buf[o : o + size]), bytes(mask[o : o + size])))
        launches.append({"kernel": sym, "dims": (gx, gy, gz, bx, by, bz, smem, stream), "attrs": alist, "params": plist})
        if max_launches is not None and len(launches) > max_launches:
            raise _TooLong(f"more than {max_launches} launches")
        return 0

    shims = {
        "_cudaDeviceGetAttribute": get_dev_attr,
        "_cudaLibraryGetKernel": get_kernel,
        "_cuKernelGetAttribute": kern_attr,
        "_cudaKernelSetAttributeForDevice": set_attr,
        "_cudaLaunchKernelEx": launch,
        "printf": lambda mc, *a: 0,  # error paths print before they trap
    }
    mc = _Machine(module, shims, max_steps)
    mc.literals = dict(literals or {})
    lib = mc.alloc(8)
    mc.write(lib, struct.pack("<Q", 0xABCDE))
    if mc.run("cuda_load_to_device", [lib, 0]) != 0:
        raise VerifyError("concrete cuda_load_to_device returned an error")
    flat = list(args)
    f = module.funcs[entry_function]
    call_args = [_unflatten(ir.parse_type(t), flat) for _, t in f.args]
    mc.run(entry_function, call_args)
    return setup_calls, launches


def _unflatten(t, flat):
    if isinstance(t, ir.Struct):
        return [_unflatten(ft, flat) for ft in t.fields]
    return flat.pop(0)


def load_launcher(source: str, name="launcher"):
    ns = {"__name__": f"aot_lifted_{name}"}
    exec(compile(source, f"<lifted {name}>", "exec"), ns)
    return ns


def f32bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _random_args(spec, rng, loops=False):
    """Pointers: 16-byte aligned; integers: small values often (edge cases of ceil-divisions and
    bucket bounds live there), then mid-size, large positive and any bit pattern."""
    out = []
    for _, kind in spec:
        if kind == "ptr":
            out.append(rng.randrange(1, 1 << 47) * 16)
            continue
        if kind == "f32":
            out.append(rng.choice([0.0, -0.0, 1.0, 0.125, -3.5, 1e-30, 3.0e38, float("inf"), float("nan")]) * rng.choice([1, rng.random()]))
            continue
        bits = int(kind[1:])
        r = rng.random()
        if loops:  # launch loops run over extents: keep trip counts interpretable, edges still covered
            out.append(rng.randrange(0, 65) if r < 0.7 else rng.randrange(1, 4097) if r < 0.95 else rng.randrange(0, 1 << bits))
            continue
        if r < 0.35:
            out.append(rng.randrange(0, 17))
        elif r < 0.75:
            out.append(rng.randrange(1, 1 << 20))
        elif r < 0.92:
            out.append(rng.randrange(1, 1 << (bits - 1)))
        else:
            out.append(rng.randrange(0, 1 << bits))
    return out


def verify(host_mlir: str, entry_function: str, launcher_src: str, cubin: bytes, samples: int = 50, seed: int = 0, literals: dict | None = None) -> dict:
    """Run checks (a), (b), (c); return a report dict, raise VerifyError on any mismatch.

    ``literals`` (name -> the float or int value compiled in, as given to the lift): the launcher's
    trailing arguments of those names are drawn at random like any f32 / i32 argument, and the concrete
    run uses the drawn value wherever the host code holds the compiled constant."""
    module = ir.parse_module(host_mlir)
    ns = load_launcher(launcher_src)
    info = read_cubin(cubin)
    kparams = {k.name: [(p.offset, p.size) for p in k.params] for k in info.kernels}
    problems = []
    lit = dict(literals or {})
    if lit and [n for n, _ in ns["ARGS"][len(ns["ARGS"]) - len(lit):]] != list(lit):
        problems.append(f"the launcher's trailing arguments are not the literals {list(lit)}")

    # (c) the host module's embedded fatbin holds this exact cubin
    glob = module.globals.get("kernels_binary")
    if glob is None or cubin not in ir.attr_bytes(glob.props["value"]):
        problems.append("the host module's kernels_binary does not contain the shipped cubin")

    # (b) parameter layout vs the cubin
    for li, L in enumerate(ns["LAUNCHES"]):
        k = L["kernel"]
        if k not in kparams:
            problems.append(f"launch {li}: kernel {k} is not in the cubin (has {sorted(kparams)})")
            continue
        mine = [tuple(p) for p in L["params"]]
        if mine != kparams[k]:
            problems.append(f"launch {li}: parameter (offset, size) {mine} != cubin EIATTR_KPARAM_INFO {kparams[k]}")
    if problems:
        raise VerifyError("; ".join(problems))

    # (a) lifted launcher vs concrete interpretation, on random arguments
    rng = random.Random(seed)
    dvals = {97: 232448}
    calls_lifted = []
    setup_calls = None
    agree_traps = 0
    checked = attempts = too_long = most = 0
    loops = ns.get("LOOPS", False)
    # loop entries: a bounded budget skips the samples whose random extents loop for long
    budget = dict(max_steps=300_000, max_launches=256) if loops else {}
    while checked < samples:
        attempts += 1
        if attempts > 20 * samples:
            raise VerifyError(f"only {checked} of {samples} random argument sets ran to the end in the concrete interpreter ({too_long} looped too long)")
        s = attempts - 1
        kvals = {}

        def kattr(sym, attr):
            return kvals.setdefault((sym, attr), rng.randrange(0, 1 << 16))

        def dattr(attr):
            return dvals.setdefault(attr, rng.randrange(1, 1 << 20))

        args = _random_args(ns["ARGS"], rng, loops=loops)
        try:
            bits = [f32bits(a) if k == "f32" else a for a, (_, k) in zip(args, ns["ARGS"])]
            n_host = len(bits) - len(lit)
            swap = {("f32", f32bits(lit[name])) if k == "f32" else ("i32", lit[name]): b for (name, k), b in zip(ns["ARGS"][n_host:], bits[n_host:])}
            setup_calls, conc = run_concrete(module, entry_function, bits[:n_host], kparams, dattr, kattr, literals=swap, **budget)
            conc_err = None
        except _Trap as e:
            conc, conc_err = None, str(e)
        except _TooLong:
            too_long += 1  # a loop over a huge random extent: draw another sample
            continue
        checked += 1
        if s == 0 or conc is not None:
            calls_lifted.clear()
            ns["setup"](dattr, kattr, lambda k, a, v: calls_lifted.append((k, a, v)))
            if setup_calls is not None and calls_lifted != setup_calls:
                raise VerifyError(f"setup differs: lifted {calls_lifted} vs JIT host code {setup_calls}")
        bufs = [bytearray.fromhex(L["template"]) for L in ns["LAUNCHES"]]
        seq = []
        try:
            ns["launch"](lambda k, d: seq.append((k, tuple(d), bytes(bufs[k]))), *bufs, *args)
            dims, lift_err = seq, None
        except LaunchError as e:
            dims, lift_err = None, str(e)
        if conc is None or dims is None:
            if (conc is None) != (dims is None):
                raise VerifyError(f"sample {s} args {args}: JIT host code {'traps (' + conc_err + ')' if conc is None else 'runs'} but the lifted launcher {'raises: ' + lift_err if dims is None else 'runs'}")
            agree_traps += 1
            continue
        most = max(most, len(conc))
        if len(conc) != len(dims):
            raise VerifyError(f"sample {s}: {len(conc)} launches in the JIT host code, {len(dims)} lifted")
        for li, (c, (k, d, buf)) in enumerate(zip(conc, dims)):
            L = ns["LAUNCHES"][k]
            where = f"sample {s} launch {li} (site {k}) args {args}"
            if c["kernel"] != L["kernel"]:
                raise VerifyError(f"{where}: kernel {c['kernel']} vs lifted {L['kernel']}")
            cd = tuple(x & 0xFFFFFFFF if i < 6 else x for i, x in enumerate(c["dims"]))
            if cd != tuple(d):
                raise VerifyError(f"{where}: launch config (grid, block, smem, stream) {cd} vs lifted {tuple(d)}")
            lattrs = []
            for aid, fields in L["attrs"]:
                val = bytearray(64)
                for o, sz, v in fields:
                    val[o : o + sz] = v.to_bytes(sz, "little")
                lattrs.append((aid, bytes(val)))
            cattrs = [(aid, bytes(b if m else 0 for b, m in zip(val, mask))) for aid, val, mask in c["attrs"]]
            if cattrs != lattrs:
                raise VerifyError(f"{where}: launch attributes {cattrs} vs lifted {lattrs}")
            for pi, ((pbytes, pmask), (off, size)) in enumerate(zip(c["params"], L["params"])):
                mine = buf[off : off + size]
                for bi in range(size):
                    if pmask[bi] and pbytes[bi] != mine[bi]:
                        raise VerifyError(f"{where}: kernel parameter {pi} byte {bi}: JIT host code writes {pbytes[bi]:#04x}, lifted {mine[bi]:#04x}")
                never = [bi for bi in range(size) if not pmask[bi]]
                if never != L["never_written"][pi]:
                    raise VerifyError(f"{where}: parameter {pi}: bytes the JIT never writes {never} vs lifter's {L['never_written'][pi]}")
    return {
        "samples": samples,
        "samples_skipped_long_loops": too_long,
        "most_launches_in_a_sample": most,
        "error_path_samples": agree_traps,
        "launches": len(ns["LAUNCHES"]),
        "params_checked_against_cubin": {L["kernel"]: L["params"] for L in ns["LAUNCHES"]},
        "setup_calls": len(setup_calls or []),
        "fatbin_contains_cubin": True,
        "literal_arguments": sorted(lit),
        "verdict": "ok",
    }
