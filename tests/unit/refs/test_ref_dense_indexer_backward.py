"""The float64 dense indexer-backward reference (tests/gpu/ref_dense_indexer_backward.py) against torch.autograd (CPU, fast).

The reference writes the backward in closed form (per-batch masks, einsum, the softmax Jacobian by
hand). The oracle below shares none of that: it writes the *loss*, one query row at a time with the
causal limit computed from Python ints,

    L = -c * sum_rows sum_{j < lim} max(target_j, e^-100) * clamp(log_softmax(logits)_j, min=-100),
    logits_j = sum_h w_h relu(sm_scale * q_h . k_j),   target_j = attn_score_j / (attn_l1norm + 1e-10),

with ``c = loss_coeff / rows`` and ``grad_loss`` as the incoming gradient, and lets autograd give
``dL/dq``, ``dL/dw``, ``dL/dk`` and ``dL/dlogits`` (= ``grad_signal``). For the two to be the same
function, ``index_score`` must be the logits and ``index_lse`` their log-sum-exp: ``make_inputs``
builds them so (in float64 here, ``score_dtype=torch.float64``; the fp32 scores the GPU tests use stay
within ~1e-7 of the loss's gradient).

Mutated oracles (each a plausible implementation slip) must disagree with the reference on the same
inputs, which proves the inputs exercise what the agreement claims. A kernel-like fp32/bf16
emulation calibrates ``REL_ERR_BOUNDS``.
"""

from __future__ import annotations

import math

import pytest
import torch

import ref_dense_indexer_backward as ref  # noqa: E402 - tests/gpu is on sys.path (tests/conftest.py)

OUTS = ("d_index_q", "d_weights", "d_index_k", "grad_signal")
TIGHT = 1e-11  # fp64 vs fp64, different association orders
H, D = 4, 8
SM_SCALE, LOSS_COEFF = 0.6, 1.7

# name -> make_inputs arguments. BSHD and THD, ratio 1 and 4, with and without offsets; THD with an
# empty segment (ratio 4 with offsets: one with keys but no query, so key rows nobody reaches), a
# score width above the longest segment (ratio 1) and offsets that clamp the limit at S_k.
CASES = {
    "bshd-r1": dict(B=2, S_q=9, S_k=9, ratio=1),
    "bshd-r1-off": dict(B=2, S_q=9, S_k=9, ratio=1, q_causal_offsets=[0, 4]),
    "bshd-r4": dict(B=2, S_q=13, S_k=5, ratio=4),
    "bshd-r4-off": dict(B=2, S_q=13, S_k=6, ratio=4, q_causal_offsets=[3, 9]),
    "thd-r1": dict(B=3, S_q=8, S_k=9, ratio=1, thd=([8, 0, 5], [8, 0, 5])),
    "thd-r1-off": dict(B=3, S_q=8, S_k=8, ratio=1, q_causal_offsets=[2, 7, 0], thd=([8, 0, 5], [8, 0, 6])),
    "thd-r4": dict(B=3, S_q=12, S_k=4, ratio=4, thd=([12, 0, 7], [4, 0, 3])),
    "thd-r4-off": dict(B=3, S_q=12, S_k=6, ratio=4, q_causal_offsets=[5, 0, 9], thd=([12, 0, 7], [5, 2, 4])),
}


def _inputs(name, seed=0, score_dtype=torch.float64, sm_scale=SM_SCALE, h=H, d=D):
    kw = dict(CASES[name])
    return ref.make_inputs(kw.pop("B"), kw.pop("S_q"), kw.pop("S_k"), h, d, sm_scale=sm_scale, seed=seed, score_dtype=score_dtype, **kw)


def _ratio(name):
    return CASES[name]["ratio"]


# ------------------------------------------------------------------------------------------------
# The autograd oracle
# ------------------------------------------------------------------------------------------------

MUTANTS = (
    "no_sm_scale",  # sm_scale dropped from the scores (relu(q.k) instead of relu(sm_scale q.k))
    "no_gate",  # no relu: every head contributes, negative scores too
    "no_causal_limit",  # every key of the batch visible
    "limit_plus_one",  # off by one: j <= (off + i + 1) // ratio
    "no_offsets",  # q_causal_offsets ignored
    "ratio_ignored",  # the limit of ratio 1
    "sum_over_rows",  # no 1 / rows normalisation
    "mean_over_valid_rows",  # normalised by the rows that see a key instead of all rows
)


def _segments(x):
    if "cu_seqlens_q" in x:
        cq, ck = x["cu_seqlens_q"].tolist(), x["cu_seqlens_k"].tolist()
    else:
        B, S_q, S_k = x["index_q"].shape[0], x["index_q"].shape[1], x["index_k"].shape[1]
        cq, ck = [b * S_q for b in range(B + 1)], [b * S_k for b in range(B + 1)]
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _limit(i, n_k, ratio, off, mutant):
    if mutant == "no_causal_limit":
        return n_k
    if mutant == "no_offsets":
        off = 0
    r = 1 if mutant == "ratio_ignored" else ratio
    lim = (off + i + 1) // r + (1 if mutant == "limit_plus_one" else 0)
    return min(max(lim, 0), n_k)


def loss_autograd(x, sm_scale, loss_coeff, ratio, mutant=None, log_clip=True):
    """dict(d_index_q, d_weights, d_index_k, grad_signal) from autograd of the clipped KL loss."""
    q = x["index_q"].double().requires_grad_(True)
    w = x["weights"].double().requires_grad_(True)
    k = x["index_k"].double().requires_grad_(True)
    h, d = q.shape[-2:]
    qf, wf, kf = q.reshape(-1, h, d), w.reshape(-1, h), k.reshape(-1, d)
    rows = qf.shape[0]
    target_raw = x["attn_score"].double().reshape(rows, -1)
    l1 = x["attn_l1norm"].double().reshape(rows)
    segs = _segments(x)
    offs = x["q_causal_offsets"].tolist() if "q_causal_offsets" in x else [0] * len(segs)
    pieces = []  # (row, logits of the row)
    for (q0, q1, k0, k1), off in zip(segs, offs):
        for i in range(q1 - q0):
            lim = _limit(i, k1 - k0, ratio, off, mutant)
            if lim == 0:
                continue
            r = q0 + i
            s = qf[r] @ kf[k0:k0 + lim].T  # (H, lim)
            a = s if mutant == "no_sm_scale" else sm_scale * s
            z = (wf[r][:, None] * (a if mutant == "no_gate" else torch.relu(a))).sum(0)
            z.retain_grad()
            pieces.append((r, z))
    n = {"sum_over_rows": 1, "mean_over_valid_rows": len({r for r, _ in pieces})}.get(mutant, rows)
    loss = torch.zeros((), dtype=torch.float64)
    for r, z in pieces:
        lp = torch.log_softmax(z, dim=-1)
        if log_clip:
            lp = lp.clamp(min=ref.CLIP_LOG_MIN)
        # a mutant's extra columns hold NaN (never valid): read as a zero target
        t = torch.nan_to_num(target_raw[r, : z.numel()], nan=0.0) / (l1[r] + ref.DENOM_EPS)
        loss = loss - (loss_coeff / max(n, 1)) * (t.clamp_min(ref.CLIP_PROB_MIN) * lp).sum()
    if loss.requires_grad:
        loss.backward(torch.tensor(float(x["grad_loss"][0]), dtype=torch.float64))
    gs = torch.zeros(rows, target_raw.shape[1], dtype=torch.float64)
    for r, z in pieces:
        gs[r, : z.numel()] = z.grad
    zeros = torch.zeros_like
    return dict(d_index_q=q.grad if q.grad is not None else zeros(q), d_weights=w.grad if w.grad is not None else zeros(w),
                d_index_k=k.grad if k.grad is not None else zeros(k), grad_signal=gs.reshape(x["index_score"].shape))


def _errs(got, want):
    return {n: ref.rel_err(got[n], want[n]) for n in OUTS}


def _assert_close(got, want, tol=TIGHT):
    for name in OUTS:
        assert got[name].dtype == torch.float64 and got[name].shape == want[name].shape, name
        err = ref.rel_err(got[name], want[name])
        assert err < tol, f"{name}: rel err {err:.3e}"


# ------------------------------------------------------------------------------------------------
# Agreement
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_closed_form_matches_autograd_of_the_loss(case, seed):
    x = _inputs(case, seed)
    got = ref.reference(x, SM_SCALE, LOSS_COEFF, _ratio(case))
    _assert_close(got, loss_autograd(x, SM_SCALE, LOSS_COEFF, _ratio(case)))
    for name in OUTS:
        assert got[name].abs().sum() > 0, f"{name} is all zero: the case checks nothing"
    assert (got["limits"] > 1).any(), "some row needs two keys (with one, grad_signal is 0)"


@pytest.mark.parametrize("case", ["bshd-r4-off", "thd-r1-off"])
def test_fp32_scores_stay_within_rounding_of_the_loss_gradient(case):
    """The GPU tests' inputs (fp32 scores and denominators) differ from the loss's gradient only by the
    fp32 rounding of index_score / index_lse: the reference reads the inputs, not the logits."""
    x = _inputs(case, 3, score_dtype=torch.float32)
    errs = _errs(ref.reference(x, SM_SCALE, LOSS_COEFF, _ratio(case)), loss_autograd(x, SM_SCALE, LOSS_COEFF, _ratio(case)))
    assert max(errs.values()) < 1e-5, errs


def test_both_clips_match_autograd():
    """A large sm_scale drives log predict below -100 on some valid columns (their g is gated off), and
    targets below e^-100 are clamped up to it: both paths taken, still the loss's gradient."""
    x = _inputs("thd-r1-off", 5, sm_scale=400.0)
    lim = ref.reference(x, 400.0, LOSS_COEFF, 1)["limits"]
    valid = torch.arange(x["index_score"].shape[-1])[None, :] < lim[:, None]
    logp = x["index_score"] - x["index_lse"][:, None]
    assert (logp[valid] < ref.CLIP_LOG_MIN).sum() >= 3, "the case must clip log predict"
    tiny = valid & (torch.rand(valid.shape, generator=torch.Generator().manual_seed(5)) < 0.3)
    x["attn_score"] = torch.where(tiny, 1e-60, x["attn_score"])  # target < e^-100 (fp64 scores)
    got = ref.reference(x, 400.0, LOSS_COEFF, 1)
    _assert_close(got, loss_autograd(x, 400.0, LOSS_COEFF, 1))
    unclipped = loss_autograd(x, 400.0, LOSS_COEFF, 1, log_clip=False)
    assert max(_errs(got, unclipped).values()) > 1e-3, "dropping the log clip must be detected"


@pytest.mark.parametrize("ratio", [1, 4])
def test_bshd_is_thd_with_equal_segments(ratio):
    s_k = 9 if ratio == 1 else 4
    x = ref.make_inputs(3, 9, s_k, H, D, ratio=ratio, sm_scale=SM_SCALE, q_causal_offsets=[0, 2, 5], seed=7)
    y = dict(x, cu_seqlens_q=torch.arange(4, dtype=torch.int32) * 9, cu_seqlens_k=torch.arange(4, dtype=torch.int32) * s_k)
    for n in ("index_q", "weights", "attn_l1norm", "index_lse"):
        y[n] = x[n].flatten(0, 1)
    y["index_k"] = x["index_k"].flatten(0, 1)
    y["attn_score"], y["index_score"] = x["attn_score"].flatten(0, 1), x["index_score"].flatten(0, 1)
    a, b = ref.reference(x, SM_SCALE, LOSS_COEFF, ratio), ref.reference(y, SM_SCALE, LOSS_COEFF, ratio)
    for n in OUTS + ("limits",):
        assert torch.equal(a[n].flatten(0, 1), b[n]), n


# ------------------------------------------------------------------------------------------------
# Mutants: the comparison fails when a semantic detail is dropped
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mutant", MUTANTS)
@pytest.mark.parametrize("case", ["bshd-r4", "bshd-r4-off", "thd-r4", "thd-r4-off", "thd-r1-off"])
def test_comparison_detects_mutants(case, mutant):
    x = _inputs(case, 1)
    got = ref.reference(x, SM_SCALE, LOSS_COEFF, _ratio(case))
    if (mutant == "ratio_ignored" and _ratio(case) == 1) or (mutant == "no_offsets" and "q_causal_offsets" not in x):
        pytest.skip("nothing to drop in this case")
    if mutant == "mean_over_valid_rows" and (got["limits"] > 0).all():
        pytest.skip("every row sees a key: both normalisations agree")
    worst = max(_errs(got, loss_autograd(x, SM_SCALE, LOSS_COEFF, _ratio(case), mutant)).values())
    assert worst > 1e-3, f"mutant {mutant} not detected (worst rel err {worst:.2e})"


# ------------------------------------------------------------------------------------------------
# Contract, chunking, generator
# ------------------------------------------------------------------------------------------------


def test_nan_past_the_limit_is_never_read():
    x = _inputs("thd-r4-off", 2, score_dtype=torch.float32)
    assert torch.isnan(x["attn_score"]).any() and torch.isnan(x["index_score"]).any()
    a = ref.reference(x, SM_SCALE, LOSS_COEFF, 4)
    for n in OUTS:
        assert torch.isfinite(a[n]).all(), n
    filled = dict(x, attn_score=torch.nan_to_num(x["attn_score"], nan=3.0), index_score=torch.nan_to_num(x["index_score"], nan=-2.0))
    b = ref.reference(filled, SM_SCALE, LOSS_COEFF, 4)
    for n in OUTS:
        assert torch.equal(a[n], b[n]), n


def test_inputs_are_not_modified_and_chunking_is_invisible():
    x = _inputs("bshd-r1-off", 4)
    before = {k: v.clone() for k, v in x.items()}
    whole = ref.reference(x, SM_SCALE, LOSS_COEFF, 1)
    for k, v in x.items():
        assert torch.equal(v.nan_to_num(7.0), before[k].nan_to_num(7.0)), f"{k} was modified"
    chunked = ref.reference(x, SM_SCALE, LOSS_COEFF, 1, max_chunk_elems=H * D * 2)  # 2 rows per chunk
    _assert_close(chunked, whole, tol=1e-14)
    assert set(whole) == {"d_index_q", "d_weights", "d_index_k", "grad_signal", "limits"}
    for n, like in (("d_index_q", "index_q"), ("d_weights", "weights"), ("d_index_k", "index_k"), ("grad_signal", "index_score"),
                    ("limits", "index_lse")):
        assert whole[n].shape == x[like].shape, n
    assert whole["limits"].tolist() == [[min((o + i + 1), 9) for i in range(9)] for o in (0, 4)]


def test_shape_contract_is_enforced():
    x = _inputs("bshd-r4", 0)
    with pytest.raises(ValueError, match="weights"):
        ref.reference(dict(x, weights=x["weights"][..., :-1]), ratio=4)
    with pytest.raises(ValueError, match="index_score"):
        ref.reference(dict(x, index_score=x["index_score"][..., :-1]), ratio=4)
    with pytest.raises(ValueError, match="grad_loss"):
        ref.reference(dict(x, grad_loss=torch.ones(2)), ratio=4)
    with pytest.raises(ValueError, match="q_causal_offsets"):
        ref.reference(dict(x, q_causal_offsets=torch.zeros(3, dtype=torch.int32)), ratio=4)
    y = _inputs("thd-r1", 0)
    with pytest.raises(ValueError, match="score width"):  # a segment longer than max_seqlen_k
        ref.reference(dict(y, attn_score=y["attn_score"][:, :4], index_score=y["index_score"][:, :4]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        ref.reference(dict(y, cu_seqlens_q=torch.tensor([0, 9, 7, 13], dtype=torch.int32)))
    with pytest.raises(ValueError, match="both"):
        ref.reference({k: v for k, v in y.items() if k != "cu_seqlens_k"})


@pytest.mark.parametrize("case", ["bshd-r4", "thd-r4-off"])
def test_make_inputs(case):
    x = _inputs(case, 9, score_dtype=torch.float32)
    y = _inputs(case, 9, score_dtype=torch.float32)
    for k in x:
        same = torch.equal(x[k].nan_to_num(7.0), y[k].nan_to_num(7.0)) if isinstance(x[k], torch.Tensor) else x[k] == y[k]
        assert same, f"{k} not reproducible from the seed"
    assert not torch.equal(_inputs(case, 10)["index_q"], x["index_q"])
    assert x["index_q"].dtype == x["weights"].dtype == x["index_k"].dtype == torch.bfloat16
    for n in ("attn_score", "attn_l1norm", "index_score", "index_lse", "grad_loss"):
        assert x[n].dtype == torch.float32, n
    assert x["grad_loss"].shape == (1,) and 0.5 <= x["grad_loss"].item() < 1.5
    assert ("q_causal_offsets" in x) == ("q_causal_offsets" in CASES[case])
    if "q_causal_offsets" in x:
        assert x["q_causal_offsets"].dtype == torch.int32 and x["q_causal_offsets"].tolist() == CASES[case]["q_causal_offsets"]
    thd = "cu_seqlens_q" in x
    if thd:
        lens_q, lens_k = CASES[case]["thd"]
        assert x["cu_seqlens_q"].dtype == x["cu_seqlens_k"].dtype == torch.int32
        assert x["cu_seqlens_q"][-1] == x["index_q"].shape[0] == sum(lens_q) and x["cu_seqlens_k"][-1] == x["index_k"].shape[0] == sum(lens_k)
        assert (x["max_seqlen_q"], x["max_seqlen_k"]) == (CASES[case]["S_q"], CASES[case]["S_k"])
    lim = ref.reference(x, SM_SCALE, LOSS_COEFF, 4)["limits"].reshape(-1)
    sc, at = x["index_score"].reshape(lim.numel(), -1).double(), x["attn_score"].reshape(lim.numel(), -1).double()
    lse, l1 = x["index_lse"].reshape(-1).double(), x["attn_l1norm"].reshape(-1).double()
    valid = torch.arange(sc.shape[1])[None, :] < lim[:, None]
    assert torch.equal(torch.isnan(sc), ~valid) and torch.equal(torch.isnan(at), ~valid), "NaN exactly past the limit"
    assert (at[valid] > 0).all() and ((lim == 0).any() or "q_causal_offsets" in x)  # rows with no key: lse and l1norm 0 (below)
    torch.testing.assert_close(lse, torch.where(lim > 0, torch.logsumexp(sc.masked_fill(~valid, -math.inf), -1), 0.0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(l1, torch.where(valid, at, 0.0).sum(-1), rtol=1e-6, atol=0.0)
    assert 0.02 < sc[valid].std().item() < 3.0  # the indexer logits: O(1) at sm_scale 0.6


# ------------------------------------------------------------------------------------------------
# Bounds: a kernel-like fp32/bf16 computation passes them, a semantic slip does not
# ------------------------------------------------------------------------------------------------


def _kernel_like(x, sm_scale, loss_coeff, ratio):
    """The kernels' rounding points: fp32 score grad from the fp32 inputs, fp32 scores from bf16
    inputs, dS rounded to bf16 before the dQ/dK contractions, fp32 accumulation, bf16 outputs."""
    f32 = torch.float32
    h, d = x["index_q"].shape[-2:]
    rows = x["weights"].numel() // h
    q, w, k = x["index_q"].float().reshape(rows, h, d), x["weights"].float().reshape(rows, h), x["index_k"].float().reshape(-1, d)
    s_all, t_all = x["index_score"].reshape(rows, -1), x["attn_score"].reshape(rows, -1)
    lse_all, l1_all = x["index_lse"].reshape(rows), x["attn_l1norm"].reshape(rows)
    c = torch.tensor(loss_coeff / rows, dtype=f32) * x["grad_loss"][0]
    G = torch.zeros(rows, s_all.shape[1])
    dq, dw, dk = torch.zeros(rows, h, d), torch.zeros(rows, h), torch.zeros_like(k)
    offs = x["q_causal_offsets"].tolist() if "q_causal_offsets" in x else None
    for b, (q0, q1, k0, k1) in enumerate(ref.segments(x["index_q"], x["index_k"], x.get("cu_seqlens_q"), x.get("cu_seqlens_k"))):
        lim = ref.limits_of(q1 - q0, k1 - k0, ratio, offs[b] if offs else 0)
        m = int(lim.max()) if q1 > q0 else 0
        if m == 0:
            continue
        valid = torch.arange(m)[None, :] < lim[:, None]
        xs = torch.where(valid, s_all[q0:q1, :m], 0.0) - lse_all[q0:q1, None]
        p = torch.exp(xs)
        t = torch.where(valid, t_all[q0:q1, :m], 0.0) / (l1_all[q0:q1, None] + torch.tensor(ref.DENOM_EPS, dtype=f32))
        g = torch.where(valid & (xs >= ref.CLIP_LOG_MIN), -t.clamp_min(torch.tensor(ref.CLIP_PROB_MIN, dtype=f32)) * c, 0.0)
        gs = torch.where(valid, g - p * g.sum(-1, keepdim=True), 0.0)
        G[q0:q1, :m] = gs
        kb = k[k0:k0 + m]
        a = torch.einsum("ihd,jd->ihj", q[q0:q1], kb) * sm_scale
        pos = (a > 0) & valid[:, None, :]
        dw[q0:q1] = torch.einsum("ij,ihj->ih", gs, torch.where(pos, a, 0.0))
        ds = torch.where(pos, gs[:, None, :] * w[q0:q1, :, None], 0.0).bfloat16().float()
        dq[q0:q1] = torch.einsum("ihj,jd->ihd", ds, kb) * sm_scale
        dk[k0:k0 + m] += torch.einsum("ihj,ihd->jd", ds, q[q0:q1]) * sm_scale
    out = dict(d_index_q=dq.bfloat16().reshape(x["index_q"].shape), d_weights=dw.bfloat16().reshape(x["weights"].shape),
               d_index_k=dk.bfloat16().reshape(x["index_k"].shape), grad_signal=G.reshape(x["index_score"].shape))
    return out


def test_bounds_admit_kernel_like_rounding_and_reject_slips():
    # the kernels' production H and D, a GPU-test shape (two K blocks, a partial one), offsets
    x = ref.make_inputs(2, 130, 130, 64, 128, ratio=1, sm_scale=0.37, q_causal_offsets=[0, 37], seed=21)
    want = ref.reference(x, 0.37, LOSS_COEFF, 1)
    got = _kernel_like(x, 0.37, LOSS_COEFF, 1)
    errs = _errs(got, want)
    for name in OUTS:
        assert errs[name] < ref.REL_ERR_BOUNDS[name] / 2, f"{name}: {errs[name]:.2e} leaves too little headroom ({errs})"
    # A lost sm_scale or gate, or a causal limit off by one, is far outside the bounds.
    for mutant in ("no_sm_scale", "no_gate", "limit_plus_one"):
        slip = loss_autograd(x, 0.37, LOSS_COEFF, 1, mutant)
        e = _errs(slip, want)
        assert max(e[n] / ref.REL_ERR_BOUNDS[n] for n in OUTS) > 10, f"{mutant}: {e}"
