"""Policy of the DSA sparse attention backward family (cudnn.deepseek_sparse_attention.sparse_attention_backward, 1.32.0).

The route is the one cudnn's public ``sparse_attention_backward_wrapper`` takes: a prepared
``SparseAttentionBackward`` plan whose ``compile()`` builds ONE cute.compile artifact per call on SM100
(4-9 kernel launches inside one host function) and whose SM90 ``execute()`` compiles three separate
artifacts (preprocess, main, postprocess). Ops and their compile keys:

  bwd        SM100, ``_interface_sm100._compile_sm100_artifact`` (reached through
             ``_compile_nondeterministic_sm100`` / ``_compile_deterministic_sm100``): every backend except
             the D576 two-CTA one. Key: dtype, heads, dim (D_v = 512), topk (= max_topk, the index row
             width), topk_length (presence), deterministic, planes + relay (upstream's
             (deterministic_shards, relay_cluster_size): (1, 1) ordinary; generic deterministic
             (32|64|128, 1) or relay (32, 4) / (16, 8) / (8, 16), chosen by upstream from S_q and S_kv;
             (128, 1) for the tuned H96 / H128 deterministic classes), wide (Int64 addressing: upstream
             switches to fully dynamic strided tensor types when a tensor or workspace passes 2**31
             elements; the relay layouts only exist past a 16 GiB workspace, so they are always wide).
             The backend (generic_m64 | h16_m128 | h32_m64 | h96_h64_h32 | h128_2cta_m64) and its row
             tile are derived (:func:`select_backend`).
  bwd_d576   SM100, ``_interface_sm100_d576._compile_d576_2cta``: H96/H128 D576 BF16 two-CTA kernel
             (+ deterministic). Key: heads, topk (upstream's five tuned widths), topk_length,
             single_query (S_q == 1), split (the split regime: ``_split_count(S_q, topk, SMs) > 1``,
             S_q <= SMs // 4 on a B200), deterministic, wide. The deterministic compact-slot count is the
             target's ``min(SMs // 2, 76)``.
  pre_sm90   SM90 ``_FlashAttentionDSABackwardPreprocessSm90`` (sum OdO, LSE*log2e, d_sink): dtype.
  main_sm90  SM90 ``FlashAttentionDSABackwardSm90``: dtype, heads, dim, topk, topk_length.
  post_sm90  SM90 ``_FlashAttentionDSABackwardPostprocessSm90`` (f32 dKV accumulator -> dkv): dtype, dim.

Every function here is checked against upstream's own on every build (kernels/dsa_sparse_attention_backward.py).
"""

from ._math import cdiv, prod, round_up
from .arch import SM90, SM100, is_sm100
from .keys import Choice, IntRange, Op

__all__ = [
    "FAMILY", "OPS", "HEAD_DIM_V", "TWO_CTA_TOPK", "DETERMINISTIC_HEADS", "D576_BACKENDS", "GENERIC_DKV", "WS_ALIGN",
    "select_backend", "deterministic_dkv", "d576_split_count", "d576_compact_slots", "sm100_workspace_shapes", "sm100_workspace_bytes",
    "needs_wide", "sm90_post_chunk", "workspace_bytes", "kernels", "sm100_shape",
]  # fmt: skip

FAMILY = "dsa_sparse_attention_backward"
HEAD_DIM_V = 512  # D 512 -> D_v 512; D 576 (MLA: 512 + 64 rope) -> D_v 512
TWO_CTA_TOPK = (128, 512, 1024, 1152, 2048)  # upstream's tuned two-CTA widths (H128 D512, H96/H128 D576)
DETERMINISTIC_HEADS = (16, 32, 64, 96, 128)
D576_BACKENDS = ("h96_d576_2cta_m64", "h128_d576_2cta_m64")
WS_ALIGN = 128  # cudnn.api_base.ws_align
_BOOL = Choice(False, True)
DTYPES = Choice("bf16", "f16")
TOPK = IntRange(64, 2048, 64)
# deterministic generic-M64 dKV layouts: (planes, relay cluster size)
GENERIC_DKV = ((32, 1), (64, 1), (128, 1), (32, 4), (16, 8), (8, 16))


def select_backend(heads: int, dim: int, dtype: str, topk: int, deterministic: bool) -> tuple:
    """(backend, block_tile) of ``_select_sm100_backend`` for a contiguous plan on an SM100/SM103 device."""
    bf16 = dtype == "bf16"
    if bf16 and heads == 128 and dim == 512 and topk in TWO_CTA_TOPK:
        return "h128_2cta_m64", 64
    if bf16 and heads == 128 and dim == 576 and topk in TWO_CTA_TOPK:
        return "h128_d576_2cta_m64", 64
    if bf16 and heads == 96 and dim == 576 and topk in TWO_CTA_TOPK:
        return "h96_d576_2cta_m64", 64
    if heads == 96 and dim == 576:
        return "h96_h64_h32", 64
    if deterministic:
        return "generic_m64", 64
    if heads == 16 and dim == 576:
        return "h16_m128", 128
    if heads == 32 and dim == 576:
        return "h32_m64", 64
    return "generic_m64", 64


def deterministic_dkv(s_q: int, s_kv: int, dim: int, heads: int) -> tuple:
    """(planes, relay) upstream's generic deterministic policy picks (``deterministic_kernel_class``)."""
    k, d = round_up(s_kv, 8), round_up(dim, 8)
    need = cdiv(s_q, 4)
    planes = next((p for p in (32, 64, 128) if need <= p), 128)
    if planes * k * d * 4 <= 16 << 30:
        return planes, 1
    relay = 4 if s_q >= 8192 else 8
    if _relay_bytes(s_q, k, d, heads, relay) > 32 << 30:
        relay = 16
    return 128 // relay, relay


def _relay_bytes(s_q, k, d, heads, relay):
    return (128 // relay) * (k + _relay_mask_rows(s_q, k, d, heads, relay)) * d * 4


def _relay_mask_rows(s_q, k, d, heads, relay):
    words = cdiv(s_q, 128) * cdiv(heads, 64) * cdiv(k, 32 // relay)
    return cdiv(words, d)


def d576_split_count(s_q: int, topk: int, sm_count: int) -> int:
    """``_interface_sm100_d576._split_count``: query splitting for short batches (run-time Int32 argument)."""
    return max(1, min((sm_count // 2) // max(s_q, 1), 1 + cdiv(topk, 64) // 2, 8))


def d576_compact_slots(sm_count: int) -> int:
    """``_deterministic_compact_slots``: deterministic D576 wave width (one slot per two-SM cluster)."""
    return max(1, min(sm_count // 2, 76))


def sm100_workspace_shapes(s_q, s_kv, dim, heads, deterministic, backend) -> tuple:
    """The byte-shaped (LSE/OdO, dKV) workspaces of one SM100 call (``_workspace_shapes_sm100``)."""
    lse = (1, heads, round_up(s_q, 8), 8)
    k, d = round_up(s_kv, 8), round_up(dim, 8)
    if not deterministic:
        return lse, (1, 1, k, d * 4)
    if backend in D576_BACKENDS:
        return lse, (1, 96, k, d * 4)
    if backend != "generic_m64":
        return lse, (1, 128, k, d * 4)
    planes, relay = deterministic_dkv(s_q, s_kv, dim, heads)
    rows = k + (_relay_mask_rows(s_q, k, d, heads, relay) if relay > 1 else 0)
    return lse, (1, planes, rows, d * 4)


def sm100_workspace_bytes(s_q, s_kv, dim, heads, deterministic, backend) -> int:
    """Caller workspace of one SM100 call: both segments, each rounded up to 128 bytes."""
    lse, dkv = sm100_workspace_shapes(s_q, s_kv, dim, heads, deterministic, backend)
    return round_up(prod(lse), WS_ALIGN) + round_up(prod(dkv), WS_ALIGN)


def needs_wide(s_q, s_kv, dim, heads, topk, deterministic, backend) -> bool:
    """``_requires_wide_data_addressing``: any tensor (or, off the D576 route, workspace) past 2**31 elements."""
    spans = [s_q * heads * dim, s_q * heads * HEAD_DIM_V, s_q * heads, s_q * topk, s_kv * dim]
    if backend not in D576_BACKENDS:
        spans += [prod(s) for s in sm100_workspace_shapes(s_q, s_kv, dim, heads, deterministic, backend)]
    return any(s > 1 << 31 for s in spans)


# --- key rules -------------------------------------------------------------------------------------


def _bwd_check(key):
    backend, _ = select_backend(key["heads"], key["dim"], key["dtype"], key["topk"], key["deterministic"])
    if backend in D576_BACKENDS:
        return f"H{key['heads']} D576 bf16 topk {key['topk']} runs upstream's two-CTA D576 kernel: use op bwd_d576"
    if key["deterministic"] and key["heads"] not in DETERMINISTIC_HEADS:
        return f"upstream's deterministic backward supports heads {DETERMINISTIC_HEADS}"
    dkv = (key["planes"], key["relay"])
    if not key["deterministic"]:
        if dkv != (1, 1):
            return "planes/relay are deterministic specialisations: (1, 1) otherwise"
    elif backend == "generic_m64":
        if dkv not in GENERIC_DKV:
            return f"the generic deterministic kernel has (planes, relay) in {GENERIC_DKV}"
        if key["relay"] > 1 and not key["wide"]:
            return "relay layouts are chosen only past a 16 GiB dKV workspace, which upstream always compiles with wide (Int64) addressing"
    elif dkv != (128, 1):
        return f"the deterministic {backend} kernel has a fixed (planes, relay) = (128, 1)"
    return None


def _d576_check(key):
    if key["deterministic"] and key["split"]:
        return "upstream never splits queries in deterministic mode (split_count = 1)"
    if key["single_query"] and not key["deterministic"] and not key["split"]:
        return "upstream always splits a single query (split_count > 1 for S_q = 1 on >= 4 SMs)"
    return None


# Ops whose cubins bake the target's SM count (the D576 split regime and compact slots): a GPU runs them only
# from a target with its own SM count. The others serve any target of the GPU's arch (the build checks their
# cubins agree across the SM counts of a manifest)
SM_COUNT_OPS = frozenset({"bwd_d576"})

OPS = {
    "bwd": Op(
        fields={
            "dtype": DTYPES,
            "heads": Choice(16, 32, 64, 96, 128),
            "dim": Choice(512, 576),
            "topk": TOPK,
            "topk_length": _BOOL,
            "deterministic": _BOOL,
            "planes": Choice(1, 8, 16, 32, 64, 128),
            "relay": Choice(1, 4, 8, 16),
            "wide": _BOOL,
        },
        check=_bwd_check,
        arches=SM100,
    ),
    "bwd_d576": Op(
        fields={
            "heads": Choice(96, 128),
            "topk": Choice(*TWO_CTA_TOPK),
            "topk_length": _BOOL,
            "single_query": _BOOL,
            "split": _BOOL,
            "deterministic": _BOOL,
            "wide": _BOOL,
        },
        check=_d576_check,
        arches=SM100,
    ),
    "pre_sm90": Op(fields={"dtype": DTYPES}, arches=SM90),
    "main_sm90": Op(
        fields={"dtype": DTYPES, "heads": Choice(16, 32, 64, 96, 128), "dim": Choice(512, 576), "topk": TOPK, "topk_length": _BOOL},
        requires=lambda key: [("pre_sm90", {"dtype": key["dtype"]}), ("post_sm90", {"dtype": key["dtype"], "dim": key["dim"]})],
        arches=SM90,
    ),
    "post_sm90": Op(fields={"dtype": DTYPES, "dim": Choice(512, 576)}, arches=SM90),
}

# SM90 launch constants of flash_attn_bwd_sm90 (tiles, threads); its fp32 scratch rounds S_q and S_kv
# to the tiles and D to a multiple of 32
SM90_TILE_M, SM90_TILE_N, SM90_THREADS, SM90_PRE_THREADS = 64, 64, 256, 256
SM90_DIM_MULTIPLE = 32


def sm90_post_chunk(dim: int) -> int:
    """hdim_chunk of the SM90 postprocess (also its thread count)."""
    return 64 if dim == 576 else min(128, dim)


def workspace_bytes(total_s_q, total_s_kv, head_dim, num_heads, *, arch, topk=None, deterministic=False) -> int:
    """cudnn's ``SparseAttentionBackward.scratch_workspace_bytes()``: uint8 bytes ``workspace=`` must hold.

    SM90: dPsum and log2-scaled LSE (each S_q rounded to 64 x H fp32) and the fp32 dKV accumulator
    (S_kv rounded to 64 x D rounded to 32), each chunk 128-byte aligned. SM100: the LSE/OdO and dKV
    workspaces of the selected backend.
    """
    if not is_sm100(arch):
        stats = round_up(round_up(total_s_q, SM90_TILE_M) * num_heads * 4, WS_ALIGN)
        return 2 * stats + round_up(round_up(total_s_kv, SM90_TILE_N) * round_up(head_dim, SM90_DIM_MULTIPLE) * 4, WS_ALIGN)
    if topk is None:
        raise ValueError("pass topk= (the index row width) for an SM100 arch: it selects the backend")
    backend, _ = select_backend(num_heads, head_dim, "bf16", topk, deterministic)
    return sm100_workspace_bytes(total_s_q, total_s_kv, head_dim, num_heads, deterministic, backend)


def kernels(arch, heads, head_dim, topk, *, has_topk_length=False, dtype="bf16", deterministic=False, s_q=1, s_kv=1, sm_count=148) -> dict:
    """Which shipped (op, key) serves each stage of one call: role -> (op, key).

    SM90: three artifacts (pre, main, post). SM100: one artifact ("bwd") whose host function launches
    every kernel; its key follows upstream's plan: the backend, the deterministic dKV layout (from S_q
    and S_kv), wide addressing (from the extents) and, on the D576 route, the query-split regime (from
    the device's SM count) and S_q == 1.
    """
    if not is_sm100(arch):
        return {
            "pre": ("pre_sm90", {"dtype": dtype}),
            "main": ("main_sm90", {"dtype": dtype, "heads": heads, "dim": head_dim, "topk": topk, "topk_length": bool(has_topk_length)}),
            "post": ("post_sm90", {"dtype": dtype, "dim": head_dim}),
        }
    det = bool(deterministic)
    backend, _ = select_backend(heads, head_dim, dtype, topk, det)
    wide = needs_wide(s_q, s_kv, head_dim, heads, topk, det, backend)
    if backend in D576_BACKENDS:
        split = not det and d576_split_count(s_q, topk, sm_count) > 1
        return {"bwd": ("bwd_d576", {"heads": heads, "topk": topk, "topk_length": bool(has_topk_length), "single_query": s_q == 1, "split": split,
                                     "deterministic": det, "wide": wide})}
    planes, relay = (1, 1) if not det else deterministic_dkv(s_q, s_kv, head_dim, heads) if backend == "generic_m64" else (128, 1)
    return {"bwd": ("bwd", {"dtype": dtype, "heads": heads, "dim": head_dim, "topk": topk, "topk_length": bool(has_topk_length),
                            "deterministic": det, "planes": planes, "relay": relay, "wide": wide})}


# Candidate (S_q, S_kv) for an SM100 key: some key fields are derived from the extents (wide addressing,
# the deterministic dKV layout, the D576 split regime, S_q == 1), so checking an entry against upstream's
# plan, or running the op's call of it, needs extents that select it.
_SHAPE_SQ = (512, 1, 16, 128, 200, 4096, 8192, 20000, 30000, 100000)
_SHAPE_SKV = (4096, 8192, 1 << 16, 1 << 17, 1 << 20, 1 << 21, 1 << 22, 1 << 23)


def sm100_shape(op: str, key: dict, sm_count: int) -> tuple:
    """The first candidate (S_q, S_kv) at which :func:`kernels` serves a call with the SM100 entry (op, key)."""
    dim, dtype = (576, "bf16") if op == "bwd_d576" else (key["dim"], key["dtype"])
    for sq in _SHAPE_SQ:
        for skv in _SHAPE_SKV:
            got = kernels("sm_100a", key["heads"], dim, key["topk"], has_topk_length=key["topk_length"], dtype=dtype,
                          deterministic=key["deterministic"], s_q=sq, s_kv=skv, sm_count=sm_count)["bwd"]
            if got == (op, key):
                return sq, skv
    raise ValueError(f"no (S_q, S_kv) among {_SHAPE_SQ} x {_SHAPE_SKV} selects {op} {key}")
