#!/usr/bin/env python3
"""JIT-vs-AOT parity of the fused indexer forward + top-k's tail, stage 2 and local-to-global in place,
in two processes on one GPU machine (SM90 or SM100: the SIMT kernels are the same code; the GEMM before
them is SM100 only and is checked offline, ci/check_sm100_calls.py).

    python ci/parity/dsa_indexer_forward_top_k.py jit --dir D      # cudnn + cutlass importable: writes D/jit.json
    python ci/parity/dsa_indexer_forward_top_k.py aot --dir D      # cutlass NOT importable: aot, writes D/aot.json
    python ci/parity/dsa_indexer_forward_top_k.py compare --dir D  # markdown table + D/parity.json; exit 1 on any mismatch

Both sides run on one candidate buffer (the compact ratio-causal scores the GEMM writes, built here from
random scores: tests/gpu/ref_indexer_forward_top_k.compact) into NaN / 0x7EADBEEF-poisoned outputs. JIT:
the functions cudnn's wrapper calls, ``compress_stage2_topk`` / ``compress_stage2_topk_varlen`` with the
wrapper's block size (``_select_topk_block_threads``) and ``_local_to_global_inplace`` for global ids.
AOT: ``dsa_aot.ops.dsa_indexer_forward_top_k._tail_into`` (the same two launches of the fused plan). Cases:
every block size (256 / 512 / 1024 threads), BSHD and THD, causal offsets, softmax on and off, ties
with ``deterministic``, local and global ids, top-k 512 / 1024 / 2048, ratio 4 and 1.

``compare``: per row the selected ids and logits bitwise equal JIT vs AOT (slot order is unspecified
upstream: rows are compared sorted by id); the softmax within the JIT's own run-to-run jitter
(``jitter_verdict``, three reruns a side): its fp32 sum runs over the slots, whose order the kernel's
atomicAdd slot assignment decides (compress_top_k_sm100.py l.396-517, the sum l.588-591), so its last
bits vary from run to run on one cubin (measured on the H200); both sides within the fp64 reference
(``check_dense``, or ``check_rows`` for tied scores), the same kernels, each JIT cubin with the shipped
sha256 (stage 2: this family; local-to-global: dsa_topk_utils).
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from parity_common import (  # noqa: E402
    SpiedAot,
    aot_side,
    bitwise,
    cli,
    cubin_report,
    device_us,
    family_entries,
    first_call,
    jit_cubins,
    jit_side,
    jitter_verdict,
    load_json,
    md_table,
    print_summary,
    sha_status,
    verdict,
    warm_us,
    write_report,
)
from parity_common import host_copy as _host  # noqa: E402
from parity_common import key_str as _key_str  # noqa: E402
from parity_common import same as _same  # noqa: E402

FAMILY = "dsa_indexer_forward_top_k"
FAMILIES = (FAMILY, "dsa_topk_utils")  # local-to-global is that family's entry
SCRIPT = "ci/parity/dsa_indexer_forward_top_k.py"
POISON = 0x7EADBEEF
RERUNS = ("run2", "run3", "run4")


def build_cases(quick=False):
    cases = []

    def add(name, **spec):
        spec.update({k: v for k, v in dict(thd=False, ratio=4, top_k=512, offsets=False, softmax=True, det=False, glob=False, ties=False).items() if k not in spec})
        spec["seed"] = 9000 + zlib.crc32(name.encode()) % 100000
        cases.append((name, spec))

    add("bshd-256t-k512-global", segs=[[2560, 1024]], glob=True)
    add("bshd-256t-k2048-offs", segs=[[256, 1024]] * 2, top_k=2048, offsets=True)
    add("bshd-512t-k512-offs-nosoftmax", segs=[[100, 8191]] * 3, offsets=True, softmax=False, glob=True)
    add("bshd-1024t-k1024-offs", segs=[[200, 10000]] * 2, top_k=1024, offsets=True, glob=True)
    add("bshd-256t-k512-ties-det", segs=[[2560, 1024]], det=True, ties=True)
    add("bshd-ratio1-256t-k2048", segs=[[300, 3000]] * 2, ratio=1, top_k=2048, offsets=True, glob=True)
    add("thd-512t-k512", segs=[[100, 40], [3, 20], [0, 5], [260, 90]], thd=True)
    add("thd-256t-k2048-offs-global", segs=[[300, 200], [0, 3], [400, 300]], thd=True, top_k=2048, offsets=True, glob=True)
    add("thd-1024t-k1024-global", segs=[[50, 9000], [10, 8192]], thd=True, top_k=1024, glob=True)
    add("thd-256t-k512-ties-det-offs", segs=[[600, 700]], thd=True, det=True, ties=True, offsets=True, glob=True)
    if quick:
        cases = [c for c in cases if "1024t" not in c[0]]
    return cases


def label(spec):
    return (f"{'THD' if spec['thd'] else 'BSHD'} k{spec['top_k']} r{spec['ratio']}" + (" offs" if spec["offsets"] else "")
            + ("" if spec["softmax"] else " nosm") + (" det" if spec["det"] else "") + (" global" if spec["glob"] else ""))


def _ref():
    here = os.path.join(ROOT, "tests", "gpu")
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module("ref_indexer_forward_top_k")


def problem(spec):
    """(dense scores per batch (float64 of fp32), causal offsets): random normal, or few levels with ``ties``."""
    import torch

    gen = torch.Generator().manual_seed(spec["seed"])
    dense, offs = [], []
    for s_q, s_k in spec["segs"]:
        d = torch.randint(0, 6, (s_q, s_k), generator=gen).double() if spec["ties"] else torch.randn(s_q, s_k, generator=gen).float().double()
        dense.append(d)
        hi = max(0, spec["ratio"] * s_k - s_q)
        offs.append(int(torch.randint(0, hi + 1, (1,), generator=gen)) if spec["offsets"] else 0)
    return dense, offs


def make_inputs(spec):
    import torch

    dense, offs = problem(spec)
    cand, cbo = _ref().compact(dense, spec["ratio"], offs)
    segs = spec["segs"]
    cu_q = torch.tensor([0] + [sum(s for s, _ in segs[: b + 1]) for b in range(len(segs))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(k for _, k in segs[: b + 1]) for b in range(len(segs))], dtype=torch.int32)
    return dict(cand=cand, cbo=cbo, qco=torch.tensor(offs, dtype=torch.int32), cu_q=cu_q, cu_k=cu_k)


def _geometry(spec):
    segs = spec["segs"]
    rows = sum(s for s, _ in segs)
    lead = (rows,) if spec["thd"] else (len(segs), segs[0][0])
    return rows, lead, max(s for s, _ in segs), max(k for _, k in segs)


def _outs(spec):
    import torch

    _, lead, _, _ = _geometry(spec)
    shape = lead + (spec["top_k"],)
    return {"indices": torch.full(shape, POISON, dtype=torch.int32, device="cuda"), "logits": torch.full(shape, math.nan, device="cuda"),
            **({"softmax": torch.full(shape, math.nan, device="cuda")} if spec["softmax"] else {})}


def run_case(name, spec, x, api, args, out_dir):
    import torch

    pristine = {k: v.clone() for k, v in x.items()}
    row = {"case": name, "label": label(spec), "spec": spec}
    outs = _outs(spec)
    api.begin_first(spec)
    row["first_s"] = first_call(lambda: api.call(spec, x, outs))
    row.update(api.end_first(spec))
    saved = {f"first.{n}": _host(t) for n, t in outs.items()}
    for run in RERUNS:  # the softmax's last bits follow the slot order the kernel's atomics give: measure that jitter
        again = _outs(spec)
        api.call(spec, x, again)
        torch.cuda.synchronize()
        saved.update({f"{run}.{n}": _host(t) for n, t in again.items()})
    row["inputs_untouched"] = all(_same(x[k], v) for k, v in pristine.items())
    row["warm_us"] = warm_us(lambda: api.call(spec, x, again), args.calls, sync_every=16)
    row["device_us"] = device_us(lambda: api.call(spec, x, again))
    torch.save(saved, os.path.join(out_dir, f"{name}.pt"))
    return row


def failed_row(name, spec, exc, side):
    import traceback

    traceback.print_exc()
    return {"case": name, "label": label(spec), "spec": spec, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}


class _Recording(dict):
    """A JIT compile cache that notes the keys looked up (``_compile_cache[key](...)``)."""

    def __init__(self, d):
        super().__init__(d)
        self.used = []

    def __getitem__(self, k):
        self.used.append(k)
        return super().__getitem__(k)


class JitApi:
    def __init__(self):
        self.s2 = importlib.import_module("cudnn.deepseek_sparse_attention.indexer_top_k.compress_top_k_sm100")
        self.l2g = importlib.import_module("cudnn.deepseek_sparse_attention.indexer_top_k.local_to_global_dsl")
        self.ctk = importlib.import_module("cudnn.deepseek_sparse_attention.indexer_forward._compressed_top_k_sm100")

    @staticmethod
    def index_key(kind, k):
        if kind == "l2g":
            dt, vl, keep = k
            return "local_to_global", {"dtype": str(dt).removeprefix("torch."), "varlen": vl, "preserve_negative": keep}
        if k[0] == "varlen":
            _, top_k, ratio, bt, offs, sm, det = k
            return "stage2", {"top_k": top_k, "ratio": ratio, "threads": bt, "offsets": offs, "softmax": sm, "deterministic": det, "varlen": True}
        _, _, _, top_k, ratio, bt, _, offs, sm, det = k
        return "stage2", {"top_k": top_k, "ratio": ratio, "threads": bt, "offsets": offs, "softmax": sm, "deterministic": det, "varlen": False}

    def _tables(self):
        return (("stage2", self.s2._compile_cache), ("l2g", self.l2g._compile_cache))

    def begin_first(self, spec):
        # the kernels a call uses, compiled now or before: every lookup of the compile caches, recorded
        for mod in (self.s2, self.l2g):
            if not isinstance(mod._compile_cache, _Recording):
                mod._compile_cache = _Recording(mod._compile_cache)
            mod._compile_cache.used.clear()
        self._before = {kind: set(t) for kind, t in self._tables()}

    def end_first(self, spec):
        new = [k for kind, t in self._tables() for k in t if k not in self._before[kind]]
        used = [list(self.index_key(kind, k)) for kind, t in self._tables() for k in t.used]
        return {"keys": used, "new": bool(new)}

    def call(self, spec, x, outs):
        rows, lead, s_q, s_k = _geometry(spec)
        bt = self.ctk._select_topk_block_threads(rows, s_k)  # the wrapper's: B * S_q (BSHD) or total_q rows
        kw = dict(out_indices=outs["indices"], out_logits=outs["logits"], out_softmax=outs.get("softmax"), return_softmax=spec["softmax"],
                  deterministic=spec["det"], q_causal_offsets=x["qco"] if spec["offsets"] else None)
        if spec["thd"]:
            self.s2.compress_stage2_topk_varlen(x["cand"], x["cu_q"], x["cu_k"], x["cbo"], rows, s_q, s_k, spec["top_k"], spec["ratio"], block_threads=bt,
                                                **kw)
            if spec["glob"]:
                self.l2g._local_to_global_inplace(outs["indices"], 0, x["cu_q"], x["cu_k"])
        else:
            self.s2.compress_stage2_topk(x["cand"], lead[0], s_q, s_k, spec["top_k"], spec["ratio"], block_threads=bt,
                                         cand_batch_offsets=x["cbo"] if spec["offsets"] else None, **kw)
            if spec["glob"]:
                self.l2g._local_to_global_inplace(outs["indices"], s_k)

    def cubins(self):
        return jit_cubins(self._tables(), self.index_key)


def cmd_jit(args):
    jit_side(args, JitApi, build_cases, make_inputs, run_case, lambda r: f"warm {r['warm_us']:.1f} us, device {r['device_us']:.1f} us", failed_row)


class AotApi(SpiedAot):
    OP_MODULE = "dsa_aot.ops.dsa_indexer_forward_top_k"
    CACHES = ("_TAILS",)

    def call(self, spec, x, outs):
        import dsa_aot.ops.dsa_indexer_forward_top_k as op_mod

        _, _, s_q, s_k = _geometry(spec)
        thd = spec["thd"]
        op_mod._tail_into(outs["indices"], outs["logits"], outs.get("softmax"), x["cand"], s_q, s_k, spec["top_k"], spec["ratio"],
                          cand_batch_offsets=x["cbo"] if thd or spec["offsets"] else None, q_causal_offsets=x["qco"] if spec["offsets"] else None,
                          cu_seqlens_q=x["cu_q"] if thd else None, cu_seqlens_k=x["cu_k"] if thd else None, deterministic=spec["det"],
                          topk_indices_global=spec["glob"])


def cmd_aot(args):
    aot_side(args, SCRIPT, FAMILIES, AotApi, run_case, lambda r: f"warm {r['warm_us']:.1f} us", failed_row)


def by_id(saved, form):
    """(indices, logits, softmax) of ``form`` with every row's slots sorted by id (-1 padding last): upstream
    leaves the slot order unspecified."""
    import torch

    idx = saved[f"{form}.indices"]
    flat = idx.reshape(-1, idx.shape[-1]).long()
    order = torch.argsort(torch.where(flat < 0, 2**40, flat), dim=1, stable=True)
    out = [torch.gather(flat, 1, order)]
    for n in ("logits", "softmax"):
        if f"{form}.{n}" in saved:
            out.append(torch.gather(saved[f"{form}.{n}"].reshape(flat.shape), 1, order))
    return out


def cmd_compare(args):
    import torch

    jit = load_json(os.path.join(args.dir, "jit.json"), SCRIPT, "jit", args.dir)
    aot = load_json(os.path.join(args.dir, "aot.json"), SCRIPT, "aot", args.dir)
    if jit is None or aot is None:
        return 1
    arch = jit["meta"].get("arch", "sm_90a")
    entries = family_entries(aot.get("index"), FAMILIES, arch)
    ref = _ref()
    failures, lines, report = [], [], []
    for name, jr in jit["rows"].items():
        spec, ar = jr["spec"], aot["rows"].get(name)
        report.append({"case": name, "spec": spec})
        if ar is None or "error" in ar or "error" in jr:
            failures.append(f"{name}: {jr.get('error') or (ar or {}).get('error') or 'not run on the aot side'}")
            continue
        jo = torch.load(os.path.join(args.dir, "jit", f"{name}.pt"))
        ao = torch.load(os.path.join(args.dir, "aot", f"{name}.pt"))
        ok = True
        js, as_ = {}, {}
        want = by_id(jo, "first")
        for form in ("first",) + RERUNS:
            jf, af = by_id(jo, form), by_id(ao, form)
            for i, n in enumerate(("indices", "logits")):
                eq, cnt = bitwise(want[i], af[i])
                if not eq:
                    ok = False
                    failures.append(f"{name}: AOT {form}.{n} (rows sorted by id) not bitwise equal to JIT ({cnt} elements)")
            if spec["softmax"]:
                key = "softmax" if form == "first" else f"softmax.{form}"
                js[key], as_[key] = jf[2], af[2]
        sm_text = "-"
        if spec["softmax"]:  # its fp32 sum runs in slot order, which the kernel's atomics decide: against the JIT's own jitter
            sm_ok, sm_text, _ = jitter_verdict(js, as_, "softmax")
            if not sm_ok:
                ok = False
                failures.append(f"{name}: AOT softmax vs JIT {sm_text}")
        dense, offs = problem(spec)
        rows, _, _, s_k = _geometry(spec)
        segs = spec["segs"]
        if spec["glob"]:
            starts = [sum(k for _, k in segs[:b]) for b in range(len(segs))] if spec["thd"] else [b * s_k for b in range(len(segs))]
        else:
            starts = [0] * len(segs)
        for side, saved in (("jit", jo), ("aot", ao)):
            idx = saved["first.indices"].reshape(rows, -1)
            val = saved["first.logits"].reshape(rows, -1)
            sm = saved["first.softmax"].reshape(rows, -1) if "first.softmax" in saved else None
            try:
                if spec["det"] or spec["ties"]:
                    ref.check_rows(idx, val, sm, dense, spec["ratio"], offs, spec["top_k"], deterministic=spec["det"], base=starts)
                else:  # random fp32 scores rarely tie at the boundary; check_rows decides those (ref.Tie)
                    scores = torch.full((rows, s_k), -math.inf, dtype=torch.float64)
                    r0 = 0
                    for d, off in zip(dense, offs):
                        for i in range(d.shape[0]):
                            n = ref.visible(off, i, spec["ratio"], d.shape[1])
                            scores[r0 + i, :n] = d[i, :n]
                        r0 += d.shape[0]
                    base = torch.cat([torch.full((d.shape[0],), st) for d, st in zip(dense, starts)])
                    try:
                        ref.check_dense(idx, val, sm, scores, spec["top_k"], base)
                    except ref.Tie:
                        ref.check_rows(idx, val, sm, dense, spec["ratio"], offs, spec["top_k"], base=starts)
            except AssertionError as e:
                ok = False
                failures.append(f"{name}: {side} off the reference ({e})")
        if not ar.get("inputs_untouched") or not jr.get("inputs_untouched"):
            ok = False
            failures.append(f"{name}: inputs modified")
        same_k = sorted(map(_key_str, jr["keys"])) == sorted(map(_key_str, ar["keys"]))
        sha = sha_status(jr["keys"], jit["cubins"], entries)
        if not same_k or sha != "yes":
            ok = False
            failures.append(f"{name}: kernels {jr['keys']} vs {ar['keys']}, sha256 {sha}")
        lines.append((name, jr["label"], "yes" if ok else "NO", sm_text, sha, f"{jr['first_s']:.3f}", f"{1e3 * ar['first_s']:.2f}", f"{jr['warm_us']:.1f}",
                      f"{ar['warm_us']:.1f}", f"{jr['device_us']:.1f} / {ar['device_us']:.1f}"))
    cubins, cubin_fails = cubin_report(jit.get("cubins", []), entries)
    failures += cubin_fails
    print(md_table(("case", "kernel", "ok", "softmax vs JIT", "sha256", "JIT 1st s", "AOT 1st ms", "JIT warm us", "AOT warm us", "device us JIT/AOT"), lines))
    print_summary(jit["meta"], aot["meta"], cubins, jit["rows"], aot["rows"])
    write_report(args.dir, failures, arch, report, cubins, jit["meta"], aot["meta"])
    return verdict(failures, f"{len(lines)} cases: selected ids and logits bitwise equal JIT vs AOT (rows sorted by id), softmax within the JIT's "
                             f"own run-to-run jitter, both within the reference, same kernels, cubin sha256 equal")


def main(argv=None):
    return cli(__doc__, cmd_jit, cmd_aot, cmd_compare, argv, extra=(("--quick", dict(action="store_true", help="jit: no 1024-thread case")),))


if __name__ == "__main__":
    sys.exit(main())
