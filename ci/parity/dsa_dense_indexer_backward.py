#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA dense indexer backward (dense_indexer_backward_wrapper): ci/parity/harness.py runs it.

Both sides make the same public call: cudnn's ``indexer_backward.api.dense_indexer_backward_wrapper`` and
``dsa_aot.dsa.dense_indexer_backward`` (and ``dense_indexer_backward_into``), sm_scale 0.75, loss_coeff 2.0,
with NaN-poisoned outputs, a 0xFF workspace sized by each side's own API (cudnn's ``DenseIndexerBackward``,
``dense_indexer_backward_workspace_bytes``; none for an fp32 dK) and a fresh copy of ``index_score``, which
both overwrite with the score-grad signal. Cases: ratio 1 and 4, BSHD and THD (one empty segment), q causal
offsets, bf16 and fp32 ``d_index_k``, a prefill-sized one (not in --quick); every batch's key count a multiple
of 128 (every K block full: see ``race``).

Rules: the signal left in ``index_score`` bitwise; ``d_index_q``, ``d_weights``, ``d_index_k`` within the
JIT's own run-to-run jitter (bitwise where the JIT reproduces itself; dK is a sum of fp32 reduce-adds).

    python ci/parity/dsa_dense_indexer_backward.py race [jit|aot] [--calls N]

counts upstream's SM90 tail-K-block race (docs/research/dense-indexer-backward.md) on each side, a rate the
harness's few reruns cannot measure: of N calls (300) on B 16, S_q 256, S_k 60 (every row reads only a K
block that ends past the keys), those leaving a dW row more than 1% of max |dW| off the fp64 reference
(tests/gpu/ref_dense_indexer_backward.py) or NaN. Without a side it runs both, each in its own process.
"""

import importlib
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BITWISE, JITTER, Aot, Jit, Parity, install_blocker, load_ref, nan_like, poisoned_workspace, to_cuda  # noqa: E402

H, D, BLOCK_I = 64, 128, 128
SM_SCALE, LOSS_COEFF = 0.75, 2.0
OUTS = ("d_index_q", "d_weights", "d_index_k")
BASE = "cudnn.deepseek_sparse_attention.indexer_backward"
RACE = "race-bshd-r1-b16-sk60"  # the race's shape: its name seeds its inputs, as when it was a case


def _spec(name, **spec):
    return {"ratio": 1, "offsets": False, "varlen": False, "dk": "bf16", **spec, "seed": 7000 + zlib.crc32(name.encode()) % 100000}


def cases(quick):
    out = [
        ("bshd-r1-b2-sq512", dict(b=2, s_q=512, s_k=512)),
        ("bshd-r4-b2-sq1024-offs", dict(b=2, s_q=1024, s_k=256, ratio=4, offsets=True)),
        ("bshd-r4-b1-sq512-dkf32", dict(b=1, s_q=512, s_k=128, ratio=4, dk="f32")),
        ("thd-r1-offs", dict(varlen=True, lens_q=[300, 0, 129], lens_k=[384, 128, 256], offsets=True)),
        ("thd-r4", dict(varlen=True, lens_q=[512, 100, 1], lens_k=[128, 128, 128], ratio=4)),
        ("thd-r4-dkf32", dict(varlen=True, lens_q=[256, 64], lens_k=[128, 128], ratio=4, dk="f32")),
    ]
    out += [] if quick else [("bshd-r4-b1-sq4096-prefill", dict(b=1, s_q=4096, s_k=1024, ratio=4))]
    return [(name, _spec(name, **s)) for name, s in out]


def inputs(spec):
    """Consistent scores (the indexer logits of q, k, w over the ratio-causal columns, their LSE; a positive
    target with its row sum), random values beyond the causal limit."""
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


def _args(x, b):
    return (x["index_q"], x["weights"], x["index_k"], x["attn_score"], x["attn_l1norm"], b["index_score"], x["index_lse"], x["grad_loss"])


def _kwargs(spec, x):
    kw = dict(sm_scale=SM_SCALE, loss_coeff=LOSS_COEFF, ratio=spec["ratio"], q_causal_offsets=x["q_causal_offsets"])
    if spec["varlen"]:
        kw.update(cu_seqlens_q=x["cu_seqlens_q"], cu_seqlens_k=x["cu_seqlens_k"], max_seqlen_q=x["max_seqlen_q"], max_seqlen_k=x["max_seqlen_k"])
    return kw


def buffers(side, api, spec, x):
    import torch

    b = dict(d_index_q=nan_like(x["index_q"]), d_weights=nan_like(x["weights"]),
             d_index_k=nan_like(x["index_k"], torch.float32 if spec["dk"] == "f32" else None), index_score=x["index_score"].clone())
    if side == "aot":
        n = api.dense_indexer_backward_workspace_bytes(x["index_k"].shape, b["d_index_k"].dtype)
    else:  # cudnn's plan object sizes it (building one compiles nothing)
        thd = dict(is_thd=True, batch=len(spec["lens_q"]), max_seqlen_q=x["max_seqlen_q"], max_seqlen_k=x["max_seqlen_k"]) if spec["varlen"] else {}
        n = api.DenseIndexerBackward(*_args(x, b)[:3], *(b[o] for o in OUTS), *_args(x, b)[3:7], **thd).scratch_workspace_bytes()
    b["workspace"] = poisoned_workspace(n) if n else None  # an fp32 dK needs none
    return b


def _call(fn, spec, x, b):
    fn(*_args(x, b), **_kwargs(spec, x), **{o: b[o] for o in OUTS}, workspace=b["workspace"])
    return b


def _into(dsa, spec, x, b):
    dsa.dense_indexer_backward_into(*(b[o] for o in OUTS), *_args(x, b), **_kwargs(spec, x), workspace=b["workspace"])
    return b


def _setup():
    return importlib.import_module(BASE + ".api")


def _index_key(kind, k):
    """cudnn's cache key -> (op, key) as in the index (the kinds are the index's ops); a field the shipped keys fix
    is added only when it differs. SM100's score-grad key also holds heads and dim, which its cubin does not depend on."""
    if kind.startswith("score_grad"):
        vl, r, block_i, o = k if kind == "score_grad_sm90" else (k[0], k[4], k[3], k[5])
        key = {"varlen": vl, "ratio": r, "offsets": o}
        return kind, key if block_i == BLOCK_I else {**key, "block_I": block_i}
    vl, h, d, block_i, r, o = k
    key = {"heads": h, "varlen": vl, "ratio": r, "offsets": o}
    key.update({n: v for n, v, want in (("dim", d, D), ("block_I", block_i, BLOCK_I)) if v != want})
    return kind, key


PARITY = Parity(
    family="dsa_dense_indexer_backward", doc=__doc__, cases=cases, inputs=inputs, buffers=buffers,
    outputs=lambda spec: {"index_score": BITWISE, **{o: JITTER for o in OUTS}},
    label=lambda s: f"r{s['ratio']} {'thd' if s['varlen'] else 'bshd'}{' offs' if s['offsets'] else ''} dK {s['dk']}",
    jit=Jit(setup=_setup, index_key=_index_key, call=lambda api, spec, x, b: _call(api.dense_indexer_backward_wrapper, spec, x, b),
            caches={"score_grad_sm90": (BASE + ".dense_indexer_backward_sm90", "_dense_score_grad_compile_cache"),
                    "gemm_sm90": (BASE + ".dense_indexer_backward_sm90", "_dense_compile_cache"),
                    "score_grad": (BASE + ".dense_indexer_backward_sm100", "_score_grad_compile_cache"),
                    "gemm": (BASE + ".dense_indexer_backward_sm100", "_gemm_compile_cache")}),
    aot=Aot(call=lambda dsa, spec, x, b: _call(dsa.dense_indexer_backward, spec, x, b), into=_into),
    sync_every=8, quick="no prefill-sized case",
)


def race(argv):
    import argparse
    import subprocess

    p = argparse.ArgumentParser(prog="dsa_dense_indexer_backward.py race", description="counts upstream's SM90 tail-K-block race (module docstring)")
    p.add_argument("side", nargs="?", choices=("jit", "aot"), help="one side (default: both, each in its own process)")
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args(argv)
    if a.side is None:
        return max(subprocess.call([sys.executable, os.path.abspath(__file__), "race", s, f"--calls={a.calls}"]) for s in ("jit", "aot"))
    if a.side == "aot":
        install_blocker()
    import torch

    api = _setup() if a.side == "jit" else importlib.import_module(PARITY.aot.module)
    call = PARITY.jit.call if a.side == "jit" else PARITY.aot.call
    spec = _spec(RACE, b=16, s_q=256, s_k=60, dk="f32")
    x = to_cuda(inputs(spec))
    want = load_ref("ref_dense_indexer_backward.py").reference(x, SM_SCALE, LOSS_COEFF, spec["ratio"])["d_weights"].reshape(-1, H)
    off = 0
    for _ in range(a.calls):
        g = call(api, spec, x, buffers(a.side, api, spec, x))["d_weights"].double().reshape(want.shape)
        off += bool((((g - want).abs().amax(-1) > 1e-2 * want.abs().max()) | torch.isnan(g).any(-1)).any())
    print(f"{a.side}: {off}/{a.calls} calls with a dW row more than 1% of max |dW| off the fp64 reference ({RACE})")
    return 0


if __name__ == "__main__":
    sys.exit(race(sys.argv[2:]) if sys.argv[1:2] == ["race"] else PARITY.main())
