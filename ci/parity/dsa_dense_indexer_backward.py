#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA dense indexer backward (dense_indexer_backward_wrapper), in two processes on one GPU machine.

    python ci/parity/dsa_dense_indexer_backward.py jit --dir D      # cudnn + cutlass importable: JIT path, writes D/jit.json
    python ci/parity/dsa_dense_indexer_backward.py aot --dir D      # cutlass NOT importable: dsa_aot.dsa, writes D/aot.json
    python ci/parity/dsa_dense_indexer_backward.py compare --dir D  # markdown table + D/parity.json; exit status 1 on any mismatch

Both sides make the same public call with the same arguments::

    dense_indexer_backward(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss,
                           sm_scale=0.75, loss_coeff=2.0, ratio=R, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=,
                           max_seqlen_k=, q_causal_offsets=, d_index_q=, d_weights=, d_index_k=, workspace=)

JIT: ``cudnn.deepseek_sparse_attention.indexer_backward.dense_indexer_backward_wrapper`` (on the H200
the SM90 path: zero fp32 dK, ScoreGradDenseSm90, IndexerBackwardSm90(is_dense=True), bf16 cast);
AOT: ``dsa_aot.dsa.dense_indexer_backward`` and ``dense_indexer_backward_into``. Cases: ratio 1 and 4,
BSHD and THD (one empty segment), q causal offsets, bf16 and fp32 ``d_index_k``, a prefill-sized case.

Every call gets NaN-poisoned outputs, a 0xFF-poisoned workspace and a fresh copy of ``index_score``
(both ops overwrite it with the score-grad signal). ``compare``: the signal left in ``index_score``
bitwise equal; ``d_index_q``, ``d_weights``, ``d_index_k`` against the JIT's own run-to-run jitter
(bitwise where the JIT reproduces itself; dK is a sum of fp32 reduce-adds); no NaN; ``attn_score``
and the other inputs untouched; the same kernels (the AOT lookups equal upstream's compile keys); the
JIT's cubins of those keys have the sha256 of the shipped entries.
"""

from __future__ import annotations

import importlib
import os
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from parity_common import (  # noqa: E402
    CompileKeys,
    SpiedAot,
    aot_side,
    bitwise,
    call_checks,
    cli,
    device_us,
    finish,
    first_call,
    into_verdict,
    jit_cubins,
    jit_side,
    jitter_verdict,
    load_ref,
    load_sides,
    nan_like,
    poisoned_workspace,
    timing_cells,
    torch_isnan,
    unrun,
    warm_us,
)
from parity_common import host_copy as _host  # noqa: E402
from parity_common import same as _same  # noqa: E402

FAMILY = "dsa_dense_indexer_backward"
SCRIPT = "ci/parity/dsa_dense_indexer_backward.py"
H, D, BLOCK_I = 64, 128, 128
SM_SCALE, LOSS_COEFF = 0.75, 2.0
SYNC_EVERY = 8
RACE = 300  # calls per side of the race case
JITTERY = ("d_index_q", "d_weights", "d_index_k")  # reduce-adds (dK) upstream; held to the JIT's own jitter, bitwise where it has none


def build_cases(quick=False):
    cases = []

    def add(name, **spec):
        spec.setdefault("ratio", 1)
        spec.setdefault("offsets", False)
        spec.setdefault("varlen", False)
        spec.setdefault("dk", "bf16")
        spec["seed"] = 7000 + zlib.crc32(name.encode()) % 100000
        cases.append((name, spec))

    # key counts per batch are multiples of 128 (every K block full): see RACE below for the tail blocks
    add("bshd-r1-b2-sq512", b=2, s_q=512, s_k=512)
    add("bshd-r4-b2-sq1024-offs", b=2, s_q=1024, s_k=256, ratio=4, offsets=True)
    add("bshd-r4-b1-sq512-dkf32", b=1, s_q=512, s_k=128, ratio=4, dk="f32")
    add("thd-r1-offs", varlen=True, lens_q=[300, 0, 129], lens_k=[384, 128, 256], offsets=True)
    add("thd-r4", varlen=True, lens_q=[512, 100, 1], lens_k=[128, 128, 128], ratio=4)
    add("thd-r4-dkf32", varlen=True, lens_q=[256, 64], lens_k=[128, 128], ratio=4, dk="f32")
    if not quick:
        add("bshd-r4-b1-sq4096-prefill", b=1, s_q=4096, s_k=1024, ratio=4)
    # upstream's SM90 tail-K-block race (docs/research/dense-indexer-backward.md): every row reads only a
    # K block that ends past the batch's keys; RACE calls per side, each against the fp64 reference
    add("race-bshd-r1-b16-sk60", b=16, s_q=256, s_k=60, dk="f32", race=RACE)
    return cases


def label(spec):
    return f"r{spec['ratio']} {'thd' if spec['varlen'] else 'bshd'}{' offs' if spec['offsets'] else ''} dK {spec['dk']}"


def make_inputs(spec):
    """CPU inputs of a case: consistent scores (the indexer logits of q, k, w over the ratio-causal
    columns, their LSE; a positive target with its row sum), random values beyond the causal limit."""
    import torch

    gen = torch.Generator().manual_seed(int(spec["seed"]))
    x = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None)
    if spec["varlen"]:
        lq, lk = spec["lens_q"], spec["lens_k"]
        segs = list(zip(lq, lk))
        x["cu_seqlens_q"] = torch.tensor([0] + [sum(lq[: i + 1]) for i in range(len(lq))], dtype=torch.int32)
        x["cu_seqlens_k"] = torch.tensor([0] + [sum(lk[: i + 1]) for i in range(len(lk))], dtype=torch.int32)
        x["max_seqlen_q"], x["max_seqlen_k"] = max(lq), max(lk)
        tq, tk, cols = sum(lq), sum(lk), max(lk)
    else:
        segs = [(spec["s_q"], spec["s_k"])] * spec["b"]
        tq, tk, cols = spec["b"] * spec["s_q"], spec["b"] * spec["s_k"], spec["s_k"]
    offs = torch.randint(0, 64, (len(segs),), generator=gen, dtype=torch.int32) if spec["offsets"] else torch.zeros(len(segs), dtype=torch.int32)
    q = (torch.randn(tq, H, D, generator=gen) * D**-0.25).bfloat16()
    k = (torch.randn(tk, D, generator=gen) * D**-0.25).bfloat16()
    w = (torch.randn(tq, H, generator=gen) / H**0.5).bfloat16()
    score = torch.randn(tq, cols, generator=gen)  # beyond each row's limit: random, never read
    attn = torch.rand(tq, cols, generator=gen)
    lse, l1 = torch.zeros(tq), torch.ones(tq)
    q0 = k0 = 0
    for b, (sq, sk) in enumerate(segs):
        if sq and sk:
            logits = torch.einsum("ihd,jd->ihj", q[q0 : q0 + sq].float(), k[k0 : k0 + sk].float()).mul(SM_SCALE).relu()
            logits = torch.einsum("ihj,ih->ij", logits, w[q0 : q0 + sq].float())
            lim = ((int(offs[b]) + torch.arange(sq) + 1) // spec["ratio"]).clamp(0, sk)
            valid = torch.arange(sk)[None, :] < lim[:, None]
            score[q0 : q0 + sq, :sk] = torch.where(valid, logits, score[q0 : q0 + sq, :sk])
            lse[q0 : q0 + sq] = torch.logsumexp(logits.masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0, neginf=0.0)
            l1[q0 : q0 + sq] = (attn[q0 : q0 + sq, :sk] * valid).sum(-1)
        q0, k0 = q0 + sq, k0 + sk
    if spec["offsets"]:
        x["q_causal_offsets"] = offs
    if not spec["varlen"]:
        b, s_q, s_k = spec["b"], spec["s_q"], spec["s_k"]
        q, w, k = q.view(b, s_q, H, D), w.view(b, s_q, H), k.view(b, s_k, D)
        score, attn, lse, l1 = score.view(b, s_q, s_k), attn.view(b, s_q, s_k), lse.view(b, s_q), l1.view(b, s_q)
    x.update(index_q=q, weights=w, index_k=k, attn_score=attn.contiguous(), attn_l1norm=l1, index_score=score.contiguous(), index_lse=lse,
             grad_loss=0.5 + torch.rand(1, generator=gen))
    return x


def _kwargs(spec, x):
    kw = dict(sm_scale=SM_SCALE, loss_coeff=LOSS_COEFF, ratio=spec["ratio"], q_causal_offsets=x["q_causal_offsets"])
    if spec["varlen"]:
        kw.update(cu_seqlens_q=x["cu_seqlens_q"], cu_seqlens_k=x["cu_seqlens_k"], max_seqlen_q=x["max_seqlen_q"], max_seqlen_k=x["max_seqlen_k"])
    return kw


def _workspace_bytes(x, dk_dtype):
    import torch

    return 0 if dk_dtype == torch.float32 else -(-x["index_k"].numel() * 4 // 128) * 128  # cudnn's ws_align of the fp32 dK


def run_case(name, spec, x, api, args, out_dir):
    """First call, reruns (the JIT's jitter), the _into form, warm timing; saves outputs, returns the row."""
    import torch

    dk_dtype = torch.float32 if spec["dk"] == "f32" else torch.bfloat16
    score0 = x["index_score"]
    pristine = {k: v.clone() for k, v in x.items() if isinstance(v, torch.Tensor) and k != "index_score"}
    ws_bytes = _workspace_bytes(x, dk_dtype)

    def fresh():
        outs = dict(d_index_q=nan_like(x["index_q"]), d_weights=nan_like(x["weights"]),
                    d_index_k=torch.full(x["index_k"].shape, float("nan"), dtype=dk_dtype, device="cuda"))
        return outs, (poisoned_workspace(ws_bytes) if ws_bytes else None), score0.clone()

    row = {"case": name, "label": label(spec), "spec": spec, "ws_bytes": ws_bytes}
    saved = {}
    outs, ws, score = fresh()
    api.begin_first(spec)
    row["first_s"] = first_call(lambda: api.call(spec, x, score, outs, ws))
    row.update(api.end_first(spec))
    if spec.get("race"):
        row["race_off"] = _race(spec, x, api, fresh)
        row["inputs_untouched"] = all(_same(x[k], v) for k, v in pristine.items())
        return row
    saved.update({n: _host(outs[n]) for n in JITTERY}, index_score=_host(score))
    for r in range(api.reruns(args)):
        o2, w2, s2 = fresh()
        api.call(spec, x, s2, o2, w2)
        torch.cuda.synchronize()
        saved.update({f"{n}.run{r + 2}": _host(o2[n]) for n in JITTERY})
        saved[f"index_score.run{r + 2}"] = _host(s2)
        del o2, w2, s2
    row["reruns"] = api.reruns(args)
    if hasattr(api, "call_into"):
        o3, w3, s3 = fresh()
        api.call_into(spec, x, s3, o3, w3)
        torch.cuda.synchronize()
        saved.update({f"into.{n}": _host(o3[n]) for n in JITTERY}, **{"into.index_score": _host(s3)})
    row["inputs_untouched"] = all(_same(x[k], v) for k, v in pristine.items())
    row["warm_us"] = warm_us(lambda: api.call(spec, x, score, outs, ws), args.calls, sync_every=SYNC_EVERY)
    if hasattr(api, "call_into"):
        row["warm_into_us"] = warm_us(lambda: api.call_into(spec, x, score, outs, ws), args.calls, sync_every=SYNC_EVERY)
    row["device_us"] = device_us(lambda: api.call(spec, x, score, outs, ws))
    torch.save(saved, os.path.join(out_dir, f"{name}.pt"))
    return row


def _race(spec, x, api, fresh):
    """How many of ``spec['race']`` calls leave a row of dW more than 1% of max |dW| off the fp64
    reference (or NaN): the signature of upstream's tail-K-block race."""
    import torch

    ref = load_ref("ref_dense_indexer_backward.py")
    want = ref.reference(x, SM_SCALE, LOSS_COEFF, spec["ratio"])["d_weights"]
    w = want.reshape(-1, want.shape[-1])
    off = 0
    for _ in range(spec["race"]):
        outs, ws, score = fresh()
        api.call(spec, x, score, outs, ws)
        g = outs["d_weights"].double().reshape(w.shape)
        off += bool((((g - w).abs().amax(-1) > 1e-2 * w.abs().max()) | torch.isnan(g).any(-1)).any())
    return off


def failed_row(name, spec, exc, side):
    import traceback

    traceback.print_exc()
    print(f"{side} {name}: FAILED: {exc!r}", flush=True)
    return {"case": name, "label": label(spec), "spec": spec, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}


def _args(x, score):
    return (x["index_q"], x["weights"], x["index_k"], x["attn_score"], x["attn_l1norm"], score, x["index_lse"], x["grad_loss"])


# ------------------------------------------------------------------------------------------------
# JIT side (cudnn + cutlass)
# ------------------------------------------------------------------------------------------------


class JitApi(CompileKeys):
    def __init__(self):
        self.api = importlib.import_module("cudnn.deepseek_sparse_attention.indexer_backward.api")
        self.k90 = importlib.import_module("cudnn.deepseek_sparse_attention.indexer_backward.dense_indexer_backward_sm90")
        self._before = None

    def reruns(self, args):
        return args.reruns

    def _snapshot(self):
        return {("gemm", k) for k in self.k90._dense_compile_cache} | {("score_grad", k) for k in self.k90._dense_score_grad_compile_cache}

    @staticmethod
    def jit_keys(spec):
        vl, r, o = spec["varlen"], spec["ratio"], spec["offsets"]
        return [("score_grad", (vl, r, BLOCK_I, o)), ("gemm", (vl, H, D, BLOCK_I, r, o))]

    @staticmethod
    def index_key(kind, k):
        """cudnn's SM90 cache key -> (op, key) as in the index; a field the shipped keys fix is added only when it differs."""
        if kind == "score_grad":
            vl, r, block_i, o = k
            key = {"varlen": vl, "ratio": r, "offsets": o}
            return "score_grad_sm90", key if block_i == BLOCK_I else {**key, "block_I": block_i}
        vl, h, d, block_i, r, o = k
        key = {"heads": h, "varlen": vl, "ratio": r, "offsets": o}
        key.update({n: v for n, v, want in (("dim", d, D), ("block_I", block_i, BLOCK_I)) if v != want})
        return "gemm_sm90", key

    def call(self, spec, x, score, outs, ws):
        self.api.dense_indexer_backward_wrapper(*_args(x, score), **_kwargs(spec, x), **outs, workspace=ws)

    def cubins(self):
        return jit_cubins((("gemm", self.k90._dense_compile_cache), ("score_grad", self.k90._dense_score_grad_compile_cache)), self.index_key)


def _describe(r):
    if "race_off" in r:
        return f"race: {r['race_off']}/{r['spec']['race']} calls with a dW row off the reference"
    return f"warm {r['warm_us']:.1f} us" + (f" (into {r['warm_into_us']:.1f} us)" if "warm_into_us" in r else "") + f", device {r['device_us']:.1f} us"


def cmd_jit(args):
    jit_side(args, JitApi, build_cases, make_inputs, run_case, _describe, failed_row)


# ------------------------------------------------------------------------------------------------
# AOT side (no cutlass, no cudnn)
# ------------------------------------------------------------------------------------------------


class AotApi(SpiedAot):
    OP_MODULE = "dsa_aot.ops.dsa_dense_indexer_backward"

    def reruns(self, args):
        return 1  # the AOT jitter is reported, not used

    def call(self, spec, x, score, outs, ws):
        self.dsa.dense_indexer_backward(*_args(x, score), **_kwargs(spec, x), **outs, workspace=ws)

    def call_into(self, spec, x, score, outs, ws):
        self.dsa.dense_indexer_backward_into(outs["d_index_q"], outs["d_weights"], outs["d_index_k"], *_args(x, score), **_kwargs(spec, x),
                                             workspace=ws)


def cmd_aot(args):
    aot_side(args, SCRIPT, FAMILY, AotApi, run_case, _describe, failed_row)


# ------------------------------------------------------------------------------------------------
# Compare
# ------------------------------------------------------------------------------------------------


def cmd_compare(args):
    import torch

    sides = load_sides(args, SCRIPT, FAMILY)
    if sides is None:
        return 1
    jit, aot, _, entries = sides
    failures, lines, report, races = [], [], [], []
    header = ("case", "kernels' key", "signal bitwise (call / into)", "dQ / dW / dK vs JIT (JIT jitter)", "into = call", "kernels", "sha256",
              "JIT 1st s", "AOT 1st ms", "JIT warm us", "AOT warm us (into)", "device us JIT/AOT")
    for name, jr in jit["rows"].items():
        spec = jr["spec"]
        ar = aot["rows"].get(name)
        rep = {"case": name, "spec": spec, "jit": {k: jr.get(k) for k in ("first_s", "warm_us", "device_us", "new", "keys")}}
        report.append(rep)
        why = unrun(name, jr, ar, failures)
        if why:
            lines.append((name, jr["label"], "; ".join(w.split(":")[0] for w in why)) + ("",) * 9)
            continue
        rep["aot"] = {k: ar.get(k) for k in ("first_s", "warm_us", "warm_into_us", "device_us", "new", "keys", "loaded")}
        ok_row, same_kernels, sha = call_checks(name, jr, ar, jit, entries, failures, "an input other than index_score")
        rep.update(kernels_same=same_kernels, sha256=sha)
        if spec.get("race"):  # a measurement of upstream's race on both sides: reported; the kernels, cubins and inputs checked
            races.append(f"upstream race, measured: {name}: calls with a dW row off the reference: JIT {jr['race_off']}/{spec['race']}, "
                         f"AOT {ar['race_off']}/{spec['race']} (the same cubins: {sha})")
            rep.update(race_off={"jit": jr["race_off"], "aot": ar["race_off"], "calls": spec["race"]}, ok=ok_row)
            continue
        jo = torch.load(os.path.join(args.dir, "jit", f"{name}.pt"))
        ao = torch.load(os.path.join(args.dir, "aot", f"{name}.pt"))
        sig = []
        for n in ("index_score", "into.index_score"):
            eq, cnt = bitwise(jo["index_score"], ao[n])
            sig.append("yes" if eq else f"NO({cnt})")
            rep[f"aot {n} = jit index_score"] = {"bitwise": eq, "differing": cnt}
            if not eq:
                ok_row = False
                failures.append(f"{name}: AOT {n} (the score-grad signal) not bitwise equal to the JIT's ({cnt} elements differ)")
        texts = []
        for n in JITTERY:
            ok_n, text_n, nums_n = jitter_verdict(jo, ao, n)
            rep[n] = dict(nums_n, ok=ok_n)
            texts.append(text_n)
            if not ok_n:
                ok_row = False
                failures.append(f"{name}: {n} {text_n}; limit {nums_n.get('limit', float('nan')):.3g}{nums_n['unit']}")
        into_ok = all(not int(torch_isnan(ao[f"into.{n}"])) and into_verdict(jo, ao, n)[0] for n in JITTERY)
        if not into_ok:
            ok_row = False
            failures.append(f"{name}: the _into form's outputs are off the JIT's (or hold NaN)")
        rep.update(into_ok=into_ok, ok=ok_row)
        lines.append((name, jr["label"], " / ".join(sig), " / ".join(texts), "yes" if into_ok else "NO", "same" if same_kernels else "NO", sha,
                      *timing_cells(jr, ar)))
    return finish(args, sides, failures, header, lines, report,
                  f"{len(lines)} cases: the score-grad signal bitwise equal, dQ / dW / dK within the JIT's own jitter, same kernels, every cubin "
                  f"sha256 equal", races + [f"sm_scale {SM_SCALE}, loss_coeff {LOSS_COEFF}"])


def main(argv=None):
    return cli(__doc__, cmd_jit, cmd_aot, cmd_compare, argv, extra=(
        ("--reruns", dict(type=int, default=2, help="jit: extra runs per case to measure the dK jitter")),
        ("--quick", dict(action="store_true", help="jit: no prefill-sized case")),
    ))


if __name__ == "__main__":
    sys.exit(main())
