"""DSA sparse attention forward: cudnn's sparse_attention_forward_wrapper, from shipped cubins (SM100 only;
upstream has no SM90 kernel).

Per query row ``i`` and head ``h``, over the slots ``t`` of ``topk_idxs[i]`` that are valid (``t <
clamp(topk_length[i], 0, K)`` and ``0 <= topk_idxs[i, t] < S_kv``; -1 and any other id outside are
skipped, a duplicate counts twice), with ``s_t = softmax_scale * q[i, h] . kv[n_t, :D]``::

    out[i, h]        = sum_t exp(s_t - m) kv[n_t, :512] / (sum_t exp(s_t - m) + exp(attn_sink[h] - m))
    max_logits[i, h] = max_t s_t
    lse[i, h]        = log sum_t exp(s_t)                      (the sink excluded)
    lse_indexer[i,h] = log sum_{t < indexer_topk} exp(s_t)     (indexer_topk > 0 only)

A row without a valid slot gives out 0, max_logits -inf, lse (and lse_indexer) +inf. q (S_q, H, D),
kv (S_kv, D) with K = V = the MLA latent (D 576: the last 64 columns enter Q.K only), topk_idxs
(S_q, K) int32, attn_sink (H,) fp32, topk_length (S_q,) int32; out (S_q, H, 512) in q's dtype, the
rest fp32 (S_q, H). ``softmax_scale`` defaults to 1/sqrt(D) and must be finite and positive (the
kernels take the row maximum before scaling).

Which entry serves a call is :mod:`dsa_aot.policy.dsa_sparse_attention_forward` (upstream's key: H, D,
dtype, indexer_topk, sink?, topk_length?). The kernels read the index rows 64 slots at a time:
upstream pads them with -1 to a multiple of 64, as the allocating form does; ``_into`` takes rows of
a multiple of 64 slots. Upstream launches on torch's current stream; here the stream is an argument.
"""

from __future__ import annotations

import math

from ..policy import dsa_sparse_attention_forward as policy
from ._support import (aliasing, alloc_on, allocate, arch_or_refuse, check, flag, footprint, input_error, launcher, require, scalar_f32,
                       stream_handle, tensor_args, writes_only)
from .library import call
from .outputs import Outputs
from .plan import ALLOC, Plan, Recorder, cached, compile_call, fresh, probe_for, remember, remembered

__all__ = ["sparse_attention", "sparse_attention_forward", "sparse_attention_forward_into", "SparseAttentionForward"]

FAMILY = policy.FAMILY
_I32 = 2**31 - 1
_NEG_INF, _POS_INF = 0xFF800000, 0x7F800000  # fp32 words of the empty-problem fills (upstream's fill_(-inf) / fill_(inf))
_CALLS: dict = {}
_TENSORS = ("out", "max_logits", "lse", "lse_indexer", "q", "kv", "topk_idxs", "attn_sink", "topk_length")
_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "f16"}


def _is_tensor(t) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and t.layout == torch.strided


class _Call:
    __slots__ = ("dev", "s_q", "h", "d", "s_kv", "k", "dtype")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


def _inputs(problems, q, kv, topk_idxs, attn_sink, topk_length, indexer_topk, staged=False, heads=None):
    """A :class:`_Call` for valid inputs (problems appended otherwise). ``staged``: the layout and
    alignment of the inputs are not checked (the allocating form stages them as upstream does), and
    the index rows may have any width (it pads them). ``heads``: the head count of the launch when the
    caller pads q and the sink to it (:func:`sparse_attention` runs H16 and H32 as H64); the tensors
    given are checked against their own H."""
    import torch

    if not _is_tensor(q) or q.ndim != 3 or str(q.dtype) not in _DTYPES:
        problems.append(f"q: expected a (S_q, H, D) bfloat16 or float16 CUDA tensor, got {getattr(q, 'dtype', type(q).__name__)} "
                        f"{tuple(getattr(q, 'shape', ()))}")
        return None
    if q.device.type != "cuda":
        problems.append(f"q: on {q.device} (expected a CUDA tensor)")
        return None
    dev = q.device.index
    arch, sm100 = arch_or_refuse(problems, dev)
    if arch is None:
        return None
    if not sm100:
        problems.append(f"cuda:{dev} runs {arch}: cudnn's sparse attention forward exists for SM100 only (no SM90 kernel upstream)")
        return None
    s_q, h, d = q.shape

    def tensor(t, name, shape, dtype, align):
        check(problems, t, name, shape, dtype, dev, align, layout=not staged)

    tensor(q, "q", q.shape, q.dtype, 16)
    if (heads or h, d) not in ((64, 512), (64, 576), (128, 512)):
        problems.append(f"q: H {h}, D {d} (upstream's kernels serve (64, 512), (64, 576), (128, 512))")
    if not _is_tensor(kv) or kv.ndim != 2:
        problems.append(f"kv: expected a (S_kv, {d}) tensor, got {tuple(getattr(kv, 'shape', ()))}")
        return None
    tensor(kv, "kv", (kv.shape[0], d), q.dtype, 16)
    if not _is_tensor(topk_idxs) or topk_idxs.ndim != 2:
        problems.append(f"topk_idxs: expected a (S_q, K) int32 tensor, got {tuple(getattr(topk_idxs, 'shape', ()))}")
        return None
    k = topk_idxs.shape[1]
    tensor(topk_idxs, "topk_idxs", (s_q, k), torch.int32, policy.IDX_ALIGN)
    if not staged and k % policy.SLOT_TILE:
        problems.append(f"topk_idxs: {k} slots a row (the kernels read 64 at a time: pad the rows with -1 to {policy.padded_topk(k)}; "
                        f"the allocating form does, as upstream)")
    allowed = policy.INDEXER_TOPK.get(heads or h, ())
    if not (type(indexer_topk) is int and indexer_topk in allowed):
        problems.append(f"indexer_topk={indexer_topk!r} (H {heads or h} takes {', '.join(map(str, allowed))})")
    elif indexer_topk > k:
        problems.append(f"indexer_topk={indexer_topk} exceeds the {k} slots of topk_idxs")
    if attn_sink is not None:
        tensor(attn_sink, "attn_sink", (h,), torch.float32, 4)
    if topk_length is not None:
        tensor(topk_length, "topk_length", (s_q,), torch.int32, 4)
    for n in (s_q, kv.shape[0], k):
        if n > _I32:
            problems.append("q / kv / topk_idxs: an extent past 2**31 - 1 (the kernels take int32 extents)")
            break
    if problems:
        return None
    return _Call(dev=dev, s_q=s_q, h=heads or h, d=d, s_kv=kv.shape[0], k=k, dtype=_DTYPES[str(q.dtype)])


def _staged_call(problems, q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, indexer_topk, heads=None):
    """What the allocating form checks before it stages or allocates anything: the :class:`_Call`
    (None, the problems appended, when the call is invalid). ``heads``: see :func:`_inputs`."""
    c = _inputs(problems, q, kv, topk_idxs, attn_sink, topk_length, indexer_topk, staged=True, heads=heads)
    if c is not None:
        scalar_f32(problems, "softmax_scale", 1.0 / math.sqrt(c.d) if softmax_scale is None else softmax_scale, positive=True)
    return c


def _require(c, indexer_topk, sink, topk_length) -> None:
    """The entry a valid call launches (none for an empty problem) ships for its device:
    KernelNotFoundError / ArchMismatchError naming the bucket to add otherwise."""
    if c.s_q and c.k and c.s_kv:
        key = policy.kernel(c.h, c.d, c.dtype, indexer_topk, sink, topk_length)
        require(FAMILY, {"main": key}, c.dev, {"main": _hint(key[1])})


def _scale_of(softmax_scale, d):
    """The fp32 scale a call passes (default 1/sqrt(D)): InputError unless finite and positive."""
    problems = []
    x = scalar_f32(problems, "softmax_scale", 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale, positive=True)
    if problems:
        raise input_error(problems)
    return (x,)


def _hint(key) -> str:
    return (f" (the sparse attention forward compiles one cubin per H {key['heads']}, D {key['dim']}, dtype {key['dtype']}, indexer_topk "
            f"{key['indexer_topk']}, sink {key['sink']} and topk_length {key['topk_length']})")


def _record(rec, le, ts):
    """The launch on ``rec``: the host function's arguments in upstream's order (q, kv, topk_idxs, out,
    max_logits, lse, [lse_indexer], [attn_sink], [topk_length], scale, stream), each tensor as its
    pointer, extents and non-unit strides (``ts``: anything with ``shape`` and ``stride()``, in
    :data:`_TENSORS` order)."""
    p = rec.p
    out, max_logits, lse, lse_indexer, q, kv, idx, sink, tl = ts
    args = [*tensor_args(q, p[4]), *tensor_args(kv, p[5]), *tensor_args(idx, p[6]), *tensor_args(out, p[0]), *tensor_args(max_logits, p[1]),
            *tensor_args(lse, p[2])]
    for t, i in ((lse_indexer, 3), (sink, 7), (tl, 8)):
        if t is not None:
            args += tensor_args(t, p[i])
    rec.launch(le, *args, rec.x[0], rec.s)


def _plan_forward(out, max_logits, lse, lse_indexer, q, kv, topk_idxs, attn_sink=None, topk_length=None, softmax_scale=None, indexer_topk=0):
    """Validate a sparse_attention_forward call into caller-provided outputs and compile what it does."""
    import torch

    problems = []
    c = _inputs(problems, q, kv, topk_idxs, attn_sink, topk_length, indexer_topk)
    if c is not None:
        scalar_f32(problems, "softmax_scale", 1.0 / math.sqrt(c.d) if softmax_scale is None else softmax_scale, positive=True)
        check(problems, out, "out", (c.s_q, c.h, policy.DV), q.dtype, c.dev, 16)
        check(problems, max_logits, "max_logits", (c.s_q, c.h), torch.float32, c.dev, 4)
        check(problems, lse, "lse", (c.s_q, c.h), torch.float32, c.dev, 4)
        if indexer_topk:
            check(problems, lse_indexer, "lse_indexer", (c.s_q, c.h), torch.float32, c.dev, 4)
        elif lse_indexer is not None:
            problems.append("lse_indexer: must be None when indexer_topk == 0 (nothing is snapshotted)")
        if not problems:
            problems += aliasing((("out", out), ("max_logits", max_logits), ("lse", lse), ("lse_indexer", lse_indexer)),
                                 (("q", q), ("kv", kv), ("topk_idxs", topk_idxs), ("attn_sink", attn_sink), ("topk_length", topk_length)))
    if problems:
        raise input_error(problems)
    ts = (out, max_logits, lse, lse_indexer, q, kv, topk_idxs, attn_sink, topk_length)
    rec = Recorder(len(ts), 1)
    p = rec.p
    if c.s_q and not (c.k and c.s_kv):  # nothing to attend to: upstream's epilogue, no launch
        rec.memset(p[0], out.numel() * out.element_size())
        rec.memset(p[1], max_logits.numel() * 4, _NEG_INF)
        rec.memset(p[2], lse.numel() * 4, _POS_INF)
        if lse_indexer is not None:
            rec.memset(p[3], lse_indexer.numel() * 4, _POS_INF)
    elif c.s_q:
        op, key = policy.kernel(c.h, c.d, c.dtype, indexer_topk, attn_sink is not None, topk_length is not None)
        _record(rec, launcher(FAMILY, op, key, c.dev, _hint(key)), ts)
    foot = footprint(ts, writes=(0, 1, 2, 3), masks=(15, 3, 3, 3, 15, 15, policy.IDX_ALIGN - 1, 3, 3))
    return compile_call("dsa_sparse_attention_forward.forward", rec, c.dev, ts, foot, _scale_of(softmax_scale, c.d),
                        lambda softmax_scale=None: _scale_of(softmax_scale, c.d))


def sparse_attention_forward_into(out, max_logits, lse, lse_indexer, q, kv, topk_idxs, *, attn_sink=None, topk_length=None, softmax_scale=None,
                                  indexer_topk=0, stream=None):
    """``sparse_attention_forward`` into caller-provided ``out`` (S_q, H, 512) in q's dtype and fp32
    ``max_logits``, ``lse`` and ``lse_indexer`` (S_q, H) (None when ``indexer_topk`` is 0). Every
    tensor contiguous; q, kv, out 16-byte aligned, ``topk_idxs`` 32-byte aligned with rows of a
    multiple of 64 slots (pad with -1). Capture-safe from the first call; allocates nothing. Returns
    (out, max_logits, lse, lse_indexer)."""
    ts = (out, max_logits, lse, lse_indexer, q, kv, topk_idxs, attn_sink, topk_length)
    call, p = cached(_CALLS, ts, (indexer_topk,), lambda: _plan_forward(*ts, softmax_scale, indexer_topk))
    call.run(p, stream_handle(stream, call.dev), call.scalars(softmax_scale=softmax_scale), ts, stream)
    return out, max_logits, lse, lse_indexer


def sparse_attention_forward(q, kv, topk_idxs, *, attn_sink=None, topk_length=None, softmax_scale=None, indexer_topk=0, stream=None):
    """cudnn's sparse_attention_forward_wrapper: returns ``{'out', 'max_logits', 'lse', 'lse_indexer'}``
    (``lse_indexer`` None when ``indexer_topk`` is 0). Strided or misaligned inputs are copied, and the
    index rows padded with -1 to a multiple of 64 slots, on the launch stream, as upstream does."""
    import torch

    ins = (q, kv, topk_idxs, attn_sink, topk_length)
    hit = remembered(_CALLS, ALLOC, ins, (indexer_topk,))
    if hit is not None:
        c, box = hit[0]
    else:
        problems = []
        c = _staged_call(problems, q, kv, topk_idxs, attn_sink, topk_length, softmax_scale, indexer_topk)
        if problems:
            raise input_error(problems)
        stream_handle(stream, c.dev)  # refuse a bad stream, and a missing entry, before allocating
        _require(c, indexer_topk, attn_sink is not None, topk_length is not None)
        box = [None]
        aligned = {0: 16, 1: 16, 2: policy.IDX_ALIGN, 3: 4, 4: 4}
        if c.k % policy.SLOT_TILE == 0 and all(t is None or (t.is_contiguous() and t.data_ptr() % aligned[i] == 0) for i, t in enumerate(ins)):
            remember(_CALLS, ALLOC, (indexer_topk,), probe_for(ins, c.dev, footprint(ins, writes=(), masks=(15, 15, policy.IDX_ALIGN - 1, 3, 3))),
                     (c, box))
    s = stream_handle(stream, c.dev)

    def staged():  # upstream's _normalize_and_validate: contiguous, aligned, the index rows padded with -1 to 64 slots
        with alloc_on(stream, c.dev):
            def aligned(t, a):
                if t is None:
                    return None
                t = t.contiguous()
                return t if t.data_ptr() % a == 0 else t.clone()

            idx = topk_idxs.contiguous()
            kp = policy.padded_topk(c.k)
            if kp != c.k:
                idx = torch.cat([idx, torch.full((c.s_q, kp - c.k), -1, dtype=torch.int32, device=idx.device)], dim=1)
            return aligned(q, 16), aligned(kv, 16), aligned(idx, policy.IDX_ALIGN), aligned(attn_sink, 4), aligned(topk_length, 4)

    if hit is None:
        ins = allocate(staged)
    q, kv, topk_idxs, attn_sink, topk_length = ins

    def outputs():
        with alloc_on(stream, c.dev):
            out = torch.empty(c.s_q, c.h, policy.DV, dtype=q.dtype, device=q.device)
            ml, ls = (torch.empty(c.s_q, c.h, dtype=torch.float32, device=q.device) for _ in range(2))
            li = torch.empty(c.s_q, c.h, dtype=torch.float32, device=q.device) if indexer_topk else None
            return out, ml, ls, li

    out, ml, ls, li = allocate(outputs)
    ts = (out, ml, ls, li, *ins)
    call, p = fresh(box, _CALLS, ts, (indexer_topk,), lambda: _plan_forward(*ts, softmax_scale, indexer_topk))
    call.run(p, s, _scale_of(softmax_scale, c.d), ts, stream)
    return Outputs(out=out, max_logits=ml, lse=ls, lse_indexer=li)


class SparseAttentionForward(Plan):
    """A plan of one sparse_attention_forward call, built from :func:`sparse_attention_forward_into`'s
    arguments (``SparseAttentionForward(out, max_logits, lse, lse_indexer, q, kv, topk_idxs,
    attn_sink=None, topk_length=None, softmax_scale=None, indexer_topk=0)``); ``execute(out,
    max_logits, lse, lse_indexer, q, kv, topk_idxs, attn_sink=None, topk_length=None, stream=None,
    softmax_scale=...)`` (see :class:`dsa_aot.ops.plan.Plan`). cudnn's class of the same name is built
    from sample inputs; this one, like every plan here, from the ``_into`` call's tensors."""

    _build = staticmethod(_plan_forward)
    _tensors = _TENSORS
    _scalars = ("softmax_scale",)


# --- the differentiable op: cudnn.DSA.sparse_attention (deepseek_sparse_attention/training.py) ------------

_TOPK_TILE = 128  # upstream's training composition pads the index rows with -1 to a multiple of 128 slots
_PADDED_HEADS = 64  # ... and runs the forward of H16 and H32 as H64


def sparse_attention(q, kv, indices, attn_sink=None, softmax_scale=None, topk_length=None, trusted_compact_metadata=False):
    """cudnn's ``DSA.sparse_attention`` (training.py): bf16 MQA sparse attention with first-order
    autograd, as one op (``torch.ops.dsa_aot.dsa_sparse_attention``). Returns ``{'out', 'max_logits',
    'lse'}`` (``lse`` KV-only, natural log); only ``out`` is differentiable, with respect to ``q``,
    ``kv`` and ``attn_sink`` (the backward: :func:`dsa_aot.dsa.sparse_attention_backward`).

    Upstream's contract: q (S_q, H, D) with H 16, 32, 64 or 128 and D 512 or 576 (not H128 D576), kv
    (S_kv, D), ``indices`` (S_q, K) int32 global ids, ``attn_sink`` (H,) fp32 or None (no sink),
    ``topk_length`` (S_q,) int32 or None; every tensor contiguous on one device, no empty extent,
    ``softmax_scale`` finite and > 0 (default 1/sqrt(D)). Unless ``trusted_compact_metadata``, ids
    outside [0, S_kv) and slots past ``clamp(topk_length, 0, K)`` become -1 and, with lengths, each
    row's valid ids move to its front (:func:`dsa_aot.dsa.compactify`, which gives the new lengths); the
    rows are then padded with -1 to a multiple of 128 slots. H16 and H32 run the forward as H64 (zero
    heads, a -inf sink) and slice the outputs back. Forward and backward read the same normalised
    metadata (saved with q, kv, out, lse and the sink).

    Upstream accepts compute capability 10.0 only; this runs on any device the build has the forward's
    entry for. Where it has none, the forward's own error is raised (on an SM90 GPU its InputError:
    upstream has no SM90 forward kernel; a missing bucket: KernelNotFoundError), before anything runs,
    as every other malformed input. Runs on torch's current stream; traces under
    ``torch.compile(fullgraph=True)``.
    """
    out, max_logits, lse, _, _ = call("dsa_sparse_attention", q, kv, indices, attn_sink, softmax_scale, topk_length, trusted_compact_metadata)
    return Outputs(out=out, max_logits=max_logits, lse=lse)


def _training_call(q, kv, indices, attn_sink, softmax_scale, topk_length, trusted):
    """Everything :func:`sparse_attention` checks before it runs anything: the forward's own checks of
    the launch it makes (q's heads padded for H16 / H32, always a sink), upstream's training contract
    beyond them, then the entries it launches (the forward's; compactify's when it compacts lengths).
    Returns (the forward's :class:`_Call`, trusted)."""
    problems = []
    trusted = flag(problems, "trusted_compact_metadata", trusted)
    h = q.shape[1] if _is_tensor(q) and q.ndim == 3 else None
    c = _staged_call(problems, q, kv, indices, attn_sink, topk_length, softmax_scale, 0, heads=_PADDED_HEADS if h in (16, 32) else None)
    if c is not None:
        # upstream's training contract beyond the forward's: bf16 (the backward has no fp16 kernels), every
        # tensor contiguous, q, kv and the sink 16-byte aligned (the backward reads them in place), no empty extent
        if c.dtype != "bf16":
            problems.append(f"q: dtype {q.dtype} (expected torch.bfloat16: the sparse attention backward is bf16 only)")
        for name, t, align in (("q", q, 16), ("kv", kv, 16), ("indices", indices, 4), ("attn_sink", attn_sink, 16), ("topk_length", topk_length, 4)):
            if t is not None:
                check(problems, t, name, t.shape, t.dtype, c.dev, align)
        if not (c.s_q and c.s_kv and c.k):
            problems.append(f"S_q = {c.s_q}, S_kv = {c.s_kv}, top-k = {c.k} (expected each >= 1, as upstream's sparse_attention)")
    if problems:
        raise input_error(problems)
    _require(c, 0, True, topk_length is not None)
    if topk_length is not None and not trusted:
        from ..policy import dsa_topk_utils as topk_utils

        require(topk_utils.FAMILY, {"main": topk_utils.compactify_kernel(c.k)}, c.dev)
    return c, trusted


def _t_sparse_attention(q, kv, indices, attn_sink=None, softmax_scale=None, topk_length=None, trusted_compact_metadata=False):
    """(out, max_logits, lse, the index rows and lengths the forward read: saved for the backward;
    lengths (0,) when None). Outputs never alias inputs: trusted metadata the forward reads as given is copied."""
    import torch
    import torch.nn.functional as F

    from .dsa_topk_utils import compactify

    c, trusted = _training_call(q, kv, indices, attn_sink, softmax_scale, topk_length, trusted_compact_metadata)
    h = q.shape[1]
    with alloc_on(None, c.dev):  # torch's current stream of the tensors' device (upstream: torch.cuda.device(q.device))
        idx, lengths = indices, topk_length
        if not trusted:  # ids outside [0, S_kv) and slots past the clamped length become -1 ...
            valid = (indices >= 0) & (indices < c.s_kv)
            if topk_length is not None:
                slots = torch.arange(c.k, dtype=torch.int32, device=indices.device)
                valid &= slots[None, :] < topk_length.clamp(0, c.k)[:, None]
            idx = torch.where(valid, indices, -1)
            if topk_length is not None:  # ... and each row's valid ids move to its front, their count the new length
                idx, lengths = compactify(idx)
        k = -(-c.k // _TOPK_TILE) * _TOPK_TILE
        idx = F.pad(idx, (0, k - c.k), value=-1) if k != c.k else idx.clone() if idx is indices else idx
        lengths = idx.new_empty(0) if lengths is None else lengths.clone() if lengths is topk_length else lengths
        sink = attn_sink if attn_sink is not None else torch.full((h,), -math.inf, dtype=torch.float32, device=q.device)
        launch_q, launch_sink = q, sink
        if h < c.h:  # zero heads with a -inf sink, sliced off below
            launch_q = F.pad(q, (0, 0, 0, c.h - h))
            launch_sink = F.pad(sink, (0, c.h - h), value=-math.inf)
        r = sparse_attention_forward(launch_q, kv, idx, attn_sink=launch_sink, topk_length=None if topk_length is None else lengths,
                                     softmax_scale=softmax_scale)
        out, max_logits, lse = r["out"], r["max_logits"], r["lse"]
        if h < c.h:
            out, max_logits, lse = (t[:, :h].contiguous() for t in (out, max_logits, lse))
    return out, max_logits, lse, idx, lengths


def _f_sparse_attention(q, kv, indices, attn_sink=None, softmax_scale=None, topk_length=None, trusted_compact_metadata=False):
    import torch

    s_q, h = q.shape[0], q.shape[1]
    k = -(-indices.shape[1] // _TOPK_TILE) * _TOPK_TILE
    stats = [q.new_empty((s_q, h), dtype=torch.float32) for _ in range(2)]
    return q.new_empty((s_q, h, policy.DV)), *stats, indices.new_empty((s_q, k)), indices.new_empty((s_q,) if topk_length is not None else (0,))


def _sparse_attention_setup(ctx, inputs, output):
    q, kv, _, attn_sink, softmax_scale, topk_length, _ = inputs
    out, max_logits, lse, idx, lengths = output
    ctx.mark_non_differentiable(max_logits, lse, idx, lengths)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, kv, out, lse, attn_sink, idx, lengths)
    ctx.softmax_scale, ctx.has_lengths = softmax_scale, topk_length is not None


def _sparse_attention_grad(ctx, dout, *_):
    """The backward op on what the forward saved (the sink -inf when there was none): dq, dkv, d_sink where wanted."""
    import torch

    if dout is None:  # out took no part in the loss
        return (None,) * 7
    q, kv, out, lse, sink, idx, lengths = ctx.saved_tensors
    if sink is None:
        sink = torch.full((q.shape[1],), -math.inf, dtype=torch.float32, device=q.device)
    dq, dkv, d_sink = torch.ops.dsa_aot.dsa_sparse_attention_backward(q, kv, out, dout.contiguous(), lse, sink, idx, ctx.softmax_scale,
                                                                      lengths if ctx.has_lengths else None)
    need = ctx.needs_input_grad
    return dq if need[0] else None, dkv if need[1] else None, None, d_sink if need[3] else None, None, None, None


# --- torch.library (dsa_aot.library registers these as torch.ops.dsa_aot.<name>: schema, CUDA impl, fake) ---


def _t_forward(q, kv, topk_idxs, attn_sink=None, topk_length=None, softmax_scale=None, indexer_topk=0):
    r = sparse_attention_forward(q, kv, topk_idxs, attn_sink=attn_sink, topk_length=topk_length, softmax_scale=softmax_scale, indexer_topk=indexer_topk)
    return [r["out"], r["max_logits"], r["lse"]] + ([r["lse_indexer"]] if indexer_topk else [])


def _f_forward(q, kv, topk_idxs, attn_sink=None, topk_length=None, softmax_scale=None, indexer_topk=0):
    import torch

    s_q, h = q.shape[0], q.shape[1]
    rows = [q.new_empty((s_q, h), dtype=torch.float32) for _ in range(3 if indexer_topk else 2)]
    return [q.new_empty((s_q, h, policy.DV))] + rows


def _t_forward_into(out, max_logits, lse, lse_indexer, q, kv, topk_idxs, attn_sink=None, topk_length=None, softmax_scale=None, indexer_topk=0):
    sparse_attention_forward_into(out, max_logits, lse, lse_indexer, q, kv, topk_idxs, attn_sink=attn_sink, topk_length=topk_length,
                                  softmax_scale=softmax_scale, indexer_topk=indexer_topk)


TORCH_OPS = {
    "dsa_sparse_attention_forward": ("(Tensor q, Tensor kv, Tensor topk_idxs, Tensor? attn_sink=None, Tensor? topk_length=None, "
                                     "float? softmax_scale=None, int indexer_topk=0) -> Tensor[]", _t_forward, _f_forward),
    "dsa_sparse_attention_forward_into": ("(Tensor(a!) out, Tensor(b!) max_logits, Tensor(c!) lse, Tensor(d!)? lse_indexer, Tensor q, Tensor kv, "
                                          "Tensor topk_idxs, Tensor? attn_sink=None, Tensor? topk_length=None, float? softmax_scale=None, "
                                          "int indexer_topk=0) -> ()", _t_forward_into, writes_only),
    "dsa_sparse_attention": ("(Tensor q, Tensor kv, Tensor indices, Tensor? attn_sink=None, float? softmax_scale=None, Tensor? topk_length=None, "
                             "bool trusted_compact_metadata=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)", _t_sparse_attention,
                             _f_sparse_attention, (_sparse_attention_setup, _sparse_attention_grad)),
}  # fmt: skip
