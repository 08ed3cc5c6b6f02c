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


def _record_stage2(rec, le, cand, outs, s_q, s_k, cbo, qco):
    """Stage 2's launch in upstream's order (compress_stage2_topk's cute.compile call): cand, indices,
    logits, S_q, S_k, the stream, [batch offsets, causal offsets], [softmax]. Tensors in
    :func:`tensor_args` form: ``cand`` (pointer, extent), ``outs`` (indices, logits, softmax or None)."""
    idx, val, sm = outs
    args = [*cand, *idx, *val, s_q, s_k, rec.s]
    if cbo is not None:
        args += [*cbo, *qco]
    if sm is not None:
        args += sm
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
        p = rec.p
        _record_stage2(rec, launcher(FAMILY, "stage2", key, dev), (p[3], cand.shape[0]),
                       [tensor_args(t, pt) if t is not None else None for t, pt in zip(ts[:3], p)], s_q, s_k,
                       tensor_args(cbo, p[4]) if cbo is not None else None, tensor_args(qco, p[5]) if qco is not None else None)
    return compile_call("dsa_indexer_forward_top_k.stage2", rec, dev, ts, footprint(ts, writes=(0, 1, 2), masks=(3, 3, 3, 15, 15, 15)))


def _stage2_into(indices, logits, softmax, cand, s_k, top_k, ratio, cand_batch_offsets=None, q_causal_offsets=None, deterministic=False,
                 stream=None):
    """Stage 2 alone (the op's second launch), into caller buffers: what the H200 can run of this family."""
    ts = (indices, logits, softmax, cand, cand_batch_offsets, q_causal_offsets)
    extra = (s_k, top_k, ratio, deterministic)
    call, p = cached(_STAGE2, ts, extra, lambda: _plan_stage2(*ts, s_k, top_k, ratio, deterministic))
    call.run(p, stream_handle(stream, call.dev), call.x, ts, stream)


# --- the fused call, BSHD: GEMM -> stage 2 (one pair per window) -> local-to-global in place ---

_CALLS: dict = {}
_TENSORS = ("indices", "logits", "softmax", "lse", "cand_buffer", "q", "k", "w", "q_scale", "k_scale", "q_causal_offsets", "cand_batch_offsets")


def _rows(t, ptr, rs, n):
    """:func:`tensor_args` of the view ``t[:, rs:rs + n]`` of a (B, S, ...) tensor: the rows of one window."""
    return (ptr + rs * t.stride(1) * t.element_size(), t.shape[0], n, *t.shape[2:], *t.stride()[:-1])


def _record_gemm(rec, le, q, k, w, scales, cand, lse, s_q, s_k, qco, cbo):
    """The compressed GEMM's launch in upstream's order (_compressed_top_k_sm100's cute.compile call):
    q, k, w, [q_scale, k_scale], the candidate buffer, [lse], the scale, S_q, S_k, [causal offsets],
    the stream, [batch offsets]. Each tensor argument is given in :func:`tensor_args` form (or None)."""
    args = [*q, *k, *w]
    if scales is not None:
        args += [*scales[0], *scales[1]]
    args += cand
    if lse is not None:
        args += lse
    args += [rec.x[0], s_q, s_k]
    if qco is not None:
        args += qco
    args.append(rec.s)
    if cbo is not None:
        args += cbo
    rec.launch(le, *args)


def _fill_words(rec, ptr: int, words) -> None:
    """Record memsets that write ``words`` (32-bit values) at ``ptr``, one per run of equal words: every
    byte gets its final value directly, so a call on another stream reading the same table never sees
    a half-written one."""
    i = 0
    while i < len(words):
        j = i
        while j < len(words) and words[j] == words[i]:
            j += 1
        rec.memset(ptr + 4 * i, 4 * (j - i), words[i] & 0xFFFFFFFF)
        i = j


def _table(nbytes: int, device):
    """Device memory a plan owns (its window tables; torch's allocator, the capture's pool under capture)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def windows(s_q: int, s_k: int, ratio: int, mb: int) -> list:
    """Upstream's windows [(rs, rows, kw)]: rows [rs, rs + rows) see keys [0, kw), kw = (rs + rows) // ratio."""
    return [(rs, min(mb, s_q - rs), min((rs + min(mb, s_q - rs)) // ratio, s_k)) for rs in range(0, s_q, mb)]


def _microbatch(problems, microbatch_rows, precision, lse, offs, s_q, b, ratio) -> int:
    """The window size a call runs with (0: one launch), upstream's rules; problems appended for what it refuses."""
    mb = integer(problems, "microbatch_rows", microbatch_rows, -1, _I32)
    if mb > 0 and lse:
        problems.append("microbatch_rows > 0 with an LSE output: upstream does not support it (pass microbatch_rows=0 or -1)")
    if mb > 0 and offs:
        problems.append("microbatch_rows > 0 with q_causal_offsets: upstream does not support it (pass microbatch_rows=0 or -1)")
    if mb > 0 and precision != "bf16":
        problems.append(f"microbatch_rows > 0 with precision={precision!r}: upstream windows bf16 only")
    if mb < 0:
        mb = 0 if precision != "bf16" or lse or offs else policy.microbatch_rows(s_q, b, ratio)
    if 0 < mb < s_q and (mb % ratio or s_q % ratio):
        problems.append(f"microbatch_rows {mb} and S_q {s_q} must be multiples of ratio ({ratio}) to run in windows")
    return mb if 0 < mb < s_q else 0


def _plan_fused(indices, logits, softmax, lse, cand_buffer, q, k, w, top_k, ratio=4, sm_scale=1.0, q_causal_offsets=None, cand_batch_offsets=None,
                precision="bf16", q_scale=None, k_scale=None, topk_indices_global=True, deterministic=False, microbatch_rows=-1):
    """Validate a BSHD fused call into caller buffers and compile its launches."""
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
    offs = q_causal_offsets is not None
    mb = _microbatch(problems, microbatch_rows, precision, lse is not None, offs, s_q, b, ratio)
    wins = windows(s_q, s_k, ratio, mb) if mb else None
    pbf = max(policy.cand_floats(rs + n, ratio) - policy.cand_floats(rs, ratio) for rs, n, _ in wins) if wins else policy.cand_floats(s_q, ratio)
    cand_2d = not offs and not wins and policy.uses_cand_2d(precision, s_q, ratio)
    for name, t, dt in (("indices", indices, torch.int32), ("logits", logits, torch.float32), ("softmax", softmax, torch.float32)):
        if t is not None or name != "softmax":
            check(problems, t, name, (b, s_q, top_k), dt, c.dev, 16 if name == "indices" and topk_indices_global else 4)
    if lse is not None:
        check(problems, lse, "lse", (b, s_q), torch.float32, c.dev, 16)
    need = None if offs else b * pbf  # with causal offsets the size needs the offsets' values: the caller's (upstream trusts it too)
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
    p = rec.p
    keep = ()
    if b and s_q and s_k:
        gkey = {"precision": precision, "w_dtype": c.w_dtype, "heads": c.h, "ratio": ratio, "lse": lse is not None,
                "cand": "1d_cbo" if offs or wins else "2d" if cand_2d else "1d", "varlen": False, "offsets": bool(offs or wins)}
        skey = {"top_k": top_k, "ratio": ratio, "threads": policy.stage2_threads(b * s_q, s_k), "offsets": bool(offs or wins),
                "softmax": softmax is not None, "deterministic": bool(deterministic), "varlen": False}
        gemm, stage2 = launcher(FAMILY, "gemm", gkey, c.dev), launcher(FAMILY, "stage2", skey, c.dev)
        scales = None if q_scale is None else (tensor_args(q_scale, p[8]), tensor_args(k_scale, p[9]))
        cand = (p[4], cand_buffer.shape[0])
        outs = ((indices, p[0]), (logits, p[1]), (softmax, p[2]))
        if wins:
            # Each window is the causal-offsets kernel pair on views of the rows it covers (upstream's loop): offsets rs for every
            # batch, batch slabs b * pbf (pbf: the largest window's, so one table serves every window and the buffer is
            # compress_topk_cand_buffer_size's). The tables live in the plan and are written by its memsets on each call.
            row = (b * 4 + 15) // 16 * 16
            keep = (_table((2 * (b + 1) * 4 + 15) // 16 * 16 + len(wins) * row, q.device),)
            base = keep[0].data_ptr()
            _fill_words(rec, base, [w_ for i in range(b + 1) for w_ in (i * pbf, 0)])
            cbo = (base, b + 1)
            qco0 = base + (2 * (b + 1) * 4 + 15) // 16 * 16
            for j, (rs, _, _) in enumerate(wins):
                _fill_words(rec, qco0 + j * row, [rs] * b)
            for j, (rs, n, kw) in enumerate(wins):
                qco = (qco0 + j * row, b)
                _record_gemm(rec, gemm, _rows(q, p[5], rs, n), _rows(k, p[6], 0, kw), _rows(w, p[7], rs, n), None, cand, None, n, kw, qco, cbo)
                o = [_rows(t, pt, rs, n) if t is not None else None for t, pt in outs]
                _record_stage2(rec, stage2, cand, o, n, kw, cbo, qco)
        else:
            qco = tensor_args(q_causal_offsets, p[10]) if offs else None
            cbo = tensor_args(cand_batch_offsets, p[11]) if offs else None
            gcand = (p[4], b, pbf, pbf) if cand_2d else cand
            _record_gemm(rec, gemm, tensor_args(q, p[5]), tensor_args(k, p[6]), tensor_args(w, p[7]), scales, gcand,
                         tensor_args(lse, p[3]) if lse is not None else None, s_q, s_k, qco, cbo)
            _record_stage2(rec, stage2, cand, [tensor_args(t, pt) if t is not None else None for t, pt in outs], s_q, s_k, cbo, qco)
        if topk_indices_global:  # in place: -1 padding kept (upstream's preserve_negative form)
            lkey = l2g_policy.local_to_global_kernel("int32", False, True)
            rec.launch(launcher("dsa_topk_utils", *lkey, c.dev), *tensor_args(indices, p[0]), *tensor_args(indices, p[0]), s_k, rec.s)
    foot = footprint(ts, writes=(0, 1, 2, 3, 4))
    return compile_call("dsa_indexer_forward_top_k.fused", rec, c.dev, ts, foot, (scalar_f32([], "sm_scale", sm_scale),), fwd._scale, keep=keep)


def indexer_forward_top_k_into(indices, logits, softmax, lse, cand_buffer, q, k, w, top_k, ratio=4, sm_scale=1.0, stream=None,
                               q_causal_offsets=None, cand_batch_offsets=None, precision="bf16", q_scale=None, k_scale=None,
                               topk_indices_global=True, deterministic=False, microbatch_rows=-1):
    """The fused BSHD call into caller buffers: ``indices`` / ``logits`` / ``softmax`` (B, S_q, top_k;
    ``softmax`` None for none), ``lse`` (B, S_q) or None, ``cand_buffer`` of at least
    :func:`compress_topk_cand_buffer_size` floats (with ``q_causal_offsets``: its ``cand_batch_offsets``
    too, (B + 1,) int64 prefix sums, as upstream's capture-safe contract asks). bf16 calls from S_q
    32768 run in upstream's windows (``microbatch_rows``: -1 upstream's choice, 0 one launch, > 0
    that many rows). Capture-safe from the first call; allocates nothing on later calls (a windowed
    shape's first call allocates its plan's small offset tables). Returns (indices, logits, softmax, lse)."""
    ts = (indices, logits, softmax, lse, cand_buffer, q, k, w, q_scale, k_scale, q_causal_offsets, cand_batch_offsets)
    extra = (top_k, ratio, precision, topk_indices_global, deterministic, microbatch_rows)
    call, p = cached(_CALLS, ts, extra, lambda: _plan_fused(*ts[:8], top_k, ratio, sm_scale, q_causal_offsets, cand_batch_offsets, precision,
                                                            q_scale, k_scale, topk_indices_global, deterministic, microbatch_rows))
    from .dsa_indexer_forward import _scale

    call.run(p, stream_handle(stream, call.dev), _scale(sm_scale), ts, stream)
    return indices, logits, softmax, lse
