#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA indexer forward (indexer_forward_wrapper), in two processes on one GPU machine.

    python ci/parity/dsa_indexer_forward.py jit --dir D      # cudnn + cutlass importable: JIT path, writes D/jit.json
    python ci/parity/dsa_indexer_forward.py aot --dir D      # cutlass NOT importable: dsa_aot.dsa, writes D/aot.json
    python ci/parity/dsa_indexer_forward.py compare --dir D  # markdown table + D/parity.json; exit status 1 on any mismatch

Both sides make the same public call with the same arguments::

    indexer_forward(q, k, w, ratio, sm_scale=, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=,
                    q_causal_offsets=, precision=, q_scale=, k_scale=, return_lse=)   -> {'scores'[, 'lse']}

JIT: ``cudnn.deepseek_sparse_attention.indexer_forward_wrapper`` (SM90 path on the H200); AOT:
``dsa_aot.dsa.indexer_forward`` and ``indexer_forward_into``. Cases: bf16 and fp8 (per-token descales),
W bf16 and fp32, H 64 / 32 / 16, ratio 4 and 1, BSHD and THD (segments that cover every row, one
of them empty), causal offsets, LSE, the three fp8 H64 BSHD variants upstream picks from S_q % 2 and
S_k % 64, and a prefill-sized case (S_q 4096).

Per case and side: a first call (timed, synchronised; JIT: includes the compile when its key is new in
the process; AOT: the lazy cubin load), the allocating call again with its outputs served from a
private memory pool just filled with NaN, then (AOT) the ``_into`` form on NaN-filled outputs; warm
median host time per call (allocating; AOT also ``_into``) and device time per call.

``compare``: every AOT output bitwise equal to the JIT's; both sides within the fp64 reference's
bound (tests/gpu/ref_indexer_forward.py, computed on the GPU in fp64) with the -inf mask exact; the
inputs untouched; the same kernel on both sides (the AOT lookup equals upstream's compile key); the
JIT's cubin of that key has the sha256 of the shipped entry.
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
    jit_side,
    aot_side,
    bitwise,
    cli,
    cubin_report,
    device_us,
    family_entries,
    first_call,
    jit_cubins,
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

FAMILY = "dsa_indexer_forward"
SCRIPT = "ci/parity/dsa_indexer_forward.py"
SYNC_EVERY = 16
BOUND = {"bf16": 1e-5, "fp8": 2e-3}  # as tests/gpu/test_dsa_indexer_forward.py


def build_cases(quick=False):
    cases = []

    def add(name, **spec):
        spec.setdefault("w", "bfloat16")
        spec.setdefault("ratio", 4)
        spec.setdefault("h", 64)
        spec.setdefault("precision", "bf16")
        spec.setdefault("offsets", False)
        spec.setdefault("lse", False)
        spec.setdefault("varlen", False)
        spec["seed"] = 9000 + zlib.crc32(name.encode()) % 100000
        cases.append((name, spec))

    add("bf16-h64-r4-b2-sq512-sk128", b=2, s_q=512, s_k=128)
    add("bf16-h64-r4-w32-lse-offs", b=2, s_q=300, s_k=77, w="float32", lse=True, offsets=True)
    add("bf16-h64-r1-b2-sq256-sk256", b=2, s_q=256, s_k=256, ratio=1)
    add("bf16-h32-r4", b=3, s_q=200, s_k=64, h=32)
    add("bf16-h16-r1", b=1, s_q=129, s_k=130, h=16, ratio=1)
    add("fp8-h64-masked", b=2, s_q=512, s_k=128, precision="fp8")
    add("fp8-h64-unchecked", b=2, s_q=512, s_k=127, precision="fp8")
    add("fp8-h64-checked-lse", b=2, s_q=511, s_k=128, precision="fp8", lse=True)
    add("fp8-h64-w32-prescaled", b=2, s_q=256, s_k=64, precision="fp8", w="float32")
    add("fp8-h32", b=2, s_q=256, s_k=64, precision="fp8", h=32)
    add("thd-bf16-h64-r4-lse-offs", varlen=True, lens_q=[300, 0, 129, 64], lens_k=[80, 10, 33, 16], lse=True, offsets=True)
    add("thd-fp8-h64-r4", varlen=True, lens_q=[256, 100, 1], lens_k=[64, 30, 1], precision="fp8")
    if not quick:
        add("bf16-h64-r4-b1-sq4096-sk1024", b=1, s_q=4096, s_k=1024)
    return cases


def label(spec):
    return (f"{spec['precision']} W {spec['w'][:4]} H{spec['h']} r{spec['ratio']} {'thd' if spec['varlen'] else 'bshd'}"
            + (" offs" if spec["offsets"] else "") + (" lse" if spec["lse"] else ""))


def _ref():
    path = os.path.join(ROOT, "tests", "gpu")
    if path not in sys.path:
        sys.path.insert(0, path)
    import ref_indexer_forward

    return ref_indexer_forward


def make_inputs(spec):
    """CPU inputs of a case: q, k, w, q_scale, k_scale, cu_seqlens_q/k, max_seqlen_q/k, q_causal_offsets."""
    import torch

    ref = _ref()
    gen = torch.Generator().manual_seed(int(spec["seed"]))
    fp8 = spec["precision"] == "fp8"
    wdt = getattr(torch, spec["w"])
    x = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None)
    if spec["varlen"]:
        lq, lk = spec["lens_q"], spec["lens_k"]
        x["cu_seqlens_q"] = torch.tensor([0] + [sum(lq[: i + 1]) for i in range(len(lq))], dtype=torch.int32)
        x["cu_seqlens_k"] = torch.tensor([0] + [sum(lk[: i + 1]) for i in range(len(lk))], dtype=torch.int32)
        x["max_seqlen_q"], x["max_seqlen_k"] = max(lq), max(lk)
        q, k, w, qs, ks = ref.random_inputs((sum(lq),), (sum(lk),), spec["h"], gen, fp8, wdt)
        batches = len(lq)
    else:
        q, k, w, qs, ks = ref.random_inputs((spec["b"], spec["s_q"]), (spec["b"], spec["s_k"]), spec["h"], gen, fp8, wdt)
        batches = spec["b"]
    if spec["offsets"]:
        x["q_causal_offsets"] = torch.randint(0, 64, (batches,), generator=gen, dtype=torch.int32)
    x.update(q=q, k=k, w=w, q_scale=qs, k_scale=ks)
    return x


def reference(spec, x):
    """(scores, lse) in fp64, on the GPU."""
    import torch

    ref = _ref()
    g = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in x.items()}
    pre = spec["precision"] == "fp8" and spec["w"] == "float32"
    if spec["varlen"]:
        s = ref.scores_thd(g["q"], g["k"], g["w"], x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], spec["ratio"],
                           _SCALE, x["q_causal_offsets"], g["q_scale"], g["k_scale"], pre)
    else:
        s = ref.scores_bshd(g["q"], g["k"], g["w"], spec["ratio"], _SCALE, x["q_causal_offsets"], g["q_scale"], g["k_scale"], pre)
    return s, ref.lse_of(s)


_SCALE = 0.0883883  # 1 / sqrt(128)


def _kwargs(spec, x):
    kw = dict(sm_scale=_SCALE, precision=spec["precision"], q_scale=x["q_scale"], k_scale=x["k_scale"], q_causal_offsets=x["q_causal_offsets"])
    if spec["varlen"]:
        kw.update(cu_seqlens_q=x["cu_seqlens_q"], cu_seqlens_k=x["cu_seqlens_k"], max_seqlen_q=x["max_seqlen_q"], max_seqlen_k=x["max_seqlen_k"])
    return kw


def _outputs(r, lse):
    return {"scores": r["scores"], **({"lse": r["lse"]} if lse else {})}


def _shapes(spec, x):
    if spec["varlen"]:
        return (x["q"].shape[0], x["max_seqlen_k"]), (x["q"].shape[0],)
    return (spec["b"], spec["s_q"], spec["s_k"]), (spec["b"], spec["s_q"])


def poisoned_alloc_call(fn, nbytes):
    """fn() with its allocations served from a private pool whose blocks were just NaN-filled."""
    import torch

    pool_cls, use = getattr(torch.cuda, "MemPool", None), getattr(torch.cuda, "use_mem_pool", None)
    if pool_cls is None or use is None:
        return fn(), None, "unpoisoned (torch has no MemPool)"
    pool = pool_cls()
    with use(pool):
        bufs = [torch.full((max(1, n // 4),), float("nan"), dtype=torch.float32, device="cuda") for n in nbytes]
        del bufs
        res = fn()
    return res, pool, "pool"


def run_case(name, spec, x, api, args, out_dir):
    import torch

    pristine = {k: v.clone() for k, v in x.items() if isinstance(v, torch.Tensor)}
    row = {"case": name, "label": label(spec), "spec": spec}
    saved, res = {}, {}
    api.begin_first(spec)
    row["first_s"] = first_call(lambda: res.update(api.call(spec, x)))
    row.update(api.end_first(spec))
    saved.update({f"first.{n}": _host(t) for n, t in res.items()})
    res.clear()
    ss, ls = _shapes(spec, x)
    sizes = [4 * math.prod(ss)] + ([4 * math.prod(ls)] if spec["lse"] else [])
    out, pool, row["alloc_poison"] = poisoned_alloc_call(lambda: api.call(spec, x), sizes)
    torch.cuda.synchronize()
    saved.update({f"alloc.{n}": _host(t) for n, t in out.items()})
    del out, pool
    outs = None
    if hasattr(api, "call_into"):
        outs = {"scores": torch.full(ss, float("nan"), device="cuda")}
        if spec["lse"]:
            outs["lse"] = torch.full(ls, float("nan"), device="cuda")
        api.call_into(spec, x, outs)
        torch.cuda.synchronize()
        saved.update({f"into.{n}": _host(t) for n, t in outs.items()})
    row["inputs_untouched"] = all(_same(x[k], v) for k, v in pristine.items())
    row["warm_us"] = warm_us(lambda: api.call(spec, x), args.calls, sync_every=SYNC_EVERY)
    if outs is not None:
        row["warm_into_us"] = warm_us(lambda: api.call_into(spec, x, outs), args.calls, sync_every=SYNC_EVERY)
    row["device_us"] = device_us(lambda: api.call(spec, x))
    torch.save(saved, os.path.join(out_dir, f"{name}.pt"))
    return row


def failed_row(name, spec, exc, side):
    import traceback

    traceback.print_exc()
    print(f"{side} {name}: FAILED: {exc!r}", flush=True)
    return {"case": name, "label": label(spec), "spec": spec, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}


# ------------------------------------------------------------------------------------------------
# JIT side (cudnn + cutlass)
# ------------------------------------------------------------------------------------------------


class JitApi:
    def __init__(self):
        self.api = importlib.import_module("cudnn.deepseek_sparse_attention.indexer_forward.api")
        self.h = importlib.import_module("cudnn.deepseek_sparse_attention.indexer_forward._interface_sm90")
        self._before = None

    @staticmethod
    def jit_key(spec):
        import torch

        fp8 = spec["precision"] == "fp8"
        h, vl = spec["h"], spec["varlen"]
        unchecked = fp8 and h == 64 and not vl and spec["s_q"] % 2 == 0
        masked = unchecked and spec["s_k"] % 64 == 0
        rank = 3 if vl else 4
        b = lambda n: (False,) * n  # noqa: E731 - broadcast dims of a contiguous tensor
        return (torch.float8_e4m3fn if fp8 else torch.bfloat16, getattr(torch, spec["w"]), 128, h, spec["ratio"], vl, unchecked, masked,
                spec["lse"], b(rank), b(rank), b(rank - 1), b(rank - 1) if fp8 else None, b(rank - 1) if fp8 else None, spec["offsets"])

    @staticmethod
    def index_key(kind, k):
        import torch

        qdt, wdt, _d, h, ratio, vl, unchecked, masked, lse = k[:9]
        return "fwd_sm90", {"precision": "fp8" if qdt == torch.float8_e4m3fn else "bf16", "w_dtype": str(wdt).replace("torch.", ""), "heads": h,
                            "ratio": ratio, "varlen": vl, "offsets": k[14], "lse": lse, "unchecked": unchecked, "masked": masked}

    def begin_first(self, spec):
        self._before = set(self.h._compile_cache)

    def end_first(self, spec):
        want = self.jit_key(spec)
        after = set(self.h._compile_cache)
        res = {"keys": [list(self.index_key("fwd", want))], "new": want not in self._before}
        unexpected = sorted(repr(k) for k in after - self._before if k != want)
        if want not in after or unexpected:
            res["key_error"] = f"predicted compile key in cudnn's cache: {want in after}; compiled besides: {unexpected}"
        return res

    def call(self, spec, x):
        r = self.api.indexer_forward_wrapper(x["q"], x["k"], x["w"], spec["ratio"], return_lse=spec["lse"], **_kwargs(spec, x))
        return _outputs(r, spec["lse"])

    def cubins(self):
        return jit_cubins((("fwd", self.h._compile_cache),), self.index_key)


def cmd_jit(args):
    jit_side(args, JitApi, build_cases, make_inputs, run_case, lambda r: f"warm {r['warm_us']:.1f} us, device {r['device_us']:.1f} us", failed_row)


# ------------------------------------------------------------------------------------------------
# AOT side (no cutlass, no cudnn)
# ------------------------------------------------------------------------------------------------


class AotApi(SpiedAot):
    OP_MODULE = "dsa_aot.ops.dsa_indexer_forward"

    def call(self, spec, x):
        r = self.dsa.indexer_forward(x["q"], x["k"], x["w"], spec["ratio"], return_lse=spec["lse"], **_kwargs(spec, x))
        return _outputs(r, spec["lse"])

    def call_into(self, spec, x, outs):
        self.dsa.indexer_forward_into(outs["scores"], outs.get("lse"), x["q"], x["k"], x["w"], spec["ratio"], **_kwargs(spec, x))


def cmd_aot(args):
    aot_side(args, SCRIPT, FAMILY, AotApi, run_case,
             lambda r: f"warm {r['warm_us']:.1f} us (into {r['warm_into_us']:.1f} us), device {r['device_us']:.1f} us", failed_row)


# ------------------------------------------------------------------------------------------------
# Compare
# ------------------------------------------------------------------------------------------------


def _ref_check(got, want, bound):
    """(ok, rel err) of an output against the fp64 reference: the -inf mask exact, no NaN, rel err < bound."""
    import torch

    from parity_common import torch_isnan

    g = got.to(want.device, torch.float64)
    mask_ok = torch.equal(torch.isinf(g) & (g < 0), torch.isinf(want)) and not bool(torch_isnan(g).any())
    fin = torch.isfinite(want)
    num = torch.linalg.vector_norm(g[fin] - want[fin]).item() if fin.any() else 0.0
    den = torch.linalg.vector_norm(want[fin]).item() if fin.any() else 0.0
    err = num / den if den else num
    return mask_ok and err < bound, err


def cmd_compare(args):
    import torch

    jit = load_json(os.path.join(args.dir, "jit.json"), SCRIPT, "jit", args.dir)
    aot = load_json(os.path.join(args.dir, "aot.json"), SCRIPT, "aot", args.dir)
    if jit is None or aot is None:
        return 1
    arch = jit["meta"].get("arch", "sm_90a")
    entries = family_entries(aot.get("index"), FAMILY, arch)
    failures, lines, report = [], [], []
    header = ("case", "kernel", "AOT = JIT (first / alloc / into)", "= reference (JIT / AOT; max rel err)", "kernels", "sha256", "JIT 1st s",
              "AOT 1st ms", "JIT warm us", "AOT warm us (into)", "device us JIT/AOT")  # fmt: skip
    for name, jr in jit["rows"].items():
        spec = jr["spec"]
        ar = aot["rows"].get(name)
        rep = {"case": name, "spec": spec, "jit": {k: jr.get(k) for k in ("first_s", "warm_us", "device_us", "new", "keys", "alloc_poison")}}
        report.append(rep)
        if ar is None or "error" in ar or "error" in jr:
            why = [f"{side} raised {r['error']}" for side, r in (("jit", jr), ("aot", ar or {})) if "error" in r]
            why += ["not run on the aot side"] if ar is None else []
            failures += [f"{name}: {w}" for w in why]
            lines.append((name, jr["label"], "; ".join(w.split(":")[0] for w in why), "", "", "", "", "", "", "", ""))
            continue
        rep["aot"] = {k: ar.get(k) for k in ("first_s", "warm_us", "warm_into_us", "device_us", "new", "keys", "alloc_poison")}
        jo = torch.load(os.path.join(args.dir, "jit", f"{name}.pt"))
        ao = torch.load(os.path.join(args.dir, "aot", f"{name}.pt"))
        s_ref, l_ref = reference(spec, torch.load(os.path.join(args.dir, "inputs", f"{name}.pt")))
        want = {"scores": s_ref, **({"lse": l_ref} if spec["lse"] else {})}
        ok_row, forms = True, []
        for form in ("first", "alloc", "into"):
            verdicts = []
            for out in want:
                n = f"{form}.{out}"
                jn = n if n in jo else f"alloc.{out}"
                if n not in ao or jn not in jo:
                    verdicts.append("missing")
                    ok_row = False
                    failures.append(f"{name}: {n} not saved on the {'aot' if n not in ao else 'jit'} side")
                    continue
                eq, cnt = bitwise(jo[jn], ao[n])
                rep[f"aot {n} = jit {jn}"] = {"bitwise": eq, "differing": cnt}
                verdicts.append("yes" if eq else f"NO({cnt})")
                if not eq:
                    ok_row = False
                    failures.append(f"{name}: AOT {n} not bitwise equal to JIT {jn} ({cnt} elements differ)")
            forms.append("/".join(verdicts))
        ref_text = []
        for side, saved in (("jit", jo), ("aot", ao)):
            bad, worst = [], 0.0
            for n in sorted(saved):
                ok, err = _ref_check(saved[n], want[n.split(".", 1)[1]], BOUND[spec["precision"]])
                worst = max(worst, err)
                rep[f"{side} {n} = reference"] = {"ok": ok, "rel_err": err}
                if not ok:
                    bad.append(n)
                    failures.append(f"{name}: {side.upper()} {n} off the reference (rel err {err:.3g}, or the -inf mask / NaN)")
            ref_text.append(("yes" if not bad else f"NO({','.join(bad)})") + f" {worst:.1e}")
            ok_row &= not bad
        for side, r in (("jit", jr), ("aot", ar)):
            if not r.get("inputs_untouched", False):
                ok_row = False
                failures.append(f"{name}: inputs modified on the {side} side")
        if jr.get("key_error"):
            ok_row = False
            failures.append(f"{name}: {jr['key_error']}")
        same_kernels = sorted(map(_key_str, jr["keys"])) == sorted(map(_key_str, ar["keys"]))
        if not same_kernels:
            ok_row = False
            failures.append(f"{name}: kernels differ: JIT compile keys {jr['keys']}, AOT looked up {ar['keys']}")
        sha = sha_status(jr["keys"], jit["cubins"], entries)
        if sha != "yes":
            ok_row = False
            failures.append(f"{name}: cubin sha256 {sha} for {jr['keys']}")
        rep.update(kernels_same=same_kernels, sha256=sha, ok=ok_row)
        lines.append((
            name, jr["label"], " / ".join(forms), " / ".join(ref_text), "same" if same_kernels else "NO", sha,
            f"{jr['first_s']:.3f}{'' if jr.get('new') else '*'}", f"{1e3 * ar['first_s']:.2f}{'' if ar.get('new') else '*'}",
            f"{jr['warm_us']:.1f}", f"{ar['warm_us']:.1f} ({ar['warm_into_us']:.1f})", f"{jr['device_us']:.1f} / {ar['device_us']:.1f}",
        ))  # fmt: skip
    for name in aot["rows"]:
        if name not in jit["rows"]:
            failures.append(f"{name}: run on the aot side only")
    cubins, cubin_fails = cubin_report(jit.get("cubins", []), entries)
    failures += cubin_fails
    print(md_table(header, lines))
    print("\n(* = the first call compiled (JIT) / loaded (AOT) nothing new: its key was already used by an earlier case)")
    jm, am = jit["meta"], aot["meta"]
    print(f"device: {jm.get('device')} ({jm.get('sm_count')} SMs), arch {arch}; torch {jm.get('torch')}; reference tests/gpu/ref_indexer_forward.py (fp64, GPU)")
    print_summary(jm, am, cubins, jit["rows"], aot["rows"], into_label="_into")
    write_report(args.dir, failures, arch, report, cubins, jm, am)
    return verdict(failures, f"{len(lines)} cases: every output bitwise equal JIT vs AOT and within the reference, same kernels, every cubin sha256 equal")


def main(argv=None):
    return cli(__doc__, cmd_jit, cmd_aot, cmd_compare, argv, extra=(("--quick", dict(action="store_true", help="jit: no prefill-sized case")),))


if __name__ == "__main__":
    sys.exit(main())
