#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA indexer backward op (SM90): ci/parity/harness.py runs it.

Both sides make the same public call, ``indexer_backward(index_q, weights, index_k, attn_score, index_score,
topk_indices, grad_loss, sm_scale=0.75, loss_coeff=2.0, block_I=128, topk_indices_global=G, d_index_q=..,
d_weights=.., d_index_k=.., workspace=..)``: cudnn's ``indexer_backward_wrapper`` (on SM90
``indexer_backward_sm90``: ScoreGradSm90, IndexerBackwardSm90) and ``dsa_aot.dsa.indexer_backward`` (and
``indexer_backward_into``); default backend, non-deterministic (the only mode upstream's SM90 has). sm_scale
and loss_coeff are not 1 so that a swapped or dropped scalar shows. Every call gets NaN outputs, a 0xFF
workspace (cudnn's size formula vs dsa_aot's ``indexer_backward_workspace_bytes``) and a fresh copy of
``attn_score``, which both overwrite with the score-grad signal (an output here).

Cases: B=1, H=64, D=128, S_k=4096, S_q in {4096, 8192} (``--quick``: 1024), topk in {512, 1024, 1536, 2048}
with local ids; global ids for every topk at the first S_q and topk 512 at the second; an fp32 ``d_index_k``
case (no workspace); a case with 5 % top-k padding (-1 ids). Inputs: tests/gpu/ref_indexer.make_inputs.

Rules: ``d_index_q`` and ``attn_score`` bitwise (single writer, no atomics); ``d_weights`` and ``d_index_k``
within the JIT's own jitter (upstream merges dW across warpgroups with shared-memory atomics, dK with fp32
reduce-adds: the JIT does not reproduce itself); no output holds a NaN on either side (an element unwritten).
"""

import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BITWISE, JITTER, Aot, Jit, Parity, load_ref, nan_like, poisoned, poisoned_workspace  # noqa: E402

B, H, D, S_K = 1, 64, 128, 4096
TOPKS = (512, 1024, 1536, 2048)
SM_SCALE, LOSS_COEFF, BLOCK_I = 0.75, 2.0, 128
K90 = "cudnn.deepseek_sparse_attention.indexer_backward.indexer_backward_sm90"


def cases(quick):
    out = []

    def add(s_q, topk, glob, dk="bf16", invalid_frac=0.0):
        tag = f"sq{s_q}-topk{topk}-{'global' if glob else 'local'}" + ("-pad" if invalid_frac else "")
        seed = 5000 + zlib.crc32(tag.encode()) % 100000  # stable across runs and --only filters
        out.append((tag + f"-dk{dk}", dict(b=B, s_q=s_q, s_k=S_K, h=H, d=D, topk=topk, glob=glob, dk=dk, invalid_frac=invalid_frac, seed=seed,
                                           inputs=tag)))

    for i, s_q in enumerate((1024,) if quick else (4096, 8192)):
        for topk in TOPKS:
            add(s_q, topk, False)
            if i == 0 and topk == 512:
                add(s_q, topk, False, dk="f32")  # fp32 d_index_k: no workspace, the output is the accumulator
            if i == 0 or topk == 512:
                add(s_q, topk, True)
        if i == 0:
            add(s_q, 512, False, invalid_frac=0.05)
    return out


def inputs(spec):
    return load_ref("ref_indexer.py").make_inputs(spec["b"], spec["s_q"], spec["s_k"], spec["h"], spec["d"], spec["topk"], device="cpu",
                                                  topk_indices_global=spec["glob"], seed=spec["seed"], invalid_frac=spec["invalid_frac"])


def outputs(spec):
    return {"d_index_q": BITWISE, "attn_score": BITWISE, "d_weights": JITTER, "d_index_k": JITTER}


def reference(spec, x, outs):
    import torch

    return [f"{n}: {int(torch.isnan(t).sum())} NaN" for n, t in outs.items() if torch.isnan(t).any()]


def _dk_dtype(spec):
    import torch

    return torch.float32 if spec["dk"] == "f32" else torch.bfloat16


def buffers(side, api, spec, x):
    if side == "jit":  # cudnn's IndexerBackward.scratch_workspace_bytes (default backend): a fp32 dK accumulator for a bf16 dK
        from cudnn.api_base import ws_align

        ws = 0 if spec["dk"] == "f32" else ws_align(spec["b"] * spec["s_k"] * spec["d"] * 4)
    else:
        ws = api.indexer_backward_workspace_bytes(spec["b"], spec["s_k"], spec["d"], d_index_k_dtype=_dk_dtype(spec))
    b = dict(d_index_q=nan_like(x["index_q"]), d_weights=nan_like(x["weights"]), attn_score=x["attn_score"].clone(),
             d_index_k=poisoned((spec["b"], spec["s_k"], spec["d"]), _dk_dtype(spec)))
    return dict(b, workspace=poisoned_workspace(ws)) if ws else b


def _call(fn, spec, x, b):
    fn(index_q=x["index_q"], weights=x["weights"], index_k=x["index_k"], attn_score=b["attn_score"], index_score=x["index_score"],
       topk_indices=x["topk_indices"], grad_loss=x["grad_loss"], sm_scale=SM_SCALE, loss_coeff=LOSS_COEFF, block_I=BLOCK_I,
       topk_indices_global=spec["glob"], d_index_q=b["d_index_q"], d_weights=b["d_weights"], d_index_k=b["d_index_k"], workspace=b.get("workspace"))
    return b


def _into(dsa, spec, x, b):
    dsa.indexer_backward_into(b["d_index_q"], b["d_weights"], b["d_index_k"], x["index_q"], x["weights"], x["index_k"], b["attn_score"],
                              x["index_score"], x["topk_indices"], x["grad_loss"], SM_SCALE, LOSS_COEFF, BLOCK_I, spec["glob"],
                              workspace=b.get("workspace"))
    return b


def _setup():
    from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_wrapper

    return indexer_backward_wrapper


def _index_key(kind, k):
    """cudnn's cache key -> (op, key dict) as in the shipped index; fields the shipped keys fix (D 128, block_I 128,
    probability-domain scores) are added only when they differ, so that such a kernel matches no entry."""
    if kind == "gemm":
        heads, dim, topk, block_i, is_log, glob = k
        key = {"heads": heads, "topk": topk, "topk_global": bool(glob)}
        fixed = (("dim", dim, D), ("block_I", block_i, BLOCK_I), ("score_input_is_log", bool(is_log), False))
        key.update({f: v for f, v, want in fixed if v != want})
        return "gemm_sm90", key
    topk, is_log = k
    return "score_grad_sm90", dict(topk=topk, **({"index_is_log": True} if is_log else {}))


PARITY = Parity(
    family="dsa_indexer_backward", doc=__doc__, cases=cases, inputs=inputs, outputs=outputs, reference=reference, buffers=buffers,
    label=lambda s: f"topk {s['topk']} {'global' if s['glob'] else 'local'} dK {s['dk']}", covers=("sm_90a",),
    inputs_of=lambda name, spec: spec["inputs"], sync_every=8,  # the kernels run longer on the device than on the host
    jit=Jit(setup=_setup, caches={"gemm": (K90, "_compile_cache"), "score_grad": (K90, "_score_grad_cute_cache")}, index_key=_index_key,
            call=_call),
    aot=Aot(call=lambda dsa, spec, x, b: _call(dsa.indexer_backward, spec, x, b), into=_into),
    quick="S_q 1024 only",
)

if __name__ == "__main__":
    sys.exit(PARITY.main())
