"""The JIT-vs-AOT parity harness: one for every kernel family (ci/parity/<family>.py declares a :class:`Parity`).

    python ci/parity/<family>.py jit --dir D      # cudnn + cutlass importable: cudnn's JIT, writes D/jit.json
    python ci/parity/<family>.py aot --dir D      # cutlass and cudnn NOT importable: dsa_aot, writes D/aot.json
    python ci/parity/<family>.py compare --dir D  # markdown table + D/parity.json; exit status 1 on any mismatch
    python ci/parity/<family>.py cases [--quick]  # the case list (no GPU)

A family states its cases, an input maker (CPU, fixed seeds), the cudnn call, the dsa_aot call (and its
``_into`` form), the caller's buffers of a call, and a compare rule per output. The harness does the rest,
the same way for every family, in each side's own process:

* per case, a first call (synchronised, timed: the JIT's includes its compile when a compile key is new in
  the process, the AOT's the lazy cubin load), whose kernels are recorded: on the JIT side every lookup of
  cudnn's compile caches (wrapped in a recording dict for the call), on the AOT side every entry lookup of
  the op modules (their plan caches emptied first, so that the call resolves its entries);
* ``reruns`` more calls on the same inputs (JIT 1 + ``--reruns``, AOT 2): the run-to-run jitter an
  order-dependent output is held against, and poisoned allocations: each rerun's torch allocations come
  from a private memory pool whose blocks were just filled with the poison of the first call's outputs
  (NaN for floats, 0x7EADBEEF for integers), so that an element a kernel does not write shows;
* on the AOT side the ``_into`` form on poisoned outputs; caller buffers (``Parity.buffers``: outputs,
  workspaces, copies of in-place inputs) are fresh and poisoned for every call;
* the inputs compared with their saved copies after every call (an op must not write them);
* warm host microseconds per call (median of ``--calls``, the device synchronised every ``sync_every``
  calls outside the timed ones), the ``_into`` form's too, device microseconds (CUDA events), and
  ``torch.add`` on 16 elements as a yardstick of the process's host speed.

``compare`` checks per case: every output of every AOT call (first, reruns, ``_into``) against the JIT's
first call by its rule (:data:`BITWISE`; :data:`JITTER`: within the JIT's own run-to-run jitter, bitwise
when the JIT reproduces itself; or a family's function), the family's reference check on both sides'
outputs when it has one, the same kernels on both sides, the same buffer shapes (workspace sizes), the
inputs untouched, and every cubin the JIT compiled against the shipped entry of its key (sha256).

torch is imported lazily: ``compare``, ``cases`` and ``--help`` need no GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import importlib.abc
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BITWISE, JITTER = "bitwise", "jitter"
INT_POISON = 0x7EADBEEF  # not -1 (a legitimate id), not an id of any case's inputs


@dataclasses.dataclass(frozen=True)
class Jit:
    """cudnn's side. ``setup()`` imports cudnn's modules (timed) and returns what ``call`` gets as ``api``;
    ``caches``: kind -> (module, attribute or dotted path) of the compile caches its calls use; ``index_key(kind, key)``: a
    cache key as the shipped index's (op, key dict); ``call(api, spec, x, b)`` -> {output name: tensor}."""

    setup: Callable
    caches: dict
    index_key: Callable
    call: Callable


@dataclasses.dataclass(frozen=True)
class Aot:
    """dsa_aot's side: ``call(api, spec, x, b)`` and ``into(api, spec, x, b)`` (the ``_into`` form; ``b``
    also holds poisoned tensors like the first call's outputs) -> {output name: tensor}; ``api`` is
    ``module`` imported."""

    call: Callable
    into: Optional[Callable] = None
    module: str = "dsa_aot.dsa"


@dataclasses.dataclass(frozen=True)
class Parity:
    """A family's parity declaration. ``cases(quick)`` -> [(name, spec dict)] (json-able specs);
    ``inputs(spec)`` -> {name: CPU tensor or scalar}; ``outputs(spec)`` -> {output name: rule}, a rule being
    BITWISE, JITTER or ``f(spec, jit outputs, aot outputs) -> (ok, text)`` over one call's outputs;
    ``buffers(side, api, spec, x)`` -> the caller's tensors of one call (poisoned), or {};
    ``reference(spec, x, outputs)`` -> failure texts (empty: agrees); ``arches``: the GPUs the family has
    kernels for (others exit 2: not applicable); ``covers``: the GPUs the declaration checks when fewer
    (others fail: not a skip); ``inputs_of(name, spec)``: the input file of a case
    (cases may share one); ``families``: the index families its calls use (default: ``family``); ``bench``:
    the cases bench/run.py times."""

    family: str
    doc: str
    cases: Callable
    inputs: Callable
    outputs: Callable
    jit: Jit
    aot: Aot
    buffers: Callable = lambda side, api, spec, x: {}
    reference: Optional[Callable] = None
    label: Callable = lambda spec: spec.get("op", "")
    arches: tuple = ()
    covers: tuple = ()  # the GPUs this declaration checks, when fewer than the family's: elsewhere a run fails, it is not skipped
    inputs_of: Callable = lambda name, spec: name
    families: tuple = ()
    bench: tuple = ()  # the cases bench/run.py times (names of cases(False)); default: the first
    canon: Optional[Callable] = None  # canon(spec, outputs) -> outputs in a canonical order (unordered slots), before any rule
    sync_every: int = 16
    calls: int = 100
    quick: str = "a shorter case list"

    def main(self, argv=None) -> int:
        p = argparse.ArgumentParser(description=self.doc.split("\n\n")[0], epilog=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("mode", choices=("jit", "aot", "compare", "cases"))
        p.add_argument("--dir", help="folder shared by the three steps")
        p.add_argument("--calls", type=int, default=self.calls, help="warm calls timed per case (median)")
        p.add_argument("--reruns", type=int, default=2, help="JIT reruns per case on the same inputs (its jitter)")
        p.add_argument("--only", default="", help="run only cases whose name contains one of these comma-separated strings")
        p.add_argument("--quick", action="store_true", help=f"jit / cases: {self.quick}")
        a = p.parse_args(argv)
        if a.mode == "cases":
            for name, spec in self.cases(a.quick):
                print(name, json.dumps(spec, sort_keys=True))
            return 0
        if not a.dir:
            p.error("--dir is required")
        return {"jit": jit_step, "aot": aot_step, "compare": compare_step}[a.mode](self, a)


# ------------------------------------------------------------------------------------------------
# The AOT process: the JIT toolchain must not be importable
# ------------------------------------------------------------------------------------------------


class Blocker(importlib.abc.MetaPathFinder):
    BLOCKED = ("cutlass", "cudnn", "tvm_ffi")

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.BLOCKED:
            raise ImportError(f"{fullname} is blocked in this process: the dsa_aot side must not import the toolchain")
        return None


def install_blocker():
    """A :class:`Blocker` first on sys.meta_path; refuse if the toolchain is already imported."""
    if not any(isinstance(f, Blocker) for f in sys.meta_path):
        sys.meta_path.insert(0, Blocker())
    for mod in list(sys.modules):
        if mod.split(".")[0] in Blocker.BLOCKED:
            raise SystemExit(f"{mod} was imported before the blocker was installed")
    try:
        found = importlib.util.find_spec("cutlass")
    except ImportError:
        found = None
    assert found is None, "cutlass is importable in the aot process"


def production_jit():
    """The JIT side compiles as cudnn's production JIT does: no ``CUTE_DSL_KEEP`` / ``CUTE_DSL_DUMP_DIR`` (keep mode
    disables the DSL's caches and changes what some kernels compile to: docs/fidelity.md, refused here), and a
    fresh, empty DSL file cache (``CUTE_DSL_CACHE_DIR``; it does not enter the compile), so that a first call
    compiles as on a fresh machine instead of loading what an earlier process compiled. The cubins are read
    from the compiled host module (``kernels_binary``), which needs no keep mode."""
    import tempfile

    set_ = [v for v in ("CUTE_DSL_KEEP", "CUTE_DSL_DUMP_DIR", "CUTE_DSL_KEEP_CUBIN", "CUTE_DSL_KEEP_PTX") if os.environ.get(v)]
    if set_:
        raise SystemExit(f"{', '.join(set_)} set: the JIT side must compile as cudnn does in production; unset it")
    os.environ["CUTE_DSL_CACHE_DIR"] = tempfile.mkdtemp(prefix="dsa-aot-jit-cache-")


def into_buffers(par, api, spec, x, like):
    """The ``_into`` form's buffers: a fresh ``buffers()`` and a poisoned tensor like each first-call output not in it."""
    b = dict(par.buffers("aot", api, spec, x))
    b.update({n: nan_like(t) for n, t in like.items() if n not in b})
    return b


def load_ref(filename):
    """tests/gpu/<filename> (the fp64 references and their ``make_inputs``), or None in a checkout without tests."""
    here = os.path.join(ROOT, "tests", "gpu")
    path = os.path.join(here, filename)
    if not os.path.exists(path):
        return None
    if here not in sys.path:  # the references import their shared refutil by name
        sys.path.insert(0, here)
    spec = importlib.util.spec_from_file_location("dsa_aot_parity_" + filename[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


def first_call(fn):
    """(wall seconds of one synchronised call, its result)."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, res


def warm_us(fn, calls, sync_every=None):
    """Median host microseconds per call; the device synchronised every ``sync_every`` calls, untimed (an
    op slower on the device than on the host must not make the host wait on a full launch queue)."""
    import torch

    fn()
    torch.cuda.synchronize()
    samples = []
    for i in range(calls):
        if sync_every and i and i % sync_every == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(samples) / 1e3


def device_us(fn, calls=20):
    """Device microseconds per call, back to back (CUDA events around ``calls`` calls)."""
    import torch

    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / calls


def torch_add_us(calls):
    import torch

    a, b = torch.ones(16, device="cuda"), torch.ones(16, device="cuda")
    return warm_us(lambda: torch.add(a, b), calls)


# ------------------------------------------------------------------------------------------------
# Poison, copies, equality
# ------------------------------------------------------------------------------------------------


def poison(t):
    """Fill ``t`` with its dtype's poison (NaN, or 0x7EADBEEF for integers); returns it."""
    import torch

    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    if t.element_size() < 4:
        t.view(torch.uint8).fill_(0xA5)  # the view's fill, ``t`` returned (its own dtype)
        return t
    return t.fill_(INT_POISON)


def nan_like(t, dtype=None):
    import torch

    return poison(torch.empty_like(t, dtype=dtype))


def poisoned(shape, dtype):
    import torch

    return poison(torch.empty(shape, dtype=dtype, device="cuda"))


def poisoned_workspace(nbytes):
    import torch

    return torch.full((max(int(nbytes), 1),), 0xFF, dtype=torch.uint8, device="cuda")


def to_cuda(x):
    import torch

    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in x.items()}


def host(t):
    """A host copy (a copy even of a host tensor: later calls overwrite the device buffers)."""
    return t.to("cpu", copy=True)


def _view(t):
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def bitwise(a, b):
    """(equal, differing element count) of two tensors, NaN-safe; (False, -1) on a shape or dtype mismatch."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, -1
    n = int((_view(a) != _view(b)).sum())
    return n == 0, n


def _absdiff(x, y):
    """|x - y|, 0 where equal (equal infinities included: masked logits are -inf on both sides)."""
    import torch

    return torch.where(x == y, torch.zeros_like(x), (x - y).abs())


def _ulp_bf16(a, b):
    import torch

    m = torch.maximum(a.abs(), b.abs())
    _, e = torch.frexp(m)
    return torch.where(m == 0, torch.zeros_like(m), torch.pow(2.0, (e - 8).to(torch.float64)))


def jitter_verdict(jo, ao, n, own=0.0):
    """(ok, text, numbers): AOT output ``ao[n]`` against the JIT's ``jo[n]`` and the kernel's run-to-run jitter:
    the max |difference| of the JIT's reruns ``jo[n + '.runK']`` from its first call, or ``own`` (the AOT's
    reruns' from its first: the same cubins, sha256-checked, so the same nondeterminism; a rare race a few JIT
    reruns did not show still counts). bf16: |aot - jit| <= 1 bf16 ulp (a sum in another order rounds to a
    neighbour) + 2 * jitter, elementwise; fp32: max |diff| <= max(4 * jitter, 1e-6 * max|jit|). Bitwise when
    neither side varied from run to run."""
    import torch

    j1, a1 = jo[n].double(), ao[n].double()
    runs = sorted(k for k in jo if k.startswith(n + ".run"))
    bf16 = jo[n].dtype == torch.bfloat16
    nans = int(torch.isnan(ao[n].float()).sum()) if ao[n].is_floating_point() else 0
    eq, cnt = bitwise(jo[n], ao[n])
    if not eq and cnt < 0:
        return False, f"NO (shape {tuple(ao[n].shape)} {ao[n].dtype} vs {tuple(jo[n].shape)} {jo[n].dtype})", {}
    jit_jitter = max((float(_absdiff(jo[k].double(), j1).max()) for k in runs if jo[k].numel()), default=0.0 if j1.numel() == 0 else float("nan"))
    jitter = max(jit_jitter, own)
    diff = float(_absdiff(a1, j1).max()) if j1.numel() else 0.0
    unit = ""
    if bf16 and runs and j1.numel():
        bound = _ulp_bf16(a1, j1) + 2 * jitter
        diff, unit = float((_absdiff(a1, j1) / bound.clamp_min(1e-300)).max()), "x bound"
    fin = j1[torch.isfinite(j1)] if j1.numel() else j1
    scale = float(fin.abs().max()) if fin.numel() else 0.0
    nums = dict(diff=diff, unit=unit, jitter=jitter, jit_jitter=jit_jitter, aot_jitter=own, max_abs=scale, differing=cnt, nan=nans, jit_reruns=len(runs))
    if nans or diff != diff:
        return False, f"NO ({nans} NaN)", nums
    if not runs:
        return False, "NO (no JIT rerun to measure jitter)", nums
    if own != own:
        return False, "NO (an AOT rerun differs from its first call by an infinity)", nums
    if jitter == 0.0:
        return eq, ("bitwise" if eq else f"NO ({cnt} differ; neither side varied run to run)"), dict(nums, limit=0.0)
    limit = 1.0 if bf16 else max(4 * jitter, 1e-6 * scale)
    ok = diff <= limit
    return ok, f"{'ok' if ok else 'NO'} {diff:.3g}{unit} (jitter JIT {jit_jitter:.2e}, AOT {own:.2e}; {cnt} differ)", dict(nums, limit=limit)


# ------------------------------------------------------------------------------------------------
# Kernels a call uses
# ------------------------------------------------------------------------------------------------


class Recording(dict):
    """A JIT compile cache that notes every key looked up or stored while it stands in for cudnn's."""

    def __init__(self, d):
        super().__init__(d)
        self.used = []

    def _note(self, k):
        self.used.append(k)
        return k

    def __getitem__(self, k):
        return super().__getitem__(self._note(k))

    def __setitem__(self, k, v):
        super().__setitem__(self._note(k), v)

    def __contains__(self, k):
        return super().__contains__(self._note(k))

    def get(self, k, default=None):
        return super().get(self._note(k), default)

    def setdefault(self, k, default=None):
        return super().setdefault(self._note(k), default)


def _unique(pairs):
    out = []
    for p in pairs:
        if p not in out:
            out.append(p)
    return out


class JitKeys:
    """cudnn's compile caches, each replaced by a :class:`Recording` for one first call."""

    def __init__(self, caches):
        self.caches = {kind: importlib.import_module(mod) for kind, (mod, _) in caches.items()}
        self.attrs = {kind: attr for kind, (_, attr) in caches.items()}

    def _owner(self, kind):
        """(object holding the cache, its attribute): ``attr`` may be a dotted path (a function's ``compile_cache``)."""
        *path, last = self.attrs[kind].split(".")
        obj = self.caches[kind]
        for part in path:
            obj = getattr(obj, part)
        return obj, last

    def table(self, kind):
        return getattr(*self._owner(kind))

    def begin(self):
        self.before, self.orig = {}, {}
        for kind, mod in self.caches.items():
            self.orig[kind] = self.table(kind)
            rec = Recording(self.orig[kind])
            setattr(*self._owner(kind), rec)
            self.before[kind] = set(rec)

    def end(self, index_key):
        used, new = [], False
        for kind, mod in self.caches.items():
            rec = self.table(kind)
            self.orig[kind].update(rec)  # cudnn's own dict again (others may hold it), with what the call compiled
            setattr(*self._owner(kind), self.orig[kind])
            for k in _unique(rec.used):
                if k in rec:  # a key only probed and never compiled is not a kernel the call used
                    used.append(list(index_key(kind, k)))
                    new |= k not in self.before[kind]
        return {"keys": _unique(used), "new": new}

    def cubins(self, index_key):
        from dsa_aot.toolchain import ir
        from dsa_aot.toolchain.cubin import extract_cubins_from_fatbin

        out = []
        for kind in self.caches:
            for key, fn in self.table(kind).items():
                host_ir = fn.ir_module.operation.get_asm(print_generic_op_form=True)
                cubins = extract_cubins_from_fatbin(ir.attr_bytes(ir.parse_module(host_ir).globals["kernels_binary"].props["value"]))
                cubin = cubins[0] if len(cubins) == 1 else None
                op, k = index_key(kind, key)
                out.append({"op": op, "key": k, "jit_key": repr(key), "sha256": hashlib.sha256(cubin).hexdigest() if cubin else None})
        return out


class AotKeys:
    """The entries a first call resolves: every lookup of ``dsa_aot.ops.gpu._find`` (the op modules'
    and the declaration's launchers go through it), after the op modules' plan caches are emptied."""

    def __init__(self, families):
        from dsa_aot.ops import declare, gpu as _support

        self.support, self.declare, self.orig = _support, declare, _support._find
        self.modules = [importlib.import_module(f"dsa_aot.ops.{f}") for f in families]

    def begin(self):
        import dsa_aot.runtime

        self.declare.clear_caches()  # every op is declared: its validated calls live there
        self.used, self.loaded = [], set(dsa_aot.runtime.load_stats())

        def spy(ix, family, op, key, *a, **kw):
            self.used.append([op, dict(key)])
            return self.orig(ix, family, op, key, *a, **kw)

        self.support._find = spy

    def end(self, index_key=None):
        import dsa_aot.runtime

        self.support._find = self.orig
        return {"keys": _unique(self.used), "new": any(k not in self.loaded for k in dsa_aot.runtime.load_stats())}


# ------------------------------------------------------------------------------------------------
# One case, either side
# ------------------------------------------------------------------------------------------------


def _pool_call(fn, like):
    """fn() with its torch allocations served from a private memory pool whose blocks were just filled with
    the poison of the tensors ``like`` (the first call's outputs: same sizes, so the pool hands them back)."""
    import torch

    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        bufs = [nan_like(t) for t in like]
        del bufs  # back to the pool, stream-ordered after the fills
        res = fn()
    return res, pool


def _shapes(b):
    import torch

    return {k: [list(v.shape), str(v.dtype)] for k, v in b.items() if isinstance(v, torch.Tensor)}


def run_case(par, side, api, keys, name, spec, x, cpu, args, reruns):
    """First call (kernels recorded), reruns under poisoned pools, the ``_into`` form (AOT), warm timing.
    Saves ``<dir>/<side>/<name>.pt`` ({form.output: host tensor}), returns the row."""
    import torch

    outs = par.outputs(spec)
    call = par.jit.call if side == "jit" else par.aot.call
    row = {"case": name, "label": par.label(spec), "spec": spec, "touched": []}
    saved = {}

    def check_inputs(form):
        for k, v in cpu.items():
            if isinstance(v, torch.Tensor) and not bitwise(host(x[k]), v)[0]:
                row["touched"].append(f"{k} ({form})")
                x[k] = v.cuda()  # the next calls get the pristine input again

    def keep(form, res):
        missing = [n for n in outs if not isinstance(res.get(n), torch.Tensor)]
        if missing:
            raise AssertionError(f"the {side} call returned no {missing} (it returned {sorted(res)})")
        saved.update({f"{form}.{n}" if not form.startswith("run") else f"first.{n}.{form}": host(res[n]) for n in outs})

    b = par.buffers(side, api, spec, x)
    row["buffers"] = _shapes(b)
    keys.begin()
    try:
        row["first_s"], res = first_call(lambda: call(api, spec, x, b))
    finally:
        row.update(keys.end(par.jit.index_key))
    keep("first", res)
    check_inputs("first call")
    like = [res[n] for n in outs]
    del res
    for r in range(reruns):
        res, pool = _pool_call(lambda: call(api, spec, x, par.buffers(side, api, spec, x)), like)
        torch.cuda.synchronize()
        keep(f"run{r + 2}", res)
        del res, pool
        check_inputs(f"rerun {r + 2}")
    if side == "aot" and par.aot.into is not None:
        bi = into_buffers(par, api, spec, x, dict(zip(outs, like)))
        res = par.aot.into(api, spec, x, bi)
        torch.cuda.synchronize()
        keep("into", res)
        del res
        check_inputs("_into call")
        row["warm_into_us"] = warm_us(lambda: par.aot.into(api, spec, x, bi), args.calls, sync_every=par.sync_every)
    del like
    row["warm_us"] = warm_us(lambda: call(api, spec, x, b), args.calls, sync_every=par.sync_every)
    row["device_us"] = device_us(lambda: call(api, spec, x, b))
    torch.save(saved, os.path.join(args.dir, side, f"{name}.pt"))
    return row


def _meta(torch, **kw):
    props = torch.cuda.get_device_properties(0)
    cap = torch.cuda.get_device_capability()
    return {"python": platform.python_version(), "torch": torch.__version__, "device": props.name, "sm_count": props.multi_processor_count,
            "arch": f"sm_{cap[0]}{cap[1]}a", **kw}


def _run_side(par, side, args, api, keys, cases, reruns):
    import torch

    in_dir = os.path.join(args.dir, "inputs")
    os.makedirs(os.path.join(args.dir, side), exist_ok=True)
    rows, loaded, made = {}, {}, set()
    for name, spec in cases:
        tag = par.inputs_of(name, spec)
        path = os.path.join(in_dir, f"{tag}.pt")
        if side == "jit" and tag not in made:  # fresh inputs from the seeds, never a stale file
            torch.save(par.inputs(spec), path)
            made.add(tag)
        if not os.path.exists(path):
            raise SystemExit(f"missing inputs {path}: run `python ci/parity/{par.family}.py jit --dir {args.dir}` first")
        if tag not in loaded:
            loaded = {tag: torch.load(path)}  # one input set held at a time
        cpu = loaded[tag]
        try:
            rows[name] = r = run_case(par, side, api, keys, name, spec, to_cuda(cpu), cpu, args, reruns)
        except Exception as exc:  # noqa: BLE001 - this case's failure; the other cases still run
            traceback.print_exc()
            rows[name] = {"case": name, "label": par.label(spec), "spec": spec, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
            print(f"{side} {name}: FAILED: {exc!r}", flush=True)
            continue
        first = f"{r['first_s']:.3f} s" if side == "jit" else f"{1e3 * r['first_s']:.2f} ms"
        print(f"{side} {name}: first {first}{'' if r['new'] else ' (nothing new)'}, warm {r['warm_us']:.1f} us"
              + (f" (into {r['warm_into_us']:.1f} us)" if "warm_into_us" in r else "") + f", device {r['device_us']:.1f} us", flush=True)
    return rows


def _applicable(par, torch):
    cap = torch.cuda.get_device_capability()
    arch = f"sm_{cap[0]}{cap[1]}a"
    if par.arches and arch not in par.arches:
        print(f"{par.family}: no kernel for {arch} (it has {', '.join(par.arches)}): not applicable on this GPU")
        return False
    if par.covers and arch not in par.covers:  # the family ships kernels here, this declaration does not check them yet
        raise SystemExit(f"{par.family}: its parity declaration covers {', '.join(par.covers)} only (its compile caches and keys), not "
                         f"{arch}, where the family ships kernels: declare {arch}'s caches in ci/parity/{par.family}.py")
    return True


def jit_step(par, args) -> int:
    """cudnn's side: keep its cubins, import it (timed), write the case list and inputs, run every case."""
    production_jit()
    import torch

    if not _applicable(par, torch):
        return 2
    t0 = time.perf_counter()
    api = par.jit.setup()
    import_s = time.perf_counter() - t0
    keys = JitKeys(par.jit.caches)
    os.makedirs(os.path.join(args.dir, "inputs"), exist_ok=True)
    cases = [(n, s) for n, s in par.cases(args.quick) if _selected(args, n)]
    with open(os.path.join(args.dir, "inputs", "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)
    rows = _run_side(par, "jit", args, api, keys, cases, 1 + args.reruns)
    m = _meta(torch, import_s=import_s, torch_add_us=torch_add_us(args.calls), calls=args.calls, quick=args.quick, reruns=1 + args.reruns)
    _dump(args.dir, "jit.json", {"meta": m, "rows": rows, "cubins": keys.cubins(par.jit.index_key)})
    return 0


def aot_step(par, args) -> int:
    """dsa_aot's side, in a process where cutlass and cudnn cannot be imported: the cases the jit step wrote."""
    install_blocker()
    import torch

    if not _applicable(par, torch):
        return 2
    t0 = time.perf_counter()
    import dsa_aot.runtime

    api = importlib.import_module(par.aot.module)
    import_s = time.perf_counter() - t0
    path = os.path.join(args.dir, "inputs", "cases.json")
    if not os.path.exists(path):
        raise SystemExit(f"missing {path}: run `python ci/parity/{par.family}.py jit --dir {args.dir}` first")
    with open(path) as f:
        cases = [(n, s) for n, s in json.load(f) if _selected(args, n)]
    families = par.families or (par.family,)
    rows = _run_side(par, "aot", args, api, AotKeys(families), cases, 2)
    index_path = os.path.join(os.path.dirname(dsa_aot.__file__), "_generated", "index.json")
    index = None
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = {"entries": [e for e in json.load(f).get("entries", []) if e.get("family") in families]}
    loads = dsa_aot.runtime.load_stats()
    m = _meta(torch, import_s=import_s, torch_add_us=torch_add_us(args.calls), calls=args.calls, index_path=index_path,
              loads_ms=sorted(float(v) for v in loads.values()))
    _dump(args.dir, "aot.json", {"meta": m, "rows": rows, "index": index})
    return 0


def _selected(args, name):
    return not args.only or any(part and part in name for part in args.only.split(","))


def _dump(d, name, obj):
    with open(os.path.join(d, name), "w") as f:
        json.dump(obj, f, indent=1, default=str)
    print(f"wrote {os.path.join(d, name)}")


# ------------------------------------------------------------------------------------------------
# Compare
# ------------------------------------------------------------------------------------------------


def key_str(op_key):
    return json.dumps(list(op_key), sort_keys=True)


def shipped(entries, op, key):
    """The index entries of (op, key): every field of the JIT's key equal (in the entry's key, else the entry)."""
    return [e for e in entries if e.get("op") == op and all(e.get("key", {}).get(k, e.get(k)) == v for k, v in key.items())]


def cubin_report(cubins, entries):
    """Every cubin the JIT compiled against the shipped entry of its key: (report rows, failures)."""
    report, failures = [], []
    for c in cubins:
        shas = sorted({e.get("sha256") for e in shipped(entries, c["op"], c["key"])})
        ok = bool(c["sha256"]) and shas == [c["sha256"]]
        report.append(dict(c, shipped=shas, ok=ok))
        if not ok:
            why = "no cubin from the JIT" if not c["sha256"] else ("no shipped entry" if not shas else f"shipped {shas}")
            failures.append(f"JIT cubin {c['op']} {c['key']} ({c['jit_key']}): sha256 {c['sha256']} vs {why}")
    if not cubins:
        failures.append("the JIT side recorded no cubins")
    return report, failures


def _forms(saved, n):
    """The AOT calls' outputs ``n`` by form: first, its reruns, into."""
    return {k.split(".")[0] if k.startswith("into.") else ("first" if k == f"first.{n}" else k.rsplit(".", 1)[1]): v
            for k, v in saved.items() if k in (f"first.{n}", f"into.{n}") or k.startswith(f"first.{n}.run")}


def compare_outputs(par, spec, jo, ao):
    """(cell texts, failures) of one case's outputs, every AOT form against the JIT's first call by its rule."""
    cells, failures, names = [], [], list(par.outputs(spec))
    forms = sorted({f for n in names for f in _forms(ao, n)}, key=lambda f: (f != "first", f))
    have = {f: all(_pick(ao, m, f) is not None for m in names) for f in forms}
    for n, rule in par.outputs(spec).items():
        if f"first.{n}" not in jo:
            failures.append(f"{n}: not saved on the jit side")
            continue
        j = {n: jo[f"first.{n}"], **{f"{n}.{k}": v for k, v in _forms(jo, n).items() if k != "first"}}
        cell = "missing"
        for form in forms or ["first"]:
            t = _pick(ao, n, form)
            if t is None:
                ok, text = False, "not saved on the aot side"
            elif rule == BITWISE:
                ok, cnt = bitwise(j[n], t)
                text = "bitwise" if ok else f"NO ({cnt} differ)"
            elif rule == JITTER:
                ok, text, _ = jitter_verdict(j, {n: t}, n, own=_own_jitter(ao, n))
            elif not have[form] or any(f"first.{m}" not in jo for m in names):
                continue  # the missing output fails on its own
            else:
                ok, text = rule(spec, {m: jo[f"first.{m}"] for m in names}, {m: _pick(ao, m, form) for m in names})
            cell = text if form == "first" else cell
            if not ok:
                failures.append(f"{n} ({form}): {text}")
        if rule == BITWISE:  # the JIT's own reruns: a bitwise rule must hold there too, or the rule is wrong
            for k in (k for k in j if k != n):
                if not bitwise(j[n], j[k])[0]:
                    failures.append(f"{n}: the JIT's {k.split('.')[-1]} differs from its first call: a bitwise rule cannot hold")
        cells.append(f"{n} {cell}")
    return cells, failures


def _own_jitter(ao, n):
    """The AOT reruns' max |difference| from its first call (NaNs left out: they fail on their own)."""
    import torch

    if f"first.{n}" not in ao:
        return 0.0  # fails as not saved
    first = ao[f"first.{n}"].double()
    runs = [ao[k].double() for k in ao if k.startswith(f"first.{n}.run") and ao[k].shape == first.shape]
    d = [_absdiff(r, first) for r in runs if r.numel()]
    if any(not bool(torch.isfinite(x[~torch.isnan(x)]).all()) for x in d):
        return float("nan")  # an infinity one call has and another not: no jitter explains it
    return max((float(x.nan_to_num(0.0).max()) for x in d), default=0.0)


def _canonical(par, spec, saved):
    """``saved`` with every call's outputs (first, each rerun, into) put through ``par.canon`` together."""
    names, out = list(par.outputs(spec)), dict(saved)
    for k in saved:
        prefix, _, rest = k.partition(".")
        if rest.split(".")[0] == names[0]:
            keys = [f"{prefix}.{m}{rest[len(names[0]):]}" for m in names]
            if all(x in saved for x in keys):
                res = par.canon(spec, {m: saved[x] for m, x in zip(names, keys)})
                out.update({x: res[m] for m, x in zip(names, keys)})
    return out


def _pick(saved, m, form):
    return saved.get(f"into.{m}" if form == "into" else f"first.{m}" + ("" if form == "first" else f".{form}"))


def compare_step(par, args) -> int:
    import torch

    sides = {}
    for side in ("jit", "aot"):
        path = os.path.join(args.dir, f"{side}.json")
        if not os.path.exists(path):
            print(f"FAIL: {path} missing: run `python ci/parity/{par.family}.py {side} --dir {args.dir}` (it may have failed)")
            return 1
        with open(path) as f:
            sides[side] = json.load(f)
    jit, aot = sides["jit"], sides["aot"]
    arch = jit["meta"]["arch"]
    entries = [e for e in (aot.get("index") or {}).get("entries", []) if e.get("arch") == arch]
    failures, lines, report = [], [], []
    for name, jr in jit["rows"].items():
        ar = aot["rows"].get(name)
        fails = [f"{s} raised {r['error']}" for s, r in (("jit", jr), ("aot", ar or {})) if "error" in r]
        fails += ["not run on the aot side"] if ar is None else []
        cells, ref = [], ""
        if not fails:
            jo = torch.load(os.path.join(args.dir, "jit", f"{name}.pt"))
            ao = torch.load(os.path.join(args.dir, "aot", f"{name}.pt"))
            if par.canon is not None:
                jo, ao = _canonical(par, jr["spec"], jo), _canonical(par, jr["spec"], ao)
            cells, out_fails = compare_outputs(par, jr["spec"], jo, ao)
            fails += out_fails
            if par.reference is not None:
                x = torch.load(os.path.join(args.dir, "inputs", f"{par.inputs_of(name, jr['spec'])}.pt"))
                names = list(par.outputs(jr["spec"]))
                bad = [f"{s} {form}: {t}" for s, saved in (("jit", jo), ("aot", ao)) for form in ("first", "into")
                       if all(f"{form}.{m}" in saved for m in names)  # a missing output fails on its own
                       for t in par.reference(jr["spec"], x, {m: saved[f"{form}.{m}"] for m in names})]
                fails += [f"reference: {t}" for t in bad]
                ref = "yes" if not bad else f"NO ({len(bad)})"
            fails += [f"input {t} modified on the {s} side" for s, r in (("jit", jr), ("aot", ar)) for t in r["touched"]]
            if sorted(map(key_str, jr["keys"])) != sorted(map(key_str, ar["keys"])):
                fails.append(f"kernels differ: the JIT used {jr['keys']}, the AOT looked up {ar['keys']}")
            if jr["buffers"] != ar["buffers"]:
                fails.append(f"caller buffers differ (workspace sizes?): JIT {jr['buffers']}, AOT {ar['buffers']}")
            fails += [f"kernel {k} has no shipped entry" for k in jr["keys"] if not shipped(entries, *k)]
            if not jr["keys"]:
                fails.append("the JIT call used no kernel of the declared compile caches")
        failures += [f"{name}: {t}" for t in fails]
        report.append({"case": name, "spec": jr["spec"], "ok": not fails, "failures": fails, "jit": jr, "aot": ar})
        timing = ("", "", "", "", "") if fails and not cells else (
            f"{jr['first_s']:.3f}{'' if jr['new'] else '*'}", f"{1e3 * ar['first_s']:.2f}{'' if ar['new'] else '*'}", f"{jr['warm_us']:.1f}",
            f"{ar['warm_us']:.1f}" + (f" ({ar['warm_into_us']:.1f})" if "warm_into_us" in ar else ""), f"{jr['device_us']:.0f} / {ar['device_us']:.0f}")
        lines.append((name, jr["label"], "; ".join(cells) or "; ".join(fails)[:120], ref, "ok" if not fails else "NO", *timing))
    failures += [f"{name}: run on the aot side only" for name in aot["rows"] if name not in jit["rows"]]
    cubins, cubin_fails = cubin_report(jit["cubins"], entries)
    failures += cubin_fails

    header = ("case", "kernel", "outputs (AOT vs JIT)", "reference", "case ok", "JIT 1st s", "AOT 1st ms", "JIT warm us", "AOT warm us (into)",
              "device us JIT / AOT")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    print("\n".join("| " + " | ".join(str(v) for v in ln) + " |" for ln in lines))
    jm, am = jit["meta"], aot["meta"]
    print("\n(* = the first call compiled (JIT) / loaded (AOT) nothing new: an earlier case used its kernels)")
    print(f"device: {jm['device']} ({jm['sm_count']} SMs), arch {arch}; torch {jm['torch']}" + ("; --quick" if jm.get("quick") else ""))
    print(f"import: cudnn side {jm['import_s']:.2f} s, dsa_aot {1e3 * am['import_s']:.1f} ms; torch.add warm host us: JIT process "
          f"{jm['torch_add_us']:.1f}, AOT process {am['torch_add_us']:.1f}")
    print(f"JIT cubins: {len(cubins)} compiled, {sum(c['ok'] for c in cubins)} with the shipped sha256; AOT cubin loads: {len(am['loads_ms'])}"
          + (f", median {statistics.median(am['loads_ms']):.2f} ms" if am["loads_ms"] else ""))
    both = [(jit["rows"][n], r) for n, r in aot["rows"].items() if "warm_us" in r and "warm_us" in jit["rows"].get(n, {})]
    if both:
        jw, aw = statistics.median(j["warm_us"] for j, _ in both), statistics.median(a["warm_us"] for _, a in both)
        print(f"warm host us per call, median over cases: JIT {jw:.1f}, AOT {aw:.1f} (AOT/JIT {aw / jw:.2f})")
        jf, af = [j["first_s"] for j, _ in both if j["new"]], [a["first_s"] for _, a in both if a["new"]]
        if jf and af:
            print(f"first call that compiles / loads, median: JIT {statistics.median(jf):.2f} s, AOT {1e3 * statistics.median(af):.1f} ms "
                  f"(JIT/AOT {statistics.median(jf) / statistics.median(af):.0f}x)")
    _dump(args.dir, "parity.json", {"ok": not failures, "failures": failures, "arch": arch, "rows": report, "cubins": cubins, "meta": {"jit": jm, "aot": am}})
    if failures:
        print(f"\nFAIL: {len(failures)} mismatch(es)\n" + "\n".join(f"  - {f}" for f in failures))
        return 1
    print(f"\nOK: {len(lines)} cases of {par.family}: every output by its rule, same kernels, inputs untouched, every JIT cubin the shipped one")
    return 0
