"""The float64 sparse indexer score-recompute reference (tests/gpu/ref_score_recompute.py) against an
independent formulation (CPU, fast).

The reference masks whole (rows, topk) tensors, gathers the key rows of a chunk of rows at once and
writes its own max-subtracted softmax. The oracle below shares none of that: one query row at a time,
it lists the scored slots with Python ints (``j < topk_length`` with a length, ``id >= 0`` without),
stacks their key rows, takes ``w @ relu(q @ K^T)`` and ``torch.softmax`` over those slots alone, and
scatters the result into a zero row.

Mutated oracles (each a plausible implementation slip) must disagree with the reference on the same
inputs, which proves the inputs exercise what the agreement claims: dropping the ReLU or the weights,
the weights of another query row (a wrong (B, S_q, H) -> (B, H, S_q) transpose), a ``-1`` slot scored as
a zero key row instead of masked, the length ignored (masking by ``-1`` only, on inputs whose slots past
the length hold real ids) or off by one, and the batch offset of the ids dropped. A kernel-like
fp32/bf16 emulation calibrates ``REL_ERR_BOUNDS``.
"""

from __future__ import annotations

import math

import pytest
import torch

import ref_score_recompute as ref  # noqa: E402 - tests/gpu is on sys.path (tests/conftest.py)

TIGHT = 1e-12  # fp64 vs fp64, different association orders
H, DIM = 4, 16

# name -> make_inputs arguments: with and without a length, local and global ids, topk above S_k (rows
# see fewer keys than topk: padding), no invalid slot at all.
CASES = {
    "plain": dict(with_length=False, topk_indices_global=False, S_k=40, topk=32, invalid_frac=0.25),
    "plain-global": dict(with_length=False, topk_indices_global=True, S_k=40, topk=32, invalid_frac=0.25),
    "plain-short": dict(with_length=False, topk_indices_global=False, S_k=20, topk=32, invalid_frac=0.1),
    "plain-full": dict(with_length=False, topk_indices_global=False, S_k=40, topk=32, invalid_frac=0.0),
    "length": dict(with_length=True, topk_indices_global=False, S_k=40, topk=32, invalid_frac=0.25),
    "length-global": dict(with_length=True, topk_indices_global=True, S_k=40, topk=32, invalid_frac=0.25),
    "length-short": dict(with_length=True, topk_indices_global=True, S_k=20, topk=32, invalid_frac=0.1),
}
B, S_Q = 2, 6


def _inputs(name, seed=0, **over):
    kw = dict(CASES[name], **over)
    return ref.make_inputs(B, S_Q, kw.pop("S_k"), H, kw.pop("topk"), d=DIM, seed=seed, **kw)


def _global(name):
    return CASES[name]["topk_indices_global"]


# ------------------------------------------------------------------------------------------------
# The independent oracle
# ------------------------------------------------------------------------------------------------

MUTANTS = (
    "no_relu",  # relu dropped: negative head scores count
    "no_weights",  # every head weighted 1
    "weights_other_row",  # the weights of query row s + 1 (a transposed copy read with the wrong stride)
    "minus1_scored",  # a -1 slot (no length) scored as a zero key row (logit 0) instead of masked
    "no_length",  # the length ignored, slots masked by their id's sign only
    "length_plus_one",  # j <= topk_length scored
    "no_batch_offset",  # local ids read from batch 0's keys; global ids not decoded (out of range: a zero row)
)


def oracle(x, topk_indices_global=False, mutant=None):
    """float64 predict, one query row at a time."""
    q, k, w = x["q_indexer"].double(), x["k_indexer"].double(), x["weights"].double()
    ids, length = x["topk_indices"], x.get("topk_length")
    b_n, s_q, h, d = q.shape
    s_k, topk = k.shape[1], ids.shape[-1]
    out = torch.zeros(b_n, s_q, topk, dtype=torch.float64)
    flat_k = k.reshape(b_n * s_k, d)
    for b in range(b_n):
        for s in range(s_q):
            row = ids[b, s].tolist()
            n = None if length is None or mutant == "no_length" else int(length[b, s])
            slots = []
            for j, i in enumerate(row):
                if n is not None:
                    ok = j <= n if mutant == "length_plus_one" else j < n
                else:
                    ok = i >= 0 or mutant == "minus1_scored"
                if ok:
                    slots.append(j)
            if not slots:
                continue
            keys = []
            for j in slots:
                i = row[j]
                if mutant == "no_batch_offset":
                    local = i
                    key = flat_k[i] if (not topk_indices_global and 0 <= i < b_n * s_k) else (k[b, i] if 0 <= i < s_k else None)
                else:
                    local = i - b * s_k if topk_indices_global else i
                    key = k[b, local] if 0 <= local < s_k else None
                keys.append(key if key is not None else torch.zeros(d, dtype=torch.float64))
            kk = torch.stack(keys)  # (n, d)
            sc = q[b, s] @ kk.T  # (h, n)
            if mutant != "no_relu":
                sc = torch.relu(sc)
            wr = w[b, (s + 1) % s_q] if mutant == "weights_other_row" else w[b, s]
            if mutant == "no_weights":
                wr = torch.ones_like(wr)
            out[b, s, slots] = torch.softmax(wr @ sc, dim=0)
    return out


def _past_length(x, fill, seed=0):
    """A copy of x whose slots at and past topk_length hold ``fill`` ("ids": random ids of the row's batch;
    "junk": any int32, out of range and negative included) instead of -1."""
    ids = x["topk_indices"].clone()
    b_n, s_q, topk = ids.shape
    s_k = x["k_indexer"].shape[1]
    gen = torch.Generator().manual_seed(seed)
    if fill == "ids":
        new = torch.randint(s_k, ids.shape, generator=gen)
        if bool(ids.max() >= s_k):  # global ids
            new = new + (torch.arange(b_n) * s_k).view(b_n, 1, 1)
    else:
        new = torch.randint(-(2**31), 2**31 - 1, ids.shape, generator=gen)
    past = torch.arange(topk)[None, None, :] >= x["topk_length"][..., None].long()
    return dict(x, topk_indices=torch.where(past, new.to(torch.int32), ids).contiguous())


# ------------------------------------------------------------------------------------------------
# Agreement
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_the_oracle(case, seed):
    x = _inputs(case, seed)
    got = ref.reference(x, _global(case))
    assert got.dtype == torch.float64 and got.shape == x["topk_indices"].shape
    err = ref.rel_err(got, oracle(x, _global(case)))
    assert err < TIGHT, f"rel err {err:.3e}"
    scored = ref.scored_mask(x["topk_indices"], x["topk_length"])
    assert (got[~scored] == 0).all(), "a slot that is not scored must be exactly 0"
    sums = got.sum(-1)
    has = scored.any(-1)
    torch.testing.assert_close(sums[has], torch.ones_like(sums[has]), rtol=0, atol=1e-12)
    assert (sums[~has] == 0).all()
    if CASES[case]["invalid_frac"] > 0:
        assert not has[0, 0] and (got[0, 0] == 0).all(), "edge row (0, 0): nothing scored"
        assert scored[0, 1].sum() == 1 and got[0, 1].max() == 1.0, "edge row (0, 1): one slot, predict 1"
    many = scored.sum(-1) >= 4
    lo = torch.where(scored, got, math.inf).amin(-1)
    assert (got.amax(-1) / lo)[many].median() > 10, "predict far from uniform (max / min over a row's slots)"


def test_ids_past_the_length_are_never_read():
    for case in ("length", "length-global", "length-short"):
        x = _inputs(case, 2)
        want = ref.reference(x, _global(case))
        for fill in ("ids", "junk"):
            y = _past_length(x, fill, seed=3)
            assert not torch.equal(y["topk_indices"], x["topk_indices"])
            assert torch.equal(ref.reference(y, _global(case)), want), f"{case} {fill}"


def test_every_negative_id_is_masked_without_a_length():
    for case in ("plain", "plain-global"):
        x = _inputs(case, 4)
        want = ref.reference(x, _global(case))
        for v in (-2, -(2**31)):
            ids = torch.where(x["topk_indices"] < 0, torch.tensor(v, dtype=torch.int32), x["topk_indices"])
            assert torch.equal(ref.reference(dict(x, topk_indices=ids), _global(case)), want), v


def test_global_ids_are_local_ids_plus_the_batch_offset():
    for length in (False, True):
        xl = ref.make_inputs(3, 4, 30, H, 24, d=DIM, with_length=length, topk_indices_global=False, invalid_frac=0.2, seed=5)
        xg = ref.make_inputs(3, 4, 30, H, 24, d=DIM, with_length=length, topk_indices_global=True, invalid_frac=0.2, seed=5)
        off = (torch.arange(3) * 30).view(3, 1, 1).to(torch.int32)
        assert torch.equal(xg["topk_indices"], torch.where(xl["topk_indices"] >= 0, xl["topk_indices"] + off, -1))
        assert torch.equal(ref.reference(xg, True), ref.reference(xl, False))


def test_a_negative_length_scores_nothing():
    x = _inputs("length", 6)
    ln = x["topk_length"].clone()
    ln[1, 2] = -5
    got = ref.reference(dict(x, topk_length=ln))
    assert (got[1, 2] == 0).all()
    want = ref.reference(x)
    keep = torch.ones(B, S_Q, dtype=torch.bool)
    keep[1, 2] = False
    assert torch.equal(got[keep], want[keep])


# ------------------------------------------------------------------------------------------------
# Mutants: the comparison fails when a semantic detail is dropped
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mutant", MUTANTS)
@pytest.mark.parametrize("case", ["plain", "plain-global", "length", "length-global", "length-short"])
def test_comparison_detects_mutants(case, mutant):
    length = CASES[case]["with_length"]
    if mutant in ("no_length", "length_plus_one") and not length:
        pytest.skip("no length to drop")
    if mutant == "minus1_scored" and length:
        pytest.skip("with a length no -1 slot is scored")
    x = _inputs(case, 1)
    if length:
        x = _past_length(x, "ids", seed=1)  # real ids past the length: masking by the sign alone keeps them
    want = ref.reference(x, _global(case))
    err = ref.rel_err(oracle(x, _global(case), mutant), want)
    assert err > 1e-2, f"mutant {mutant} not detected (rel err {err:.2e})"


# ------------------------------------------------------------------------------------------------
# Contract, chunking, generator
# ------------------------------------------------------------------------------------------------


def test_inputs_outside_the_contract_are_refused():
    x = _inputs("length", 7)
    ids, ln = x["topk_indices"].clone(), x["topk_length"]
    b, s = 1, 3
    assert ln[b, s] > 0
    ids[b, s, 0] = -1  # a -1 before the length
    with pytest.raises(ValueError, match="not a key row"):
        ref.reference(dict(x, topk_indices=ids))
    too_long = ln.clone()
    too_long[0, 2] = ids.shape[-1] + 1
    with pytest.raises(ValueError, match="topk_length"):
        ref.reference(dict(x, topk_length=too_long))
    y = _inputs("plain", 7)
    ids = y["topk_indices"].clone()
    j = int((ids[1, 2] >= 0).nonzero()[0])
    ids[1, 2, j] = y["k_indexer"].shape[1]  # one past the batch's keys
    with pytest.raises(ValueError, match="not a key row"):
        ref.reference(dict(y, topk_indices=ids))
    g = _inputs("plain-global", 7)
    ids = g["topk_indices"].clone()
    j = int((ids[1, 2] >= 0).nonzero()[0])
    ids[1, 2, j] = 3  # a key row of batch 0 in batch 1
    with pytest.raises(ValueError, match="not a key row"):
        ref.reference(dict(g, topk_indices=ids), True)
    with pytest.raises(ValueError, match="not a key row"):  # global ids read as local ones: batch 1's are past S_k
        ref.reference(g, False)


def test_shape_contract_is_enforced():
    x = _inputs("length", 0)
    with pytest.raises(ValueError, match="w "):
        ref.reference(dict(x, weights=x["weights"][..., :-1]))
    with pytest.raises(ValueError, match="topk_length"):
        ref.reference(dict(x, topk_length=x["topk_length"][:, :-1]))
    with pytest.raises(ValueError, match="topk_indices"):
        ref.reference(dict(x, topk_indices=x["topk_indices"][:, :-1]))
    with pytest.raises(ValueError, match="k "):
        ref.reference(dict(x, k_indexer=x["k_indexer"][..., :-1]))
    with pytest.raises(ValueError, match="dtype"):
        ref.reference(dict(x, topk_indices=x["topk_indices"].float()))


def test_inputs_are_not_modified_and_chunking_is_invisible():
    x = _inputs("plain-global", 8)
    before = {k: v.clone() for k, v in x.items() if v is not None}
    whole = ref.reference(x, True)
    for k, v in before.items():
        assert torch.equal(x[k], v), f"{k} was modified"
    chunked = ref.sparse_indexer_predict_ref(x["q_indexer"], x["k_indexer"], x["weights"], x["topk_indices"], None, True,
                                             max_chunk_elems=3 * 32 * DIM)  # 3 rows per chunk
    assert ref.rel_err(chunked, whole) < 1e-15


@pytest.mark.parametrize("case", list(CASES))
def test_make_inputs(case):
    x, y = _inputs(case, 9), _inputs(case, 9)
    for k in x:
        assert (x[k] is None and y[k] is None) or torch.equal(x[k], y[k]), f"{k} not reproducible from the seed"
    assert not torch.equal(_inputs(case, 10)["q_indexer"], x["q_indexer"])
    kw = CASES[case]
    s_k, topk = kw["S_k"], kw["topk"]
    assert x["q_indexer"].shape == (B, S_Q, H, DIM) and x["k_indexer"].shape == (B, s_k, DIM) and x["weights"].shape == (B, S_Q, H)
    assert x["q_indexer"].dtype == x["k_indexer"].dtype == x["weights"].dtype == torch.bfloat16
    ids = x["topk_indices"]
    assert ids.dtype == torch.int32 and ids.shape == (B, S_Q, topk) and ids.is_contiguous()
    assert (ids >= -1).all()
    local = torch.where(ids >= 0, ids.long() - ((torch.arange(B) * s_k).view(B, 1, 1) if kw["topk_indices_global"] else 0), 0)
    assert ((local >= 0) & (local < s_k)).all(), "every id a key row of its own batch"
    for b in range(B):
        for s in range(S_Q):
            row = ids[b, s][ids[b, s] >= 0].tolist()
            assert len(set(row)) == len(row), "distinct ids"
            assert len(row) <= min(topk, s_k)
    ln = x["topk_length"]
    if kw["with_length"]:
        assert ln.dtype == torch.int32 and ln.shape == (B, S_Q) and ln.is_contiguous()
        pos = torch.arange(topk)[None, None, :]
        assert torch.equal(ids >= 0, pos < ln[..., None].long()), "compact: ids before the length, -1 at and past it"
    else:
        assert ln is None
    n = (ids >= 0).sum(-1)
    if kw["invalid_frac"] > 0:
        assert n[0, 0] == 0 and n[0, 1] == 1 and n[-1, -1] == min(topk, s_k), "edge rows"
        assert (n < min(topk, s_k)).sum() > 2, "some invalid slots beyond the edge rows"
    else:
        assert (n == min(topk, s_k)).all()
    logits = torch.log(ref.reference(x, kw["topk_indices_global"]).clamp_min(1e-300))
    has = n > 1
    spread = torch.stack([logits[b, s][ids[b, s] >= 0].std() for b, s in has.nonzero().tolist()])
    assert 0.5 < spread.median() < 4.0, f"logit spread {spread.median():.2f} (weights N(0,1)*3/sqrt(H))"


def test_make_inputs_refuses_what_it_cannot_make():
    with pytest.raises(ValueError, match="invalid_frac"):
        ref.make_inputs(1, 2, 8, H, 8, invalid_frac=1.0)
    with pytest.raises(ValueError, match="S_k"):
        ref.make_inputs(1, 2, 0, H, 8)


# ------------------------------------------------------------------------------------------------
# Bounds: a kernel-like fp32 computation passes them, a semantic slip does not
# ------------------------------------------------------------------------------------------------


_TRUNC = ~((1 << 29) - 1)  # float64 keeps 29 mantissa bits more than float32


def _round_toward_zero(exact):
    """The float64 ``exact`` rounded toward zero to fp32 precision (a truncating adder), kept as float64:
    the low 29 mantissa bits cleared (sign-magnitude, so toward zero); exact in fp32's normal range."""
    return (exact.view(torch.int64) & _TRUNC).view(torch.float64)


def _kernel_like(x, topk_indices_global, rounding="rn", seed=0):
    """The kernels' rounding points, fp32 from the bf16 inputs.

    ``rn``: QK accumulated in order over D with round-to-nearest, the head reduce as SM100's (products
    and sums rounded separately, two interleaved partial sums), fp32 pairwise sums in the softmax.
    ``rz``: QK accumulated with round-toward-zero (a pessimistic tensor-core adder), the head reduce as
    SM90's (fused multiply-add over 16 heads per thread, then a 4-way reduce), a sequential softmax sum,
    SM90's ``1 / (sum + 1e-10)``. Both: ``exp`` through ``exp2((x - m) * log2 e)`` with the argument
    rounded to fp32 and the result perturbed by up to 2 ulp (``ex2.approx``)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, w = x["q_indexer"].float(), x["k_indexer"].float(), x["weights"].float()
    ids, length = x["topk_indices"].long(), x["topk_length"]
    b_n, s_q, h, d = q.shape
    s_k, topk = k.shape[1], ids.shape[-1]
    scored = ref.scored_mask(ids, length)
    base = (torch.arange(b_n) * s_k).view(b_n, 1, 1)
    local = ids - base if topk_indices_global else ids
    flat = torch.where(scored, local + base, 0)
    kg = k.reshape(b_n * s_k, d)[flat]  # (B, S_q, topk, D) fp32 (exact bf16)
    kg = torch.where(scored[..., None], kg, 0.0)
    rows = b_n * s_q
    qd = q.reshape(rows, h, d).permute(2, 0, 1).unsqueeze(-1).contiguous()  # (D, rows, H, 1): one step a slice
    kd = kg.reshape(rows, topk, d).permute(2, 0, 1).unsqueeze(-2).contiguous()  # (D, rows, 1, topk)
    acc = torch.zeros(rows, h, topk, dtype=torch.float32 if rounding == "rn" else torch.float64)
    for i in range(d):  # bf16 x bf16 products are exact in fp32, fp32 + fp32 sums exact in fp64
        prod = torch.bmm(qd[i], kd[i])  # the outer product: no sum, exact
        acc = acc + prod if rounding == "rn" else _round_toward_zero(acc + prod.double())
    acc = acc.float().view(b_n, s_q, h, topk)
    r = acc.clamp_min(0.0)
    if rounding == "rn":
        parts = torch.zeros(2, b_n, s_q, topk)
        for hh in range(h):
            parts[hh % 2] = parts[hh % 2] + r[:, :, hh] * w[:, :, hh, None]
        logit = parts[0] + parts[1]
    else:
        per = h // 4
        parts = torch.zeros(4, b_n, s_q, topk)
        for hh in range(h):
            t = hh // per
            parts[t] = (parts[t].double() + r[:, :, hh].double() * w[:, :, hh, None].double()).float()
        logit = (parts[0] + parts[1]) + (parts[2] + parts[3])
    xm = torch.where(scored, logit, -math.inf)
    m = xm.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    arg = (xm - m) * torch.tensor(math.log2(math.e), dtype=torch.float32)
    e = torch.exp2(arg.double()).float()
    e = e * (1 + (2 * torch.rand(e.shape, generator=gen) - 1) * 2.0**-22).float()
    if rounding == "rn":
        tot = e.sum(-1, keepdim=True)
        inv = torch.where(tot > 0, 1.0 / tot, 0.0)
    else:
        tot = e.cumsum(-1)[..., -1:]
        inv = 1.0 / (tot + torch.tensor(1e-10, dtype=torch.float32))
    return torch.where(scored, e * inv, 0.0)


def test_bounds_admit_kernel_like_rounding_and_reject_slips():
    # the kernels' H and D, the largest shipped topk, rows that see fewer keys than topk among them
    bound = ref.REL_ERR_BOUNDS["predict"]
    for length, glob, s_k in ((False, False, 4096), (True, True, 1500)):
        x = ref.make_inputs(2, 3, s_k, 64, 2048, with_length=length, topk_indices_global=glob, invalid_frac=0.1, seed=21)
        want = ref.reference(x, glob)
        for rounding in ("rn", "rz"):
            err = ref.rel_err(_kernel_like(x, glob, rounding), want)
            assert err < bound / 10, f"{rounding} length {length}: {err:.2e} leaves too little headroom"
        y = _past_length(x, "ids") if length else x
        for mutant in ("no_relu", "weights_other_row", "no_length" if length else "minus1_scored"):
            err = ref.rel_err(oracle(y, glob, mutant), want)
            assert err > 100 * bound, f"{mutant}: {err:.2e}"


# ------------------------------------------------------------------------------------------------
# The attention target (sparse_attn_target_ref): its own oracle, one row and one head at a time
# ------------------------------------------------------------------------------------------------

ATTN_MUTANTS = (
    "no_lse",  # the forward's LSE ignored: exp(scale * s) summed over heads
    "no_scale",  # exp(s - lse)
    "softmax_not_l1",  # the indexer's softmax over the head-summed probabilities instead of an L1 norm
    "lse_other_head",  # the LSE of head h + 1 (a transposed copy read with the wrong stride)
    "minus1_scored",  # a -1 slot (no length) scored as a zero key row instead of masked
    "no_length",  # the length ignored, slots masked by their id's sign only
)


def attn_oracle(x, topk_indices_global=False, mutant=None):
    """float64 target: per row, per head, the probabilities exp(scale q.k - lse) of the scored slots."""
    q, k, lse, scale = x["q_attn"].double(), x["k_attn"].double(), x["lse"].double(), x["softmax_scale"]
    ids, length = x["topk_indices"], x.get("topk_length")
    b_n, s_q, h, d = q.shape
    s_k, topk = k.shape[1], ids.shape[-1]
    out = torch.zeros(b_n, s_q, topk, dtype=torch.float64)
    for b in range(b_n):
        for s in range(s_q):
            row = ids[b, s].tolist()
            n = None if length is None or mutant == "no_length" else int(length[b, s])
            p = torch.zeros(topk, dtype=torch.float64)
            for j, i in enumerate(row):
                if not (j < n if n is not None else (i >= 0 or mutant == "minus1_scored")):
                    continue
                local = i - b * s_k if topk_indices_global else i
                key = k[b, local] if 0 <= local < s_k else torch.zeros(d, dtype=torch.float64)
                for hh in range(h):
                    logit = q[b, s, hh] @ key * (1.0 if mutant == "no_scale" else scale)
                    m = 0.0 if mutant == "no_lse" else float(lse[b, s, (hh + 1) % h if mutant == "lse_other_head" else hh])
                    p[j] += math.exp(float(logit) - m)
            if mutant == "softmax_not_l1":
                nz = p > 0
                if bool(nz.any()):
                    p[nz] = torch.softmax(p[nz], dim=0)
            elif float(p.sum()) > 0:
                p = p / p.sum()
            out[b, s] = p
    return out


def _attn_inputs(name, seed=0):
    kw = dict(CASES[name])
    return ref.make_attention_inputs(B, S_Q, kw.pop("S_k"), H, kw.pop("topk"), d=DIM, seed=seed, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_attention_reference_matches_its_oracle(case):
    x = _attn_inputs(case, seed=3)
    got = ref.attention_reference(x, _global(case))
    want = attn_oracle(x, _global(case))
    assert torch.allclose(got, want, rtol=TIGHT, atol=TIGHT)
    rows = got.sum(-1)
    assert bool(((rows - 1).abs() < 1e-12).logical_or(rows == 0).all()), "each row is an L1-normalised distribution or all 0"
    assert bool((rows == 0).any()) == (CASES[case]["invalid_frac"] > 0), "the edge row without a scored slot is all 0"


@pytest.mark.parametrize("mutant", ATTN_MUTANTS)
@pytest.mark.parametrize("case", ["plain", "plain-global", "length", "length-global"])
def test_attention_comparison_detects_mutants(case, mutant):
    x = _attn_inputs(case, seed=4)
    if mutant == "no_length" and x.get("topk_length") is None:
        pytest.skip("no length to ignore")
    if mutant == "minus1_scored" and x.get("topk_length") is not None:
        pytest.skip("with a length the ids are not read")
    if mutant == "no_length":
        x = _past_length(dict(x, k_indexer=x["k_attn"]), "ids")
    got = ref.attention_reference(x, _global(case))
    assert ref.rel_err(got, attn_oracle(x, _global(case), mutant)) > 100 * ref.REL_ERR_BOUNDS["target"], mutant


def test_attention_lse_is_the_forwards_per_head_log_sum_exp():
    x = _attn_inputs("length", seed=5)
    x0 = ref.make_attention_inputs(B, S_Q, 40, H, 32, d=DIM, seed=5, with_length=True, invalid_frac=0.25, lse_jitter=0.0)
    # without jitter every head's probabilities over the scored slots sum to 1: the target is their mean
    q, k, ids, n = x0["q_attn"].double(), x0["k_attn"].double(), x0["topk_indices"], x0["topk_length"]
    b, s = 1, 2
    keys = k[b, ids[b, s, : int(n[b, s])].long()]
    p = torch.softmax(x0["softmax_scale"] * q[b, s] @ keys.T, dim=-1)
    assert torch.allclose(ref.attention_reference(x0)[b, s, : int(n[b, s])], p.mean(0), rtol=1e-6, atol=1e-9)
    assert not torch.equal(x["lse"], x0["lse"])


# ------------------------------------------------------------------------------------------------
# The dense attention's scores: a loop oracle and mutants
# ------------------------------------------------------------------------------------------------


def _dense_oracle(q, k, lse, scale, ratio, offs, mutant=None):
    B, S_q, H, D = q.shape
    S_k = k.shape[1]
    out = torch.full((B, S_q, S_k), -math.inf, dtype=torch.float64)
    den = torch.zeros(B, S_q, dtype=torch.float64)
    for b in range(B):
        off = 0 if offs is None else int(offs[b])
        for i in range(S_q):
            limit = (off + i + 1) // ratio + (1 if mutant == "limit_plus_one" else 0)
            for j in range(min(limit, S_k)):
                v = sum(math.exp(scale * float(q[b, i, h].double() @ k[b, j, 0].double()) - (0.0 if mutant == "no_lse" else float(lse[b, i, h])))
                        for h in range(H))
                out[b, i, j] = v
                den[b, i] += v
    if mutant == "normalised":
        out = torch.where(torch.isfinite(out), out / den.clamp_min(1e-300)[..., None], out)
    return out, den


@pytest.mark.parametrize("ratio,offsets", [(1, False), (4, True)])
def test_dense_attention_reference_matches_its_oracle_and_catches_mutants(ratio, offsets):
    offs = torch.tensor([0, 5], dtype=torch.int32) if offsets else None
    q, k, lse, scale = ref.make_dense_attn_inputs(2, 9, 7, 3, 16, ratio, offs, seed=11)
    got, den = ref.dense_attn_ref(q, k, lse, scale, ratio, offs)
    want, want_den = _dense_oracle(q, k, lse, scale, ratio, offs)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], rtol=TIGHT, atol=TIGHT) and torch.allclose(den, want_den, rtol=TIGHT, atol=TIGHT)
    assert bool((den == 0).any()) == (ratio > 1), "rows that see no key (ratio 4: the first three) sum to 0"
    for mutant in ("no_lse", "normalised", "limit_plus_one"):
        m, md = _dense_oracle(q, k, lse, scale, ratio, offs, mutant)
        differs = not torch.equal(torch.isinf(m), torch.isinf(got)) or ref.rel_err(got[fin], m[fin]) > 1e-3 or ref.rel_err(den, md) > 1e-3
        assert differs, mutant
