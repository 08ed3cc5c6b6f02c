"""DSA score recompute ops, launched from shipped cubins: cudnn's ``sparse_indexer_score_recompute_wrapper`` (the
indexer's ``predict = softmax_i(sum_h relu(q_h . k_slot) w_h)`` over each query's top-k slots), ``sparse_attn_score_recompute_wrapper``
(the attention's ``target = L1norm_i(sum_h exp(scale q_h . k_slot - lse_h))``), their dense twins over every key (on SM100 also
block-scaled) and the training-layout ``sparse_attention_score_recompute``. One launch per call (SM90 THD: one per segment); on
SM90 the weights / LSE are first copied transposed into the caller's workspace, as upstream copies them on every call.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

from ..policy.families import FAMILIES
from ..policy import dsa_score_recompute as policy
from .args import flat_args, tensor_args
from .checks import block_scales, check, input_error, int32_extents, integer, scalar_f32
from .gpu import alloc_on, arch_or_refuse, max_lengths, require
from .declare import REQUIRED, Flag, Float, Hidden, In, Int, OneOf, Op, Out, Workspace
from .outputs import Outputs

FAMILY = policy.FAMILY
__all__ = list(FAMILIES[FAMILY].exports)  # the registry lists them: dsa_aot.<namespace> imports this module for them
_I32 = 2**31
_LOG2_E = math.log2(math.e)  # the SM90 attention kernel takes f32(scale * log2 e), as upstream computes it


@dataclass(frozen=True)
class _Kind:
    """What differs between the indexer's and the attention's wrapper, sparse or dense."""

    name: str  # the op's name, dsa_aot.dsa.<name>
    tensors: tuple  # argument names, in _into order (a dense block-scaled call's scales last)
    aux_dtype: str  # the per-head input's torch dtype: weights bf16, lse fp32
    aux_bytes: int
    dims: tuple  # head dims the kernels take (dense: bf16's; the block-scaled ones policy.DIM / policy.MX_ATTN_DIMS)
    result: str = "out"  # the sparse wrapper's TupleDict key
    precisions: tuple = ("bf16",)  # what the build ships for a dense one


_INDEXER = _Kind("sparse_indexer_score_recompute", ("out", "q_indexer", "k_indexer", "weights", "topk_indices", "topk_length", "workspace"),
                 "bfloat16", 2, (policy.DIM,), "predict")
_ATTENTION = _Kind("sparse_attn_score_recompute", ("out", "q_attn", "k_attn", "lse", "topk_indices", "topk_length", "workspace"),
                   "float32", 4, policy.ATTN_DIMS, "target")


def _workspace_bytes(kind, aux_shape, device, cu_q=None, cu_k=None) -> int:
    """Every sizer's body: BSHD (B, S_q, H), or THD (T_q, H) with ``cu_seqlens`` (SM90: per segment, from host bounds)."""
    import torch

    from ..runtime.device import device_index

    thd, problems = cu_q is not None or cu_k is not None, []
    shape = tuple(aux_shape) if isinstance(aux_shape, (tuple, list, torch.Size)) else None
    if shape is None or len(shape) != (2 if thd else 3):
        problems.append(f"{kind.tensors[3]}_shape={aux_shape!r} (expected {'(T_q, H) with cu_seqlens: THD' if thd else '(B, S_q, H)'})")
    for i, n in enumerate(shape if not problems else ()):
        integer(problems, f"{kind.tensors[3]}_shape[{i}]", n, 0, _I32 - 1)
    dev = None if problems else device_index(device)
    arch, sm100 = arch_or_refuse(problems, dev) if not problems else (None, False)
    cu = _host_offsets(problems, cu_q, cu_k, dev, None) if thd and not problems and not sm100 else None
    if problems:
        raise input_error(problems)
    if not thd:
        return policy.workspace_bytes(arch, *shape, elem_bytes=kind.aux_bytes)
    return 0 if sm100 else policy.thd_workspace(policy.thd_segments(*cu), shape[1], kind.aux_bytes)[1]


def sparse_indexer_score_recompute_workspace_bytes(weights_shape, device=None) -> int:
    """uint8 bytes the ``workspace`` of a call with ``weights`` of this shape (B, S_q, H) needs on GPU
    ``device`` (None: the current one): the transposed bf16 copy of the weights on SM90, none on SM100."""
    return _workspace_bytes(_INDEXER, weights_shape, device)


def sparse_attn_score_recompute_workspace_bytes(lse_shape, device=None) -> int:
    """uint8 bytes the ``workspace`` of a call with ``lse`` of this shape (B, S_q, H) needs on GPU
    ``device`` (None: the current one): the transposed fp32 copy of the LSE on SM90, none on SM100."""
    return _workspace_bytes(_ATTENTION, lse_shape, device)


def _transposed(src, ws, dtype, dev, parts):
    """The plan step that copies the weights / LSE ``ts[src]`` of ``dtype`` transposed into the workspace ``ts[ws]``: what
    every SM90 score-recompute kernel reads (S_q the unit stride), as upstream makes it on every call. Per (rows, byte
    offset, shape (..., S_q, H)) of ``parts``: ``ts[src][rows]`` (None: all) as (..., H, S_q) there (BSHD: one part of
    (B, S_q, H); THD: one (S_q, H) per segment)."""
    import torch

    t = getattr(torch, dtype)  # (resolved once per plan: the step runs on every call)
    parts = [(r, off, off + math.prod(shape) * t.itemsize, (*shape[:-2], shape[-1], shape[-2])) for r, off, shape in parts]

    def step(ts, stream):
        with alloc_on(stream, dev):
            for r, lo, hi, shape in parts:
                ts[ws][lo:hi].view(t).view(shape).copy_((ts[src] if r is None else ts[src][r]).transpose(-1, -2))

    return step


def _launch_args(op, key, ts, p, s, x=()) -> tuple:
    """The host-function arguments of entry ``op`` (``key``) in upstream's order (``ts``: anything with
    ``shape`` and ``stride()``, in the ``_into`` order; ``p``: their pointers; ``x``: the attention's
    scale as the kernel reads it)."""
    out, q, k, aux, idx, length, _ = ts
    lens = tensor_args(length, p[5]) if length is not None and key["length"] else ()  # SM100 attention: dropped where upstream drops it
    if op in ("sparse_indexer", "sparse_attention"):  # SM100: q, k, w / lse, ids, out, [lengths], scale (the indexer's: 1.0), stream
        return (*tensor_args(q, p[1]), *tensor_args(k, p[2]), *tensor_args(aux, p[3]), *tensor_args(idx, p[4]), *tensor_args(out, p[0]), *lens,
                x[0] if x else 1.0, s)
    b, s_k, d = k.shape
    b, s_q, h = aux.shape
    kv4 = (p[2], b, s_k, 1, d, s_k * d, d, d)  # k.unsqueeze(2): the SM90 kernel takes kv as (B, S_k, H_kv = 1, D)
    # SM90: q, kv, ids, stream, out, the weights / LSE transposed (B, H, S_q) in the workspace, [lengths], (no L1 denominator),
    # then the attention's softmax_scale_log2 (the spec's LITERALS: upstream bakes it into the host code)
    return (*tensor_args(q, p[1]), *kv4, *tensor_args(idx, p[4]), s, *tensor_args(out, p[0]), *flat_args(p[6], (b, h, s_q)), *lens, *x)


def _sparse_rules(kind):
    """The sparse ``kind``'s rules beyond its tensors' declaration (run once they pass): the arch, head dim, slots and
    int32 extents; the scale as the kernel reads it (``c.x32``), the entry (``c.kernel``) and the workspace it needs."""

    def rules(c, problems):
        b, s_q, h, d, s_k, topk = (c.sym[n] for n in ("B", "S_q", "H", "D", "S_k", "topk"))
        arch, sm100 = arch_or_refuse(problems, c.dev)
        if d not in kind.dims:
            problems.append(f"D={d} (expected {' or '.join(map(str, kind.dims))})")
        if topk % 128 or not 128 <= topk <= 2048:
            problems.append(f"topk={topk} (the kernels take 128..2048 slots in multiples of 128: pad the rows with -1)")
        if not s_k and b * s_q:
            problems.append(f"{kind.tensors[2]}: S_k = 0 (expected at least one key row)")
        int32_extents(problems, ("B*S_q*H*D", b * s_q * h * d), ("B*S_k*D", b * s_k * d), ("B*S_q*topk", b * s_q * topk))
        c.x32, c.kernel, c.ws = (), None, 0
        if problems:
            return
        if kind is _ATTENTION:  # SM100 reads the scale; SM90 the f32 of scale * log2 e its host code would have computed
            x = float(c.softmax_scale)
            c.x32 = (x,) if sm100 else (scalar_f32(problems, "softmax_scale * log2(e)", x * _LOG2_E),)
        ks = policy.kernels(arch, h, topk, c.topk_length is not None, c.topk_indices_global, d if kind is _ATTENTION else None)
        require(FAMILY, ks, c.dev)  # the entry ships, before anything is allocated or written (an empty call too)
        c.kernel = ks["main"] if b * s_q else None
        c.ws = policy.workspace_bytes(arch, b, s_q, h, elem_bytes=kind.aux_bytes)

    return rules


def _qhead(c, problems):  # reported with the options' and tensors' problems (they fix nothing here)
    if c.qhead_per_kv_head is not None and c.qhead_per_kv_head != c.sym.get("H", c.qhead_per_kv_head):
        problems.append(f"qhead_per_kv_head={c.qhead_per_kv_head!r}: must equal q's heads ({c.sym['H']}; k has one KV head)")


def _sparse_plan(kind):
    def plan(rec, c):
        if c.kernel is not None:
            op, key = c.kernel
            ts = tuple(getattr(c, n) for n in kind.tensors)
            if op.endswith("_sm90"):
                rec.first(_transposed(3, 6, kind.aux_dtype, c.dev, [(None, 0, ts[3].shape)]))
            rec.launch(c.entry["main"], *_launch_args(op, key, ts, rec.p, rec.s, c.x32))

    return plan


def _sparse(kind, plan_class, note, *scale):
    """The declaration of a sparse wrapper (``scale``: the attention's softmax_scale option), cudnn's signatures."""
    q, k, aux = kind.tensors[1:4]
    s = "softmax_scale, " if scale else ""
    return Op(
        FAMILY, kind.name, plan_class=plan_class, note=note,
        into=f"out, {q}, {k}, {aux}, topk_indices, {s}topk_length=None, topk_indices_global=False, stream=None, *, workspace=None, "
             "qhead_per_kv_head=None",
        alloc=f"{q}, {k}, {aux}, topk_indices, {s}qhead_per_kv_head=None, topk_length=None, topk_indices_global=False, out=None, stream=None, *, "
              "workspace=None",
        plan_args=f"out, {q}, {k}, {aux}, topk_indices, topk_length=None, workspace=None, *, {s}topk_indices_global=False, qhead_per_kv_head=None",
        tensors=(Out("out", "float32", ("B", "S_q", "topk"), given=True, returns=kind.result),
                 In(kind.tensors[1], "bfloat16", ("B", "S_q", "H", "D")), In(kind.tensors[2], "bfloat16", ("B", "S_k", "D")),
                 In(kind.tensors[3], kind.aux_dtype, ("B", "S_q", "H")), In("topk_indices", "int32", ("B", "S_q", "topk")),
                 In("topk_length", "int32", ("B", "S_q"), optional=True),
                 Workspace("workspace", lambda c: c.ws, f"dsa_aot.dsa.{kind.name}_workspace_bytes", align=lambda c: 16 if c.ws else 1,
                           given=True)),
        options=(*scale, Flag("topk_indices_global", False), Int("qhead_per_kv_head", 1, _I32 - 1, None, torch=False)),
        early_rules=_qhead, rules=_sparse_rules(kind), entries=lambda c: {"main": c.kernel} if c.kernel is not None else {}, plan=_sparse_plan(kind),
    )  # fmt: skip


SPARSE_INDEXER = _sparse(_INDEXER, "SparseIndexerScoreRecompute", (
    "The indexer's predict (B, S_q, topk) fp32: q_indexer (B, S_q, H, 128), k_indexer (B, S_k, 128), weights (B, S_q, H) bf16; "
    "topk_indices (B, S_q, topk) int32, per-batch local ids unless ``topk_indices_global`` (``b * S_k + local``), a negative id for an "
    "empty slot (its predict is 0); topk_length (B, S_q) int32 or None: the slots at and past it are 0. Not checkable on the host, as "
    "upstream: every scored id a key row of its own batch, ``0 <= topk_length <= topk``. On SM90 ``workspace``: "
    "``sparse_indexer_score_recompute_workspace_bytes``."))
SPARSE_ATTN = _sparse(_ATTENTION, "SparseAttnScoreRecompute", (
    "The attention's target (B, S_q, topk) fp32, the L1-normalised ``sum_h exp(softmax_scale q_h . k_slot - lse_h)`` over each query's "
    "slots: q_attn (B, S_q, H, D) bf16 with D 512 or 576, k_attn (B, S_k, D) bf16, lse (B, S_q, H) fp32 (the forward's, natural log); "
    "topk_indices and topk_length as the indexer's. As upstream's docstring says, ``topk_length`` does not replace the -1 padding: slots "
    "at and past it must hold -1. ``softmax_scale`` > 0, any value (none is compiled in). On SM90 ``workspace``: "
    "``sparse_attn_score_recompute_workspace_bytes``."),
    Float("softmax_scale", positive=True))

sparse_indexer_score_recompute, sparse_indexer_score_recompute_into, SparseIndexerScoreRecompute = SPARSE_INDEXER.forms(globals())
sparse_attn_score_recompute, sparse_attn_score_recompute_into, SparseAttnScoreRecompute = SPARSE_ATTN.forms(globals())


# --- the dense wrappers: dense_indexer_ / dense_attn_score_recompute_wrapper --------------------------------

_NEG_INF = 0xFF800000  # fp32 -inf: what a key the ratio-causal rule hides holds in ``out``


_DENSE_TENSORS = ("out", "denom_out", "q", "k", "weights", "cu_seqlens_q", "cu_seqlens_k", "q_causal_offsets", "workspace")
_SCALES = ("q_scale", "k_scale", "cu_seqlens_q_scale_padded", "cu_seqlens_k_scale_padded")  # a block-scaled call's, after _DENSE_TENSORS
_DENSE_INDEXER = _Kind("dense_indexer_score_recompute", _DENSE_TENSORS + _SCALES, "bfloat16", 2, (policy.DIM,), precisions=policy.DENSE_PRECISIONS)
_DENSE_ATTENTION = _Kind("dense_attn_score_recompute", _DENSE_TENSORS[:4] + ("lse",) + _DENSE_TENSORS[5:] + _SCALES, "float32", 4, policy.ATTN_DIMS,
                         precisions=policy.ATTN_PRECISIONS)
_QK_DTYPES = {"bf16": "bfloat16", "mxfp8": "float8_e4m3fn", "mxfp4": "float4_e2m1fn_x2"}  # Q / K as each precision stores them


def dense_indexer_score_recompute_workspace_bytes(weights_shape, device=None, cu_seqlens_q=None, cu_seqlens_k=None) -> int:
    """uint8 bytes the ``workspace`` of a dense indexer call with ``weights`` of this shape needs on GPU
    ``device`` (None: the current one); none on SM100. SM90 BSHD, weights (B, S_q, H): their transposed
    bf16 copy. SM90 THD, weights (T_q, H) and the call's ``cu_seqlens_q`` / ``cu_seqlens_k`` (on the host:
    CPU tensors or lists; device ones are read back): per segment the transposed copy and the scores and
    denominators the kernel writes before they are copied into the packed outputs, as upstream allocates
    them."""
    return _workspace_bytes(_INDEXER, weights_shape, device, cu_seqlens_q, cu_seqlens_k)


def dense_attn_score_recompute_workspace_bytes(lse_shape, device=None, cu_seqlens_q=None, cu_seqlens_k=None) -> int:
    """uint8 bytes the ``workspace`` of a dense attention call with ``lse`` of this shape needs on GPU
    ``device`` (None: the current one): as :func:`dense_indexer_score_recompute_workspace_bytes`, with the
    fp32 LSE in place of the weights."""
    return _workspace_bytes(_ATTENTION, lse_shape, device, cu_seqlens_q, cu_seqlens_k)


def _dense_first(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, precision, host=None, *, q, stream, sf_vec_size=REQUIRED):
    """Both forms' first step, before their caches: ``precision`` as upstream compares it (lower case); an SM90 bf16 THD
    call's segment bounds on the host (``host``; its ``cu_seqlens`` then None), since its kernel runs once per segment:
    ``cu_seqlens_*`` given on the host as they are, device ones read back (upstream's sync; refused under capture). The
    allocating form's (the one that passes ``sf_vec_size``) reads missing SM100 THD maxima back from ``cu_seqlens`` as upstream does (a
    synchronisation: refused under capture). A block-scaled SM90 call is left for the validation to refuse, unread."""
    allocating = sf_vec_size is not REQUIRED
    if allocating and not (type(sf_vec_size) is int and sf_vec_size == policy.SF_VEC):  # (keyed before the validation runs)
        raise input_error([f"sf_vec_size={sf_vec_size!r}: upstream's {policy.SF_VEC} only (values per e8m0 scale)"])
    precision = _lower(precision)
    thd = cu_seqlens_q is not None or cu_seqlens_k is not None
    arch, sm100 = arch_or_refuse([], q.device.index) if thd and getattr(q, "is_cuda", False) else (None, False)
    if arch is not None and not sm100 and precision == "bf16":
        problems = []
        host = _host_offsets(problems, cu_seqlens_q, cu_seqlens_k, q.device.index, stream)
        if problems:
            raise input_error(problems)
        return None, None, max_seqlen_q, max_seqlen_k, precision, host
    if thd and allocating and sm100 and (max_seqlen_q is None or max_seqlen_k is None):
        max_seqlen_q, max_seqlen_k = max_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, stream)
    return cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, precision, host


def _host_offsets(problems, cu_q, cu_k, dev, stream):
    """(cu_seqlens_q, cu_seqlens_k) as tuples of ints: from lists / tuples / 1-D integer CPU tensors, or
    1-D int32 tensors on GPU ``dev`` read back (a synchronisation, refused under graph capture). None with
    ``problems`` appended for anything else."""
    import torch

    got = []
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        what = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        if isinstance(t, torch.Tensor) and t.ndim == 1 and t.dtype in (torch.int32, torch.int64) and t.device.index in (None, dev):
            if t.is_cuda and torch.cuda.is_current_stream_capturing():
                problems.append(f"{name} on the device under CUDA-graph capture: SM90 THD launches the BSHD kernel per segment, so the "
                                "segment bounds must be known on the host; pass cu_seqlens_q / cu_seqlens_k as CPU tensors or lists "
                                "(the sync-free form)")
                continue
            with alloc_on(stream, dev) if t.is_cuda else contextlib.nullcontext():
                t = t.tolist()  # a device tensor: upstream's read back (a synchronisation)
        if not isinstance(t, (list, tuple)) or not t or not all(type(v) is int for v in t):
            problems.append(f"{name}: {what} (THD on SM90 needs batch + 1 integer offsets: a 1-D CPU tensor or list, or int32 on cuda:{dev}, "
                            "read back)")
            continue
        got.append(tuple(t))
    return tuple(got) if len(got) == 2 else None


def _lower(precision):
    """``precision`` as upstream compares it (lower case). Anything but a string is refused here, at once: it
    keys the call caches before the validation runs, and a list or a dict there is a bare TypeError."""
    if not isinstance(precision, str):
        raise input_error([f"precision={precision!r} (expected a string: 'bf16', or on SM100 'mxfp8' / 'mxfp4')"])
    return precision.lower()


def _dense_plan(kind):
    def plan(rec, c):
        ts = tuple(getattr(c, n) for n in kind.tensors)
        out, aux = ts[0], ts[4]
        if c.varlen and not c.sm100:
            _record_sm90_thd(rec, kind, ts, c)
        elif c.kernel is not None:
            op, key = c.kernel
            if op.endswith("_sm90"):
                rec.first(_transposed(4, 8, kind.aux_dtype, c.dev, [(None, 0, aux.shape)]))
            if key.get("precision") == "mxfp8" and op == "dense_attention":
                # upstream zeroes out (the kernel accumulates into it and writes -inf where the causal rule hides a key) and, for
                # the kernels that accumulate into denom too, denom (it zeroes out twice there: once is the same)
                rec.memset(rec.p[0], out.numel() * 4)
                if policy.mx_zeroes_denom(key["dim"], key["heads"]):
                    rec.memset(rec.p[1], ts[1].numel() * 4)
            else:
                # upstream fills out with -inf before the kernel, which skips the K blocks the causal rule hides
                rec.memset(rec.p[0], out.numel() * 4, _NEG_INF)
            rec.launch(c.entry["main"], *_dense_launch_args(op, ts, c, rec.p, rec.s, c.kx))
        elif ts[1].numel():
            # queries and no key (S_k 0): nothing to launch, and each row gets what the kernel writes for a row
            # that sees no key, the LSE of none (-inf) or the sum of none (0), not the caller's old bytes
            rec.memset(rec.p[1], ts[1].numel() * 4, _NEG_INF if kind is _DENSE_INDEXER else 0)

    return plan



def _record_sm90_thd(rec, kind, ts, c):
    """Upstream's SM90 THD host loop as one plan, from host segment bounds: every segment's weights / LSE
    transposed into its workspace region; ``out`` filled with -inf and so is each segment's scores
    region (the BSHD call's fill); the denominators of rows whose segment has no key written as the
    kernel writes a row that sees none (upstream leaves them unwritten); one BSHD launch per segment
    into its regions; the regions copied into the packed outputs."""
    import torch

    out, _, q, k, _, _, _, offs, _ = ts[:9]
    p = rec.p
    h, d, h_kv = q.shape[1], q.shape[2], k.shape[1]
    segs, regions, dev = c.segs, c.regions, c.dev

    def copy_back(ts, stream):
        with alloc_on(stream, dev):
            ws = ts[8]
            for (_, qs, sq, _, sk), (_, oo, do) in zip(segs, regions):
                ts[0][qs:qs + sq, :sk].copy_(ws[oo:oo + sq * sk * 4].view(torch.float32).view(sq, sk))
                ts[1][qs:qs + sq].copy_(ws[do:do + sq * 4].view(torch.float32))

    if segs:
        rec.first(_transposed(4, 8, kind.aux_dtype, dev, [(slice(qs, qs + sq), wo, (sq, h)) for (_, qs, sq, _, _), (wo, _, _) in zip(segs, regions)]))
    rec.memset(p[0], out.numel() * 4, _NEG_INF)
    for qs, sq in c.no_keys:  # the LSE of no key is -inf, the attention's sum of none 0
        rec.memset(p[1] + qs * 4, sq * 4, _NEG_INF if kind is _DENSE_INDEXER else 0)
    for (_, _, sq, _, sk), (_, oo, _) in zip(segs, regions):
        rec.memset(p[8] + oo, sq * sk * 4, _NEG_INF)
    entry = c.entry.get("main")
    for (b, qs, sq, ks, sk), (wo, oo, do) in zip(segs, regions):
        rec.launch(entry, *_sm90_dense_args(p[2] + qs * h * d * 2, p[3] + ks * h_kv * d * 2, p[8] + oo, p[8] + wo, p[8] + do,
                                            None if offs is None else p[7] + 4 * b, 1, sq, sk, h, h_kv, d, rec.s, c.kx))
    if segs:
        rec.then(copy_back)


def _dense_launch_args(op, ts, c, p, s, x=()) -> tuple:
    """The host-function arguments of dense entry ``op`` in upstream's order (``x``: the scale as the kernel
    reads it: the call's ``c.kx``)."""
    _, _, q, k, aux, _, _, offs, _ = ts[:9]
    if not op.endswith("_sm90"):
        # SM100: q, k, w / lse, [q_scale, k_scale], out, denom, scale, max_seqlen_q, max_seqlen_k, [cu_seqlens_q, cu_seqlens_k,
        # [their scale-padded twins]], [offsets], stream; block-scaled when the call has scales (the validation ties them to the precision)
        mx = (9, 10) if len(ts) > 9 and ts[9] is not None else ()
        ta = lambda *ix: tuple(a for i in ix for a in tensor_args(ts[i], p[i]))  # noqa: E731
        cu = ta(5, 6, *(i + 2 for i in mx)) if c.varlen else ()
        return (*ta(2, 3, 4, *mx, 0, 1), x[0], c.s_q, c.s_k, *cu, *(ta(7) if offs is not None else ()), s)
    b, s_q, h = aux.shape
    return _sm90_dense_args(p[2], p[3], p[0], p[8], p[1], None if offs is None else p[7], b, s_q, k.shape[1], h, k.shape[2], q.shape[3], s, x)


def _sm90_dense_args(q, k, out, aux_t, denom, offs, b, s_q, s_k, h, h_kv, d, s, x) -> tuple:
    """The SM90 dense host function's arguments, compact BSHD buffers at these pointers: q, kv, (no ids),
    stream, out, the weights / LSE transposed (B, H, S_q), (no lengths), denom, [offsets], then the
    attention's softmax_scale_log2 (the spec's LITERALS)."""
    o = flat_args(offs, (b,)) if offs is not None else ()
    return (*flat_args(q, (b, s_q, h, d)), *flat_args(k, (b, s_k, h_kv, d)), s, *flat_args(out, (b, s_q, s_k)), *flat_args(aux_t, (b, h, s_q)),
            *flat_args(denom, (b, s_q)), *o, *x)


def _varlen(c):  # THD: cu_seqlens given (an SM90 bf16 call's as host bounds, ``c.host``)
    return c.cu_seqlens_q is not None or c.cu_seqlens_k is not None or c.host is not None


def _layout(bshd, thd):  # a dense tensor's declared shape: its BSHD or THD one
    return lambda c: thd if _varlen(c) else bshd


def _dense_sizes(c, problems):
    """The call's batch, S_q and S_k and its outputs' shapes, once its inputs passed (the outputs are checked against them):
    BSHD q / k's; THD the maxima and batch + 1 ``cu_seqlens``; SM90 THD the host bounds ``c.host``, their segments (those
    with queries and keys) and the rows with no key, the maxima by default the longest segments."""
    sym, c.varlen, c.segs, c.no_keys = c.sym, _varlen(c), (), ()
    c.lead = (sym["T_q"],) if c.varlen else (sym["B"], sym["S_q"])
    maxima = (("max_seqlen_q", c.max_seqlen_q), ("max_seqlen_k", c.max_seqlen_k))
    if not c.varlen:
        c.b, c.s_q, c.s_k = sym["B"], sym["S_q"], sym["S_k"]
        problems += [f"{n}={v!r}: only with cu_seqlens_q / cu_seqlens_k (THD)" for n, v in maxima if v is not None]
    elif c.host is not None:
        (cu_q, cu_k), c.b, n = c.host, len(c.host[0]) - 1, len(problems)  # (problems: a CPU tensor's, whose shapes still bind)
        if len(cu_k) != len(cu_q):
            problems.append(f"cu_seqlens_q ({len(cu_q)} offsets) and cu_seqlens_k ({len(cu_k)}): the same number, batch + 1")
        for name, cu, total in (("cu_seqlens_q", cu_q, sym["T_q"]), ("cu_seqlens_k", cu_k, sym["T_k"])):
            if cu[0] < 0 or any(y < x for x, y in zip(cu, cu[1:])) or cu[-1] > total:
                problems.append(f"{name} = {list(cu)[:8]}{'...' if len(cu) > 8 else ''}: expected non-decreasing offsets from >= 0 to at most "
                                f"{total} (the packed {name[-1]} rows)")
        if len(problems) > n:
            return
        longest = [max((y - x for x, y in zip(cu, cu[1:])), default=0) for cu in (cu_q, cu_k)]
        c.s_q, c.s_k = (n if v is None else v for (_, v), n in zip(maxima, longest))
        problems += [f"{name}={v!r}: expected an integer from {n} (the longest segment) to {_I32 - 1}" for (name, v), n in zip(maxima, longest)
                     if v is not None and v < n]
        c.segs = policy.thd_segments(cu_q, cu_k)
        c.no_keys = tuple((cu_q[i], cu_q[i + 1] - cu_q[i]) for i in range(c.b) if cu_q[i + 1] > cu_q[i] and cu_k[i + 1] == cu_k[i])
    else:
        c.b, c.s_q, c.s_k = sym.get("B1", 0) - 1, c.max_seqlen_q, c.max_seqlen_k
        if c.cu_seqlens_q is None or c.cu_seqlens_k is None or c.b < 0:
            problems.append("cu_seqlens_q / cu_seqlens_k: THD needs both, 1-D int32 CUDA tensors of batch + 1 offsets")
        problems += [f"{n}: THD needs max_seqlen_q and max_seqlen_k (the longest segments; nothing is read back from the device)"
                     for n, v in maxima if v is None]
    if c.q_causal_offsets is not None and sym["B"] != c.b:  # (THD: the offsets bind B)
        problems.append(f"q_causal_offsets: {sym['B']} offsets for a batch of {c.b} (expected one per sequence)")
    c.score = (*c.lead, c.s_k if isinstance(c.s_k, int) else 0) if c.varlen else (c.b, c.s_q, c.s_k)


def _dense_rules(kind):
    """The dense ``kind``'s (early rules, rules). The early ones are reported with the options' and tensors' problems (they
    fix nothing here): precision against the scales, the arch and q / k's dtype; the head dim and heads. The rules, once
    those passed: THD in a plan, the block scales, int32 extents; the scale as the kernel reads it (``c.kx``), the entry
    (``c.kernel``), the workspace (``c.ws``; SM90 THD per segment, ``c.regions``)."""
    attention = kind is _DENSE_ATTENTION
    what, scale = f"the block-scaled dense {'attention' if attention else 'indexer'}", "softmax_scale" if attention else "sm_scale"

    def early(c, problems):
        import torch

        prec = c.precision.lower() if isinstance(c.precision, str) else None
        mx, scales = prec in policy.MX_PRECISIONS, [n for n in _SCALES if getattr(c, n) is not None]
        if scales and prec == "bf16":
            problems.append(f"{', '.join(scales)}: block scales go with precision={' or '.join(map(repr, kind.precisions[1:]))} (this call's is "
                            "'bf16'; upstream's ValueError)")
        if mx and c.dev is not None and not arch_or_refuse([], c.dev)[1]:
            problems.append(f"precision={prec!r}: {what} is SM100 only (upstream raises NotImplementedError on SM90, which takes bf16)")
        for name, t in (("q", c.q), ("k", c.k)):
            if prec in _QK_DTYPES and isinstance(t, torch.Tensor) and t.dtype != getattr(torch, _QK_DTYPES[prec]):
                problems.append(f"{name}: dtype {t.dtype} (precision={prec!r} takes torch.{_QK_DTYPES[prec]})")
        (h, h_kv, d), dims = (c.sym.get(n) for n in ("H", "H_kv", "D")), policy.MX_ATTN_DIMS if attention and mx else kind.dims
        if d is not None and prec == "mxfp4" and d != policy.DIM // 2:
            problems.append(f"q / k last dim {d} (mxfp4 stores D {policy.DIM} as {policy.DIM // 2} float4_e2m1fn_x2 elements, two values each)")
        elif d is not None and prec in kind.precisions and prec != "mxfp4" and d not in dims:
            problems.append(f"D={d} (expected {' or '.join(map(str, dims))})")
        if h is None or h_kv is None:
            return
        if not h_kv or h % h_kv or h <= h_kv:
            problems.append(f"H={h} over H_kv={h_kv}: the kernels need H a multiple of H_kv and more query heads than KV heads")
        elif c.qhead_per_kv_head is not None and c.qhead_per_kv_head != h // h_kv:
            problems.append(f"qhead_per_kv_head={c.qhead_per_kv_head!r}: must equal H / H_kv = {h // h_kv}")
        elif mx and (h_kv != 1 or h not in policy.mx_heads(attention)):
            problems.append(f"H={h} over H_kv={h_kv}: {what} takes one KV head and {' or '.join(map(str, policy.mx_heads(attention)))} q heads "
                            "(upstream's ValueError; the attention's H32 does not compile)")

    def rules(c, problems):
        q, prec, offs = c.q, c.precision.lower(), c.q_causal_offsets
        (h, d, h_kv), mx = (c.sym[n] for n in ("H", "D", "H_kv")), prec in policy.MX_PRECISIONS
        c.arch, c.sm100 = arch, sm100 = arch_or_refuse(problems, c.dev)
        c.kernel, c.ws, c.regions, c.kx = None, 0, (), ()
        if c.varlen and arch is not None and not sm100 and c.host is None and not mx:
            problems.append(f"THD on SM90 in a plan: as upstream's plan classes, none runs it (the kernel is BSHD-native: each call needs the "
                            f"segment bounds on the host); call dsa_aot.dsa.{kind.name}_into with cu_seqlens_q / cu_seqlens_k as CPU tensors or "
                            "lists")
        if mx:  # the scales' columns follow the logical head dim (mxfp4 stores two values an element)
            block_scales(problems, prec, c.varlen, c.b, c.s_q, c.s_k, h, c.dev, *(getattr(c, n) for n in _SCALES), dim=2 * d if prec == "mxfp4" else d)
        rows = q.numel() // (h * d) if h and d else 0
        int32_extents(problems, ("q elements", q.numel()), ("k elements", c.k.numel()), ("rows*S_k", rows * c.s_k))
        if problems:
            return
        # the scale as the kernel reads it: SM100 an argument; SM90 attention f32(scale * log2 e), the host code's literal; SM90
        # indexer none (a float32 immediate in the cubin: part of the key)
        x32 = float(getattr(c, scale))
        c.kx = (x32,) if sm100 else (scalar_f32(problems, "softmax_scale * log2(e)", x32 * _LOG2_E),) if attention else ()
        if attention:  # the K block is upstream's pick from the S_k hint: max_seqlen_k (THD), S_k (BSHD)
            ks = policy.dense_attention_kernels(arch, h // h_kv, d, c.ratio, c.varlen, offs is not None, prec, c.s_k)
        else:
            ks = policy.dense_indexer_kernels(arch, h // h_kv, c.ratio, c.varlen, offs is not None, x32, prec)
        require(FAMILY, ks, c.dev)  # the entry ships, before anything is allocated or written (an empty call too)
        c.kernel = ks["main"] if (c.segs if c.host is not None else rows and c.s_k and c.s_q and c.b) else None
        if c.host is not None:
            c.regions, c.ws = policy.thd_workspace(c.segs, h, kind.aux_bytes)
        elif not sm100:
            c.ws = policy.workspace_bytes(arch, c.b, c.s_q, h, elem_bytes=kind.aux_bytes)

    return early, rules


def _f_dense(q, k, aux, scale=None, ratio=1, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, *_, **__):
    """Both dense torch ops' fake (their schemas agree up to here: q, k, weights / lse, the scale, ratio, THD)."""
    import torch

    thd = cu_seqlens_q is not None
    if thd and max_seqlen_k is None:
        raise input_error(["max_seqlen_k: the torch op needs it for THD (the output's width)"])
    rows = (q.shape[0],) if thd else tuple(q.shape[:2])
    return q.new_empty((*rows, max_seqlen_k if thd else k.shape[1]), dtype=torch.float32), q.new_empty(rows, dtype=torch.float32)


def _dense(kind, plan_class, note, scale):
    """The declaration of a dense wrapper (``scale``: its sm_scale / softmax_scale option), cudnn's signatures."""
    aux, sc, d = kind.tensors[4], scale.name, "=1.0" if scale.default is not REQUIRED else ""
    early, rules = _dense_rules(kind)
    scales = "q_scale=None, k_scale=None, cu_seqlens_q_scale_padded=None, cu_seqlens_k_scale_padded=None"
    thd = "cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None"
    return Op(
        FAMILY, kind.name, plan_class=plan_class, note=note,
        into=f"out, denom_out, q, k, {aux}, {sc}{d}, ratio=1, {thd}, stream=None, *, workspace=None, qhead_per_kv_head=None, precision='bf16', "
             f"{scales}",
        alloc=f"q, k, {aux}, " + (f"{sc}, qhead_per_kv_head=None, out=None, denom_out=None, " if not d else  # (cudnn's orders)
                                  f"qhead_per_kv_head=None, out=None, denom_out=None, {sc}{d}, ")
              + f"ratio=1, {thd}, precision='bf16', {scales}, sf_vec_size=32, stream=None, *, workspace=None",
        plan_args=f"out, denom_out, q, k, {aux}, cu_seqlens_q=None, cu_seqlens_k=None, q_causal_offsets=None, workspace=None, {scales}, *, "
                  f"{sc}{d}, ratio=1, max_seqlen_q=None, max_seqlen_k=None, qhead_per_kv_head=None, precision='bf16'",
        tensors=(Out("out", "float32", lambda c: c.score, given=True), Out("denom_out", "float32", lambda c: c.lead, given=True, returns="denom"),
                 In("q", _QK_DTYPES.values(), _layout(("B", "S_q", "H", "D"), ("T_q", "H", "D"))),
                 In("k", _QK_DTYPES.values(), _layout(("B", "S_k", "H_kv", "D"), ("T_k", "H_kv", "D"))), In(aux, kind.aux_dtype, _layout(("B", "S_q", "H"), ("T_q", "H"))),
                 *(In(n, "int32", ("B1",), optional=True) for n in ("cu_seqlens_q", "cu_seqlens_k")),
                 In("q_causal_offsets", "int32", ("B",), optional=True, align=lambda c: 16 if arch_or_refuse([], c.dev)[1] else 4),
                 Workspace("workspace", lambda c: c.ws, f"dsa_aot.dsa.{kind.name}_workspace_bytes", align=lambda c: 16 if c.ws else 1,
                           given=True),
                 *(In(n, "float8_e8m0fnu", None, optional=True) for n in _SCALES[:2]), *(In(n, "int32", None, optional=True) for n in _SCALES[2:])),
        options=(scale, Int("ratio", 1, _I32 - 1, 1), Int("max_seqlen_q", 0, _I32 - 1, None), Int("max_seqlen_k", 0, _I32 - 1, None),
                 Int("qhead_per_kv_head", 1, _I32 - 1, None, torch=False), Hidden("host"), OneOf("precision", kind.precisions, "bf16", fold=str.lower),
                 OneOf("sf_vec_size", (policy.SF_VEC,), policy.SF_VEC, alloc_only=True, torch=False)),
        torch_order=(None, f"out, denom_out, q, k, {aux}, {sc}, ratio, {thd.replace('=None', '')}, precision, "
                           f"{scales.replace('=None', '')}, workspace"),
        early_rules=early, symbols=_dense_sizes, rules=rules, plan=_dense_plan(kind),
        entries=lambda c: {"main": c.kernel} if c.kernel is not None else {},
        into_first=_dense_first, alloc_first=_dense_first, fake=_f_dense,
    )  # fmt: skip


DENSE_INDEXER = _dense(_DENSE_INDEXER, "DenseIndexerScoreRecompute", (
    "The indexer's logits ``out[b, i, j] = sm_scale * sum_h w[b, i, h] relu(q[b, i, h] . k[b, j, h // qhpkv])`` over every key, -inf "
    "where the ratio-causal rule hides key j from row i (``j >= (offset_b + i + 1) // ratio``), and ``denom`` their log-sum-exp per row "
    "(-inf for a row that sees no key). BSHD: q (B, S_q, H, 128), k (B, S_k, H_kv, 128), weights (B, S_q, H) bf16; ``out`` (B, S_q, "
    "S_k), ``denom`` (B, S_q) fp32. THD (``cu_seqlens_q`` / ``cu_seqlens_k``): (T_q, ...) rows, ``out`` (T_q, max_seqlen_k); on SM90 "
    "one launch per segment, sync-free and capture-safe with ``cu_seqlens`` on the host. On SM90 ``sm_scale`` is compiled in (the "
    "manifest lists the scales). ``precision`` \"mxfp8\" / \"mxfp4\" (SM100) take e8m0 scales in upstream's packed layout. "
    "docs/ops.md has the whole contract."), Float("sm_scale", 1.0))
DENSE_ATTN = _dense(_DENSE_ATTENTION, "DenseAttnScoreRecompute", (
    "The attention's probabilities summed over heads, ``out[b, i, j] = sum_h exp(softmax_scale q[b, i, h] . k[b, j, h // qhpkv] - "
    "lse[b, i, h])`` for every key the ratio-causal rule shows row i, -inf where it hides one, and ``denom`` their sum per row (``out`` "
    "is not divided by it). Layouts as ``dense_indexer_score_recompute``'s with ``lse`` (B, S_q, H) / (T_q, H) fp32 in place of the "
    "weights and D 512 or 576; any ``softmax_scale`` > 0; ``precision`` \"mxfp8\" on SM100 (D512 / D128). docs/ops.md has the whole "
    "contract."), Float("softmax_scale", positive=True))

dense_indexer_score_recompute, dense_indexer_score_recompute_into, DenseIndexerScoreRecompute = DENSE_INDEXER.forms(globals())
dense_attn_score_recompute, dense_attn_score_recompute_into, DenseAttnScoreRecompute = DENSE_ATTN.forms(globals())
# --- cudnn.DSA.sparse_attention_score_recompute (deepseek_sparse_attention/training.py) ----------------

_TOPK_TILE = 128  # upstream pads the index rows with -1 to a multiple of 128 slots


def sparse_attention_score_recompute(q, kv, lse, indices, softmax_scale=None, topk_length=None):
    """cudnn's ``DSA.sparse_attention_score_recompute`` (training.py): the attention's target distribution
    over each query's index slots, in the training layout. Returns ``{'target', 'indices'}``: ``target``
    (S_q, K) fp32, L1-normalised over the row's valid slots, 0 elsewhere, no gradient attached (as
    upstream); ``indices`` the slots as scored, ids outside [0, S_kv) and slots at or past
    ``clamp(topk_length, 0, K)`` set to -1 (positions unchanged, no compaction).

    q (S_q, H, D) bf16, kv (S_kv, D) bf16, lse (S_q, H) fp32 (the forward's natural-log ``lse``), indices
    (S_q, K) int32 ids into kv, topk_length (S_q,) int32 or None; contiguous, one device, no empty extent;
    ``softmax_scale`` > 0 (default 1/sqrt(D)). Run as upstream runs it: rows padded with -1 to 128 slots, one
    batch of :func:`sparse_attn_score_recompute`, on torch's current stream; wherever the build has the entry
    (upstream: capability 10.0 only), a missing one refused before any work, naming the bucket to add.
    """
    import torch
    import torch.nn.functional as F

    problems = []
    dev, h, d, k, scale = _training_checks(problems, q, kv, lse, indices, softmax_scale, topk_length)
    padded = -(-k // _TOPK_TILE) * _TOPK_TILE
    arch = None if problems else arch_or_refuse(problems, dev)[0]
    if problems:
        raise input_error(problems)
    require(FAMILY, policy.kernels(arch, h, padded, False, False, d), dev)
    s_kv = kv.shape[0]
    with alloc_on(None, dev):  # torch's current stream of the tensors' device (upstream: torch.cuda.device(q.device))
        valid = (indices >= 0) & (indices < s_kv)
        if topk_length is not None:
            slots = torch.arange(k, dtype=torch.int32, device=indices.device)
            valid &= slots[None, :] < topk_length.clamp(0, k)[:, None]
        safe = torch.where(valid, indices, -1)
        ids = F.pad(safe, (0, padded - k), value=-1) if padded != k else safe
        target = sparse_attn_score_recompute(q[None], kv[None], lse[None], ids[None], scale)["target"][0]
        target = target[:, :k].contiguous() if padded != k else target
    return Outputs(target=target, indices=safe)


def _training_checks(problems, q, kv, lse, indices, softmax_scale, topk_length):
    """Upstream's training contract (training._validate_contract and its lse check) as problems:
    (device, H, D, K, scale); the kernels' own limits are the score recompute's, checked when it runs."""
    import torch

    ts = {"q": (q, 3, torch.bfloat16), "kv": (kv, 2, torch.bfloat16), "lse": (lse, 2, torch.float32), "indices": (indices, 2, torch.int32),
          "topk_length": (topk_length, 1, torch.int32)}
    for name, (t, rank, _) in ts.items():
        if (t is not None or name != "topk_length") and (not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type != "cuda"
                                                         or t.ndim != rank):
            problems.append(f"{name}: expected a {rank}-D CUDA tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if problems:
        return None, 0, 0, 0, 0.0
    (s_q, h, d), k = q.shape, indices.shape[1]
    shapes = {"q": (s_q, h, d), "kv": (kv.shape[0], d), "lse": (s_q, h), "indices": (s_q, k), "topk_length": (s_q,)}
    for name, (t, _, dtype) in ts.items():
        if t is not None:
            check(problems, t, name, shapes[name], dtype, q.device.index, 16 if name in ("q", "kv") else 4)
    if not (s_q and kv.shape[0] and k):
        problems.append(f"S_q = {s_q}, S_kv = {kv.shape[0]}, K = {k} (expected each >= 1, as upstream)")
    scale = scalar_f32(problems, "softmax_scale", d**-0.5 if softmax_scale is None else softmax_scale, positive=True)
    return q.device.index, h, d, k, scale


# --- torch.library (dsa_aot.library registers these as torch.ops.dsa_aot.<name>) -------------------------


def _t_training(q, kv, lse, indices, softmax_scale=None, topk_length=None):
    return tuple(sparse_attention_score_recompute(q, kv, lse, indices, softmax_scale, topk_length).values())  # (target, indices)


def _f_training(q, kv, lse, indices, softmax_scale=None, topk_length=None):
    import torch

    return indices.new_empty(indices.shape, dtype=torch.float32), indices.new_empty(indices.shape)


_TRAINING = "(Tensor q, Tensor kv, Tensor lse, Tensor indices, float? softmax_scale=None, Tensor? topk_length=None) -> (Tensor, Tensor)"
TORCH_OPS = {"dsa_sparse_attention_score_recompute": (_TRAINING, _t_training, _f_training)}  # (the declared ops: dsa_aot.ops.library)
