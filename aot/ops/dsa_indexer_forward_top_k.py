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

__all__ = ["compress_topk_cand_buffer_size"]

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


def _record_stage2(rec, le, ts, s_q, s_k):
    """Stage 2's launch: the host function's arguments in upstream's order (compress_stage2_topk's
    cute.compile call): cand, indices, logits, S_q, S_k, the stream, [batch offsets, causal
    offsets], [softmax]. ``ts``: (indices, logits, softmax, cand, cbo, qco)."""
    p = rec.p
    idx, val, sm, cand, cbo, qco = ts
    args = [p[3], cand.shape[0], *tensor_args(idx, p[0]), *tensor_args(val, p[1]), s_q, s_k, rec.s]
    if cbo is not None:
        args += [*tensor_args(cbo, p[4]), *tensor_args(qco, p[5])]
    if sm is not None:
        args += tensor_args(sm, p[2])
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
        _record_stage2(rec, launcher(FAMILY, "stage2", key, dev), ts, s_q, s_k)
    return compile_call("dsa_indexer_forward_top_k.stage2", rec, dev, ts, footprint(ts, writes=(0, 1, 2), masks=(3, 3, 3, 15, 15, 15)))


def _stage2_into(indices, logits, softmax, cand, s_k, top_k, ratio, cand_batch_offsets=None, q_causal_offsets=None, deterministic=False,
                 stream=None):
    """Stage 2 alone (the op's second launch), into caller buffers: what the H200 can run of this family."""
    ts = (indices, logits, softmax, cand, cand_batch_offsets, q_causal_offsets)
    extra = (s_k, top_k, ratio, deterministic)
    call, p = cached(_STAGE2, ts, extra, lambda: _plan_stage2(*ts, s_k, top_k, ratio, deterministic))
    call.run(p, stream_handle(stream, call.dev), call.x, ts, stream)
