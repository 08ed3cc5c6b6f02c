"""Policy of the DSA sparse attention forward (cudnn.deepseek_sparse_attention.sparse_attention_forward,
1.32.0): ``sparse_attention_forward_wrapper`` / ``SparseAttentionForward``. SM100 only: upstream has
no SM90 kernel.

One op, ``fwd``: ``SparseAttentionForwardSm100Head64`` (H 64, D 512 or 576: one CTA per query) or
``SparseAttentionForwardSm100Head128SmallTopKPrefill`` (H 128, D 512: two-CTA clusters over a
problem-sized CLC grid). Upstream's compile key is (device, capability, variant, H, D, q / kv /
index dtypes, sink?, topk_length?, indexer_topk); the device and capability pick the arch, kv's
dtype is q's and the indices are int32, the variant follows from (H, D). What is left, every field
measured to change the cubin (docs/research/sparse-attention-forward.md):

  heads          64 or 128
  dim            q / kv head dim: 512, or 576 (H 64; the last 64 columns enter Q.K only)
  dtype          bf16 or f16
  indexer_topk   the slots whose running (max, sum) the kernel snapshots as ``lse_indexer``:
                 0 (none), 512, 1024, 2048 (H 64) / 0, 512, 1024 (H 128)
  sink           an fp32 sink logit per head
  topk_length    a per-query count of valid slots

Shapes and the scale are run-time values. No SM count, no workspace, one launch; the index rows are
read 64 slots at a time (upstream pads them with -1 to a multiple of 64).
"""

from .arch import SM100
from .keys import Choice, Op

__all__ = ["FAMILY", "OPS", "HEADS", "DIMS", "DV", "INDEXER_TOPK", "SLOT_TILE", "IDX_ALIGN", "kernel", "padded_topk"]

FAMILY = "dsa_sparse_attention_forward"
HEADS = (64, 128)
DIMS = (512, 576)
DV = 512  # the value width: kv[:, :512]
INDEXER_TOPK = {64: (0, 512, 1024, 2048), 128: (0, 512, 1024)}
SLOT_TILE = 64  # the kernels read whole tiles of 64 index slots
IDX_ALIGN = 32  # the index rows' base alignment upstream stages to (H128 reads 32 bytes at a time)
_BOOL = Choice(False, True)


def _check(key):
    if key["heads"] == 128 and key["dim"] != 512:
        return "H 128 takes D 512 only (upstream's variants: (64, 512), (64, 576), (128, 512))"
    if key["indexer_topk"] not in INDEXER_TOPK[key["heads"]]:
        return f"H {key['heads']} takes indexer_topk {INDEXER_TOPK[key['heads']]}"
    return None


# Ops whose cubins bake the target's SM count (one entry per SM count; a GPU needs its own): none here, so
# any target of the GPU's arch serves it (the build checks the cubins agree when a manifest has several)
SM_COUNT_OPS = frozenset()

OPS = {
    "fwd": Op(fields={"heads": Choice(*HEADS), "dim": Choice(*DIMS), "dtype": Choice("bf16", "f16"), "indexer_topk": Choice(0, 512, 1024, 2048),
                      "sink": _BOOL, "topk_length": _BOOL},
              check=_check, arches=SM100),
}


def padded_topk(k: int) -> int:
    """The index row width the kernels read: ``k`` rounded up to a multiple of 64 (upstream pads with -1)."""
    return -(-k // SLOT_TILE) * SLOT_TILE


def kernel(heads, dim, dtype, indexer_topk, sink, topk_length) -> tuple:
    """(op, key) upstream compiles for a call."""
    return "fwd", {"heads": heads, "dim": dim, "dtype": dtype, "indexer_topk": indexer_topk, "sink": bool(sink), "topk_length": bool(topk_length)}
