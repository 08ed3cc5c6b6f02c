"""Policy of the DSA indexer backward family (cudnn.deepseek_sparse_attention.indexer_backward, 1.32.0).

Ops and their compile keys. Batch and sequence lengths are run-time values everywhere upstream keeps
them dynamic; what upstream derives from the device (SM count, capability) or from the row count
(persistence, v2 ticket slots) is a key field here, checked against upstream's own policy on every build:

  score_grad       ScoreGradSm100: topk, zero_dk (the fp32 dK clear folded into the launch)
  gemm             IndexerBackwardSm100.kernel_gemm: heads, topk, topk_global, persistent (upstream's
                   choice from B*S_q vs the grid), pdl (score-grad -> GEMM overlap), deterministic +
                   planes; the persistent grid is the target's SM count (or the plane count)
  reduce_dk        DeterministicDkReduceSm100: out dtype, planes
  gemm_v2          IndexerBackwardV2Sm100 (backend "sm100_v2"): topk, rows_per_cta = ceil(B*S_q /
                   num_ctas) (upstream keys ticket_slots and ring depth, both derived from it), dw dtype,
                   idx_local, deterministic + planes
  score_grad_sm90  ScoreGradSm90: topk (probability-domain scores, as upstream's sm90 factory)
  gemm_sm90        IndexerBackwardSm90.kernel: heads, topk, topk_global

The order of work per call (kernels on one stream):

  SM90 (H200)            zero fp32 dK -> ScoreGradSm90 -> IndexerBackwardSm90 -> bf16 cast
  SM100 default          ScoreGradSm100 (clears fp32 dK in the same launch) -> GEMM (PDL) -> cast
  SM100 deterministic    zero planes -> ScoreGradSm100 -> GEMM on fixed-owner planes (PDL) -> reduce
  SM100 sm100_v2         zero counter + dK (or planes) -> ScoreGradSm100 -> v2 GEMM -> cast / reduce
"""

from ._math import cdiv, round_up
from .arch import SM90, SM100, is_sm100
from .keys import Choice, IntRange, Op

__all__ = [
    "FAMILY", "OPS", "BACKENDS", "PLANES", "DEFAULT_PLANES", "SHORT_TOPK", "DIM", "BLOCK_I", "WS_ALIGN", "V2_COUNTER_CHUNK",
    "gemm_persistent", "v2_schedule", "kernels", "workspace_bytes",
]  # fmt: skip

FAMILY = "dsa_indexer_backward"
BACKENDS = ("default", "sm100_v2")
PLANES = (96, 128, 148)  # deterministic dK plane counts upstream specialises for
DEFAULT_PLANES = 96
# Upstream's short-row persistent set: topk 512 is always persistent, 128..384 only when the rows
# outnumber the grid, longer rows never (H64/H32, D128, block_I 128).
SHORT_TOPK = (128, 256, 384, 512)
DIM = 128
BLOCK_I = 128
WS_ALIGN = 128  # cudnn.api_base.ws_align: scratch chunks are carved at 128-byte boundaries
V2_COUNTER_CHUNK = round_up(8, WS_ALIGN)  # the ordinary v2 kernel's ticket counter, first in the workspace

_BOOL = Choice(False, True)
_PLANES = Choice(*PLANES)
_TOPK = IntRange(128, 2048, 128)


def _gemm_check(key):
    if key["deterministic"]:
        if not key["persistent"]:
            return "deterministic GEMMs are persistent (fixed-owner rows)"
        if not key["pdl"]:
            return "the op launches the deterministic GEMM right after score-grad, with PDL"
    else:
        if key["planes"] != DEFAULT_PLANES:
            return "planes is a deterministic specialisation; keep it at 96 otherwise"
        if key["topk"] == 512 and not key["persistent"]:
            return "upstream always runs topk 512 persistent"
        if key["topk"] not in SHORT_TOPK and key["persistent"]:
            return f"upstream runs topk {key['topk']} non-persistent"
    return None


def _v2_check(key):
    if not key["deterministic"] and key["planes"] != DEFAULT_PLANES:
        return "planes is a deterministic specialisation; keep it at 96 otherwise"
    return None


def _companions(key, zero_dk):
    """What a GEMM needs beside it: the score-grad of its topk, and both reductions when deterministic."""
    need = [("score_grad", {"topk": key["topk"], "zero_dk": zero_dk})]
    if key["deterministic"]:
        need += [("reduce_dk", {"out": o, "planes": key["planes"]}) for o in ("bf16", "f32")]
    return need


# Ops whose cubins bake the target's SM count (persistent grid / v2 num_ctas = the SM count): a GPU runs them
# only from a target with its own SM count. The others serve any target of the GPU's arch (the build checks
# their cubins agree across the SM counts of a manifest)
SM_COUNT_OPS = frozenset({"gemm", "gemm_v2"})

OPS = {
    "score_grad": Op(fields={"topk": _TOPK, "zero_dk": _BOOL}, arches=SM100),
    "gemm": Op(
        fields={"heads": Choice(32, 64), "topk": _TOPK, "topk_global": _BOOL, "persistent": _BOOL, "pdl": _BOOL, "deterministic": _BOOL,
                "planes": _PLANES},
        check=_gemm_check,
        requires=lambda key: _companions(key, zero_dk=not key["deterministic"]),
        arches=SM100,
    ),  # fmt: skip
    "reduce_dk": Op(fields={"out": Choice("bf16", "f32"), "planes": _PLANES}, arches=SM100),
    "gemm_v2": Op(
        fields={"topk": _TOPK, "rows_per_cta": IntRange(1, 1 << 20), "dw": Choice("bf16", "f32"), "idx_local": _BOOL, "deterministic": _BOOL,
                "planes": _PLANES},
        check=_v2_check,
        requires=lambda key: _companions(key, zero_dk=False),
        arches=SM100,
    ),  # fmt: skip
    "score_grad_sm90": Op(fields={"topk": _TOPK}, arches=SM90),
    "gemm_sm90": Op(
        fields={"heads": Choice(64, 128), "topk": _TOPK, "topk_global": _BOOL},
        requires=lambda key: [("score_grad_sm90", {"topk": key["topk"]})],
        arches=SM90,
    ),
}


def gemm_persistent(topk: int, rows: int, grid: int) -> bool:
    """Upstream's launch policy for the non-deterministic SM100 GEMM (H32/H64, D128, block_I 128)."""
    return topk in SHORT_TOPK and (topk == 512 or rows > grid)


def v2_schedule(rows_per_cta: int, deterministic: bool) -> tuple:
    """(ticket_slots, ring_depth) of the v2 kernel, as upstream's factory derives them."""
    if deterministic:
        slots = max(2, rows_per_cta)
        return slots, min(4, slots)
    return rows_per_cta + 8, 4


def kernels(arch, batch, seqlen_q, heads, topk, *, topk_indices_global=False, backend="default", deterministic=False,
            deterministic_dk_planes=DEFAULT_PLANES, d_index_k_f32=False, d_weights_f32=False, target_sm_count=None) -> dict:
    """Which shipped (op, key) serves each stage of one call, by upstream's policy: role -> (op, key).

    ``target_sm_count`` is the SM count the build's target for ``arch`` declared (persistent grids are
    baked with it)."""
    glob, planes, rows = bool(topk_indices_global), int(deterministic_dk_planes), batch * seqlen_q
    if not is_sm100(arch):
        return {"score_grad": ("score_grad_sm90", {"topk": topk}), "gemm": ("gemm_sm90", {"heads": heads, "topk": topk, "topk_global": glob})}
    out = {}
    if backend == "sm100_v2":
        num_ctas = planes if deterministic else target_sm_count
        out["gemm"] = ("gemm_v2", {"topk": topk, "rows_per_cta": cdiv(rows, num_ctas), "dw": "f32" if d_weights_f32 else "bf16",
                                   "idx_local": (not glob) and batch > 1, "deterministic": bool(deterministic), "planes": planes})
        out["score_grad"] = ("score_grad", {"topk": topk, "zero_dk": False})
    elif deterministic:
        out["gemm"] = ("gemm", {"heads": heads, "topk": topk, "topk_global": glob, "persistent": True, "pdl": True, "deterministic": True,
                                "planes": planes})
        out["score_grad"] = ("score_grad", {"topk": topk, "zero_dk": False})
    else:
        # the op launches the GEMM right behind score-grad, so always the PDL variant (as upstream's wrapper)
        out["gemm"] = ("gemm", {"heads": heads, "topk": topk, "topk_global": glob, "persistent": gemm_persistent(topk, rows, target_sm_count),
                                "pdl": True, "deterministic": False, "planes": DEFAULT_PLANES})
        out["score_grad"] = ("score_grad", {"topk": topk, "zero_dk": True})
    if deterministic:
        out["reduce"] = ("reduce_dk", {"out": "f32" if d_index_k_f32 else "bf16", "planes": planes})
    return out


def workspace_bytes(batch, seqlen_k, head_dim=DIM, *, d_index_k_f32=False, backend="default", deterministic=False,
                    deterministic_dk_planes=DEFAULT_PLANES) -> int:
    """cudnn's ``IndexerBackward.scratch_workspace_bytes()``: the v2 ticket counter (8 bytes, ordinary
    v2 only) first; then the deterministic fp32 dK planes, or the fp32 dK accumulator a bf16
    ``d_index_k`` needs (none for an fp32 one)."""
    counter = V2_COUNTER_CHUNK if backend == "sm100_v2" and not deterministic else 0
    if deterministic:
        return counter + round_up(int(deterministic_dk_planes) * batch * seqlen_k * head_dim * 4, WS_ALIGN)
    return counter + (0 if d_index_k_f32 else round_up(batch * seqlen_k * head_dim * 4, WS_ALIGN))
