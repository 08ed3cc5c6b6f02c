"""DSA indexer forward: cudnn's indexer_forward_wrapper, from shipped cubins.

``scores[b, i, j] = sm_scale * sum_h relu(q[b, i, h, :] . k[b, j, 0, :]) * w[b, i, h]`` (fp32) where
key ``j`` is visible to query ``i``: ``j < S_k`` and ``j < (off_b + i + 1) // ratio`` (``off_b`` from
``q_causal_offsets``, else 0); every other position is -inf. BSHD: q (B, S_q, H, 128), k (B, S_k, 1,
128), w (B, S_q, H), scores (B, S_q, S_k). THD (``cu_seqlens_q`` / ``cu_seqlens_k`` and both
``max_seqlen_*``): q (total_q, H, 128), k (total_k, 1, 128), w (total_q, H), scores (total_q,
max_seqlen_k) with each segment's local key columns. ``precision="fp8"``: q / k float8_e4m3fn with
fp32 per-token descales ``q_scale`` (.., H) and ``k_scale`` (.., 1) (SM90); an fp32 ``w`` is then taken
as already scaled (q_scale and sm_scale unused), as upstream does. ``"mxfp8"`` / ``"mxfp4"`` (SM100):
q / k e4m3, or e2m1 pairs (``float4_e2m1fn_x2``, last dim 64), with e8m0 block scales in upstream's
packed layout (BSHD (B, ceil128(S_q * H), 4) / (B, ceil128(S_k), 4); THD (1, rows, 4) with
``cu_seqlens_*_scale_padded``) and a bf16 ``w``. ``return_lse`` (or ``lse_out``, SM90 only) also
gives ``lse[b, i] = log sum_j exp(scores[b, i, j])`` over the visible keys (-inf for none).

Which entry serves a call is :mod:`dsa_aot.policy.dsa_indexer_forward` (upstream's keys; on SM90 its fp8
H64 variants picked from S_q % 2 and S_k % 64). The op fills the scores with -inf and launches one
kernel; upstream does the same on torch's current stream, here the stream is an argument like every
op's. The arch is the one of q's device (upstream reads the current device's). SM100 binds the
scores with rows of a multiple of 4 floats: the allocating form allocates (..., ceil4(S_k)) and
returns the (..., S_k) scores contiguous, as upstream does; ``_into`` takes that padded buffer.
"""

from __future__ import annotations

from ..policy import dsa_indexer_forward as policy
from ._support import (aliasing, f32_scalar, alloc_on, allocate, arch_or_refuse, block_scales, check, flag, footprint, input_error, integer, launcher, require,
                       row_major, scalar_f32, stream_handle, tensor_args, thd_batch, writes_only)
from .outputs import Outputs
from .plan import ALLOC, Plan, Recorder, cached, compile_call, fresh, probe_for, remember, remembered

__all__ = ["indexer_forward", "indexer_forward_into", "IndexerForward"]

FAMILY = policy.FAMILY
_I32 = 2**31 - 1
_NEG_INF = 0xFF800000  # fp32 -inf, the word the scores are filled with before the launch
_CALLS: dict = {}
_TENSORS = ("scores", "lse", "q", "k", "w", "q_scale", "k_scale", "cu_seqlens_q", "cu_seqlens_k", "q_causal_offsets", "cu_seqlens_q_scale_padded",
            "cu_seqlens_k_scale_padded")
_TUNING = {"m_block_size": 128, "n_block_size": 128, "q_stage": 2, "kv_stage": 4}  # upstream's defaults: the only tuning shipped


def _is_tensor(t) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and t.layout == torch.strided


class _Call:
    """What validating a call's inputs found (shapes, device, arch, the kernel), before its outputs are known."""

    __slots__ = ("dev", "arch", "sm100", "varlen", "b", "s_q", "s_k", "h", "scores", "lse", "prec", "w_dtype")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)

    def padded_scores(self) -> tuple:
        """The scores buffer SM100 binds: the last dim rounded up to 4 (16-byte rows); SM90's is exact."""
        return self.scores[:-1] + (policy.padded(self.s_k),) if self.sm100 else self.scores


def _precision(problems, precision, sm100) -> str | None:
    allowed = policy.SM100_PRECISIONS if sm100 else policy.SM90_PRECISIONS
    if not isinstance(precision, str):  # a list or a dict would reach dict lookups below (unhashable: a bare TypeError)
        problems.append(f"precision={precision!r} (expected a string: one of {', '.join(map(repr, allowed))})")
        return None
    p = precision.lower()
    allowed = policy.SM100_PRECISIONS if sm100 else policy.SM90_PRECISIONS
    if p not in allowed:
        where = ("SM90 only" if p == "fp8" else "SM100 only") if p in policy.SM90_PRECISIONS + policy.SM100_PRECISIONS else "unknown"
        problems.append(f"precision={precision!r} ({where}; upstream's {'SM100' if sm100 else 'SM90'} kernels take "
                        f"{', '.join(map(repr, allowed))})")
    return p


def check_inputs(problems, q, k, w, ratio, qhead_per_kv_head, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_causal_offsets,
            precision, q_scale, k_scale, cu_q_scale=None, cu_k_scale=None, lse=False, staged=False, tuning=None):
    """A :class:`_Call` for valid inputs (problems appended otherwise). ``staged``: layout and alignment of
    the inputs are not checked (the allocating form copies them, as upstream does for strided ones)."""
    import torch

    for name, v in (tuning or {}).items():
        if not (type(v) is int and v == _TUNING[name]):
            problems.append(f"{name}={v!r}: the build ships upstream's default {_TUNING[name]} only")
    integer(problems, "ratio", ratio, 1, policy.MAX_RATIO)
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    rank = 3 if varlen else 4
    if not _is_tensor(q) or q.ndim != rank:
        problems.append(f"q: expected a {'(total_q, H, 128)' if varlen else '(B, S_q, H, 128)'} CUDA tensor, got "
                        f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
        return None
    if q.device.type != "cuda":
        problems.append(f"q: on {q.device} (expected a CUDA tensor)")
        return None
    dev = q.device.index
    arch, sm100 = arch_or_refuse(problems, dev)
    if arch is None:
        return None
    prec = _precision(problems, precision, sm100)
    mx = prec in policy.SM100_ONLY
    qdt = {"fp8": torch.float8_e4m3fn, "mxfp8": torch.float8_e4m3fn, "mxfp4": getattr(torch, "float4_e2m1fn_x2", None)}.get(prec, torch.bfloat16)
    d = policy.HEAD_DIM // 2 if prec == "mxfp4" else policy.HEAD_DIM  # e2m1 pairs: two values a stored byte
    h = q.shape[-2]
    lead = tuple(q.shape[:-2])  # (B, S_q) or (total_q,)

    def tensor(t, name, shape, dtype, align=16):
        check(problems, t, name, shape, dtype, dev, align, layout=not staged)

    tensor(q, "q", lead + (h, d), qdt)
    heads = policy.SM100_HEADS if sm100 else policy.SM90_HEADS.get(prec, ())
    if h not in heads:
        problems.append(f"q: {h} heads (upstream's {arch} {prec} kernel takes {', '.join(map(str, heads))} query heads per KV head)")
    if qhead_per_kv_head is not None and qhead_per_kv_head != h:
        problems.append(f"qhead_per_kv_head={qhead_per_kv_head!r}: must equal q's heads per KV head ({h}; k has one KV head)")
    if not _is_tensor(k) or k.ndim != rank:
        problems.append(f"k: expected a {'(total_k, 1, 128)' if varlen else '(B, S_k, 1, 128)'} tensor, got {tuple(getattr(k, 'shape', ()))}")
        return None
    tensor(k, "k", ((lead[0], k.shape[1]) if not varlen else (k.shape[0],)) + (1, d), qdt)
    w_ok = (torch.bfloat16,) if mx else (torch.bfloat16, torch.float32)
    if not _is_tensor(w) or w.dtype not in w_ok:
        problems.append(f"w: expected a {' or '.join(map(str, w_ok))} {lead + (h,)} CUDA tensor, got {getattr(w, 'dtype', type(w).__name__)}")
        return None
    tensor(w, "w", lead + (h,), w.dtype)
    if prec == "fp8" and (q_scale is None or k_scale is None):
        problems.append(f"precision={prec!r} requires q_scale and k_scale")
    elif prec not in ("fp8", "mxfp8", "mxfp4") and (q_scale is not None or k_scale is not None):
        problems.append(f"q_scale and k_scale: only with a scaled precision (this call's is {prec!r})")
    if (cu_q_scale is not None or cu_k_scale is not None) and not mx:
        problems.append("cu_seqlens_q_scale_padded / cu_seqlens_k_scale_padded: only with THD mxfp8 / mxfp4 (SM100)")
    b = thd_batch(problems, varlen, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dev, layout=not staged)
    if varlen:
        s_q, s_k = max_seqlen_q, max_seqlen_k
        scores_shape, lse_shape = (lead[0], s_k), lead
    else:
        b, s_q = lead
        s_k = k.shape[1]
        scores_shape, lse_shape = (b, s_q, s_k), lead
        if sm100 and type(ratio) is int and ratio >= 1 and s_q > s_k * ratio + ratio - 1:
            problems.append(f"q: S_q {s_q} > S_k * ratio + ratio - 1 = {s_k * ratio + ratio - 1} (the last queries would see keys past S_k; "
                            f"upstream's SM100 path refuses this geometry)")
    if prec == "fp8" and q_scale is not None and k_scale is not None:
        tensor(q_scale, "q_scale", lead + (h,), torch.float32)
        tensor(k_scale, "k_scale", tuple(k.shape[:-2]) + (1,), torch.float32)
    elif mx:
        block_scales(problems, prec, varlen, b, s_q, s_k, h, dev, q_scale, k_scale, cu_q_scale, cu_k_scale, layout=not staged)
    if q_causal_offsets is not None and b is not None:
        tensor(q_causal_offsets, "q_causal_offsets", (b,), torch.int32)
    if lse and sm100:
        problems.append("return_lse / lse: SM90 only (upstream's SM100 indexer forward raises NotImplementedError; its LSE comes from "
                        "dense_indexer_score_recompute)")
    for n in tuple(q.shape) + tuple(k.shape):
        if n > _I32:
            problems.append(f"q {tuple(q.shape)} / k {tuple(k.shape)}: an extent past 2**31 - 1 (the kernel takes int32 extents)")
            break
    if problems:
        return None
    return _Call(dev=dev, arch=arch, sm100=sm100, varlen=varlen, b=b, s_q=s_q, s_k=s_k, h=h, scores=scores_shape, lse=lse_shape, prec=prec,
                 w_dtype=str(w.dtype).removeprefix("torch."))


def _kernel(c: _Call, ratio, offsets, lse):
    """(op, key) of the entry serving the call."""
    if c.sm100:
        return policy.sm100_kernel(c.prec, c.w_dtype, c.h, ratio, c.varlen, offsets)
    return policy.sm90_kernel(c.prec, c.w_dtype, c.h, ratio, c.varlen, offsets, lse, c.s_q, c.s_k)


def _hint(op, key) -> str:
    base = (f" (the indexer forward compiles one cubin per precision {key['precision']}, W dtype {key['w_dtype']}, heads {key['heads']}, "
            f"ratio {key['ratio']}, THD {key['varlen']}, causal offsets {key['offsets']}")
    if op == "fwd_sm100":
        return base + ")"
    return base + f", LSE {key['lse']} and, for fp8 H64 BSHD, S_q % 2 == 0 ({key['unchecked']}) and S_k % 64 == 0 ({key['masked']}))"


def _scale(sm_scale) -> tuple:
    return f32_scalar("sm_scale", sm_scale)


def _record(rec, c: _Call, op, le, ts):
    """The launch of a validated call on ``rec``: the host function's arguments in upstream's order
    (``ts``: the call's tensors, anything with ``shape`` and ``stride()``, in :data:`_TENSORS` order).
    SM90: q, k, w, [scales], scores, [lse], H_kv, S_q, S_k, scale, [cu_seqlens], [offsets], stream.
    SM100: q, k, w, [scales], the scores' (..., S_k) view of its row stride, scale, S_q, S_k,
    [cu_seqlens (mx: and their scale-padded twins)], [offsets], stream."""
    p = rec.p
    scores, lse, q, k, w, q_scale, k_scale, cu_q, cu_k, offs, cu_qs, cu_ks = ts
    args = [*tensor_args(q, p[2]), *tensor_args(k, p[3]), *tensor_args(w, p[4])]
    if q_scale is not None:
        args += [*tensor_args(q_scale, p[5]), *tensor_args(k_scale, p[6])]
    row = scores.shape[-1]  # the scores' row stride: S_k, or S_k rounded up to 4 (a padded buffer)
    out = (p[0], *c.scores, *[s * row for s in row_major(c.scores[:-1])])  # the (..., S_k) view: extents, then the non-unit strides
    if op == "fwd_sm100":
        args += [*out, rec.x[0], c.s_q, c.s_k]
        if c.varlen:
            args += [*tensor_args(cu_q, p[7]), *tensor_args(cu_k, p[8])]
            if c.prec in policy.SM100_ONLY:
                args += [*tensor_args(cu_qs, p[10]), *tensor_args(cu_ks, p[11])]
    else:
        args += out
        if lse is not None:
            args += tensor_args(lse, p[1])
        args += [1, c.s_q, c.s_k, rec.x[0]]
        if c.varlen:
            args += [*tensor_args(cu_q, p[7]), *tensor_args(cu_k, p[8])]
    if offs is not None:
        args += tensor_args(offs, p[9])
    rec.launch(le, *args, rec.s)


def _plan_forward(scores, lse, q, k, w, ratio=4, sm_scale=1.0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                  q_causal_offsets=None, precision="bf16", q_scale=None, k_scale=None, cu_seqlens_q_scale_padded=None,
                  cu_seqlens_k_scale_padded=None):
    """Validate an indexer_forward call into caller-provided outputs and compile what it does."""
    import torch

    problems = []
    scalar_f32(problems, "sm_scale", sm_scale)
    c = check_inputs(problems, q, k, w, ratio, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_causal_offsets, precision, q_scale,
                k_scale, cu_seqlens_q_scale_padded, cu_seqlens_k_scale_padded, lse=lse is not None)
    if c is not None:
        padded = c.scores[:-1] + (policy.padded(c.s_k),)
        shape = padded if _is_tensor(scores) and tuple(scores.shape) == padded else c.scores
        if c.sm100 and shape != padded and _is_tensor(scores) and tuple(scores.shape) == c.scores:
            problems.append(f"scores: {tuple(scores.shape)} (SM100 binds the scores with a 16-byte row stride: pass a {padded} fp32 buffer, "
                            f"whose first {c.s_k} columns receive the scores and the rest -inf)")
        check(problems, scores, "scores", shape, torch.float32, c.dev, 16)
        if lse is not None:
            check(problems, lse, "lse", c.lse, torch.float32, c.dev, 16)
        if not problems:
            problems += aliasing((("scores", scores), ("lse", lse)),
                                 (("q", q), ("k", k), ("w", w), ("q_scale", q_scale), ("k_scale", k_scale), ("cu_seqlens_q", cu_seqlens_q),
                                  ("cu_seqlens_k", cu_seqlens_k), ("q_causal_offsets", q_causal_offsets),
                                  ("cu_seqlens_q_scale_padded", cu_seqlens_q_scale_padded),
                                  ("cu_seqlens_k_scale_padded", cu_seqlens_k_scale_padded)))
    if problems:
        raise input_error(problems)
    ts = (scores, lse, q, k, w, q_scale, k_scale, cu_seqlens_q, cu_seqlens_k, q_causal_offsets, cu_seqlens_q_scale_padded, cu_seqlens_k_scale_padded)
    rec = Recorder(len(ts), 1)
    p = rec.p
    runs = c.b and c.s_q and c.s_k  # grid.z / grid.x / key blocks of zero: upstream's launch would fail, nothing is visible
    rec.memset(p[0], scores.numel() * 4, _NEG_INF)
    if lse is not None and (c.varlen or not runs):  # THD rows outside every segment, and rows with no keys, are -inf
        rec.memset(p[1], lse.numel() * 4, _NEG_INF)
    if runs:
        op, key = _kernel(c, ratio, q_causal_offsets is not None, lse is not None)
        _record(rec, c, op, launcher(FAMILY, op, key, c.dev, _hint(op, key)), ts)
    foot = footprint(ts, writes=(0, 1))
    return compile_call("dsa_indexer_forward.forward", rec, c.dev, ts, foot, (scalar_f32([], "sm_scale", sm_scale),), _scale)


def indexer_forward_into(scores, lse, q, k, w, ratio=4, sm_scale=1.0, stream=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                         max_seqlen_k=None, q_causal_offsets=None, precision="bf16", q_scale=None, k_scale=None, *, cu_seqlens_q_scale_padded=None,
                         cu_seqlens_k_scale_padded=None):
    """``indexer_forward`` into caller-provided fp32 ``scores`` and ``lse`` (SM90; None for no LSE).

    ``scores``: (B, S_q, S_k) / (total_q, max_seqlen_k), or that with the last dim rounded up to a
    multiple of 4 (a padded buffer: its first S_k columns receive the scores, the rest -inf); on SM100
    the row must be a multiple of 4 (upstream's kernel binds 16-byte rows), so pass the padded buffer
    when S_k % 4 != 0. ``lse``: (B, S_q) / (total_q,). Every tensor contiguous and 16-byte aligned.
    Capture-safe from the first call; allocates nothing. Returns (scores, lse)."""
    ts = (scores, lse, q, k, w, q_scale, k_scale, cu_seqlens_q, cu_seqlens_k, q_causal_offsets, cu_seqlens_q_scale_padded, cu_seqlens_k_scale_padded)
    extra = (ratio, max_seqlen_q, max_seqlen_k, precision)
    call, p = cached(_CALLS, ts, extra, lambda: _plan_forward(*ts[:5], ratio, sm_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                              q_causal_offsets, precision, q_scale, k_scale, *ts[10:]))
    call.run(p, stream_handle(stream, call.dev), _scale(sm_scale), ts, stream)
    return scores, lse


def indexer_forward(q, k, w, ratio=4, qhead_per_kv_head=None, m_block_size=128, n_block_size=128, q_stage=2, kv_stage=4, sm_scale=1.0, out=None,
                    stream=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None,
                    precision="bf16", q_scale=None, k_scale=None, cu_seqlens_q_scale_padded=None, cu_seqlens_k_scale_padded=None, sf_vec_size=32,
                    return_lse=False, lse_out=None):
    """cudnn's indexer_forward_wrapper: returns ``{'scores'}``, and ``{'scores', 'lse'}`` with ``return_lse`` (SM90).

    ``out`` / ``lse_out``: caller-provided outputs (fp32), else allocated on the launch stream. An
    ``out`` the kernel cannot bind as it is (not contiguous, or on SM100 a row of S_k % 4 != 0 floats)
    is filled through a padded buffer and copied back, as upstream does. A strided input is copied first, on the launch stream, as upstream does. The tuning
    arguments take upstream's defaults only; ``sf_vec_size`` must be 32 (unused on SM90)."""
    import torch

    want_lse = bool(return_lse or lse_out is not None)
    ins = (q, k, w, q_scale, k_scale, cu_seqlens_q, cu_seqlens_k, q_causal_offsets, cu_seqlens_q_scale_padded, cu_seqlens_k_scale_padded)
    extra = (ratio, qhead_per_kv_head, m_block_size, n_block_size, q_stage, kv_stage, max_seqlen_q, max_seqlen_k, precision, return_lse,
             lse_out is not None, sf_vec_size)
    hit = None if out is not None else remembered(_CALLS, ALLOC, ins, extra)
    if hit is not None:
        c, box = hit[0]
        x = _scale(sm_scale)
    else:
        problems = []
        x = (scalar_f32(problems, "sm_scale", sm_scale),)
        tuning = {"m_block_size": m_block_size, "n_block_size": n_block_size, "q_stage": q_stage, "kv_stage": kv_stage}
        c = check_inputs(problems, q, k, w, ratio, qhead_per_kv_head, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_causal_offsets,
                    precision, q_scale, k_scale, cu_seqlens_q_scale_padded, cu_seqlens_k_scale_padded, lse=want_lse, staged=True, tuning=tuning)
        if not (type(sf_vec_size) is int and sf_vec_size == 32):
            problems.append(f"sf_vec_size={sf_vec_size!r} (the block-scaled kernels take 32; unused on SM90)")
        flag(problems, "return_lse", return_lse)
        if lse_out is not None and not _is_tensor(lse_out):
            problems.append(f"lse_out: got {type(lse_out).__name__} (expected None or a float32 CUDA tensor)")
        if c is not None and out is not None and (not _is_tensor(out) or tuple(out.shape) != c.scores or out.dtype != torch.float32
                                                  or out.device != q.device):
            problems.append(f"out: {getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))} (expected float32 "
                            f"{c.scores} on {q.device})")
        if problems:
            raise input_error(problems)
        stream_handle(stream, c.dev)  # refuse a bad stream, and a missing entry, before allocating
        if c.b and c.s_q and c.s_k:
            op, key = _kernel(c, ratio, q_causal_offsets is not None, want_lse)
            require(FAMILY, {"main": (op, key)}, c.dev, {"main": _hint(op, key)})
        box = [None]
        if out is None and all(t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0) for t in ins):
            remember(_CALLS, ALLOC, extra, probe_for(ins, c.dev, footprint(ins, writes=())), (c, box))
    s = stream_handle(stream, c.dev)

    def staged(t):  # what upstream launches on: contiguous (16-byte aligned: torch's allocations are)
        if t is None or (t.is_contiguous() and t.data_ptr() % 16 == 0):
            return t
        with alloc_on(stream, c.dev):
            x = t.contiguous()
            return x if x.data_ptr() % 16 == 0 else x.clone()

    if hit is None:
        ins = tuple(allocate(lambda t=t: staged(t)) for t in ins)
    padded = c.padded_scores()
    # the buffer the kernel writes: the caller's out when it can be bound as it is, else one of ours copied back into it (the
    # -inf fill covers the whole buffer: a (..., S_k) view of the caller's padded buffer is staged too, its pad columns untouched)
    buf = out if out is not None and tuple(out.shape) == padded and out.is_contiguous() and out.data_ptr() % 16 == 0 else None

    def outputs():
        with alloc_on(stream, c.dev):
            sc = torch.empty(padded, dtype=torch.float32, device=q.device) if buf is None else buf
            ls = (torch.empty(c.lse, dtype=torch.float32, device=q.device) if lse_out is None else lse_out) if want_lse else None
            return sc, ls

    sc, ls = allocate(outputs)
    q, k, w, q_scale, k_scale, cu_seqlens_q, cu_seqlens_k, q_causal_offsets, cqs, cks = ins
    ts = (sc, ls, q, k, w, q_scale, k_scale, cu_seqlens_q, cu_seqlens_k, q_causal_offsets, cqs, cks)
    call, p = fresh(box, _CALLS, ts, (ratio, max_seqlen_q, max_seqlen_k, precision),
                    lambda: _plan_forward(sc, ls, q, k, w, ratio, sm_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_causal_offsets,
                                          precision, q_scale, k_scale, cqs, cks))
    call.run(p, s, x, ts, stream)
    result = sc
    if out is not None:
        if buf is None:  # staged: copied back into the caller's out on the stream (upstream's copy_into_on_stream)
            with alloc_on(stream, c.dev):
                out.copy_(sc[..., : c.s_k])
        result = out
    elif padded != c.scores:  # upstream returns its padded allocation made contiguous
        with alloc_on(stream, c.dev):
            result = allocate(lambda: sc[..., : c.s_k].contiguous())
    return Outputs(scores=result, lse=ls) if return_lse else Outputs(scores=result)


class IndexerForward(Plan):
    """A plan of one indexer_forward call, built from :func:`indexer_forward_into`'s arguments
    (``IndexerForward(scores, lse, q, k, w, ratio=4, sm_scale=1.0, ...)``, the stream excepted);
    ``execute(scores, lse, q, k, w, q_scale=None, k_scale=None, cu_seqlens_q=None, cu_seqlens_k=None,
    q_causal_offsets=None, cu_seqlens_q_scale_padded=None, cu_seqlens_k_scale_padded=None, stream=None,
    sm_scale=...)`` (see :class:`dsa_aot.ops.plan.Plan`). cudnn's IndexerForward class is the SM100 bf16
    BSHD kernel's, execute taking the padded scores; this one serves every shipped entry of the
    device's arch, with the scores as :func:`indexer_forward_into` takes them (padded on SM100)."""

    _tensors = _TENSORS
    _scalars = ("sm_scale",)

    @staticmethod
    def _build(scores, lse, q, k, w, ratio=4, sm_scale=1.0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
               q_causal_offsets=None, precision="bf16", q_scale=None, k_scale=None, cu_seqlens_q_scale_padded=None, cu_seqlens_k_scale_padded=None):
        return _plan_forward(scores, lse, q, k, w, ratio, sm_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_causal_offsets,
                             precision, q_scale, k_scale, cu_seqlens_q_scale_padded, cu_seqlens_k_scale_padded)


# --- torch.library (dsa_aot.library registers these as torch.ops.dsa_aot.<name>: schema, CUDA impl, fake) ---


def _t_forward(q, k, w, ratio=4, sm_scale=1.0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None,
               precision="bf16", q_scale=None, k_scale=None, cu_seqlens_q_scale_padded=None, cu_seqlens_k_scale_padded=None, return_lse=False):
    out = indexer_forward(q, k, w, ratio, sm_scale=sm_scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                          max_seqlen_k=max_seqlen_k, q_causal_offsets=q_causal_offsets, precision=precision, q_scale=q_scale, k_scale=k_scale,
                          cu_seqlens_q_scale_padded=cu_seqlens_q_scale_padded, cu_seqlens_k_scale_padded=cu_seqlens_k_scale_padded,
                          return_lse=return_lse)
    return list(out.values())


def _f_forward(q, k, w, ratio=4, sm_scale=1.0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None,
               precision="bf16", q_scale=None, k_scale=None, cu_seqlens_q_scale_padded=None, cu_seqlens_k_scale_padded=None, return_lse=False):
    import torch

    if cu_seqlens_q is not None:
        scores, lse = (q.shape[0], max_seqlen_k), (q.shape[0],)
    else:
        scores, lse = (q.shape[0], q.shape[1], k.shape[1]), (q.shape[0], q.shape[1])
    out = [q.new_empty(scores, dtype=torch.float32)]
    return out + ([q.new_empty(lse, dtype=torch.float32)] if return_lse else [])


def _t_forward_into(scores, lse, q, k, w, ratio=4, sm_scale=1.0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    q_causal_offsets=None, precision="bf16", q_scale=None, k_scale=None, cu_seqlens_q_scale_padded=None,
                    cu_seqlens_k_scale_padded=None):
    indexer_forward_into(scores, lse, q, k, w, ratio, sm_scale, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_causal_offsets,
                         precision, q_scale, k_scale, cu_seqlens_q_scale_padded=cu_seqlens_q_scale_padded,
                         cu_seqlens_k_scale_padded=cu_seqlens_k_scale_padded)


_ARGS = ("int ratio=4, float sm_scale=1.0, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, int? max_seqlen_q=None, "
         "int? max_seqlen_k=None, Tensor? q_causal_offsets=None, str precision=\"bf16\", Tensor? q_scale=None, Tensor? k_scale=None, "
         "Tensor? cu_seqlens_q_scale_padded=None, Tensor? cu_seqlens_k_scale_padded=None")
TORCH_OPS = {
    "dsa_indexer_forward": (f"(Tensor q, Tensor k, Tensor w, {_ARGS}, bool return_lse=False) -> Tensor[]", _t_forward, _f_forward),
    "dsa_indexer_forward_into": (f"(Tensor(a!) scores, Tensor(b!)? lse, Tensor q, Tensor k, Tensor w, {_ARGS}) -> ()", _t_forward_into, writes_only),
}  # fmt: skip
