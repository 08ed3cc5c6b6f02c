#!/usr/bin/env python3
"""JIT-vs-AOT parity of the CSA compressor ops, in two processes on one GPU machine.

    python ci/parity/csa_compressor.py jit --dir D      # cudnn + cutlass importable: JIT path, writes D/jit.json
    python ci/parity/csa_compressor.py aot --dir D      # cutlass NOT importable: aot ops, writes D/aot.json
    python ci/parity/csa_compressor.py compare --dir D  # table; exit status 1 on any mismatch

``dsa_aot`` imports the ``dsa_aot`` package from the environment (the installed wheel, or
``PYTHONPATH=<repo root>`` for a source checkout with a build in ``dsa_aot/_generated``).

``jit`` generates the inputs of every case from fixed seeds and saves them under D/inputs; ``dsa_aot``
loads the same files. Both poison every output with NaN (deterministic workspace with 0xFF bytes)
before the first call, save what the ops wrote, and time the ops the same way:

* first call: wall time of the first call of that op on that case, synchronised (JIT: includes the
  compile when the kernel's compile key is new in the process; AOT: includes the lazy cubin load);
* warm: median host time per call over ``--calls`` calls, the device synchronised only before and
  after the loop; ``torch.add`` on 16-element tensors is timed the same way as a yardstick.

The JIT side calls cudnn's launch functions ``compressor_sm100_r128.run_fwd_r128`` /
``run_bwd_r128`` and ``compressor_sm100.run_fwd`` / ``run_bwd`` (cudnn's public wrappers refuse
SM90, these do not) and records the sha256 of every cubin it compiled (``_COMPILED[key].__cubin__``,
with CUTE_DSL_KEEP=cubin). ``compare`` matches those against ``dsa_aot/_generated/index.json`` entries
(family csa_compressor, arch of the JIT device) by (op, ratio, d, coff, schedule, deterministic,
split), and checks outputs bitwise: out, grad_kv, grad_score, and grad_ape in deterministic mode.
The atomic grad_ape is not run-to-run deterministic: its AOT-vs-JIT max abs difference is held
against the jitter of two JIT runs (limit: max(4 * jitter, 1e-6 * max|grad_ape|)).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parity_common import bitwise as _bitwise  # noqa: E402
from parity_common import first_call, install_blocker, keep_cubins, nan_like, poisoned_workspace, torch_add_us, warm_us  # noqa: E402,F401
from parity_common import key_match as _key_match  # noqa: E402
from parity_common import jit_cubins  # noqa: E402
from parity_common import meta as _meta  # noqa: E402
from parity_common import runtime_stats as _runtime_stats  # noqa: E402
from parity_common import selected as _selected  # noqa: E402
from parity_common import cli, verdict  # noqa: E402

# ------------------------------------------------------------------------------------------------
# Cases: every bucket of every op
# ------------------------------------------------------------------------------------------------

# r128 bucket bounds of nb_total (= total_comp), inclusive; upstream compressor_sm100_r128
# _SMALL_NB_MAX = 128, _LARGE_NB_MIN = 1024, _BWD_SMALL_NB_MAX = 192.
FWD_R128 = (("small", 1, 128), ("default", 129, 1023), ("large", 1024, 2**31 - 1))
BWD_R128 = (("small", 1, 192), ("default", 193, 2**31 - 1))


def _bucket(table, nb):
    for name, lo, hi in table:
        if lo <= nb <= hi:
            return name
    raise ValueError(nb)


def build_cases():
    """[(name, spec)]; spec: ratio, coff, d, valid rows, pad rows, pad tokens, seed, ops."""
    cases = []
    seed = 1000
    for coff in (1, 2):
        for d in (128, 512):
            # s: fwd small + bwd small (with padding rows/tokens); m: fwd default + bwd default;
            # l: fwd large (131072 tokens; its backward would repeat the default bucket).
            for tag, valid, pad_rows, pad_tokens, ops in (
                ("s", 60, 4, 5, ("fwd", "bwd_atomic", "bwd_det")),
                ("m", 300, 0, 0, ("fwd", "bwd_atomic", "bwd_det")),
                ("l", 1024, 0, 0, ("fwd",)),
            ):
                seed += 1
                nb = valid + pad_rows
                name = f"r128-c{coff}-d{d}-{tag}-nb{nb}"
                cases.append((name, dict(ratio=128, coff=coff, d=d, valid=valid, pad_rows=pad_rows, pad_tokens=pad_tokens, seed=seed, ops=ops)))
    for ratio in (2, 4):
        for coff in (1, 2):
            for d in (128, 512):
                seed += 1
                name = f"r{ratio}-c{coff}-d{d}-nb1003"
                cases.append((name, dict(ratio=ratio, coff=coff, d=d, valid=1000, pad_rows=3, pad_tokens=2, seed=seed, ops=("fwd", "bwd_atomic", "bwd_det"))))
    return cases


def row_label(case, op):
    name, spec = case
    if spec["ratio"] == 128:
        nb = spec["valid"] + spec["pad_rows"]
        if op == "fwd":
            return f"fwd_r128/{_bucket(FWD_R128, nb)}"
        return f"bwd_r128/{_bucket(BWD_R128, nb)}/{'det' if op == 'bwd_det' else 'atomic'}"
    return {"fwd": "fwd", "bwd_atomic": "bwd/atomic", "bwd_det": "bwd/det"}[op]


# ------------------------------------------------------------------------------------------------
# Shared helpers (torch only)
# ------------------------------------------------------------------------------------------------


def make_inputs(spec):
    """Deterministic CPU inputs for one case (segments with tails, a short and an empty segment)."""
    import torch

    ratio, coff, d = spec["ratio"], spec["coff"], spec["d"]
    gen = torch.Generator().manual_seed(spec["seed"])

    def randint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    valid = spec["valid"]
    nseg = min(3, valid)
    cuts = sorted(torch.randperm(valid - 1, generator=gen)[: nseg - 1].add(1).tolist()) if nseg > 1 else []
    bounds = [0] + cuts + [valid]
    lengths = [(bounds[i + 1] - bounds[i]) * ratio + randint(0, ratio - 1) for i in range(nseg)]
    lengths.insert(randint(0, len(lengths)), randint(1, ratio - 1))  # shorter than ratio
    lengths.insert(randint(0, len(lengths)), 0)  # empty
    cu, cuc = [0], [0]
    for n in lengths:
        cu.append(cu[-1] + n)
        cuc.append(cuc[-1] + n // ratio)
    assert cuc[-1] == valid
    total_tokens = cu[-1] + spec["pad_tokens"]
    total_comp = valid + spec["pad_rows"]
    width = coff * d
    return dict(
        kv=torch.randn(total_tokens, width, generator=gen).to(torch.bfloat16),
        score=(2.0 * torch.randn(total_tokens, width, generator=gen)).to(torch.bfloat16),
        ape=(0.5 * torch.randn(ratio, width, generator=gen)).float(),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        cu_seqlens_comp=torch.tensor(cuc, dtype=torch.int32),
        grad_out=torch.randn(total_comp, d, generator=gen).to(torch.bfloat16),
        total_comp=total_comp,
    )


def to_cuda(x):
    import torch

    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in x.items()}


def run_case(name, spec, x, api, calls, out_dir):
    """Run every op of one case through ``api`` (JIT or AOT adapter); save outputs, return rows."""
    import torch

    d, nb = spec["d"], x["total_comp"]
    ins = (x["kv"], x["score"], x["ape"], x["cu_seqlens"], x["cu_seqlens_comp"])
    saved, rows = {}, {}
    for op in spec["ops"]:
        row = {"case": name, "op": op, "label": row_label((name, spec), op)}
        if op == "fwd":
            out = torch.full((nb, d), float("nan"), dtype=torch.bfloat16, device="cuda")
            row["keys"], row["compiled_new"] = api.fwd_keys(spec, nb)
            row["first_s"] = first_call(lambda: api.fwd(ins, out, spec))
            saved["fwd.out"] = out.cpu()
            row["warm_us"] = warm_us(lambda: api.fwd(ins, out, spec), calls)
        else:
            det = op == "bwd_det"
            gkv, gs = nan_like(x["kv"]), nan_like(x["score"])
            gape = nan_like(x["ape"]) if det else torch.zeros_like(x["ape"])
            ws = poisoned_workspace(api.workspace_bytes(spec, nb)) if det else None
            row["keys"], row["compiled_new"] = api.bwd_keys(spec, nb, det)
            row["first_s"] = first_call(lambda: api.bwd(ins, x["grad_out"], gkv, gs, gape, ws, spec, det))
            saved[f"{op}.grad_kv"], saved[f"{op}.grad_score"], saved[f"{op}.grad_ape"] = gkv.cpu(), gs.cpu(), gape.cpu()
            if not det:  # a second run from a fresh zeroed grad_ape: run-to-run jitter of the atomics
                gape2 = torch.zeros_like(x["ape"])
                api.bwd(ins, x["grad_out"], nan_like(x["kv"]), nan_like(x["score"]), gape2, None, spec, det)
                torch.cuda.synchronize()
                saved[f"{op}.grad_ape.run2"] = gape2.cpu()
            row["warm_us"] = warm_us(lambda: api.bwd(ins, x["grad_out"], gkv, gs, gape, ws, spec, det), calls)
        rows[f"{name}/{op}"] = row
    torch.save(saved, os.path.join(out_dir, f"{name}.pt"))
    return rows


# ------------------------------------------------------------------------------------------------
# JIT side (cudnn + cutlass)
# ------------------------------------------------------------------------------------------------


class JitApi:
    def __init__(self):
        from cudnn.csa.compressor import compressor_sm100 as g
        from cudnn.csa.compressor import compressor_sm100_r128 as r

        import torch

        self.g, self.r = g, r
        self.dev = torch.cuda.current_device()  # the device index inside cudnn's compile keys

    def _snapshot(self):
        return set(self.g._COMPILED) | set(self.r._COMPILED)

    @staticmethod
    def index_key(jit_key):
        """cudnn's _COMPILED key -> (op, key dict) as in dsa_aot/_generated/index.json."""
        tag = jit_key[0]
        if tag == "r128fwd":
            _, ratio, d, coff, sched, _dev = jit_key
            return "fwd_r128", {"ratio": ratio, "d": d, "coff": coff, "schedule": list(sched)}
        if tag == "r128bwd":
            _, ratio, d, coff, sched, det, _dev = jit_key
            return "bwd_r128", {"ratio": ratio, "d": d, "coff": coff, "schedule": list(sched), "deterministic": bool(det)}
        if tag == "fwd":
            _, ratio, d, coff, _dev = jit_key
            return "fwd", {"ratio": ratio, "d": d, "coff": coff}
        if tag == "bwd":
            _, ratio, d, coff, det, _dev = jit_key
            return "bwd", {"ratio": ratio, "d": d, "coff": coff, "deterministic": bool(det)}
        if tag == "dape_reduce":
            _, split, _dev = jit_key
            return "dape_reduce", {"split": bool(split)}
        raise ValueError(f"unknown cudnn compile key {jit_key!r}")

    def _keys(self, jit_keys):
        new = [k for k in jit_keys if k not in self._snapshot()]
        return [list(self.index_key(k)) for k in jit_keys], bool(new)

    def fwd_keys(self, spec, nb):
        dev = self.dev
        ratio, d, coff = spec["ratio"], spec["d"], spec["coff"]
        if ratio == 128:
            return self._keys([("r128fwd", ratio, d, coff, self.r._fwd_schedule_r128(ratio, d, coff, nb), dev)])
        return self._keys([("fwd", ratio, d, coff, dev)])

    def bwd_keys(self, spec, nb, det):
        dev = self.dev
        ratio, d, coff = spec["ratio"], spec["d"], spec["coff"]
        if ratio == 128:
            keys = [("r128bwd", ratio, d, coff, self.r._bwd_schedule_r128(ratio, d, coff, nb), det, dev)]
        else:
            keys = [("bwd", ratio, d, coff, det, dev)]
        if det:
            keys.append(("dape_reduce", ratio == 4, dev))
        return self._keys(keys)

    def workspace_bytes(self, spec, nb):
        ratio, d, coff = spec["ratio"], spec["d"], spec["coff"]
        if ratio == 128:
            return self.r.bwd_dape_workspace_bytes_r128(nb, ratio, d, coff, self.dev)
        return self.g.bwd_dape_workspace_bytes(nb, ratio, d, coff)

    def fwd(self, ins, out, spec):
        run = self.r.run_fwd_r128 if spec["ratio"] == 128 else self.g.run_fwd
        run(*ins, out, out.shape[0], spec["ratio"], spec["d"], spec["coff"])

    def bwd(self, ins, go, gkv, gs, gape, ws, spec, det):
        run = self.r.run_bwd_r128 if spec["ratio"] == 128 else self.g.run_bwd
        run(*ins, go, gkv, gs, gape, go.shape[0], spec["ratio"], spec["d"], spec["coff"], deterministic=det, workspace=ws)

    def cubins(self):
        return jit_cubins(((None, self.g._COMPILED), (None, self.r._COMPILED)), lambda _, key: self.index_key(key))


def cmd_jit(args):
    keep_cubins()
    import torch

    t0 = time.perf_counter()
    api = JitApi()  # imports cutlass and the cudnn kernel modules
    import_s = time.perf_counter() - t0
    os.makedirs(os.path.join(args.dir, "inputs"), exist_ok=True)
    os.makedirs(os.path.join(args.dir, "jit"), exist_ok=True)
    rows = {}
    for name, spec in build_cases():
        if not _selected(args, name):
            continue
        x = make_inputs(spec)
        torch.save(x, os.path.join(args.dir, "inputs", f"{name}.pt"))
        rows.update(run_case(name, spec, to_cuda(x), api, args.calls, os.path.join(args.dir, "jit")))
        print(f"jit {name}: " + ", ".join(f"{r['op']} first {r['first_s']:.3f} s warm {r['warm_us']:.1f} us" for k, r in rows.items() if r["case"] == name), flush=True)
    cap = torch.cuda.get_device_capability()
    meta = _meta(torch)
    meta.update(import_s=import_s, arch=f"sm_{cap[0]}{cap[1]}a", torch_add_us=torch_add_us(args.calls))
    with open(os.path.join(args.dir, "jit.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "cubins": api.cubins()}, f, indent=1)
    print(f"wrote {os.path.join(args.dir, 'jit.json')}")


# ------------------------------------------------------------------------------------------------
# AOT side (no cutlass, no cudnn)
# ------------------------------------------------------------------------------------------------


class AotApi:
    def __init__(self, csa):
        self.csa = csa

    def fwd_keys(self, spec, nb):
        return [], None

    def bwd_keys(self, spec, nb, det):
        return [], None

    def workspace_bytes(self, spec, nb):
        import torch

        return self.csa.backward_workspace_bytes(nb, spec["ratio"], spec["d"], spec["coff"], torch.device("cuda", 0))

    def fwd(self, ins, out, spec):
        self.csa.compressor_forward_into(out, *ins, ratio=spec["ratio"], coff=spec["coff"])

    def bwd(self, ins, go, gkv, gs, gape, ws, spec, det):
        self.csa.compressor_backward_into(gkv, gs, gape, *ins, go, ratio=spec["ratio"], coff=spec["coff"], deterministic=det, workspace=ws)


def cmd_aot(args):
    install_blocker()
    import torch

    t0 = time.perf_counter()
    import dsa_aot
    import dsa_aot.csa

    import_s = time.perf_counter() - t0
    api = AotApi(dsa_aot.csa)
    os.makedirs(os.path.join(args.dir, "aot"), exist_ok=True)
    rows = {}
    for name, cspec in build_cases():
        if not _selected(args, name):
            continue
        path = os.path.join(args.dir, "inputs", f"{name}.pt")
        if not os.path.exists(path):
            raise SystemExit(f"missing inputs {path}: run `python ci/parity/csa_compressor.py jit --dir {args.dir}` first")
        x = to_cuda(torch.load(path))
        rows.update(run_case(name, cspec, x, api, args.calls, os.path.join(args.dir, "aot")))
        print(f"aot {name}: " + ", ".join(f"{r['op']} first {1e3 * r['first_s']:.2f} ms warm {r['warm_us']:.1f} us" for k, r in rows.items() if r["case"] == name), flush=True)
    index_path = os.path.join(os.path.dirname(dsa_aot.__file__), "_generated", "index.json")
    index = None
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
    meta = _meta(torch)
    meta.update(import_s=import_s, torch_add_us=torch_add_us(args.calls), index_path=index_path, runtime_stats=_runtime_stats(aot))
    with open(os.path.join(args.dir, "aot.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "index": index}, f, indent=1, default=str)
    print(f"wrote {os.path.join(args.dir, 'aot.json')}")


# ------------------------------------------------------------------------------------------------
# Compare
# ------------------------------------------------------------------------------------------------


def _sha_status(keys, cubins, index, arch):
    """'yes' / 'NO' / 'missing:...' for the kernels a row used."""
    if index is None:
        return "no-index"
    entries = [e for e in index.get("entries", []) if e.get("family") == "csa_compressor" and e.get("arch") == arch]
    status = "yes"
    for op, key in keys:
        jit = [c for c in cubins if c["op"] == op and c["key"] == key]
        if not jit or not jit[0]["sha256"]:
            return f"no-jit-cubin:{op}"
        match = [e for e in entries if e.get("op") == op and _key_match(e, key)]
        if not match:
            return f"missing:{op}"
        if any(e.get("sha256") != jit[0]["sha256"] for e in match):
            status = "NO"
    return status


def cmd_compare(args):
    import torch

    with open(os.path.join(args.dir, "jit.json")) as f:
        jit = json.load(f)
    with open(os.path.join(args.dir, "aot.json")) as f:
        aot = json.load(f)
    arch = jit["meta"].get("arch", "sm_90a")
    failures = []
    header = ("row", "bucket", "out/gkv/gs", "grad_ape", "sha256", "JIT 1st s", "JIT warm us", "AOT 1st ms", "AOT warm us")
    lines = []
    loaded = {}

    def outputs(side, case):
        if (side, case) not in loaded:
            loaded[(side, case)] = torch.load(os.path.join(args.dir, side, f"{case}.pt"))
        return loaded[(side, case)]

    for row_id, jr in jit["rows"].items():
        ar = aot["rows"].get(row_id)
        if ar is None:
            failures.append(f"{row_id}: not run on the aot side")
            lines.append((row_id, jr["label"], "not run", "", "", f"{jr['first_s']:.3f}", f"{jr['warm_us']:.1f}", "", ""))
            continue
        jo, ao = outputs("jit", jr["case"]), outputs("aot", jr["case"])
        op = jr["op"]
        names = ["fwd.out"] if op == "fwd" else [f"{op}.grad_kv", f"{op}.grad_score"]
        verdicts = []
        for n in names:
            eq, cnt = _bitwise(jo[n], ao[n])
            nans = int(torch.isnan(ao[n].float()).sum())
            verdicts.append("yes" if eq and nans == 0 else f"NO({cnt} diff, {nans} NaN)")
            if not (eq and nans == 0):
                failures.append(f"{row_id}: {n} not bitwise equal ({cnt} elements differ, {nans} NaN on the aot side)")
        ape = ""
        if op == "bwd_det":
            eq, cnt = _bitwise(jo[f"{op}.grad_ape"], ao[f"{op}.grad_ape"])
            ape = "bitwise yes" if eq else f"bitwise NO({cnt})"
            if not eq:
                failures.append(f"{row_id}: deterministic grad_ape not bitwise equal ({cnt} elements differ)")
        elif op == "bwd_atomic":
            j1, j2, a1 = jo[f"{op}.grad_ape"].double(), jo[f"{op}.grad_ape.run2"].double(), ao[f"{op}.grad_ape"].double()
            diff = float((a1 - j1).abs().max())
            jitter = float((j2 - j1).abs().max())
            limit = max(4 * jitter, 1e-6 * float(j1.abs().max()))
            ok = diff == diff and diff <= limit  # NaN fails
            ape = f"diff {diff:.2e} jitter {jitter:.2e} {'ok' if ok else 'NO'}"
            if not ok:
                failures.append(f"{row_id}: atomic grad_ape differs by {diff:.3e} > limit {limit:.3e} (JIT jitter {jitter:.3e})")
        sha = _sha_status(jr["keys"], jit["cubins"], aot.get("index"), arch)
        if sha != "yes":
            failures.append(f"{row_id}: cubin sha256 {sha} for {jr['keys']}")
        lines.append(
            (row_id, jr["label"], "/".join(verdicts), ape, sha, f"{jr['first_s']:.3f}{'' if jr.get('compiled_new') else '*'}", f"{jr['warm_us']:.1f}", f"{1e3 * ar['first_s']:.2f}", f"{ar['warm_us']:.1f}")
        )
    for row_id in aot["rows"]:
        if row_id not in jit["rows"]:
            failures.append(f"{row_id}: run on the aot side only")

    widths = [max(len(str(r[i])) for r in [header] + lines) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths)] + lines:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    print("(* = first JIT call of a compile key already compiled in this process: no compile inside)")
    jm, am = jit["meta"], aot["meta"]
    print(f"device: {jm.get('device')} ({jm.get('sm_count')} SMs), arch {arch}; torch {jm.get('torch')}")
    print(f"import: JIT cutlass+cudnn modules {jm.get('import_s', float('nan')):.2f} s, dsa_aot.csa {am.get('import_s', float('nan')) * 1e3:.1f} ms")
    print(f"torch.add warm host us: JIT process {jm.get('torch_add_us', float('nan')):.1f}, AOT process {am.get('torch_add_us', float('nan')):.1f}")
    stats = am.get("runtime_stats") or {}
    loads = stats.get("load_stats")
    if isinstance(loads, dict) and loads and all(isinstance(v, (int, float)) for v in loads.values()):
        v = sorted(loads.values())
        print(f"aot cubin loads (dsa_aot.runtime.load_stats): {len(v)}, median {statistics.median(v):.2f} ms, max {v[-1]:.2f} ms, total {sum(v):.1f} ms")
    elif stats:
        print(f"dsa_aot.runtime stats: {json.dumps(stats, default=str)[:2000]}")
    jw = [r["warm_us"] for r in jit["rows"].values()]
    aw = [r["warm_us"] for r in aot["rows"].values()]
    if jw and aw:
        print(f"warm host us, median over rows: JIT {statistics.median(jw):.1f}, AOT {statistics.median(aw):.1f}")
    return verdict(failures, f"{len(lines)} rows bitwise equal (atomic grad_ape within JIT jitter), every cubin sha256 equal")


def main(argv=None):
    return cli(__doc__, cmd_jit, cmd_aot, cmd_compare, argv, calls=200)


if __name__ == "__main__":
    sys.exit(main())
