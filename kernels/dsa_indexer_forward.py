"""Spec of the DSA indexer forward (cudnn.deepseek_sparse_attention.indexer_forward, 1.32.0).

``build`` presents what ``_interface_sm90.indexer_fwd`` / ``_interface._indexer_fwd_bound`` pass to
``cute.compile``: every tensor
through ``to_cute_tensor`` (gmem, 16-byte aligned, dynamic Int32 extents, dynamic Int64 strides but
the unit innermost one), H_kv / S_q / S_k as Int32 and the scale as Float32 (run-time values), and
the stream. docs/research/indexer-forward.md: 26 configurations built both ways, byte-identical.
"""

from dsa_aot.policy import dsa_indexer_forward as policy
from dsa_aot.toolchain.fakes import dlpack as _T, indexer_inputs

FAMILY = policy.FAMILY
OPS = policy.OPS
_D = 128


def build(op, key, target):
    if op == "fwd_sm100":
        return _build_sm100(key)
    import cuda.bindings.driver as cuda_driver
    import cutlass

    from cudnn.deepseek_sparse_attention.indexer_forward.indexer_fwd_sm90 import IndexerForwardSm90

    T = _T
    fp8 = key["precision"] == "fp8"
    qk = cutlass.Float8E4M3FN if fp8 else cutlass.BFloat16
    w = cutlass.Float32 if key["w_dtype"] == "float32" else cutlass.BFloat16
    vl = key["varlen"]
    qr, wr = (3, 2) if vl else (4, 3)
    obj = IndexerForwardSm90(qk, w, head_dim=_D, qhead_per_kvhead=key["heads"], ratio=key["ratio"], is_varlen=vl,
                             use_unchecked_qh64=key["unchecked"], use_unchecked_qh64_masked=key["masked"], compute_lse=key["lse"])
    f32 = cutlass.Float32
    scales = (T(f32, wr), T(f32, wr)) if fp8 else (None, None)
    cu = (T(cutlass.Int32, 1), T(cutlass.Int32, 1)) if vl else (None, None)
    args = (T(qk, qr), T(qk, qr), T(w, wr), *scales, T(f32, wr), T(f32, wr - 1) if key["lse"] else None,
            cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1), cutlass.Float32(1.0), *cu,
            T(cutlass.Int32, 1) if key["offsets"] else None, cuda_driver.CUstream(0))
    return obj, args, None, {"threads": 384 if fp8 else 256}


def _build_sm100(key):
    """What _indexer_fwd_bound compiles: the bf16 kernel with the m tile of the heads, or the mx kernel
    (Q/K e4m3, or e2m1 pairs passed as a uint8 view; e8m0 block scales; kv_stage 24)."""
    import cuda.bindings.driver as cuda_driver
    import cutlass

    T = _T
    prec, vl, h = key["precision"], key["varlen"], key["heads"]
    qr, wr = (3, 2) if vl else (4, 3)
    w = cutlass.Float32 if key["w_dtype"] == "float32" else cutlass.BFloat16
    cu = (T(cutlass.Int32, 1), T(cutlass.Int32, 1)) if vl else (None, None)
    offs = T(cutlass.Int32, 1) if key["offsets"] else None
    m = policy.sm100_m_block(prec, h)
    stream = cuda_driver.CUstream(0)
    if prec == "bf16":
        from cudnn.deepseek_sparse_attention.score_recompute.indexer_score_unified_sm100 import IndexerScoreUnifiedSm100

        obj = IndexerScoreUnifiedSm100(head_dim=_D, qhead_per_kvhead=h, m_block_size=m, n_block_size=128, k_block_size=64, kv_stage=4,
                                       ratio=key["ratio"], is_varlen=vl, compute_lse=False, is_compressed_logits=False)
        qk = cutlass.BFloat16
        args = (T(qk, qr), T(qk, qr), T(w, wr), T(cutlass.Float32, wr), None, cutlass.Float32(1.0), cutlass.Int32(1), cutlass.Int32(1), *cu,
                offs, stream)
        return obj, args, None, {"m_block": m, "threads": 256}
    from cudnn.deepseek_sparse_attention.score_recompute._block_scaled import BLOCK_SCALED_FORMATS

    obj = BLOCK_SCALED_FORMATS[prec].kernel_cls(head_dim=_D, qhead_per_kvhead=h, m_block_size=m, n_block_size=128, k_block_size=64, kv_stage=24,
                                                ratio=key["ratio"], is_varlen=vl, sf_vec_size=32, compute_lse=False, is_compressed_logits=False)
    qk = cutlass.Float8E4M3FN if prec == "mxfp8" else cutlass.Uint8
    e8 = cutlass.Float8E8M0FNU
    cus = (T(cutlass.Int32, 1), T(cutlass.Int32, 1)) if vl else (None, None)
    args = (T(qk, qr), T(qk, qr), T(w, wr), T(e8, 3), T(e8, 3), T(cutlass.Float32, wr), None, cutlass.Float32(1.0), cutlass.Int32(1),
            cutlass.Int32(1), *cu, *cus, offs, stream)
    return obj, args, None, {"m_block": m, "threads": 384}


def check_policy(targets):
    """upstream's unchecked / masked rule is the policy's (read from its source, as upstream states it)."""
    import inspect

    from cudnn.deepseek_sparse_attention.indexer_forward import _interface_sm90 as h

    src = inspect.getsource(h)
    for needle in ("% 64 == 0",):
        if needle not in src:
            raise ValueError(f"cudnn's _interface_sm90 no longer contains {needle!r}: review dsa_aot/policy/dsa_indexer_forward.py's sm90_kernel")


FIDELITY_ROUTES = {"fwd_sm90": "api.indexer_forward_wrapper -> _interface_sm90.indexer_fwd",
                   "fwd_sm100": "api.indexer_forward_wrapper -> _interface.indexer_fwd -> _indexer_fwd_bound"}
PRELOAD = ("cudnn.deepseek_sparse_attention.indexer_forward.api", "cudnn.deepseek_sparse_attention.indexer_forward._interface_sm90",
           "cudnn.deepseek_sparse_attention.indexer_forward.indexer_fwd_sm90", "cudnn.deepseek_sparse_attention.indexer_forward._interface",
           "cudnn.deepseek_sparse_attention.score_recompute.indexer_score_unified_sm100",
           "cudnn.deepseek_sparse_attention.score_recompute._block_scaled")


def fidelity(op, key, target, up):
    """Run indexer_forward_wrapper for the key on ``up``. SM90: B 2, S_q and S_k picked to give the
    key's unchecked / masked variant; SM100: B 2, S_q 252 (or what the ratio-causal geometry admits)
    against S_k 63 (a padded scores row), block scales in upstream's packed shapes."""
    import torch

    from cudnn.deepseek_sparse_attention.indexer_forward import _interface, _interface_sm90, api  # noqa: F401

    up.cudnn_route(_interface, _interface_sm90)
    T = up.tensor
    up.on_host("empty")
    if op == "fwd_sm100":
        return _fidelity_sm100(key, up, api, up.cache(_interface, "_compile_cache"))
    cache = up.cache(_interface_sm90, "_compile_cache")
    fp8 = key["precision"] == "fp8"
    qdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    wdt = getattr(torch, key["w_dtype"])
    H, B = key["heads"], 2
    s_q = 256 if (key["unchecked"] or not (fp8 and H == 64)) else 255
    s_k = 64 if key["masked"] else 63
    kw = {}
    if key["varlen"]:
        q, k, w = T(qdt, B * s_q, H, _D), T(qdt, B * s_k, 1, _D), T(wdt, B * s_q, H)
        kw.update(cu_seqlens_q=T(torch.int32, B + 1), cu_seqlens_k=T(torch.int32, B + 1), max_seqlen_q=s_q, max_seqlen_k=s_k)
    else:
        q, k, w = T(qdt, B, s_q, H, _D), T(qdt, B, s_k, 1, _D), T(wdt, B, s_q, H)
    if fp8:
        kw.update(precision="fp8", q_scale=T(torch.float32, *q.shape[:-1]), k_scale=T(torch.float32, *k.shape[:-1]))
    if key["offsets"]:
        kw["q_causal_offsets"] = T(torch.int32, B)
    if key["lse"]:
        kw["return_lse"] = True
    api.indexer_forward_wrapper(q, k, w, ratio=key["ratio"], sm_scale=0.5, stream=up.stream, **kw)

    def bcast(t):
        return (False,) * t.ndim

    want = (qdt, wdt, _D, H, key["ratio"], key["varlen"], key["unchecked"], key["masked"], key["lse"], bcast(q), bcast(k), bcast(w),
            bcast(kw["q_scale"]) if fp8 else None, bcast(kw["k_scale"]) if fp8 else None, key["offsets"])
    return cache, want, 1


def _fidelity_sm100(key, up, api, cache):
    import torch

    prec, H, B, vl = key["precision"], key["heads"], 2, key["varlen"]
    s_k = 63
    s_q = min(252, s_k * key["ratio"] + key["ratio"] - 1)
    q, k, w, kw = indexer_inputs(up.tensor, prec, H, key["w_dtype"], vl, B, s_q, s_k, key["offsets"])
    qdt, wdt = q.dtype, w.dtype
    api.indexer_forward_wrapper(q, k, w, ratio=key["ratio"], sm_scale=0.5, stream=up.stream, precision=prec, **kw)
    m = policy.sm100_m_block(prec, H)
    if prec == "bf16":
        want = ("bf16", qdt, wdt, _D, H, key["ratio"], m, 128, 64, 4, 384, vl, key["offsets"])
    else:
        want = (prec, qdt, qdt, wdt, torch.float8_e8m0fnu, torch.float8_e8m0fnu, _D, H, key["ratio"], m, 128, 384, vl, 32, key["offsets"])
    return cache, want, 1
