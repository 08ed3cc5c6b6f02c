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

from ..policy.families import FAMILIES
from ..policy import dsa_dense_indexer_backward as policy
from .args import flat_args, tensor_args
from .checks import _FLT_MAX, aliasing, check, input_error, int32_extents, integer, scalar_f32, thd_batch, workspace_problems
from .gpu import alloc_on, arch_or_refuse, cast_into, max_lengths, require
from .declare import Float, In, Int, OneOf, Op, Out, Workspace

FAMILY = policy.FAMILY
__all__ = list(FAMILIES[FAMILY].exports)  # the registry lists them: dsa_aot.<namespace> imports this module for them
_I32 = 2**31
_SIZER = "dsa_aot.dsa.dense_indexer_backward_workspace_bytes"


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


def _maxima(max_seqlen_q, max_seqlen_k, *, cu_seqlens_q, cu_seqlens_k, stream):
    """The allocating form's THD maxima, read from ``cu_seqlens_*`` when not given (upstream's .item(): a synchronisation)."""
    if cu_seqlens_q is not None and (max_seqlen_q is None or max_seqlen_k is None):
        return max_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, stream)
    return max_seqlen_q, max_seqlen_k


def _check(c, problems):
    """Every problem with a call (options, tensors, workspace, overlaps), listed together (``c.allocating``: outputs
    and workspace given as None will be allocated, not checked); sets what the plan reads, requires every entry it names."""
    import torch

    scalar_f32(problems, "sm_scale", c.sm_scale)
    scalar_f32(problems, "loss_coeff", c.loss_coeff)
    if not (type(c.block_I) is int and c.block_I == policy.BLOCK_I):
        problems.append(f"block_I={c.block_I!r}: the build ships upstream's default {policy.BLOCK_I} only")
    integer(problems, "ratio", c.ratio, 1, _I32 - 1)
    index_q, index_k, offsets = c.index_q, c.index_k, c.q_causal_offsets
    c.varlen = varlen = c.cu_seqlens_q is not None or c.cu_seqlens_k is not None
    rank = 3 if varlen else 4
    if not isinstance(index_q, torch.Tensor) or index_q.layout != torch.strided or index_q.ndim != rank or index_q.device.type != "cuda":
        problems.append(f"index_q: expected a CUDA tensor {'(total_q, H, 128)' if varlen else '(B, S_q, H, 128)'}"
                        f"{' (THD: cu_seqlens_q / cu_seqlens_k given)' if varlen else ''}, got {getattr(index_q, 'shape', type(index_q).__name__)}")
        raise input_error(problems)
    if not isinstance(index_k, torch.Tensor) or index_k.ndim != rank - 1:
        problems.append(f"index_k: expected a {'(total_k, 128)' if varlen else '(B, S_k, 128)'} tensor, got {getattr(index_k, 'shape', type(index_k).__name__)}")
        raise input_error(problems)
    c.dev = dev = index_q.device.index
    arch, _ = arch_or_refuse(problems, dev)
    h, d = index_q.shape[-2], index_q.shape[-1]
    lead = tuple(index_q.shape[:-2])
    b = thd_batch(problems, varlen, c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k, dev)
    if varlen:
        s_q, s_k, rows = c.max_seqlen_q, c.max_seqlen_k, lead[0]
        k_shape, score = (index_k.shape[0], d), (rows, s_k)
    else:
        (b, s_q), s_k = lead, index_k.shape[1]
        rows, k_shape, score = b * s_q, (b, s_k, d), (b, s_q, s_k)
    bf16, f32 = torch.bfloat16, torch.float32
    check(problems, index_q, "index_q", lead + (h, d), bf16, dev, 16)
    check(problems, c.weights, "weights", lead + (h,), bf16, dev, 16)
    check(problems, index_k, "index_k", k_shape, bf16, dev, 16)
    if isinstance(score[-1], int):
        check(problems, c.attn_score, "attn_score", score, f32, dev, 16)
        check(problems, c.index_score, "index_score", score, f32, dev, 16)
    check(problems, c.attn_l1norm, "attn_l1norm", lead, f32, dev, 16)
    check(problems, c.index_lse, "index_lse", lead, f32, dev, 16)
    if offsets is not None and b is not None:
        check(problems, offsets, "q_causal_offsets", (b,), torch.int32, dev, 16)
    c.dk_f32 = isinstance(c.d_index_k, torch.Tensor) and c.d_index_k.dtype == f32
    for name, shape, dt in (("d_index_q", lead + (h, d), bf16), ("d_weights", lead + (h,), bf16), ("d_index_k", k_shape, f32 if c.dk_f32 else bf16)):
        if not (c.allocating and getattr(c, name) is None):
            check(problems, getattr(c, name), name, shape, dt, dev, 16)
    gl = c.grad_loss
    if not isinstance(gl, torch.Tensor) or gl.layout != torch.strided or gl.numel() != 1 or gl.dtype != f32 or gl.device != index_q.device:
        problems.append(f"grad_loss: must be a single-element float32 tensor on {index_q.device}")
    elif gl.data_ptr() % 4:
        problems.append(f"grad_loss: data pointer 0x{gl.data_ptr():x} is not 4-byte aligned")
    if h not in policy.HEADS:
        problems.append(f"H={h} (the dense indexer backward ships H={', '.join(map(str, policy.HEADS))}: upstream needs H >= 64, and its "
                        f"SM100 GEMM does not fit in shared memory beyond H 64)")
    if d != policy.DIM:
        problems.append(f"D={d} (expected {policy.DIM})")
    if not problems:
        int32_extents(problems, ("rows*H*D", rows * h * d), ("index_k elements", index_k.numel()), ("rows*S_k", rows * s_k))
    if not problems:
        ks = policy.kernels(arch, h, varlen, ratio=c.ratio, offsets=offsets is not None)
        require(FAMILY, ks, dev)  # every entry ships, before anything is allocated or written (an empty call too: the same key)
        c.ks = ks if rows and s_q and s_k and b else {}  # {}: nothing to launch
        c.rows, c.s_q, c.s_k = rows, s_q, s_k
        c.ws_need = need = policy.workspace_bytes(index_k.numel(), c.dk_f32)
        if need and not (c.allocating and c.workspace is None):
            problems += workspace_problems(c.workspace, need, dev, [(n, getattr(c, n)) for n in _TENSORS[:14]], _SIZER)
        elif c.workspace is not None and not isinstance(c.workspace, torch.Tensor):  # not needed, but given: a tensor or None
            problems.append(f"workspace: got {type(c.workspace).__name__} (expected None or a 1-D uint8 CUDA tensor)")
    if not problems:  # the outputs and index_score (the score-grad signal) against each other and the inputs
        named = [(n, getattr(c, n)) for n in _TENSORS[:14]]
        problems += aliasing([named[i] for i in (0, 1, 2, 8)], [nt for i, nt in enumerate(named) if i not in (0, 1, 2, 8)])


def _scalars(c):
    """The per-call scalars of a call like ``c`` (sm_scale, grad_scale = loss_coeff / max(rows, 1)), checked."""
    rows = max(c.rows, 1)

    def scalars(sm_scale, loss_coeff):
        if type(sm_scale) is float and type(loss_coeff) is float and -_FLT_MAX <= sm_scale <= _FLT_MAX and -_FLT_MAX <= loss_coeff <= _FLT_MAX:
            return (sm_scale, loss_coeff / rows)
        problems = []
        sm = scalar_f32(problems, "sm_scale", sm_scale)
        lc = scalar_f32(problems, "loss_coeff", loss_coeff)
        if problems:
            raise input_error(problems)
        return (sm, lc / rows)

    return scalars


def _plan(rec, c):
    if not c.ks:  # nothing launches (no query rows, no keys, or no segments): dK is zero; dQ / dW zero where they have rows
        def zero(ts, stream):
            with alloc_on(stream, c.dev):
                for t in ts[:3]:
                    t.zero_()

        rec.then(zero)
        return
    ts, p, (sm, grad_scale) = tuple(getattr(c, n) for n in _TENSORS), rec.p, rec.x
    rec.memset(p[2] if c.dk_f32 else p[14], c.index_k.numel() * 4)  # both GEMMs reduce-add dK into zeroed fp32
    for role in ("score_grad", "gemm"):
        rec.launch(c.entry[role], *_launch_args(c.ks[role][0], ts, p, c.varlen, c.s_q, c.s_k, c.dk_f32, grad_scale, sm, rec.s))
    if not c.dk_f32:
        def cast_dk(ts, stream, shape=(1, 1, c.index_k.numel())):
            cast_into(ts[2], ts[14], shape, stream, c.dev)

        rec.then(cast_dk)


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


_ARGS = ("index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale=1.0, loss_coeff=1.0, block_I=128, "
         "ratio=1, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None")
BACKWARD = Op(
    FAMILY, "dense_indexer_backward", plan_class="DenseIndexerBackward",
    into=f"d_index_q, d_weights, d_index_k, {_ARGS}, stream=None, workspace=None",
    alloc=f"{_ARGS}, d_index_q=None, d_weights=None, d_index_k=None, stream=None, workspace=None",
    tensors=(
        Out("d_index_q", "bfloat16", "like index_q", given=True, alloc_like=True),
        Out("d_weights", "bfloat16", "like weights", given=True, alloc_like=True),
        Out("d_index_k", ("bfloat16", "float32"), "like index_k", given=True, alloc_like=True),
        *(In(n, "bfloat16", None) for n in ("index_q", "weights", "index_k")),
        In("attn_score", "float32", None), In("attn_l1norm", "float32", None), In("index_score", "float32", None, written=True),
        In("index_lse", "float32", None), In("grad_loss", "float32", None, align=4),
        *(In(n, "int32", None, optional=True) for n in ("cu_seqlens_q", "cu_seqlens_k", "q_causal_offsets")),
        Workspace("workspace", lambda c: policy.workspace_bytes(c.index_k.numel(), c.dk_f32), _SIZER, given=True),
    ),
    options=(
        Float("sm_scale", 1.0, per_call=True), Float("loss_coeff", 1.0, per_call=True), OneOf("block_I", (policy.BLOCK_I,), policy.BLOCK_I),
        Int("ratio", 1, _I32 - 1, 1), Int("max_seqlen_q", 0, _I32 - 1, None), Int("max_seqlen_k", 0, _I32 - 1, None),
    ),
    check=_check, entries=lambda c: c.ks, plan=_plan, scalar_fn=_scalars, alloc_first=_maxima, alias_order=("index_score",),
    note="BSHD: index_q (B, S_q, H, 128), weights (B, S_q, H), index_k (B, S_k, 128) bf16; attn_score and index_score (B, S_q, S_k), "
         "attn_l1norm and index_lse (B, S_q) fp32. THD (``cu_seqlens_q`` and ``cu_seqlens_k``, int32 (B + 1,)): (total_q, H, 128), "
         "(total_q, H), (total_k, 128); scores (total_q, max_seqlen_k), denominators (total_q,). ``index_score`` is overwritten with the "
         "score-grad signal. Outputs not given are allocated like the inputs (bf16; ``d_index_k`` may be fp32); ``workspace`` (uint8, "
         "``dense_indexer_backward_workspace_bytes``) per call when omitted. THD without ``max_seqlen_q`` / ``max_seqlen_k``: the allocating "
         "form reads them from ``cu_seqlens_*`` (a synchronisation, refused under graph capture); the _into form and the plan need them. "
         "Every tensor contiguous: pass ``.contiguous()`` copies of strided ones.",
)  # fmt: skip
_TENSORS = BACKWARD.names  # the op's tensors, in the order of the plan's pointers

dense_indexer_backward, dense_indexer_backward_into, DenseIndexerBackward = BACKWARD.forms(globals())
# torch.ops.dsa_aot.<name>, on torch's current stream; index_score is overwritten with the score-grad signal: annotated as mutated
