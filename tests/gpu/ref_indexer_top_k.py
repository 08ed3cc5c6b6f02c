"""Reference of the indexer top-k from upstream's contract (no GPU, no dsa-aot code).

Row ``t`` of ``values`` (n_rows, num_cols) sees its first ``L = seq_lens[t // next_n] - next_n +
t % next_n + 1`` columns (clamped to [0, num_cols]); the op selects the ``top_k`` largest of them,
padding with id -1 / value -inf when ``L < top_k``. Values are ordered as the radix select orders
them: by their bits mapped to an order-preserving integer (so +0 is above -0; NaN is not used here).
Ties at the cutoff (equal keys): ``tie_break`` 1 keeps the smaller column ids, 2 the larger ones;
``deterministic`` with tie_break 0 keeps the smaller ones, and returns the valid ids ascending.
Otherwise which tied ids are kept and the order of the ids are unspecified: :func:`check` accepts any
valid choice and order.
"""

from __future__ import annotations

import torch

__all__ = ["lengths", "keys", "expected", "check"]

_BITS = {torch.float32: (torch.int32, 32), torch.float16: (torch.int16, 16), torch.bfloat16: (torch.int16, 16)}


def lengths(seq_lens, n_rows: int, next_n: int, num_cols: int) -> list:
    """The valid column count of every row."""
    s = seq_lens.detach().cpu().tolist()
    return [max(0, min(num_cols, s[t // next_n] - next_n + t % next_n + 1)) for t in range(n_rows)]


def keys(values: torch.Tensor) -> torch.Tensor:
    """An int64 per element, ordered as the values are (the float's bits made monotone)."""
    itype, nbits = _BITS[values.dtype]
    b = values.detach().cpu().contiguous().view(itype).to(torch.int64) & ((1 << nbits) - 1)
    sign = 1 << (nbits - 1)
    return torch.where(b & sign != 0, ((1 << nbits) - 1) - b, b | sign)


def expected(values, seq_lens, top_k: int, next_n: int = 1, tie_break: int = 1):
    """(ids (n_rows, top_k) int32, values) when the choice is defined (tie_break 1 or 2, or
    deterministic): each row's chosen ids ascending, then -1 / -inf."""
    n_rows, num_cols = values.shape
    # one exact int64 per element, distinct within a row: the value's key, then the column (the
    # smaller column ranks higher with tie_break 1 or 0, the larger with 2); keys < 2**32, columns < 2**20
    col = torch.arange(num_cols, dtype=torch.int64)
    rank = keys(values) * (1 << 20) + (col if tie_break == 2 else (1 << 20) - 1 - col)
    ids = torch.full((n_rows, top_k), -1, dtype=torch.int32)
    for t, L in enumerate(lengths(seq_lens, n_rows, next_n, num_cols)):
        n = min(L, top_k)
        if n:
            ids[t, :n] = torch.topk(rank[t, :L], n).indices.sort().values.to(torch.int32)
    vals = gather(values, ids)
    return ids, vals


def gather(values, ids):
    """values[row, id] for the valid ids, -inf where the id is -1 (in the values' dtype, on the CPU)."""
    v = values.detach().cpu()
    out = torch.full(ids.shape, float("-inf"), dtype=v.dtype)
    valid = ids >= 0
    out[valid] = v.gather(1, ids.clamp(min=0).long())[valid]
    return out


def check(values, seq_lens, ids, vals, top_k: int, next_n: int = 1, tie_break: int = 0, deterministic: bool = False) -> list:
    """What is wrong with the op's (ids, vals) for this call (an empty list: nothing)."""
    n_rows, num_cols = values.shape
    k = keys(values)
    ids = ids.detach().cpu()
    problems = []
    if tie_break in (1, 2) or deterministic:
        want, _ = expected(values, seq_lens, top_k, next_n, tie_break)
    for t, L in enumerate(lengths(seq_lens, n_rows, next_n, num_cols)):
        row = ids[t].tolist()
        n = min(L, top_k)
        valid, pad = row[:n], row[n:]
        if deterministic and valid != sorted(valid):
            problems.append(f"row {t}: deterministic ids not ascending")
        if pad != [-1] * len(pad) or len(set(valid)) != n or any(not 0 <= c < L for c in valid):
            problems.append(f"row {t}: {n} distinct ids in [0, {L}) then -1 expected, got {row[:8]}...")
            continue
        if tie_break in (1, 2) or deterministic:
            if sorted(valid) != want[t, :n].tolist():
                problems.append(f"row {t}: chosen ids differ from the defined choice")
            continue
        kr = k[t, :L]
        chosen = torch.zeros(L, dtype=torch.bool)
        chosen[valid] = True
        if n < L and int(kr[chosen].min()) < int(kr[~chosen].max()):
            problems.append(f"row {t}: a smaller value was chosen over a larger one")
        if len(problems) > 8:
            break
    if vals is not None:
        got = vals.detach().cpu()
        ref = gather(values, ids)
        if not torch.equal(got.view(_BITS[got.dtype][0]), ref.view(_BITS[ref.dtype][0])):
            problems.append("values: not the input's values at the ids (bitwise), or padding not -inf")
    return problems
