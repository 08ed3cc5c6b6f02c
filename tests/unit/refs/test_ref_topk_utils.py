"""The integer references of tests/gpu/ref_topk_utils.py on cases worked by hand (CPU)."""

import torch

import ref_topk_utils as ref


def test_local_to_global_by_hand():
    local = torch.tensor([[[0, 3, -1], [7, -5, 2]], [[1, -1, 0], [4, 4, -2]]], dtype=torch.int32)  # (B 2, S_q 2, K 3)
    want = torch.tensor([[[0, 3, -1], [7, -1, 2]], [[101, -1, 100], [104, 104, -1]]], dtype=torch.int32)
    assert torch.equal(ref.local_to_global(local, 100), want)
    assert torch.equal(ref.local_to_global(local.long(), 100), want)


def test_local_to_global_thd_by_hand():
    # batches of 2, 0 and 3 query rows: rows 0-1 batch 0, rows 2-4 batch 2 (the empty batch 1 owns none)
    cu_q, cu_k = torch.tensor([0, 2, 2, 5], dtype=torch.int32), torch.tensor([0, 10, 30, 60], dtype=torch.int32)
    local = torch.tensor([[0, 1], [2, -1], [0, 5], [-3, 1], [9, 9]], dtype=torch.int32)
    want = torch.tensor([[0, 1], [2, -1], [30, 35], [-1, 31], [39, 39]], dtype=torch.int32)
    assert torch.equal(ref.local_to_global(local, 12345, cu_q, cu_k), want)  # seqlen_k plays no part in THD


def test_local_to_global_keeps_the_low_32_bits():
    local = torch.tensor([[[2**31 - 1]], [[5]]], dtype=torch.int64)
    assert ref.local_to_global(local, 2**31 - 1).flatten().tolist() == [2**31 - 1, -(2**31) + 4]


def test_compactify_by_hand():
    ids = torch.tensor([[3, -1, 5, -7, 0], [-1, -1, -1, -1, -1], [4, 3, 2, 1, 0]], dtype=torch.int32)
    out, n = ref.compactify(ids)
    assert out.tolist() == [[3, 5, 0, -1, -1], [-1] * 5, [4, 3, 2, 1, 0]] and n.tolist() == [3, 0, 5]
    out3, n3 = ref.compactify(ids.view(1, 3, 5))
    assert torch.equal(out3, out) and torch.equal(n3, n)  # (B, S, cols) comes back as (B * S, cols)
