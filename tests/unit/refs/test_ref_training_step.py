"""The fp64 training-step reference (tests/gpu/ref_training_step.py, autograd over the step's loss)
against the per-op references written from hand-derived formulas (CPU, small): the attention's dq /
dkv (ref_sparse_attention.sparse_attention_backward_ref), the indexer's d_qi / d_w / d_ki
(ref_indexer.indexer_backward_ref, the KL gradient upstream's backward computes), the target and
predict distributions (ref_score_recompute) and the forward's out / lse. Two derivations that share
no code must agree to fp64 rounding; a step reference with the KL term's sign or coefficient wrong,
or the attention's scale, would not."""

from __future__ import annotations

import math

import pytest
import torch

import ref_indexer
import ref_score_recompute
import ref_sparse_attention
import ref_training_step as ref

S, H, D, HI, DI, K = 40, 4, 512, 4, 16, 16


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    ids = torch.full((S, K), -1, dtype=torch.int32)
    for s in range(S):  # a causal choice: up to K distinct keys <= s, in random order, -1 after
        n = min(K, s + 1)
        ids[s, :n] = torch.randperm(s + 1, generator=g)[:n].to(torch.int32)
    x = dict(q=randn(S, H, D), kv=randn(S, D), qi=randn(S, HI, DI, scale=DI**-0.25), ki=randn(S, DI, scale=DI**-0.25), w=randn(S, HI, scale=HI**-0.5),
             dout=randn(S, H, 512, scale=0.1), softmax_scale=D**-0.5, loss_coeff=0.5)
    return x, ids


def _close(a, b, what, tol=1e-9):
    e = ref_indexer.rel_err(a, b)
    assert e < tol, f"{what}: rel err {e:.2e}"


@pytest.mark.parametrize("seed", [0, 1])
def test_step_reference_agrees_with_the_per_op_references(seed):
    x, ids = _inputs(seed)
    r = ref.step_reference(x, ids)
    sink = torch.full((H,), -math.inf)
    fwd = ref_sparse_attention.sparse_attention_forward_ref(x["q"], x["kv"], sink, ids, x["softmax_scale"])
    _close(r["out"], fwd["out"], "out")
    _close(r["lse"], fwd["lse"], "lse")
    bwd = ref_sparse_attention.sparse_attention_backward_ref(x["q"], x["kv"], r["out"], x["dout"], r["lse"], sink, ids, x["softmax_scale"])
    _close(r["dq"], bwd["dq"], "dq")
    _close(r["dkv"], bwd["dkv"], "dkv")
    target = ref_score_recompute.sparse_attn_target_ref(x["q"][None], x["kv"][None], r["lse"][None], ids[None], x["softmax_scale"])[0]
    predict = ref_score_recompute.sparse_indexer_predict_ref(x["qi"][None], x["ki"][None], x["w"][None], ids[None])[0]
    _close(r["target"], target, "target")
    _close(r["predict"], predict, "predict")
    ib = ref_indexer.indexer_backward_ref(x["qi"][None], x["w"][None], x["ki"][None], target[None], predict[None], ids[None], 1.0, sm_scale=1.0,
                                          loss_coeff=x["loss_coeff"])
    for mine, theirs in (("d_qi", "d_index_q"), ("d_w", "d_weights"), ("d_ki", "d_index_k")):
        _close(r[mine], ib[theirs][0], mine)
    visible = torch.arange(S)[None, :] <= torch.arange(S)[:, None]
    assert torch.equal(torch.isfinite(r["scores"]), visible)


def test_a_wrong_step_is_caught():
    """The comparison has teeth: the indexer loss at another coefficient, and the attention at another
    scale, move the gradients far beyond the bounds the GPU test uses."""
    x, ids = _inputs(2)
    r = ref.step_reference(x, ids)
    other = ref.step_reference(dict(x, loss_coeff=0.25), ids)
    assert ref_indexer.rel_err(other["d_qi"], r["d_qi"]) > 100 * ref.BOUNDS["d_qi"] / 10
    other = ref.step_reference(dict(x, softmax_scale=x["softmax_scale"] * 1.25), ids)
    assert ref_indexer.rel_err(other["dq"], r["dq"]) > 10 * ref.BOUNDS["dq"]
    with pytest.raises(ValueError, match="causal"):
        bad = ids.clone()
        bad[0, 0] = 5  # row 0 sees key 0 only
        ref.step_reference(x, bad)
