"""Plans: one validated call of an op, compiled to straight-line code that later calls run.

An op validates a call completely once (its module's ``_validate``), resolves the entries the call
needs on its device, and records what the call does on a :class:`Recorder`: which entries it
launches with which arguments, which bytes it zeroes (or fills) first, which torch steps follow. Arguments are
recorded symbolically: tensor data pointers as ``p[i]`` (plus a constant byte offset), the stream as
``s``, per-call fp32 scalars as ``x[j]``; extents, strides and every choice the call's shapes fix are
constants. :func:`compile_call` turns the record into one Python function, ``run(p, s, x, ts,
stream)``, whose body is the launches with those constants written in (``Call.source`` shows it): a
repeated call reads its pointers and its stream, writes them and launches.

Two users, one object (:class:`Call`): the functional ops keep a cache of calls keyed by the call's
signature (a repeated call with the same shapes and options re-checks only what its pointers can
change: alignment and overlap, :func:`dsa_aot.ops.args.recheck`), and the plan classes
(``dsa_aot.csa.CompressorForward``, ``dsa_aot.dsa.IndexerBackward``, ...) hold one, in cudnn's class shape:
built once from sample tensors and options, ``check_support()``, ``execute(...)``.
"""

from __future__ import annotations

from ..errors import LaunchError
from .args import lookup, recheck, recheck_ptrs, signature
from .checks import input_error
from .gpu import memset0, stream_handle

__all__ = ["Sym", "Recorder", "Call", "compile_call", "probe_for", "matches", "remembered", "remember", "ALLOC", "cached", "fresh", "Plan"]

_CACHE_MAX = 4096  # calls per op kept by signature (a process sees a handful of shapes)


class Sym:
    """A value only a call knows: a data pointer (plus a constant byte offset), the stream, or a scalar."""

    __slots__ = ("name", "off")

    def __init__(self, name: str, off: int = 0):
        self.name, self.off = name, off

    def __add__(self, n):
        if type(n) is not int:
            raise TypeError(f"{self!r} + {n!r}: only a constant byte offset can be added to a per-call value")
        return Sym(self.name, self.off + n) if n else self

    __radd__ = __add__

    def __repr__(self):
        return f"({self.name} + {self.off})" if self.off else self.name

    def value(self, values: dict) -> int:
        """This value given ``values`` {name: int} ("p[0]", "s", "x[0]", ...): what a replay passes."""
        return values[self.name] + self.off

    def _refuse(self, *_):
        raise TypeError(f"{self!r} is a per-call value: a plan cannot branch on it or compute with it")

    __bool__ = __int__ = __index__ = __float__ = __mul__ = __rmul__ = __sub__ = __eq__ = __lt__ = _refuse
    __hash__ = None


class Recorder:
    """What one call does, recorded with symbolic pointers ``p``, stream ``s`` and scalars ``x``.

    Order is fixed, as every op runs: torch steps that prepare an input (a transposed copy into the
    workspace), memsets, then the launches (each checked, bytes and dims, before any of those), then
    torch steps on the call's stream (a cast, zeroing an empty result)."""

    def __init__(self, n_ptrs: int, n_scalars: int = 0):
        self.p = tuple(Sym(f"p[{i}]") for i in range(n_ptrs))
        self.s = Sym("s")
        self.x = tuple(Sym(f"x[{j}]") for j in range(n_scalars))
        self.before, self.memsets, self.launches, self.after = [], [], [], []

    def memset(self, ptr, nbytes: int, word: int = 0) -> None:
        """Zero ``nbytes`` at ``ptr`` before the launches, or fill them with the 32-bit ``word``."""
        if self.launches or self.after:
            raise RuntimeError("a plan zeroes memory before its launches")
        if word and nbytes % 4:
            raise RuntimeError(f"a fill with the word 0x{word:x} covers whole words, not {nbytes} bytes")
        if nbytes:
            self.memsets.append((ptr, nbytes, word))

    def launch(self, entry, *args) -> None:
        if self.after:
            raise RuntimeError("a plan's torch steps follow its launches")
        self.launches.append((entry, args))

    def first(self, fn) -> None:
        """``fn(ts, stream)`` before the memsets and launches (once they are checked): torch work on the
        call's stream that prepares what an entry reads."""
        self.before.append(fn)

    def then(self, fn) -> None:
        """``fn(ts, stream)`` after the launches: torch work on the call's stream (see gpu.alloc_on)."""
        self.after.append(fn)


class Call:
    """One validated call of an op, compiled: ``run(p, s, x, ts, stream)``.

    ``foot``: what :func:`recheck` needs; ``meta``: per tensor (dtype, shape) or None, what a
    plan's execute() matches its tensors against; ``x``: the scalars of the validating call;
    ``scalars(**kw)``: the per-call scalars from keyword values (InputError otherwise); ``guard()``:
    per-call checks of process state (torch's deterministic mode) or None; ``keep``: device memory the
    call owns (tables its memsets write and its launches read), alive as long as the call."""

    __slots__ = ("op", "dev", "foot", "run", "x", "source", "meta", "scalars", "guard", "probe", "keep")

    def __init__(self, op, dev, foot, run, x, source, meta, probe, scalars=None, guard=None, keep=()):
        self.op, self.dev, self.foot, self.run, self.x, self.source = op, dev, foot, run, x, source
        self.meta, self.probe, self.scalars, self.guard, self.keep = meta, probe, scalars, guard, keep


def _lit(v, env) -> str:
    if isinstance(v, Sym) or type(v) is int:
        return repr(v)
    name = f"C{len(env)}"  # floats and anything else: bound by name, no round trip through text
    env[name] = v
    return name


def compile_call(op: str, rec: Recorder, dev: int, ts, foot, x=(), scalars=None, guard=None, keep=()) -> Call:
    """The :class:`Call` that replays ``rec`` (recorded for tensors ``ts`` on GPU ``dev``; ``keep``: memory
    the record points into by address, owned by the call)."""
    env = {"memset0": memset0, "DEV": dev}
    lines = ["def run(p, s, x, ts, stream):"]
    for k, (entry, _) in enumerate(rec.launches):
        env[f"E{k}"] = entry
    direct = len(rec.launches) == 1 and not rec.memsets and not rec.before
    if direct:
        lines.append(f"    E0({', '.join(_lit(a, env) for a in rec.launches[0][1])})")  # the entry's own last-call memo
    elif rec.launches:
        # the last call's prepared launches are kept whole (immutable): the same pointers, stream and
        # scalars again skip building and comparing each entry's arguments (1.1-1.4 µs an entry on the H200)
        ls = "".join(f"l{k}, " for k in range(len(rec.launches)))
        env["M"] = [(None, ())]
        lines += ["    m = M[0]", "    if m[0] == (p, s, x):", f"        {ls}= m[1]", "    else:"]
        for k, (_, args) in enumerate(rec.launches):
            lines.append(f"        l{k} = E{k}.prepare({', '.join(_lit(a, env) for a in args)})")
        lines.append(f"        M[0] = ((p, s, x), ({ls}))")
    if not direct:
        for j, fn in enumerate(rec.before):
            env[f"B{j}"] = fn
            lines.append(f"    B{j}(ts, stream)")
        for ptr, n, word in rec.memsets:
            lines.append(f"    memset0({_lit(ptr, env)}, {n}, s, DEV{f', 0x{word:x}' if word else ''})")
        lines += [f"    l{k}.fire()" for k in range(len(rec.launches))]
    for j, fn in enumerate(rec.after):
        env[f"T{j}"] = fn
        lines.append(f"    T{j}(ts, stream)")
    if len(lines) == 1:
        lines.append("    pass  # nothing to do for this call's shapes")
    source = "\n".join(lines) + "\n"
    exec(compile(source, f"<aot plan: {op}>", "exec"), env)  # noqa: S102  (our own text: constants and names)
    return Call(op, dev, foot, env["run"], tuple(x), source, _meta(ts), probe_for(ts, dev, foot), scalars, guard, tuple(keep))


_LAST = ("last call",)  # cache keys no signature can equal (see args.signature)
ALLOC = ("last allocating call",)


def _meta(ts) -> tuple:
    return tuple(None if t is None else (t.dtype, t.shape) for t in ts)


def probe_for(ts, dev: int, foot):
    """A function ``probe(ts)`` compiled for tensors like ``ts`` on GPU ``dev``: the data pointers of
    tensors with the samples' dtypes, shapes and device, contiguous (as every op requires: shape and
    contiguity fix the strides), None where the samples were None, whose pointers pass the per-call
    checks of ``foot`` (:func:`dsa_aot.ops.args.recheck_ptrs`); None for anything else (the caller's
    full check then says what is wrong).

    Straight-line code with the samples' metadata bound as constants: a repeated call pays the torch
    attribute reads and little else (a loop over metadata tuples cost 2.4 µs for six tensors on the
    H200, see docs/gpu-results.md)."""
    env = {"F": foot, "RC": recheck_ptrs, "DEV": dev}
    conds, ptrs = [], []
    for i, t in enumerate(ts):
        if t is None:
            conds.append(f"t{i} is None")
            ptrs.append("0")
        else:
            env[f"D{i}"], env[f"S{i}"] = t.dtype, t.shape
            conds.append(f"t{i}.dtype is D{i} and t{i}.shape == S{i} and t{i}.is_contiguous() and t{i}.get_device() == DEV")
            ptrs.append(f"t{i}.data_ptr()")
    names = "".join(f"t{i}, " for i in range(len(ts)))
    source = (
        "def probe(ts):\n"
        "    try:\n"
        f"        {names}= ts\n"
        f"        if {' and '.join(conds) or 'True'}:\n"
        f"            p = ({''.join(x + ', ' for x in ptrs)})\n"
        "            return p if p == F[3] else RC(p, F)\n"
        "    except (AttributeError, TypeError, RuntimeError, ValueError):  # not a tensor, or not as many\n"
        "        pass\n"
        "    return None\n"
    )
    exec(compile(source, "<aot probe>", "exec"), env)  # noqa: S102  (our own text: names and bound constants)
    return env["probe"]


def matches(call: Call, ts) -> bool:
    """``ts`` are tensors like the ones ``call`` was validated for, with pointers that pass its per-call checks."""
    return call.probe(ts) is not None


def remembered(cache: dict, key, ts, extra):
    """(value, pointers) for what :func:`remember` kept under ``key``, for a call with the same options
    ``extra`` (compared by value, then type) and tensors its probe accepts; None otherwise. Threads may
    race on it: it is replaced whole."""
    v = cache.get(key)
    if v is not None and v[0] == extra and v[1] == tuple(map(type, extra)):
        p = v[2](ts)
        if p is not None:
            return v[3], p
    return None


def remember(cache: dict, key, extra, probe, value) -> None:
    """Keep ``value``, what validating a call with options ``extra`` proved for the tensors ``probe`` accepts."""
    cache[key] = (extra, tuple(map(type, extra)), probe, value)


def cached(cache: dict, ts, extra, build):
    """The functional ops' path: (call, pointers) for tensors ``ts`` and options ``extra``.

    The op's last call is tried first (:func:`remembered`: what a loop calling one shape pays), then the
    call cached under the full signature (:func:`dsa_aot.ops.args.signature`); a call whose probe
    accepts the tensors is used as is. Otherwise ``build()`` validates in full (raising what is wrong)
    and its call is kept."""
    hit = remembered(cache, _LAST, ts, extra)
    if hit is not None:
        return hit
    sig = signature(ts, extra)  # None: an argument that is not a tensor; build() says what is wrong
    call = lookup(cache, sig)
    if call is None:
        call = build()
        if sig is not None and len(cache) < _CACHE_MAX:
            cache[sig] = call
    p = call.probe(ts)  # a fresh call's own pointers pass at once (its footprint holds them)
    if p is None:  # the pointers fail a per-call check: the full validation says which
        call = build()
        p = call.probe(ts)
        if p is None:
            raise LaunchError(f"{call.op}: a call that passed validation fails its own per-call checks; please report this")
    if sig is not None:
        remember(cache, _LAST, extra, call.probe, call)
    return call, p


def fresh(box: list, cache: dict, ts, extra, build):
    """The allocating forms' path: (call, pointers) for ``ts``, the inputs their own memo (:func:`remembered`)
    just matched and the outputs (and workspace) they just allocated, whose dtypes, shapes and device are
    theirs by construction. ``box[0]``: the ``_into`` op's call kept with that memo, so only the pointers
    are checked again (:func:`recheck`); otherwise :func:`cached` (``extra``, ``build``: the ``_into``
    op's) and the call is kept in the box."""
    call = box[0]
    if call is not None:
        p = recheck(ts, call.foot)
        if p is not None:
            return call, p
    call, p = cached(cache, ts, extra, build)
    box[0] = call
    return call, p


class Plan:
    """cudnn's plan shape: built once from sample tensors and options (every check the op makes, every
    entry resolved and loaded), ``check_support()``, then ``execute(...)`` with tensors of the same
    shapes, dtypes, strides and device, as often as wanted, from any thread.

    A subclass names its op's plan function (``_build``: the ``_into`` op's arguments -> :class:`Call`),
    the tensors ``execute`` takes in order (``_tensors``; optional ones last) and its per-call scalars
    (``_scalars``, keyword-only in ``execute``)."""

    _build = None
    _tensors: tuple = ()
    _scalars: tuple = ()

    def __init__(self, *args, **kwargs):
        self._call = type(self)._build(*args, **kwargs)

    def check_support(self) -> bool:
        """True: construction validated the call and found every entry it needs (it raises otherwise)."""
        return True

    @property
    def source(self) -> str:
        """The code ``execute`` runs after its checks (launches with this plan's constants)."""
        return self._call.source

    def execute(self, *tensors, stream=None, **kw):
        """Run the plan on ``tensors`` (positional in ``_tensors`` order, or by name) on ``stream`` (None:
        torch's current stream of the plan's device). Each tensor must match the sample's dtype, shape
        and device and be contiguous; alignment and overlap are checked on the pointers; InputError before
        anything runs otherwise."""
        c = self._call
        if kw or len(tensors) != len(self._tensors):
            tensors, x = self._bind(tensors, kw)
        else:
            x = c.x
        p = c.probe(tensors)
        if p is not None:
            if c.guard is not None:
                c.guard()
            c.run(p, stream_handle(stream, c.dev), x, tensors, stream)
            return
        raise input_error(self._mismatch(tensors))

    def _bind(self, tensors, kw):
        """(tensors in ``_tensors`` order, None for those not given; the call's scalars) from execute's arguments."""
        c, names = self._call, self._tensors
        if len(tensors) > len(names):
            raise input_error([f"{type(self).__name__}.execute takes {len(names)} tensors ({', '.join(names)}), got {len(tensors)}"])
        ts = list(tensors) + [None] * (len(names) - len(tensors))
        sc = {}
        for k, v in kw.items():
            if k in names and names.index(k) >= len(tensors):
                ts[names.index(k)] = v
            elif k in self._scalars:
                sc[k] = v
            else:
                raise input_error([f"{type(self).__name__}.execute: unexpected argument {k}= (tensors: {', '.join(names)}; scalars: "
                                   f"{', '.join(self._scalars) or 'none'})"])
        return tuple(ts), (c.scalars(**sc) if sc else c.x)

    def _mismatch(self, tensors) -> list:
        """What is wrong with ``tensors`` against the plan (the slow path of execute)."""
        import torch

        out = []
        c = self._call
        for name, t, m in zip(self._tensors, tensors, c.meta):
            if m is None:
                if t is not None:
                    out.append(f"{name}: given, but the plan was built without it")
                continue
            if not isinstance(t, torch.Tensor):
                out.append(f"{name}: got {type(t).__name__} (expected a torch.Tensor like the plan's sample)")
                continue
            contiguous = t.layout == torch.strided and t.is_contiguous()
            if (t.dtype, tuple(t.shape)) != m[:2] or not contiguous or t.get_device() != c.dev:
                out.append(f"{name}: {t.dtype} {tuple(t.shape)}{'' if contiguous else ' (not contiguous)'} on {t.device} (the plan was built for "
                           f"{m[0]} {m[1]}, contiguous, on cuda:{c.dev}; build another plan for other shapes)")
            elif t.data_ptr() & c.foot[1][self._tensors.index(name)]:
                out.append(f"{name}: data pointer 0x{t.data_ptr():x} is not aligned as the kernels need (clone() the tensor)")
        if not out:
            out.append("an output or the workspace overlaps another tensor of the call (outputs must not alias the inputs or each other)")
        return out
