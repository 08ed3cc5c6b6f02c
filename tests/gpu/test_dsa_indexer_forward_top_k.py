"""The fused indexer forward + top-k on the H200: its tail, stage 2 and local-to-global in place (the SIMT
kernels run the same on SM100; the GEMM before them is SM100 only, checked offline by
ci/check_sm100_calls.py and the stand-in tests). Every shipped sm_90a stage-2 entry at two shapes
(block-size edges included), BSHD and THD, with and without causal offsets, softmax, deterministic
ties, local and global ids; outputs NaN-poisoned first, checked against ref_indexer_forward_top_k.
Then graph capture, empty calls, and what the fused op refuses on SM90."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

import ref_indexer_forward_top_k as ref  # noqa: E402
from refutil import generator  # noqa: E402

DEV = "cuda:0"
# per block size (stage 2's 256 / 512 / 1024 threads: rows >= 512, else S_k >= 8192), two shapes:
# BSHD (B, S_q, S_k); THD [(S_q(b), S_k(b)), ...]
BSHD = {256: [(2, 256, 64), (1, 2560, 1024)], 512: [(1, 4, 64), (3, 100, 8191)], 1024: [(1, 4, 8192), (2, 200, 10000)]}
THD = {256: [[(300, 200), (0, 3), (400, 300)], [(600, 700)]], 512: [[(100, 40), (3, 20), (0, 5), (260, 90)], [(17, 8191)]],
       1024: [[(50, 9000), (10, 8192)], [(4, 8200), (0, 1), (100, 12000)]]}


def _problem(shape, varlen, ratio, with_offsets, ties, gen):
    """The segments, per-batch dense scores (float64 of fp32 values: what the kernel compares) and causal
    offsets. Upstream's geometry holds (S_q <= S_k * ratio + ratio - 1: at ratio 1 S_k grows to S_q) and
    offsets never take a row past S_k."""
    segs = shape if varlen else [(shape[1], shape[2])] * shape[0]
    segs = [(s_q, s_k if s_q <= s_k * ratio + ratio - 1 else s_q) for s_q, s_k in segs]
    dense, offs = [], []
    for s_q, s_k in segs:
        d = torch.randint(0, 6, (s_q, s_k), generator=gen).double() if ties else torch.randn(s_q, s_k, generator=gen).float().double()
        dense.append(d)
        hi = max(0, ratio * s_k - s_q)
        offs.append(int(torch.randint(0, hi + 1, (1,), generator=gen)) if with_offsets else 0)
    return segs, dense, offs


def _run(segs, dense, offs, varlen, ratio, top_k, softmax, deterministic, global_ids, with_offsets):
    import dsa_aot.ops.dsa_indexer_forward_top_k as op

    cand, cbo = ref.compact(dense, ratio, offs)
    rows = sum(s for s, _ in segs)
    lead = (rows,) if varlen else (len(segs), segs[0][0] if segs else 0)
    idx = torch.full(lead + (top_k,), 0x7EADBEEF, dtype=torch.int32, device=DEV)
    val = torch.full(lead + (top_k,), math.nan, device=DEV)
    sm = torch.full(lead + (top_k,), math.nan, device=DEV) if softmax else None
    kw = {}
    if with_offsets:
        kw["q_causal_offsets"] = torch.tensor(offs, dtype=torch.int32, device=DEV)
    if varlen or with_offsets:
        kw["cand_batch_offsets"] = cbo.to(DEV)
    if varlen:
        cu_q = torch.tensor([0] + [sum(s for s, _ in segs[: b + 1]) for b in range(len(segs))], dtype=torch.int32, device=DEV)
        cu_k = torch.tensor([0] + [sum(k for _, k in segs[: b + 1]) for b in range(len(segs))], dtype=torch.int32, device=DEV)
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        s_q, s_k = max(s for s, _ in segs), max(k for _, k in segs)
    else:
        s_q, s_k = segs[0] if segs else (0, 0)
    op._tail_into(idx, val, sm, cand.to(DEV), s_q, s_k, top_k, ratio, deterministic=deterministic, topk_indices_global=global_ids, **kw)
    torch.cuda.synchronize()
    if global_ids:
        starts = cu_k.tolist()[:-1] if varlen else [b * s_k for b in range(len(segs))]
    else:
        starts = [0] * len(segs)
    return idx.reshape(rows, top_k).cpu(), val.reshape(rows, top_k).cpu(), None if sm is None else sm.reshape(rows, top_k).cpu(), starts, s_k


def _entries():
    out = []
    for threads in (256, 512, 1024):
        for which in (0, 1):
            for top_k in (512, 1024, 2048):
                for offsets in (False, True):
                    for softmax in (True, False):
                        for det in (False, True):
                            for varlen in (False, True):
                                out.append((4, threads, which, top_k, offsets, softmax, det, varlen))
            for offsets in (False, True):
                for varlen in (False, True):
                    out.append((1, threads, which, 2048, offsets, True, False, varlen))
    return out


@pytest.mark.parametrize("ratio,threads,which,top_k,offsets,softmax,deterministic,varlen", _entries())
def test_tail_selects_each_rows_top_k(ratio, threads, which, top_k, offsets, softmax, deterministic, varlen):
    """Shape ``which`` of the block size ``threads``: selection, logits, softmax and -1 / -inf padding per
    row; deterministic entries get tied scores (ties broken toward the smallest ids); shape 1 returns
    global ids (b * S_k + j, or cu_seqlens_k[b] + j)."""
    shape = (THD if varlen else BSHD)[threads][which]
    gen = generator(hash((ratio, threads, which, top_k, offsets, softmax, deterministic, varlen)) & 0xFFFF)
    segs, dense, offs = _problem(shape, varlen, ratio, offsets, deterministic, gen)
    from dsa_aot.policy.dsa_indexer_forward_top_k import stage2_threads

    rows = sum(s for s, _ in segs)
    assert stage2_threads(rows, max(k for _, k in segs)) == threads  # the shape reaches the entry it is meant to
    idx, val, sm, starts, s_k = _run(segs, dense, offs, varlen, ratio, top_k, softmax, deterministic, which == 1, offsets)
    assert ref.check(idx, val, sm, dense, ratio, offs, top_k, deterministic=deterministic, base=starts) == rows


def test_tail_captures_in_a_cuda_graph_and_replays_on_new_candidates():
    import dsa_aot.ops.dsa_indexer_forward_top_k as op

    gen = generator(5)
    segs, dense, offs = _problem((2, 256, 1024), False, 4, True, False, gen)
    cand, cbo = ref.compact(dense, 4, offs)
    cand_d = cand.to(DEV)
    idx = torch.empty(2, 256, 512, dtype=torch.int32, device=DEV)
    val = torch.empty(2, 256, 512, device=DEV)
    sm = torch.empty(2, 256, 512, device=DEV)
    kw = dict(q_causal_offsets=torch.tensor(offs, dtype=torch.int32, device=DEV), cand_batch_offsets=cbo.to(DEV), topk_indices_global=True)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        op._tail_into(idx, val, sm, cand_d, 256, 1024, 512, 4, **kw)  # warm (the plan is built outside capture too)
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        op._tail_into(idx, val, sm, cand_d, 256, 1024, 512, 4, **kw)
    dense2 = [torch.randn(d.shape, generator=gen).float().double() for d in dense]
    cand2, _ = ref.compact(dense2, 4, offs)
    cand_d.copy_(cand2.to(DEV))
    idx.fill_(0x7EADBEEF)
    val.fill_(math.nan)
    sm.fill_(math.nan)
    g.replay()
    torch.cuda.synchronize()
    base = torch.cat([torch.full((256,), b * 1024) for b in range(2)])
    assert ref.check_dense(idx.reshape(512, 512).cpu(), val.reshape(512, 512).cpu(), sm.reshape(512, 512).cpu(), ref.scores(dense2, offs, 4, 1024),
                           512, base) == 512


def test_empty_calls_launch_nothing_and_leave_outputs_alone():
    import dsa_aot.ops.dsa_indexer_forward_top_k as op

    for b, s_q in ((0, 16), (2, 0)):
        idx = torch.full((b, s_q, 512), 7, dtype=torch.int32, device=DEV)
        val = torch.full((b, s_q, 512), 1.0, device=DEV)
        op._tail_into(idx, val, None, torch.zeros(4, device=DEV), s_q, 64, 512, 4, topk_indices_global=True)
        torch.cuda.synchronize()
        assert (idx == 7).all() and (val == 1.0).all()


def test_the_fused_op_refuses_sm90_before_anything_runs():
    import dsa_aot.dsa
    from dsa_aot.errors import InputError

    q = torch.randn(1, 64, 64, 128, device=DEV).bfloat16()
    k = torch.randn(1, 16, 1, 128, device=DEV).bfloat16()
    w = torch.randn(1, 64, 64, device=DEV).bfloat16()
    with pytest.raises(InputError, match="SM100 only"):
        dsa_aot.dsa.indexer_forward_top_k(q, k, w, 512)
    idx = torch.full((1, 64, 512), 7, dtype=torch.int32, device=DEV)
    val = torch.full((1, 64, 512), 1.0, device=DEV)
    cand = torch.full((dsa_aot.dsa.compress_topk_cand_buffer_size(1, 64, 16, 4),), 3.0, device=DEV)
    with pytest.raises(InputError, match="SM100 only"):
        dsa_aot.dsa.indexer_forward_top_k_into(idx, val, None, None, cand, q, k, w, 512)
    torch.cuda.synchronize()
    assert (idx == 7).all() and (val == 1.0).all() and (cand == 3.0).all()


def test_a_top_k_the_build_lacks_names_the_bucket_before_any_write():
    import dsa_aot.ops.dsa_indexer_forward_top_k as op
    from dsa_aot.errors import KernelNotFoundError

    idx = torch.full((1, 8, 700), 7, dtype=torch.int32, device=DEV)
    val = torch.full((1, 8, 700), 1.0, device=DEV)
    with pytest.raises(KernelNotFoundError, match="top_k = 700"):
        op._tail_into(idx, val, None, torch.zeros(64, device=DEV), 8, 64, 700, 4)
    torch.cuda.synchronize()
    assert (idx == 7).all() and (val == 1.0).all()
