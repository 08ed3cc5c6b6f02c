"""The float64 indexer-backward reference (tests/gpu/ref_indexer.py) against torch.autograd (CPU, fast).

The reference writes the backward in closed form (gather the selected key rows, einsum, scatter-add).
The oracles below share none of that: they write a *forward* and let autograd differentiate it.

* GEMM stage: dense scores of every query against every key of every batch, in the forward kernel's
  form ``sm_scale * sum_h w_h relu(q_h . k)``, then the selected slot logits picked out of the dense
  matrix by a per-slot Python loop over the ids; autograd of ``sum(grad_signal * logits)``.
* score grad: ``loss_coeff * kl_div(clamp(log_softmax(z)), clamp(log t), log_target=True)`` summed
  over slots and averaged over rows; autograd w.r.t. the predict logits ``z``.
* end to end: the two chained, from ``q, w, k`` to the clipped KL loss.

Mutated oracles (each a plausible implementation mistake) must disagree with the reference on the
same inputs, which proves the inputs exercise what the agreement tests claim to check. A kernel-like
fp32/bf16 emulation calibrates ``REL_ERR_BOUNDS``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F




import ref_indexer as ref  # noqa: E402 - tests/gpu is on sys.path (tests/conftest.py)

OUTS = ("d_index_q", "d_weights", "d_index_k")
TIGHT = 1e-11  # fp64 vs fp64, different association orders

# B, S_q, S_k, H, D, topk: small, but S_k > topk so rows differ, and B > 1 so batch offsets matter.
SHAPE = (2, 5, 24, 4, 8, 10)


# ------------------------------------------------------------------------------------------------
# The autograd oracles
# ------------------------------------------------------------------------------------------------

GEMM_MUTANTS = (
    "no_sm_scale",  # sm_scale dropped (e.g. not applied to dQ/dK)
    "sm_scale_twice",  # sm_scale applied both inside the gate and on the output
    "no_relu",  # no relu gate
    "invalid_as_row0",  # invalid ids clamped to key row 0 of the batch instead of skipped
    "global_as_local",  # global ids used as local ids (no batch offset removed)
    "cross_batch_flip",  # the other architecture's rule for global ids of another batch
    "duplicates_once",  # a key row selected twice in one query row counted once
)


def slot_rows(ids, B, S_k, topk_global, cross_batch, mutant=None):
    """Per-slot (flat key row, valid) from the id rules, by plain loops over Python ints."""
    flat, ok = [], []
    for b, rows in enumerate(ids):
        fr, orow = [], []
        for s_ids in rows:
            f_s, o_s, seen = [], [], set()
            for n in s_ids:
                if not topk_global or mutant == "global_as_local":
                    good, f = 0 <= n < S_k, b * S_k + n
                elif cross_batch != (mutant == "cross_batch_flip"):
                    good, f = 0 <= n < B * S_k, n
                else:
                    good, f = b * S_k <= n < (b + 1) * S_k, n
                if not good:
                    good, f = (True, b * S_k) if mutant == "invalid_as_row0" else (False, 0)
                if good and mutant == "duplicates_once":
                    good = f not in seen
                    seen.add(f)
                f_s.append(f)
                o_s.append(1.0 if good else 0.0)
            fr.append(f_s)
            orow.append(o_s)
        flat.append(fr)
        ok.append(orow)
    return torch.tensor(flat, dtype=torch.int64), torch.tensor(ok, dtype=torch.float64)


def dense_logits(q, w, k, sm_scale, mutant=None, backward_convention=False):
    """(B, S_q, B*S_k) fp64 logits of every query against every key row of every batch."""
    B, S_k, D = k.shape
    S = torch.einsum("bshd,nd->bshn", q, k.reshape(B * S_k, D))
    if backward_convention:  # sum_h w relu(sm_scale * S): what the backward kernels differentiate
        return torch.einsum("bsh,bshn->bsn", w, torch.relu(sm_scale * S))
    act = S if mutant == "no_relu" else torch.relu(S)
    scale = {"no_sm_scale": 1.0, "sm_scale_twice": sm_scale * sm_scale}.get(mutant, sm_scale)
    return scale * torch.einsum("bsh,bshn->bsn", w, act)  # the forward kernel's form


def gemm_autograd(x, G, sm_scale, topk_global, cross_batch=False, mutant=None, backward_convention=False):
    q = x["index_q"].double().requires_grad_(True)
    w = x["weights"].double().requires_grad_(True)
    k = x["index_k"].double().requires_grad_(True)
    B, S_k = k.shape[0], k.shape[1]
    flat, ok = slot_rows(x["topk_indices"].tolist(), B, S_k, topk_global, cross_batch, mutant)
    logits = dense_logits(q, w, k, sm_scale, mutant, backward_convention).gather(-1, flat) * ok
    (G.detach() * logits).sum().backward()
    return dict(d_index_q=q.grad, d_weights=w.grad, d_index_k=k.grad)


SCORE_MUTANTS = (
    "no_predict_clip",  # log(predict) not clipped at -100
    "mean_over_slots",  # kl.mean() over every element (grad_scale / topk)
    "sum_over_rows",  # no 1 / (B * S_q)
    "no_softmax",  # gradient w.r.t. log predict, not w.r.t. the logits
)


def clipped_kl_loss(lp, target, loss_coeff, mutant=None):
    lt = torch.log(target).clamp(ref.CLIP_LOG_MIN, 0.0)
    inp = lp if mutant == "no_predict_clip" else lp.clamp(ref.CLIP_LOG_MIN, 0.0)
    kl = F.kl_div(inp, lt, log_target=True, reduction="none")  # exp(lt) * (lt - inp)
    if mutant == "mean_over_slots":
        return loss_coeff * kl.mean()
    if mutant == "sum_over_rows":
        return loss_coeff * kl.sum()
    return loss_coeff * kl.sum(-1).mean()


def score_autograd(z, target, grad_loss, loss_coeff, mutant=None):
    z = z.detach().clone().requires_grad_(True)
    lp = torch.log_softmax(z, dim=-1)
    if mutant == "no_softmax":
        lp = lp.detach().requires_grad_(True)
    loss = clipped_kl_loss(lp, target, loss_coeff, mutant)
    loss.backward(torch.tensor(grad_loss, dtype=torch.float64))
    return (lp if mutant == "no_softmax" else z).grad


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


def _inputs(topk_global, seed, invalid_frac=0.25, shape=SHAPE):
    B, S_q, S_k, H, D, topk = shape
    x = ref.make_inputs(B, S_q, S_k, H, D, topk, topk_indices_global=topk_global, seed=seed, invalid_frac=invalid_frac)
    assert (x["topk_indices"] < 0).any() or invalid_frac == 0
    return x


def _dirty(x, seed, topk_global):
    """Violate the caller contract on purpose: predict mass on invalid slots (grad_signal becomes
    non-zero there), duplicate ids, positive out-of-range ids, other negative ids and, for global
    ids, ids of the other batch. The kernel must still drop every invalid slot."""
    gen = torch.Generator().manual_seed(seed)
    x = {k: v.clone() for k, v in x.items()}
    B, S_q, topk = x["topk_indices"].shape
    S_k = x["index_k"].shape[1]
    ids = x["topk_indices"]
    off = (torch.arange(B) * S_k).view(B, 1) if topk_global else torch.zeros(B, 1, dtype=torch.int64)
    ids[:, :, 1] = ids[:, :, 0]  # duplicate (slot 0 may be -1: then a duplicate invalid)
    ids[:, 0, 2] = (S_k + 3 + off[:, 0]).to(torch.int32)  # positive out of range of its batch
    ids[:, 1, 2] = -7
    if topk_global:
        for s in range(S_q):
            ids[0, s, 3] = S_k + (5 + s) % S_k  # batch 1's rows, read from batch-0 queries
            ids[1, s, 3] = (6 + s) % S_k  # batch 0's rows, read from batch-1 queries
        ids[1, 3, 4] = B * S_k + 1  # past every batch
    ids[:, 1, 0] = (4 + off[:, 0]).to(torch.int32)  # make slots 0/1 of row 1 a valid duplicate pair
    ids[:, 1, 1] = ids[:, 1, 0]
    bad = ids < 0
    x["index_score"] = torch.where(bad, 0.05 + 0.1 * torch.rand(ids.shape, generator=gen), x["index_score"])
    x["attn_score"] = torch.where(bad, 0.02 * torch.rand(ids.shape, generator=gen), x["attn_score"])
    return x


def _ref(x, sm_scale, loss_coeff, topk_global, **kw):
    return ref.indexer_backward_ref(
        x["index_q"], x["weights"], x["index_k"], x["attn_score"], x["index_score"], x["topk_indices"],
        x["grad_loss"], sm_scale=sm_scale, loss_coeff=loss_coeff, topk_indices_global=topk_global, **kw,
    )  # fmt: skip


def _assert_close(got, want, tol=TIGHT):
    for name in OUTS:
        assert got[name].dtype == torch.float64
        assert got[name].shape == want[name].shape, name
        err = ref.rel_err(got[name], want[name])
        assert err < tol, f"{name}: rel err {err:.3e}"


# ------------------------------------------------------------------------------------------------
# (a) GEMM stage vs autograd of the forward
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("topk_global", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_gemm_matches_autograd_clean(topk_global, seed):
    """make_inputs (the caller contract: distinct ids, -1 padding with zero scores)."""
    x = _inputs(topk_global, seed)
    got = _ref(x, 0.6, 1.7, topk_global)
    _assert_close(got, gemm_autograd(x, got["grad_signal"], 0.6, topk_global))
    assert got["d_index_k"].abs().sum() > 0 and got["d_weights"].abs().sum() > 0


@pytest.mark.parametrize("topk_global,cross_batch", [(False, False), (True, False), (True, True)])
def test_gemm_matches_autograd_dirty(topk_global, cross_batch):
    x = _dirty(_inputs(topk_global, 7), 7, topk_global)
    got = _ref(x, 1.3, 0.9, topk_global, global_cross_batch=cross_batch)
    G = got["grad_signal"]
    assert (G[x["topk_indices"] < 0].abs() > 1e-6).all(), "invalid slots must carry grad signal for this test"
    _assert_close(got, gemm_autograd(x, G, 1.3, topk_global, cross_batch))


@pytest.mark.parametrize(
    "topk_global,mutant",
    [(g, m) for g in (False, True) for m in GEMM_MUTANTS if g or m not in ("global_as_local", "cross_batch_flip")],
)
def test_gemm_comparison_detects_mutants(topk_global, mutant):
    x = _dirty(_inputs(topk_global, 7), 7, topk_global)
    got = _ref(x, 1.3, 0.9, topk_global)
    want = gemm_autograd(x, got["grad_signal"], 1.3, topk_global, mutant=mutant)
    worst = max(ref.rel_err(got[n], want[n]) for n in OUTS)
    assert worst > 1e-3, f"mutant {mutant} not detected (worst rel err {worst:.2e})"


def test_negative_sm_scale_follows_the_backward_kernels_gate():
    """sm_scale < 0: the reference is the gradient of sum_h w relu(sm_scale S) (the backward kernels'
    gate on sm_scale * S), which is *not* that of the forward's sm_scale * sum_h w relu(S)."""
    x = _inputs(False, 3)
    got = _ref(x, -0.8, 1.0, False)
    _assert_close(got, gemm_autograd(x, got["grad_signal"], -0.8, False, backward_convention=True))
    fwd = gemm_autograd(x, got["grad_signal"], -0.8, False)
    assert max(ref.rel_err(got[n], fwd[n]) for n in OUTS) > 0.1


def test_positive_sm_scale_conventions_agree():
    """For sm_scale > 0, relu(sm_scale S) == sm_scale relu(S): both oracles give the same gradient."""
    x = _inputs(True, 4)
    G = _ref(x, 0.45, 1.0, True)["grad_signal"]
    a = gemm_autograd(x, G, 0.45, True)
    b = gemm_autograd(x, G, 0.45, True, backward_convention=True)
    _assert_close(a, b)


# ------------------------------------------------------------------------------------------------
# (b) score grad vs autograd of the clipped KL loss
# ------------------------------------------------------------------------------------------------


def _score_case(seed, B=2, S_q=3, T=16):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(B, S_q, T, generator=gen, dtype=torch.float64) * 2
    z[..., 3] -= 260.0  # predict ~e^-260: > 0 but below e^-100 -> clipped
    z[..., 5] -= 1000.0  # predict underflows to exactly 0 (log_softmax stays finite)
    t = torch.softmax(torch.randn(B, S_q, T, generator=gen, dtype=torch.float64) * 1.5, dim=-1)
    t[..., 3] += 0.5  # large target where predict is clipped: the clip matters
    t[..., 7] = 0.0  # zero target: log t = -inf clipped to -100
    t = t / t.sum(-1, keepdim=True)
    return z, t


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_score_grad_matches_autograd(seed):
    z, t = _score_case(seed)
    p = torch.softmax(z, dim=-1)
    assert (p[..., 3] > 0).all() and (p[..., 3] < ref.CLIP_PROB_MIN).all() and (p[..., 5] == 0).all()
    B, S_q, _ = z.shape
    grad_loss, loss_coeff = 0.75, 2.5
    got = ref.score_grad_ref(t, p, torch.tensor([grad_loss], dtype=torch.float32), loss_coeff / (B * S_q))
    want = score_autograd(z, t, grad_loss, loss_coeff)
    assert got.dtype == torch.float64
    assert ref.rel_err(got, want) < 1e-12
    # The closed form term by term.
    g = -t.clamp_min(ref.CLIP_PROB_MIN) * (p >= ref.CLIP_PROB_MIN) * grad_loss * loss_coeff / (B * S_q)
    torch.testing.assert_close(got, g - p * g.sum(-1, keepdim=True), rtol=1e-12, atol=1e-16)


@pytest.mark.parametrize("mutant", SCORE_MUTANTS)
def test_score_comparison_detects_mutants(mutant):
    z, t = _score_case(0)
    B, S_q, _ = z.shape
    got = ref.score_grad_ref(t, torch.softmax(z, dim=-1), 0.75, 2.5 / (B * S_q))
    want = score_autograd(z, t, 0.75, 2.5, mutant)
    assert ref.rel_err(got, want) > 1e-3, f"mutant {mutant} not detected"


# ------------------------------------------------------------------------------------------------
# End to end: q, w, k -> logits -> softmax -> clipped KL, one autograd pass
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("topk_global", [False, True])
def test_end_to_end_matches_autograd_of_the_loss(topk_global):
    x = _inputs(topk_global, 11)
    B, S_q, topk = x["topk_indices"].shape
    S_k = x["index_k"].shape[1]
    sm_scale, loss_coeff = 0.7, 1.9
    valid = x["topk_indices"] >= 0
    assert valid.any(-1).all(), "every row needs a valid slot for the softmax"

    q = x["index_q"].double().requires_grad_(True)
    w = x["weights"].double().requires_grad_(True)
    k = x["index_k"].double().requires_grad_(True)
    flat, ok = slot_rows(x["topk_indices"].tolist(), B, S_k, topk_global, False)
    logits = dense_logits(q, w, k, sm_scale).gather(-1, flat)
    logits = logits.masked_fill(ok == 0, -math.inf)  # top-k padding: -inf logits, zero softmax
    lp = torch.log_softmax(logits, dim=-1)
    loss = clipped_kl_loss(lp, x["attn_score"].double(), loss_coeff)
    grad_loss = float(x["grad_loss"][0])
    loss.backward(torch.tensor(grad_loss, dtype=torch.float64))
    want = dict(d_index_q=q.grad, d_weights=w.grad, d_index_k=k.grad)

    x = dict(x, index_score=lp.detach().exp())  # predict consistent with the logits (fp64)
    _assert_close(_ref(x, sm_scale, loss_coeff, topk_global), want, tol=1e-10)


# ------------------------------------------------------------------------------------------------
# Contract, chunking, generator
# ------------------------------------------------------------------------------------------------


def test_inputs_are_not_modified_and_chunking_is_invisible():
    x = _dirty(_inputs(True, 5), 5, True)
    before = {k: v.clone() for k, v in x.items()}
    whole = _ref(x, 1.1, 1.0, True)
    for k, v in x.items():
        assert torch.equal(v, before[k]), f"{k} was modified"
    B, S_q, S_k, H, D, topk = SHAPE
    chunked = _ref(x, 1.1, 1.0, True, max_chunk_elems=topk * max(H, D) * 3)  # 3 rows per chunk
    _assert_close(chunked, whole, tol=1e-14)
    assert set(whole) == {"d_index_q", "d_weights", "d_index_k", "grad_signal"}
    assert whole["d_index_q"].shape == (B, S_q, H, D) and whole["d_weights"].shape == (B, S_q, H)
    assert whole["d_index_k"].shape == (B, S_k, D) and whole["grad_signal"].shape == (B, S_q, topk)


def test_shape_contract_is_enforced():
    x = _inputs(False, 0)
    with pytest.raises(ValueError, match="weights"):
        ref.indexer_backward_ref(**dict(x, weights=x["weights"][:, :, :-1]))
    with pytest.raises(ValueError, match="index_score"):
        ref.indexer_backward_ref(**dict(x, index_score=x["index_score"][..., :-1]))
    with pytest.raises(ValueError, match="grad_loss"):
        ref.indexer_backward_ref(**dict(x, grad_loss=torch.ones(2)))


@pytest.mark.parametrize("topk_global", [False, True])
def test_make_inputs(topk_global):
    B, S_q, S_k, H, D, topk = 3, 7, 40, 6, 32, 16
    x = ref.make_inputs(B, S_q, S_k, H, D, topk, topk_indices_global=topk_global, seed=9, invalid_frac=0.3)
    y = ref.make_inputs(B, S_q, S_k, H, D, topk, topk_indices_global=topk_global, seed=9, invalid_frac=0.3)
    for k in x:
        assert torch.equal(x[k], y[k]), f"{k} not reproducible from the seed"
    assert x["index_q"].dtype == x["weights"].dtype == x["index_k"].dtype == torch.bfloat16
    assert x["attn_score"].dtype == x["index_score"].dtype == x["grad_loss"].dtype == torch.float32
    assert x["topk_indices"].dtype == torch.int32 and x["grad_loss"].shape == (1,) and x["grad_loss"].item() > 0
    ids = x["topk_indices"].long()
    valid = ids >= 0
    assert 0.15 < 1 - valid.double().mean().item() < 0.45
    assert (ids[~valid] == -1).all()
    local = ids - (torch.arange(B) * S_k).view(B, 1, 1) if topk_global else ids
    assert ((local[valid] >= 0) & (local[valid] < S_k)).all()
    for b in range(B):
        for s in range(S_q):
            row = local[b, s][valid[b, s]].tolist()
            assert len(set(row)) == len(row), "ids must be distinct per row"
    for name in ("attn_score", "index_score"):
        p = x[name].double()
        assert (p[~valid] == 0).all() and (p[valid] > 0).all()
        torch.testing.assert_close(p.sum(-1), torch.ones(B, S_q, dtype=torch.float64), rtol=0, atol=1e-6)
    # Logits O(1) at sm_scale = 1.
    flat, ok = slot_rows(x["topk_indices"].tolist(), B, S_k, topk_global, False)
    lg = dense_logits(x["index_q"].double(), x["weights"].double(), x["index_k"].double(), 1.0).gather(-1, flat)[ok > 0]
    assert 0.05 < lg.std().item() < 3.0
    # The caller contract makes grad_signal vanish on invalid slots and sum to ~0 per row.
    gs = ref.indexer_backward_ref(**x)["grad_signal"]
    assert (gs[~valid] == 0).all()
    assert gs.sum(-1).abs().max().item() < 1e-6 * gs.abs().max().item()
    z = ref.make_inputs(B, S_q, S_k, H, D, topk, seed=10)
    assert not torch.equal(z["index_q"], x["index_q"]) and (z["topk_indices"] >= 0).all()


# ------------------------------------------------------------------------------------------------
# Bounds: a kernel-like fp32/bf16 computation passes them, a semantic slip does not
# ------------------------------------------------------------------------------------------------


def _kernel_like(x, sm_scale, loss_coeff):
    """The default backends' rounding points: fp32 score grad and scores from bf16 inputs, dS
    rounded to bf16 before the dQ/dK contractions, fp32 accumulation, bf16 outputs."""
    B, S_q, H, D = x["index_q"].shape
    S_k = x["index_k"].shape[1]
    t, p = x["attn_score"], x["index_score"]
    c = torch.tensor(loss_coeff / (B * S_q), dtype=torch.float32) * x["grad_loss"][0]
    g = -t.clamp_min(torch.tensor(ref.CLIP_PROB_MIN, dtype=torch.float32)) * (p >= ref.CLIP_PROB_MIN).float() * c
    G = g - p * g.sum(-1, keepdim=True)  # fp32
    ids = x["topk_indices"].long()
    valid = ids >= 0
    flat = torch.where(valid, ids + (torch.arange(B) * S_k).view(B, 1, 1), torch.zeros_like(ids))
    kf = x["index_k"].float().reshape(B * S_k, D)
    kg = kf[flat] * valid[..., None]  # (B,S_q,T,D)
    q, w = x["index_q"].float(), x["weights"].float()
    a = torch.einsum("bshd,bstd->bsht", q, kg) * sm_scale
    pos = a > 0
    dw = torch.einsum("bst,bsht->bsh", G, torch.where(pos, a, torch.zeros_like(a)))
    ds = torch.where(pos, G[:, :, None, :] * w[..., None], torch.zeros_like(a)).bfloat16().float()
    dq = torch.einsum("bsht,bstd->bshd", ds, kg) * sm_scale
    dkr = torch.einsum("bsht,bshd->bstd", ds, q) * sm_scale
    dk = torch.zeros(B * S_k, D).index_add_(0, flat[valid], dkr[valid])
    out = dict(d_index_q=dq.bfloat16(), d_weights=dw.bfloat16(), d_index_k=dk.view(B, S_k, D).bfloat16())
    return out, G


def test_bounds_admit_kernel_like_rounding_and_reject_slips():
    B, S_q, S_k, H, D, topk = 1, 8, 512, 64, 128, 256  # the kernels' production H, D
    x = ref.make_inputs(B, S_q, S_k, H, D, topk, seed=21, invalid_frac=0.05)
    want = _ref(x, 1.0, 1.0, False)
    got, G = _kernel_like(x, 1.0, 1.0)
    for name in OUTS:
        err = ref.rel_err(got[name], want[name])
        assert err < ref.REL_ERR_BOUNDS[name] / 2, f"{name}: {err:.2e} leaves too little headroom"
    assert ref.rel_err(G, want["grad_signal"]) < ref.REL_ERR_BOUNDS["grad_signal"] / 10
    # A lost sm_scale (here 0.5) or a dropped relu gate is far outside the bounds.
    half = _ref(x, 0.5, 1.0, False)
    lost = gemm_autograd(x, half["grad_signal"], 0.5, False, mutant="no_sm_scale")
    assert all(ref.rel_err(lost[n], half[n]) > 10 * ref.REL_ERR_BOUNDS[n] for n in OUTS)
    nogate = gemm_autograd(x, want["grad_signal"], 1.0, False, mutant="no_relu")
    assert all(ref.rel_err(nogate[n], want[n]) > 10 * ref.REL_ERR_BOUNDS[n] for n in OUTS)
