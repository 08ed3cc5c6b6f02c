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

from ..policy.families import FAMILIES
from ..policy import dsa_sparse_attention_forward as policy
from .args import tensor_args
from .checks import check, flag, input_error
from .gpu import alloc_on, arch_or_refuse, require
from .declare import Float, In, OneOf, Op, Out
from .library import call
from .outputs import Outputs

FAMILY = policy.FAMILY
__all__ = list(FAMILIES[FAMILY].exports)  # the registry lists them: dsa_aot.<namespace> imports this module for them
_I32 = 2**31 - 1
_NEG_INF, _POS_INF = 0xFF800000, 0x7F800000  # fp32 words of the empty-problem fills (upstream's fill_(-inf) / fill_(inf))
_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "f16"}
_VARIANTS = ((64, 512), (64, 576), (128, 512))


def _arch(c, problems):
    """SM100 only, refused once the inputs passed (before the outputs and the rules: nothing else is meaningful on SM90)."""
    if c.dev is not None:  # (None: a fake call, no device)
        arch, sm100 = arch_or_refuse(problems, c.dev)
        if arch is not None and not sm100:
            problems.append(f"cuda:{c.dev} runs {arch}: cudnn's sparse attention forward exists for SM100 only (no SM90 kernel upstream)")


def _rules(c, problems):
    s_q, h, d, k = (c.sym[n] for n in ("S_q", "H", "D", "K"))
    c.heads = getattr(c, "launch_heads", None) or h  # the head count launched (sparse_attention runs H16 and H32 as H64)
    if (c.heads, d) not in _VARIANTS:
        problems.append(f"q: H {h}, D {d} (upstream's kernels serve (64, 512), (64, 576), (128, 512))")
    allowed = policy.INDEXER_TOPK.get(c.heads, ())
    if allowed and c.indexer_topk not in allowed:
        problems.append(f"indexer_topk={c.indexer_topk!r} (H {c.heads} takes {', '.join(map(str, allowed))})")
    elif c.indexer_topk > k:
        problems.append(f"indexer_topk={c.indexer_topk} exceeds the {k} slots of topk_idxs")
    if not c.allocating and k % policy.SLOT_TILE:  # the allocating form pads the rows (ALLOC_VIEW)
        problems.append(f"topk_idxs: {k} slots a row (the kernels read 64 at a time: pad the rows with -1 to {policy.padded_topk(k)}; "
                        f"the allocating form does, as upstream)")
    if max(s_q, c.sym["S_kv"], k) > _I32:
        problems.append("q / kv / topk_idxs: an extent past 2**31 - 1 (the kernels take int32 extents)")


def _key(c, dtype, indexer_topk, sink, topk_length):
    return policy.kernel(c.heads, c.sym["D"], dtype, indexer_topk, sink, topk_length)


def _entries(c):  # an empty problem launches nothing
    if not (c.sym["S_q"] and c.sym["K"] and c.sym["S_kv"]):
        return {}
    return {"main": _key(c, _DTYPES[str(c.q.dtype)], c.indexer_topk, c.attn_sink is not None, c.topk_length is not None)}


def _hint(c, key) -> str:
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


def _plan(rec, c):
    p = rec.p
    if "main" in c.entry:
        _record(rec, c.entry["main"], tuple(getattr(c, n) for n in _TENSORS))
    elif c.sym["S_q"]:  # nothing to attend to: upstream's epilogue, no launch
        rec.memset(p[0], c.out.numel() * c.out.element_size())
        rec.memset(p[1], c.max_logits.numel() * 4, _NEG_INF)
        rec.memset(p[2], c.lse.numel() * 4, _POS_INF)
        if c.lse_indexer is not None:
            rec.memset(p[3], c.lse_indexer.numel() * 4, _POS_INF)


def _pad_rows(x):
    """The allocating form's index rows padded with -1 to a multiple of 64 slots (on the launch stream), as upstream."""
    import torch

    q, kv, idx, sink, tl = x
    s_q, k = idx.shape
    if k % policy.SLOT_TILE:
        idx = torch.cat([idx, torch.full((s_q, policy.padded_topk(k) - k), -1, dtype=torch.int32, device=idx.device)], dim=1)
    return q, kv, idx, sink, tl


FORWARD = Op(
    FAMILY, "sparse_attention_forward", plan_class="SparseAttentionForward",
    into="out, max_logits, lse, lse_indexer, q, kv, topk_idxs, *, attn_sink=None, topk_length=None, softmax_scale=None, indexer_topk=0, "
         "stream=None",
    alloc="q, kv, topk_idxs, *, attn_sink=None, topk_length=None, softmax_scale=None, indexer_topk=0, stream=None",
    plan_args="out, max_logits, lse, lse_indexer, q, kv, topk_idxs, attn_sink=None, topk_length=None, softmax_scale=None, indexer_topk=0",
    tensors=(
        Out("out", "like q", ("S_q", "H", policy.DV)),
        Out("max_logits", "float32", ("S_q", "H"), align=4),
        Out("lse", "float32", ("S_q", "H"), align=4),
        Out("lse_indexer", "float32", ("S_q", "H"), align=4, when="indexer_topk"),
        In("q", ("bfloat16", "float16"), ("S_q", "H", "D"), staged=True),
        In("kv", "like q", ("S_kv", "D"), staged=True),
        In("topk_idxs", "int32", ("S_q", "K"), align=policy.IDX_ALIGN, staged=True),
        In("attn_sink", "float32", ("H",), align=4, optional=True, staged=True),
        In("topk_length", "int32", ("S_q",), align=4, optional=True, staged=True),
    ),
    options=(
        Float("softmax_scale", None, positive=True, none=lambda c: 1.0 / math.sqrt(c.sym["D"]), per_call=True),
        OneOf("indexer_topk", (0, 512, 1024, 2048), 0),
    ),
    symbols=_arch, rules=_rules, entries=_entries, plan=_plan, hint=_hint, alloc_view=_pad_rows,
    note="``lse_indexer`` None when ``indexer_topk`` is 0. ``_into``: every tensor contiguous; q, kv, out 16-byte aligned, ``topk_idxs`` "
         "32-byte aligned with rows of a multiple of 64 slots (pad with -1); the allocating form copies strided or misaligned inputs and "
         "pads the rows on the launch stream, as upstream does.",
)  # fmt: skip

_TENSORS = FORWARD.names
sparse_attention_forward, sparse_attention_forward_into, SparseAttentionForward = FORWARD.forms(globals())
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
    Returns (the forward's checked call, trusted)."""
    import torch

    from ..errors import InputError

    problems = []
    trusted = flag(problems, "trusted_compact_metadata", trusted)
    h = q.shape[1] if isinstance(q, torch.Tensor) and q.ndim == 3 else None
    values = dict.fromkeys(FORWARD.names) | dict(q=q, kv=kv, topk_idxs=indices, attn_sink=attn_sink, topk_length=topk_length,
                                                 softmax_scale=softmax_scale, indexer_topk=0, launch_heads=_PADDED_HEADS if h in (16, 32) else None)
    try:
        c = FORWARD.validate(values, allocating=True)
    except InputError as e:
        if not problems:
            raise
        raise input_error(problems + e.problems) from None
    # upstream's training contract beyond the forward's: bf16 (the backward has no fp16 kernels), every
    # tensor contiguous, q, kv and the sink 16-byte aligned (the backward reads them in place), no empty extent
    if q.dtype != torch.bfloat16:
        problems.append(f"q: dtype {q.dtype} (expected torch.bfloat16: the sparse attention backward is bf16 only)")
    for name, t, align in (("q", q, 16), ("kv", kv, 16), ("indices", indices, 4), ("attn_sink", attn_sink, 16), ("topk_length", topk_length, 4)):
        if t is not None:
            check(problems, t, name, t.shape, t.dtype, c.dev, align)
    s_q, s_kv, k = c.sym["S_q"], c.sym["S_kv"], c.sym["K"]
    if not (s_q and s_kv and k):
        problems.append(f"S_q = {s_q}, S_kv = {s_kv}, top-k = {k} (expected each >= 1, as upstream's sparse_attention)")
    if problems:
        raise input_error(problems)
    key = _key(c, "bf16", 0, True, topk_length is not None)
    require(FAMILY, {"main": key}, c.dev, {"main": _hint(c, key[1])})
    if topk_length is not None and not trusted:
        from ..policy import dsa_topk_utils as topk_utils

        require(topk_utils.FAMILY, {"main": topk_utils.compactify_kernel(k)}, c.dev)
    return c, trusted


def _t_sparse_attention(q, kv, indices, attn_sink=None, softmax_scale=None, topk_length=None, trusted_compact_metadata=False):
    """(out, max_logits, lse, the index rows and lengths the forward read: saved for the backward;
    lengths (0,) when None). Outputs never alias inputs: trusted metadata the forward reads as given is copied."""
    import torch
    import torch.nn.functional as F

    from .dsa_topk_utils import compactify

    c, trusted = _training_call(q, kv, indices, attn_sink, softmax_scale, topk_length, trusted_compact_metadata)
    h, s_kv, k0, heads = q.shape[1], c.sym["S_kv"], c.sym["K"], c.heads
    with alloc_on(None, c.dev):  # torch's current stream of the tensors' device (upstream: torch.cuda.device(q.device))
        idx, lengths = indices, topk_length
        if not trusted:  # ids outside [0, S_kv) and slots past the clamped length become -1 ...
            valid = (indices >= 0) & (indices < s_kv)
            if topk_length is not None:
                slots = torch.arange(k0, dtype=torch.int32, device=indices.device)
                valid &= slots[None, :] < topk_length.clamp(0, k0)[:, None]
            idx = torch.where(valid, indices, -1)
            if topk_length is not None:  # ... and each row's valid ids move to its front, their count the new length
                idx, lengths = compactify(idx)
        k = -(-k0 // _TOPK_TILE) * _TOPK_TILE
        idx = F.pad(idx, (0, k - k0), value=-1) if k != k0 else idx.clone() if idx is indices else idx
        lengths = idx.new_empty(0) if lengths is None else lengths.clone() if lengths is topk_length else lengths
        sink = attn_sink if attn_sink is not None else torch.full((h,), -math.inf, dtype=torch.float32, device=q.device)
        launch_q, launch_sink = q, sink
        if h < heads:  # zero heads with a -inf sink, sliced off below
            launch_q = F.pad(q, (0, 0, 0, heads - h))
            launch_sink = F.pad(sink, (0, heads - h), value=-math.inf)
        r = sparse_attention_forward(launch_q, kv, idx, attn_sink=launch_sink, topk_length=None if topk_length is None else lengths,
                                     softmax_scale=softmax_scale)
        out, max_logits, lse = r["out"], r["max_logits"], r["lse"]
        if h < heads:
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

TORCH_OPS = {  # the training composite (the declared ops register themselves: dsa_aot.ops.library)
    "dsa_sparse_attention": ("(Tensor q, Tensor kv, Tensor indices, Tensor? attn_sink=None, float? softmax_scale=None, Tensor? topk_length=None, "
                             "bool trusted_compact_metadata=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)", _t_sparse_attention,
                             _f_sparse_attention, (_sparse_attention_setup, _sparse_attention_grad)),
}  # fmt: skip
