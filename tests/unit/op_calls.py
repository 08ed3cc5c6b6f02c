"""Valid calls of every public op on stand-in CUDA tensors (tests/unit/stand_in.py), built on the
small build of tests/unit/conftest.py (sm_90a: CSA ratio 4 d 128, indexer H64 top-k 128, sparse
attention H64 D512 top-k 128, local_to_global, compactify 128 columns, indexer top-k fp32 4096-column bucket top-k 128, indexer forward bf16 H64 ratio 4 with LSE, dense indexer backward H64 ratio 4). Each call is (function, args, kwargs, outputs): ``outputs`` are the
tensors the op may write (its outputs and workspace)."""

from __future__ import annotations

import torch

from stand_in import cuda_tensor


def _t(shape, dtype, dev, fill=None):
    if dtype in (torch.int32, torch.int64, torch.uint8):
        x = torch.zeros(shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    else:
        x = torch.randn(shape, dtype=torch.float32).to(dtype)
    return cuda_tensor(x, dev)


def _csa_inputs(dev, nb, ratio=4, d=128, coff=2):
    """kv, score, ape, cu_seqlens, cu_seqlens_comp of one sequence of ``ratio * nb`` tokens."""
    tokens = ratio * nb
    kv, score = _t((tokens, coff * d), torch.bfloat16, dev), _t((tokens, coff * d), torch.bfloat16, dev)
    ape = _t((ratio, coff * d), torch.float32, dev)
    cu, cuc = cuda_tensor(torch.tensor([0, tokens], dtype=torch.int32), dev), cuda_tensor(torch.tensor([0, nb], dtype=torch.int32), dev)
    return kv, score, ape, cu, cuc


def csa_forward(dev, stream, nb=32):
    import dsa_aot.csa

    ratio, d, coff = 4, 128, 2
    kv, score, ape, cu, cuc = _csa_inputs(dev, nb, ratio, d, coff)
    out = _t((nb, d), torch.bfloat16, dev)
    return dsa_aot.csa.compressor_forward_into, (out, kv, score, ape, cu, cuc), dict(ratio=ratio, coff=coff, stream=stream), (out,)


def csa_backward(dev, stream, nb=32, deterministic=True):
    import dsa_aot.csa

    ratio, d, coff = 4, 128, 2
    tokens = ratio * nb
    kv, score, ape, cu, cuc = _csa_inputs(dev, nb, ratio, d, coff)
    go = _t((nb, d), torch.bfloat16, dev)
    gkv, gs, gape = _t((tokens, coff * d), torch.bfloat16, dev), _t((tokens, coff * d), torch.bfloat16, dev), _t((ratio, coff * d), torch.float32, dev)
    ws = _t((dsa_aot.csa.backward_workspace_bytes(nb, ratio, d, coff),), torch.uint8, dev) if deterministic else None
    kw = dict(ratio=ratio, coff=coff, stream=stream, deterministic=deterministic, workspace=ws)
    outs = (gkv, gs, gape) + ((ws,) if ws is not None else ())
    return dsa_aot.csa.compressor_backward_into, (gkv, gs, gape, kv, score, ape, cu, cuc, go), kw, outs


def indexer_backward(dev, stream, s_q=8, s_k=256):
    import dsa_aot.dsa

    b, h, d, topk = 1, 64, 128, 128
    q, w, k = _t((b, s_q, h, d), torch.bfloat16, dev), _t((b, s_q, h), torch.bfloat16, dev), _t((b, s_k, d), torch.bfloat16, dev)
    att, isc = _t((b, s_q, topk), torch.float32, dev), _t((b, s_q, topk), torch.float32, dev)
    idx = _t((b, s_q, topk), torch.int32, dev, fill=1)
    gl = _t((1,), torch.float32, dev)
    dq, dw, dk = _t((b, s_q, h, d), torch.bfloat16, dev), _t((b, s_q, h), torch.bfloat16, dev), _t((b, s_k, d), torch.float32, dev)
    args = (dq, dw, dk, q, w, k, att, isc, idx, gl)
    return dsa_aot.dsa.indexer_backward_into, args, dict(sm_scale=0.1, loss_coeff=1.0, stream=stream), (dq, dw, dk, att)


def sparse_backward(dev, stream, s_q=16, s_kv=256):
    import dsa_aot.dsa

    h, d, topk = 64, 512, 128
    q, kv = _t((s_q, h, d), torch.bfloat16, dev), _t((s_kv, d), torch.bfloat16, dev)
    out, dout = _t((s_q, h, 512), torch.bfloat16, dev), _t((s_q, h, 512), torch.bfloat16, dev)
    lse, sink = _t((s_q, h), torch.float32, dev), _t((h,), torch.float32, dev)
    idx = _t((s_q, topk), torch.int32, dev, fill=3)
    dq, dkv, d_sink = _t((s_q, h, d), torch.bfloat16, dev), _t((s_kv, d), torch.bfloat16, dev), _t((h,), torch.float32, dev)
    ws = _t((dsa_aot.dsa.sparse_attention_backward_workspace_bytes(s_q, s_kv, d, h),), torch.uint8, dev)
    args = (dq, dkv, d_sink, q, kv, out, dout, lse, sink, idx)
    return dsa_aot.dsa.sparse_attention_backward_into, args, dict(softmax_scale=0.05, stream=stream, workspace=ws), (dq, dkv, d_sink, ws)


def local_to_global(dev, stream, b=2, s_q=8, k=128):
    import dsa_aot.dsa

    idx, out = _t((b, s_q, k), torch.int32, dev, fill=5), _t((b, s_q, k), torch.int32, dev)
    return dsa_aot.dsa.local_to_global_into, (out, idx), dict(seqlen_k=4096, stream=stream), (out,)


def compactify(dev, stream, rows=16, cols=128):
    import dsa_aot.dsa

    idx, out, length = _t((rows, cols), torch.int32, dev, fill=-1), _t((rows, cols), torch.int32, dev), _t((rows,), torch.int32, dev)
    return dsa_aot.dsa.compactify_into, (out, length, idx), dict(stream=stream), (out, length)


def indexer_top_k(dev, stream, rows=8, cols=4000):
    import dsa_aot.dsa

    top_k = 128
    x, lens = _t((rows, cols), torch.float32, dev), _t((rows,), torch.int32, dev, fill=cols)
    idx, val = _t((rows, top_k), torch.int32, dev), _t((rows, top_k), torch.float32, dev)
    ws = _t((dsa_aot.dsa.indexer_top_k_workspace_bytes(x),), torch.uint8, dev)
    return dsa_aot.dsa.indexer_top_k_into, (idx, val, x, lens), dict(top_k=top_k, stream=stream, workspace=ws), (idx, val, ws)


def indexer_forward(dev, stream, s_q=8, s_k=40):
    import dsa_aot.dsa

    b, h, d = 2, 64, 128
    q, k, w = _t((b, s_q, h, d), torch.bfloat16, dev), _t((b, s_k, 1, d), torch.bfloat16, dev), _t((b, s_q, h), torch.bfloat16, dev)
    scores, lse = _t((b, s_q, s_k), torch.float32, dev), _t((b, s_q), torch.float32, dev)
    return dsa_aot.dsa.indexer_forward_into, (scores, lse, q, k, w), dict(ratio=4, sm_scale=0.1, stream=stream), (scores, lse)


def fused_top_k(dev, stream, b=2, s_q=256, s_k=65, top_k=512):
    """The fused indexer top-k, BSHD (SM100 only: the sm100 build, a capability-10.0 stand-in)."""
    import dsa_aot.dsa

    h, d = 64, 128
    q, k, w = _t((b, s_q, h, d), torch.bfloat16, dev), _t((b, s_k, 1, d), torch.bfloat16, dev), _t((b, s_q, h), torch.bfloat16, dev)
    idx, val, sm = _t((b, s_q, top_k), torch.int32, dev), _t((b, s_q, top_k), torch.float32, dev), _t((b, s_q, top_k), torch.float32, dev)
    cand = _t((dsa_aot.dsa.compress_topk_cand_buffer_size(b, s_q, s_k, 4),), torch.float32, dev)
    return (dsa_aot.dsa.indexer_forward_top_k_into, (idx, val, sm, None, cand, q, k, w, top_k), dict(sm_scale=0.1, stream=stream),
            (idx, val, sm, cand))


def fused_top_k_thd(dev, stream, top_k=512):
    """The fused indexer top-k, THD: two segments (300 / 300 queries over 90 / 180 keys), every value given."""
    import dsa_aot.dsa

    h, d, tq, tk = 64, 128, 600, 270
    q, k, w = _t((tq, h, d), torch.bfloat16, dev), _t((tk, 1, d), torch.bfloat16, dev), _t((tq, h), torch.bfloat16, dev)
    cu_q = cuda_tensor(torch.tensor([0, 300, 600], dtype=torch.int32), dev)
    cu_k = cuda_tensor(torch.tensor([0, 90, 270], dtype=torch.int32), dev)
    cbo = _t((3,), torch.int64, dev)
    idx, val, sm = _t((tq, top_k), torch.int32, dev), _t((tq, top_k), torch.float32, dev), _t((tq, top_k), torch.float32, dev)
    cand = _t((40000,), torch.float32, dev)
    return (dsa_aot.dsa.indexer_forward_top_k_into, (idx, val, sm, None, cand, q, k, w, top_k),
            dict(cand_batch_offsets=cbo, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=300, max_seqlen_k=180, stream=stream), (idx, val, sm, cand))


def dense_indexer_backward(dev, stream, s_q=8, s_k=3, varlen=False, dk_dtype=torch.float32):
    """The dense indexer backward (H64, ratio 4), BSHD (B 2) or THD (two segments of s_q / s_q - 3 queries over s_k / s_k - 1 keys);
    fp32 d_index_k (a bf16 one takes the fp32 workspace and a torch cast)."""
    import dsa_aot.dsa

    h, d = 64, 128
    if varlen:
        lead, k_lead, score = (2 * s_q - 3,), (2 * s_k - 1,), (2 * s_q - 3, s_k)
        cu = (cuda_tensor(torch.tensor([0, s_q, 2 * s_q - 3], dtype=torch.int32), dev), cuda_tensor(torch.tensor([0, s_k, 2 * s_k - 1], dtype=torch.int32), dev))
        kw = dict(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=s_q, max_seqlen_k=s_k)
    else:
        lead, k_lead, score, kw = (2, s_q), (2, s_k), (2, s_q, s_k), {}
    q, w, k = _t(lead + (h, d), torch.bfloat16, dev), _t(lead + (h,), torch.bfloat16, dev), _t(k_lead + (d,), torch.bfloat16, dev)
    att, den, isc, lse = _t(score, torch.float32, dev), _t(lead, torch.float32, dev), _t(score, torch.float32, dev), _t(lead, torch.float32, dev)
    gl = _t((1,), torch.float32, dev)
    dq, dw, dk = _t(q.shape, torch.bfloat16, dev), _t(w.shape, torch.bfloat16, dev), _t(k.shape, dk_dtype, dev)
    need = dsa_aot.dsa.dense_indexer_backward_workspace_bytes(k.shape, dk_dtype)
    ws = _t((need,), torch.uint8, dev) if need else None
    kw.update(sm_scale=0.1, loss_coeff=0.5, ratio=4, stream=stream, workspace=ws)
    outs = (dq, dw, dk, isc) + ((ws,) if ws is not None else ())
    return dsa_aot.dsa.dense_indexer_backward_into, (dq, dw, dk, q, w, k, att, den, isc, lse, gl), kw, outs


def dense_indexer_backward_thd(dev, stream, s_q=8):
    return dense_indexer_backward(dev, stream, s_q=s_q, varlen=True)


def sparse_indexer_score_recompute(dev, stream, s_q=8, s_k=300, length=False):
    """The sparse indexer score recompute (H64, top-k 512, local ids), B 2; on SM90 with its workspace."""
    import dsa_aot.dsa

    b, h, d, topk = 2, 64, 128, 512
    q, k, w = _t((b, s_q, h, d), torch.bfloat16, dev), _t((b, s_k, d), torch.bfloat16, dev), _t((b, s_q, h), torch.bfloat16, dev)
    idx, out = _t((b, s_q, topk), torch.int32, dev, fill=-1), _t((b, s_q, topk), torch.float32, dev)
    ln = _t((b, s_q), torch.int32, dev, fill=7) if length else None
    need = dsa_aot.dsa.sparse_indexer_score_recompute_workspace_bytes(w.shape, dev)
    ws = _t((need,), torch.uint8, dev) if need else None
    return (dsa_aot.dsa.sparse_indexer_score_recompute_into, (out, q, k, w, idx, ln), dict(stream=stream, workspace=ws),
            (out,) + ((ws,) if ws is not None else ()))


def sparse_attn_score_recompute(dev, stream, s_q=8, s_k=300, length=False, heads=64):
    """The sparse attention score recompute (D512, top-k 512, local ids, softmax_scale 512**-0.5), B 2; on SM90
    with its workspace."""
    import dsa_aot.dsa

    b, d, topk = 2, 512, 512
    q, k, lse = _t((b, s_q, heads, d), torch.bfloat16, dev), _t((b, s_k, d), torch.bfloat16, dev), _t((b, s_q, heads), torch.float32, dev)
    idx, out = _t((b, s_q, topk), torch.int32, dev, fill=-1), _t((b, s_q, topk), torch.float32, dev)
    ln = _t((b, s_q), torch.int32, dev, fill=7) if length else None
    need = dsa_aot.dsa.sparse_attn_score_recompute_workspace_bytes(lse.shape, dev)
    ws = _t((need,), torch.uint8, dev) if need else None
    return (dsa_aot.dsa.sparse_attn_score_recompute_into, (out, q, k, lse, idx, 512**-0.5, ln), dict(stream=stream, workspace=ws),
            (out,) + ((ws,) if ws is not None else ()))


def _dense_score(dev, stream, attention, s_q, s_k, varlen):
    """A dense score recompute's ``_into`` call, bf16 H64 ratio 4, B 2 (THD: segments of S_q and S_k rows, SM100
    only; on SM90 with its workspace): the indexer's (D128, weights, scale 1.0) or the attention's (D512, an fp32
    LSE, softmax_scale 512**-0.5)."""
    import dsa_aot.dsa

    b, h, d = 2, 64, 512 if attention else 128
    lead, k_lead = ((b * s_q,), (b * s_k,)) if varlen else ((b, s_q), (b, s_k))
    q, k = _t(lead + (h, d), torch.bfloat16, dev), _t(k_lead + (1, d), torch.bfloat16, dev)
    aux = _t(lead + (h,), torch.float32 if attention else torch.bfloat16, dev)
    out, den = _t(lead[:1] + (s_k,) if varlen else lead + (s_k,), torch.float32, dev), _t(lead, torch.float32, dev)
    kw = dict(ratio=4, stream=stream)
    if varlen:
        kw.update(cu_seqlens_q=_t((b + 1,), torch.int32, dev), cu_seqlens_k=_t((b + 1,), torch.int32, dev), max_seqlen_q=s_q, max_seqlen_k=s_k)
    sizer = dsa_aot.dsa.dense_attn_score_recompute_workspace_bytes if attention else dsa_aot.dsa.dense_indexer_score_recompute_workspace_bytes
    need = 0 if varlen else sizer(aux.shape, dev)
    ws = _t((need,), torch.uint8, dev) if need else None
    fn = dsa_aot.dsa.dense_attn_score_recompute_into if attention else dsa_aot.dsa.dense_indexer_score_recompute_into
    return fn, (out, den, q, k, aux) + ((512**-0.5,) if attention else ()), dict(kw, workspace=ws), (out, den) + ((ws,) if ws is not None else ())


def dense_indexer_score_recompute(dev, stream, s_q=8, s_k=40, varlen=False):
    return _dense_score(dev, stream, False, s_q, s_k, varlen)


def dense_indexer_score_recompute_mx(dev, stream, precision="mxfp8", s_q=8, s_k=40, varlen=False, heads=64):
    """A block-scaled dense indexer ``_into`` call (SM100 only): :func:`_dense_score_mx` with bf16 weights, D128."""
    return _dense_score_mx(dev, stream, False, precision, s_q, s_k, varlen, heads, 128)


def dense_attn_score_recompute_mx(dev, stream, s_q=8, s_k=40, varlen=False, heads=64, dim=512):
    """An mxfp8 dense attention ``_into`` call (SM100 only): :func:`_dense_score_mx` with an fp32 LSE and
    softmax_scale 512**-0.5."""
    return _dense_score_mx(dev, stream, True, "mxfp8", s_q, s_k, varlen, heads, dim)


def _dense_score_mx(dev, stream, attention, precision, s_q, s_k, varlen, heads, dim):
    """A block-scaled dense score ``_into`` call, ratio 4, B 2, one KV head: q / k e4m3 (mxfp8) or e2m1 pairs
    (mxfp4, last dim dim / 2), e8m0 scales in upstream's packed shapes (ceil4(dim / 32) columns; THD: segments of
    S_q and S_k rows, each padded to 128 scale rows, with their padded offsets and the maxima)."""
    import dsa_aot.dsa

    b, h = 2, heads
    d = dim // 2 if precision == "mxfp4" else dim
    cols = -(-(dim // 32) // 4) * 4

    def raw(shape, dtype):  # random bytes viewed as an 8-bit (or packed 4-bit) float type
        return cuda_tensor(torch.randint(0, 127, shape, dtype=torch.uint8).view(dtype), dev)

    qk = torch.float4_e2m1fn_x2 if precision == "mxfp4" else torch.float8_e4m3fn
    lead, k_lead = ((b * s_q,), (b * s_k,)) if varlen else ((b, s_q), (b, s_k))
    q, k, aux = raw(lead + (h, d), qk), raw(k_lead + (1, d), qk), _t(lead + (h,), torch.float32 if attention else torch.bfloat16, dev)
    out, den = _t(lead[:1] + (s_k,) if varlen else lead + (s_k,), torch.float32, dev), _t(lead, torch.float32, dev)
    rows_q, rows_k = -(-s_q * h // 128) * 128, -(-s_k // 128) * 128
    kw = dict(ratio=4, stream=stream, precision=precision)
    if varlen:
        kw.update(cu_seqlens_q=cuda_tensor(torch.tensor([0, s_q, 2 * s_q], dtype=torch.int32), dev),
                  cu_seqlens_k=cuda_tensor(torch.tensor([0, s_k, 2 * s_k], dtype=torch.int32), dev), max_seqlen_q=s_q, max_seqlen_k=s_k,
                  q_scale=raw((1, b * rows_q, cols), torch.float8_e8m0fnu), k_scale=raw((1, b * rows_k, cols), torch.float8_e8m0fnu),
                  cu_seqlens_q_scale_padded=cuda_tensor(torch.tensor([0, rows_q, 2 * rows_q], dtype=torch.int32), dev),
                  cu_seqlens_k_scale_padded=cuda_tensor(torch.tensor([0, rows_k, 2 * rows_k], dtype=torch.int32), dev))
    else:
        kw.update(q_scale=raw((b, rows_q, cols), torch.float8_e8m0fnu), k_scale=raw((b, rows_k, cols), torch.float8_e8m0fnu))
    fn = dsa_aot.dsa.dense_attn_score_recompute_into if attention else dsa_aot.dsa.dense_indexer_score_recompute_into
    return fn, (out, den, q, k, aux) + ((512**-0.5,) if attention else ()), kw, (out, den)


def dense_attn_score_recompute(dev, stream, s_q=8, s_k=40, varlen=False):
    return _dense_score(dev, stream, True, s_q, s_k, varlen)


def dense_attn_score_recompute_thd(dev, stream):
    return dense_attn_score_recompute(dev, stream, varlen=True)


def dense_indexer_score_recompute_thd(dev, stream):
    return dense_indexer_score_recompute(dev, stream, varlen=True)


SM100_FAMILIES = {"fused_top_k": fused_top_k, "fused_top_k_thd": fused_top_k_thd, "sparse_indexer_score_recompute": sparse_indexer_score_recompute,
                  "sparse_attn_score_recompute": sparse_attn_score_recompute, "dense_indexer_score_recompute": dense_indexer_score_recompute,
                  "dense_indexer_score_recompute_thd": dense_indexer_score_recompute_thd, "dense_attn_score_recompute": dense_attn_score_recompute,
                  "dense_attn_score_recompute_thd": dense_attn_score_recompute_thd}  # on the sm100 build (sm100_env)


def plan_class(fn):
    """The plan class of an ``_into`` op (its tensors in the op's order)."""
    import dsa_aot.csa
    import dsa_aot.dsa

    return {dsa_aot.csa.compressor_forward_into: dsa_aot.csa.CompressorForward, dsa_aot.csa.compressor_backward_into: dsa_aot.csa.CompressorBackward,
            dsa_aot.dsa.indexer_backward_into: dsa_aot.dsa.IndexerBackward,
            dsa_aot.dsa.sparse_attention_backward_into: dsa_aot.dsa.SparseAttentionBackward,
            dsa_aot.dsa.local_to_global_into: dsa_aot.dsa.LocalToGlobal, dsa_aot.dsa.compactify_into: dsa_aot.dsa.Compactify,
            dsa_aot.dsa.indexer_top_k_into: dsa_aot.dsa.IndexerTopK, dsa_aot.dsa.indexer_forward_into: dsa_aot.dsa.IndexerForward,
            dsa_aot.dsa.dense_indexer_backward_into: dsa_aot.dsa.DenseIndexerBackward,
            dsa_aot.dsa.sparse_indexer_score_recompute_into: dsa_aot.dsa.SparseIndexerScoreRecompute,
            dsa_aot.dsa.sparse_attn_score_recompute_into: dsa_aot.dsa.SparseAttnScoreRecompute,
            dsa_aot.dsa.dense_indexer_score_recompute_into: dsa_aot.dsa.DenseIndexerScoreRecompute,
            dsa_aot.dsa.dense_attn_score_recompute_into: dsa_aot.dsa.DenseAttnScoreRecompute}[fn]


def _scalars_by_name(make):
    """``make`` with its call's arguments from the first positional scalar on (an attention's softmax_scale)
    passed by keyword: the positional arguments are then the call's leading tensors, what a plan takes."""
    import inspect

    def made(dev, stream, **kw):
        fn, args, kws, writes = make(dev, stream, **kw)
        names = list(inspect.signature(fn).parameters)
        n = next(i for i, a in enumerate(args) if not (a is None or isinstance(a, torch.Tensor)))
        return fn, args[:n], dict(kws, **dict(zip(names[n:], args[n:]))), writes

    return made


FAMILIES = {"csa_forward": csa_forward, "csa_backward": csa_backward, "indexer_backward": indexer_backward, "sparse_backward": sparse_backward,
            "local_to_global": local_to_global, "compactify": compactify, "indexer_top_k": indexer_top_k,
            "indexer_forward": indexer_forward, "dense_indexer_backward": dense_indexer_backward, "dense_indexer_backward_thd": dense_indexer_backward_thd,
            "sparse_indexer_score_recompute": sparse_indexer_score_recompute,
            "sparse_attn_score_recompute": _scalars_by_name(sparse_attn_score_recompute),
            "dense_indexer_score_recompute": dense_indexer_score_recompute, "dense_attn_score_recompute": _scalars_by_name(dense_attn_score_recompute)}

