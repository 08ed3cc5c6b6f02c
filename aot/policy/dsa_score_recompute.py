"""Policy of the DSA score recompute (cudnn.deepseek_sparse_attention.score_recompute, 1.32.0).

So far the sparse indexer's: ``sparse_indexer_score_recompute_wrapper``, the indexer's predicted
distribution ``softmax_i(sum_h relu(q_h . k_topk[i]) w_h)`` over each query's top-k slots (the dense
and attention wrappers follow; docs/research/score-recompute.md has all four).

Ops and what changes their cubins (measured by compiling two values; docs/research/score-recompute.md §3):

  sparse_indexer       SparseScoreRecomputeSm100 "indexer": heads, topk, length (topk_length given),
                       topk_global; derived m = heads, n = 128, kv_stage and whether the slot ids
                       fit in shared memory (upstream's 227 KiB budget)
  sparse_indexer_sm90  SparseScoreRecomputeSm90 (index scores): the same fields; derived tile_m =
                       min(heads, 64) and the head tiles

Not in the keys: batch and sequence lengths (both arches), the scale (no wrapper passes one: 1.0).
D is 128. One launch per call; on SM90 the weights are first copied transposed, (B, S_q, H) ->
(B, H, S_q), as upstream does on every call (the kernel reads S_q as the unit stride): into the
caller's workspace here.
"""

from ._math import round_up
from .arch import SM90, SM100, is_sm100
from .keys import Choice, IntRange, Op

__all__ = ["FAMILY", "OPS", "DIM", "N_BLOCK", "SMEM_BYTES", "WS_ALIGN", "sm100_stages", "sm90_tiles", "kernels", "workspace_bytes"]

FAMILY = "dsa_score_recompute"
DIM = 128
N_BLOCK = 128  # SM100 sparse: keys per tile
SMEM_BYTES = 227 * 1024  # upstream's SM100 budget (_interface_sm100._SM100_SMEM_BYTES)
WS_ALIGN = 128
_SM90_MAX_TILE_M = 64

_BOOL = Choice(False, True)
_SPARSE = {"heads": Choice(16, 32, 64, 128),  # all compile upstream; the manifest ships 64
            "topk": IntRange(128, 2048, 128), "length": _BOOL, "topk_global": _BOOL}

OPS = {
    "sparse_indexer": Op(fields=dict(_SPARSE), arches=SM100),
    "sparse_indexer_sm90": Op(fields=dict(_SPARSE), arches=SM90),
}


def sm100_stages(heads: int, topk: int, dim: int = DIM) -> tuple:
    """(kv_stage, topk_in_smem) of the SM100 sparse indexer, as upstream sizes them from its shared-memory budget."""
    d = -(-dim // 16) * 16
    sk, sq = N_BLOCK * d * 2, heads * d * 2
    fixed = heads * 2 * 2 + 2048
    overhead = topk * 2 * 4 + fixed
    stage = min(4, max(1, (SMEM_BYTES - sq - overhead) // sk))
    if sq + sk * stage + overhead <= SMEM_BYTES:
        return stage, True
    return min(4, max(1, (SMEM_BYTES - sq - fixed) // sk)), False


def sm90_tiles(heads: int) -> tuple:
    """(tile_m, head tiles) of the SM90 index-score kernel."""
    tile_m = min(heads, _SM90_MAX_TILE_M)
    return tile_m, heads // tile_m


def kernels(arch, heads, topk, length, topk_global) -> dict:
    """role -> (op, key) of one call."""
    key = {"heads": int(heads), "topk": int(topk), "length": bool(length), "topk_global": bool(topk_global)}
    return {"main": ("sparse_indexer" if is_sm100(arch) else "sparse_indexer_sm90", key)}


def workspace_bytes(arch, batch, seqlen_q, heads) -> int:
    """Bytes of the caller's workspace: on SM90 the (B, H, S_q) bf16 copy of the weights (128-byte
    rounded); none on SM100."""
    return 0 if is_sm100(arch) else round_up(batch * seqlen_q * heads * 2, WS_ALIGN)
