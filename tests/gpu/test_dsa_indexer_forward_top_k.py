"""Stage 2 of the fused indexer forward + top-k on the H200 (the SIMT kernel runs the same on SM100; the
GEMM before it cannot run here): the top-k of each row's compact candidates against a reference built
from dense scores, every block size, with and without causal offsets, outputs NaN-poisoned first.
Work in progress (branch)."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

from refutil import generator  # noqa: E402

DEV = "cuda:0"


def _G(n, ratio):
    q, s = divmod(n, ratio)
    return ratio * q * (q - 1) // 2 + q * (s + 1)


def _compact(dense, ratio, offs):
    """The candidate buffer of dense (B, S_q, S_k) scores and its batch offsets (int64 prefix sums)."""
    b, s_q, s_k = dense.shape
    sizes = [_G(o + s_q, ratio) - _G(o, ratio) for o in offs]
    cbo = [0]
    for n in sizes:
        cbo.append(cbo[-1] + n)
    cand = torch.full((max(cbo[-1], 1),), float("nan"))
    for bb in range(b):
        for r in range(s_q):
            seg = min(max((offs[bb] + r + 1) // ratio, 0), s_k)
            at = cbo[bb] + _G(offs[bb] + r, ratio) - _G(offs[bb], ratio)
            cand[at : at + seg] = dense[bb, r, :seg]
    return cand, torch.tensor(cbo, dtype=torch.int64)


@pytest.mark.parametrize("shape", [(2, 256, 64), (1, 4, 64), (1, 4, 10000)])  # 256 / 512 / 1024 threads
@pytest.mark.parametrize("top_k", [512, 2048])
@pytest.mark.parametrize("with_offsets", [False, True])
def test_stage2_selects_each_rows_top_k(shape, top_k, with_offsets):
    import aot.ops.dsa_indexer_forward_top_k as op

    b, s_q, s_k = shape
    ratio = 4
    gen = generator(b * s_q + s_k + top_k)
    dense = torch.randn(b, s_q, s_k, generator=gen)
    offs = [int(x) for x in torch.randint(0, 4 * s_k, (b,), generator=gen)] if with_offsets else [0] * b
    if with_offsets:
        offs = [min(o, max(0, s_k * ratio - s_q)) for o in offs]  # rows past the keys see them all
    cand, cbo = _compact(dense, ratio, offs)
    idx = torch.full((b, s_q, top_k), 0x7EADBEEF, dtype=torch.int32, device=DEV)
    val = torch.full((b, s_q, top_k), math.nan, device=DEV)
    sm = torch.full((b, s_q, top_k), math.nan, device=DEV)
    kw = dict(cand_batch_offsets=cbo.to(DEV), q_causal_offsets=torch.tensor(offs, dtype=torch.int32, device=DEV)) if with_offsets else {}
    if not with_offsets:
        cand = cand[: b * _G(s_q, ratio)] if b * _G(s_q, ratio) else cand
    op._stage2_into(idx, val, sm, cand.contiguous().to(DEV), s_k, top_k, ratio, **kw)
    torch.cuda.synchronize()
    idx, val, sm = idx.cpu(), val.cpu(), sm.cpu()
    for bb in range(b):
        for r in range(s_q):
            seg = min(max((offs[bb] + r + 1) // ratio, 0), s_k)
            row = dense[bb, r, :seg]
            want = torch.arange(seg) if seg <= top_k else torch.topk(row, top_k).indices
            got = idx[bb, r]
            valid = got >= 0
            assert valid.sum() == min(seg, top_k), (bb, r)
            assert torch.equal(torch.sort(got[valid]).values.long(), torch.sort(want).values), (bb, r)
            assert (got[~valid] == -1).all() and torch.isinf(val[bb, r][~valid]).all() and (sm[bb, r][~valid] == 0).all()
            v = val[bb, r][valid]
            assert torch.equal(v, row[got[valid].long()])
            if valid.any():
                ref = torch.softmax(v.double(), 0)
                assert torch.allclose(sm[bb, r][valid].double(), ref, rtol=1e-5, atol=1e-7)
