"""The float64 CSA reference (tests/gpu/ref_csa.py) against a dead-simple per-row loop (CPU, fast).

The loop below restates the window from the math in plain Python floats, skipping the invalid
previous half instead of masking it with -inf, so it shares no code and no formulation with the
vectorised gather reference. Mutated variants of the loop (each a plausible implementation mistake)
must disagree with the reference on the same inputs: that proves the inputs exercise every
semantic detail the agreement test claims to check. The backward is checked against central finite
differences of the loop, and the GPU tolerance table against an fp32-intermediate computation.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch




import ref_csa as ref  # noqa: E402 - tests/gpu is on sys.path (tests/conftest.py)


# ------------------------------------------------------------------------------------------------
# The loop reference
# ------------------------------------------------------------------------------------------------

MUTANTS = (
    "first_block_prev_valid",  # coff 2: previous half of a segment's first block treated as valid
    "prev_half_second_cols",  # coff 2: previous half reads the second-half columns
    "own_ape_first_cols",  # coff 2: own half adds APE from the first-half columns
    "ape_row_shift",  # APE row (k + 1) % ratio instead of k % ratio
    "global_blocks",  # row b starts at token b * ratio, ignoring segments
    "padding_rows_zero",  # padding rows left as zeros instead of computed from token 0
)


def loop_forward(KV, S, A, cu, cuc, ratio, coff, d, total_comp, mutant=None, consumed=None):
    """Per-row, per-column loop over Python lists. ``consumed`` (a set) collects (token, col) reads
    of real rows."""
    nb_valid = cuc[-1]
    out = []
    for b in range(total_comp):
        if b < nb_valid:
            segs = [s for s in range(len(cu) - 1) if cuc[s] <= b < cuc[s + 1]]
            assert len(segs) == 1
            s = segs[0]
            i = b - cuc[s]
            t0 = cu[s] + i * ratio
            if mutant == "global_blocks":
                i, t0 = b, b * ratio
        else:
            if mutant == "padding_rows_zero":
                out.append([0.0] * d)
                continue
            i, t0 = 0, cu[0]
        row = []
        for j in range(d):
            logits, vals = [], []

            def take(t, col, ape_row, ape_col):
                if mutant == "ape_row_shift":
                    ape_row = (ape_row + 1) % ratio
                logits.append(S[t][col] + A[ape_row][ape_col])
                vals.append(KV[t][col])
                if consumed is not None and b < nb_valid:
                    consumed.add((t, col))

            if coff == 1:
                for k in range(ratio):
                    take(t0 + k, j, k, j)
            else:
                prev_valid = i > 0 or (mutant == "first_block_prev_valid" and t0 >= ratio)
                if prev_valid:  # the previous block's half-window: skipped (not -inf) when invalid
                    for k in range(ratio):
                        col = d + j if mutant == "prev_half_second_cols" else j
                        take(t0 - ratio + k, col, k, col)
                for k in range(ratio):
                    ape_col = j if mutant == "own_ape_first_cols" else d + j
                    take(t0 + k, d + j, k, ape_col)
            m = max(logits)
            e = [math.exp(x - m) for x in logits]
            z = sum(e)
            row.append(sum(v * w / z for v, w in zip(vals, e)))
        out.append(row)
    return out


def _lists(x):
    return x["kv"].double().tolist(), x["score"].double().tolist(), x["ape"].double().tolist()


def _case(ratio, coff, d, n_blocks, seed, pad_rows=2, pad_tokens=1, empty=True, n_segments=None):
    gen = torch.Generator().manual_seed(seed)
    cu, cuc = ref.random_segments(ratio, n_blocks, gen, n_segments=n_segments, short=True, empty=empty)
    x = ref.random_inputs(cu, cuc, ratio, coff, d, gen, pad_rows=pad_rows, pad_tokens=pad_tokens)
    x["cu"], x["cuc"] = cu, cuc
    return x


CONFIGS = [(ratio, coff) for ratio in (2, 4) for coff in (1, 2)]


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("ratio,coff", CONFIGS)
def test_forward_matches_loop(ratio, coff, seed):
    x = _case(ratio, coff, 3, n_blocks=7, seed=100 * ratio + 10 * coff + seed, n_segments=3)
    assert len(x["cu"]) - 1 >= 4, "expect 3 long segments plus a short and an empty one"
    assert any(0 < x["cu"][s + 1] - x["cu"][s] < ratio for s in range(len(x["cu"]) - 1)), "expect a segment shorter than ratio"
    assert x["total_comp"] > x["cuc"][-1], "expect padding rows"
    got = ref.csa_forward_ref(x["kv"], x["score"], x["ape"], x["cu_seqlens"], x["cu_seqlens_comp"], ratio, coff, None, x["total_comp"])
    want = torch.tensor(loop_forward(*_lists(x), x["cu"], x["cuc"], ratio, coff, 3, x["total_comp"]), dtype=torch.float64)
    assert got.dtype == torch.float64 and got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= 1e-12, f"vectorised reference differs from the loop by {err}"


@pytest.mark.parametrize("mutant", MUTANTS)
@pytest.mark.parametrize("ratio,coff", CONFIGS)
def test_loop_comparison_detects_mutants(ratio, coff, mutant):
    """Each plausible mistake changes the output on these inputs by far more than the 1e-12 above."""
    if coff == 1 and mutant in ("first_block_prev_valid", "prev_half_second_cols", "own_ape_first_cols"):
        pytest.skip("coff 1 has no previous half-window / second-half columns")
    x = _case(ratio, coff, 3, n_blocks=7, seed=7 + ratio + coff, n_segments=3)
    got = ref.csa_forward_ref(x["kv"], x["score"], x["ape"], x["cu"], x["cuc"], ratio, coff, None, x["total_comp"])
    bad = torch.tensor(loop_forward(*_lists(x), x["cu"], x["cuc"], ratio, coff, 3, x["total_comp"], mutant=mutant), dtype=torch.float64)
    assert (got - bad).abs().max().item() > 1e-3, f"mutant {mutant} is indistinguishable from the reference"


def test_padding_rows_use_first_in_segment_semantics():
    """Padding rows equal the first block of a segment starting at token 0, for both coff."""
    for coff in (1, 2):
        x = _case(4, coff, 5, n_blocks=6, seed=11 + coff, pad_rows=3, empty=False)
        out = ref.csa_forward_ref(x["kv"], x["score"], x["ape"], x["cu"], x["cuc"], 4, coff, None, x["total_comp"])
        one = ref.csa_forward_ref(x["kv"][:4], x["score"][:4], x["ape"], [0, 4], [0, 1], 4, coff, None, 1)
        nb = x["cuc"][-1]
        for b in range(nb, x["total_comp"]):
            assert torch.equal(out[b], one[0]), f"padding row {b} (coff={coff}) differs from the first block at token 0"


def test_chunking_is_invisible():
    x = _case(4, 2, 6, n_blocks=9, seed=5)
    args = (x["kv"], x["score"], x["ape"], x["cu"], x["cuc"], 4, 2)
    a = ref.csa_forward_ref(*args, None, x["total_comp"])
    b = ref.csa_forward_ref(*args, None, x["total_comp"], max_chunk_elems=1)  # one row per chunk
    assert (a - b).abs().max().item() <= 1e-13
    ga = ref.csa_backward_ref(*args[:5], x["grad_out"], 4, 2)
    gb = ref.csa_backward_ref(*args[:5], x["grad_out"], 4, 2, max_chunk_elems=1)
    for u, v in zip(ga, gb):
        assert (u - v).abs().max().item() <= 1e-12


def test_input_contract_is_enforced():
    x = _case(4, 2, 3, n_blocks=3, seed=1)
    bad_cuc = list(x["cuc"])
    bad_cuc[-1] += 1  # one block more than the last segment's seqlen // ratio
    with pytest.raises(ValueError, match="blocks for"):
        ref.csa_forward_ref(x["kv"], x["score"], x["ape"], x["cu"], bad_cuc, 4, 2)
    with pytest.raises(ValueError, match="total_comp"):
        ref.csa_forward_ref(x["kv"], x["score"], x["ape"], x["cu"], x["cuc"], 4, 2, None, x["cuc"][-1] - 1)
    with pytest.raises(ValueError, match="ape shape"):
        ref.csa_forward_ref(x["kv"], x["score"], x["ape"][:2], x["cu"], x["cuc"], 4, 2)


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------


def _fd_grads(x, ratio, coff, d, h=1e-5):
    """Central finite differences of L = sum_{real rows b, j} grad_out[b, j] * loop_out[b, j]."""
    KV, S, A = _lists(x)
    go = x["grad_out"].double().tolist()
    nb = x["cuc"][-1]

    def loss():
        out = loop_forward(KV, S, A, x["cu"], x["cuc"], ratio, coff, d, nb)
        return sum(go[b][j] * out[b][j] for b in range(nb) for j in range(d))

    grads = []
    for M in (KV, S, A):
        g = [[0.0] * len(M[0]) for _ in M]
        for r in range(len(M)):
            for c in range(len(M[0])):
                v = M[r][c]
                M[r][c] = v + h
                lp = loss()
                M[r][c] = v - h
                lm = loss()
                M[r][c] = v
                g[r][c] = (lp - lm) / (2 * h)
        grads.append(torch.tensor(g, dtype=torch.float64))
    return grads


@pytest.mark.parametrize("ratio,coff", CONFIGS)
def test_backward_matches_finite_differences(ratio, coff):
    d = 2
    x = _case(ratio, coff, d, n_blocks=4, seed=31 + 3 * ratio + coff, n_segments=2)
    got = ref.csa_backward_ref(x["kv"], x["score"], x["ape"], x["cu_seqlens"], x["cu_seqlens_comp"], x["grad_out"], ratio, coff)
    want = _fd_grads(x, ratio, coff, d)
    for name, g, w in zip(("grad_kv", "grad_score", "grad_ape"), got, want):
        assert g.dtype == torch.float64 and g.shape == w.shape, name
        err = (g - w).abs().max().item()
        assert err <= 1e-7, f"{name}: autograd reference differs from finite differences by {err}"
        assert w.abs().max().item() > 1e-2, f"{name}: degenerate case (all gradients ~0)"


@pytest.mark.parametrize("ratio,coff", CONFIGS)
def test_padding_row_gradients_are_ignored(ratio, coff):
    x = _case(ratio, coff, 4, n_blocks=5, seed=3 + ratio + coff, pad_rows=3)
    args = (x["kv"], x["score"], x["ape"], x["cu"], x["cuc"])
    a = ref.csa_backward_ref(*args, x["grad_out"], ratio, coff)
    go2 = x["grad_out"].clone()
    go2[x["cuc"][-1] :] = 1e3 * torch.randn_like(go2[x["cuc"][-1] :].float()).to(go2.dtype)
    b = ref.csa_backward_ref(*args, go2, ratio, coff)
    for u, v in zip(a, b):
        assert torch.equal(u, v), "grad_out on padding rows changed the gradients"
    # ... while grad_out on a real row does change them (the assertion above can fail).
    go3 = x["grad_out"].clone()
    go3[0] += 1
    c = ref.csa_backward_ref(*args, go3, ratio, coff)
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("ratio,coff", CONFIGS + [(128, 1), (128, 2)])
def test_consumed_mask_and_exact_zeros(ratio, coff):
    d = 3
    x = _case(ratio, coff, d, n_blocks=5, seed=17 + ratio + coff, pad_rows=2, pad_tokens=2, n_segments=3)
    T = x["kv"].shape[0]
    consumed = set()
    loop_forward(*_lists(x), x["cu"], x["cuc"], ratio, coff, d, x["total_comp"], consumed=consumed)
    mask = ref.csa_consumed_mask(x["cu"], x["cuc"], ratio, coff, d, T)
    want = torch.zeros(T, coff * d, dtype=torch.bool)
    for t, c in consumed:
        want[t, c] = True
    assert torch.equal(mask, want), "csa_consumed_mask disagrees with the positions the loop reads"
    assert (~mask).any() and mask.any()
    gkv, gs, _ = ref.csa_backward_ref(x["kv"], x["score"], x["ape"], x["cu"], x["cuc"], x["grad_out"], ratio, coff)
    for name, g in (("grad_kv", gkv), ("grad_score", gs)):
        assert bool((g[~mask] == 0).all()), f"{name}: nonzero at a never-consumed position"
        assert bool((g[mask] != 0).all()), f"{name}: zero at a consumed position (degenerate inputs?)"


def test_total_comp_zero():
    gen = torch.Generator().manual_seed(0)
    x = ref.random_inputs([0, 3, 3, 6], [0, 0, 0, 0], 4, 2, 8, gen)
    assert x["total_comp"] == 0
    out = ref.csa_forward_ref(x["kv"], x["score"], x["ape"], x["cu_seqlens"], x["cu_seqlens_comp"], 4, 2)
    assert out.shape == (0, 8)
    g = ref.csa_backward_ref(x["kv"], x["score"], x["ape"], x["cu_seqlens"], x["cu_seqlens_comp"], x["grad_out"], 4, 2)
    for t, like in zip(g, (x["kv"], x["score"], x["ape"])):
        assert t.shape == like.shape and t.dtype == torch.float64 and bool((t == 0).all())


# ------------------------------------------------------------------------------------------------
# Tolerance table of tests/gpu/test_csa_ops.py: attainable by fp32 arithmetic, and able to fail.
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ops_tests(pytestconfig):
    # The GPU module marks itself `gpu`; register the marker (tests/gpu/conftest.py is not loaded
    # when only tests/unit is collected) so --strict-markers accepts the import.
    pytestconfig.addinivalue_line("markers", "gpu: needs a CUDA GPU")
    return importlib.import_module("test_csa_ops")


@pytest.mark.parametrize("ratio,coff,d,n_blocks", [(4, 2, 32, 400), (2, 1, 16, 300), (128, 2, 16, 48), (128, 1, 32, 40)])
def test_tolerances_admit_fp32_arithmetic(ops_tests, ratio, coff, d, n_blocks):
    """fp32-intermediate eager results (+ the kernels' final bf16 rounding) pass the GPU table with margin."""
    x = _case(ratio, coff, d, n_blocks=n_blocks, seed=ratio * 1000 + d, pad_rows=3)
    args = (x["kv"], x["score"], x["ape"], x["cu"], x["cuc"], ratio, coff)
    tol = ops_tests.TOLERANCES
    out64 = ref.csa_forward_ref(*args, None, x["total_comp"])
    out32 = ref.csa_forward_ref(*args, None, x["total_comp"], compute_dtype=torch.float32)
    rep = ops_tests.compare(out32.to(torch.bfloat16), out64, torch.bfloat16)
    assert rep["ok"] and rep["rel_norm"] <= 0.6 * tol[torch.bfloat16].rel_norm, rep
    g64 = ref.csa_backward_ref(*args[:5], x["grad_out"], ratio, coff)
    g32 = ref.csa_backward_ref(*args[:5], x["grad_out"], ratio, coff, compute_dtype=torch.float32)
    for name, a, b in (("grad_kv", g32[0], g64[0]), ("grad_score", g32[1], g64[1])):
        rep = ops_tests.compare(a.to(torch.bfloat16), b, torch.bfloat16)
        assert rep["ok"] and rep["rel_norm"] <= 0.6 * tol[torch.bfloat16].rel_norm, (name, rep)
    rep = ops_tests.compare(g32[2], g64[2], torch.float32)
    assert rep["ok"] and rep["rel_norm"] <= 0.1 * tol[torch.float32].rel_norm, ("grad_ape", rep)


def test_tolerances_reject_wrong_results(ops_tests):
    """NaN, a mutated window, and a 2-ulp bias all fail the comparison."""
    x = _case(4, 2, 8, n_blocks=60, seed=99, n_segments=4)
    out64 = ref.csa_forward_ref(x["kv"], x["score"], x["ape"], x["cu"], x["cuc"], 4, 2, None, x["total_comp"])
    good = out64.to(torch.bfloat16)
    assert ops_tests.compare(good, out64, torch.bfloat16)["ok"]

    nan = good.clone()
    nan[3, 2] = float("nan")
    rep = ops_tests.compare(nan, out64, torch.bfloat16)
    assert not rep["ok"] and rep["nan"] == 1

    for mutant in ("ape_row_shift", "first_block_prev_valid"):
        bad = torch.tensor(loop_forward(*_lists(x), x["cu"], x["cuc"], 4, 2, 8, x["total_comp"], mutant=mutant), dtype=torch.float64)
        assert not ops_tests.compare(bad.to(torch.bfloat16), out64, torch.bfloat16)["ok"], mutant

    biased = (out64 + 2 * ops_tests.ulp_bf16(out64)).to(torch.bfloat16)
    assert not ops_tests.compare(biased, out64, torch.bfloat16)["ok"]

    g = ref.csa_backward_ref(x["kv"], x["score"], x["ape"], x["cu"], x["cuc"], x["grad_out"], 4, 2)[2]
    assert ops_tests.compare(g.float(), g, torch.float32)["ok"]
    assert not ops_tests.compare((g * (1 + 3e-4)).float(), g, torch.float32)["ok"]
