"""tests/gpu/refutil.py: what the DSA references share."""

import math

import pytest
import torch

import refutil  # tests/gpu is on sys.path (tests/conftest.py)


def test_rel_err():
    a = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert refutil.rel_err(a, a) == 0.0
    assert refutil.rel_err(a * 1.01, a) == pytest.approx(0.01)
    assert refutil.rel_err(a.to(torch.bfloat16), a) == 0.0
    assert refutil.rel_err(torch.zeros(2), torch.zeros(2)) == 0.0
    assert refutil.rel_err(a, torch.zeros(2)) == math.inf


def test_distinct_ids_are_distinct_in_range_and_seeded():
    ids = refutil.distinct_ids(300, 70, 64, refutil.generator(3))
    assert ids.shape == (300, 64) and ids.min() >= 0 and ids.max() < 70
    assert all(len(set(r.tolist())) == 64 for r in ids)
    assert torch.equal(ids, refutil.distinct_ids(300, 70, 64, refutil.generator(3)))
    assert not torch.equal(ids, refutil.distinct_ids(300, 70, 64, refutil.generator(4)))
