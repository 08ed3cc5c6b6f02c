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

Which entry serves a call is :mod:`aot.policy.dsa_sparse_attention_forward` (upstream's key: H, D,
dtype, indexer_topk, sink?, topk_length?). The kernels read the index rows 64 slots at a time:
upstream pads them with -1 to a multiple of 64, as the allocating form does; ``_into`` takes rows of
a multiple of 64 slots. Upstream launches on torch's current stream; here the stream is an argument.
"""

from __future__ import annotations

import math

from ..policy import dsa_sparse_attention_forward as policy
from ._support import (aliasing, alloc_on, allocate, arch_or_refuse, check, footprint, input_error, launcher, require, scalar_f32, stream_handle,
                       tensor_args, writes_only)
from .outputs import Outputs
from .plan import ALLOC, Plan, Recorder, cached, compile_call, fresh, probe_for, remember, remembered

__all__ = ["sparse_attention_forward", "sparse_attention_forward_into", "SparseAttentionForward"]

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


def _inputs(problems, q, kv, topk_idxs, attn_sink, topk_length, indexer_topk, staged=False):
    """A :class:`_Call` for valid inputs (problems appended otherwise). ``staged``: the layout and
    alignment of the inputs are not checked (the allocating form stages them as upstream does), and
    the index rows may have any width (it pads them)."""
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
    if (h, d) not in ((64, 512), (64, 576), (128, 512)):
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
    allowed = policy.INDEXER_TOPK.get(h, ())
    if not (type(indexer_topk) is int and indexer_topk in allowed):
        problems.append(f"indexer_topk={indexer_topk!r} (H {h} takes {', '.join(map(str, allowed))})")
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
    return _Call(dev=dev, s_q=s_q, h=h, d=d, s_kv=kv.shape[0], k=k, dtype=_DTYPES[str(q.dtype)])


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
        c = _inputs(problems, q, kv, topk_idxs, attn_sink, topk_length, indexer_topk, staged=True)
        if c is not None:
            scalar_f32(problems, "softmax_scale", 1.0 / math.sqrt(c.d) if softmax_scale is None else softmax_scale, positive=True)
        if problems:
            raise input_error(problems)
        stream_handle(stream, c.dev)  # refuse a bad stream, and a missing entry, before allocating
        if c.s_q and c.k and c.s_kv:
            key = policy.kernel(c.h, c.d, c.dtype, indexer_topk, attn_sink is not None, topk_length is not None)
            require(FAMILY, {"main": key}, c.dev, {"main": _hint(key[1])})
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
    softmax_scale=...)`` (see :class:`aot.ops.plan.Plan`). cudnn's class of the same name is built
    from sample inputs; this one, like every plan here, from the ``_into`` call's tensors."""

    _build = staticmethod(_plan_forward)
    _tensors = _TENSORS
    _scalars = ("softmax_scale",)


# --- torch.library (aot.library registers these as torch.ops.dsa_aot.<name>: schema, CUDA impl, fake) ---


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
}  # fmt: skip
