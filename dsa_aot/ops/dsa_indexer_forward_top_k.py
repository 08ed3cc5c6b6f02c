"""Fused DSA indexer forward + top-k (cudnn's indexer_forward_top_k_wrapper, SM100), from shipped cubins.

One call runs the compressed-logits GEMM (the ratio-causal scores each query row sees, written
compactly into a candidate buffer), stage 2 (the top-k of each row's candidates, their logits and
softmax) and, for global ids, local-to-global in place. bf16 BSHD calls from S_q 32768 run as
upstream's windows (a GEMM and a stage 2 per window, on views of the window's rows). Stage 2 and
local-to-global also ship for SM90, where ``_tail_into`` runs them (the tests' only GPU path).

The candidate buffer holds, for query row r of batch b, the ``(off_b + r + 1) // ratio`` compressed
scores that row sees (clamped to S_k), rows back to back: row r of batch b at ``base_b + G(off_b +
r) - G(off_b)`` with ``G(n) = sum_{i<n} (i + 1) // ratio`` (:func:`dsa_aot.policy.dsa_indexer_forward_top_k.cand_floats`);
``base_b = b * G(S_q)`` without causal offsets, else the int64 prefix sums ``cand_batch_offsets``.

The ``_into`` form, capture-safe from the first call (nothing is read back from the device): BSHD ``indices`` /
``logits`` / ``softmax`` (B, S_q, top_k; ``softmax`` None for none), ``lse`` (B, S_q) or None, ``cand_buffer`` of
at least :func:`compress_topk_cand_buffer_size` floats; with ``q_causal_offsets`` also ``cand_batch_offsets`` ((B + 1,)
int64 prefix sums, upstream's capture-safe contract). bf16 calls from S_q 32768 run in upstream's windows
(``microbatch_rows``: -1 upstream's choice, 0 one launch, > 0 that many rows; a windowed shape's first call allocates
its plan's small offset table). THD (``cu_seqlens_q`` / ``cu_seqlens_k``, ``max_seqlen_q`` / ``max_seqlen_k``):
outputs (total_q, top_k) and (total_q,), ``cand_buffer`` and ``cand_batch_offsets`` from
:func:`compress_topk_cand_buffer_size_thd`; global ids are ``cu_seqlens_k[b] + local``.

The allocating form returns ``{'indices', 'logits', 'softmax'}`` by default, without ``softmax`` when
``return_softmax=False``, plus ``'lse'`` with ``return_lse`` / ``lse_out``. What is not given is made as upstream
makes it, on the launch stream: the outputs, the candidate buffer (sized by host arithmetic; with causal offsets or
in THD from the device values: one synchronisation), the batch offsets (on the device) and, in THD, the longest
segments (``.max().item()``: a synchronisation). Under graph capture every value that needs a synchronisation must be
given, as upstream requires; InputError otherwise. Strided inputs are copied first; an output that cannot be bound as
it is is filled through one of the op's own and copied back. The tuning arguments take upstream's defaults only.
"""

from __future__ import annotations

import itertools

from ..policy.families import FAMILIES
from ..policy import dsa_indexer_forward_top_k as policy
from ..policy.dsa_indexer_forward import MAX_RATIO, SM100_PRECISIONS
from .args import tensor_args
from .checks import aliasing, check, input_error, integer, one_of
from .gpu import launcher, max_lengths, stream_handle
from .declare import Flag, Float, In, Int, OneOf, Op, Out

FAMILY = policy.FAMILY
__all__ = list(FAMILIES[FAMILY].exports)  # the registry lists them: dsa_aot.<namespace> imports this module for them
_I32 = 2**31 - 1
HELPERS = ("compress_topk_cand_buffer_size", "compress_topk_cand_buffer_size_thd", "cand_batch_offsets")  # sizes, not ops



def compress_topk_cand_buffer_size(bs, seqlen_q, seqlen_k, ratio, microbatch_rows=-1, return_lse=False, q_causal_offsets=None, precision="bf16"):
    """fp32 elements of the candidate buffer of a BSHD call (cudnn's compress_topk_cand_buffer_size):
    ``bs * G(S_q)`` for one launch, ``bs * max_window G`` when the call runs in windows (pass the
    launch's ``microbatch_rows``, ``return_lse`` and ``precision``: they decide that). With
    ``q_causal_offsets`` the exact per-batch sum, read back from the device (a synchronisation, as
    upstream's). What the launch would refuse is refused here."""
    problems = []
    for name, v, lo in (("bs", bs, 0), ("seqlen_q", seqlen_q, 0), ("seqlen_k", seqlen_k, 0), ("ratio", ratio, 1)):
        integer(problems, name, v, lo, _I32)
    one_of(problems, "precision", precision, ("bf16", "mxfp8", "mxfp4"))
    if not problems and seqlen_q > seqlen_k * ratio + ratio - 1:
        problems.append(f"seqlen_q ({seqlen_q}) must be <= seqlen_k * ratio + (ratio - 1) ({seqlen_k * ratio + ratio - 1})")
    if q_causal_offsets is not None:
        _offsets_arg(problems, q_causal_offsets, bs)
    mb = 0 if problems else _microbatch(problems, microbatch_rows, precision, bool(return_lse), q_causal_offsets is not None, seqlen_q, bs, ratio)
    if problems:
        raise input_error(problems)
    if q_causal_offsets is not None:
        return int(_slabs(seqlen_q, ratio, q_causal_offsets)[-1].item())  # upstream's .item(): a device sync
    return bs * _slab_floats(seqlen_q, seqlen_k, ratio, mb)


def _slab_floats(s_q, s_k, ratio, mb) -> int:
    """Floats of one batch's slab: G(S_q), or the largest window's when the call runs in windows of ``mb`` rows."""
    if not mb:
        return policy.cand_floats(s_q, ratio)
    return max(policy.cand_floats(rs + n, ratio) - policy.cand_floats(rs, ratio) for rs, n, _ in windows(s_q, s_k, ratio, mb))


def _slabs(s_q, ratio, offsets):
    """int64 (B + 1,) prefix sums of G(off_b + s_q_b) - G(off_b) on the device (no sync): ``s_q`` a number
    (BSHD: ``offsets`` given) or a (B,) int64 tensor of segment lengths (THD: ``offsets`` None for zeros)."""
    import torch

    def g(n):
        q_ = torch.div(n, ratio, rounding_mode="floor")
        return ratio * q_ * (q_ - 1) // 2 + q_ * (n - q_ * ratio + 1)

    if offsets is None:
        off = torch.zeros_like(s_q)
    else:
        off = offsets.to(torch.int64)
    out = torch.zeros(off.shape[0] + 1, dtype=torch.int64, device=off.device)
    torch.cumsum(g(off + s_q) - g(off), dim=0, out=out[1:])
    return out


def cand_batch_offsets(bs, seqlen_q, ratio, q_causal_offsets):
    """The BSHD batch bases a call with ``q_causal_offsets`` takes (upstream's _bshd_cand_batch_offsets):
    int64 (bs + 1,), computed on the device without a synchronisation (capture-safe)."""
    problems = []
    for name, v, lo in (("bs", bs, 0), ("seqlen_q", seqlen_q, 0), ("ratio", ratio, 1)):
        integer(problems, name, v, lo, _I32)
    _offsets_arg(problems, q_causal_offsets, bs)
    if problems:
        raise input_error(problems)
    return _slabs(seqlen_q, ratio, q_causal_offsets)


def _offsets_arg(problems, t, bs, device=None):
    import torch

    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.ndim != 1 or (bs is not None and t.shape[0] != bs) or not t.is_cuda \
            or (device is not None and t.device != device):
        problems.append(f"q_causal_offsets: expected a 1-D int32 CUDA tensor of {bs} offsets{f' on {device}' if device else ''}, got "
                        f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


def compress_topk_cand_buffer_size_thd(cu_seqlens_q, cu_seqlens_k, ratio, q_causal_offsets=None):
    """(cand_batch_offsets, total_floats) of a THD call (cudnn's compress_topk_cand_buffer_size_thd): the
    int64 (B + 1,) slab bases, computed on the device, and their total, read back with one
    synchronisation. Feed both to :func:`indexer_forward_top_k_into` (or the allocating op) to make the
    THD call capture-safe."""
    import torch

    problems = []
    ok = all(isinstance(t, torch.Tensor) and t.ndim == 1 and t.dtype == torch.int32 and t.is_cuda for t in (cu_seqlens_q, cu_seqlens_k))
    if not ok or cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 2 or cu_seqlens_q.device != cu_seqlens_k.device:
        problems.append("cu_seqlens_q / cu_seqlens_k: 1-D int32 CUDA tensors of equal length batch + 1 >= 2 on one device")
    integer(problems, "ratio", ratio, 1, _I32)
    if q_causal_offsets is not None and not problems:
        _offsets_arg(problems, q_causal_offsets, cu_seqlens_q.shape[0] - 1, cu_seqlens_q.device)
    if problems:
        raise input_error(problems)
    cbo = _slabs(cu_seqlens_q.to(torch.int64).diff(), ratio, q_causal_offsets)
    return cbo, int(cbo[-1].item())  # upstream's .item(): a device sync


def _record_stage2(rec, le, cand, outs, s_q, s_k, cbo, qco, cu=()):
    """Stage 2's launch in upstream's order (compress_stage2_topk(_varlen)'s cute.compile calls): cand,
    indices, logits, S_q, S_k, the stream, [cu_seqlens_q, cu_seqlens_k], [batch offsets], [causal
    offsets], [softmax]. Tensors in :func:`tensor_args` form: ``cand`` (pointer, extent), ``outs``
    (indices, logits, softmax or None)."""
    idx, val, sm = outs
    rec.launch(le, *cand, *idx, *val, s_q, s_k, rec.s, *_flat((*cu, cbo, qco, sm)))


def _flat(ts) -> list:
    """The arguments of tensors in :func:`tensor_args` form, None (absent) left out."""
    return [a for t in ts if t is not None for a in t]


def _stage2_key(top_k, ratio, rows, s_k, offsets, softmax, deterministic, varlen) -> dict:
    """Stage 2's entry: block threads from the rows (B * S_q, or total_q) and S_k (THD: the longest), upstream's rule."""
    return {"top_k": top_k, "ratio": ratio, "threads": policy.stage2_threads(rows, s_k), "offsets": bool(offsets), "softmax": softmax,
            "deterministic": bool(deterministic), "varlen": varlen}


def _record_l2g(rec, dev, idx, s_k, cu) -> None:
    """Local-to-global in place on the indices (``idx`` in tensor_args form), -1 padding kept (upstream's
    preserve_negative form): BSHD adds b * S_k, THD (``cu``: the cu_seqlens args) cu_seqlens_k[b]."""
    from ..policy import dsa_topk_utils as l2g_policy

    lkey = l2g_policy.local_to_global_kernel("int32", bool(cu), True)
    rec.launch(launcher("dsa_topk_utils", *lkey, dev), *idx, *idx, 0 if cu else s_k, *[a for t in cu for a in t], rec.s)


def _stage2_outs(pairs, varlen, top_k) -> list:
    """Stage 2's output arguments from (tensor or None, pointer) pairs: BSHD as the tensors are; THD as the
    (total_q, 1, top_k) views upstream binds."""
    return [None if t is None else (pt, t.shape[0], 1, top_k, top_k, top_k) if varlen else tensor_args(t, pt) for t, pt in pairs]


def _tail_plan(rec, c):
    """The fused call's tail alone, stage 2 and local-to-global, over a caller's candidate buffer (BSHD: outputs (B, S_q,
    top_k); THD with ``cu_seqlens_q`` / ``cu_seqlens_k``: (total_q, top_k), ``s_q`` / ``s_k`` the longest segments)."""
    p, vl, rows = c.p, c.cu_seqlens_q is not None, tuple(c.indices.shape[:-1])
    if rows[0] and (vl or rows[1]):
        key = _stage2_key(c.top_k, c.ratio, rows[0] if vl else rows[0] * rows[1], c.s_k, c.q_causal_offsets is not None, c.softmax is not None,
                          c.deterministic, vl)
        cu = [tensor_args(c.cu_seqlens_q, p.cu_seqlens_q), tensor_args(c.cu_seqlens_k, p.cu_seqlens_k)] if vl else []
        outs = _stage2_outs(((c.indices, p.indices), (c.logits, p.logits), (c.softmax, p.softmax)), vl, c.top_k)
        opt = [tensor_args(t, pt) if t is not None else None for t, pt in ((c.cand_batch_offsets, p.cand_batch_offsets),
                                                                            (c.q_causal_offsets, p.q_causal_offsets))]
        _record_stage2(rec, launcher(FAMILY, "stage2", key, c.dev), (p.cand, c.cand.shape[0]), outs, c.s_q, c.s_k, *opt, cu)
        if c.topk_indices_global:
            _record_l2g(rec, c.dev, tensor_args(c.indices, p.indices), c.s_k, cu)


def _tail_rules(c, problems):
    vl = c.cu_seqlens_q is not None
    if not vl and (c.cand_batch_offsets is None) != (c.q_causal_offsets is None):
        problems.append("cand_batch_offsets and q_causal_offsets: both or neither in BSHD")
    if vl and c.cand_batch_offsets is None:
        problems.append("cand_batch_offsets: THD needs them (compress_topk_cand_buffer_size_thd)")
    if vl != (c.cu_seqlens_k is not None):
        problems.append("cu_seqlens_q and cu_seqlens_k: both or neither")
    if "B" in c.sym and "B1" in c.sym and c.sym["B1"] != c.sym["B"] + 1:
        problems.append(f"cu_seqlens / cand_batch_offsets: {c.sym['B1']} offsets for a batch of {c.sym['B']} (expected batch + 1)")
    if c.cand.shape[0] > _I32 and not vl:
        problems.append(f"cand_buffer: {c.cand.shape[0]} floats (the BSHD kernels take an int32 extent)")


def _rows_of(c):  # the outputs' rows: (B, S_q) with the call's s_q, or THD's packed (total_q,)
    return ("T", "top_k") if c.cu_seqlens_q is not None else ("B", "s_q", "top_k")


TAIL = Op(
    FAMILY, "_tail", plan_class=None, alloc=None, plan=_tail_plan, rules=_tail_rules,
    into="indices, logits, softmax, cand, s_q, s_k, top_k, ratio, cand_batch_offsets=None, q_causal_offsets=None, cu_seqlens_q=None, "
         "cu_seqlens_k=None, deterministic=False, topk_indices_global=False, stream=None",
    tensors=(Out("indices", "int32", _rows_of, align=lambda c: 16 if c.topk_indices_global else 4), Out("logits", "float32", _rows_of, align=4),
             Out("softmax", "float32", _rows_of, align=4, optional=True), In("cand", "float32", ("n_cand",)),
             In("cand_batch_offsets", "int64", ("B1",), optional=True), In("q_causal_offsets", "int32", ("B",), optional=True),
             In("cu_seqlens_q", "int32", ("B1",), optional=True), In("cu_seqlens_k", "int32", ("B1",), optional=True)),
    options=(Int("s_q", 0, _I32), Int("s_k", 0, _I32), Int("top_k", 1, policy.MAX_TOP_K), Int("ratio", 1, MAX_RATIO),
             Flag("deterministic", False), Flag("topk_indices_global", False)),
    note="The fused call's tail alone (stage 2, then local-to-global in place): what an SM90 GPU can run of this family.",
)  # fmt: skip
_tail_into = TAIL.forms(globals())[1]


# --- the fused call, BSHD: GEMM -> stage 2 (one pair per window) -> local-to-global in place ---


def _rows(t, ptr, rs, n):
    """:func:`tensor_args` of the view ``t[:, rs:rs + n]`` of a (B, S, ...) tensor: the rows of one window."""
    return (ptr + rs * t.stride(1) * t.element_size(), t.shape[0], n, *t.shape[2:], *t.stride()[:-1])


def _record_gemm(rec, le, q, k, w, scales, cand, lse, s_q, s_k, cu, qco, cbo):
    """The compressed GEMM's launch in upstream's order (_compressed_top_k_sm100's cute.compile calls):
    q, k, w, [q_scale, k_scale], the candidate buffer, [lse], the scale, S_q, S_k (THD: the longest
    segments), [cu_seqlens_q, cu_seqlens_k (mx: and their scale-padded twins)], [causal offsets], the
    stream, [batch offsets]. Each tensor argument in :func:`tensor_args` form (or None); ``cu`` a list."""
    rec.launch(le, *q, *k, *w, *_flat(scales or ()), *cand, *_flat((lse,)), rec.x[0], s_q, s_k, *_flat(cu), *_flat((qco,)), rec.s, *_flat((cbo,)))


def _fill_words(rec, ptr: int, words) -> None:
    """Record memsets that write ``words`` (32-bit values) at ``ptr``, one per run of equal words: every
    byte gets its final value directly, so a call on another stream reading the same table never sees
    a half-written one."""
    i = 0
    for w, run in itertools.groupby(words):
        n = len(list(run))
        rec.memset(ptr + 4 * i, 4 * n, w & 0xFFFFFFFF)
        i += n


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


def _check(c, problems):
    """Every check of a call of either form (``c.allocating``: the allocating one's, before anything is made; its inputs
    are staged, so their layout is not checked), option and tensor problems together."""
    import torch

    from . import dsa_indexer_forward as fwd

    a = c.allocating
    if a:
        vl = c.cu_seqlens_q is not None or c.cu_seqlens_k is not None
        given = [v if v is not None or not vl else 0 for v in (c.max_seqlen_q, c.max_seqlen_k)]  # worked out by the prelude when not given
        tuning = {n: getattr(c, n) for n in ("m_block_size", "n_block_size", "q_stage", "kv_stage")}
        f = fwd.check_inputs(problems, c.q, c.k, c.w, c.ratio, c.qhead_per_kv_head, c.cu_seqlens_q, c.cu_seqlens_k, *given, c.q_causal_offsets,
                             c.precision, c.q_scale, c.k_scale, c.cu_seqlens_q_scale_padded, c.cu_seqlens_k_scale_padded, staged=True, tuning=tuning)
        if not (type(c.sf_vec_size) is int and c.sf_vec_size == 32):
            problems.append(f"sf_vec_size={c.sf_vec_size!r} (the block-scaled kernels take 32)")
        if c.return_softmax not in (None, True, False):
            problems.append(f"return_softmax={c.return_softmax!r} (expected None, True or False)")
    else:
        f = fwd.check_inputs(problems, c.q, c.k, c.w, c.ratio, None, c.cu_seqlens_q, c.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k,
                             c.q_causal_offsets, c.precision, c.q_scale, c.k_scale, c.cu_seqlens_q_scale_padded, c.cu_seqlens_k_scale_padded)
    if f is not None and not f.sm100:
        problems.append(f"cuda:{f.dev} runs {f.arch}: cudnn's fused indexer forward + top-k exists for SM100 only" + (" (upstream raises too)" if a else ""))
    FUSED.check_options(c.__dict__, problems, ("sm_scale", "top_k", "topk_indices_global", "deterministic"))  # (check_inputs: the rest)
    c.f, c.dev = f, f and f.dev
    if problems or a:
        return
    b, s_q, s_k, vl, ratio, cand = f.b, f.s_q, f.s_k, f.varlen, c.ratio, c.cand_buffer
    c.offs = offs = c.q_causal_offsets is not None
    if vl and s_q > s_k * ratio + ratio - 1:
        problems.append(f"max_seqlen_q {s_q} > max_seqlen_k * ratio + ratio - 1 = {s_k * ratio + ratio - 1} (upstream refuses this geometry)")
    mb = 0 if vl else _microbatch(problems, c.microbatch_rows, c.precision, c.lse is not None, offs, s_q, b, ratio)
    c.wins = windows(s_q, s_k, ratio, mb) if mb else None
    c.pbf = _slab_floats(s_q, s_k, ratio, mb)
    c.cand_2d = not vl and not offs and not c.wins and policy.uses_cand_2d(c.precision, s_q, ratio)
    c.rows = rows = (c.q.shape[0],) if vl else (b, s_q)
    for name, t, dt in (("indices", c.indices, torch.int32), ("logits", c.logits, torch.float32), ("softmax", c.softmax, torch.float32)):
        if t is not None or name != "softmax":
            check(problems, t, name, rows + (c.top_k,), dt, f.dev, 16 if name == "indices" and c.topk_indices_global else 4)
    if c.lse is not None:
        check(problems, c.lse, "lse", rows, torch.float32, f.dev, 16)
    need = None if offs or vl else b * c.pbf  # the size needs the offsets' or the segments' values: the caller's (upstream trusts it too)
    how = "compress_topk_cand_buffer_size_thd(...)" if vl else "compress_topk_cand_buffer_size(...)"
    if not isinstance(cand, torch.Tensor) or cand.ndim != 1:
        problems.append(f"cand_buffer: expected a 1-D fp32 tensor of at least {need or how} floats")
    else:
        check(problems, cand, "cand_buffer", cand.shape, torch.float32, f.dev, 16)
        if need is not None and cand.shape[0] < need:
            problems.append(f"cand_buffer: {cand.shape[0]} floats, the call needs {need} (compress_topk_cand_buffer_size)")
        if cand.shape[0] > _I32 and not vl:
            problems.append(f"cand_buffer: {cand.shape[0]} floats (upstream's BSHD kernels take an int32 extent)")
    if offs or vl:
        check(problems, c.cand_batch_offsets, "cand_batch_offsets", (b + 1,), torch.int64, f.dev, 16)
    elif c.cand_batch_offsets is not None:
        problems.append("cand_batch_offsets: only with q_causal_offsets or THD (the batch bases are b * G(S_q) otherwise)")
    if not problems:
        problems += aliasing([(n, getattr(c, n)) for n in FUSED.names[:5]], [(n, getattr(c, n)) for n in FUSED.names[5:]])


def _plan(rec, c):
    """The fused call's launches (a validated ``_into`` call ``c``): GEMM, stage 2 (one pair per window), local-to-global."""
    f, p, top_k, wins = c.f, c.p, c.top_k, c.wins
    b, s_q, s_k, vl, offs = f.b, f.s_q, f.s_k, f.varlen, c.offs
    q, k, w, lse, cand = c.q, c.k, c.w, c.lse, (p.cand_buffer, c.cand_buffer.shape[0])
    if not (c.rows[0] and (vl or (s_q and s_k))):
        return
    cbo_kind = offs or wins or vl
    gkey = {"precision": c.precision, "w_dtype": f.w_dtype, "heads": f.h, "ratio": c.ratio, "lse": lse is not None,
            "cand": "1d_cbo" if cbo_kind else "2d" if c.cand_2d else "1d", "varlen": vl, "offsets": bool(offs or wins)}
    skey = _stage2_key(top_k, c.ratio, c.rows[0] * (1 if vl else s_q), s_k, offs or wins, c.softmax is not None, c.deterministic, vl)
    gemm, stage2 = launcher(FAMILY, "gemm", gkey, f.dev), launcher(FAMILY, "stage2", skey, f.dev)
    scales = None if c.q_scale is None else (tensor_args(c.q_scale, p.q_scale), tensor_args(c.k_scale, p.k_scale))
    outs = ((c.indices, p.indices), (c.logits, p.logits), (c.softmax, p.softmax))
    cu = [tensor_args(c.cu_seqlens_q, p.cu_seqlens_q), tensor_args(c.cu_seqlens_k, p.cu_seqlens_k)] if vl else []
    if wins:
        # Each window is the causal-offsets kernel pair on views of the rows it covers (upstream's loop): offsets rs for every
        # batch, batch slabs b * pbf (pbf: the largest window's, so one table serves every window and the buffer is
        # compress_topk_cand_buffer_size's). The tables live in the plan and are written by its memsets on each call.
        row = (b * 4 + 15) // 16 * 16
        c.keep = (_table((2 * (b + 1) * 4 + 15) // 16 * 16 + len(wins) * row, q.device),)
        base = c.keep[0].data_ptr()
        _fill_words(rec, base, [w_ for i in range(b + 1) for w_ in (i * c.pbf, 0)])
        cbo = (base, b + 1)
        qco0 = base + (2 * (b + 1) * 4 + 15) // 16 * 16
        for j, (rs, _, _) in enumerate(wins):
            _fill_words(rec, qco0 + j * row, [rs] * b)
        for j, (rs, n, kw) in enumerate(wins):
            qco = (qco0 + j * row, b)
            _record_gemm(rec, gemm, _rows(q, p.q, rs, n), _rows(k, p.k, 0, kw), _rows(w, p.w, rs, n), None, cand, None, n, kw, (), qco, cbo)
            _record_stage2(rec, stage2, cand, [_rows(t, pt, rs, n) if t is not None else None for t, pt in outs], n, kw, cbo, qco)
    else:
        qco = tensor_args(c.q_causal_offsets, p.q_causal_offsets) if offs else None
        cbo = tensor_args(c.cand_batch_offsets, p.cand_batch_offsets) if cbo_kind else None
        gcu = cu + ([tensor_args(c.cu_seqlens_q_scale_padded, p.cu_seqlens_q_scale_padded),
                     tensor_args(c.cu_seqlens_k_scale_padded, p.cu_seqlens_k_scale_padded)] if vl and scales else [])
        _record_gemm(rec, gemm, tensor_args(q, p.q), tensor_args(k, p.k), tensor_args(w, p.w), scales, (p.cand_buffer, b, c.pbf, c.pbf) if c.cand_2d
                     else cand, tensor_args(lse, p.lse) if lse is not None else None, s_q, s_k, gcu, qco, cbo)
        _record_stage2(rec, stage2, cand, _stage2_outs(outs, vl, top_k), s_q, s_k, cbo, qco, cu)
    if c.topk_indices_global:
        _record_l2g(rec, f.dev, tensor_args(c.indices, p.indices), s_k, cu)


def _alloc(c, stream) -> dict:
    """The allocating form's ``_into`` call (a validated allocating call ``c``): the capture refusals, then what is not
    given made on the launch stream (see the module docstring); ``c.back``: the given outputs copied into afterwards."""
    import torch

    from .gpu import alloc_on, allocate

    f, vl, ratio = c.f, c.f.varlen, c.ratio
    s = stream_handle(stream, f.dev)
    max_q, max_k, cbo, cand = c.max_seqlen_q, c.max_seqlen_k, c.cand_batch_offsets, c.cand_buffer
    need_sync = []
    if vl and (max_q is None or max_k is None):
        need_sync.append("max_seqlen_q and max_seqlen_k")
    if cand is None and (vl or c.q_causal_offsets is not None):
        need_sync.append("cand_buffer (and cand_batch_offsets) sized by compress_topk_cand_buffer_size" + ("_thd" if vl else ""))
    want_sm = c.return_softmax is not False or c.softmax_out is not None
    want_lse = bool(c.return_lse) or c.lse_out is not None
    given = {"indices": (c.out_indices, True), "logits": (c.out_logits, True), "softmax": (c.softmax_out, want_sm), "lse": (c.lse_out, want_lse)}
    if torch.cuda.is_current_stream_capturing():
        need_sync += [f"{n} (allocating it mid-capture)" for n, (t, want) in zip(("out_indices", "out_logits", "softmax_out", "lse_out"), given.values())
                      if want and t is None and vl]
        if need_sync:
            raise input_error([f"under CUDA-graph capture pass {n}: working it out needs a device synchronisation or allocation (upstream "
                               f"requires them too)" for n in need_sync])
    a = {"stream": s}
    with alloc_on(stream, f.dev):
        a |= {n: allocate(lambda n=n: FUSED.stage(n, getattr(c, n), stream, c)) for n in ("q", "k", "w", "q_scale", "k_scale")}  # as upstream's
        if vl and (max_q is None or max_k is None):
            max_q, max_k = max_lengths(c.cu_seqlens_q, c.cu_seqlens_k, max_q, max_k, stream)
        if (vl or c.q_causal_offsets is not None) and cbo is None:  # on the device, no sync
            cbo = allocate(lambda: _slabs(c.cu_seqlens_q.to(torch.int64).diff() if vl else f.s_q, ratio, c.q_causal_offsets))
        if cand is None:
            if cbo is not None:
                n = int(cbo[-1].item())  # upstream's .item(): a device sync
            else:
                n = compress_topk_cand_buffer_size(f.b, f.s_q, f.s_k, ratio, c.microbatch_rows, want_lse, None, c.precision)
            cand = allocate(lambda: torch.empty(n, dtype=torch.float32, device=c.q.device))
        c.back = {}
        for name, (t, want) in given.items():
            out = FUSED.tensor(name)
            shape, (dtype,) = out.shape_of(c), out.dtype_of(c)  # as declared: (B, S_q, top_k) or (T, top_k)
            if want and (t is None or (isinstance(t, torch.Tensor) and tuple(t.shape) == shape and t.dtype == dtype and t.device == c.q.device
                                       and not (t.is_contiguous() and t.data_ptr() % 16 == 0))):
                if t is not None:  # one the kernels cannot bind as it is: filled through one of the op's own, copied back
                    c.back[name] = t
                t = allocate(lambda: torch.empty(shape, dtype=dtype, device=c.q.device))
            a[name] = t if want else None
    return a | {"max_seqlen_q": max_q, "max_seqlen_k": max_k, "cand_batch_offsets": cbo, "cand_buffer": cand}


def _lead(c) -> tuple:
    return tuple(c.q.shape[:-2])  # (B, S_q) or THD's (total_q,)


FUSED = Op(
    FAMILY, "indexer_forward_top_k", plan_class="IndexerForwardTopK",
    into="indices, logits, softmax, lse, cand_buffer, q, k, w, top_k, ratio=4, sm_scale=1.0, stream=None, q_causal_offsets=None, "
         "cand_batch_offsets=None, precision='bf16', q_scale=None, k_scale=None, topk_indices_global=True, deterministic=False, microbatch_rows=-1, *, "
         "cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, cu_seqlens_q_scale_padded=None, cu_seqlens_k_scale_padded=None",
    alloc="q, k, w, top_k, ratio=4, qhead_per_kv_head=None, m_block_size=128, n_block_size=128, q_stage=2, kv_stage=4, sm_scale=1.0, stream=None, "
          "cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None, precision='bf16', q_scale=None, "
          "k_scale=None, cu_seqlens_q_scale_padded=None, cu_seqlens_k_scale_padded=None, sf_vec_size=32, return_lse=False, lse_out=None, "
          "return_softmax=None, softmax_out=None, microbatch_rows=-1, topk_indices_global=True, cand_buffer=None, out_indices=None, out_logits=None, "
          "cand_batch_offsets=None, deterministic=False",
    tensors=(
        Out("indices", "int32", lambda c: _lead(c) + (c.top_k,), align=lambda c: 16 if c.topk_indices_global else 4),
        Out("logits", "float32", lambda c: _lead(c) + (c.top_k,), align=4),
        Out("softmax", "float32", lambda c: _lead(c) + (c.top_k,), align=4, when="return_softmax"),
        Out("lse", "float32", _lead, when="return_lse"),
        Out("cand_buffer", "float32", None, returns=False, given=True),
        In("q", ("bfloat16", "float8_e4m3fn", "float4_e2m1fn_x2"), None), In("k", ("bfloat16", "float8_e4m3fn", "float4_e2m1fn_x2"), None),
        In("w", ("bfloat16", "float32"), None), In("q_scale", ("float32", "uint8"), None, optional=True),
        In("k_scale", ("float32", "uint8"), None, optional=True), In("q_causal_offsets", "int32", None, optional=True),
        In("cand_batch_offsets", "int64", None, optional=True, given=True), In("cu_seqlens_q", "int32", None, optional=True),
        In("cu_seqlens_k", "int32", None, optional=True), In("cu_seqlens_q_scale_padded", "int32", None, optional=True),
        In("cu_seqlens_k_scale_padded", "int32", None, optional=True),
    ),
    options=(
        Int("top_k", 1, policy.MAX_TOP_K), Int("ratio", 1, MAX_RATIO, 4), Float("sm_scale", 1.0, per_call=True),
        OneOf("precision", SM100_PRECISIONS, "bf16"), Flag("topk_indices_global", True), Flag("deterministic", False),
        Int("microbatch_rows", -1, _I32, -1), Int("max_seqlen_q", 0, _I32, None), Int("max_seqlen_k", 0, _I32, None),
        Flag("return_lse", False, alloc_only=True), Flag("return_softmax", None, alloc_only=True, torch_default=True),
    ),
    check=_check, plan=_plan, alloc_prelude=_alloc, into_returns=("indices", "logits", "softmax", "lse"),
    note="Returns (indices, logits, softmax, lse) / the dict of those made (see the module's docstring).",
)  # fmt: skip

indexer_forward_top_k, indexer_forward_top_k_into, IndexerForwardTopK = FUSED.forms(globals())
_TENSORS = FUSED.names  # the plan's tensors in p[i] order (ci/check_sm100_calls.py records the GEMM with them)
