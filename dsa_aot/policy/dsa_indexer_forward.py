"""Policy of the DSA indexer forward (cudnn.deepseek_sparse_attention.indexer_forward, 1.32.0):
``indexer_forward_wrapper``.

  fwd_sm100  IndexerScoreUnifiedSm100 (bf16 Q/K, bf16 or fp32 W) and its block-scaled twins
             IndexerScoreUnifiedSm100Mxfp8 / ...Mxfp4 (bf16 W): precision, W dtype, heads, ratio, THD
             or not, causal offsets or not. The m tile follows from the heads (upstream's
             resolve_m_block_size; 128 for the mx kernels); n 128, k 64, kv_stage 4 (mx 24) are
             upstream's defaults, the only tuning shipped. No LSE on SM100 (upstream raises).
  fwd_sm90   IndexerForwardSm90 (indexer_fwd_sm90.py): precision (bf16; fp8 e4m3 with fp32 per-token
             descales), W dtype, heads (q heads per KV head), ratio, THD or not, causal offsets or not,
             LSE or not, and the fp8 H64 BSHD variants upstream picks from the shapes: ``unchecked``
             (S_q % 2 == 0) and ``masked`` (also S_k % 64 == 0). Shapes and the scale are run-time
             values (measured: the same cubin). docs/research/indexer-forward.md has the facts.
"""

from .arch import SM90, SM100
from .keys import Choice, IntRange, Op

__all__ = ["FAMILY", "OPS", "HEAD_DIM", "MAX_RATIO", "SM90_PRECISIONS", "SM90_HEADS", "SM100_ONLY", "SM100_HEADS", "SM100_PRECISIONS",
           "sm90_kernel", "sm100_kernel", "sm100_m_block", "OUT_ALIGN", "padded"]

FAMILY = "dsa_indexer_forward"
_BOOL = Choice(False, True)
HEAD_DIM = 128  # the only head dim upstream's kernels take
MAX_RATIO = 1024
SM90_PRECISIONS = ("bf16", "fp8")
SM90_HEADS = {"bf16": (16, 32, 64), "fp8": (32, 64)}  # q heads per KV head (_interface_sm90)
SM100_ONLY = ("mxfp8", "mxfp4")
SM100_PRECISIONS = ("bf16", "mxfp8", "mxfp4")
SM100_HEADS = (4, 8, 16, 32, 64)  # every precision (indexer_forward/_support.py)
_DENSE_Q_TOKENS = {64: 2, 32: 4, 16: 8, 8: 8, 4: 8}  # q tokens one bf16 MMA tile packs at D 128 (_support.py)
OUT_ALIGN = 4  # SM100: the scores' row stride is a multiple of 4 fp32 (the kernel binds them 16-byte aligned)


def padded(s_k: int) -> int:
    """The SM100 scores' row length for ``s_k`` keys (upstream's padded_seqlen_k)."""
    return -(-s_k // OUT_ALIGN) * OUT_ALIGN


def sm100_m_block(precision: str, heads: int) -> int:
    """The packed-M tile upstream compiles: resolve_m_block_size(128, ...) for bf16, 128 for mx."""
    return heads * min(128 // heads, _DENSE_Q_TOKENS[heads]) if precision == "bf16" else 128


def _sm90_check(key):
    if key["precision"] == "fp8" and key["heads"] == 16:
        return "fp8 takes 32 or 64 q heads per KV head (upstream's _interface_sm90)"
    if key["unchecked"] and not (key["precision"] == "fp8" and key["heads"] == 64 and not key["varlen"]):
        return "unchecked is upstream's fp8 H64 BSHD variant"
    if key["masked"] and not key["unchecked"]:
        return "masked is a refinement of unchecked"
    return None


def _sm100_check(key):
    if key["precision"] != "bf16" and key["w_dtype"] != "bfloat16":
        return "the block-scaled kernels take a bf16 W (upstream's validate_block_scaled_inputs)"
    return None


# Ops whose cubins bake the target's SM count (one entry per SM count; a GPU needs its own): none here, so
# any target of the GPU's arch serves it (the build checks the cubins agree when a manifest has several)
SM_COUNT_OPS = frozenset()

OPS = {
    "fwd_sm100": Op(fields={"precision": Choice(*SM100_PRECISIONS), "w_dtype": Choice("bfloat16", "float32"), "heads": Choice(*SM100_HEADS),
                            "ratio": IntRange(1, MAX_RATIO), "varlen": _BOOL, "offsets": _BOOL},
                    check=_sm100_check, arches=SM100),
    "fwd_sm90": Op(fields={"precision": Choice("bf16", "fp8"), "w_dtype": Choice("bfloat16", "float32"), "heads": Choice(16, 32, 64),
                           "ratio": IntRange(1, MAX_RATIO), "varlen": _BOOL, "offsets": _BOOL, "lse": _BOOL, "unchecked": _BOOL, "masked": _BOOL},
                   check=_sm90_check, arches=SM90),
}


def sm90_kernel(precision, w_dtype, heads, ratio, varlen, offsets, lse, s_q, s_k) -> tuple:
    """(op, key) upstream compiles for a call (its unchecked / masked rule from the shapes)."""
    unchecked = precision == "fp8" and heads == 64 and not varlen and s_q % (128 // heads) == 0
    return "fwd_sm90", {"precision": precision, "w_dtype": w_dtype, "heads": heads, "ratio": ratio, "varlen": bool(varlen),
                        "offsets": bool(offsets), "lse": bool(lse), "unchecked": unchecked, "masked": unchecked and s_k % 64 == 0}


def sm100_kernel(precision, w_dtype, heads, ratio, varlen, offsets) -> tuple:
    """(op, key) upstream compiles for an SM100 call (its key holds no shapes and no scale)."""
    return "fwd_sm100", {"precision": precision, "w_dtype": w_dtype, "heads": heads, "ratio": ratio, "varlen": bool(varlen), "offsets": bool(offsets)}
