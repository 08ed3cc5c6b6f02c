"""Policy of the DSA dense indexer backward (cudnn.deepseek_sparse_attention.indexer_backward, 1.32.0):
``dense_indexer_backward_wrapper`` / ``DenseIndexerBackward``, the full-KV (warm-up) form of the indexer
backward: raw dense scores and their denominators in, the KL score gradient, then the indexer GEMMs.

Ops (docs/research/dense-indexer-backward.md: 56 cubins over 28 configurations built both ways,
byte-identical; what changes a cubin was measured by compiling two values):

  score_grad       ScoreGradDense (SM100): varlen (THD), ratio, offsets (q causal offsets)
  gemm             DenseIndexerBackward2QGemmSm100: heads, varlen, ratio, offsets
  score_grad_sm90  ScoreGradDenseSm90: varlen, ratio, offsets
  gemm_sm90        IndexerBackwardSm90(is_dense=True): heads, varlen, ratio, offsets

Not in the keys because they do not change the cubin: batch, sequence lengths, sm_scale, loss_coeff (all
run-time values), d_index_k's dtype (the kernels always reduce into fp32). Upstream's SM100 score-grad
cache key also holds heads and head dim; its cubin does not depend on them. block_I is keyed upstream
and does change the cubins; only its default, 128, is shipped (the GEMM's TMEM layout assumes it).
Heads: upstream requires >= 64, and H 64 is what runs (the SM100 GEMM at H 128 needs more shared
memory than a B200 has).

The order of work per call (one stream), as upstream's ``execute``:

  zero the fp32 dK (d_index_k itself, or the workspace behind a bf16 one)
  -> score-grad (overwrites index_score with the gradient signal) -> GEMM -> bf16 cast of dK
"""

from ._math import round_up
from .arch import SM90, SM100, is_sm100
from .keys import Choice, IntRange, Op

__all__ = ["FAMILY", "OPS", "DIM", "BLOCK_I", "HEADS", "WS_ALIGN", "kernels", "workspace_bytes"]

FAMILY = "dsa_dense_indexer_backward"
DIM = 128
BLOCK_I = 128
HEADS = (64,)
WS_ALIGN = 128  # cudnn.api_base.ws_align

_BOOL = Choice(False, True)
_RATIO = IntRange(1, 1024)  # upstream accepts any ratio >= 1; each is its own cubin
_SHAPE = {"varlen": _BOOL, "ratio": _RATIO, "offsets": _BOOL}


def _score_of(op):
    return lambda key: [(op, {k: key[k] for k in _SHAPE})]


# Ops whose cubins bake the target's SM count (one entry per SM count; a GPU needs its own): none here, so
# any target of the GPU's arch serves it (the build checks the cubins agree when a manifest has several)
SM_COUNT_OPS = frozenset()

OPS = {
    "score_grad": Op(fields=dict(_SHAPE), arches=SM100),
    "gemm": Op(fields={"heads": Choice(*HEADS), **_SHAPE}, requires=_score_of("score_grad"), arches=SM100),
    "score_grad_sm90": Op(fields=dict(_SHAPE), arches=SM90),
    "gemm_sm90": Op(fields={"heads": Choice(*HEADS), **_SHAPE}, requires=_score_of("score_grad_sm90"), arches=SM90),
}


def kernels(arch, heads, varlen, ratio, offsets) -> dict:
    """role -> (op, key) of one call, as upstream's factory for the device's major picks them."""
    shape = {"varlen": bool(varlen), "ratio": int(ratio), "offsets": bool(offsets)}
    sfx = "" if is_sm100(arch) else "_sm90"
    return {"score_grad": ("score_grad" + sfx, dict(shape)), "gemm": ("gemm" + sfx, {"heads": int(heads), **shape})}


def workspace_bytes(d_index_k_numel, d_index_k_f32) -> int:
    """cudnn's ``DenseIndexerBackward.scratch_workspace_bytes()``: the fp32 dK accumulator behind a bf16
    ``d_index_k`` (128-byte aligned); none for an fp32 one."""
    return 0 if d_index_k_f32 else round_up(int(d_index_k_numel) * 4, WS_ALIGN)
