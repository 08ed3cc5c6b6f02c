"""Policy of the fused DSA indexer forward + top-k (cudnn.deepseek_sparse_attention.indexer_forward,
1.32.0): ``indexer_forward_top_k_wrapper`` and ``compress_topk_cand_buffer_size(_thd)``.

One call runs three kernels: the compressed-logits GEMM (``gemm``), stage 2 (``stage2``: the top-k of
each row's compact candidates, and the softmax over them) and, for global ids, local_to_global in
place (family dsa_topk_utils, ``preserve_negative=True``). cudnn keys the BSHD GEMM and stage 2 on
the batch, S_q, S_k and the scale, which do not change the cubin (docs/research/indexer-forward-top-k.md:
measured); what does, and is the key here:

  gemm    (SM100) precision, W dtype, heads (the compressed m tile follows), ratio, LSE, the candidate
          layout (``2d``: a (B, G(S_q)) view, bf16 without offsets or windows; ``1d``: flat, the batch
          base computed in the kernel; ``1d_cbo``: flat with int64 batch offsets, in THD and with causal
          offsets, which the long-S_q windows pass too: a window is the offsets kernel), THD, causal
          offsets.
  stage2  (any arch: SIMT) top-k, ratio, block threads (256 / 512 / 1024 from the rows and S_k,
          upstream's _select_topk_block_threads), causal offsets (BSHD: with the batch offsets; THD
          always has those), softmax, deterministic, THD.
"""

from .arch import SM100
from .keys import Choice, IntRange, Op

__all__ = ["FAMILY", "OPS", "MAX_TOP_K", "cand_floats", "gemm_m_block", "stage2_threads", "microbatch_rows", "uses_cand_2d"]

FAMILY = "dsa_indexer_forward_top_k"
MAX_TOP_K = 2048
_BOOL = Choice(False, True)
_COMPRESSED_Q_TOKENS = {64: 2, 32: 2, 16: 8, 8: 8, 4: 8}  # q tokens a bf16 tile packs on the compressed path (_support.py)


def _gemm_check(key):
    if key["precision"] != "bf16" and key["w_dtype"] != "bfloat16":
        return "the block-scaled kernels take a bf16 W"
    if key["cand"] == "2d" and (key["precision"] != "bf16" or key["varlen"] or key["offsets"]):
        return "the 2-D candidate view is bf16 BSHD without causal offsets only (upstream's _use_cand_2d)"
    if key["varlen"] and key["cand"] != "1d_cbo":
        return "THD stores through batch offsets"
    if not key["varlen"] and (key["cand"] == "1d_cbo") != key["offsets"]:
        return "in BSHD the batch offsets come with causal offsets (a caller's, or each long-S_q window's)"
    return None


# Ops whose cubins bake the target's SM count (one entry per SM count; a GPU needs its own): none here, so
# any target of the GPU's arch serves it (the build checks the cubins agree when a manifest has several)
SM_COUNT_OPS = frozenset()

OPS = {
    "gemm": Op(fields={"precision": Choice("bf16", "mxfp8", "mxfp4"), "w_dtype": Choice("bfloat16", "float32"), "heads": Choice(4, 8, 16, 32, 64),
                       "ratio": IntRange(1, 1024), "lse": _BOOL, "cand": Choice("2d", "1d", "1d_cbo"), "varlen": _BOOL, "offsets": _BOOL},
               check=_gemm_check, arches=SM100),
    "stage2": Op(fields={"top_k": IntRange(1, MAX_TOP_K), "ratio": IntRange(1, 1024), "threads": Choice(256, 512, 1024),
                         "offsets": _BOOL, "softmax": _BOOL, "deterministic": _BOOL, "varlen": _BOOL}),
}


def gemm_m_block(precision: str, heads: int) -> int:
    """The compressed GEMM's packed-M tile (upstream's resolve_m_block_size(128, compressed=True); 128 for mx)."""
    return heads * min(128 // heads, _COMPRESSED_Q_TOKENS[heads]) if precision == "bf16" else 128


def stage2_threads(rows: int, s_k: int) -> int:
    """Stage 2's block size (upstream's _select_topk_block_threads): 256 for 512 rows and more, else
    1024 from 8192 keys, else 512."""
    if rows >= 512:
        return 256
    return 1024 if s_k >= 8192 else 512


def cand_floats(n: int, ratio: int) -> int:
    """G(n): the compact candidates of the first ``n`` query rows, sum over i < n of (i + 1) // ratio."""
    q, s = divmod(n, ratio)
    return ratio * q * (q - 1) // 2 + q * (s + 1)


def uses_cand_2d(precision: str, s_q: int, ratio: int) -> bool:
    """Upstream's _use_cand_2d for a single-launch BSHD call without causal offsets."""
    return precision == "bf16" and cand_floats(s_q, ratio) < (1 << 31)


def microbatch_rows(s_q: int, batch: int, ratio: int) -> int:
    """Upstream's automatic window (_select_microbatch_rows), 0 for a single launch: bf16 BSHD without LSE
    or causal offsets windows from S_q 32768 (a multiple of ratio) in 8192 / 4096 / 2048 rows by batch."""
    if s_q < 32768 or s_q % ratio:
        return 0
    mb = 2048 if batch >= 8 else 4096 if batch >= 4 else 8192
    mb = mb // ratio * ratio
    return 0 if mb <= 0 or mb >= s_q else mb
