"""The float64 sparse-attention-backward reference (tests/gpu/ref_sparse_attention.py) against torch.autograd (CPU, fast).

The reference writes the backward in closed form (gather the selected KV rows per query, einsum,
scatter-add, the sink through ``p_sink``). The oracle below shares none of that: it writes a
*forward* and lets autograd differentiate it.

* Slots: per-slot (KV row, valid) from plain Python loops over the ids and lengths, turned into a
  one-hot selection tensor ``Sel (S_q, topk, S_kv)``.
* Logits: dense ``scale * q . kv`` of every query head against every KV row, then picked out per
  slot by ``Sel``; invalid slots ``-inf``.
* Sink: an extra softmax column holding ``attn_sink[h]`` (``softmax([logits, sink])[:topk]``);
  ``out = P Sel V`` with ``V = kv[:, :Dv]``; loss ``sum(dout * out)``; autograd w.r.t. ``q``, ``kv``
  and ``attn_sink``.

The reference's backward is fed the oracle's own fp64 ``out`` / ``lse``, so the two must agree to
fp64 rounding. Mutated oracles (each a plausible implementation mistake) must disagree with the
reference on the same inputs, which proves the inputs exercise what the agreement tests claim to
check. A kernel-like fp32/bf16 emulation calibrates ``REL_ERR_BOUNDS``.
"""

from __future__ import annotations

import math

import pytest
import torch




import ref_sparse_attention as ref  # noqa: E402 - tests/gpu is on sys.path (tests/conftest.py)

OUTS = ("dq", "dkv", "d_sink")
TIGHT = 1e-11  # fp64 vs fp64, different association orders

# S_q, S_kv, H, topk: small, but S_kv > topk so rows differ; D is the real 512 / 576.
S_Q, S_KV, H, TOPK = 6, 24, 4, 10


# ------------------------------------------------------------------------------------------------
# The autograd oracle
# ------------------------------------------------------------------------------------------------

MUTANTS = (
    "no_sink",  # sink dropped from the softmax denominator
    "ignore_topk_length",  # every slot of the row used, topk_length ignored
    "invalid_as_row0",  # an out-of-range id (-1 padding, ...) read as KV row 0 instead of skipped
    "v_last_cols",  # D=576 split the wrong way: V = kv[:, 64:576] instead of kv[:, :512]
    "default_scale_dv",  # default scale 1/sqrt(Dv) = 1/sqrt(512) instead of 1/sqrt(D) = 1/sqrt(576)
    "duplicates_once",  # a KV row named by two slots of one row counted once
)


def slot_table(ids, lengths, S_kv, mutant=None):
    """One-hot ``Sel (S_q, topk, S_kv)`` and validity ``ok (S_q, topk)``, by plain loops over ints."""
    S_q, topk = len(ids), len(ids[0])
    sel = torch.zeros(S_q, topk, S_kv, dtype=torch.float64)
    ok = torch.zeros(S_q, topk, dtype=torch.bool)
    for i, row in enumerate(ids):
        n_len = topk
        if lengths is not None and mutant != "ignore_topk_length":
            n_len = min(max(lengths[i], 0), topk)
        seen = set()
        for t, n in enumerate(row):
            if t >= n_len:
                continue
            if not 0 <= n < S_kv:
                if mutant != "invalid_as_row0":
                    continue
                n = 0
            if mutant == "duplicates_once":
                if n in seen:
                    continue
                seen.add(n)
            sel[i, t, n] = 1.0
            ok[i, t] = True
    return sel, ok


def oracle_forward(q, kv, sink, ids, lengths, scale, mutant=None):
    """fp64 ``(out, lse)`` from the math; differentiable in ``q``, ``kv``, ``sink``."""
    S_q, H_, D = q.shape
    Dv = 512 if D == 576 else D
    V = kv[:, D - Dv :] if mutant == "v_last_cols" else kv[:, :Dv]
    if scale is None:
        scale = 1.0 / math.sqrt(Dv if mutant == "default_scale_dv" else D)
    sel, ok = slot_table(ids.tolist(), None if lengths is None else lengths.tolist(), kv.shape[0], mutant)
    dense = scale * torch.einsum("ihd,nd->ihn", q, kv)  # every head against every KV row
    logits = torch.einsum("itn,ihn->iht", sel, dense).masked_fill(~ok[:, None, :], -math.inf)
    if mutant == "no_sink":
        z = logits
    else:
        z = torch.cat([logits, sink.view(1, H_, 1).expand(S_q, H_, 1)], dim=-1)
    p = torch.softmax(z, dim=-1)[..., : ids.shape[1]]
    out = torch.einsum("iht,itn,nc->ihc", p, sel, V)
    lse = torch.logsumexp(logits.detach(), dim=-1)
    lse = torch.where(ok.any(-1, keepdim=True), lse, torch.full_like(lse, math.inf))  # empty-row sentinel
    return out, lse


def oracle_grads(x, mutant=None, sink=None):
    """Autograd of ``sum(dout * out)``; also the oracle's fp64 ``out`` / ``lse``."""
    q = x["q"].double().requires_grad_(True)
    kv = x["kv"].double().requires_grad_(True)
    s = (x["attn_sink"] if sink is None else sink).double().requires_grad_(True)
    out, lse = oracle_forward(q, kv, s, x["topk_idxs"], x["topk_length"], x["softmax_scale"], mutant)
    (x["dout"].double() * out).sum().backward()
    zero = torch.zeros_like
    grads = dict(dq=q.grad, dkv=kv.grad, d_sink=s.grad if s.grad is not None else zero(s))
    return grads, out.detach(), lse


def _ref_bwd(x, out=None, lse=None, **kw):
    return ref.sparse_attention_backward_ref(
        x["q"], x["kv"], x["out"] if out is None else out, x["dout"], x["lse"] if lse is None else lse,
        x["attn_sink"], x["topk_idxs"], softmax_scale=x["softmax_scale"], topk_length=x["topk_length"], **kw,
    )  # fmt: skip


def _assert_close(got, want, tol=TIGHT, names=OUTS):
    for name in names:
        assert got[name].dtype == torch.float64
        assert got[name].shape == want[name].shape, name
        err = ref.rel_err(got[name], want[name])
        assert err < tol, f"{name}: rel err {err:.3e}"


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


def _inputs(D, with_len, seed, invalid_frac=0.25, softmax_scale=None):
    x = ref.make_inputs(S_Q, S_KV, H, D, TOPK, with_topk_length=with_len, seed=seed, invalid_frac=invalid_frac, softmax_scale=softmax_scale)
    assert (x["topk_idxs"] < 0).any() or invalid_frac == 0
    return x


def _dirty(x, empty_rows=True):
    """Edge cases on purpose: duplicate ids (valid and invalid), a positive out-of-range id and other
    negative ids inside the length prefix, lengths below 0 and above topk, and (``empty_rows``) rows
    with no valid slot. Rows 0..3 keep several valid slots."""
    x = dict(x)
    ids = x["topk_idxs"].clone()
    ids[:, 1] = ids[:, 0]  # duplicate (slot 0 may be -1: then a duplicate invalid)
    ids[0, 2] = S_KV + 3  # positive out of range
    ids[1, 2] = -7
    ids[2, 0] = 5  # a valid duplicate pair
    ids[2, 1] = 5
    ids[0:4, 3:6] = torch.tensor([11, 12, 13], dtype=torch.int32)  # valid slots in every kept row
    if empty_rows:
        ids[5, :] = -1  # empty by ids
    x["topk_idxs"] = ids
    if x["topk_length"] is not None:
        ln = x["topk_length"].clone()
        ln[0] = 7  # the out-of-range id at slot 2 lies inside the prefix
        ln[1] = TOPK + 5  # clamped to topk
        ln[2] = 6
        ln[3] = 4  # slots 4.. valid but past the length
        ln[4] = -3 if empty_rows else TOPK  # clamped to 0: empty by length
        x["topk_length"] = ln
    # out / lse of the edited inputs (make_inputs' belong to the unedited ones), rounded as the kernel's.
    fwd = ref.sparse_attention_forward_ref(x["q"], x["kv"], x["attn_sink"], ids, x["softmax_scale"], x["topk_length"])
    x["out"], x["lse"] = fwd["out"].to(torch.bfloat16), fwd["lse"].to(torch.float32)
    return x


# ------------------------------------------------------------------------------------------------
# (a) backward vs autograd of the forward
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [512, 576])
@pytest.mark.parametrize("with_len", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_backward_matches_autograd_clean(D, with_len, seed):
    """make_inputs (distinct ids, -1 padding, default scale) with the oracle's exact out / lse."""
    x = _inputs(D, with_len, seed)
    want, out, lse = oracle_grads(x)
    got = _ref_bwd(x, out=out, lse=lse)
    _assert_close(got, want)
    assert all(got[n].abs().sum() > 0 for n in OUTS)


@pytest.mark.parametrize("D", [512, 576])
@pytest.mark.parametrize("with_len", [False, True])
def test_backward_matches_autograd_dirty(D, with_len):
    x = _dirty(_inputs(D, with_len, 7, softmax_scale=0.03))
    want, out, lse = oracle_grads(x)
    assert torch.isinf(lse[5]).all() and (out[5] == 0).all()
    got = _ref_bwd(x, out=out, lse=lse)
    _assert_close(got, want)
    assert (got["dq"][5] == 0).all(), "an empty row has no dq"


def test_forward_matches_oracle():
    """The reference forward (used by make_inputs) is the oracle's forward: out, KV-only lse, +inf
    in empty rows, 0 output there."""
    for D in (512, 576):
        for with_len in (False, True):
            x = _dirty(_inputs(D, with_len, 3))
            out, lse = oracle_forward(x["q"].double(), x["kv"].double(), x["attn_sink"].double(), x["topk_idxs"], x["topk_length"], None)
            got = ref.sparse_attention_forward_ref(x["q"], x["kv"], x["attn_sink"], x["topk_idxs"], topk_length=x["topk_length"])
            assert got["out"].dtype == got["lse"].dtype == torch.float64
            assert ref.rel_err(got["out"], out) < TIGHT
            fin = torch.isfinite(lse)
            assert torch.equal(fin, torch.isfinite(got["lse"])) and (got["lse"][~fin] == math.inf).all()
            torch.testing.assert_close(got["lse"][fin], lse[fin], rtol=1e-13, atol=1e-13)
            assert (got["out"][~fin.all(-1)] == 0).all()


def test_sink_only_enters_the_denominator():
    """out * (1 + exp(sink - lse)) is the sink-free softmax average: the sink has no value row."""
    x = _dirty(_inputs(576, True, 4))
    with_sink = ref.sparse_attention_forward_ref(x["q"], x["kv"], x["attn_sink"], x["topk_idxs"], topk_length=x["topk_length"])
    no_sink = ref.sparse_attention_forward_ref(x["q"], x["kv"], None, x["topk_idxs"], topk_length=x["topk_length"])
    torch.testing.assert_close(with_sink["lse"], no_sink["lse"], rtol=0, atol=0)
    fin = torch.isfinite(with_sink["lse"])
    factor = 1 + torch.exp(x["attn_sink"].double()[None, :] - with_sink["lse"])
    torch.testing.assert_close((with_sink["out"] * factor[..., None])[fin], no_sink["out"][fin], rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------------------------------
# (b) d_sink
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [512, 576])
def test_d_sink_closed_form_matches_autograd(D):
    x = _dirty(_inputs(D, True, 5))
    want, out, lse = oracle_grads(x)
    got = _ref_bwd(x, out=out, lse=lse)
    # The closed form term by term: d_sink[h] = -sum_i Delta[i,h] / (1 + exp(lse[i,h] - sink[h])).
    delta = (out * x["dout"].double()).sum(-1)
    p_sink = 1.0 / (1.0 + torch.exp(lse - x["attn_sink"].double()[None, :]))  # 0 where lse = +inf
    closed = -(p_sink * delta).sum(0)
    torch.testing.assert_close(got["d_sink"], closed, rtol=1e-12, atol=1e-14)
    assert ref.rel_err(got["d_sink"], want["d_sink"]) < TIGHT
    assert got["d_sink"].abs().min() > 1e-3, "every head's sink gradient should be exercised"


def test_no_sink_is_plain_softmax():
    """attn_sink = -inf: p_sink = 0, d_sink = 0, and the gradients are those of a sink-free softmax."""
    x = _inputs(512, False, 6, invalid_frac=0.2)
    minus_inf = torch.full((H,), -math.inf, dtype=torch.float32)
    x = dict(x, attn_sink=minus_inf)
    want, out, lse = oracle_grads(x, mutant="no_sink")
    got = _ref_bwd(x, out=out, lse=lse)
    _assert_close(got, want, names=("dq", "dkv"))
    assert (got["d_sink"] == 0).all()


def test_backward_uses_the_given_out_and_kv_only_lse():
    """Delta comes from the out passed in (bf16 from make_inputs), not a recomputed one; lse is read as
    KV-only (a sink-inclusive lse is a different, wrong input)."""
    x = _inputs(576, True, 8)
    got = _ref_bwd(x)
    delta = (x["out"].double() * x["dout"].double()).sum(-1)
    lse = x["lse"].double()
    p_sink = torch.where(torch.isinf(lse), torch.zeros_like(lse), 1.0 / (1.0 + torch.exp(lse - x["attn_sink"].double())))
    torch.testing.assert_close(got["d_sink"], -(p_sink * delta).sum(0), rtol=1e-12, atol=1e-14)
    exact, _, _ = oracle_grads(x)
    for n in OUTS:  # bf16 out / fp32 lse: close to the exact gradient, but not equal
        assert 0 < ref.rel_err(got[n], exact[n]) < 1e-2
    wrong = _ref_bwd(x, lse=torch.logaddexp(x["lse"], x["attn_sink"][None, :]))
    assert max(ref.rel_err(wrong[n], got[n]) for n in OUTS) > 1e-2


# ------------------------------------------------------------------------------------------------
# (c) mutants
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mutant", MUTANTS)
def test_comparison_detects_mutants(mutant):
    """Each mutant's autograd gradients disagree with the reference's (fed the correct forward)."""
    x = _dirty(_inputs(576, True, 9), empty_rows=False)  # no_sink needs a valid slot in every row
    _, out, lse = oracle_grads(x)
    got = _ref_bwd(x, out=out, lse=lse)
    want, _, _ = oracle_grads(x, mutant=mutant)
    worst = max(ref.rel_err(got[n], want[n]) for n in OUTS)
    assert worst > 1e-3, f"mutant {mutant} not detected (worst rel err {worst:.2e})"


def test_mutants_touch_every_output():
    """Finer: which outputs each mutant moves, so no single output carries the detection alone."""
    x = _dirty(_inputs(576, True, 9), empty_rows=False)
    _, out, lse = oracle_grads(x)
    got = _ref_bwd(x, out=out, lse=lse)
    for mutant in ("no_sink", "ignore_topk_length", "invalid_as_row0", "default_scale_dv"):
        want, _, _ = oracle_grads(x, mutant=mutant)
        for n in OUTS:
            assert ref.rel_err(got[n], want[n]) > 1e-3, f"{mutant}: {n} unchanged"


# ------------------------------------------------------------------------------------------------
# Contract, chunking, generator
# ------------------------------------------------------------------------------------------------


def test_inputs_are_not_modified_and_chunking_is_invisible():
    x = _dirty(_inputs(576, True, 10))
    before = {k: v.clone() for k, v in x.items() if isinstance(v, torch.Tensor)}
    whole = _ref_bwd(x)
    for k, v in before.items():
        assert torch.equal(x[k], v), f"{k} was modified"
    chunked = _ref_bwd(x, max_chunk_elems=TOPK * 576 * 2)  # 2 rows per chunk
    _assert_close(chunked, whole, tol=1e-14)
    fw = ref.sparse_attention_forward_ref(x["q"], x["kv"], x["attn_sink"], x["topk_idxs"], topk_length=x["topk_length"])
    fc = ref.sparse_attention_forward_ref(x["q"], x["kv"], x["attn_sink"], x["topk_idxs"], topk_length=x["topk_length"], max_chunk_elems=1)
    assert torch.equal(fw["lse"], fc["lse"]) and ref.rel_err(fc["out"], fw["out"]) < 1e-14
    assert set(whole) == {"dq", "dkv", "d_sink"}
    assert whole["dq"].shape == (S_Q, H, 576) and whole["dkv"].shape == (S_KV, 576) and whole["d_sink"].shape == (H,)
    # KV rows no valid slot names get no gradient.
    rows, valid = ref.resolve_slots(x["topk_idxs"], S_KV, x["topk_length"])
    named = torch.zeros(S_KV, dtype=torch.bool)
    named[rows[valid]] = True
    assert not named.all() and (whole["dkv"][~named] == 0).all() and (whole["dkv"][named].abs().sum(-1) > 0).all()


def test_resolve_slots():
    ids = torch.tensor([[3, -1, 7, 30, 3], [0, 1, 2, 3, 4], [5, 6, -2, 8, 9]], dtype=torch.int32)
    rows, valid = ref.resolve_slots(ids, 10, torch.tensor([4, -1, 99], dtype=torch.int32))
    assert valid.tolist() == [[True, False, True, False, False], [False] * 5, [True, True, False, True, True]]
    assert rows.tolist() == [[3, 0, 7, 0, 0], [0] * 5, [5, 6, 0, 8, 9]]
    _, valid = ref.resolve_slots(ids, 10)
    assert valid.tolist()[0] == [True, False, True, False, True]


def test_shape_contract_is_enforced():
    x = _inputs(512, True, 0)
    with pytest.raises(ValueError, match="head_dim"):
        ref.head_dim_v(128)
    with pytest.raises(ValueError, match="head_dim"):
        ref.make_inputs(2, 8, 2, 128, 4)
    with pytest.raises(ValueError, match="out"):
        _ref_bwd(x, out=x["out"][..., :-1])
    with pytest.raises(ValueError, match="lse"):
        _ref_bwd(x, lse=x["lse"][:, :-1])
    with pytest.raises(ValueError, match="attn_sink"):
        _ref_bwd(dict(x, attn_sink=x["attn_sink"][:-1]))
    with pytest.raises(ValueError, match="topk_length"):
        _ref_bwd(dict(x, topk_length=x["topk_length"][:-1]))
    with pytest.raises(ValueError, match="kv"):
        _ref_bwd(dict(x, kv=torch.zeros(S_KV, 576, dtype=torch.bfloat16)))


@pytest.mark.parametrize("D", [512, 576])
def test_make_inputs(D):
    S_q, S_kv, H_, topk = 9, 64, 8, 32
    kw = dict(with_topk_length=True, seed=9, invalid_frac=0.3)
    x = ref.make_inputs(S_q, S_kv, H_, D, topk, **kw)
    y = ref.make_inputs(S_q, S_kv, H_, D, topk, **kw)
    for k, v in x.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, y[k]), f"{k} not reproducible from the seed"
    Dv = 512 if D == 576 else D
    assert x["q"].dtype == x["kv"].dtype == x["out"].dtype == x["dout"].dtype == torch.bfloat16
    assert x["lse"].dtype == x["attn_sink"].dtype == torch.float32
    assert x["topk_idxs"].dtype == x["topk_length"].dtype == torch.int32 and x["softmax_scale"] is None
    assert x["q"].shape == (S_q, H_, D) and x["kv"].shape == (S_kv, D) and x["out"].shape == x["dout"].shape == (S_q, H_, Dv)
    assert x["lse"].shape == (S_q, H_) and x["attn_sink"].shape == (H_,) and x["topk_idxs"].shape == (S_q, topk)
    ids = x["topk_idxs"].long()
    valid = ids >= 0
    assert 0.15 < 1 - valid.double().mean().item() < 0.45 and (ids[~valid] == -1).all() and (ids < S_kv).all()
    for i in range(S_q):
        row = ids[i][valid[i]].tolist()
        assert len(set(row)) == len(row), "ids must be distinct per row"
    ln = x["topk_length"]
    assert (ln >= 0).all() and (ln <= topk).all() and len(set(ln.tolist())) > 1
    # out / lse are the fp64 forward, rounded.
    fwd = ref.sparse_attention_forward_ref(x["q"], x["kv"], x["attn_sink"], x["topk_idxs"], topk_length=ln)
    assert torch.equal(x["out"], fwd["out"].to(torch.bfloat16)) and torch.equal(x["lse"], fwd["lse"].float())
    # Logits O(1) at the default scale; the sink's share spread out.
    rows, ok = ref.resolve_slots(x["topk_idxs"], S_kv, ln)
    s = torch.einsum("ihd,itd->iht", x["q"].double(), x["kv"].double()[rows]) / math.sqrt(D)
    assert 0.5 < s.permute(0, 2, 1)[ok].std().item() < 2.0
    fin = torch.isfinite(x["lse"])
    p_sink = 1 / (1 + torch.exp(x["lse"].double() - x["attn_sink"].double()))[fin]
    assert p_sink.min() < 0.3 and p_sink.max() > 0.6
    # Explicit scale: logits still O(1); no topk_length when not asked for.
    z = ref.make_inputs(S_q, S_kv, H_, D, topk, seed=10, softmax_scale=0.2)
    assert z["topk_length"] is None and (z["topk_idxs"] >= 0).all() and z["softmax_scale"] == 0.2
    s = 0.2 * torch.einsum("ihd,itd->iht", z["q"].double(), z["kv"].double()[z["topk_idxs"].long()])
    assert 0.5 < s.std().item() < 2.0
    assert not torch.equal(z["q"], x["q"])


# ------------------------------------------------------------------------------------------------
# Bounds: a kernel-like fp32/bf16 computation passes them, a semantic slip does not
# ------------------------------------------------------------------------------------------------


def _kernel_like(x):
    """The kernels' rounding points: fp32 S / dP from bf16 operands, fp32 Delta from the bf16 out,
    log2-domain lse_tot and P in fp32, P and dS rounded to bf16 before their MMAs, fp32
    accumulation (dKV by fp32 atomics), bf16 dq / dkv, fp32 d_sink."""
    q, kv, do = x["q"].float(), x["kv"].float(), x["dout"].float()
    S_q, H_, D = q.shape
    Dv = do.shape[-1]
    scale = 1.0 / math.sqrt(D) if x["softmax_scale"] is None else x["softmax_scale"]
    log2e = math.log2(math.e)
    rows, valid = ref.resolve_slots(x["topk_idxs"], kv.shape[0], x["topk_length"])
    delta = (x["out"].float() * do).sum(-1)
    lse2, sink2 = x["lse"] * log2e, x["attn_sink"][None, :] * log2e
    m = torch.maximum(lse2, sink2)
    lse_tot2 = torch.where(torch.isinf(m), m, m + torch.log2(torch.exp2(lse2 - m) + torch.exp2(sink2 - m)))
    p_sink = torch.where(torch.isinf(x["lse"]), torch.zeros_like(lse2), 1 / (1 + torch.exp2(lse2 - sink2)))
    d_sink = -(p_sink * delta).sum(0)
    kg = kv[rows]  # (S_q, T, D)
    s = torch.einsum("ihd,itd->iht", q, kg)
    p = torch.where(valid[:, None, :], torch.exp2(s * (scale * log2e) - lse_tot2[..., None]), torch.zeros_like(s))
    dp = torch.einsum("ihc,itc->iht", do, kg[..., :Dv])
    ds = (p * (dp - delta[..., None]) * scale).bfloat16().float()
    pb = p.bfloat16().float()
    dq = torch.einsum("iht,itd->ihd", ds, kg)
    dkr = torch.einsum("iht,ihd->itd", ds, q)
    dkr[..., :Dv] += torch.einsum("iht,ihc->itc", pb, do)
    dkv = torch.zeros(kv.shape).index_add_(0, rows[valid], dkr[valid])
    return dict(dq=dq.bfloat16(), dkv=dkv.bfloat16(), d_sink=d_sink)


@pytest.mark.parametrize("D", [512, 576])
def test_bounds_admit_kernel_like_rounding_and_reject_slips(D):
    S_q, S_kv, H_, topk = 8, 1024, 64, 256  # the kernels' H=64 and real D
    x = ref.make_inputs(S_q, S_kv, H_, D, topk, with_topk_length=True, seed=21, invalid_frac=0.05)
    x["topk_length"] = torch.maximum(x["topk_length"], torch.tensor(topk // 2, dtype=torch.int32))
    fwd = ref.sparse_attention_forward_ref(x["q"], x["kv"], x["attn_sink"], x["topk_idxs"], topk_length=x["topk_length"])
    x = dict(x, out=fwd["out"].bfloat16(), lse=fwd["lse"].float())
    want = _ref_bwd(x)
    got = _kernel_like(x)
    for name in OUTS:
        err = ref.rel_err(got[name], want[name])
        assert err < ref.REL_ERR_BOUNDS[name] / 3, f"{name}: {err:.2e} leaves too little headroom"
    # Slips are far outside the bounds: sink dropped, length ignored, (D=576) wrong V columns / scale.
    mutants = ["no_sink", "ignore_topk_length"] + (["v_last_cols", "default_scale_dv"] if D == 576 else [])
    small = dict(x)  # the oracle is dense; a few rows suffice
    for k in ("q", "out", "dout", "lse", "topk_idxs", "topk_length"):
        small[k] = x[k][:3]
    base = _ref_bwd(small)
    for mutant in mutants:
        slip, _, _ = oracle_grads(small, mutant=mutant)
        worst = max(ref.rel_err(slip[n], base[n]) / ref.REL_ERR_BOUNDS[n] for n in OUTS)
        assert worst > 10, f"{mutant}: only {worst:.1f}x the bound"


@pytest.mark.parametrize("indexer_topk", [64, 128])
def test_forward_max_logits_and_lse_indexer_by_a_loop(indexer_topk):
    """max_logits and lse_indexer (the sparse attention forward's extra outputs) against a loop over
    rows and heads written from their definition, the snapshot rule included: a row whose slot count
    is at most indexer_topk - 64 never reaches it (+inf)."""
    s_kv = 300
    x = ref.make_inputs(6, s_kv, 2, 512, 192, with_topk_length=True, seed=5, invalid_frac=0.25)
    x["topk_length"][3] = 1000  # clamped to the 192 slots
    x["topk_length"][4] = indexer_topk - 64  # at the rule's edge: not reached
    x["topk_length"][5] = indexer_topk - 63  # one past: reached
    got = ref.sparse_attention_forward_ref(x["q"], x["kv"], x["attn_sink"], x["topk_idxs"], topk_length=x["topk_length"], indexer_topk=indexer_topk)
    q, kv, ids = x["q"].double(), x["kv"].double(), x["topk_idxs"].long()
    scale = 1 / math.sqrt(512)
    s_q, topk = ids.shape
    for i in range(s_q):
        n = min(max(int(x["topk_length"][i]), 0), topk)
        for hh in range(q.shape[1]):
            scores = [scale * float(q[i, hh] @ kv[int(ids[i, t])]) for t in range(n) if 0 <= int(ids[i, t]) < s_kv]
            first = [scale * float(q[i, hh] @ kv[int(ids[i, t])]) for t in range(min(n, indexer_topk)) if 0 <= int(ids[i, t]) < s_kv]
            want_max = max(scores) if scores else -math.inf
            want_ix = math.log(sum(math.exp(v) for v in first)) if first and n > indexer_topk - 64 else math.inf
            assert got["max_logits"][i, hh].item() == pytest.approx(want_max, rel=1e-12, abs=1e-12)
            assert got["lse_indexer"][i, hh].item() == pytest.approx(want_ix, rel=1e-12, abs=1e-12)
    assert torch.isinf(got["lse_indexer"][4]).all() and torch.isfinite(got["lse_indexer"][5]).any()
