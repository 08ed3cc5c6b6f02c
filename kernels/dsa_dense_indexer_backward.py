"""Spec of the DSA dense indexer backward (cudnn.deepseek_sparse_attention.indexer_backward, 1.32.0).

``build`` presents what ``dense_indexer_backward_sm100`` / ``_sm90``'s lazy compiles pass to
``cute.compile``: every tensor through ``to_cute_tensor`` (gmem, 16-byte aligned, dynamic Int32
extents, dynamic Int64 strides but the unit innermost one; grad_loss 4-byte aligned), absent
cu_seqlens / offsets as None, the scale as Float32 and max_seqlen_q / k as Int32 (run-time values),
the stream. BSHD scores are (B, S_q, S_k) with (B, S_q) denominators; THD (T_q, max_S_k) and (T_q,).
docs/research/dense-indexer-backward.md: 28 configurations built both ways, byte-identical.
"""

from dsa_aot.policy import dsa_dense_indexer_backward as policy
from dsa_aot.toolchain.fakes import dlpack as _T

FAMILY = policy.FAMILY
OPS = policy.OPS
DIM, BLOCK_I = policy.DIM, policy.BLOCK_I


def build(op, key, target):
    """Return (kernel object, args, options, extra key) for one entry. Imports the toolchain."""
    import cuda.bindings.driver as cuda_driver
    import cutlass

    from cudnn.deepseek_sparse_attention.indexer_backward import dense_indexer_backward_sm90 as k90
    from cudnn.deepseek_sparse_attention.indexer_backward import dense_indexer_backward_sm100 as k100
    from cudnn.deepseek_sparse_attention.indexer_backward.indexer_backward_sm90 import IndexerBackwardSm90

    T, bf16, f32, i32 = _T, cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    vl, ratio = key["varlen"], key["ratio"]
    cu = (T(i32, 1), T(i32, 1)) if vl else (None, None)
    offsets = T(i32, 1) if key["offsets"] else None
    lead = 0 if vl else 1  # THD drops the batch mode
    stream = cuda_driver.CUstream(0)
    seq = (cutlass.Int32(1), cutlass.Int32(1))  # max_seqlen_q, max_seqlen_k
    if op in ("score_grad", "score_grad_sm90"):
        cls = k100.ScoreGradDense if op == "score_grad" else k90.ScoreGradDenseSm90
        obj = cls(ratio=ratio, block_I=BLOCK_I)
        score, denom = T(f32, 2 + lead), T(f32, 1 + lead)
        args = (score, T(f32, 2 + lead), denom, T(f32, 1 + lead), *cu, offsets, T(f32, 1, align=4), cutlass.Float32(1.0), *seq, stream)
        return obj, args, "--opt-level 3", {"threads": obj.THREADS_PER_CTA}
    q, w, k = T(bf16, 3 + lead), T(bf16, 2 + lead), T(bf16, 2 + lead)
    dq, dw, dk, sig = T(bf16, 3 + lead), T(bf16, 2 + lead), T(f32, 2 + lead), T(f32, 2 + lead)
    if op == "gemm":
        obj = k100.DenseIndexerBackward2QGemmSm100(head_dim=DIM, heads=key["heads"], block_I=BLOCK_I, ratio=ratio)
        args = (q, w, k, dq, dw, dk, sig, *cu, offsets, cutlass.Float32(1.0), *seq, stream)
        return obj, args, "--opt-level 3", {"threads": obj.THREADS_PER_CTA}
    # the ctor's topk is unused in dense mode (upstream passes S_k; it changes nothing)
    obj = IndexerBackwardSm90(head_dim=DIM, heads=key["heads"], block_I=BLOCK_I, topk=BLOCK_I, is_dense=True, ratio=ratio)
    args = (q, w, k, dq, dw, dk, sig, None, cutlass.Float32(1.0), stream, *cu, *seq, offsets)
    return obj, args, None, {"threads": obj.THREADS_PER_CTA}


def check_policy(targets):
    """The constants the policy mirrors: upstream's workspace alignment and the factories' keyed fields."""
    import inspect

    from cudnn.api_base import ws_align
    from cudnn.deepseek_sparse_attention.indexer_backward import dense_indexer_backward_sm90 as k90
    from cudnn.deepseek_sparse_attention.indexer_backward import dense_indexer_backward_sm100 as k100

    for n in (1, 127, 128, 129, 4096 * 128):
        if ws_align(n * 4) != policy.workspace_bytes(n, False):
            raise ValueError(f"cudnn aligns a {n}-element fp32 dK to {ws_align(n * 4)} bytes; dsa_aot/policy/dsa_dense_indexer_backward.py disagrees")
    # the keys upstream compiles by: if a new field appears, the policy must learn what it changes
    for mod, want in ((k100, "compile_key = (is_varlen, heads, dim, block_I, ratio, bool(has_q_causal_offsets))"),
                      (k90, "gemm_key = (is_varlen, heads, dim, block_I, ratio, bool(has_q_causal_offsets))"),
                      (k90, "score_grad_key = (is_varlen, ratio, block_I, bool(has_q_causal_offsets))")):
        if want not in inspect.getsource(mod):
            raise ValueError(f"{mod.__name__} no longer keys its compiles as `{want}`: re-measure what changes the cubin")


# --- fidelity: cudnn's own wrapper for each key (dsa_aot/toolchain/fidelity.py runs it) ------------------

FIDELITY_ROUTES = {
    "score_grad": "dense_indexer_backward_wrapper -> DenseIndexerBackward.execute -> dense_indexer_backward_sm100 _run (score-grad)",
    "gemm": "dense_indexer_backward_wrapper -> DenseIndexerBackward.execute -> dense_indexer_backward_sm100 _run (2Q GEMM)",
    "score_grad_sm90": "dense_indexer_backward_wrapper -> DenseIndexerBackward.execute -> dense_indexer_backward_sm90 _run (score-grad)",
    "gemm_sm90": "dense_indexer_backward_wrapper -> DenseIndexerBackward.execute -> dense_indexer_backward_sm90 _run (GEMM)",
}
PRELOAD = (
    "cudnn.deepseek_sparse_attention.indexer_backward.api",
    "cudnn.deepseek_sparse_attention.indexer_backward.dense_indexer_backward_sm100",
    "cudnn.deepseek_sparse_attention.indexer_backward.dense_indexer_backward_sm90",
)


def fidelity(op, key, target, up):
    """Run ``dense_indexer_backward_wrapper`` for the key on ``up``: B 2, S_q 256, S_k 64 (ratio 4 geometry),
    sm_scale 0.5, loss_coeff 0.25, fp32 d_index_k (no workspace); THD with max_seqlen given (no sync)."""
    import torch

    from cudnn.deepseek_sparse_attention.indexer_backward import api
    from cudnn.deepseek_sparse_attention.indexer_backward import dense_indexer_backward_sm90 as k90
    from cudnn.deepseek_sparse_attention.indexer_backward import dense_indexer_backward_sm100 as k100

    up.cudnn_route(api)
    up.no_op(api, "memset_zero_async")
    api._cache_of_DenseIndexerBackwardObjects.clear()
    caches = {"score_grad": up.cache(k100, "_score_grad_compile_cache"), "gemm": up.cache(k100, "_gemm_compile_cache"),
              "score_grad_sm90": up.cache(k90, "_dense_score_grad_compile_cache"), "gemm_sm90": up.cache(k90, "_dense_compile_cache")}
    T, f32, bf16, i32 = up.tensor, torch.float32, torch.bfloat16, torch.int32
    H, B, s_q, s_k = key.get("heads", 64), 2, 256, 64
    vl, ratio, offs = key["varlen"], key["ratio"], key["offsets"]
    kw = {}
    if vl:
        lead = (B * s_q,)
        q, w, k = T(bf16, *lead, H, DIM), T(bf16, *lead, H), T(bf16, B * s_k, DIM)
        score = (B * s_q, s_k)
        kw.update(cu_seqlens_q=T(i32, B + 1), cu_seqlens_k=T(i32, B + 1), max_seqlen_q=s_q, max_seqlen_k=s_k)
    else:
        lead = (B, s_q)
        q, w, k = T(bf16, *lead, H, DIM), T(bf16, *lead, H), T(bf16, B, s_k, DIM)
        score = (B, s_q, s_k)
    if offs:
        kw["q_causal_offsets"] = T(i32, B)
    api.dense_indexer_backward_wrapper(q, w, k, T(f32, *score), T(f32, *lead), T(f32, *score), T(f32, *lead), T(f32, 1), sm_scale=0.5,
                                       loss_coeff=0.25, ratio=ratio, d_index_q=T(bf16, *q.shape), d_weights=T(bf16, *w.shape),
                                       d_index_k=T(f32, *k.shape), stream=up.stream, **kw)
    if op == "score_grad_sm90":
        want = (vl, ratio, BLOCK_I, offs)
    else:  # upstream's SM100 score-grad shares the GEMM's key (heads and dim included; the cubin has neither)
        want = (vl, H, DIM, BLOCK_I, ratio, offs)
    return caches[op], want, 1
