"""The fused top-k reference (tests/gpu/ref_indexer_forward_top_k.py) against independent formulations on
the CPU: the candidate buffer against a masked select of the dense scores (every visible score, row-major),
G against the sum it stands for, the selection against torch.topk (free ties) and a stable descending
sort (the deterministic tie rule); a wrong output must fail check_rows."""

from __future__ import annotations

import pytest
import torch

import ref_indexer_forward_top_k as ref  # noqa: E402 - tests/gpu is on sys.path (tests/conftest.py)
from refutil import generator  # noqa: E402


@pytest.mark.parametrize("ratio", [1, 4])
def test_g_is_the_sum_it_stands_for(ratio):
    for m in range(0, 70):
        assert ref.G(m, ratio) == sum((t + 1) // ratio for t in range(m))


@pytest.mark.parametrize("ratio,offs", [(4, [0, 0]), (4, [5, 0]), (1, [0, 3])])
def test_compact_is_every_visible_score_row_major(ratio, offs):
    gen = generator(ratio * 10 + sum(offs))
    s_q, s_k = 13, 40
    dense = [torch.randn(s_q, s_k, generator=gen, dtype=torch.float64) for _ in offs]
    cand, cbo = ref.compact(dense, ratio, offs)
    for b, (d, off) in enumerate(zip(dense, offs)):
        i = torch.arange(s_q).unsqueeze(1)
        j = torch.arange(s_k).unsqueeze(0)
        want = d[j < torch.div(off + i + 1, ratio, rounding_mode="floor")].float()
        assert torch.equal(cand[cbo[b] : cbo[b + 1]], want)


@pytest.mark.parametrize("deterministic", [False, True])
def test_select_agrees_with_torch_topk_and_a_stable_sort(deterministic):
    gen = generator(7)
    for n, k, levels in ((10, 4, 0), (300, 64, 0), (300, 64, 5), (50, 50, 3), (20, 64, 0)):
        row = torch.randn(n, generator=gen, dtype=torch.float64)
        if levels:
            row = torch.randint(0, levels, (n,), generator=gen).double()  # many ties at the boundary
        must, may, count = ref.select(row, k, deterministic)
        assert count == min(n, k)
        if n > k:
            top = set(torch.topk(row, k).indices.tolist())  # some valid choice among ties
            free_must, free_may, _ = ref.select(row, k, False)
            assert free_must <= top <= free_must | free_may and free_must <= must <= free_must | free_may
            stable = set(torch.sort(row, descending=True, stable=True).indices[:k].tolist())  # ties in id order
            if deterministic:
                assert must == stable and not may
            elif not levels:
                assert must == top and not may


def test_check_rows_fails_a_wrong_selection():
    gen = generator(11)
    ratio, top_k, s_q, s_k = 4, 3, 24, 6
    dense = [torch.randn(s_q, s_k, generator=gen, dtype=torch.float64)]
    idx = torch.full((s_q, top_k), -1, dtype=torch.int32)
    val = torch.full((s_q, top_k), float("-inf"))
    sm = torch.zeros(s_q, top_k)
    for i in range(s_q):
        n = ref.visible(0, i, ratio, s_k)
        row = dense[0][i, :n]
        t = torch.topk(row, min(n, top_k)).indices
        idx[i, : len(t)] = t.int()
        val[i, : len(t)] = row[t].float()
        sm[i, : len(t)] = torch.softmax(row[t], 0).float()
    assert ref.check_rows(idx, val, sm, dense, ratio, [0], top_k) == s_q
    for mutate in ("id", "pad", "softmax"):
        i2, v2, s2 = idx.clone(), val.clone(), sm.clone()
        if mutate == "id":  # row 23 sees 6 keys: swap a selected id for an unselected one
            chosen = set(i2[23].tolist())
            i2[23, 0] = next(j for j in range(6) if j not in chosen)
        elif mutate == "pad":  # row 4 sees one key: its padding must be -1 / -inf
            i2[4, 2] = 0
        else:
            s2[23, 0] += 0.01
        with pytest.raises(AssertionError):
            ref.check_rows(i2, v2, s2, dense, ratio, [0], top_k)


def test_check_dense_agrees_with_check_rows():
    """The vectorized check passes what check_rows passes and fails the same mutations (and refuses ties)."""
    gen = generator(12)
    ratio, top_k, s_q, s_k = 4, 3, 24, 6
    d = torch.randn(s_q, s_k, generator=gen, dtype=torch.float64)
    scores = torch.full((s_q, s_k), float("-inf"), dtype=torch.float64)
    idx = torch.full((s_q, top_k), -1, dtype=torch.int32)
    val = torch.full((s_q, top_k), float("-inf"))
    sm = torch.zeros(s_q, top_k)
    for i in range(s_q):
        n = ref.visible(0, i, ratio, s_k)
        scores[i, :n] = d[i, :n]
        t = torch.topk(d[i, :n], min(n, top_k)).indices
        idx[i, : len(t)] = t.int() + 100
        val[i, : len(t)] = d[i, t].float()
        sm[i, : len(t)] = torch.softmax(d[i, t], 0).float()
    base = torch.full((s_q,), 100)
    assert ref.check_dense(idx, val, sm, scores, top_k, base) == ref.check_rows(idx, val, sm, [d], ratio, [0], top_k, base=[100]) == s_q
    for mutate in ("id", "pad", "softmax", "value"):
        i2, v2, s2 = idx.clone(), val.clone(), sm.clone()
        if mutate == "id":
            chosen = set(i2[23].tolist())
            i2[23, 0] = next(j for j in range(100, 106) if j not in chosen)
        elif mutate == "pad":
            i2[4, 2] = 100
        elif mutate == "softmax":
            s2[23, 0] += 0.01
        else:
            v2[10, 0] += 0.01
        for check in (lambda: ref.check_dense(i2, v2, s2, scores, top_k, base), lambda: ref.check_rows(i2, v2, s2, [d], ratio, [0], top_k, base=[100])):
            with pytest.raises(AssertionError):
                check()
    tied = scores.clone()
    tied[23, :] = 1.0
    with pytest.raises(ref.Tie):
        ref.check_dense(idx, val, sm, tied, top_k, base)


def test_check_takes_check_dense_where_it_decides_and_check_rows_for_ties(monkeypatch):
    """ref.check (the GPU tests' and the parity's one call): the scores it builds are the visible ones, a correct
    output passes, a wrong one fails; tied rows fall through to check_rows (which accepts any tied choice),
    and a deterministic call goes to check_rows alone."""
    gen = generator(13)
    ratio, top_k = 4, 3
    dense = [torch.randn(24, 6, generator=gen, dtype=torch.float64), torch.randn(24, 6, generator=gen, dtype=torch.float64)]
    s = ref.scores(dense, [0, 5], ratio, 6)
    assert s.shape == (48, 6) and torch.isinf(s[0]).all() and torch.equal(s[24 + 3, :2], dense[1][3, :2]) and torch.isinf(s[27, 2:]).all()
    outs = []
    for d, off, base in zip(dense, [0, 5], [0, 6]):
        for i in range(d.shape[0]):
            n = ref.visible(off, i, ratio, 6)
            t = torch.topk(d[i, :n], min(n, top_k)).indices
            row = [torch.full((top_k,), -1, dtype=torch.int32), torch.full((top_k,), float("-inf")), torch.zeros(top_k)]
            row[0][: len(t)], row[1][: len(t)], row[2][: len(t)] = t.int() + base, d[i, t].float(), torch.softmax(d[i, t], 0).float()
            outs.append(row)
    idx, val, sm = (torch.stack([r[j] for r in outs]) for j in range(3))
    used = []
    for name in ("check_dense", "check_rows"):
        real = getattr(ref, name)
        monkeypatch.setattr(ref, name, lambda *a, _r=real, _n=name, **k: used.append(_n) or _r(*a, **k))
    assert ref.check(idx, val, sm, dense, ratio, [0, 5], top_k, base=[0, 6]) == 48 and used == ["check_dense"]
    used.clear()
    assert ref.check(idx, val, sm, dense, ratio, [0, 5], top_k, deterministic=False, base=[0, 6]) == 48
    bad = idx.clone()
    bad[47, 0] = -1
    with pytest.raises(AssertionError):
        ref.check(bad, val, sm, dense, ratio, [0, 5], top_k, base=[0, 6])
    tied = [dense[0].clone(), dense[1]]
    tied[0][23, :] = 1.0  # row 23 sees 6 keys, all tied: any 3 of them are right
    i2, v2, s2 = idx.clone(), val.clone(), sm.clone()
    i2[23], v2[23], s2[23] = torch.tensor([5, 0, 2], dtype=torch.int32), torch.ones(3), torch.full((3,), 1 / 3)
    used.clear()
    assert ref.check(i2, v2, s2, tied, ratio, [0, 5], top_k, base=[0, 6]) == 48 and used == ["check_dense", "check_rows"]
    used.clear()
    with pytest.raises(AssertionError):  # deterministic: the smallest tied ids, 0, 1, 2
        ref.check(i2, v2, s2, tied, ratio, [0, 5], top_k, deterministic=True, base=[0, 6])
    assert used == ["check_rows"]
