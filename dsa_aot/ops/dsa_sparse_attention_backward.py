"""DSA sparse attention backward op: cudnn's ``sparse_attention_backward_wrapper``, launched from shipped cubins.

SM100: one artifact per call whose host function launches every kernel (the generic M64, H16/H32/H96,
H128 two-CTA, D576 two-CTA and deterministic / row-relay classes, picked from the shapes as upstream's
plan does). SM90: the preprocess -> main -> postprocess pipeline. The dispatch and the workspace
layouts are :mod:`dsa_aot.policy.dsa_sparse_attention_backward`, checked against cudnn on every build.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..errors import InputError
from ..policy import dsa_sparse_attention_backward as policy
from ..policy._math import prod, round_up
from ..policy.arch import is_sm100
from ._support import (aliasing, alloc_on, allocate, arch_of, check, cute_args, flag, flat_args, footprint, input_error, integer, launcher, one_of,
                       require, scalar_f32, sm_count_of, stream_handle, tensor_args, workspace_problems, writes_only)
from .outputs import Outputs
from .plan import ALLOC, Plan, Recorder, cached, compile_call, probe_for, remember, remembered

__all__ = ["sparse_attention_backward", "sparse_attention_backward_into", "sparse_attention_backward_workspace_bytes", "SparseAttentionBackward"]

FAMILY = policy.FAMILY
HEAD_DIM_V = policy.HEAD_DIM_V
_I32 = 2**31


def sparse_attention_backward_workspace_bytes(total_s_q, total_s_kv, head_dim, num_heads, *, arch="sm_90a", topk=None, deterministic=False) -> int:
    """cudnn's ``SparseAttentionBackward.scratch_workspace_bytes()``: uint8 bytes ``workspace=`` must hold.

    SM90: dPsum and log2-scaled LSE (each S_q rounded to 64 x H fp32) and the fp32 dKV accumulator
    (S_kv rounded to 64 x D rounded to 32), each chunk 128-byte aligned. SM100 (pass ``topk=``, the
    index row width: it selects the backend): the LSE/OdO and dKV workspaces of that backend.
    """
    problems = []
    for name, v, lo, hi in (("total_s_q", total_s_q, 0, _I32 - 1), ("total_s_kv", total_s_kv, 0, _I32 - 1), ("head_dim", head_dim, 1, 1024),
                            ("num_heads", num_heads, 1, 1024)):
        integer(problems, name, v, lo, hi)
    one_of(problems, "arch", arch, ("sm_90a", "sm_100a", "sm_103a", "sm_100f"))
    if topk is not None:
        integer(problems, "topk", topk, 1, 1 << 20)
    deterministic = flag(problems, "deterministic", deterministic)
    if problems:
        raise input_error(problems)
    if is_sm100(arch) and topk is None:
        raise InputError("sparse_attention_backward_workspace_bytes: pass topk= (the index row width) for an SM100 arch: it selects the backend")
    return policy.workspace_bytes(total_s_q, total_s_kv, head_dim, num_heads, arch=arch, topk=topk, deterministic=deterministic)


@dataclass(frozen=True)
class _Call:
    """What validating one call proved: device, arch, extents, the workspace bytes it needs, the entries
    that serve it, and what recheck() needs (byte sizes, alignment masks: lse 4 on SM90, 8 on SM100;
    workspace 32 for the deterministic D576 layout)."""

    dev: int
    arch: str
    s_q: int
    s_kv: int
    h: int
    d: int
    topk: int
    need: int
    kernels: dict
    foot: list  # for recheck()


def sparse_attention_backward(q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None, topk_length=None, dq=None, dkv=None,
                              block_tile=64, deterministic=False, stream=None, workspace=None, q_cluster_mode="off"):
    """cudnn's ``sparse_attention_backward_wrapper``: returns ``{'dq', 'dkv', 'd_sink'}``.

    ``q`` (S_q, H, D) bf16, ``kv`` (S_kv, D) (K = V, one KV head; D 576 = QK dim, the first 512
    columns are V), ``out``/``dout`` (S_q, H, 512), ``lse`` (S_q, H) fp32 (KV-only LSE), ``attn_sink``
    (H,) fp32, ``topk_idxs`` (S_q, topk) int32 global KV ids (ids outside [0, S_kv) are ignored),
    ``topk_length`` (S_q,) int32 optional valid prefix. ``dq``/``dkv`` and ``workspace`` are
    allocated on the launch stream when omitted; ``d_sink`` is always a new (H,) fp32 tensor, as
    upstream. Pass the outputs and workspace to ``sparse_attention_backward_into`` to capture it.
    """
    import torch

    # allocate what is missing once everything given is known to be valid (the allocated outputs and
    # workspace are checked after)
    ins = (dq, dkv, None, q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, workspace)  # d_sink is always allocated
    extra = (block_tile, deterministic, q_cluster_mode)
    hit = remembered(_CALLS, ALLOC, ins, extra)  # the same options, tensors like the last validated call's, pointers that pass
    call = hit and hit[0]
    if call is not None:  # and the scale passes its per-call check
        try:
            _scalars_of(call.d)(softmax_scale=softmax_scale)
        except InputError:
            call = None
    if call is None:
        call = _validate(dq, dkv, None, q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, softmax_scale, block_tile, deterministic,
                         workspace, q_cluster_mode, allocating=True)
        remember(_CALLS, ALLOC, extra, probe_for(ins, call.dev, call.foot), call)
    dev = call.dev
    stream_handle(stream, dev)  # refuse a bad stream before allocating on it (the _into call checks the rest, the scale and pointers)

    def outputs():
        with alloc_on(stream, dev):
            return (torch.empty_like(q) if dq is None else dq, torch.empty_like(kv) if dkv is None else dkv, torch.empty_like(attn_sink),
                    torch.empty(call.need, dtype=torch.uint8, device=q.device) if workspace is None else workspace)

    dq, dkv, d_sink, workspace = allocate(outputs)
    sparse_attention_backward_into(dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale, topk_length, block_tile,
                                   deterministic, stream, workspace, q_cluster_mode)
    return Outputs(dq=dq, dkv=dkv, d_sink=d_sink)


def sparse_attention_backward_into(dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None, topk_length=None,
                                   block_tile=64, deterministic=False, stream=None, workspace=None, q_cluster_mode="off"):
    """``sparse_attention_backward`` into caller-provided ``dq``, ``dkv``, ``d_sink`` and ``workspace``
    (capture-safe from the first call, see dsa_aot.runtime; allocates nothing). Returns (dq, dkv, d_sink)."""
    ts = (dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, workspace)
    # the signature proves every check but the per-call ones: the scale's value (below), pointer
    # alignment and the outputs and workspace overlapping anything (recheck), the stream
    call, p = cached(_CALLS, ts, (block_tile, deterministic, q_cluster_mode),
                     lambda: _plan_backward(*ts[:10], softmax_scale, topk_length, block_tile, deterministic, workspace, q_cluster_mode))
    call.run(p, stream_handle(stream, call.dev), call.scalars(softmax_scale=softmax_scale), ts, stream)
    return dq, dkv, d_sink


def _scalars_of(d: int):
    def scalars(softmax_scale=None):
        if softmax_scale is None:
            return (1.0 / math.sqrt(d),)
        if type(softmax_scale) is float and -3.4028234663852886e38 <= softmax_scale <= 3.4028234663852886e38:
            return (softmax_scale,)
        problems = []
        v = scalar_f32(problems, "softmax_scale", softmax_scale)
        if problems:
            raise input_error(problems)
        return (v,)

    return scalars


def _plan_backward(dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None, topk_length=None, block_tile=64,
                   deterministic=False, workspace=None, q_cluster_mode="off"):
    """Validate a sparse attention backward call and compile what it does (:class:`dsa_aot.ops.plan.Call`)."""
    call = _validate(dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, softmax_scale, block_tile, deterministic,
                     workspace, q_cluster_mode)
    dev, s_q, s_kv, h, d, topk, ks = call.dev, call.s_q, call.s_kv, call.h, call.d, call.topk, call.kernels
    ts = (dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, workspace)
    scalars = _scalars_of(d)
    x = scalars(softmax_scale=softmax_scale)
    defaults = functools.partial(scalars, softmax_scale=softmax_scale)  # a plan's execute may override it
    rec = Recorder(len(ts), 1)
    P, s, scale = rec.p, rec.s, rec.x[0]
    if s_q == 0:  # no query: nothing flows back
        def zero(ts, stream):
            with alloc_on(stream, dev):
                ts[1].zero_()
                ts[2].zero_()

        rec.then(zero)
    elif "bwd" in ks:
        _sm100_call(rec, ks["bwd"], dev, s_q, s_kv, h, d, topk, topk_length is not None)
    else:
        pre, main, post = (launcher(FAMILY, *ks[r], dev) for r in ("pre", "main", "post"))
        sqr, skr, dr = round_up(s_q, policy.SM90_TILE_M), round_up(s_kv, policy.SM90_TILE_N), round_up(d, policy.SM90_DIM_MULTIPLE)
        stats = round_up(sqr * h * 4, policy.WS_ALIGN)
        ws = P[11]
        dpsum, lse_log2, acc = flat_args(ws, (1, sqr, h)), flat_args(ws + stats, (1, sqr, h)), ws + 2 * stats
        acc3 = flat_args(acc, (1, 1, skr * dr))
        o4, do4 = tensor_args(out.unsqueeze(0), P[5]), tensor_args(dout.unsqueeze(0), P[6])
        tl = tensor_args(topk_length.unsqueeze(0), P[10]) if topk_length is not None else ()
        # upstream's order: clear the dKV accumulator and d_sink (both are atomically accumulated)
        rec.memset(acc, skr * dr * 4)
        rec.memset(P[2], h * 4)
        rec.launch(pre, *o4, *do4, *dpsum, *tensor_args(lse.unsqueeze(0), P[7]), *lse_log2, *tensor_args(attn_sink, P[8]), *tensor_args(d_sink, P[2]), s)
        rec.launch(main, *tensor_args(q.unsqueeze(0), P[3]), *tensor_args(kv.unsqueeze(0).unsqueeze(2), P[4]), *do4, *lse_log2, *dpsum,
                   *tensor_args(dq.unsqueeze(0), P[0]), *acc3, *tensor_args(topk_idxs.unsqueeze(0), P[9]), *tl, scale, s)
        rec.launch(post, *acc3, *tensor_args(dkv.unsqueeze(0).unsqueeze(2), P[1]), s_kv, s)
    return compile_call("dsa_sparse_attention_backward", rec, dev, ts, call.foot, x, defaults)


def _sm100_call(rec, op_key, dev, s_q, s_kv, h, d, topk, has_topk_length):
    """One SM100 call: upstream's d_sink clear where its kernels accumulate into it, then the one
    artifact whose host function launches every kernel (zero-init, sum_OdO, backward, convert,
    sum_dSink, shard fold) on stream ``s``."""
    op, key = op_key
    P, s, scale = rec.p, rec.s, rec.x[0]
    fn = launcher(FAMILY, op, key, dev)
    det, wide = key["deterministic"], key["wide"]
    dv = HEAD_DIM_V
    c = lambda ptr, shape, dyn: cute_args(ptr, shape, tuple(range(len(shape))) if wide else dyn, wide)  # noqa: E731
    tensors = [
        c(P[3], (s_q, h, d), (0,)), c(P[4], (s_kv, d), (0,)), c(P[5], (s_q, h, dv), (0,)), c(P[6], (s_q, h, dv), (0,)), c(P[7], (s_q, h), (0,)),
        c(P[8], (h,), ()), cute_args(P[9], (s_q, topk), (0,), wide),  # topk is a static extent even when wide
    ]  # fmt: skip
    if has_topk_length:
        tensors.append(c(P[10], (s_q,), (0,)))
    tensors += [c(P[0], (s_q, h, d), (0,)), c(P[1], (s_kv, d), (0,)), c(P[2], (h,), ())]
    backend = policy.select_backend(h, d, "bf16", topk, det)[0]
    lse_shape, dkv_shape = policy.sm100_workspace_shapes(s_q, s_kv, d, h, det, backend)
    ws = P[11]
    ws_dkv = ws + round_up(prod(lse_shape), policy.WS_ALIGN)
    problem = (s_q, s_kv, d, h, 1)
    if op == "bwd_d576":
        # flat byte workspaces; split_count is a run-time argument (1 when deterministic)
        split = 1 if det else policy.d576_split_count(s_q, topk, sm_count_of(dev))
        flat = ((ws, prod(lse_shape)), (ws_dkv, prod(dkv_shape)))
        rec.launch(fn, *problem, *(a for t in tensors for a in t), *(a for t in flat for a in t), scale, split, s)
        return
    if backend != "h128_2cta_m64" and not det:
        rec.memset(P[2], h * 4)  # ordinary sum_dSink accumulates atomically
    rec.launch(fn, *problem, *(a for t in tensors for a in t), *c(ws, lse_shape, (2,)), *c(ws_dkv, dkv_shape, (2,)), scale, s)


class SparseAttentionBackward(Plan):
    """cudnn's SparseAttentionBackward shape: ``SparseAttentionBackward(dq, dkv, d_sink, q, kv, out, dout,
    lse, attn_sink, topk_idxs, softmax_scale=None, topk_length=None, block_tile=64, deterministic=False,
    workspace=None, q_cluster_mode="off")``; ``execute(dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink,
    topk_idxs, topk_length=None, workspace=None, stream=None, softmax_scale=...)`` (see :class:`dsa_aot.ops.plan.Plan`)."""

    _build = staticmethod(_plan_backward)
    _tensors = ("dq", "dkv", "d_sink", "q", "kv", "out", "dout", "lse", "attn_sink", "topk_idxs", "topk_length", "workspace")
    _scalars = ("softmax_scale",)


# signature (types, shapes, dtypes, devices, layouts, contiguity, options) -> the compiled Call
_CALLS: dict = {}


def _validate(dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, softmax_scale, block_tile, deterministic, workspace,
              q_cluster_mode, allocating=False):
    """Every problem with the inputs, raised together before anything is launched or written.
    ``allocating``: outputs and workspace given as None will be allocated (not checked)."""
    import torch

    problems = []
    deterministic = flag(problems, "deterministic", deterministic)
    integer(problems, "block_tile", block_tile, 64, 64)
    one_of(problems, "q_cluster_mode", q_cluster_mode, ("off",))
    if softmax_scale is not None:
        scalar_f32(problems, "softmax_scale", softmax_scale)
    if topk_length is not None and not isinstance(topk_length, torch.Tensor):
        problems.append(f"topk_length: got {type(topk_length).__name__} (expected a torch.Tensor or None)")
    shapeless = [f"{name}: must be a dense {nd}-D tensor, got {getattr(t, 'shape', type(t).__name__)}"
                 for t, name, nd in ((q, "q", 3), (kv, "kv", 2), (topk_idxs, "topk_idxs", 2))
                 if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.ndim != nd]
    if shapeless:  # every other check reads its shape from these three
        raise input_error(problems + shapeless)
    dev = q.device.index if q.device.type == "cuda" else None
    arch = arch_of(dev) if dev is not None else None
    sm100 = arch is not None and is_sm100(arch)
    s_q, h, d = q.shape
    s_kv, topk = kv.shape[0], topk_idxs.shape[1]
    bf16, f32 = torch.bfloat16, torch.float32
    if d not in (512, 576):
        problems.append(f"head dim D={d} (expected 512 or 576)")
    check(problems, q, "q", (s_q, h, d), bf16, dev, 16)
    check(problems, kv, "kv", (s_kv, d), bf16, dev, 16)
    check(problems, out, "out", (s_q, h, HEAD_DIM_V), bf16, dev, 16)
    check(problems, dout, "dout", (s_q, h, HEAD_DIM_V), bf16, dev, 16)
    check(problems, lse, "lse", (s_q, h), f32, dev, 8 if sm100 else 4)  # SM100 copies LSE in fp32 pairs
    check(problems, attn_sink, "attn_sink", (h,), f32, dev, 16)
    check(problems, topk_idxs, "topk_idxs", (s_q, topk), torch.int32, dev, 16)
    if topk_length is not None:
        check(problems, topk_length, "topk_length", (s_q,), torch.int32, dev, 4 if sm100 else 16)
    for t, name, shape, dt in ((dq, "dq", (s_q, h, d), bf16), (dkv, "dkv", (s_kv, d), bf16), (d_sink, "d_sink", (h,), f32)):
        if not (allocating and t is None):
            check(problems, t, name, shape, dt, dev, 16)
    if s_kv < 1:
        problems.append("kv: S_kv = 0 (expected at least one key row: the sink alone has no gradient path upstream supports)")
    for what, n in (("S_q*H*D", s_q * h * d), ("S_kv*D", s_kv * d), ("S_q*topk", s_q * topk)):
        if n >= 1 << 40:
            problems.append(f"{what} = {n} (expected < 2**40)")
    if deterministic and arch is not None and not sm100:
        problems.append("deterministic=True needs an SM100 GPU; upstream refuses it on SM90 too")
    if deterministic and sm100 and h not in policy.DETERMINISTIC_HEADS:
        problems.append(f"deterministic=True: upstream's deterministic kernels exist for heads {policy.DETERMINISTIC_HEADS}, not H{h}")
    need, ks, ws_align = 0, None, 16
    if not problems and dev is not None:
        sms = sm_count_of(dev)
        ks = policy.kernels(arch, h, d, topk, has_topk_length=topk_length is not None, deterministic=deterministic, s_q=s_q, s_kv=s_kv, sm_count=sms)
        # bwd_d576 bakes the SM count in (split regime, compact slots): its entry is the target of this GPU's
        # own SM count, or an ArchMismatchError naming the target to add (policy SM_COUNT_OPS)
        require(FAMILY, ks, dev)
        op, key = ks.get("bwd", (None, None))
        if op == "bwd_d576" and deterministic:
            ws_align = 32  # the compact 96-plane dKV layout
    if not problems:
        need = policy.workspace_bytes(s_q, s_kv, d, h, arch=arch, topk=topk, deterministic=deterministic)
    if not problems and not (allocating and workspace is None):
        named = (("q", q), ("kv", kv), ("out", out), ("dout", dout), ("lse", lse), ("attn_sink", attn_sink), ("topk_idxs", topk_idxs),
                 ("topk_length", topk_length), ("dq", dq), ("dkv", dkv), ("d_sink", d_sink))
        problems += workspace_problems(workspace, need, dev, named, "dsa_aot.dsa.sparse_attention_backward_workspace_bytes", ws_align)
    if not problems:
        problems += aliasing((("dq", dq), ("dkv", dkv), ("d_sink", d_sink)), (("q", q), ("kv", kv), ("out", out), ("dout", dout), ("lse", lse),
                                                                            ("attn_sink", attn_sink), ("topk_idxs", topk_idxs), ("topk_length", topk_length)))
    if problems:
        raise input_error(problems)
    ts = (dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, workspace)
    masks = (15,) * 7 + ((7 if sm100 else 3),) + (15, 15) + ((3 if sm100 else 15), ws_align - 1)  # as checked above
    foot = footprint(ts, writes=(0, 1, 2, 11), masks=masks, sizes={11: need})
    return _Call(dev, arch, s_q, s_kv, h, d, topk, need, ks, foot)


# --- torch.library (dsa_aot.library registers these as torch.ops.dsa_aot.<name>: schema, CUDA impl, fake) ---
# On torch's current stream.


def _t_backward(q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None, topk_length=None, block_tile=64, deterministic=False,
                q_cluster_mode="off"):
    return tuple(sparse_attention_backward(q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale, topk_length, block_tile=block_tile,
                                           deterministic=deterministic, q_cluster_mode=q_cluster_mode))


def _f_backward(q, kv, out, dout, lse, attn_sink, *args, **kwargs):
    return q.new_empty(q.shape), kv.new_empty(kv.shape), attn_sink.new_empty(attn_sink.shape)


def _t_backward_into(dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, workspace, softmax_scale=None, topk_length=None, block_tile=64,
                     deterministic=False, q_cluster_mode="off"):
    sparse_attention_backward_into(dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale, topk_length, block_tile,
                                   deterministic, None, workspace, q_cluster_mode)


_IN = "Tensor q, Tensor kv, Tensor out, Tensor dout, Tensor lse, Tensor attn_sink, Tensor topk_idxs"
_OPTS = "float? softmax_scale=None, Tensor? topk_length=None, int block_tile=64, bool deterministic=False, str q_cluster_mode=\"off\""
TORCH_OPS = {
    "dsa_sparse_attention_backward": (f"({_IN}, {_OPTS}) -> (Tensor, Tensor, Tensor)", _t_backward, _f_backward),
    "dsa_sparse_attention_backward_into": (f"(Tensor(a!) dq, Tensor(b!) dkv, Tensor(c!) d_sink, {_IN}, Tensor(d!) workspace, {_OPTS}) -> ()",
                                           _t_backward_into, writes_only),
}  # fmt: skip
