"""The indexer top-k reference of tests/gpu/ref_indexer_top_k.py, by hand and against an independent
torch formulation (torch.topk / a stable sort in float64), on the CPU."""

import pytest
import torch

import ref_indexer_top_k as ref


def test_lengths_follow_the_speculative_stagger():
    # next_n 2: rows (0, 1) of batch 0 see 4 and 5 columns; rows (2, 3) of batch 1 see 0 (clamped) and 1
    assert ref.lengths(torch.tensor([5, 1]), 4, 2, 8) == [4, 5, 0, 1]
    assert ref.lengths(torch.tensor([9, 3]), 2, 1, 8) == [8, 3]  # clamped to num_cols


def test_keys_order_values_as_the_radix_select_does():
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        v = torch.tensor([float("-inf"), -3.0, -1.0, -0.0, 0.0, 0.5, 2.0, float("inf")], dtype=dt)
        k = ref.keys(v).tolist()
        assert k == sorted(k) and len(set(k)) == len(k), dt  # strictly increasing, -0 below +0


def test_by_hand():
    v = torch.tensor([[1.0, 5.0, 3.0, 5.0, 0.0], [2.0, 2.0, 2.0, 2.0, 9.0]])
    lens = torch.tensor([5, 4])
    ids, vals = ref.expected(v, lens, 2, tie_break=1)
    assert ids.tolist() == [[1, 3], [0, 1]] and vals.tolist() == [[5.0, 5.0], [2.0, 2.0]]  # row 1 sees 4 columns: 9 is out
    ids, _ = ref.expected(v, lens, 2, tie_break=2)
    assert ids.tolist() == [[1, 3], [2, 3]]
    ids, vals = ref.expected(v, torch.tensor([1, 0]), 3)
    assert ids.tolist() == [[0, -1, -1], [-1, -1, -1]] and vals[0, 1] == float("-inf")


@pytest.mark.parametrize("seed", range(5))
def test_against_torch_topk_and_a_stable_sort(seed):
    g = torch.Generator().manual_seed(seed)
    rows, cols, top_k = 6, 300, 40
    distinct = (torch.randperm(rows * cols, generator=g).view(rows, cols).float() - 900.0) / 7.0 + 0.5  # no ties, no zeros
    lens = torch.randint(0, cols + 1, (rows,), generator=g)
    lens[0], lens[1] = 0, 17  # an empty row, a row shorter than top_k
    ids, vals = ref.expected(distinct, lens, top_k)
    for t in range(rows):
        L = int(lens[t])
        masked = torch.where(torch.arange(cols) < L, distinct[t].double(), torch.tensor(float("-inf"), dtype=torch.float64))
        n = min(L, top_k)
        want = sorted(torch.topk(masked, n).indices.tolist()) if n else []
        assert ids[t, :n].tolist() == want and (ids[t, n:] == -1).all()
    assert ref.check(distinct, lens, ids, vals, top_k) == []
    tied = torch.randint(0, 6, (rows, cols), generator=g).float() + 1.0  # many ties at every cutoff
    for tie in (1, 2):
        ids, _ = ref.expected(tied, lens, top_k, tie_break=tie)
        for t in range(rows):
            L, n = int(lens[t]), min(int(lens[t]), top_k)
            x = tied[t, :L].double() if tie == 1 else tied[t, :L].double().flip(0)
            order = torch.sort(x, descending=True, stable=True).indices[:n]
            want = sorted(order.tolist() if tie == 1 else (L - 1 - order).tolist())
            assert ids[t, :n].tolist() == want


def test_check_finds_what_is_wrong():
    g = torch.Generator().manual_seed(7)
    v = torch.randn(4, 200, generator=g)
    lens = torch.tensor([200, 150, 3, 0])
    ids, vals = ref.expected(v, lens, 16)
    assert ref.check(v, lens, ids, vals, 16, deterministic=True) == []
    shuffled = ids.clone()
    shuffled[0] = shuffled[0].flip(0)
    assert ref.check(v, lens, shuffled, None, 16) == []  # order is free unless deterministic
    assert "not ascending" in ref.check(v, lens, shuffled, None, 16, deterministic=True)[0]
    worse = ids.clone()
    worse[0, 0] = int(torch.argsort(v[0])[0])  # the smallest value instead of a chosen one
    assert ref.check(v, lens, worse, None, 16)
    bad_pad = ids.clone()
    bad_pad[2, 5] = 0
    assert ref.check(v, lens, bad_pad, None, 16)
    wrong_vals = vals.clone()
    wrong_vals[1, 0] += 1
    assert ref.check(v, lens, ids, wrong_vals, 16)
