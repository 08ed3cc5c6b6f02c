"""Fused DSA indexer forward + top-k (cudnn's indexer_forward_top_k_wrapper), from shipped cubins.
Work in progress (branch): the candidate-buffer size and the stage-2 call (the top-k of each row's
compact candidates, checked on the H200); the GEMM, the windows, local-to-global and the public op
are not written yet.

The candidate buffer holds, for query row r of batch b, the ``(off_b + r + 1) // ratio`` compressed
scores that row sees (clamped to S_k), rows back to back: row r of batch b at ``base_b + G(off_b +
r) - G(off_b)`` with ``G(n) = sum_{i<n} (i + 1) // ratio`` (:func:`aot.policy.dsa_indexer_forward_top_k.cand_floats`);
``base_b = b * G(S_q)`` without causal offsets, else the int64 prefix sums ``cand_batch_offsets``.
"""

from __future__ import annotations

from ..policy import dsa_indexer_forward_top_k as policy
from ._support import aliasing, check, footprint, input_error, integer, launcher, stream_handle, tensor_args
from .plan import Recorder, cached, compile_call

__all__ = ["compress_topk_cand_buffer_size", "indexer_forward_top_k_into"]

FAMILY = policy.FAMILY
_I32 = 2**31 - 1
_STAGE2: dict = {}


def compress_topk_cand_buffer_size(bs, seqlen_q, seqlen_k, ratio, microbatch_rows=-1, return_lse=False, q_causal_offsets=None, precision="bf16"):
    """fp32 elements of the candidate buffer of a BSHD call (cudnn's compress_topk_cand_buffer_size):
    ``bs * G(S_q)`` for one launch, ``bs * max_window G`` when the call runs in windows. With
    ``q_causal_offsets`` the exact per-batch sum, which reads the offsets back from the device (a
    synchronisation, as upstream's)."""
    problems = []
    for name, v, lo in (("bs", bs, 0), ("seqlen_q", seqlen_q, 0), ("seqlen_k", seqlen_k, 0), ("ratio", ratio, 1)):
        integer(problems, name, v, lo, _I32)
    if problems:
        raise input_error(problems)
    if seqlen_q > seqlen_k * ratio + ratio - 1:
        raise input_error([f"seqlen_q ({seqlen_q}) must be <= seqlen_k * ratio + (ratio - 1) ({seqlen_k * ratio + ratio - 1})"])
    if q_causal_offsets is not None:
        offs = [int(o) for o in q_causal_offsets.tolist()]  # upstream's .item(): a device sync
        if len(offs) != bs:
            raise input_error([f"q_causal_offsets: {len(offs)} offsets for {bs} batches"])
        return sum(policy.cand_floats(o + seqlen_q, ratio) - policy.cand_floats(o, ratio) for o in offs)
    mb = microbatch_rows
    if precision != "bf16":
        mb = 0
    elif mb < 0:
        mb = 0 if return_lse else policy.microbatch_rows(seqlen_q, bs, ratio)
    if 0 < mb < seqlen_q:
        return bs * max(policy.cand_floats(rs + min(mb, seqlen_q - rs), ratio) - policy.cand_floats(rs, ratio) for rs in range(0, seqlen_q, mb))
    return bs * policy.cand_floats(seqlen_q, ratio)


def _record_stage2(rec, le, ts, ptrs, s_q, s_k):
    """Stage 2's launch: the host function's arguments in upstream's order (compress_stage2_topk's
    cute.compile call): cand, indices, logits, S_q, S_k, the stream, [batch offsets, causal
    offsets], [softmax]. ``ts``: (indices, logits, softmax, cand, cbo, qco); ``ptrs``: their pointers
    as the recording call numbers them."""
    idx, val, sm, cand, cbo, qco = ts
    p_idx, p_val, p_sm, p_cand, p_cbo, p_qco = ptrs
    args = [p_cand, cand.shape[0], *tensor_args(idx, p_idx), *tensor_args(val, p_val), s_q, s_k, rec.s]
    if cbo is not None:
        args += [*tensor_args(cbo, p_cbo), *tensor_args(qco, p_qco)]
    if sm is not None:
        args += tensor_args(sm, p_sm)
    rec.launch(le, *args)


def _plan_stage2(indices, logits, softmax, cand, cbo, qco, s_k, top_k, ratio, deterministic):
    """Validate a stage-2 call (BSHD; outputs (B, S_q, top_k)) and compile it."""
    import torch

    problems = []
    if not isinstance(indices, torch.Tensor) or indices.ndim != 3:
        raise input_error(["indices: expected (B, S_q, top_k) int32"])
    b, s_q, k = indices.shape
    dev = indices.device.index if indices.device.type == "cuda" else None
    integer(problems, "top_k", top_k, 1, policy.MAX_TOP_K)
    check(problems, indices, "indices", (b, s_q, top_k), torch.int32, dev, 4)
    check(problems, logits, "logits", (b, s_q, top_k), torch.float32, dev, 4)
    if softmax is not None:
        check(problems, softmax, "softmax", (b, s_q, top_k), torch.float32, dev, 4)
    if not isinstance(cand, torch.Tensor) or cand.ndim != 1:
        problems.append("cand_buffer: expected a 1-D fp32 tensor")
    else:
        check(problems, cand, "cand_buffer", cand.shape, torch.float32, dev, 16)
        if cand.shape[0] > _I32:
            problems.append(f"cand_buffer: {cand.shape[0]} floats (the BSHD kernels take an int32 extent)")
    if (cbo is None) != (qco is None):
        problems.append("cand_batch_offsets and q_causal_offsets: both or neither")
    if cbo is not None:
        check(problems, cbo, "cand_batch_offsets", (b + 1,), torch.int64, dev, 16)
        check(problems, qco, "q_causal_offsets", (b,), torch.int32, dev, 16)
    if not problems:
        problems += aliasing((("indices", indices), ("logits", logits), ("softmax", softmax)),
                             (("cand_buffer", cand), ("cand_batch_offsets", cbo), ("q_causal_offsets", qco)))
    if problems:
        raise input_error(problems)
    ts = (indices, logits, softmax, cand, cbo, qco)
    rec = Recorder(len(ts))
    if b and s_q:
        key = {"top_k": top_k, "ratio": ratio, "threads": policy.stage2_threads(b * s_q, s_k), "offsets": cbo is not None,
               "softmax": softmax is not None, "deterministic": bool(deterministic), "varlen": False}
        _record_stage2(rec, launcher(FAMILY, "stage2", key, dev), ts, rec.p, s_q, s_k)
    return compile_call("dsa_indexer_forward_top_k.stage2", rec, dev, ts, footprint(ts, writes=(0, 1, 2), masks=(3, 3, 3, 15, 15, 15)))


def _stage2_into(indices, logits, softmax, cand, s_k, top_k, ratio, cand_batch_offsets=None, q_causal_offsets=None, deterministic=False,
                 stream=None):
    """Stage 2 alone (the op's second launch), into caller buffers: what the H200 can run of this family."""
    ts = (indices, logits, softmax, cand, cand_batch_offsets, q_causal_offsets)
    extra = (s_k, top_k, ratio, deterministic)
    call, p = cached(_STAGE2, ts, extra, lambda: _plan_stage2(*ts, s_k, top_k, ratio, deterministic))
    call.run(p, stream_handle(stream, call.dev), call.x, ts, stream)


# --- the fused call, BSHD (work in progress: one launch of each kernel; THD and the long-S_q windows missing) ---

_CALLS: dict = {}
_TENSORS = ("indices", "logits", "softmax", "lse", "cand_buffer", "q", "k", "w", "q_scale", "k_scale", "q_causal_offsets", "cand_batch_offsets")


def _record_gemm(rec, le, ts, cand_2d, s_q, s_k, pbf):
    """The compressed GEMM's launch in upstream's order (_compressed_top_k_sm100's cute.compile call):
    q, k, w, [q_scale, k_scale], the candidate buffer ((B, G(S_q)) view, or flat), [lse], the scale,
    S_q, S_k, [causal offsets], the stream, [batch offsets]. ``ts`` in :data:`_TENSORS` order."""
    p = rec.p
    idx, val, sm, lse, cand, q, k, w, qs, ks, qco, cbo = ts
    args = [*tensor_args(q, p[5]), *tensor_args(k, p[6]), *tensor_args(w, p[7])]
    if qs is not None:
        args += [*tensor_args(qs, p[8]), *tensor_args(ks, p[9])]
    args += [p[4], q.shape[0], pbf, pbf] if cand_2d else [p[4], cand.shape[0]]
    if lse is not None:
        args += tensor_args(lse, p[3])
    args += [rec.x[0], s_q, s_k]
    if qco is not None:
        args += tensor_args(qco, p[10])
    args.append(rec.s)
    if cbo is not None:
        args += tensor_args(cbo, p[11])
    rec.launch(le, *args)


def _plan_fused(indices, logits, softmax, lse, cand_buffer, q, k, w, top_k, ratio=4, sm_scale=1.0, q_causal_offsets=None, cand_batch_offsets=None,
                precision="bf16", q_scale=None, k_scale=None, topk_indices_global=True, deterministic=False):
    """Validate a BSHD fused call into caller buffers and compile its launches (GEMM, stage 2, local-to-global)."""
    import torch

    from . import dsa_indexer_forward as fwd
    from ..policy import dsa_topk_utils as l2g_policy
    from ._support import flag, scalar_f32

    problems = []
    scalar_f32(problems, "sm_scale", sm_scale)
    integer(problems, "top_k", top_k, 1, policy.MAX_TOP_K)
    flag(problems, "topk_indices_global", topk_indices_global)
    flag(problems, "deterministic", deterministic)
    c = fwd._inputs(problems, q, k, w, ratio, None, None, None, None, None, q_causal_offsets, precision, q_scale, k_scale)
    if c is not None and not c.sm100:
        problems.append(f"cuda:{c.dev} runs {c.arch}: cudnn's fused indexer forward + top-k exists for SM100 only")
    if problems:
        raise input_error(problems)
    b, s_q, s_k = c.b, c.s_q, c.s_k
    if policy.microbatch_rows(s_q, b, ratio) and precision == "bf16" and lse is None and q_causal_offsets is None:
        raise input_error([f"S_q {s_q}: upstream runs this call in windows of {policy.microbatch_rows(s_q, b, ratio)} rows, which this "
                           f"build does not have yet (work in progress)"])
    offs = q_causal_offsets is not None
    pbf = policy.cand_floats(s_q, ratio)
    cand_2d = not offs and policy.uses_cand_2d(precision, s_q, ratio)
    for name, t, dt in (("indices", indices, torch.int32), ("logits", logits, torch.float32), ("softmax", softmax, torch.float32)):
        if t is not None or name != "softmax":
            check(problems, t, name, (b, s_q, top_k), dt, c.dev, 16 if name == "indices" and topk_indices_global else 4)
    if lse is not None:
        check(problems, lse, "lse", (b, s_q), torch.float32, c.dev, 16)
    need = None if offs else b * pbf  # with causal offsets the size needs the offsets' values: the caller's (as upstream trusts it)
    if not isinstance(cand_buffer, torch.Tensor) or cand_buffer.ndim != 1:
        problems.append(f"cand_buffer: expected a 1-D fp32 tensor of at least {need or 'compress_topk_cand_buffer_size(...)'} floats")
    else:
        check(problems, cand_buffer, "cand_buffer", cand_buffer.shape, torch.float32, c.dev, 16)
        if need is not None and cand_buffer.shape[0] < need:
            problems.append(f"cand_buffer: {cand_buffer.shape[0]} floats, the call needs {need} (compress_topk_cand_buffer_size)")
        if cand_buffer.shape[0] > _I32:
            problems.append(f"cand_buffer: {cand_buffer.shape[0]} floats (upstream's BSHD kernels take an int32 extent)")
    if offs:
        check(problems, cand_batch_offsets, "cand_batch_offsets", (b + 1,), torch.int64, c.dev, 16)
    elif cand_batch_offsets is not None:
        problems.append("cand_batch_offsets: only with q_causal_offsets in BSHD (the batch bases are b * G(S_q) otherwise)")
    if not problems:
        problems += aliasing((("indices", indices), ("logits", logits), ("softmax", softmax), ("lse", lse), ("cand_buffer", cand_buffer)),
                             (("q", q), ("k", k), ("w", w), ("q_scale", q_scale), ("k_scale", k_scale), ("q_causal_offsets", q_causal_offsets),
                              ("cand_batch_offsets", cand_batch_offsets)))
    if problems:
        raise input_error(problems)
    ts = (indices, logits, softmax, lse, cand_buffer, q, k, w, q_scale, k_scale, q_causal_offsets, cand_batch_offsets)
    rec = Recorder(len(ts), 1)
    if b and s_q and s_k:
        gkey = {"precision": precision, "w_dtype": c.w_dtype, "heads": c.h, "ratio": ratio, "lse": lse is not None,
                "cand": "1d_cbo" if offs else "2d" if cand_2d else "1d", "varlen": False, "offsets": offs}
        _record_gemm(rec, launcher(FAMILY, "gemm", gkey, c.dev), ts, cand_2d, s_q, s_k, pbf)
        skey = {"top_k": top_k, "ratio": ratio, "threads": policy.stage2_threads(b * s_q, s_k), "offsets": offs, "softmax": softmax is not None,
                "deterministic": bool(deterministic), "varlen": False}
        p = rec.p
        _record_stage2(rec, launcher(FAMILY, "stage2", skey, c.dev), (indices, logits, softmax, cand_buffer, cand_batch_offsets, q_causal_offsets),
                       (p[0], p[1], p[2], p[4], p[11], p[10]), s_q, s_k)
        if topk_indices_global:  # in place: -1 padding kept (upstream's preserve_negative form)
            lkey = l2g_policy.local_to_global_kernel("int32", False, True)
            rec.launch(launcher("dsa_topk_utils", *lkey, c.dev), *tensor_args(indices, rec.p[0]), *tensor_args(indices, rec.p[0]), s_k, rec.s)
    foot = footprint(ts, writes=(0, 1, 2, 3, 4))
    return compile_call("dsa_indexer_forward_top_k.fused", rec, c.dev, ts, foot, (scalar_f32([], "sm_scale", sm_scale),), fwd._scale)


def indexer_forward_top_k_into(indices, logits, softmax, lse, cand_buffer, q, k, w, top_k, ratio=4, sm_scale=1.0, stream=None,
                               q_causal_offsets=None, cand_batch_offsets=None, precision="bf16", q_scale=None, k_scale=None,
                               topk_indices_global=True, deterministic=False):
    """The fused BSHD call into caller buffers (work in progress): ``indices`` / ``logits`` / ``softmax``
    (B, S_q, top_k), ``lse`` (B, S_q) or None, ``cand_buffer`` of at least
    :func:`compress_topk_cand_buffer_size` floats (with ``q_causal_offsets``: its ``cand_batch_offsets``
    too, (B + 1,) int64 prefix sums, as upstream's capture-safe contract asks). Allocates nothing."""
    ts = (indices, logits, softmax, lse, cand_buffer, q, k, w, q_scale, k_scale, q_causal_offsets, cand_batch_offsets)
    extra = (top_k, ratio, precision, bool(topk_indices_global), bool(deterministic))
    call, p = cached(_CALLS, ts, extra, lambda: _plan_fused(*ts[:8], top_k, ratio, sm_scale, q_causal_offsets, cand_batch_offsets, precision,
                                                            q_scale, k_scale, topk_indices_global, deterministic))
    from .dsa_indexer_forward import _scale

    call.run(p, stream_handle(stream, call.dev), _scale(sm_scale), ts, stream)
    return indices, logits, softmax, lse
