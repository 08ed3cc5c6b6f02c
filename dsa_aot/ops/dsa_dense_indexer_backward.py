"""DSA dense indexer backward op: cudnn's ``dense_indexer_backward_wrapper``, launched from shipped cubins.

The full-KV (warm-up) indexer backward. The same arguments, outputs and side effects as upstream:
``index_score`` (the raw indexer scores) is overwritten with the score-grad signal, ``attn_score`` is
only read; the same kernels in the same order on one stream (:mod:`dsa_aot.policy.dsa_dense_indexer_backward`).
Every input is validated before anything is launched or written.

THD: ``max_seqlen_q`` / ``max_seqlen_k`` size the grid and the score rows, as upstream's; the segment
lengths in ``cu_seqlens_*`` are device values neither upstream nor this op reads back (the allocating
form reads the maxima when they are not given, as upstream does: a synchronisation). Rows of a THD
call outside every segment are not written (upstream leaves them too).

Known upstream race (SM90, the cubin cudnn's JIT builds, shipped unchanged): when a batch's key count
is not a multiple of 128, the GEMM loads its last K block with cp.async from four warps but signals it
loaded after one warp's copies; in 0.1-7 % of such calls (measured on the H200) a row of d_weights /
d_index_q and its d_index_k terms come out wrong. docs/research/dense-indexer-backward.md has the
reading of the code and the measurements.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..policy import dsa_dense_indexer_backward as policy
from ._support import (aliasing, cast_into, alloc_on, allocate, arch_or_refuse, check, flat_args, footprint, input_error, integer, launcher, max_lengths,
                       require, scalar_f32, stream_handle, tensor_args, thd_batch, workspace_problems, writes_only)
from .outputs import Outputs
from .plan import ALLOC, Plan, Recorder, cached, compile_call, probe_for, remember, remembered

__all__ = ["dense_indexer_backward", "dense_indexer_backward_into", "dense_indexer_backward_workspace_bytes", "DenseIndexerBackward"]

FAMILY = policy.FAMILY
_I32 = 2**31
_FLT_MAX = 3.4028234663852886e38
# the op's tensors, in the order of the plan's pointers
_TENSORS = ("d_index_q", "d_weights", "d_index_k", "index_q", "weights", "index_k", "attn_score", "attn_l1norm", "index_score", "index_lse",
            "grad_loss", "cu_seqlens_q", "cu_seqlens_k", "q_causal_offsets", "workspace")
_WRITES = (0, 1, 2, 8, 14)  # the outputs, index_score (the score-grad signal), the workspace


def dense_indexer_backward_workspace_bytes(index_k_shape, d_index_k_dtype=None) -> int:
    """cudnn's ``DenseIndexerBackward.scratch_workspace_bytes()``: the uint8 bytes ``workspace`` must hold
    for an ``index_k`` of this shape ((B, S_k, D) or (total_k, D)); ``d_index_k_dtype`` torch.bfloat16
    (the default) or torch.float32 (none needed)."""
    import torch

    problems = []
    shape = tuple(index_k_shape) if isinstance(index_k_shape, (tuple, list, torch.Size)) else None
    if shape is None or len(shape) not in (2, 3):
        problems.append(f"index_k_shape={index_k_shape!r} (expected (B, S_k, D) or (total_k, D))")
    else:
        for i, n in enumerate(shape):
            integer(problems, f"index_k_shape[{i}]", n, 0, _I32 - 1)
    if d_index_k_dtype not in (None, torch.bfloat16, torch.float32):
        problems.append(f"d_index_k_dtype={d_index_k_dtype!r} (expected torch.bfloat16 or torch.float32)")
    if problems:
        raise input_error(problems)
    n = 1
    for x in shape:
        n *= x
    return policy.workspace_bytes(n, d_index_k_dtype == torch.float32)


@dataclass(frozen=True)
class _Call:
    """What validating one call proved: device, arch, layout, extents, workspace bytes, entries."""

    dev: int
    arch: str
    varlen: bool
    b: int
    rows: int  # B*S_q (BSHD) or total_q (THD): upstream's normalisation of the loss
    s_q: int  # S_q or max_seqlen_q
    s_k: int  # S_k or max_seqlen_k
    need: int
    kernels: dict | None  # role -> (op, key); None when nothing launches
    foot: list


def dense_indexer_backward(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale=1.0, loss_coeff=1.0,
                           block_I=128, ratio=1, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None,
                           d_index_q=None, d_weights=None, d_index_k=None, stream=None, workspace=None):
    """cudnn's ``dense_indexer_backward_wrapper``: returns ``{'d_index_q', 'd_weights', 'd_index_k'}``.

    BSHD: index_q (B, S_q, H, 128), weights (B, S_q, H), index_k (B, S_k, 128) bf16; attn_score and
    index_score (B, S_q, S_k), attn_l1norm and index_lse (B, S_q) fp32. THD (``cu_seqlens_q`` and
    ``cu_seqlens_k``, int32 (B + 1,)): (total_q, H, 128), (total_q, H), (total_k, 128); scores
    (total_q, max_seqlen_k), denominators (total_q,). ``index_score`` is overwritten with the score-grad
    signal. Outputs not given are allocated like the inputs (bf16; ``d_index_k`` may be fp32);
    ``workspace`` (uint8, ``dense_indexer_backward_workspace_bytes``) per call when omitted. THD without
    ``max_seqlen_q`` / ``max_seqlen_k`` reads them from ``cu_seqlens_*`` (a synchronisation, refused under
    graph capture). Every tensor contiguous: pass ``.contiguous()`` copies of strided ones.
    """
    import torch

    if cu_seqlens_q is not None and (max_seqlen_q is None or max_seqlen_k is None):
        max_seqlen_q, max_seqlen_k = max_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, stream)
    ts = (d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, cu_seqlens_q,
          cu_seqlens_k, q_causal_offsets, workspace)
    if workspace is None or d_index_q is None or d_weights is None or d_index_k is None:
        extra = (block_I, ratio, max_seqlen_q, max_seqlen_k)
        hit = remembered(_CALLS, ALLOC, ts, extra)
        call = hit and hit[0]
        if call is None:
            call = _validate(ts, sm_scale, loss_coeff, block_I, ratio, max_seqlen_q, max_seqlen_k, allocating=True)
            remember(_CALLS, ALLOC, extra, probe_for(ts, call.dev, call.foot), call)
        _scalars_of(call.rows)(sm_scale=sm_scale, loss_coeff=loss_coeff)  # the per-call scalars, before allocating
        dev = call.dev
        stream_handle(stream, dev)  # refuse a bad stream before allocating on it

        def outputs():
            with alloc_on(stream, dev):
                return (torch.empty_like(index_q) if d_index_q is None else d_index_q, torch.empty_like(weights) if d_weights is None else d_weights,
                        torch.empty_like(index_k) if d_index_k is None else d_index_k,
                        torch.empty(call.need, dtype=torch.uint8, device=index_q.device) if workspace is None and call.need else workspace)

        d_index_q, d_weights, d_index_k, workspace = allocate(outputs)
    dense_indexer_backward_into(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse,
                                grad_loss, sm_scale, loss_coeff, block_I, ratio, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                q_causal_offsets, stream, workspace)
    return Outputs(d_index_q=d_index_q, d_weights=d_weights, d_index_k=d_index_k)


def dense_indexer_backward_into(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse,
                                grad_loss, sm_scale=1.0, loss_coeff=1.0, block_I=128, ratio=1, cu_seqlens_q=None, cu_seqlens_k=None,
                                max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None, stream=None, workspace=None):
    """``dense_indexer_backward`` into caller-provided outputs and workspace (THD: ``max_seqlen_q`` and
    ``max_seqlen_k`` required). Capture-safe from the first call; allocates nothing."""
    ts = (d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, cu_seqlens_q,
          cu_seqlens_k, q_causal_offsets, workspace)
    extra = (block_I, ratio, max_seqlen_q, max_seqlen_k)
    call, p = cached(_CALLS, ts, extra, lambda: _plan(*ts[:11], sm_scale, loss_coeff, block_I, ratio, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                       max_seqlen_k, q_causal_offsets, workspace))
    call.run(p, stream_handle(stream, call.dev), call.scalars(sm_scale=sm_scale, loss_coeff=loss_coeff), ts, stream)
    return d_index_q, d_weights, d_index_k


def _scalars_of(rows: int):
    """The per-call scalars (grad_scale = loss_coeff / max(rows, 1), sm_scale), checked."""

    def scalars(sm_scale=1.0, loss_coeff=1.0):
        if type(sm_scale) is float and type(loss_coeff) is float and -_FLT_MAX <= sm_scale <= _FLT_MAX and -_FLT_MAX <= loss_coeff <= _FLT_MAX:
            return (loss_coeff / max(rows, 1), sm_scale)
        problems = []
        sm = scalar_f32(problems, "sm_scale", sm_scale)
        lc = scalar_f32(problems, "loss_coeff", loss_coeff)
        if problems:
            raise input_error(problems)
        return (lc / max(rows, 1), sm)

    return scalars


def _plan(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale=1.0,
          loss_coeff=1.0, block_I=128, ratio=1, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None,
          workspace=None):
    """Validate a dense indexer backward call and compile what it does (:class:`dsa_aot.ops.plan.Call`)."""
    import torch

    ts = (d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, cu_seqlens_q,
          cu_seqlens_k, q_causal_offsets, workspace)
    c = _validate(ts, sm_scale, loss_coeff, block_I, ratio, max_seqlen_q, max_seqlen_k)
    scalars = _scalars_of(c.rows)
    x = scalars(sm_scale=sm_scale, loss_coeff=loss_coeff)
    defaults = functools.partial(scalars, sm_scale=sm_scale, loss_coeff=loss_coeff)  # a plan's execute overrides some
    rec = Recorder(len(ts), 2)
    P, s, (grad_scale, sm) = rec.p, rec.s, rec.x
    if c.kernels is None:
        # nothing launches (no query rows, no keys, or no segments): dK is zero; dQ / dW zero where they have rows
        def zero(ts, stream):
            with alloc_on(stream, c.dev):
                for t in ts[:3]:
                    t.zero_()

        rec.then(zero)
        return compile_call("dsa_dense_indexer_backward", rec, c.dev, ts, c.foot, x, defaults)
    f32 = d_index_k.dtype == torch.float32
    rec.memset(P[2] if f32 else P[14], index_k.numel() * 4)  # both GEMMs reduce-add dK into zeroed fp32
    for role in ("score_grad", "gemm"):
        op, key = c.kernels[role]
        rec.launch(launcher(FAMILY, op, key, c.dev), *_launch_args(op, ts, P, c.varlen, c.s_q, c.s_k, f32, grad_scale, sm, s))
    if not f32:
        def cast_dk(ts, stream, shape=(1, 1, index_k.numel())):
            cast_into(ts[2], ts[14], shape, stream, c.dev)

        rec.then(cast_dk)
    return compile_call("dsa_dense_indexer_backward", rec, c.dev, ts, c.foot, x, defaults)


def _launch_args(op, ts, p, varlen, s_q, s_k, dk_f32, grad_scale, sm_scale, s) -> tuple:
    """The host-function arguments of entry ``op`` in upstream's order (``ts``: the op's tensors, anything
    with ``shape`` and ``stride()``, in :data:`_TENSORS` order; ``p``: their pointers)."""
    dq, dw, dk, q, w, k, att, den, isc, lse, gl, cu_q, cu_k, offs, ws = ts
    cu = (*tensor_args(cu_q, p[11]), *tensor_args(cu_k, p[12])) if varlen else ()
    off = tensor_args(offs, p[13]) if offs is not None else ()
    sig = tensor_args(isc, p[8])  # the raw indexer scores in, the score-grad signal out, the GEMM's input
    if op in ("score_grad", "score_grad_sm90"):  # (..., cu_seqlens, offsets, grad_loss, grad_scale, S_q, S_k, stream)
        return (*sig, *tensor_args(att, p[6]), *tensor_args(lse, p[9]), *tensor_args(den, p[7]), *cu, *off, *flat_args(p[10], (1,)), grad_scale,
                s_q, s_k, s)
    head = (*tensor_args(q, p[3]), *tensor_args(w, p[4]), *tensor_args(k, p[5]), *tensor_args(dq, p[0]), *tensor_args(dw, p[1]),
            *flat_args(p[2] if dk_f32 else p[14], tuple(k.shape)), *sig)
    if op == "gemm":  # SM100: (..., cu_seqlens, offsets, scale, S_q, S_k, stream)
        return (*head, *cu, *off, sm_scale, s_q, s_k, s)
    return (*head, sm_scale, s, *cu, s_q, s_k, *off)  # SM90: (..., [no top-k ids], scale, stream, cu_seqlens, S_q, S_k, offsets)


class DenseIndexerBackward(Plan):
    """cudnn's DenseIndexerBackward shape: ``DenseIndexerBackward(d_index_q, d_weights, d_index_k, index_q, weights,
    index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale=1.0, loss_coeff=1.0, block_I=128,
    ratio=1, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None,
    workspace=None)``; ``execute(<the tensors>, stream=None, sm_scale=..., loss_coeff=...)``."""

    _build = staticmethod(_plan)
    _tensors = _TENSORS[:11] + ("cu_seqlens_q", "cu_seqlens_k", "q_causal_offsets", "workspace")
    _scalars = ("sm_scale", "loss_coeff")


_CALLS: dict = {}


def _validate(ts, sm_scale, loss_coeff, block_I, ratio, max_seqlen_q, max_seqlen_k, allocating=False) -> _Call:
    """Every problem with a call, raised together before anything is touched. ``allocating``: outputs
    and workspace given as None will be allocated (not checked)."""
    import torch

    (d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, cu_q, cu_k, offsets,
     workspace) = ts
    problems = []
    scalar_f32(problems, "sm_scale", sm_scale)
    scalar_f32(problems, "loss_coeff", loss_coeff)
    if not (type(block_I) is int and block_I == policy.BLOCK_I):
        problems.append(f"block_I={block_I!r}: the build ships upstream's default {policy.BLOCK_I} only")
    integer(problems, "ratio", ratio, 1, _I32 - 1)
    varlen = cu_q is not None or cu_k is not None
    rank = 3 if varlen else 4
    if not isinstance(index_q, torch.Tensor) or index_q.layout != torch.strided or index_q.ndim != rank or index_q.device.type != "cuda":
        problems.append(f"index_q: expected a CUDA tensor {'(total_q, H, 128)' if varlen else '(B, S_q, H, 128)'}"
                        f"{' (THD: cu_seqlens_q / cu_seqlens_k given)' if varlen else ''}, got {getattr(index_q, 'shape', type(index_q).__name__)}")
        raise input_error(problems)
    if not isinstance(index_k, torch.Tensor) or index_k.ndim != rank - 1:
        problems.append(f"index_k: expected a {'(total_k, 128)' if varlen else '(B, S_k, 128)'} tensor, got {getattr(index_k, 'shape', type(index_k).__name__)}")
        raise input_error(problems)
    dev = index_q.device.index
    arch, _ = arch_or_refuse(problems, dev)
    h, d = index_q.shape[-2], index_q.shape[-1]
    lead = tuple(index_q.shape[:-2])
    b = thd_batch(problems, varlen, cu_q, cu_k, max_seqlen_q, max_seqlen_k, dev)
    if varlen:
        s_q, s_k = max_seqlen_q, max_seqlen_k
        rows = lead[0]
        k_shape = (index_k.shape[0], d)
        score, denom = (rows, s_k), lead
    else:
        b, s_q = lead
        s_k = index_k.shape[1]
        rows = b * s_q
        k_shape = (b, s_k, d)
        score, denom = (b, s_q, s_k), lead
    bf16, f32 = torch.bfloat16, torch.float32
    check(problems, index_q, "index_q", lead + (h, d), bf16, dev, 16)
    check(problems, weights, "weights", lead + (h,), bf16, dev, 16)
    check(problems, index_k, "index_k", k_shape, bf16, dev, 16)
    if isinstance(score[-1], int):
        check(problems, attn_score, "attn_score", score, f32, dev, 16)
        check(problems, index_score, "index_score", score, f32, dev, 16)
    check(problems, attn_l1norm, "attn_l1norm", denom, f32, dev, 16)
    check(problems, index_lse, "index_lse", denom, f32, dev, 16)
    if offsets is not None and b is not None:
        check(problems, offsets, "q_causal_offsets", (b,), torch.int32, dev, 16)
    skip = (lambda t: allocating and t is None)  # noqa: E731
    if not skip(d_index_q):
        check(problems, d_index_q, "d_index_q", lead + (h, d), bf16, dev, 16)
    if not skip(d_weights):
        check(problems, d_weights, "d_weights", lead + (h,), bf16, dev, 16)
    dk_f32 = isinstance(d_index_k, torch.Tensor) and d_index_k.dtype == f32
    if not skip(d_index_k):
        check(problems, d_index_k, "d_index_k", k_shape, f32 if dk_f32 else bf16, dev, 16)
    if (not isinstance(grad_loss, torch.Tensor) or grad_loss.layout != torch.strided or grad_loss.numel() != 1 or grad_loss.dtype != f32
            or grad_loss.device != index_q.device):
        problems.append(f"grad_loss: must be a single-element float32 tensor on {index_q.device}")
    elif grad_loss.data_ptr() % 4:
        problems.append(f"grad_loss: data pointer 0x{grad_loss.data_ptr():x} is not 4-byte aligned")
    if h not in policy.HEADS:
        problems.append(f"H={h} (the dense indexer backward ships H={', '.join(map(str, policy.HEADS))}: upstream needs H >= 64, and its "
                        f"SM100 GEMM does not fit in shared memory beyond H 64)")
    if d != policy.DIM:
        problems.append(f"D={d} (expected {policy.DIM})")
    if not problems:
        for what, n in (("rows*H*D", rows * h * d), ("index_k elements", index_k.numel()), ("rows*S_k", rows * s_k)):
            if n >= _I32:
                problems.append(f"{what} = {n} (expected < 2**31: the kernels index with int32)")
    ks = None
    if not problems:
        ks = policy.kernels(arch, h, varlen, ratio, offsets is not None)
        require(FAMILY, ks, dev)  # every entry ships, before anything is allocated or written (an empty call too: the same key)
        if not (rows and s_q and s_k and b):
            ks = None  # nothing to launch
    need = 0
    if not problems:
        need = policy.workspace_bytes(index_k.numel(), dk_f32)
        if need and not skip(workspace):
            problems += workspace_problems(workspace, need, dev, list(zip(_TENSORS, ts[:14])), "dsa_aot.dsa.dense_indexer_backward_workspace_bytes")
        elif workspace is not None and not isinstance(workspace, torch.Tensor):  # not needed, but given: a tensor or None
            problems.append(f"workspace: got {type(workspace).__name__} (expected None or a 1-D uint8 CUDA tensor)")
    if not problems:
        named = [(n, t) for n, t in zip(_TENSORS, ts)]
        problems += aliasing([named[i] for i in _WRITES[:4]], [nt for i, nt in enumerate(named[:14]) if i not in _WRITES])
    if problems:
        raise input_error(problems)
    masks = tuple(3 if i == 10 else (15 if i != 14 or need else 0) for i in range(len(ts)))
    foot = footprint(ts, writes=_WRITES, masks=masks, sizes={14: need})
    return _Call(dev, arch, varlen, b or 0, rows, s_q, s_k, need, ks, foot)


# --- torch.library (dsa_aot.library registers these as torch.ops.dsa_aot.<name>) -------------------------
# On torch's current stream. index_score is overwritten with the score-grad signal: annotated as mutated.


def _t_backward(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale=1.0, loss_coeff=1.0, block_I=128,
                ratio=1, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None):
    return tuple(dense_indexer_backward(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale, loss_coeff,
                                        block_I, ratio, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_causal_offsets))


def _f_backward(index_q, weights, index_k, *args, **kwargs):
    return index_q.new_empty(index_q.shape), weights.new_empty(weights.shape), index_k.new_empty(index_k.shape)


def _t_backward_into(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss,
                     sm_scale=1.0, loss_coeff=1.0, block_I=128, ratio=1, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                     q_causal_offsets=None, workspace=None):
    dense_indexer_backward_into(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse,
                                grad_loss, sm_scale, loss_coeff, block_I, ratio, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                q_causal_offsets, None, workspace)


_IN = ("Tensor index_q, Tensor weights, Tensor index_k, Tensor attn_score, Tensor attn_l1norm, Tensor(a!) index_score, Tensor index_lse, "
       "Tensor grad_loss, float sm_scale=1.0, float loss_coeff=1.0, int block_I=128, int ratio=1, Tensor? cu_seqlens_q=None, "
       "Tensor? cu_seqlens_k=None, int? max_seqlen_q=None, int? max_seqlen_k=None, Tensor? q_causal_offsets=None")
TORCH_OPS = {
    "dsa_dense_indexer_backward": (f"({_IN}) -> (Tensor, Tensor, Tensor)", _t_backward, _f_backward),
    "dsa_dense_indexer_backward_into": (f"(Tensor(b!) d_index_q, Tensor(c!) d_weights, Tensor(d!) d_index_k, {_IN}, Tensor(e!)? workspace=None) -> ()",
                                        _t_backward_into, writes_only),
}
