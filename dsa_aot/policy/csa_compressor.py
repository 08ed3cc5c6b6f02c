"""Policy of the CSA compressor family (cudnn.csa.compressor, nvidia-cudnn-frontend 1.32.0).

Ops and their compile keys:
  fwd_r128    ratio-128 forward; the schedule upstream's _fwd_schedule_r128 picks for the nb_total bucket
  bwd_r128    ratio-128 backward; _bwd_schedule_r128's bucket; deterministic dAPE or not
  fwd, bwd    ratio 2/4 generic kernels, any head_dim (one compile per d)
  dape_reduce the fixed-order dAPE reduction of the deterministic backward (serial, or split in 2 kernels)

The spec (kernels/csa_compressor.py) checks on every build that upstream picks one schedule per
bucket below and that :func:`rows_r128` and the constants equal upstream's.
"""

from ._math import cdiv
from .keys import Choice, IntRange, Op

__all__ = [
    "FAMILY", "OPS", "BWD_ROWS", "DAPE_GROUP_PARTIALS", "MAX_HEAD_DIM", "R128_HEAD_DIMS",
    "bucket_of", "bucket_range", "rows_r128", "forward_kernel", "backward_kernels", "backward_workspace",
]  # fmt: skip

FAMILY = "csa_compressor"
_BOOL = Choice(False, True)


def _needs_reduce(key):
    """Deterministic backward reuses cudnn's fixed-order dAPE reduction: split at ratio 4 only."""
    if not key.get("deterministic"):
        return []
    return [("dape_reduce", {"split": key["ratio"] == 4})]


# Ops whose cubins bake the target's SM count (one entry per SM count; a GPU needs its own): none here, so
# any target of the GPU's arch serves it (the build checks the cubins agree when a manifest has several)
SM_COUNT_OPS = frozenset()

OPS = {
    "fwd_r128": Op(
        fields={"ratio": Choice(128), "coff": Choice(1, 2), "d": Choice(128, 512), "bucket": Choice("small", "default", "large")},
    ),
    "bwd_r128": Op(
        fields={"ratio": Choice(128), "coff": Choice(1, 2), "d": Choice(128, 512), "bucket": Choice("small", "default"), "deterministic": _BOOL},
        requires=_needs_reduce,
    ),
    "fwd": Op(fields={"ratio": Choice(2, 4), "coff": Choice(1, 2), "d": IntRange(1, 65536)}),
    "bwd": Op(fields={"ratio": Choice(2, 4), "coff": Choice(1, 2), "d": IntRange(1, 65536), "deterministic": _BOOL}, requires=_needs_reduce),
    "dape_reduce": Op(fields={"split": _BOOL}),
}

# constants upstream bakes into its launch code (compressor_sm100._BWD_ROWS, _DAPE_REDUCTION_GROUP_PARTIALS)
BWD_ROWS = 8  # output rows per CTA of the ratio-2/4 backward
DAPE_GROUP_PARTIALS = 32  # partials per group of the split dAPE reduction's first stage
MAX_HEAD_DIM = 128 * 65535
R128_HEAD_DIMS = (128, 512)  # upstream's validated envelope at ratio 128

# nb_total (= total_comp, output rows) ranges of the ratio-128 schedule buckets, inclusive.
# Upstream: compressor_sm100_r128._SMALL_NB_MAX = 128, _LARGE_NB_MIN = 1024, _BWD_SMALL_NB_MAX = 192.
_INF = 2**31 - 1
_BUCKETS = {
    "fwd_r128": (("small", 1, 128), ("default", 129, 1023), ("large", 1024, _INF)),
    "bwd_r128": (("small", 1, 192), ("default", 193, _INF)),
}


def bucket_range(op: str, bucket: str) -> tuple:
    """(lo, hi) nb_total of a ratio-128 bucket, inclusive."""
    for name, lo, hi in _BUCKETS[op]:
        if name == bucket:
            return lo, hi
    raise KeyError(f"{op} has no bucket {bucket!r} (buckets: {[b[0] for b in _BUCKETS[op]]})")


def bucket_of(op: str, nb_total: int) -> str:
    for name, lo, hi in _BUCKETS[op]:
        if lo <= nb_total <= hi:
            return name
    raise ValueError(f"nb_total={nb_total} is outside every {op} bucket")


def rows_r128(nb_total: int, d: int, coff: int, schedule, sm_count: int) -> int:
    """Output rows per CTA of the ratio-128 backward: upstream's _bwd_rows_per_cta (a run-time argument)."""
    vec, tchunks, threads_x = schedule[0], schedule[1], schedule[2]
    gy = cdiv(d // vec, threads_x)
    ctas_per_sm = 2 if coff == 2 else (4 if tchunks <= 4 else 3)
    return max(1, min(16, cdiv(nb_total * gy, ctas_per_sm * sm_count)))


def forward_kernel(ratio: int, d: int, coff: int, total_comp: int) -> tuple:
    """(op, key) of the entry that serves a forward call with ``total_comp`` > 0 output rows."""
    if ratio == 128:
        return "fwd_r128", {"ratio": 128, "d": d, "coff": coff, "bucket": bucket_of("fwd_r128", total_comp)}
    return "fwd", {"ratio": ratio, "d": d, "coff": coff}


def backward_kernels(ratio: int, d: int, coff: int, total_comp: int, deterministic: bool) -> dict:
    """role -> (op, key) of the entries that serve a backward call: 'main', and 'reduce' when deterministic."""
    det = bool(deterministic)
    if ratio == 128:
        out = {"main": ("bwd_r128", {"ratio": 128, "d": d, "coff": coff, "bucket": bucket_of("bwd_r128", total_comp), "deterministic": det})}
    else:
        out = {"main": ("bwd", {"ratio": ratio, "d": d, "coff": coff, "deterministic": det})}
    if det:
        out["reduce"] = ("dape_reduce", {"split": ratio == 4})
    return out


def backward_workspace(total_comp: int, ratio: int, d: int, coff: int, rows_per_cta: int | None = None) -> tuple:
    """(partials, split, bytes) of the deterministic backward's fp32 dAPE partials (+ the split stage).

    ``rows_per_cta``: ratio 128 only, :func:`rows_r128` of the call (it depends on the device's SMs)."""
    if total_comp <= 0:
        return 0, False, 0
    nelems = ratio * coff * d
    if ratio == 128:
        partials = cdiv(total_comp, rows_per_cta)
        return partials, False, partials * nelems * 4
    partials, split = cdiv(total_comp, BWD_ROWS), ratio == 4
    stage = cdiv(partials, DAPE_GROUP_PARTIALS) * nelems if split else 0
    return partials, split, (partials * nelems + stage) * 4
