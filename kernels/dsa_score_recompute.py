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

from aot.policy import dsa_score_recompute as policy

FAMILY = policy.FAMILY
OPS = policy.OPS
DIM = policy.DIM
LOG2_E = math.log2(math.e)  # upstream's constant (sparse_score_recompute_sm90.py: math.log2(math.e))
SM90_SCALE = 0.1  # any value: the launcher replaces it per call; one no other host constant shares
LITERALS = {"sparse_attention_sm90": {"softmax_scale_log2": SM90_SCALE * LOG2_E}}


def _T(dtype, rank):
    """A tensor as to_cute_tensor presents it."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    shape = tuple(cute.sym_int() for _ in range(rank))
    stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(dtype, shape, stride, memspace=cute.AddressSpace.gmem, assumed_align=16)


def build(op, key, target):
    """Return (kernel object, args, options, extra key) for one entry. Imports the toolchain."""
    import cuda.bindings.driver as cuda_driver
    import cutlass

    if op not in OPS:
        raise KeyError(op)
    T, bf16, f32, i32 = _T, cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    h, topk = key["heads"], key["topk"]
    length = T(i32, 2) if key["length"] else None
    stream = cuda_driver.CUstream(0)
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
        raise ValueError(f"cudnn's SM100 score-recompute budget is {i._SM100_SMEM_BYTES}; aot/policy/dsa_score_recompute.py assumes {policy.SMEM_BYTES}")
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
    src = inspect.getsource(i._sparse_indexer_score_recompute)
    for line in ("kv_stage = min(4, max(1, (_SM100_SMEM_BYTES - sQ_size - smem_overhead) // sK_per_stage))", "sTopkIdx_bytes = topk * 2 * 4",
                 "smem_fixed = sPerHead_bytes + 2048"):
        if line not in src:
            raise ValueError(f"cudnn's SM100 sparse indexer no longer sizes its stages with `{line}`: re-derive policy.sm100_stages")


# --- fidelity: cudnn's own wrapper for each key (aot/toolchain/fidelity.py runs it) ------------------

FIDELITY_ROUTES = {
    "sparse_indexer": "sparse_indexer_score_recompute_wrapper -> SparseIndexerScoreRecompute.execute -> _interface_sm100",
    "sparse_indexer_sm90": "sparse_indexer_score_recompute_wrapper -> SparseIndexerScoreRecompute.execute -> _interface_sm90",
    "sparse_attention": "sparse_attn_score_recompute_wrapper -> SparseAttnScoreRecompute.execute -> _interface_sm100",
    "sparse_attention_sm90": "sparse_attn_score_recompute_wrapper -> SparseAttnScoreRecompute.execute -> _interface_sm90",
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
    import contextlib

    import torch

    from cudnn.deepseek_sparse_attention.score_recompute import _interface_sm90 as h
    from cudnn.deepseek_sparse_attention.score_recompute import _interface_sm100 as i
    from cudnn.deepseek_sparse_attention.score_recompute import api
    from cudnn.deepseek_sparse_attention.utils import compiler, runtime

    if op not in FIDELITY_ROUTES:
        raise KeyError(f"no fidelity route for op {op!r}")
    up.clear_lru(compiler.gpu_arch_flag, runtime._device_capability)
    for mod in (api, h, i):
        up.patch(mod, "_torch_stream_context", lambda *a, **k: contextlib.nullcontext())
    T = up.tensor
    real_empty, like = torch.empty, type(T(torch.int32, 1))
    up.patch(torch, "empty", lambda *shape, dtype=None, device=None, **k: like(real_empty(*shape, dtype=dtype)))
    api._cache_of_SparseIndexerScoreRecomputeObjects.clear()
    api._cache_of_SparseAttnScoreRecomputeObjects.clear()
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
