"""Integer references of local_to_global and compactify, from upstream's contract (no GPU, no dsa-aot code).

local_to_global: a local top-k id ``x >= 0`` of a query row of batch ``b`` becomes ``b * seqlen_k + x``
((B, S_q, K) ids), or ``cu_seqlens_k[b] + x`` for THD rows, where ``b`` is the batch whose
``[cu_seqlens_q[b], cu_seqlens_q[b + 1])`` holds the row (rows past the last offset count as the last
batch); a negative id becomes -1; the result is int32 (low 32 bits). compactify: each row's ids
``>= 0`` move to its front in their order, the rest of the row is -1, and the count is returned.
"""

from __future__ import annotations

import torch

__all__ = ["local_to_global", "compactify", "random_ids", "random_segments"]


def local_to_global(local: torch.Tensor, seqlen_k: int, cu_q=None, cu_k=None) -> torch.Tensor:
    """The global ids (int32, CPU) of ``local`` ((B, S_q, K), or (T, K) with the cu_seqlens)."""
    x = local.detach().cpu().to(torch.int64)
    if cu_q is None:
        b = torch.arange(x.shape[0], dtype=torch.int64).view(-1, 1, 1)
        off = b * seqlen_k
    else:
        q, k = cu_q.cpu().tolist(), cu_k.cpu().tolist()
        batches = len(q) - 1
        rows = []
        for r in range(x.shape[0]):
            b = 0
            for i in range(1, batches):  # the last batch whose start is <= r (empty batches skipped)
                if q[i] <= r:
                    b = i
            rows.append(k[b] if batches > 0 else k[0])
        off = torch.tensor(rows, dtype=torch.int64).view(-1, 1)
    out = torch.where(x >= 0, x + off, torch.full_like(x, -1))
    return (((out + 2**31) % 2**32) - 2**31).to(torch.int32)  # the low 32 bits, as the kernel stores them


def compactify(ids: torch.Tensor):
    """(compact ids (rows, cols) int32, counts (rows,) int32) of ``ids`` ((rows, cols) or (B, S, cols))."""
    x = ids.detach().cpu().reshape(-1, ids.shape[-1])
    out = torch.full(x.shape, -1, dtype=torch.int32)
    n = torch.zeros(x.shape[0], dtype=torch.int32)
    for r in range(x.shape[0]):
        valid = x[r][x[r] >= 0]
        out[r, : valid.numel()] = valid
        n[r] = valid.numel()
    return out, n


def random_ids(shape, hi: int, gen: torch.Generator, invalid_frac=0.3, dtype=torch.int32) -> torch.Tensor:
    """Ids in [0, hi) with about ``invalid_frac`` of them negative (-1 and other negatives), CPU."""
    x = torch.randint(0, hi, shape, generator=gen, dtype=torch.int64)
    neg = torch.rand(shape, generator=gen) < invalid_frac
    x = torch.where(neg, -torch.randint(1, 5, shape, generator=gen, dtype=torch.int64), x)
    return x.to(dtype)


def random_segments(batches: int, max_len: int, gen: torch.Generator, empty=True):
    """cu_seqlens (int32, CPU) of ``batches`` segments of 0..max_len rows (one empty one when ``empty``)."""
    lens = torch.randint(1, max_len + 1, (batches,), generator=gen)
    if empty and batches > 1:
        lens[batches // 2] = 0
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
