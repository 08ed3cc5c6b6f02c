"""What the JIT-vs-AOT parity scripts share (ci/parity/<family>.py, one per kernel family).

* the import blocker of the AOT side (cutlass and cudnn must not be importable there);
* timing: first call (synchronised) and warm host microseconds per call, ``torch.add`` yardstick;
* NaN / 0xFF poisoning of outputs and workspaces; host copies, device-side bitwise equality;
* the cubin a JIT-compiled function really loads (``loaded_cubin``);
* bitwise comparison, index.json key matching and sha256 status, run metadata;
* the verdict of an order-dependent output against the JIT's own run-to-run jitter
  (``jitter_verdict``), markdown tables.

torch is imported lazily (the compare step and ``--help`` need no GPU).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import json
import os
import platform
import statistics
import sys
import time

__all__ = [
    "aot_side",
    "Blocker",
    "install_blocker",
    "first_call",
    "warm_us",
    "device_us",
    "torch_add_us",
    "nan_like",
    "poisoned_workspace",
    "loaded_cubin",
    "runtime_stats",
    "meta",
    "bitwise",
    "key_match",
    "selected",
    "to_cuda",
    "host_copy",
    "same",
    "key_str",
    "shipped_index",
    "family_entries",
    "shipped",
    "sha_status",
    "torch_ulp",
    "torch_isnan",
    "jitter_verdict",
    "md_table",
    "load_json",
]

# ------------------------------------------------------------------------------------------------
# AOT side: the JIT toolchain must not be importable
# ------------------------------------------------------------------------------------------------


class Blocker(importlib.abc.MetaPathFinder):
    """Makes the JIT toolchain unimportable in this process: the AOT runtime must not need it."""

    BLOCKED = ("cutlass", "cudnn")

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.BLOCKED:
            raise ImportError(f"{fullname} is blocked in the aot parity process (the runtime must not import it)")
        return None


def install_blocker():
    """Put a :class:`Blocker` first on sys.meta_path; refuse if the toolchain is already imported."""
    if not any(isinstance(f, Blocker) for f in sys.meta_path):
        sys.meta_path.insert(0, Blocker())
    for mod in list(sys.modules):
        if mod.split(".")[0] in Blocker.BLOCKED:
            raise SystemExit(f"{mod} was imported before the blocker was installed")
    try:
        spec = importlib.util.find_spec("cutlass")
    except ImportError:
        spec = None
    assert spec is None, "cutlass is importable in the aot process"


# ------------------------------------------------------------------------------------------------
# Timing (torch only)
# ------------------------------------------------------------------------------------------------


def load_ref(filename):
    """tests/gpu/<filename>, the fp64 reference whose ``make_inputs`` both sides share; None when the
    checkout has no tests (the script then generates equivalent inputs itself)."""
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests", "gpu")
    path = os.path.join(here, filename)
    if not os.path.exists(path):
        return None
    if here not in sys.path:  # the references import their shared refutil by name
        sys.path.insert(0, here)
    spec = importlib.util.spec_from_file_location("dsa_aot_parity_" + filename[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod if hasattr(mod, "make_inputs") else None


def first_call(fn):
    """Wall seconds of one synchronised call."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def warm_us(fn, calls, sync_every=None):
    """Median host microseconds per call; the device is synchronised only outside the timed calls.

    ``sync_every``: synchronise (untimed) after every that many calls, so that ops whose device time
    exceeds their host time cannot fill the launch queue and make the host wait inside a call.
    None: only before and after the loop.
    """
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
    """Device microseconds per call, back to back: CUDA events around ``calls`` calls, synchronised.

    When the device is the bottleneck this is the kernels' time per call; when the host is, it is
    the host's (the device idles between launches)."""
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

    a = torch.ones(16, device="cuda")
    b = torch.ones(16, device="cuda")
    return warm_us(lambda: torch.add(a, b), calls)


# ------------------------------------------------------------------------------------------------
# Poisoning
# ------------------------------------------------------------------------------------------------


def nan_like(t):
    import torch

    return torch.full_like(t, float("nan"))


def poisoned_workspace(nbytes):
    import torch

    return torch.full((max(int(nbytes), 1),), 0xFF, dtype=torch.uint8, device="cuda")


# ------------------------------------------------------------------------------------------------
# JIT side: the cubin a compiled function loads
# ------------------------------------------------------------------------------------------------


def loaded_cubin(fn):
    """The cubin the JIT loads: the one embedded in the host module's fatbin (kernels_binary).

    ``fn.__cubin__`` is bytes with some DSL library builds and a dump-file path with others.
    """
    from dsa_aot.toolchain import ir
    from dsa_aot.toolchain.cubin import extract_cubins_from_fatbin

    host = fn.ir_module.operation.get_asm(print_generic_op_form=True)
    cubins = extract_cubins_from_fatbin(ir.attr_bytes(ir.parse_module(host).globals["kernels_binary"].props["value"]))
    return cubins[0] if len(cubins) == 1 else None


# ------------------------------------------------------------------------------------------------
# Metadata
# ------------------------------------------------------------------------------------------------


def _jsonable(v):
    if isinstance(v, dict):
        return {(k if isinstance(k, str) else repr(k)): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)


def runtime_stats(aot_pkg=None):
    """Whatever cubin-load statistics dsa_aot.runtime exposes (optional; probed defensively)."""
    try:
        runtime = importlib.import_module("dsa_aot.runtime")
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return {"error": repr(exc)}
    found = {}
    for name in ("load_stats", "cubin_load_ms", "stats", "load_times"):
        obj = getattr(runtime, name, None)
        if obj is None:
            continue
        try:
            found[name] = _jsonable(obj() if callable(obj) else obj)
        except Exception as exc:  # noqa: BLE001
            found[name] = repr(exc)
    return found


def meta(torch):
    props = torch.cuda.get_device_properties(0)
    return {"python": platform.python_version(), "torch": torch.__version__, "device": props.name, "sm_count": props.multi_processor_count}


# ------------------------------------------------------------------------------------------------
# Compare helpers
# ------------------------------------------------------------------------------------------------


def bitwise(a, b):
    """(equal, differing element count) for same-shape tensors, NaN-safe."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False, -1
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    n = int((a.view(view) != b.view(view)).sum())
    return n == 0, n


def key_match(entry, want):
    """Every field of the JIT key equals the entry's (looked up in entry["key"], then the entry)."""
    key = entry.get("key", {})
    return all(key.get(k, entry.get(k)) == v for k, v in want.items())


def selected(args, name):
    """--only: comma-separated substrings of case names (empty: every case)."""
    return not args.only or any(part and part in name for part in args.only.split(","))


# ------------------------------------------------------------------------------------------------
# Tensors moved around by both sides (torch only)
# ------------------------------------------------------------------------------------------------


def to_cuda(x):
    """A dict of CPU inputs on the GPU (non-tensors, None included, as they are)."""
    import torch

    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in x.items()}


def host_copy(t):
    """A host copy (a copy even of a host tensor: later calls overwrite the device buffers)."""
    return t.to("cpu", copy=True)


def same(a, b):
    """Bitwise equality on the device (NaN-safe)."""
    import torch

    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.view(view), b.view(view)))


# ------------------------------------------------------------------------------------------------
# Shipped index: entries, key matching, sha256 status
# ------------------------------------------------------------------------------------------------


def key_str(op_key):
    """A canonical string of an (op, key dict) pair (kernel lists compare as sorted lists of these)."""
    op, key = op_key
    return json.dumps([op, key], sort_keys=True)


def _families(family) -> tuple:
    return (family,) if isinstance(family, str) else tuple(family)


def shipped_index(aot_module, family):
    """(path, {"tools", "entries" of ``family`` (a name, or a tuple of names: an op that launches
    another family's kernels too)}) of the aot package's index.json; index None if absent."""
    index_path = os.path.join(os.path.dirname(aot_module.__file__), "_generated", "index.json")
    index = None
    if os.path.exists(index_path):
        with open(index_path) as f:
            full = json.load(f)
        index = {"tools": full.get("tools"), "entries": [e for e in full.get("entries", []) if e.get("family") in _families(family)]}
    return index_path, index


def family_entries(index, family, arch):
    if index is None:
        return None
    return [e for e in index.get("entries", []) if e.get("family") in _families(family) and e.get("arch") == arch]


def shipped(entries, op, key):
    """The index entries of (op, key): every field of the JIT key equal."""
    return [e for e in entries if e.get("op") == op and key_match(e, key)]


def sha_status(keys, cubins, entries):
    """'yes' / 'NO' / 'missing:...' / 'no-jit-cubin:...' for the kernels a row used."""
    if entries is None:
        return "no-index"
    status = "yes"
    for op, key in keys:
        jit = [c for c in cubins if c["op"] == op and c["key"] == key]
        if not jit or not jit[0]["sha256"]:
            return f"no-jit-cubin:{op}"
        match = shipped(entries, op, key)
        if not match:
            return f"missing:{op}"
        if any(e.get("sha256") != jit[0]["sha256"] for e in match):
            status = "NO"
    return status


# ------------------------------------------------------------------------------------------------
# Order-dependent outputs against the JIT's own jitter
# ------------------------------------------------------------------------------------------------


def torch_ulp(a, b):
    """bf16 ulp at max(|a|, |b|) (float64 tensors)."""
    import torch

    m = torch.maximum(a.abs(), b.abs())
    _, e = torch.frexp(m)
    return torch.where(m == 0, torch.zeros_like(m), torch.pow(2.0, (e - 8).to(torch.float64)))


def torch_isnan(t):
    import torch

    return torch.isnan(t.float()).sum()


def torch_isfinite(t):
    import torch

    return torch.isfinite(t)


def jitter_verdict(jo, ao, n):
    """(ok, text, numbers) for an order-dependent output: AOT vs JIT against the JIT's own jitter.

    ``jo`` / ``ao``: the saved outputs of each side, ``n`` and its reruns ``n.run2``, ``n.run3``, ...
    bf16 outputs, elementwise: |aot - jit| <= 1 bf16 ulp (a sum in another order rounds to a
    neighbour) + 2 * the JIT's own max |jitter| (fp32 order noise, large where a sum cancels); fp32
    outputs: max |diff| <= max(4 * jitter, 1e-6 * max|ref|). Bitwise when the JIT reruns were all
    bitwise equal to its first run.
    """
    j1, a1 = jo[n].double(), ao[n].double()
    runs = sorted(k for k in jo if k.startswith(n + ".run"))
    aot_runs = sorted(k for k in ao if k.startswith(n + ".run"))
    bf16 = str(jo[n].dtype) == "torch.bfloat16"
    nans = int(torch_isnan(ao[n]))
    eq, cnt = bitwise(jo[n], ao[n])
    jitter = max((float(_absdiff(jo[k].double(), j1).max()) for k in runs), default=float("nan"))
    aot_jitter = max((float(_absdiff(ao[k].double(), a1).max()) for k in aot_runs), default=float("nan"))
    diff = float(_absdiff(a1, j1).max()) if j1.numel() else 0.0
    unit = ""
    if bf16 and runs and j1.numel():
        # each element may round to a neighbour (1 bf16 ulp at its size) and carry the fp32
        # order noise the JIT shows against itself (large where the sum cancels)
        bound = torch_ulp(a1, j1) + 2 * jitter
        over = float((_absdiff(a1, j1) / bound.clamp_min(1e-300)).max())
        diff, unit = over, "x bound"
    fin = j1[torch_isfinite(j1)] if j1.numel() else j1
    scale = float(fin.abs().max()) if fin.numel() else 0.0  # the finite values' (masked -inf entries compare exactly)
    nums = dict(diff=diff, unit=unit, jitter=jitter, aot_jitter=aot_jitter, max_abs=scale, differing=cnt, nan=nans, jit_reruns=len(runs))
    if nans or diff != diff:
        return False, f"NO ({nans} NaN)", nums
    if not runs:
        return False, "NO (no JIT rerun to measure jitter)", nums
    if jitter == 0.0:  # the JIT reproduced itself bitwise: require bitwise
        nums["limit"] = 0.0
        return eq, ("bitwise" if eq else f"NO ({cnt} differ, JIT reproducible)"), nums
    limit = 1.0 if bf16 else max(4 * jitter, 1e-6 * scale)
    nums["limit"] = limit
    ok = diff <= limit
    return ok, f"{'ok' if ok else 'NO'} {diff:.3g}{unit} (JIT jitter {jitter:.2e}, AOT jitter {aot_jitter:.2e}, {cnt} differ)", nums


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def _absdiff(x, y):
    """|x - y| elementwise, 0 where the two are equal (equal infinities included: the masked logits' -inf)."""
    import torch

    return torch.where(x == y, torch.zeros_like(x), (x - y).abs())


def into_verdict(jo, ao, n):
    """:func:`jitter_verdict` of the AOT ``_into`` form's output ``into.<n>`` against the JIT's ``n`` and its reruns."""
    runs = {k: v for k, v in jo.items() if k.startswith(n + ".run")}
    return jitter_verdict({n: jo[n], **runs}, {n: ao[f"into.{n}"]}, n)


def md_table(header, lines):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(v) for v in r) + " |" for r in lines]
    return "\n".join(out)


def load_json(path, script, step, d):
    """The json a step wrote, or None (with the command to run) when it is missing."""
    if not os.path.exists(path):
        print(f"FAIL: {path} missing: run `python {script} {step} --dir {d}` (it may have failed)")
        return None
    with open(path) as f:
        return json.load(f)


def verdict(failures, ok_text):
    """Print the failures (exit status 1) or the one-line OK summary (0)."""
    if failures:
        print(f"\nFAIL: {len(failures)} mismatch(es)")
        for f in failures:
            print(f"  - {f}")
        return 1
    print(f"\nOK: {ok_text}")
    return 0


def load_sides(args, script, family):
    """(jit, aot, arch, the shipped entries of ``family`` for it) of a compare step; None when a side's
    json is missing (the command to run is printed)."""
    jit = load_json(os.path.join(args.dir, "jit.json"), script, "jit", args.dir)
    aot = load_json(os.path.join(args.dir, "aot.json"), script, "aot", args.dir)
    if jit is None or aot is None:
        return None
    arch = jit["meta"].get("arch", "sm_90a")
    return jit, aot, arch, family_entries(aot.get("index"), family, arch)


def unrun(name, jr, ar, failures) -> list:
    """Why a case has nothing to compare (a side raised, or the aot side did not run it), each reason
    appended to ``failures`` too; empty when both sides ran it."""
    why = [f"{side} raised {r['error']}" for side, r in (("jit", jr), ("aot", ar or {})) if "error" in r]
    why += ["not run on the aot side"] if ar is None else []
    failures += [f"{name}: {w}" for w in why]
    return why


def call_checks(name, jr, ar, jit, entries, failures, what="an input") -> tuple:
    """The checks every case makes beyond its outputs: the inputs untouched on both sides (``what`` names
    them), upstream's compile keys as predicted, the same kernels on both sides, the JIT's cubins equal
    to the shipped ones. Returns (ok, same kernels, sha256 status); failures appended."""
    before = len(failures)
    for side, r in (("jit", jr), ("aot", ar)):
        if not r.get("inputs_untouched", False):
            failures.append(f"{name}: {what} modified on the {side} side")
    if jr.get("key_error"):
        failures.append(f"{name}: {jr['key_error']}")
    same_kernels = sorted(map(key_str, jr["keys"])) == sorted(map(key_str, ar["keys"]))
    if not same_kernels:
        failures.append(f"{name}: kernels differ: JIT compile keys {jr['keys']}, AOT looked up {ar['keys']}")
    sha = sha_status(jr["keys"], jit["cubins"], entries)
    if sha != "yes":
        failures.append(f"{name}: cubin sha256 {sha} for {jr['keys']}")
    return len(failures) == before, same_kernels, sha


def timing_cells(jr, ar) -> tuple:
    """The table's timing cells of a case: JIT / AOT first call (``*``: nothing compiled / loaded), warm host, device."""
    return (f"{jr['first_s']:.3f}{'' if jr.get('new') else '*'}", f"{1e3 * ar['first_s']:.2f}{'' if ar.get('new') else '*'}",
            f"{jr['warm_us']:.1f}", f"{ar['warm_us']:.1f} ({ar['warm_into_us']:.1f})", f"{jr['device_us']:.0f} / {ar['device_us']:.0f}")


def finish(args, sides, failures, header, lines, report, ok_text, notes=()) -> int:
    """The end every compare shares: cases only the aot side ran, every JIT cubin against the shipped one,
    the table, ``notes`` (lines under it), the summary, ``<dir>/parity.json`` and the verdict (exit status)."""
    jit, aot, arch, entries = sides
    failures += [f"{name}: run on the aot side only" for name in aot["rows"] if name not in jit["rows"]]
    cubins, cubin_fails = cubin_report(jit.get("cubins", []), entries)
    failures += cubin_fails
    print(md_table(header, lines))
    print("\n(* = the first call compiled (JIT) / loaded (AOT) nothing new: its key was already used by an earlier case)")
    jm, am = jit["meta"], aot["meta"]
    for line in notes:
        print(line)
    print(f"device: {jm.get('device')} ({jm.get('sm_count')} SMs), arch {arch}; torch {jm.get('torch')}")
    print_summary(jm, am, cubins, jit["rows"], aot["rows"], into_label="_into")
    write_report(args.dir, failures, arch, report, cubins, jm, am)
    return verdict(failures, ok_text)


def cli(doc, cmd_jit, cmd_aot, cmd_compare, argv=None, calls=100, extra=()):
    """The jit / aot / compare command line the parity scripts share; ``extra`` = (flag, kwargs) pairs."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("jit", "aot", "compare"))
    p.add_argument("--dir", required=True, help="folder shared by the three steps")
    p.add_argument("--calls", type=int, default=calls, help="warm calls timed per case (median)")
    p.add_argument("--only", default="", help="run only cases whose name contains one of these comma-separated strings")
    for flag, kw in extra:
        p.add_argument(flag, **kw)
    args = p.parse_args(argv)
    if args.mode == "compare":
        return cmd_compare(args)
    (cmd_jit if args.mode == "jit" else cmd_aot)(args)
    return 0


def cubin_report(jit_cubins, entries):
    """Every cubin the JIT compiled against the shipped entry of its key: (report rows, failures)."""
    report, failures = [], []
    for c in jit_cubins:
        match = shipped(entries, c["op"], c["key"]) if entries is not None else []
        shas = sorted({e.get("sha256") for e in match})
        ok = bool(c["sha256"]) and shas == [c["sha256"]]
        report.append(dict(c, shipped=shas, ids=[e.get("id") for e in match], ok=ok))
        if not ok:
            why = "no cubin from the JIT" if not c["sha256"] else ("no shipped entry" if not shas else f"shipped {shas}")
            failures.append(f"JIT cubin {c['op']} {c['key']} ({c['jit_key']}): sha256 {c['sha256']} vs {why}")
    if not jit_cubins:
        failures.append("the JIT side recorded no cubins")
    return report, failures


def print_summary(jm, am, cubins, jit_rows, aot_rows, into_label=None):
    """The lines under a parity table: import and yardstick costs, cubin hashes and loads, and the
    medians over the cases both sides ran (warm host time; first calls that compiled / loaded)."""
    print(f"import: JIT cutlass+cudnn modules {jm.get('import_s', float('nan')):.2f} s, dsa_aot.dsa {am.get('import_s', float('nan')) * 1e3:.1f} ms")
    print(f"torch.add warm host us: JIT process {jm.get('torch_add_us', float('nan')):.1f}, AOT process {am.get('torch_add_us', float('nan')):.1f}")
    print(f"JIT cubins: {len(cubins)} compiled, {sum(c['ok'] for c in cubins)} with the shipped sha256")
    loads = (am.get("runtime_stats") or {}).get("load_stats")
    if isinstance(loads, dict) and loads and all(isinstance(v, (int, float)) for v in loads.values()):
        v = sorted(loads.values())
        print(f"aot cubin loads (dsa_aot.runtime.load_stats): {len(v)}, median {statistics.median(v):.2f} ms, max {v[-1]:.2f} ms, total {sum(v):.1f} ms")
    both = [(jit_rows[n], aot_rows[n]) for n in jit_rows if n in aot_rows and "warm_us" in jit_rows[n] and "warm_us" in aot_rows[n]]
    if both:
        jw, aw = statistics.median(j["warm_us"] for j, _ in both), statistics.median(a["warm_us"] for _, a in both)
        jf = [j["first_s"] for j, _ in both if j.get("new")]
        af = [a["first_s"] for _, a in both if a.get("new")]
        ai = [a["warm_into_us"] for _, a in both if "warm_into_us" in a]
        print(f"warm host us per op call, median over cases: JIT {jw:.1f}, AOT {aw:.1f} (AOT/JIT {aw / jw:.2f})"
              + (f"; AOT {into_label} {statistics.median(ai):.1f}" if ai and into_label else ""))
        if jf and af:
            print(f"first call that compiles/loads, median: JIT {statistics.median(jf):.2f} s, AOT {1e3 * statistics.median(af):.1f} ms "
                  f"(JIT/AOT {statistics.median(jf) / statistics.median(af):.0f}x)")


def write_report(d, failures, arch, rows, cubins, jm, am):
    """<d>/parity.json: the verdict, every failure, the per-case rows and cubins, both sides' metadata."""
    with open(os.path.join(d, "parity.json"), "w") as f:
        json.dump({"ok": not failures, "failures": failures, "arch": arch, "rows": rows, "cubins": cubins, "meta": {"jit": jm, "aot": am}}, f,
                  indent=1, default=str)


def keep_cubins():
    """JIT side: make the DSL keep each compiled cubin (set before the DSL is imported)."""
    keep = os.environ.get("CUTE_DSL_KEEP", "")
    if "cubin" not in keep.split(","):
        os.environ["CUTE_DSL_KEEP"] = ",".join(p for p in (keep, "cubin") if p)


def jit_cubins(tables, index_key):
    """The cubins in the JIT's compile caches: ``tables`` (kind, {jit key: compiled fn}),
    ``index_key(kind, jit key)`` -> the shipped (op, key) it corresponds to."""
    import hashlib

    result = []
    for kind, table in tables:
        for key, fn in table.items():
            cubin = loaded_cubin(fn)
            op, k = index_key(kind, key)
            result.append({"op": op, "key": k, "jit_key": repr(key), "sha256": hashlib.sha256(cubin).hexdigest() if cubin else None,
                           "bytes": len(cubin) if cubin else 0})
    return result



def jit_side(args, make_api, build_cases, make_inputs, run_case, describe, failed_row):
    """The ``jit`` subcommand the parity scripts share: keep the JIT's cubins, import cudnn's side
    (``make_api()``, timed), write the selected cases and their inputs (fixed seeds) under
    ``<dir>/inputs`` for the ``dsa_aot`` step to follow, run ``run_case(name, spec, inputs, api, args,
    out_dir)`` for each (an exception fails its case only: ``failed_row(name, spec, exc, "jit")``),
    print ``describe(row)`` per case, and write ``<dir>/jit.json`` (rows, run metadata, the JIT's
    cubins: ``api.cubins()``)."""
    keep_cubins()
    import torch

    t0 = time.perf_counter()
    api = make_api()  # imports cutlass and the cudnn kernel modules
    import_s = time.perf_counter() - t0
    in_dir, out_dir = os.path.join(args.dir, "inputs"), os.path.join(args.dir, "jit")
    os.makedirs(in_dir, exist_ok=True)
    os.makedirs(out_dir, exist_ok=True)
    quick = bool(getattr(args, "quick", False))
    cases = [(n, s) for n, s in build_cases(quick) if selected(args, n)]
    with open(os.path.join(in_dir, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)
    rows = {}
    for name, spec in cases:
        x = make_inputs(spec)
        torch.save(x, os.path.join(in_dir, f"{name}.pt"))
        try:
            rows[name] = r = run_case(name, spec, to_cuda(x), api, args, out_dir)
        except Exception as exc:  # noqa: BLE001 - recorded as this case's failure; the other cases still run
            rows[name] = failed_row(name, spec, exc, "jit")
            continue
        print(f"jit {name}: first {r['first_s']:.3f} s{'' if r.get('new') else ' (nothing compiled)'}, {describe(r)}"
              + (f"  KEY ERROR: {r['key_error']}" if r.get("key_error") else ""), flush=True)
    cap = torch.cuda.get_device_capability()
    m = meta(torch)
    m.update(import_s=import_s, arch=f"sm_{cap[0]}{cap[1]}a", capability=list(cap), torch_add_us=torch_add_us(args.calls), calls=args.calls,
             quick=quick)  # fmt: skip
    with open(os.path.join(args.dir, "jit.json"), "w") as f:
        json.dump({"meta": m, "rows": rows, "cubins": api.cubins()}, f, indent=1)
    print(f"wrote {os.path.join(args.dir, 'jit.json')}")


class CompileKeys:
    """The JIT side's view of a first call, from cudnn's compile caches: a subclass gives ``_snapshot()``
    (the set of (kind, cache key) the caches hold), ``jit_keys(spec)`` (the keys upstream must use for a
    case) and ``index_key(kind, key)`` (a cache key as the index's (op, key)). ``end_first`` returns
    {"keys", "new", "key_error" when a predicted key is missing or another was compiled}."""

    def begin_first(self, spec):
        self._before = self._snapshot()

    def end_first(self, spec):
        want = self.jit_keys(spec)
        after = self._snapshot()
        res = {"keys": [list(self.index_key(*k)) for k in want], "new": any(k not in self._before for k in want)}
        missing = [k for k in want if k not in after]
        unexpected = sorted(repr(k) for k in after - self._before if k not in want)
        if missing or unexpected:
            res["key_error"] = f"predicted compile keys not in cudnn's caches: {missing}; compiled besides: {unexpected}"
        return res


class LauncherSpy:
    """The AOT side's view of a first call: the (op, key) entries an op module's ``launcher`` resolves
    (as often as it does: a second lookup of one kernel shows as a mismatch with the JIT's keys), and
    whether the call loaded a cubin. ``begin(op_mod, *caches)`` empties the op's plan caches (so that
    the first call resolves its entries) and puts the spy in place; ``end()`` removes it and returns
    {"keys", "new", "loaded"}; ``restore()`` removes it after a first call that raised. The spy is
    gone before any timing loop."""

    def __init__(self, runtime):
        self.runtime, self._orig = runtime, None

    def begin(self, op_mod, *caches):
        for c in caches:
            c.clear()
        self._used, self._loaded = [], set(self.runtime.load_stats())
        if not hasattr(op_mod, "launcher"):  # a declared op (dsa_aot.ops.declare) resolves its entries there
            op_mod = importlib.import_module("dsa_aot.ops.declare")
        orig = op_mod.launcher

        def spy(family, op, key, dev, hint=""):
            self._used.append([op, dict(key)])
            return orig(family, op, key, dev, hint)

        self._op_mod, self._orig, op_mod.launcher = op_mod, orig, spy

    def restore(self):
        if self._orig is not None:
            self._op_mod.launcher, self._orig = self._orig, None

    def end(self) -> dict:
        self.restore()
        new = {k: v for k, v in self.runtime.load_stats().items() if k not in self._loaded}
        return {"keys": self._used, "new": bool(new), "loaded": {f"{k[0]}@{k[1]}" if isinstance(k, tuple) else str(k): v for k, v in new.items()}}


def cache_of(mod, name: str) -> dict:
    """The cache ``name`` of op module ``mod``: a module global (``_CALLS``) or a declared op's (``TOP_K.cache``)."""
    obj = mod
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


class SpiedAot:
    """The AOT side's api base for an op module (``OP_MODULE``, its name) whose validated calls live in
    its ``CACHES`` (emptied before a first call): ``begin_first`` / ``end_first`` / ``restore`` record a
    first call's entry lookups with a :class:`LauncherSpy`; a subclass adds ``call`` (and ``call_into``)."""

    OP_MODULE = ""
    CACHES = ("_CALLS",)

    def __init__(self, dsa, runtime):
        self.dsa, self.spy = dsa, LauncherSpy(runtime)

    def begin_first(self, spec):
        mod = importlib.import_module(self.OP_MODULE)
        self.spy.begin(mod, *(cache_of(mod, c) for c in self.CACHES))

    def restore(self):
        self.spy.restore()

    def end_first(self, spec):
        return self.spy.end()


def aot_side(args, script, family, make_api, run_case, describe, failed_row=None, inputs_of=lambda name, spec: name):
    """The ``dsa_aot`` subcommand every parity script runs: block the JIT toolchain, import dsa_aot (timed), run
    ``run_case(name, spec, inputs, api, args, out_dir)`` for each selected case the ``jit`` step saved
    (inputs from ``<dir>/inputs/<inputs_of(name, spec)>.pt``), print ``describe(row)`` per case, and write
    ``<dir>/aot.json`` (rows, run metadata, the shipped index of ``family``). With ``failed_row``, an
    exception fails its case only (``failed_row(name, spec, exc, "aot")``) and the others still run;
    ``api.restore()`` is called first."""
    install_blocker()
    import torch

    t0 = time.perf_counter()
    import dsa_aot
    import dsa_aot.dsa
    import dsa_aot.runtime

    import_s = time.perf_counter() - t0
    api = make_api(dsa_aot.dsa, dsa_aot.runtime)
    in_dir, out_dir = os.path.join(args.dir, "inputs"), os.path.join(args.dir, "aot")
    cases_path = os.path.join(in_dir, "cases.json")
    if not os.path.exists(cases_path):
        raise SystemExit(f"missing {cases_path}: run `python {script} jit --dir {args.dir}` first")
    with open(cases_path) as f:
        cases = json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    rows = {}
    for name, spec in cases:
        if not selected(args, name):
            continue
        path = os.path.join(in_dir, f"{inputs_of(name, spec)}.pt")
        if not os.path.exists(path):
            raise SystemExit(f"missing inputs {path}: run `python {script} jit --dir {args.dir}` first")
        try:
            rows[name] = r = run_case(name, spec, to_cuda(torch.load(path)), api, args, out_dir)
        except Exception as exc:  # noqa: BLE001 - with failed_row: this case's failure; the other cases still run
            if failed_row is None:
                raise
            api.restore()
            rows[name] = failed_row(name, spec, exc, "aot")
            continue
        print(f"aot {name}: first {1e3 * r['first_s']:.2f} ms{'' if r['new'] else ' (nothing loaded)'}, {describe(r)}", flush=True)
    index_path, index = shipped_index(aot, family)
    m = meta(torch)
    m.update(import_s=import_s, torch_add_us=torch_add_us(args.calls), index_path=index_path, runtime_stats=runtime_stats(aot), calls=args.calls)
    with open(os.path.join(args.dir, "aot.json"), "w") as f:
        json.dump({"meta": m, "rows": rows, "index": index}, f, indent=1, default=str)
    print(f"wrote {os.path.join(args.dir, 'aot.json')}")
