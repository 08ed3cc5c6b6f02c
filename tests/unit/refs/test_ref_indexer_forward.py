"""The float64 indexer-forward reference (tests/gpu/ref_indexer_forward.py) against an independent
formulation on the CPU: a loop over every (row, key) that applies the mask from its definition (the
query's global position ``off + i`` sees the compressed key ``j`` when the key's block of ``ratio``
tokens ``[j * ratio, (j + 1) * ratio)`` ends at or before ``off + i + 1``), dequantizes each element
and sums the heads one by one. Mutated masks must disagree, so the inputs exercise the mask."""

from __future__ import annotations

import math

import pytest
import torch

import ref_indexer_forward as ref  # noqa: E402 - tests/gpu is on sys.path (tests/conftest.py)
from refutil import generator  # noqa: E402


def _loop(q, k, w, ratio, sm_scale, off, q_scale=None, k_scale=None, prescaled=False, visible=None):
    s_q, h, _ = q.shape
    s_k = k.shape[0]
    visible = visible or (lambda i, j: (j + 1) * ratio <= off + i + 1)
    out = torch.full((s_q, s_k), -math.inf, dtype=torch.float64)
    for i in range(s_q):
        for j in range(s_k):
            if not visible(i, j):
                continue
            acc = 0.0
            for hh in range(h):
                x = float(q[i, hh].double() @ k[j].double())
                if k_scale is not None:
                    x *= float(k_scale[j])
                    if not prescaled:
                        x *= float(q_scale[i, hh])
                acc += max(x, 0.0) * float(w[i, hh])
            out[i, j] = acc if prescaled else sm_scale * acc
    return out


@pytest.mark.parametrize("fp8,w_dtype", [(False, torch.bfloat16), (False, torch.float32), (True, torch.bfloat16), (True, torch.float32)])
@pytest.mark.parametrize("ratio", [1, 4])
def test_bshd_matches_the_loop(fp8, w_dtype, ratio):
    gen = generator(7 + ratio)
    b, s_q, s_k, h = 2, 9, 5, 3
    q, k, w, qs, ks = ref.random_inputs((b, s_q), (b, s_k), h, gen, fp8=fp8, w_dtype=w_dtype, d=8)
    offs = torch.tensor([0, 6], dtype=torch.int32)
    pre = fp8 and w_dtype == torch.float32
    got = ref.scores_bshd(q, k, w, ratio, 0.7, offs, qs, ks, prescaled=pre)
    for bb in range(b):
        want = _loop(q[bb], k[bb, :, 0], w[bb], ratio, 0.7, int(offs[bb]), None if qs is None else qs[bb],
                     None if ks is None else ks[bb, :, 0], pre)
        assert torch.equal(torch.isinf(got[bb]), torch.isinf(want))
        fin = torch.isfinite(want)
        assert torch.allclose(got[bb][fin], want[fin], rtol=1e-12, atol=1e-12)
    # the offsets and the ratio change the mask: a row sees (off + i + 1) // ratio keys
    assert (torch.isfinite(got[1]).sum(-1) == torch.clamp((6 + torch.arange(s_q) + 1) // ratio, max=s_k)).all()
    # mutated masks (an off-by-one on batch 0, the offset ignored on batch 1) disagree on these inputs
    for bb, off, bad in ((0, 0, lambda i, j: j * ratio <= i + 1), (1, 6, lambda i, j: (j + 1) * ratio <= i + 1)):
        wrong = _loop(q[bb], k[bb, :, 0], w[bb], ratio, 0.7, off, None if qs is None else qs[bb], None if ks is None else ks[bb, :, 0], pre, bad)
        assert not torch.equal(torch.isinf(wrong), torch.isinf(got[bb]))

def test_thd_is_bshd_per_segment_with_local_columns():
    gen = generator(3)
    lens_q, lens_k = [4, 0, 7], [3, 5, 6]
    cu_q = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 8, 14], dtype=torch.int32)
    q, k, w, _, _ = ref.random_inputs((11,), (14,), 2, gen, d=8)
    offs = torch.tensor([2, 0, 9], dtype=torch.int32)
    got = ref.scores_thd(q, k, w, cu_q, cu_k, 7, 6, 2, 1.5, offs)
    assert got.shape == (11, 6)
    for b in range(3):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        want = ref.scores_bshd(q[None, q0:q1], k[None, k0:k1], w[None, q0:q1], 2, 1.5, offs[b : b + 1])[0]
        assert torch.equal(got[q0:q1, : k1 - k0], want)
        assert torch.isinf(got[q0:q1, k1 - k0 :]).all()
    assert lens_q == [int(cu_q[i + 1] - cu_q[i]) for i in range(3)] and lens_k == [int(cu_k[i + 1] - cu_k[i]) for i in range(3)]
    # a max_seqlen below a segment's length leaves its tail -inf (the kernel never visits it)
    short = ref.scores_thd(q, k, w, cu_q, cu_k, 3, 6, 2, 1.5, offs)
    assert torch.isinf(short[7:11]).all() and torch.equal(short[4:7], got[4:7])


def test_lse_is_the_log_sum_exp_of_the_visible_scores():
    s = torch.tensor([[0.0, 1.0, -math.inf], [-math.inf, -math.inf, -math.inf]], dtype=torch.float64)
    lse = ref.lse_of(s)
    assert lse[0].item() == pytest.approx(math.log(1 + math.e)) and lse[1].item() == -math.inf
    assert ref.lse_of(torch.empty(2, 0, dtype=torch.float64)).tolist() == [-math.inf, -math.inf]
