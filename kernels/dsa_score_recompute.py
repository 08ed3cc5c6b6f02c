"""Spec of the DSA score recompute (cudnn.deepseek_sparse_attention.score_recompute, 1.32.0): so far the
sparse indexer's and the sparse attention's kernels.

``build`` presents what ``_interface_sm100._sparse_indexer_score_recompute`` and
``_interface_sm90._sparse_score_recompute`` pass to ``cute.compile``: every tensor through
``to_cute_tensor`` (gmem, 16-byte aligned, dynamic extents, dynamic strides but the unit innermost one),
an absent topk_length as None, the stream where upstream puts it (4th on SM90, last on SM100), the
scale as Float32 on SM100. docs/research/score-recompute.md: 16/16 (SM100) and 23/23 (SM90) sparse
indexer configurations and 51/51 (SM100) and 41/41 (SM90) sparse attention configurations built both
ways, byte-identical.

The SM90 attention kernel takes ``f32(softmax_scale * log2 e)`` as a kernel parameter that its host
code computes from the constructor's scale, so each compile bakes one value into the host code and
none into the cubin (measured: two scales, one cubin). The spec compiles with :data:`SM90_SCALE`;
``LITERALS`` makes that constant the launcher's trailing argument ``softmax_scale_log2``, which the op
passes per call (fidelity compiles upstream at another scale and must still get the same cubin).
"""

import math

from dsa_aot.policy import dsa_score_recompute as policy
from dsa_aot.toolchain.fakes import dlpack as _T

FAMILY = policy.FAMILY
OPS = policy.OPS
DIM = policy.DIM
LOG2_E = math.log2(math.e)  # upstream's constant (sparse_score_recompute_sm90.py: math.log2(math.e))
SM90_SCALE = 0.1  # any value: the launcher replaces it per call; one no other host constant shares
LITERALS = {op: {"softmax_scale_log2": SM90_SCALE * LOG2_E} for op in ("sparse_attention_sm90", "dense_attention_sm90")}
DENSE_TOPK_MAX = 128  # the SM90 dense constructor's topk_max: upstream passes S_k, which no dense code path reads (research §3)


_ENV_3WG = "DENSE3WG_USE_WARP_SPLIT_PROD"  # read by DenseScoreRecomputeSm90's constructor, in no compile key (research §7 trap 4)


def build(op, key, target):
    """Return (kernel object, args, options, extra key) for one entry. Imports the toolchain."""
    import cuda.bindings.driver as cuda_driver
    import cutlass

    T, bf16, f32, i32 = _T, cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    h, topk = key["heads"], key.get("topk")
    length = T(i32, 2) if key.get("length") else None
    stream = cuda_driver.CUstream(0)

    def cu_twins(key):  # a block-scaled THD call's scale-padded cu_seqlens (leading_dim 0, as its cu_seqlens)
        return (T(i32, 1), T(i32, 1)) if key["varlen"] else (None, None)

    if op == "dense_indexer":
        m, n, k = policy.DENSE_TILE
        r = 3 if key["varlen"] else 4  # q / k rank: THD (T, H, D), BSHD (B, S, H, D)
        cu = (T(i32, 1), T(i32, 1)) if key["varlen"] else (None, None)
        offs = T(i32, 1) if key["offsets"] else None
        scalars = (cutlass.Float32(1.0), cutlass.Int32(1), cutlass.Int32(1))  # sm_scale, max_seqlen_q, max_seqlen_k
        prec = key["precision"]
        if prec != "bf16":
            from cudnn.deepseek_sparse_attention.score_recompute._block_scaled import BLOCK_SCALED_FORMATS

            kv_stage = policy.MX_KV_STAGE
            obj = BLOCK_SCALED_FORMATS[prec].kernel_cls(head_dim=DIM, qhead_per_kvhead=h, m_block_size=m, n_block_size=n, k_block_size=k,
                                                        kv_stage=kv_stage, ratio=key["ratio"], is_varlen=key["varlen"], sf_vec_size=policy.SF_VEC,
                                                        compute_lse=True, is_compressed_logits=False)
            qk = cutlass.Float8E4M3FN if prec == "mxfp8" else cutlass.Uint8  # e2m1 pairs go in as their bytes (upstream's kernel_qk_view)
            e8 = cutlass.Float8E8M0FNU
            # q, k, w, q_scale, k_scale (packed, rank 3), out, denom (LSE), the scalars, cu_seqlens_q / k, their scale-padded twins,
            # q_causal_offsets, stream
            args = (T(qk, r), T(qk, r), T(bf16, r - 1), T(e8, 3), T(e8, 3), T(f32, r - 1), T(f32, r - 2), *scalars, *cu, *cu_twins(key), offs, stream)
            return obj, args, None, {"m": m, "n": n, "k_block": k, "kv_stage": kv_stage}
        from cudnn.deepseek_sparse_attention.score_recompute.indexer_score_unified_sm100 import IndexerScoreUnifiedSm100

        kv_stage = policy.dense_kv_stage(m, n, k)
        obj = IndexerScoreUnifiedSm100(head_dim=DIM, qhead_per_kvhead=h, m_block_size=m, n_block_size=n, k_block_size=k, kv_stage=kv_stage,
                                       ratio=key["ratio"], is_varlen=key["varlen"], compute_lse=True, is_compressed_logits=False)
        # q, k, w, out, denom (LSE), sm_scale, max_seqlen_q, max_seqlen_k, cu_seqlens_q / k, q_causal_offsets, stream
        args = (T(bf16, r), T(bf16, r), T(bf16, r - 1), T(f32, r - 1), T(f32, r - 2), *scalars, *cu, offs, stream)
        return obj, args, None, {"m": m, "n": n, "k_block": k, "kv_stage": kv_stage}
    if op == "dense_attention":
        d = key["dim"]
        r = 3 if key["varlen"] else 4
        cu = (T(i32, 1), T(i32, 1)) if key["varlen"] else (None, None)
        offs = T(i32, 1) if key["offsets"] else None
        scalars = (cutlass.Float32(1.0), cutlass.Int32(1), cutlass.Int32(1))  # softmax_scale, max_seqlen_q, max_seqlen_k
        if key["precision"] == "mxfp8":
            from cudnn.deepseek_sparse_attention.score_recompute.dense_score_recompute_sm100_mxfp8 import BwdDenseAttnScoreSm100Mxfp8

            m, n, k, kv_stage = policy.mx_attention_tiles(d, h, key["k_block"])
            obj = BwdDenseAttnScoreSm100Mxfp8(head_dim=d, qhead_per_kvhead=h, m_block_size=m, n_block_size=n, k_block_size=k, kv_stage=kv_stage,
                                              ratio=key["ratio"], is_varlen=key["varlen"], sf_vec_size=policy.SF_VEC)
            e4, e8 = cutlass.Float8E4M3FN, cutlass.Float8E8M0FNU
            # q, k, lse, q_scale, k_scale (packed, rank 3), out, denom (L1 sums), the scalars, cu_seqlens_q / k, their scale-padded
            # twins, q_causal_offsets, stream (_dense_attn_score_recompute's mxfp8 compile)
            args = (T(e4, r), T(e4, r), T(f32, r - 1), T(e8, 3), T(e8, 3), T(f32, r - 1), T(f32, r - 2), *scalars, *cu, *cu_twins(key), offs, stream)
            return obj, args, None, {"m": m, "n": n, "kv_stage": kv_stage}
        from cudnn.deepseek_sparse_attention.score_recompute.dense_score_recompute_sm100 import DenseScoreRecomputeSm100

        m, n, k, kv_stage = policy.sm100_dense_attention_tiles(d, h)
        obj = DenseScoreRecomputeSm100(head_dim=d, qhead_per_kvhead=h, m_block_size=m, n_block_size=n, k_block_size=k, kv_stage=kv_stage,
                                       score_type="attention", ratio=key["ratio"], is_varlen=key["varlen"])
        # q, k, lse, out, denom (L1 sums), softmax_scale, max_seqlen_q, max_seqlen_k, cu_seqlens_q / k, q_causal_offsets, stream
        args = (T(bf16, r), T(bf16, r), T(f32, r - 1), T(f32, r - 1), T(f32, r - 2), *scalars, *cu, offs, stream)
        return obj, args, None, {"m": m, "n": n, "kv_stage": kv_stage}
    if op in ("dense_indexer_sm90", "dense_attention_sm90"):
        import os

        from cudnn.deepseek_sparse_attention.score_recompute.dense_score_recompute_sm90 import DenseScoreRecomputeSm90

        if os.environ.get(_ENV_3WG, "1") != "1":
            raise ValueError(f"{_ENV_3WG}={os.environ[_ENV_3WG]!r} selects another SM90 dense kernel than cudnn's default: unset it to build")
        tile_m, head_tiles = policy.sm90_tiles(h)
        index = op == "dense_indexer_sm90"
        obj = DenseScoreRecomputeSm90(bf16, head_dim=DIM if index else key["dim"], qhead_per_kvhead=h, tile_m=tile_m, tile_n=64, num_threads=384,
                                      swap_AB=True, topk_max=DENSE_TOPK_MAX, is_index_scores=index, softmax_scale=key["scale"] if index else SM90_SCALE,
                                      has_topk_length=False, num_head_tiles=head_tiles, ratio=key["ratio"])
        offs = T(i32, 1, align=4) if key["offsets"] else None  # upstream binds the offsets 4-byte aligned
        # q, kv (B, S_k, H_kv, D), (no ids), stream, out, the weights (bf16) / LSE (fp32) transposed (B, H, S_q), (no lengths),
        # denom (LSE / L1 sums), offsets
        args = (T(bf16, 4), T(bf16, 4), None, stream, T(f32, 3), T(bf16 if index else f32, 3), None, T(f32, 2), offs)
        return obj, args, None, {"tile_m": tile_m, "head_tiles": head_tiles}
    if op == "sparse_attention":
        from cudnn.deepseek_sparse_attention.score_recompute.sparse_score_recompute_sm100 import SparseScoreRecomputeSm100

        d = key["dim"]
        m, n, k = policy.sm100_attention_tiles(d, h, topk, key["length"])
        kv_stage, in_smem = policy.sm100_stages(h, topk, d, n, k, per_head=4)
        obj = SparseScoreRecomputeSm100(head_dim=d, qhead_per_kvhead=h, m_block_size=m, n_block_size=n, k_block_size=k, topk=topk, kv_stage=kv_stage,
                                        score_type="attention", have_topk_length=key["length"], topk_in_smem=in_smem,
                                        topk_indices_global=key["topk_global"])
        args = (T(bf16, 4), T(bf16, 3), T(f32, 3), T(i32, 3), T(f32, 3), length, cutlass.Float32(1.0), stream)
        # upstream: O2 for the n128 kernels (a register-spill regression at the default level), default otherwise
        return obj, args, "--opt-level 2" if n == 128 else None, {"m": m, "n": n, "k_block": k, "kv_stage": kv_stage, "topk_in_smem": in_smem}
    if op == "sparse_attention_sm90":
        from cudnn.deepseek_sparse_attention.score_recompute.sparse_score_recompute_sm90 import SparseScoreRecomputeSm90

        tile_m, head_tiles = policy.sm90_tiles(h, attention=True)
        obj = SparseScoreRecomputeSm90(bf16, head_dim=key["dim"], qhead_per_kvhead=h, tile_m=tile_m, tile_n=64, num_threads=256, swap_AB=True,
                                       topk_max=topk, is_index_scores=False, softmax_scale=SM90_SCALE, has_topk_length=key["length"],
                                       num_head_tiles=head_tiles, is_sparse=True, output_log_probs=False, topk_indices_global=key["topk_global"])
        args = (T(bf16, 4), T(bf16, 4), T(i32, 3), stream, T(f32, 3), T(f32, 3), length, None)
        return obj, args, None, {"tile_m": tile_m, "head_tiles": head_tiles}
    if op == "sparse_indexer":
        from cudnn.deepseek_sparse_attention.score_recompute.sparse_score_recompute_sm100 import SparseScoreRecomputeSm100

        kv_stage, in_smem = policy.sm100_stages(h, topk)
        obj = SparseScoreRecomputeSm100(head_dim=DIM, qhead_per_kvhead=h, m_block_size=h, n_block_size=policy.N_BLOCK, topk=topk, kv_stage=kv_stage,
                                        score_type="indexer", have_topk_length=key["length"], topk_in_smem=in_smem,
                                        topk_indices_global=key["topk_global"])
        args = (T(bf16, 4), T(bf16, 3), T(bf16, 3), T(i32, 3), T(f32, 3), length, cutlass.Float32(1.0), stream)
        return obj, args, None, {"kv_stage": kv_stage, "topk_in_smem": in_smem}
    from cudnn.deepseek_sparse_attention.score_recompute.sparse_score_recompute_sm90 import SparseScoreRecomputeSm90

    tile_m, head_tiles = policy.sm90_tiles(h)
    obj = SparseScoreRecomputeSm90(bf16, head_dim=DIM, qhead_per_kvhead=h, tile_m=tile_m, tile_n=64, num_threads=256, swap_AB=True, topk_max=topk,
                                   is_index_scores=True, softmax_scale=1.0, has_topk_length=key["length"], num_head_tiles=head_tiles,
                                   is_sparse=True, output_log_probs=False, topk_indices_global=key["topk_global"])
    # q (B,S_q,H,D), kv (B,S_k,1,D), ids, stream, out, the weights transposed (B,H,S_q), lengths, no L1 denominator
    args = (T(bf16, 4), T(bf16, 4), T(i32, 3), stream, T(f32, 3), T(bf16, 3), length, None)
    return obj, args, None, {"tile_m": tile_m, "head_tiles": head_tiles}


def check_policy(targets):
    """The SM100 budget and the SM90 tile rule against upstream's sources (the stage sizing itself is proved
    per entry by fidelity: another kv_stage is another cubin)."""
    import inspect

    from cudnn.deepseek_sparse_attention.score_recompute import _interface_sm90 as h
    from cudnn.deepseek_sparse_attention.score_recompute import _interface_sm100 as i

    if i._SM100_SMEM_BYTES != policy.SMEM_BYTES:
        raise ValueError(f"cudnn's SM100 score-recompute budget is {i._SM100_SMEM_BYTES}; dsa_aot/policy/dsa_score_recompute.py assumes {policy.SMEM_BYTES}")
    for heads in (16, 32, 64, 128):
        if h._compute_tile_m(heads) != policy.sm90_tiles(heads):
            raise ValueError(f"cudnn's SM90 tiles for H {heads} are {h._compute_tile_m(heads)}; the policy says {policy.sm90_tiles(heads)}")
    for d in policy.ATTN_DIMS:
        for heads in (16, 32, 64, 96, 128):
            for topk in (128, 512, 1024, 2048):
                for compact in (False, True):
                    up = i._dispatch_sparse_attn_tile_params(d, heads, topk, compact=compact)
                    if tuple(up) != policy.sm100_attention_tiles(d, heads, topk, compact):
                        raise ValueError(f"cudnn's SM100 sparse attention tiles for D{d} H{heads} topk {topk} compact {compact} are {up}; "
                                         f"the policy says {policy.sm100_attention_tiles(d, heads, topk, compact)}")
    for fn, lines in ((i._sparse_attn_score_recompute, ("sPerHead_bytes = m_block_size * 2 * 4",)),
                      (i.sparse_attn_score_recompute, ("if (m_block_size, n_block_size, k_block_size) == nc_params:", "topk_length = None"))):
        src = inspect.getsource(fn)
        for line in lines:
            if line not in src:
                raise ValueError(f"cudnn's {fn.__name__} no longer has `{line}`: re-derive the policy's SM100 sparse attention sizing / drop rule")
    src = inspect.getsource(h.sparse_attn_score_recompute) + inspect.getsource(h._sparse_score_recompute)
    for line in ("if not is_index_scores and qhead_per_kvhead == 96:", "tile_m, num_head_tiles = 48, 2"):
        if line not in src:
            raise ValueError(f"cudnn's SM90 sparse score recompute no longer has `{line}`: re-derive policy.sm90_tiles")
    from cudnn.deepseek_sparse_attention.score_recompute import sparse_score_recompute_sm90 as sp90

    if "softmax_scale_log2 = self.softmax_scale * LOG2_E" not in inspect.getsource(sp90) or sp90.math.log2(sp90.math.e) != LOG2_E:
        raise ValueError("cudnn's SM90 sparse kernel no longer passes softmax_scale * LOG2_E: re-derive the op's softmax_scale_log2")
    for prec in policy.DENSE_PRECISIONS:
        for heads in (16, 32, 64, 128):
            m, n, k = i._dispatch_dense_indexer_tile_params(DIM, heads, precision=prec)
            if (m, n, k) != policy.DENSE_TILE:
                raise ValueError(f"cudnn's SM100 {prec} dense indexer tiles for H{heads} are {(m, n, k)}; the policy says {policy.DENSE_TILE}")
    from cudnn.deepseek_sparse_attention.score_recompute import _block_scaled as bs

    if tuple(bs.BLOCK_SCALED_FORMATS) != policy.MX_PRECISIONS or {f.sf_vec_size for f in bs.BLOCK_SCALED_FORMATS.values()} != {policy.SF_VEC}:
        raise ValueError(f"cudnn's block-scaled formats are {bs.BLOCK_SCALED_FORMATS}; the policy says {policy.MX_PRECISIONS} at sf_vec_size {policy.SF_VEC}")
    src = inspect.getsource(i._dense_indexer_score_recompute)
    for line in (f"kv_stage = {policy.MX_KV_STAGE}", f"if qhead_per_kv_head not in {policy.MX_HEADS}:", "compute_lse=True"):
        if line not in src:
            raise ValueError(f"cudnn's SM100 dense indexer no longer has `{line}`: re-derive the policy's block-scaled dense indexer constants")
    for d in policy.ATTN_DIMS:
        for heads in (16, 32, 64, 128):
            m, n, k, kv_stage = policy.sm100_dense_attention_tiles(d, heads)
            up = i._dispatch_dense_attn_tile_params(d, heads, precision="bf16")
            up_stage = i._compute_dense_kv_stage(-(-d // 16) * 16, up[0], up[1], up[2], per_head_elem_bytes=4)
            if (m, n, k, kv_stage) != (*up, up_stage):
                raise ValueError(f"cudnn's SM100 dense attention tiles for D{d} H{heads} are {(*up, up_stage)}; the policy says {(m, n, k, kv_stage)}")
    _check_mx_attention(i)
    m, n, k = policy.DENSE_TILE
    if i._compute_dense_kv_stage(DIM, m, n, k, per_head_elem_bytes=2) != policy.dense_kv_stage(m, n, k):
        raise ValueError("cudnn's SM100 dense indexer kv_stage differs from policy.dense_kv_stage")
    src = inspect.getsource(i._sparse_indexer_score_recompute)
    for line in ("kv_stage = min(4, max(1, (_SM100_SMEM_BYTES - sQ_size - smem_overhead) // sK_per_stage))", "sTopkIdx_bytes = topk * 2 * 4",
                 "smem_fixed = sPerHead_bytes + 2048"):
        if line not in src:
            raise ValueError(f"cudnn's SM100 sparse indexer no longer sizes its stages with `{line}`: re-derive policy.sm100_stages")


def _check_mx_attention(i):
    """The mxfp8 dense attention's policy against upstream: the tiles and the S_k bucket of its dispatch, the
    heads its kernel takes, and the stage and zeroing rules written in _dense_attn_score_recompute."""
    import inspect

    from cudnn.deepseek_sparse_attention.score_recompute.dense_score_recompute_sm100 import DenseScoreRecomputeSm100

    for d in policy.MX_ATTN_DIMS:
        for heads in policy.mx_heads(True):
            for hint in (1, policy.MX_LONG_K - 1, policy.MX_LONG_K, 1 << 20):
                up = tuple(i._dispatch_dense_attn_tile_params(d, heads, precision="mxfp8", seqlen_k_hint=hint))
                ours = policy.mx_attention_tiles(d, heads, policy.dense_attention_k_block("mxfp8", d, heads, hint))[:3]
                if up != ours:
                    raise ValueError(f"cudnn's SM100 mxfp8 dense attention tiles for D{d} H{heads} at S_k {hint} are {up}; the policy says {ours}")
    fits = tuple(h for h in (16, 32, 64, 128) if policy.MX_M_BLOCK // h <= DenseScoreRecomputeSm100.max_q_tokens_per_tile)
    if fits != policy.mx_heads(True):
        raise ValueError(f"cudnn's dense attention takes {fits} heads at m 128; the policy's mxfp8 attention says {policy.mx_heads(True)}")
    src = " ".join(inspect.getsource(i._dense_attn_score_recompute).split())
    t = policy.mx_attention_tiles
    for line in (f'if precision == "mxfp8": if head_dim == 512: if k_block_size == 64: kv_stage = {t(512, 64, 64)[3]} elif k_block_size == 256: '
                 f'kv_stage = {t(512, 64, 256)[3]} elif qhead_per_kv_head >= 128: kv_stage = {t(512, 128, 128)[3]} else: kv_stage = '
                 f'{t(512, 64, 128)[3]} else: kv_stage = {t(128, 64, 64)[3]}',
                 'if precision == "mxfp8" and ((head_dim == 512 and qhead_per_kv_head >= 128) or (head_dim == 128 and qhead_per_kv_head == 64)): '
                 'with _torch_stream_context(current_stream): out.zero_() denom_out.zero_()',
                 'if precision == "mxfp8": out.zero_() else: out.fill_(float("-inf"))',
                 "sf_vec_size=sf_vec_size,"):
        if line not in src:
            raise ValueError(f"cudnn's _dense_attn_score_recompute no longer has `{line}`: re-derive the policy's mxfp8 dense attention rules")
    for d, heads in ((512, 64), (512, 128), (128, 64), (128, 128)):
        if policy.mx_zeroes_denom(d, heads) != ((d == 512 and heads >= 128) or (d == 128 and heads == 64)):
            raise ValueError(f"policy.mx_zeroes_denom({d}, {heads}) disagrees with upstream's rule")


# --- fidelity: cudnn's own wrapper for each key (dsa_aot/toolchain/fidelity.py runs it) ------------------

FIDELITY_ROUTES = {
    "sparse_indexer": "sparse_indexer_score_recompute_wrapper -> SparseIndexerScoreRecompute.execute -> _interface_sm100",
    "sparse_indexer_sm90": "sparse_indexer_score_recompute_wrapper -> SparseIndexerScoreRecompute.execute -> _interface_sm90",
    "sparse_attention": "sparse_attn_score_recompute_wrapper -> SparseAttnScoreRecompute.execute -> _interface_sm100",
    "sparse_attention_sm90": "sparse_attn_score_recompute_wrapper -> SparseAttnScoreRecompute.execute -> _interface_sm90",
    "dense_indexer": "dense_indexer_score_recompute_wrapper -> DenseIndexerScoreRecompute.execute (bf16) / dense_indexer_score_recompute "
                     "(block-scaled) -> _interface_sm100._dense_indexer_score_recompute",
    "dense_indexer_sm90": "dense_indexer_score_recompute_wrapper -> DenseIndexerScoreRecompute.execute -> _interface_sm90 (BSHD)",
    "dense_attention": "dense_attn_score_recompute_wrapper -> DenseAttnScoreRecompute.execute (bf16) / dense_attn_score_recompute (mxfp8) "
                       "-> _interface_sm100._dense_attn_score_recompute",
    "dense_attention_sm90": "dense_attn_score_recompute_wrapper -> DenseAttnScoreRecompute.execute -> _interface_sm90 (BSHD)",
}
FIDELITY_SCALE = 576**-0.5  # not SM90_SCALE: the same cubin at another scale is part of what fidelity proves
PRELOAD = (
    "cudnn.deepseek_sparse_attention.score_recompute.api",
    "cudnn.deepseek_sparse_attention.score_recompute._interface_sm90",
    "cudnn.deepseek_sparse_attention.score_recompute._interface_sm100",
)


def fidelity(op, key, target, up):
    """Run ``sparse_indexer_score_recompute_wrapper`` / ``sparse_attn_score_recompute_wrapper`` for the key
    on ``up``: B 2, S_q 64, S_k 256."""
    import torch

    from cudnn.deepseek_sparse_attention.score_recompute import _interface_sm90 as h
    from cudnn.deepseek_sparse_attention.score_recompute import _interface_sm100 as i
    from cudnn.deepseek_sparse_attention.score_recompute import api

    up.cudnn_route(api, h, i)
    T = up.tensor
    up.on_host("empty")
    for kind in ("SparseIndexer", "SparseAttn", "DenseIndexer", "DenseAttn"):
        getattr(api, f"_cache_of_{kind}ScoreRecomputeObjects").clear()
    if op.startswith("dense"):
        return _fidelity_dense(op, key, up, api, h, i, T)
    fn = {"sparse_indexer": i._sparse_indexer_score_recompute, "sparse_attention": i._sparse_attn_score_recompute}.get(op, h._sparse_score_recompute)
    cache = up.cache(fn, "compile_cache")
    bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    B, s_q, s_k, H, topk = 2, 64, 256, key["heads"], key["topk"]
    if op.startswith("sparse_attention"):
        import cutlass

        d, scale = key["dim"], FIDELITY_SCALE
        q, k, lse = T(bf16, B, s_q, H, d), T(bf16, B, s_k, d), T(f32, B, s_q, H)
        idx, out = T(i32, B, s_q, topk), T(f32, B, s_q, topk)
        length = T(i32, B, s_q) if key["length"] else None
        api.sparse_attn_score_recompute_wrapper(q, k, lse, idx, scale, topk_length=length, topk_indices_global=key["topk_global"], out=out,
                                                stream=up.stream)
        if op == "sparse_attention":
            m, n, kb = policy.sm100_attention_tiles(d, H, topk, key["length"])
            kv_stage, in_smem = policy.sm100_stages(H, topk, d, n, kb, per_head=4)
            want = ("attention", bf16, d, H, topk, m, n, kb, kv_stage, key["length"], in_smem, key["topk_global"])
        else:
            tile_m, head_tiles = policy.sm90_tiles(H, attention=True)
            want = (cutlass.BFloat16, d, H, tile_m, 64, 2, 256, True, topk, False, scale, key["length"], head_tiles, True, False, key["topk_global"])
        return cache, want, 1
    q, k, w = T(bf16, B, s_q, H, DIM), T(bf16, B, s_k, DIM), T(bf16, B, s_q, H)
    idx, out = T(i32, B, s_q, topk), T(f32, B, s_q, topk)
    length = T(i32, B, s_q) if key["length"] else None
    api.sparse_indexer_score_recompute_wrapper(q, k, w, idx, topk_length=length, topk_indices_global=key["topk_global"], out=out, stream=up.stream)
    if op == "sparse_indexer":
        kv_stage, in_smem = policy.sm100_stages(H, topk)
        want = ("indexer", bf16, DIM, H, topk, H, policy.N_BLOCK, kv_stage, key["length"], in_smem, key["topk_global"])
    else:
        tile_m, head_tiles = policy.sm90_tiles(H)
        import cutlass

        want = (cutlass.BFloat16, DIM, H, tile_m, 64, 2, 256, True, topk, True, 1.0, key["length"], head_tiles, True, False, key["topk_global"])
    return cache, want, 1


def _fidelity_dense(op, key, up, api, h, i, T):
    """``dense_indexer_score_recompute_wrapper`` / ``dense_attn_score_recompute_wrapper`` for a dense key:
    B 2, S_q 128, S_k 64, H_kv 1 (THD: the same two segments' worth of rows, max_seqlen given, real
    cu_seqlens values). Block-scaled: Q/K e4m3 or e2m1 pairs (last dim 64), e8m0 scales in upstream's
    packed shapes (THD: segments padded to 128 scale rows, with their padded offsets)."""
    import torch

    bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    sm90, attn = op.endswith("_sm90"), op.startswith("dense_attention")
    # the mxfp8 attention's 256-wide K blocks: upstream picks them from S_k (BSHD) / max_seqlen_k (THD) >= 4096
    H, B, s_q, s_k = key["heads"], 2, 128, policy.MX_LONG_K if key.get("k_block") == 256 and key.get("precision") == "mxfp8" else 64
    prec = key.get("precision", "bf16")
    mx = prec in policy.MX_PRECISIONS
    qdt = {"mxfp8": torch.float8_e4m3fn, "mxfp4": torch.float4_e2m1fn_x2}.get(prec, bf16)
    d = DIM // 2 if prec == "mxfp4" else key.get("dim", DIM)  # e2m1 pairs: two values a stored element
    cols = -(-(key.get("dim", DIM) // policy.SF_VEC) // 4) * 4  # e8m0 scale groups of a row, padded to 4 (upstream's packed layout)
    # SM90 indexer: upstream at a double that is not the key's float32 value but rounds to it (1.0 itself stays
    # 1.0: it drops the kernel's multiply): the cubin is the float32 immediate's alone
    scale = (key["scale"] if key["scale"] == 1.0 else key["scale"] * (1 + 2**-40)) if sm90 and not attn else FIDELITY_SCALE
    assert not (sm90 and not attn) or policy.f32(scale) == key["scale"]
    aux = f32 if attn else bf16
    kw = {"q_causal_offsets": T(i32, B)} if key["offsets"] else {}
    if key.get("varlen"):
        cu_q, cu_k = T(i32, B + 1), T(i32, B + 1)
        cu_q.copy_(torch.tensor([0, 100, 2 * s_q], dtype=i32))
        cu_k.copy_(torch.tensor([0, 40, 2 * s_k], dtype=i32))
        q, k, w = T(qdt, B * s_q, H, d), T(qdt, B * s_k, 1, d), T(aux, B * s_q, H)
        out, den = T(f32, B * s_q, s_k), T(f32, B * s_q)
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=s_q, max_seqlen_k=s_k)
        if mx:
            # each segment's scale rows (S * H for q, S for k) padded to 128: the packed scales and their offsets
            pads = [[-(-n // 128) * 128 for n in seg] for seg in ((100 * H, (2 * s_q - 100) * H), (40, 2 * s_k - 40))]
            cus = []
            for p in pads:
                c = T(i32, B + 1)
                c.copy_(torch.tensor([0, p[0], p[0] + p[1]], dtype=i32))
                cus.append(c)
            kw.update(q_scale=T(torch.float8_e8m0fnu, 1, sum(pads[0]), cols), k_scale=T(torch.float8_e8m0fnu, 1, sum(pads[1]), cols),
                      cu_seqlens_q_scale_padded=cus[0], cu_seqlens_k_scale_padded=cus[1])
    else:
        q, k, w = T(qdt, B, s_q, H, d), T(qdt, B, s_k, 1, d), T(aux, B, s_q, H)
        out, den = T(f32, B, s_q, s_k), T(f32, B, s_q)
        if mx:
            kw.update(q_scale=T(torch.float8_e8m0fnu, B, -(-s_q * H // 128) * 128, cols), k_scale=T(torch.float8_e8m0fnu, B, -(-s_k // 128) * 128,
                                                                                                          cols))
    if mx:
        kw["precision"] = prec
    cache = up.cache(h._dense_score_recompute if sm90 else i._dense_attn_score_recompute if attn else i._dense_indexer_score_recompute, "compile_cache")
    if attn:
        api.dense_attn_score_recompute_wrapper(q, k, w, scale, out=out, denom_out=den, ratio=key["ratio"], stream=up.stream, **kw)
    else:
        api.dense_indexer_score_recompute_wrapper(q, k, w, out=out, denom_out=den, sm_scale=scale, ratio=key["ratio"], stream=up.stream, **kw)
    if mx and attn:
        m, n, kb, kv_stage = policy.mx_attention_tiles(d, H, key["k_block"])
        want = ("dense_attention", prec, qdt, qdt, f32, torch.float8_e8m0fnu, torch.float8_e8m0fnu, d, H, m, n, kb, d // kb, kv_stage, key["ratio"],
                key["varlen"], key["offsets"], policy.SF_VEC)
    elif mx:
        m, n, kb = policy.DENSE_TILE
        want = ("dense_indexer", prec, qdt, qdt, bf16, torch.float8_e8m0fnu, torch.float8_e8m0fnu, DIM, H, m, n, kb, DIM // kb, policy.MX_KV_STAGE,
                key["ratio"], key["varlen"], key["offsets"], policy.SF_VEC)
    elif sm90:
        import cutlass

        tile_m, head_tiles = policy.sm90_tiles(H)
        want = (cutlass.BFloat16, d, H, tile_m, 64, 2, 384, True, not attn, scale, False, head_tiles, False, False, key["ratio"], key["offsets"])
    elif attn:
        m, n, kb, kv_stage = policy.sm100_dense_attention_tiles(d, H)
        want = ("dense_attention", bf16, d, H, m, n, kb, kv_stage, key["ratio"], key["varlen"], key["offsets"])
    else:
        m, n, kb = policy.DENSE_TILE
        want = ("dense_indexer", bf16, DIM, H, m, n, kb, policy.dense_kv_stage(m, n, kb), key["ratio"], key["varlen"], key["offsets"])
    return cache, want, 1
