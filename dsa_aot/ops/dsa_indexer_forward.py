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

from ..policy.families import FAMILIES
from ..policy import dsa_indexer_forward as policy
from .args import row_major, tensor_args
from .checks import aliasing, block_scales, check, flag, integer, scalar_f32, thd_batch
from .gpu import arch_or_refuse
from .declare import Flag, Float, In, Int, OneOf, Op, Out

FAMILY = policy.FAMILY
__all__ = list(FAMILIES[FAMILY].exports)  # the registry lists them: dsa_aot.<namespace> imports this module for them
_I32 = 2**31 - 1
_NEG_INF = 0xFF800000  # fp32 -inf, the word the scores are filled with before the launch
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


def _hint(c, key) -> str:
    base = (f" (the indexer forward compiles one cubin per precision {key['precision']}, W dtype {key['w_dtype']}, heads {key['heads']}, "
            f"ratio {key['ratio']}, THD {key['varlen']}, causal offsets {key['offsets']}")
    if c.fwd.sm100:
        return base + ")"
    return base + f", LSE {key['lse']} and, for fp8 H64 BSHD, S_q % 2 == 0 ({key['unchecked']}) and S_k % 64 == 0 ({key['masked']}))"


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


def _check(c, problems):
    """The whole validation of a call (``c.allocating``: the allocating form's, ``out`` / ``lse_out`` as given)."""
    import torch

    scalar_f32(problems, "sm_scale", c.sm_scale)
    c.want_lse = bool(c.return_lse or c.lse is not None)
    f = c.fwd = check_inputs(problems, c.q, c.k, c.w, c.ratio, c.qhead_per_kv_head, c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k,
                             c.q_causal_offsets, c.precision, c.q_scale, c.k_scale, c.cu_seqlens_q_scale_padded, c.cu_seqlens_k_scale_padded,
                             lse=c.want_lse, staged=c.allocating, tuning={n: getattr(c, n) for n in _TUNING})
    scores, lse = c.scores, c.lse
    if c.allocating:
        if not (type(c.sf_vec_size) is int and c.sf_vec_size == 32):
            problems.append(f"sf_vec_size={c.sf_vec_size!r} (the block-scaled kernels take 32; unused on SM90)")
        flag(problems, "return_lse", c.return_lse)
        if lse is not None and not _is_tensor(lse):
            problems.append(f"lse_out: got {type(lse).__name__} (expected None or a float32 CUDA tensor)")
        if f is not None and scores is not None and (not _is_tensor(scores) or tuple(scores.shape) != f.scores or scores.dtype != torch.float32
                                                     or scores.device != c.q.device):
            problems.append(f"out: {getattr(scores, 'dtype', type(scores).__name__)} {tuple(getattr(scores, 'shape', ()))} (expected float32 "
                            f"{f.scores} on {c.q.device})")
        if f is not None and lse is not None and not problems:  # bound as given: refused before anything is allocated
            check(problems, lse, "lse_out", f.lse, torch.float32, f.dev, 16)
    elif f is not None:
        padded = f.scores[:-1] + (policy.padded(f.s_k),)
        shape = padded if _is_tensor(scores) and tuple(scores.shape) == padded else f.scores
        if f.sm100 and shape != padded and _is_tensor(scores) and tuple(scores.shape) == f.scores:
            problems.append(f"scores: {tuple(scores.shape)} (SM100 binds the scores with a 16-byte row stride: pass a {padded} fp32 buffer, "
                            f"whose first {f.s_k} columns receive the scores and the rest -inf)")
        check(problems, scores, "scores", shape, torch.float32, f.dev, 16)
        if lse is not None:
            check(problems, lse, "lse", f.lse, torch.float32, f.dev, 16)
    if f is not None and not problems:
        problems += aliasing(tuple(zip(("out", "lse_out") if c.allocating else _TENSORS[:2], (scores, lse))), [(n, getattr(c, n)) for n in _TENSORS[2:]])
        c.dev = f.dev


def _entries(c):
    f = c.fwd
    if not (f.b and f.s_q and f.s_k):  # grid.z / grid.x / key blocks of zero: upstream's launch would fail, nothing is visible
        return {}
    c.kernel = _kernel(f, c.ratio, c.q_causal_offsets is not None, c.want_lse)
    return {"main": c.kernel}


def _plan(rec, c):
    p = rec.p
    rec.memset(p[0], c.scores.numel() * 4, _NEG_INF)
    if c.lse is not None and (c.fwd.varlen or "main" not in c.entry):  # THD rows outside every segment, and rows with no keys, are -inf
        rec.memset(p[1], c.lse.numel() * 4, _NEG_INF)
    if "main" in c.entry:
        _record(rec, c.fwd, c.kernel[0], c.entry["main"], tuple(getattr(c, n) for n in _TENSORS))


_ARGS = ("cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None, precision='bf16', q_scale=None, "
         "k_scale=None")
FORWARD = Op(
    FAMILY, "indexer_forward", plan_class="IndexerForward",
    into=f"scores, lse, q, k, w, ratio=4, sm_scale=1.0, stream=None, {_ARGS}, *, cu_seqlens_q_scale_padded=None, cu_seqlens_k_scale_padded=None",
    alloc="q, k, w, ratio=4, qhead_per_kv_head=None, m_block_size=128, n_block_size=128, q_stage=2, kv_stage=4, sm_scale=1.0, out=None, "
          f"stream=None, {_ARGS}, cu_seqlens_q_scale_padded=None, cu_seqlens_k_scale_padded=None, sf_vec_size=32, return_lse=False, lse_out=None",
    plan_args=f"scores, lse, q, k, w, ratio=4, sm_scale=1.0, {_ARGS}, cu_seqlens_q_scale_padded=None, cu_seqlens_k_scale_padded=None",
    tensors=(
        Out("scores", "float32", lambda c: tuple(c.q.shape[:1]) + ((c.max_seqlen_k,) if c.cu_seqlens_q is not None else (c.q.shape[1], c.k.shape[1])),
            given="out", pad=lambda c: c.fwd.padded_scores()),
        Out("lse", "float32", lambda c: tuple(c.q.shape[:-2]), optional=True, given="lse_out", when="return_lse", omitted=True),
        *(In(n, "float32", None, optional=n not in ("q", "k", "w"), staged=True) for n in _TENSORS[2:]),
    ),
    options=(
        Int("ratio", 1, policy.MAX_RATIO, 4), Float("sm_scale", 1.0, per_call=True),
        Int("max_seqlen_q", 0, _I32, None), Int("max_seqlen_k", 0, _I32, None),
        OneOf("precision", policy.SM90_PRECISIONS + policy.SM100_ONLY, "bf16"),  # case-insensitive, of the device's arch: _check's
        Int("qhead_per_kv_head", 1, _I32, None, alloc_only=True, torch=False), Flag("return_lse", False, alloc_only=True),
        *(OneOf(n, (v,), v, alloc_only=True, torch=False) for n, v in (*_TUNING.items(), ("sf_vec_size", 32))),  # upstream's defaults: the only ones shipped
    ),
    check=_check, entries=_entries, plan=_plan, hint=_hint,
    note="``scores`` fp32 (B, S_q, S_k) / (total_q, max_seqlen_k) (``_into``: on SM100 the row padded to a multiple of 4, its pad -inf); "
         "``lse`` (B, S_q) / (total_q,) (SM90; ``_into``: None for none; allocating: ``return_lse`` or ``lse_out``, returned with "
         "``return_lse``). ``out`` / ``lse_out``: given outputs (an ``out`` the kernel cannot bind as it is is filled through a padded "
         "buffer and copied back, as upstream does); a strided input is copied first, on the launch stream, as upstream does.",
)  # fmt: skip

indexer_forward, indexer_forward_into, IndexerForward = FORWARD.forms(globals())
