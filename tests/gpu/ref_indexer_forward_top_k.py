"""float64 reference for the fused DSA indexer forward + top-k (cudnn's ``indexer_forward_top_k_wrapper``).

Query row ``i`` of batch ``b`` sees the compressed keys ``j < n(b, i) = min((off_b + i + 1) // ratio,
S_k(b))`` with the scores of :mod:`ref_indexer_forward`. The op returns, per row, the ``top_k`` keys
of largest score among those (all of them when ``n <= top_k``), in no particular slot order:

* ``indices``: their local key ids, -1 in the slots past ``n``; with global ids ``b * S_k + j``
  (BSHD) or ``cu_seqlens_k[b] + j`` (THD), -1 kept;
* ``logits``: their scores, -inf past ``n``;
* ``softmax``: ``exp(s_j - max) / sum`` over the selected scores, 0 past ``n``;
* ``lse``: the log-sum-exp over all ``n`` visible scores (not only the selected ones).

``deterministic=True``: among keys tied with the ``top_k``-th largest score, the smallest ids are
selected. Without it any tied key may be.

The candidate buffer (what the GEMM writes and stage 2 reads) holds row ``i``'s ``n(b, i)`` scores at
``base_b + G(off_b + i) - G(off_b)`` with ``G(m) = sum_{t < m} (t + 1) // ratio``; ``base_b`` is
``b * G(S_q)`` in BSHD without offsets, else ``cand_batch_offsets[b]``, the prefix sums of the
per-batch sizes (:func:`compact` builds it from dense scores, for the tests of stage 2 alone).

Where the semantics were read from (nvidia-cudnn-frontend 1.32.0, ``deepseek_sparse_attention``):
``indexer_forward/api.py`` l.341-454 (the wrapper's docstring), ``indexer_forward/_compressed_top_k_sm100.py``
(the layout, windows, THD), ``indexer_top_k/compress_top_k_sm100.py`` (``per_batch_floats``,
``build_compact_buffer``, the -1 / -inf padding and the deterministic tie rule in its docstrings).
"""

from __future__ import annotations

import torch

__all__ = ["G", "visible", "compact", "select", "check_rows", "check_dense", "Tie", "scores", "check"]


def G(m: int, ratio: int) -> int:
    """sum over t < m of (t + 1) // ratio, in closed form: m = q * ratio + r gives ratio * q(q - 1) / 2 full
    blocks plus q for each of the last r + 1 rows (tests/unit/refs checks it against the sum)."""
    q, r = divmod(m, ratio)
    return ratio * q * (q - 1) // 2 + q * (r + 1)


def visible(off: int, i: int, ratio: int, s_k: int) -> int:
    """Keys row ``i`` (causal offset ``off``) sees, at most ``s_k``."""
    return max(0, min((off + i + 1) // ratio, s_k))


def compact(dense: list, ratio: int, offs: list) -> tuple:
    """The candidate buffer (fp32, NaN where nothing is written) and the batch offsets (int64 prefix sums)
    of per-batch dense scores ``dense[b]`` ((S_q(b), S_k(b)) each), row by row as the GEMM writes it."""
    cbo = [0]
    for d, off in zip(dense, offs):
        cbo.append(cbo[-1] + G(off + d.shape[0], ratio) - G(off, ratio))
    out = torch.full((max(cbo[-1], 1),), float("nan"))
    for b, (d, off) in enumerate(zip(dense, offs)):
        for i in range(d.shape[0]):
            n = visible(off, i, ratio, d.shape[1])
            start = cbo[b] + G(off + i, ratio) - G(off, ratio)
            out[start : start + n] = d[i, :n].float()
    return out, torch.tensor(cbo, dtype=torch.int64)


def select(row: torch.Tensor, top_k: int, deterministic: bool) -> tuple:
    """(ids that must be selected, ids that may be, how many are selected) for one row's visible scores:
    a full sort, ties at the boundary broken by id when ``deterministic``."""
    v = row.tolist()
    n = len(v)
    if n <= top_k:
        return set(range(n)), set(), n
    kth = sorted(v, reverse=True)[top_k - 1]
    above = {j for j in range(n) if v[j] > kth}
    tied = [j for j in range(n) if v[j] == kth]
    if deterministic or len(tied) == top_k - len(above):  # no choice among the tied (or the rule makes it)
        return above | set(sorted(tied)[: top_k - len(above)]), set(), top_k
    return above, set(tied), top_k


def check_rows(idx, val, sm, dense, ratio, offs, top_k, deterministic=False, base=None, lse=None, atol=1e-6):
    """Assert the op's per-row outputs (``idx`` local or global with ``base[b]`` added, -1 padded) against
    ``dense[b]`` (float64 scores); returns the rows checked."""
    rows = 0
    r0 = 0
    for b, (d, off) in enumerate(zip(dense, offs)):
        for i in range(d.shape[0]):
            n = visible(off, i, ratio, d.shape[1])
            row = d[i, :n]
            must, may, count = select(row, top_k, deterministic)
            got, v = idx[r0 + i], val[r0 + i]
            valid = got >= 0
            ids = (got[valid].long() - (base[b] if base is not None else 0)).tolist()
            where = f"batch {b} row {i}"
            assert valid.sum() == count and len(set(ids)) == count, where
            assert must <= set(ids) <= must | may, where
            assert (got[~valid] == -1).all() and (v[~valid] == float("-inf")).all(), where
            assert torch.allclose(v[valid].double(), row[ids], rtol=1e-5, atol=atol), where
            if sm is not None:
                s = sm[r0 + i]
                assert (s[~valid] == 0).all(), where
                if count:
                    assert torch.allclose(s[valid].double(), torch.softmax(row[ids], 0), rtol=1e-4, atol=1e-6), where
            if lse is not None:
                want = torch.logsumexp(row, 0) if n else torch.tensor(float("-inf"), dtype=torch.float64)
                assert torch.allclose(lse[r0 + i].double(), want, rtol=1e-5, atol=1e-5), where
            rows += 1
        r0 += d.shape[0]
    return rows


class Tie(AssertionError):
    """check_dense met rows tied at the top-k boundary: check_rows decides those (it knows the tie rules)."""


def check_dense(idx, val, sm, scores, top_k, base=None, lse=None):
    """:func:`check_rows` for many rows at once: ``scores`` (rows, S) float64 with -inf where a key is not
    visible (what :mod:`ref_indexer_forward` returns), ``base`` a (rows,) tensor added to global ids.
    Rows whose ``top_k``-th and next score tie raise :class:`Tie` (check them with check_rows).
    Returns the rows checked."""
    rows, s = scores.shape
    n = (scores > float("-inf")).sum(1)
    count = n.clamp(max=top_k)
    k = min(top_k, s)
    top, ids = torch.topk(scores, k, dim=1)
    if s > top_k:
        nxt = torch.topk(scores, top_k + 1, dim=1).values[:, top_k]
        tie = (n > top_k) & (nxt == top[:, top_k - 1])
        if tie.any():
            raise Tie(f"rows {tie.nonzero().flatten().tolist()[:5]} tie at the boundary: check them with check_rows")
    valid = idx >= 0
    assert torch.equal(valid.sum(1), count), "selected count per row"
    local = idx.long() - (base.long().unsqueeze(1) if base is not None else 0)
    big = s + 1
    got = torch.sort(torch.where(valid, local, big), dim=1).values
    want = torch.sort(torch.where(top > float("-inf"), ids, big), dim=1).values
    want = torch.cat([want, torch.full((rows, top_k - k), big, dtype=want.dtype, device=want.device)], 1)
    assert torch.equal(got, want), f"selected ids differ in rows {(got != want).any(1).nonzero().flatten().tolist()[:5]}"
    assert (idx[~valid] == -1).all() and (val[~valid] == float("-inf")).all(), "padding"
    ref_v = torch.gather(scores, 1, torch.where(valid, local, 0))
    assert torch.allclose(val.double()[valid], ref_v[valid], rtol=1e-5, atol=1e-6), "logits"
    if sm is not None:
        ref_sm = torch.softmax(torch.where(valid, ref_v, float("-inf")), 1).nan_to_num(0.0)
        assert (sm[~valid] == 0).all() and torch.allclose(sm.double(), ref_sm, rtol=1e-4, atol=1e-6), "softmax"
    if lse is not None:
        assert torch.allclose(lse.double(), torch.logsumexp(scores, 1), rtol=1e-5, atol=1e-5, equal_nan=False), "lse"
    return rows


def scores(dense, offs, ratio, width):
    """(rows, width) float64 of the batches' dense scores (each (S_q_b, S_k_b)), -inf where a key is not visible:
    what :func:`check_dense` takes."""
    out = []
    for d, off in zip(dense, offs):
        s = torch.full((d.shape[0], width), float("-inf"), dtype=torch.float64)
        for i in range(d.shape[0]):
            n = visible(off, i, ratio, d.shape[1])
            s[i, :n] = d[i, :n]
        out.append(s)
    return torch.cat(out) if out else torch.zeros(0, width, dtype=torch.float64)


def check(idx, val, sm, dense, ratio, offs, top_k, deterministic=False, base=None):
    """The outputs (rows, top_k) of every batch's rows against the reference: :func:`check_dense` where it decides
    (fast), :func:`check_rows` for a deterministic call and for rows tied at the boundary (it knows the tie
    rules). ``base``: per batch, what global ids add. Returns the rows checked."""
    base = list(base) if base is not None else [0] * len(dense)
    if not deterministic:  # random fp32 scores can still tie at the boundary (seen at S_k 8191)
        rows = sum(d.shape[0] for d in dense)
        per_row = torch.cat([torch.full((d.shape[0],), st) for d, st in zip(dense, base)]) if rows else torch.zeros(0)
        try:
            return check_dense(idx, val, sm, scores(dense, offs, ratio, max((d.shape[1] for d in dense), default=0)), top_k, per_row)
        except Tie:
            pass
    return check_rows(idx, val, sm, dense, ratio, offs, top_k, deterministic=deterministic, base=base)
