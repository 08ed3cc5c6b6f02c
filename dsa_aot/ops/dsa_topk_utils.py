"""DSA top-k index utilities: cudnn's local_to_global_wrapper and compactify_wrapper, from shipped cubins.

``local_to_global`` maps local top-k ids to global KV ids (``b * seqlen_k + id``, or ``cu_seqlens_k[b]
+ id`` for THD rows of batch b; a negative id becomes -1; the result is int32). ``compactify`` moves
each row's non-negative ids to its front in their order, fills the rest with -1 and returns the count
per row. Which entry serves a call is :mod:`dsa_aot.policy.dsa_topk_utils` (upstream's own compile keys).
"""

from __future__ import annotations

from ..policy.families import FAMILIES
from ..policy import dsa_topk_utils as policy
from .args import tensor_args
from .gpu import alloc_on
from .declare import In, Int, Op, Out

FAMILY = policy.FAMILY
__all__ = list(FAMILIES[FAMILY].exports)  # the registry lists them: dsa_aot.<namespace> imports this module for them
_I32 = 2**31 - 1
_L2G_THREADS = 256  # LocalToGlobalTopK's threads_per_cta: grid.y = ceil(K / 256) must stay <= 65535
_MAX_GRID_Y = 65535


def _l2g_rules(c, problems):
    li = c.local_indices
    varlen = c.cu_seqlens_q is not None or c.cu_seqlens_k is not None
    if li.ndim != (2 if varlen else 3):
        problems.append(f"local_indices: shape {tuple(li.shape)} (expected {'(total_q, K) with cu_seqlens' if varlen else '(B, S_q, K)'})")
    k = li.shape[-1] if li.ndim else 0
    rows = li.numel() // k if k else 0
    if rows > _I32 or -(-k // _L2G_THREADS) > _MAX_GRID_Y:
        problems.append(f"local_indices: {rows} rows of {k} ids (the kernel takes at most {_I32} rows of {_MAX_GRID_Y * _L2G_THREADS} ids)")
    if varlen and (c.cu_seqlens_q is None or c.cu_seqlens_k is None):
        problems.append("cu_seqlens_q and cu_seqlens_k: THD needs both (or neither, for (B, S_q, K) indices)")
    elif varlen and c.sym["batch1"] < 1:
        problems.append("cu_seqlens_q, cu_seqlens_k: empty (expected batch + 1 offsets)")
    c.varlen = varlen


def _l2g_entries(c):
    li = c.local_indices
    return {"main": policy.local_to_global_kernel(str(li.dtype)[6:], c.varlen)} if li.numel() else {}


def _l2g_plan(rec, c):
    if "main" in c.entry:  # no rows or no ids: nothing to write
        p = c.p
        cu = (*tensor_args(c.cu_seqlens_q, p.cu_seqlens_q), *tensor_args(c.cu_seqlens_k, p.cu_seqlens_k)) if c.varlen else ()
        rec.launch(c.entry["main"], *tensor_args(c.local_indices, p.local_indices), *tensor_args(c.global_indices, p.global_indices),
                   c.x["seqlen_k"], *cu, rec.s)


LOCAL_TO_GLOBAL = Op(
    FAMILY, "local_to_global", plan_class="LocalToGlobal",
    into="global_indices, local_indices, seqlen_k, cu_seqlens_q=None, cu_seqlens_k=None, stream=None",
    alloc="local_indices, seqlen_k, cu_seqlens_q=None, cu_seqlens_k=None, stream=None",
    tensors=(
        Out("global_indices", "int32", "like local_indices", returns="indices"),
        In("local_indices", ("int32", "int64"), None),
        In("cu_seqlens_q", "int32", ("batch1",), optional=True),
        In("cu_seqlens_k", "int32", ("batch1",), optional=True),
    ),
    options=(Int("seqlen_k", 0, _I32, per_call=True),),
    entries=_l2g_entries, rules=_l2g_rules, plan=_l2g_plan,
    note="Global ids (int32) of ``local_indices``' shape: (B, S_q, K), or (total_q, K) with ``cu_seqlens_q`` / ``cu_seqlens_k``.",
)  # fmt: skip


def _cmp_symbols(c, problems):
    shape = tuple(c.indices.shape)
    if len(shape) not in ((2, 3) if c.allocating else (2,)):
        problems.append(f"indices: shape {shape} (expected {'(rows, cols) or (B, S, cols)' if c.allocating else '(rows, cols)'})")
        return
    c.sym["cols"] = shape[-1]
    c.sym["rows"] = shape[0] * shape[1] if len(shape) == 3 else shape[0]
    if c.sym["rows"] > _I32:
        problems.append(f"indices: {c.sym['rows']} rows (the kernel takes at most {_I32})")


def _cmp_hint(c, key) -> str:
    return f" (compactify compiles one cubin per top-k width; this call's rows hold {c.sym['cols']} ids)"


def _cmp_plan(rec, c):
    p, rows = c.p, c.sym["rows"]
    if "main" in c.entry:
        rec.launch(c.entry["main"], *tensor_args(c.indices, p.indices), *tensor_args(c.indices_out, p.indices_out),
                   *tensor_args(c.topk_length, p.topk_length), rows, rec.s)
    elif rows:  # rows of no ids: every count is 0
        dev = c.dev

        def zero(ts, stream):
            with alloc_on(stream, dev):
                ts[1].zero_()

        rec.then(zero)


COMPACTIFY = Op(
    FAMILY, "compactify", plan_class="Compactify",
    into="indices_out, topk_length, indices, stream=None",
    alloc="indices, stream=None",
    tensors=(
        Out("indices_out", "int32", ("rows", "cols"), returns="indices"),
        Out("topk_length", "int32", ("rows",)),
        In("indices", "int32", None, staged="contiguous"),
    ),
    entries=lambda c: {"main": policy.compactify_kernel(c.sym["cols"])} if c.sym["rows"] and c.sym["cols"] else {},
    symbols=_cmp_symbols, plan=_cmp_plan, hint=_cmp_hint,
    alloc_view=lambda x: (x[0].view(-1, x[0].shape[-1]) if x[0].ndim == 3 else x[0],),  # (B, S, cols) as (B * S, cols), as upstream
    note="``indices``: int32 (rows, cols), or (B, S, cols) in the allocating form, flattened as upstream does.",
)  # fmt: skip

local_to_global, local_to_global_into, LocalToGlobal = LOCAL_TO_GLOBAL.forms(globals())
compactify, compactify_into, Compactify = COMPACTIFY.forms(globals())
