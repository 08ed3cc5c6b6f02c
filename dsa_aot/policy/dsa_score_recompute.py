"""Policy of the DSA score recompute (cudnn.deepseek_sparse_attention.score_recompute, 1.32.0): the sparse
indexer's softmax and the sparse attention's L1-normalised distribution over each query's top-k slots, and
their dense twins over every key (docs/research/score-recompute.md; its §3 measured which fields change a
cubin: the ``OPS`` keys below). Derived per key as upstream derives them, each rule held against upstream's
code by ``check_policy``: stages, tiles, whether the slot ids fit in shared memory, the mxfp8 attention's
D512 k_block (a key field: the call picks the entry). Not in the keys: batch and sequence lengths, and the
scales the kernels take as arguments (SM100; the SM90 attention's ``f32(scale * log2 e)``, which its host
code bakes in per compile, is the launcher's per-call argument: the spec's ``LITERALS``). The SM90 dense
indexer bakes its scale in as a float32 immediate (an F32 field: the manifest lists the scales); on SM90 the
weights / LSE are first copied transposed, (B, S_q, H) -> (B, H, S_q), into the caller's workspace.
"""

from ._math import round_up
from .arch import SM90, SM100, is_sm100
from .keys import F32, Choice, IntRange, Op

__all__ = ["FAMILY", "OPS", "DIM", "DENSE_PRECISIONS", "MX_PRECISIONS", "MX_HEADS", "MX_KV_STAGE", "SF_VEC", "ATTN_PRECISIONS", "MX_ATTN_DIMS", "MX_LONG_K", "mx_heads", "mx_attention_tiles", "mx_zeroes_denom",
           "dense_attention_k_block", "ATTN_DIMS", "N_BLOCK", "SMEM_BYTES", "WS_ALIGN", "sm100_stages", "sm100_attention_tiles", "sm90_tiles", "kernels",
           "workspace_bytes", "DENSE_TILE", "dense_kv_stage", "f32", "dense_indexer_kernels", "sm100_dense_attention_tiles",
           "dense_attention_kernels"]

FAMILY = "dsa_score_recompute"
DIM = 128
N_BLOCK = 128  # SM100 sparse: keys per tile
SMEM_BYTES = 227 * 1024  # upstream's SM100 budget (_interface_sm100._SM100_SMEM_BYTES)
WS_ALIGN = 128
_SM90_MAX_TILE_M = 64

_BOOL = Choice(False, True)
_SPARSE = {"heads": Choice(16, 32, 64, 128),  # all compile upstream; the manifest ships 64
            "topk": IntRange(128, 2048, 128), "length": _BOOL, "topk_global": _BOOL}

ATTN_DIMS = (512, 576)
_ATTN = {"heads": Choice(16, 32, 64, 96, 128), "dim": Choice(*ATTN_DIMS), "topk": IntRange(128, 2048, 128), "length": _BOOL, "topk_global": _BOOL}


def _sm100_attention_check(key):
    h, d, topk = key["heads"], key["dim"], key["topk"]
    if h == 96 and d != 576:
        return "H96 compiles on SM100 at D576 only (D512 fails upstream: '48 is not a valid Repetition')"
    if key["length"] and sm100_attention_tiles(d, h, topk, True) == sm100_attention_tiles(d, h, topk, False):
        return (f"upstream drops topk_length at H{h} D{d} topk {topk} (the compact tiles equal the non-compact ones) and runs the "
                "non-compact kernel: list length = false for it")
    n = sm100_attention_tiles(d, h, topk, key["length"])[1]
    if topk % n:
        return f"topk {topk} is not a multiple of the kernel's {n}-key tile"
    return None


_DENSE = {"heads": Choice(16, 32, 64, 128), "ratio": IntRange(1, 1024), "offsets": _BOOL}  # heads: per KV head

DENSE_PRECISIONS = ("bf16", "mxfp8", "mxfp4")  # the SM100 dense indexer's (upstream's SM100_INDEXER_PRECISIONS)
MX_PRECISIONS = DENSE_PRECISIONS[1:]  # block-scaled: SM100 only (upstream's SM90 raises NotImplementedError)
MX_HEADS = (32, 64)  # q heads per KV head the block-scaled dense indexer takes (ValueError upstream otherwise)
MX_KV_STAGE = 24  # upstream's fixed block-scaled K stages (k_block 64; not the budget rule)
SF_VEC = 32  # values per e8m0 scale (upstream's sf_vec_size, the only one it takes)


ATTN_PRECISIONS = ("bf16", "mxfp8")  # the SM100 dense attention's (upstream's _normalize_dense_precision)
MX_ATTN_DIMS = (128, 512)  # the mxfp8 dense attention's head dims (upstream's contract: D128, or D512 at 64 / 128 heads)
MX_M_BLOCK = 128  # its m = n = 128 tiles: heads >= 64 (the base class asserts at most 2 query tokens a tile)
MX_LONG_K = 4096  # S_k hint from which the D512 mxfp8 attention takes 256-wide K blocks (upstream's dispatch)


def mx_heads(attention: bool) -> tuple:
    """The q heads per KV head (one KV head) a block-scaled dense score takes: the indexer 32 / 64 (upstream's
    ValueError otherwise); the mxfp8 attention 64 / 128 (D512: the kernel's ValueError; D128: its base class
    asserts ``128 // heads <= 2`` query tokens a tile, so H32 does not compile, research trap 11)."""
    return (64, 128) if attention else MX_HEADS


def mx_attention_tiles(dim: int, heads: int, k_block: int) -> tuple:
    """(m, n, k_block, kv_stage) of the mxfp8 dense attention kernel: upstream's fixed stages by k_block
    (_dense_attn_score_recompute; check_policy reads them there)."""
    if dim == 512:
        kv_stage = 7 if k_block == 64 else 3 if k_block == 256 else 9 if heads >= 128 else 7
    else:
        kv_stage = 4
    return MX_M_BLOCK, 128, k_block, kv_stage


def mx_zeroes_denom(dim: int, heads: int) -> bool:
    """Whether upstream zeroes ``denom`` (and ``out``) before the mxfp8 attention's launch: the kernels that
    accumulate into it (research trap 10); ``out`` is zeroed before every mxfp8 launch."""
    return (dim == 512 and heads >= 128) or (dim == 128 and heads == 64)


def dense_attention_k_block(precision: str, dim: int, heads: int, seqlen_k_hint: int) -> int:
    """The SM100 dense attention's K block, upstream's _dispatch_dense_attn_tile_params: bf16 by (dim, heads);
    mxfp8 D512 256 when the S_k hint (THD max_seqlen_k, BSHD S_k) is >= 4096, else 128; mxfp8 D128 64."""
    if precision == "bf16":
        return sm100_dense_attention_tiles(dim, heads)[2]
    if dim == 512:
        return 256 if seqlen_k_hint >= MX_LONG_K else 128
    return 64


def _dense_indexer_check(key):
    if key["precision"] in MX_PRECISIONS and key["heads"] not in MX_HEADS:
        return f"the block-scaled dense indexer takes {' or '.join(map(str, MX_HEADS))} heads per KV head (upstream raises ValueError)"
    return None


def _dense_attention_check(key):
    prec, h, d, kb = key["precision"], key["heads"], key["dim"], key["k_block"]
    if prec == "bf16":
        if d not in ATTN_DIMS:
            return f"the bf16 dense attention ships D {' / '.join(map(str, ATTN_DIMS))} (its tiles are upstream's table there)"
        want = sm100_dense_attention_tiles(d, h)[2]
        return None if kb == want else f"the bf16 dense attention at D{d} H{h} has k_block {want} (upstream's dispatch)"
    if d not in MX_ATTN_DIMS or h not in mx_heads(True):
        return (f"the mxfp8 dense attention takes D128 or D512 at {' or '.join(map(str, mx_heads(True)))} heads per KV head (upstream raises "
                "ValueError, or D128 H32 fails to compile)")
    ks = (128, 256) if d == 512 else (64,)
    if kb not in ks:
        return f"the mxfp8 dense attention at D{d} has k_block {' or '.join(map(str, ks))} (upstream's dispatch; 256 when S_k >= {MX_LONG_K})"
    return None


# Ops whose cubins bake the target's SM count (one entry per SM count; a GPU needs its own): none here, so
# any target of the GPU's arch serves it (the build checks the cubins agree when a manifest has several)
SM_COUNT_OPS = frozenset()

OPS = {
    "sparse_indexer": Op(fields=dict(_SPARSE), arches=SM100),
    "sparse_indexer_sm90": Op(fields=dict(_SPARSE), arches=SM90),
    "sparse_attention": Op(fields=dict(_ATTN), check=_sm100_attention_check, arches=SM100),
    "sparse_attention_sm90": Op(fields=dict(_ATTN), arches=SM90),
    "dense_indexer": Op(fields=dict(_DENSE, varlen=_BOOL, precision=Choice(*DENSE_PRECISIONS)), check=_dense_indexer_check, arches=SM100),
    "dense_indexer_sm90": Op(fields=dict(_DENSE, scale=F32()), arches=SM90),
    "dense_attention": Op(fields=dict(_DENSE, dim=Choice(128, *ATTN_DIMS), varlen=_BOOL, precision=Choice(*ATTN_PRECISIONS),
                                      k_block=Choice(64, 128, 256)), check=_dense_attention_check, arches=SM100),
    "dense_attention_sm90": Op(fields=dict(_DENSE, dim=Choice(*ATTN_DIMS)), arches=SM90),
}

DENSE_TILE = (128, 128, 64)  # SM100 dense indexer (m, n, k_block): upstream's _dispatch_dense_indexer_tile_params at D128


def dense_kv_stage(m: int, n: int, k: int, dim: int = DIM, per_head: int = 2, extra: int = 0) -> int:
    """The SM100 dense kernels' KV stages (upstream's _compute_dense_kv_stage); ``extra``: shared-memory bytes
    beside them (the sparse kernels' slot ids)."""
    d = -(-dim // 16) * 16
    return min(4, max(1, (SMEM_BYTES - m * d * 2 - (m * 2 * per_head + 2048) - extra) // (n * k * 2)))


def sm100_dense_attention_tiles(dim: int, heads: int) -> tuple:
    """(m, n, k_block, kv_stage) of the SM100 bf16 dense attention kernel (upstream's
    _dispatch_dense_attn_tile_params at D512 / D576 and _compute_dense_kv_stage; check_policy compares):
    two query tokens per tile when their Q fits beside one 128 x 64 K stage, else one."""
    d = -(-dim // 16) * 16
    m = heads * 2 if heads * 2 * d * 2 + 128 * 64 * 2 + heads * 2 * 2 * 4 + 4096 <= SMEM_BYTES else heads
    k = 128 if dim == 512 and heads in (64, 128) else 64
    return m, 128, k, dense_kv_stage(m, 128, k, dim, per_head=4)


def dense_attention_kernels(arch, heads, dim, ratio, varlen, offsets, precision="bf16", seqlen_k_hint=0) -> dict:
    """role -> (op, key) of one dense attention call (``heads`` per KV head): SM100 native BSHD / THD of the
    precision, its K block from ``seqlen_k_hint`` as upstream picks it (THD max_seqlen_k, BSHD S_k:
    :func:`dense_attention_k_block`), SM90 bf16 BSHD (no mxfp8 kernel: ValueError); the scale a run-time
    argument on both (SM90: the launcher's literal argument)."""
    key = {"heads": int(heads), "dim": int(dim), "ratio": int(ratio), "offsets": bool(offsets)}
    if is_sm100(arch):
        kb = dense_attention_k_block(precision, int(dim), int(heads), int(seqlen_k_hint))
        return {"main": ("dense_attention", dict(key, varlen=bool(varlen), precision=precision, k_block=kb))}
    if precision != "bf16":
        raise ValueError(f"precision {precision!r}: the mxfp8 dense attention is SM100 only")
    return {"main": ("dense_attention_sm90", key)}


def f32(x: float) -> float:
    """``x`` rounded to float32, as a kernel's float32 immediate holds it."""
    import struct

    return struct.unpack("<f", struct.pack("<f", x))[0]


def dense_indexer_kernels(arch, heads, ratio, varlen, offsets, scale, precision="bf16") -> dict:
    """role -> (op, key) of one dense indexer call (``heads`` per KV head). SM100: the native BSHD / THD
    kernel of the precision, the scale a run-time argument; SM90: the bf16 BSHD kernel (THD runs it per
    segment), keyed by the float32 scale it bakes in (no block-scaled kernel: ValueError)."""
    key = {"heads": int(heads), "ratio": int(ratio), "offsets": bool(offsets)}
    if is_sm100(arch):
        return {"main": ("dense_indexer", dict(key, varlen=bool(varlen), precision=precision))}
    if precision != "bf16":
        raise ValueError(f"precision {precision!r}: the block-scaled dense indexer is SM100 only")
    return {"main": ("dense_indexer_sm90", dict(key, scale=f32(scale)))}


def sm100_attention_tiles(dim: int, heads: int, topk: int, compact: bool) -> tuple:
    """(m, n, k_block or None) of the SM100 sparse attention kernel: upstream's tuned table
    (_interface_sm100._dispatch_sparse_attn_tile_params; check_policy compares them)."""
    if dim == 576 and heads == 96:
        return heads, 128, 192
    if compact:
        return {(512, 64): (heads, 64, None), (512, 128): (heads, 128, 128), (576, 64): (heads, 64, None),
                (576, 128): (heads, 64, 192)}.get((dim, heads), (heads, 64, None))
    if dim == 512 and heads == 64:
        return heads, 128, 256
    if dim == 512 and heads == 128:
        return (heads, 128, 128) if topk <= 512 else (heads, 128, 256)
    if dim == 576 and heads in (64, 128):
        return heads, 128, 192
    return heads, 64, None


def sm100_stages(heads: int, topk: int, dim: int = DIM, n: int = N_BLOCK, k: int | None = None, per_head: int = 2) -> tuple:
    """(kv_stage, topk_in_smem) of the SM100 sparse kernels, as upstream sizes them from its shared-memory
    budget (``per_head``: bytes of a weight (bf16, the indexer) or an LSE value (fp32, the attention))."""
    d = -(-dim // 16) * 16
    stage = dense_kv_stage(heads, n, k or d, dim, per_head, extra=topk * 2 * 4)  # the stages beside the slot ids in shared memory
    if heads * d * 2 + stage * n * (k or d) * 2 + heads * 2 * per_head + 2048 + topk * 2 * 4 <= SMEM_BYTES:
        return stage, True
    return dense_kv_stage(heads, n, k or d, dim, per_head), False


def sm90_tiles(heads: int, attention: bool = False) -> tuple:
    """(tile_m, head tiles) of the SM90 sparse kernel (the attention's H96: 48 x 2, upstream's special case)."""
    if attention and heads == 96:
        return 48, 2
    tile_m = min(heads, _SM90_MAX_TILE_M)
    return tile_m, heads // tile_m


def kernels(arch, heads, topk, length, topk_global, dim=None) -> dict:
    """role -> (op, key) of one sparse call: the indexer's, or with ``dim`` the attention's (SM100: topk_length dropped
    where upstream drops it)."""
    key = {"heads": int(heads), "topk": int(topk), "length": bool(length), "topk_global": bool(topk_global)}
    op = "sparse_indexer" if dim is None else "sparse_attention"
    if dim is not None:  # (SM100 runs the non-compact kernel where the compact tiles are the same)
        key["dim"] = int(dim)
        same = is_sm100(arch) and sm100_attention_tiles(dim, heads, topk, True) == sm100_attention_tiles(dim, heads, topk, False)
        key["length"] = key["length"] and not same
    return {"main": (op if is_sm100(arch) else op + "_sm90", key)}


def workspace_bytes(arch, batch, seqlen_q, heads, elem_bytes=2) -> int:
    """Bytes of the caller's workspace: on SM90 the (B, H, S_q) copy of the weights (bf16) or the LSE
    (fp32, ``elem_bytes`` 4), 128-byte rounded; none on SM100."""
    return 0 if is_sm100(arch) else round_up(batch * seqlen_q * heads * elem_bytes, WS_ALIGN)


def thd_segments(cu_q, cu_k) -> tuple:
    """The segments an SM90 THD dense call launches, from host ``cu_seqlens_q`` / ``cu_seqlens_k`` (int
    sequences): ((b, q_start, S_q, k_start, S_k), ...) for every segment with queries and keys, in batch
    order (upstream's host loop skips the others)."""
    return tuple((b, cu_q[b], cu_q[b + 1] - cu_q[b], cu_k[b], cu_k[b + 1] - cu_k[b]) for b in range(len(cu_q) - 1)
                 if cu_q[b + 1] > cu_q[b] and cu_k[b + 1] > cu_k[b])


def thd_workspace(segments, heads, elem_bytes=2) -> tuple:
    """(per segment (transposed weights / LSE, out, denom) byte offsets, total bytes) of an SM90 THD dense
    call's workspace: what upstream allocates per segment (the (1, H, S_q) transposed copy, the (1, S_q,
    S_k) scores and the (1, S_q) denominators the kernel writes, then copied into the packed outputs),
    each region 128-byte aligned and disjoint, so that one plan runs every segment's copy, launch and copy
    back in order."""
    offs, n = [], 0
    for _, _, sq, _, sk in segments:
        regions = []
        for size in (heads * sq * elem_bytes, sq * sk * 4, sq * 4):
            regions.append(n)
            n += round_up(size, WS_ALIGN)
        offs.append(tuple(regions))
    return tuple(offs), n
