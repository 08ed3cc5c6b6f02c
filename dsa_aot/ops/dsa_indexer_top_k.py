"""DSA indexer top-k: cudnn's indexer_top_k_wrapper (and its IndexerTopK plan), from shipped cubins.

Per row ``t`` of ``input_values`` (n_rows, num_cols) the ``top_k`` largest values among the row's
first ``seq_lens[t // next_n] - next_n + t % next_n + 1`` columns: their column ids (int32) and, with
``return_val``, their values; a row with fewer valid columns is padded with -1 / -inf. ``tie_break``
picks among equal values at the cutoff (0 any, 1 smaller id, 2 larger id); ``deterministic`` makes
the choice repeatable and returns the valid ids in ascending order. ``n_rows`` must be
``seq_lens.numel() * next_n``; ``0 <= seq_lens[b] <= num_cols`` is the caller's to keep (upstream
does not read the lengths back either).

Which entry serves a call is :mod:`dsa_aot.policy.dsa_indexer_top_k` (upstream's compile key: the dtype,
the column bucket, top_k, next_n, the flags, ``n_rows > 148``). Upstream launches on torch's current
stream through TVM-FFI; here the stream is an argument like every op's (None: torch's current stream
of the input's device). Rows whose int32 radix scratch would overflow are launched in chunks, as
upstream does; a strided or misaligned input of the allocating form is copied first, as upstream does.
"""

from __future__ import annotations

from ..policy.families import FAMILIES
from ..policy import dsa_indexer_top_k as policy
from .gpu import alloc_on
from .declare import Flag, In, Int, OneOf, Op, Out, Workspace

FAMILY = policy.FAMILY
__all__ = list(FAMILIES[FAMILY].exports)  # the registry lists them: dsa_aot.<namespace> imports this module for them
_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}


def indexer_top_k_workspace_bytes(input_values) -> int:
    """Bytes of the int32 radix scratch a call on ``input_values`` (n_rows, num_cols) needs (upstream's
    ``IndexerTopK.scratch_workspace_bytes``): a 1-D uint8 tensor, 32-byte aligned."""
    n_rows, num_cols = input_values.shape
    return policy.workspace_bytes(n_rows, num_cols, _DTYPES.get(str(input_values.dtype), "float32"))


def _need(c) -> int:
    n_rows, num_cols = c.sym["n_rows"], c.sym["num_cols"]
    return policy.workspace_bytes(n_rows, num_cols, _DTYPES[str(c.input_values.dtype)]) if n_rows and num_cols else 0


def _rules(c, problems):
    n_rows, num_cols = c.sym["n_rows"], c.sym["num_cols"]
    if n_rows > policy.MAX_ROWS or num_cols > policy.MAX_COLS:
        problems.append(f"input_values: {n_rows} x {num_cols} (at most {policy.MAX_ROWS} rows of {policy.MAX_COLS} columns)")
    if n_rows != c.sym["batch"] * c.next_n:
        problems.append(f"input_values: {n_rows} rows, expected seq_lens.numel() * next_n = {c.sym['batch']} * {c.next_n} "
                        f"(for independent rows use next_n=1 and one length per row)")
    chunks = policy.row_chunks(n_rows, num_cols, _DTYPES[str(c.input_values.dtype)], c.next_n, c.input_values.element_size())
    if isinstance(chunks, str):
        problems.append(f"input_values: {chunks}")
    c.chunks = chunks


def _entries(c):
    n_rows, num_cols = c.sym["n_rows"], c.sym["num_cols"]
    if not (n_rows and num_cols):
        return {}
    return {"main": policy.top_k_kernel(_DTYPES[str(c.input_values.dtype)], num_cols, c.top_k, c.next_n, c.return_val, c.tie_break,
                                        c.deterministic, n_rows)}


def _hint(c, key) -> str:
    return (f" (top-k compiles one cubin per column bucket {key['cols']} (the next power of two of num_cols), top_k, next_n, "
            f"flags and n_rows > {policy.LARGE_ROWS} ({key['large']}))")


def _plan(rec, c):
    n_rows, num_cols, top_k, p = c.sym["n_rows"], c.sym["num_cols"], c.top_k, c.p
    if "main" in c.entry:
        es, bn = c.input_values.element_size(), policy.buffer_numbers(_DTYPES[str(c.input_values.dtype)])
        for lo, hi in c.chunks:
            rows = hi - lo
            out_v = (p.values + lo * top_k * es, rows) if c.return_val else ()
            rec.launch(c.entry["main"], p.input_values + lo * num_cols * es, rows, num_cols, num_cols,
                       p.workspace + lo * bn * num_cols * 4, rows, bn, num_cols, bn * num_cols, num_cols,
                       p.seq_lens + lo // c.next_n * 4, rows // c.next_n, p.indices + lo * top_k * 4, rows, *out_v, rec.s)
    elif n_rows:  # rows of no columns: every row is padded
        dev = c.dev

        def pad(ts, stream):
            with alloc_on(stream, dev):
                ts[0].fill_(-1)
                if ts[1] is not None:
                    ts[1].fill_(float("-inf"))

        rec.then(pad)


TOP_K = Op(
    FAMILY, "indexer_top_k", plan_class="IndexerTopK",
    into="indices, values, input_values, seq_lens, top_k, next_n=1, return_val=True, num_copy_bits=256, stream=None, tie_break=0, "
         "deterministic=False, *, workspace=None",
    alloc="input_values, seq_lens, top_k, next_n=1, return_val=True, num_copy_bits=256, stream=None, tie_break=0, deterministic=False",
    tensors=(
        Out("indices", "int32", ("n_rows", "top_k"), align=4),
        Out("values", "like input_values", ("n_rows", "top_k"), align="element", when="return_val"),
        In("input_values", ("float32", "float16", "bfloat16"), ("n_rows", "num_cols"), align=policy.ALIGN, staged=True),
        In("seq_lens", "int32", ("batch",), align=4, staged=True),
        Workspace("workspace", _need, "dsa_aot.dsa.indexer_top_k_workspace_bytes", align=policy.ALIGN),
    ),
    options=(
        Int("top_k", 1, policy.MAX_TOP_K), Int("next_n", 1, 1024, 1), Flag("return_val", True),
        OneOf("num_copy_bits", (policy.COPY_BITS,), policy.COPY_BITS, torch=False),  # upstream's default: the only one shipped
        OneOf("tie_break", (0, 1, 2), 0), Flag("deterministic", False),
    ),
    entries=_entries, rules=_rules, plan=_plan, hint=_hint, into_returns=("indices", "values"),
    note="Returns (indices, values) / {'indices', 'values'}: ``values`` None when ``return_val`` is False.",
)  # fmt: skip

indexer_top_k, indexer_top_k_into, IndexerTopK = TOP_K.forms(globals())
