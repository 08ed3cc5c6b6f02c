"""Policy of the DSA top-k index utilities (cudnn.deepseek_sparse_attention.indexer_top_k, 1.32.0):
``local_to_global_wrapper`` and ``compactify_wrapper``.

Ops and their compile keys (upstream's own keys: neither reads a shape but ``cols``):

  local_to_global  LocalToGlobalTopK (local_to_global_dsl.py): index dtype (int32 / int64), varlen
                   (THD with cu_seqlens_q / cu_seqlens_k, else (B, S_q, K)), preserve_negative (False
                   on the public wrapper; True is the in-place form the compressed top-k path uses)
  compactify       CompactifyKernel (compactify.py): cols, the top-k width (``ceil(cols / 32)``
                   registers per lane are unrolled in the kernel; one cubin per width)

Both are plain SIMT kernels: the same code builds for sm_90a and sm_100a. One launch per call, no
workspace, no memset.
"""

from .keys import Choice, IntRange, Op

__all__ = ["FAMILY", "OPS", "INDEX_DTYPES", "MAX_COLS", "local_to_global_kernel", "compactify_kernel"]

FAMILY = "dsa_topk_utils"
INDEX_DTYPES = ("int32", "int64")
# compactify unrolls ceil(cols / 32) int32 registers per lane (plus flags): widths beyond the
# production top-k (2048, upstream's training pads it to a multiple of 128) are not offered
MAX_COLS = 4096

_BOOL = Choice(False, True)

def _l2g_check(key):
    if key["preserve_negative"] and key["dtype"] != "int32":
        return "preserve_negative is upstream's in-place form (output = input), run on int32 indices only"
    return None


# Ops whose cubins bake the target's SM count (one entry per SM count; a GPU needs its own): none here, so
# any target of the GPU's arch serves it (the build checks the cubins agree when a manifest has several)
SM_COUNT_OPS = frozenset()

OPS = {
    "local_to_global": Op(fields={"dtype": Choice(*INDEX_DTYPES), "varlen": _BOOL, "preserve_negative": _BOOL}, check=_l2g_check),
    "compactify": Op(fields={"cols": IntRange(1, MAX_COLS)}),
}


def local_to_global_kernel(dtype: str, varlen: bool, preserve_negative: bool = False) -> tuple:
    """(op, key) of the entry that serves a local_to_global call (upstream's compile key)."""
    return "local_to_global", {"dtype": dtype, "varlen": bool(varlen), "preserve_negative": bool(preserve_negative)}


def compactify_kernel(cols: int) -> tuple:
    """(op, key) of the entry that serves a compactify call on rows of ``cols`` indices."""
    return "compactify", {"cols": int(cols)}
