"""Spec of the fused DSA indexer forward + top-k (cudnn.deepseek_sparse_attention.indexer_forward, 1.32.0).

``build`` presents what upstream passes to ``cute.compile``. GEMM (``_compressed_top_k_sm100``):
q, k, w (and the mx scales) as ``to_cute_tensor`` gives them (gmem, 16-byte aligned, dynamic extents
and strides but the unit innermost one), the candidate buffer 2-D, 1-D, or in THD upstream's own
1-D tensor of a 64-bit extent, the LSE, the scale and the two lengths as Float32 / Int32, the causal
and batch offsets; options None. Stage 2 (``compress_top_k_sm100``): the buffer 1-D (THD: the 64-bit
one), the outputs 4-byte aligned (scalar stores into possibly strided windows), ``--opt-level 3``.
docs/research/indexer-forward-top-k.md: byte-identical to upstream's route where measured.
"""

from dsa_aot.policy import dsa_indexer_forward_top_k as policy
from dsa_aot.toolchain.fakes import dlpack as _T, indexer_inputs

FAMILY = policy.FAMILY
OPS = policy.OPS
_D = 128


def build(op, key, target):
    import cuda.bindings.driver as cuda_driver
    import cutlass

    I32, I64, F32 = cutlass.Int32, cutlass.Int64, cutlass.Float32
    stream = cuda_driver.CUstream(0)
    if op == "stage2":
        from cudnn.deepseek_sparse_attention.indexer_top_k import compress_top_k_sm100 as s2

        vl = key["varlen"]
        obj = s2.CompressTopkStage2(topk=key["top_k"], ratio=key["ratio"], block_threads=key["threads"], is_varlen=vl,
                                    deterministic=key["deterministic"])
        sm = _T(F32, 3, 4) if key["softmax"] else None
        if vl:
            args = (s2._make_i64_cand_buffer_compile_tensor(), _T(I32, 3, 4), _T(F32, 3, 4), I32(1), I32(1), stream, _T(I32, 1), _T(I32, 1),
                    _T(I64, 1), _T(I32, 1) if key["offsets"] else None, sm)
        else:
            offs = key["offsets"]  # BSHD: the batch offsets and the causal offsets come together (upstream's every path)
            args = (_T(F32, 1), _T(I32, 3, 4), _T(F32, 3, 4), I32(1), I32(1), stream, None, None, _T(I64, 1) if offs else None,
                    _T(I32, 1) if offs else None, sm)
        return obj, args, "--opt-level 3", {}
    from cudnn.deepseek_sparse_attention.indexer_forward import _compressed_top_k_sm100 as ctk

    prec, vl, lse, h = key["precision"], key["varlen"], key["lse"], key["heads"]
    qr, wr = (3, 2) if vl else (4, 3)
    w = F32 if key["w_dtype"] == "float32" else cutlass.BFloat16
    cand = ctk._make_i64_cand_buffer_compile_tensor() if vl else _T(F32, 2 if key["cand"] == "2d" else 1)
    denom = _T(F32, 1 if vl else 2) if lse else None
    qco = _T(I32, 1) if key["offsets"] else None
    cbo = _T(I64, 1) if key["cand"] == "1d_cbo" else None
    cu = (_T(I32, 1), _T(I32, 1)) if vl else (None, None)
    m = policy.gemm_m_block(prec, h)
    if prec == "bf16":
        from cudnn.deepseek_sparse_attention.score_recompute.indexer_score_unified_sm100 import IndexerScoreUnifiedSm100

        obj = IndexerScoreUnifiedSm100(head_dim=_D, qhead_per_kvhead=h, m_block_size=m, n_block_size=128, k_block_size=64, kv_stage=4,
                                       ratio=key["ratio"], is_varlen=vl, compute_lse=lse, is_compressed_logits=True,
                                       **({} if vl else {"cand_2d": key["cand"] == "2d"}))
        args = (_T(cutlass.BFloat16, qr), _T(cutlass.BFloat16, qr), _T(w, wr), cand, denom, F32(1.0), I32(1), I32(1), *cu, qco, stream, cbo)
        return obj, args, None, {"m_block": m}
    from cudnn.deepseek_sparse_attention.score_recompute._block_scaled import BLOCK_SCALED_FORMATS

    obj = BLOCK_SCALED_FORMATS[prec].kernel_cls(head_dim=_D, qhead_per_kvhead=h, m_block_size=m, n_block_size=128, k_block_size=64, kv_stage=24,
                                                ratio=key["ratio"], is_varlen=vl, sf_vec_size=32, compute_lse=lse, is_compressed_logits=True)
    qk = cutlass.Float8E4M3FN if prec == "mxfp8" else cutlass.Uint8
    e8 = cutlass.Float8E8M0FNU
    cus = (_T(I32, 1), _T(I32, 1)) if vl else (None, None)
    args = (_T(qk, qr), _T(qk, qr), _T(w, wr), _T(e8, 3), _T(e8, 3), cand, denom, F32(1.0), I32(1), I32(1), *cu, *cus, qco, stream, cbo)
    return obj, args, None, {"m_block": m}


def check_policy(targets):
    """The block-threads, window and 2-D-layout rules and G are upstream's (its functions, over a grid)."""
    from cudnn.deepseek_sparse_attention.indexer_forward import _compressed_top_k_sm100 as ctk
    from cudnn.deepseek_sparse_attention.indexer_top_k import compress_top_k_sm100 as s2

    for rows in (1, 2, 511, 512, 513, 40000):
        for s_k in (1, 8191, 8192, 100000):
            if policy.stage2_threads(rows, s_k) != ctk._select_topk_block_threads(rows, s_k):
                raise ValueError(f"stage-2 block threads differ from upstream's at rows {rows}, S_k {s_k}")
    for ratio in (1, 2, 4, 8, 128):
        for s_q in (1, 5, 256, 32767, 32768, 32772, 65536, 131072, 131073):
            for b in (1, 3, 4, 7, 8, 16):
                if policy.microbatch_rows(s_q, b, ratio) != ctk._select_microbatch_rows(s_q, b, ratio):
                    raise ValueError(f"microbatch rows differ from upstream's at S_q {s_q}, B {b}, ratio {ratio}")
            if policy.cand_floats(s_q, ratio) != s2.per_batch_floats(s_q, s_q, ratio):
                raise ValueError(f"G({s_q}) at ratio {ratio} differs from upstream's per_batch_floats")
            if policy.uses_cand_2d("bf16", s_q, ratio) != ctk._use_cand_2d("bf16", s2.per_batch_floats(s_q, s_q, ratio)):
                raise ValueError("the 2-D candidate rule differs from upstream's")


FIDELITY_ROUTES = {"gemm": "api.indexer_forward_top_k_wrapper -> _interface.indexer_fwd -> _compressed_top_k_sm100 (its stage 2 and "
                           "local-to-global stubbed)",
                   "stage2": "compress_top_k_sm100.compress_stage2_topk(_varlen)"}
PRELOAD = ("cudnn.deepseek_sparse_attention.indexer_forward.api", "cudnn.deepseek_sparse_attention.indexer_forward._interface",
           "cudnn.deepseek_sparse_attention.indexer_forward._compressed_top_k_sm100",
           "cudnn.deepseek_sparse_attention.indexer_top_k.compress_top_k_sm100",
           "cudnn.deepseek_sparse_attention.score_recompute.indexer_score_unified_sm100",
           "cudnn.deepseek_sparse_attention.score_recompute._block_scaled")


def fidelity(op, key, target, up):
    import torch

    from cudnn.deepseek_sparse_attention.indexer_forward import _compressed_top_k_sm100 as ctk
    from cudnn.deepseek_sparse_attention.indexer_forward import _interface, _interface_sm90, api  # noqa: F401
    from cudnn.deepseek_sparse_attention.indexer_top_k import compress_top_k_sm100 as s2
    from cudnn.deepseek_sparse_attention.indexer_top_k import local_to_global_dsl as l2g

    up.cudnn_route(_interface, _interface_sm90)
    import types

    up.patch(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))  # resolve_stream(None): the null stream
    T = up.tensor
    up.on_host("empty", "full", "arange", "zeros")
    B, ratio = 2, key["ratio"]
    if op == "stage2":
        cache = up.cache(s2, "_compile_cache")
        s_q, s_k = (256, 64) if key["threads"] == 256 else (4, 10000 if key["threads"] == 1024 else 64)
        rows_b = 1 if key["threads"] != 256 else B
        n = rows_b * s2.per_batch_floats(s_q, s_k, ratio)
        kw = dict(return_softmax=key["softmax"], deterministic=key["deterministic"])
        if key["varlen"]:
            cu = T(torch.int32, rows_b + 1)
            kw.update(q_causal_offsets=T(torch.int32, rows_b) if key["offsets"] else None)
            s2.compress_stage2_topk_varlen(T(torch.float32, n), cu, cu, T(torch.int64, rows_b + 1), rows_b * s_q, s_q, s_k, key["top_k"], ratio,
                                           block_threads=key["threads"], out_indices=T(torch.int32, rows_b * s_q, key["top_k"]),
                                           out_logits=T(torch.float32, rows_b * s_q, key["top_k"]), **kw)
            want = ("varlen", key["top_k"], ratio, key["threads"], key["offsets"], key["softmax"], key["deterministic"])
        else:
            if key["offsets"]:
                kw.update(cand_batch_offsets=T(torch.int64, rows_b + 1), q_causal_offsets=T(torch.int32, rows_b))
            s2.compress_stage2_topk(T(torch.float32, n), rows_b, s_q, s_k, key["top_k"], ratio, block_threads=key["threads"], **kw)
            want = (rows_b, s_q, s_k, key["top_k"], ratio, key["threads"], key["offsets"], key["offsets"], key["softmax"], key["deterministic"])
        return cache, want, 1
    # the GEMM through the wrapper; stage 2 and local-to-global answer "cached" with stubs
    up.cache(s2, "_compile_cache", keep=lambda k: False)
    up.cache(l2g, "_compile_cache", keep=lambda k: False)
    prec, H, vl = key["precision"], key["heads"], key["varlen"]
    s_q = 256
    s_k = s_q // ratio + 1  # S_q <= S_k * ratio + ratio - 1, upstream's geometry
    q, k, w, kw = indexer_inputs(T, prec, H, key["w_dtype"], vl, B, s_q, s_k, key["offsets"])
    qdt, wdt, e8 = q.dtype, w.dtype, torch.float8_e8m0fnu
    if vl or key["offsets"]:  # a caller's buffer and THD batch offsets: no sizing sync (upstream's capture contract)
        kw["cand_buffer"] = T(torch.float32, B * policy.cand_floats(s_q + 64, ratio))
    if vl:
        kw["cand_batch_offsets"] = T(torch.int64, B + 1)
    if key["lse"]:
        kw["return_lse"] = True
    cache = up.cache(ctk, "_compile_cache")
    api.indexer_forward_top_k_wrapper(q, k, w, 512, ratio=ratio, sm_scale=0.5, stream=up.stream, precision=prec, **kw)
    scales = (e8, e8) if prec != "bf16" else (None, None)
    m = policy.gemm_m_block(prec, H)
    if vl and prec == "bf16":
        want = ("bf16_varlen_compress", qdt, wdt, B, 1, _D, H, ratio, m, 128, 64, 4, 0.5, s_q, s_k, key["offsets"], key["lse"])
    elif vl:
        want = (f"{prec}_varlen_compress", qdt, qdt, wdt, e8, e8, B, 1, _D, H, ratio, m, 128, 32, 0.5, s_q, s_k, key["offsets"], key["lse"])
    else:
        want = (prec, "is_compressed_logits", key["lse"], key["cand"] == "2d", key["offsets"], qdt, qdt, wdt, *scales, B, 1, _D, H, ratio, m,
                128, 64, 4, 32, 0.5, s_q, s_k)
    return cache, want, 1
