"""DSA sparse attention backward op: cudnn's ``sparse_attention_backward_wrapper``, launched from shipped cubins.

SM100: one artifact per call whose host function launches every kernel (the generic M64, H16/H32/H96,
H128 two-CTA, D576 two-CTA and deterministic / row-relay classes, picked from the shapes as upstream's
plan does). SM90: the preprocess -> main -> postprocess pipeline. The dispatch and the workspace
layouts are :mod:`dsa_aot.policy.dsa_sparse_attention_backward`, checked against cudnn on every build.
"""

from __future__ import annotations

import math

from ..errors import InputError
from ..policy.families import FAMILIES
from ..policy import dsa_sparse_attention_backward as policy
from ..policy._math import prod, round_up
from ..policy.arch import is_sm100
from .args import cute_args, flat_args, tensor_args
from .checks import check, flag, input_error, integer, one_of
from .gpu import alloc_on, arch_of, launcher, require, sm_count_of
from .declare import Flag, Float, In, Int, OneOf, Op, Out, Workspace

FAMILY = policy.FAMILY
__all__ = list(FAMILIES[FAMILY].exports)  # the registry lists them: dsa_aot.<namespace> imports this module for them
HEAD_DIM_V = policy.HEAD_DIM_V


def sparse_attention_backward_workspace_bytes(total_s_q, total_s_kv, head_dim, num_heads, *, arch="sm_90a", topk=None, deterministic=False) -> int:
    """cudnn's ``SparseAttentionBackward.scratch_workspace_bytes()``: uint8 bytes ``workspace=`` must hold.

    SM90: dPsum and log2-scaled LSE (each S_q rounded to 64 x H fp32) and the fp32 dKV accumulator
    (S_kv rounded to 64 x D rounded to 32), each chunk 128-byte aligned. SM100 (pass ``topk=``, the
    index row width: it selects the backend): the LSE/OdO and dKV workspaces of that backend.
    """
    problems = []
    for name, v, lo, hi in (("total_s_q", total_s_q, 0, 2**31 - 1), ("total_s_kv", total_s_kv, 0, 2**31 - 1), ("head_dim", head_dim, 1, 1024),
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


def _check(c, problems):
    """Every problem of a call, reported together (q, kv, topk_idxs give the shapes); the dispatch c.ks, the workspace c.need."""
    import torch

    OP.check_options(vars(c), problems)
    if c.topk_length is not None and not isinstance(c.topk_length, torch.Tensor):
        problems.append(f"topk_length: got {type(c.topk_length).__name__} (expected a torch.Tensor or None)")
    shapeless = [f"{name}: must be a dense {nd}-D tensor, got {getattr(t, 'shape', type(t).__name__)}" for name, nd in (("q", 3), ("kv", 2), ("topk_idxs", 2))
                 if not isinstance(t := getattr(c, name), torch.Tensor) or t.layout != torch.strided or t.ndim != nd]
    if shapeless:  # every other check reads its shape from these three
        raise input_error(problems + shapeless)
    c.dev = dev = c.q.device.index if c.q.device.type == "cuda" else None
    arch = arch_of(dev) if dev is not None else None
    c.sm100, c.need, c.ks, c.ws_align, det = arch is not None and is_sm100(arch), 0, None, 16, flag([], "deterministic", c.deterministic)
    (s_q, h, d), s_kv, topk = c.q.shape, c.kv.shape[0], c.topk_idxs.shape[1]
    c.sym.update(s_q=s_q, h=h, d=d, s_kv=s_kv, topk=topk)
    if d not in (512, 576):
        problems.append(f"head dim D={d} (expected 512 or 576)")
    for t in sorted(OP.tensors, key=lambda t: t.role != "in"):  # the inputs first; outputs an allocating call makes are not checked
        v = getattr(c, t.name)
        if t.role != "workspace" and not (v is None and (t.optional or (c.allocating and t.role == "out"))):
            check(problems, v, t.name, t.size_in(c), t.dtype_of(c)[0], dev, t.mask(v, c) + 1)
    if s_kv < 1:
        problems.append("kv: S_kv = 0 (expected at least one key row: the sink alone has no gradient path upstream supports)")
    for what, n in (("S_q*H*D", s_q * h * d), ("S_kv*D", s_kv * d), ("S_q*topk", s_q * topk)):
        if n >= 1 << 40:
            problems.append(f"{what} = {n} (expected < 2**40)")
    if det and arch is not None and not c.sm100:
        problems.append("deterministic=True needs an SM100 GPU; upstream refuses it on SM90 too")
    if det and c.sm100 and h not in policy.DETERMINISTIC_HEADS:
        problems.append(f"deterministic=True: upstream's deterministic kernels exist for heads {policy.DETERMINISTIC_HEADS}, not H{h}")
    if not problems:  # (so dev is a GPU's)
        c.ks = policy.kernels(arch, h, d, topk, has_topk_length=c.topk_length is not None, deterministic=det, s_q=s_q, s_kv=s_kv, sm_count=sm_count_of(dev))
        # bwd_d576 bakes the SM count in (split regime, compact slots): its entry is the target of this GPU's
        # own SM count, or an ArchMismatchError naming the target to add (policy SM_COUNT_OPS)
        require(FAMILY, c.ks, dev)
        if c.ks.get("bwd", (None,))[0] == "bwd_d576" and det:
            c.ws_align = 32  # the compact 96-plane dKV layout
        c.need = policy.workspace_bytes(s_q, s_kv, d, h, arch=arch, topk=topk, deterministic=det)
    OP.check_written(c, vars(c), problems)  # the workspace and overlaps, once the rest passed


def _plan(rec, c):
    s_q, s_kv, h, d, topk = (c.sym[k] for k in ("s_q", "s_kv", "h", "d", "topk"))
    P, s, scale, dev = rec.p, rec.s, rec.x[0], c.dev
    if s_q == 0:  # no query: nothing flows back
        def zero(ts, stream):
            with alloc_on(stream, dev):
                ts[1].zero_()
                ts[2].zero_()

        rec.then(zero)
    elif "bwd" in c.ks:
        _sm100_call(rec, c.ks["bwd"], dev, s_q, s_kv, h, d, topk, c.topk_length is not None)
    else:
        pre, main, post = (launcher(FAMILY, *c.ks[r], dev) for r in ("pre", "main", "post"))
        sqr, skr, dr = round_up(s_q, policy.SM90_TILE_M), round_up(s_kv, policy.SM90_TILE_N), round_up(d, policy.SM90_DIM_MULTIPLE)
        stats = round_up(sqr * h * 4, policy.WS_ALIGN)
        ws = P[11]
        dpsum, lse_log2, acc = flat_args(ws, (1, sqr, h)), flat_args(ws + stats, (1, sqr, h)), ws + 2 * stats
        acc3 = flat_args(acc, (1, 1, skr * dr))
        o4, do4 = tensor_args(c.out.unsqueeze(0), P[5]), tensor_args(c.dout.unsqueeze(0), P[6])
        tl = tensor_args(c.topk_length.unsqueeze(0), P[10]) if c.topk_length is not None else ()
        # upstream's order: clear the dKV accumulator and d_sink (both are atomically accumulated)
        rec.memset(acc, skr * dr * 4)
        rec.memset(P[2], h * 4)
        rec.launch(pre, *o4, *do4, *dpsum, *tensor_args(c.lse.unsqueeze(0), P[7]), *lse_log2, *tensor_args(c.attn_sink, P[8]),
                   *tensor_args(c.d_sink, P[2]), s)
        rec.launch(main, *tensor_args(c.q.unsqueeze(0), P[3]), *tensor_args(c.kv.unsqueeze(0).unsqueeze(2), P[4]), *do4, *lse_log2, *dpsum,
                   *tensor_args(c.dq.unsqueeze(0), P[0]), *acc3, *tensor_args(c.topk_idxs.unsqueeze(0), P[9]), *tl, scale, s)
        rec.launch(post, *acc3, *tensor_args(c.dkv.unsqueeze(0).unsqueeze(2), P[1]), s_kv, s)


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


_OPTS = "block_tile=64, deterministic=False, stream=None, workspace=None, q_cluster_mode=\"off\""
OP = Op(
    FAMILY, "sparse_attention_backward", plan_class="SparseAttentionBackward",
    into=f"dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None, topk_length=None, {_OPTS}",
    alloc=f"q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None, topk_length=None, dq=None, dkv=None, {_OPTS}",
    torch_into="dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, workspace, softmax_scale=None, topk_length=None, block_tile=64, "
               "deterministic=False, q_cluster_mode='off'",  # the schema takes the workspace positionally
    tensors=(
        Out("dq", "bfloat16", ("s_q", "h", "d"), given=True), Out("dkv", "bfloat16", ("s_kv", "d"), given=True), Out("d_sink", "float32", ("h",)),
        In("q", "bfloat16", ("s_q", "h", "d")), In("kv", "bfloat16", ("s_kv", "d")), In("out", "bfloat16", ("s_q", "h", HEAD_DIM_V)),
        In("dout", "bfloat16", ("s_q", "h", HEAD_DIM_V)),
        In("lse", "float32", ("s_q", "h"), align=lambda c: 8 if c.sm100 else 4),  # SM100 copies LSE in fp32 pairs
        In("attn_sink", "float32", ("h",)), In("topk_idxs", "int32", ("s_q", "topk")),
        In("topk_length", "int32", ("s_q",), optional=True, align=lambda c: 4 if c.sm100 else 16),
        Workspace("workspace", lambda c: c.need, "dsa_aot.dsa.sparse_attention_backward_workspace_bytes", align=lambda c: c.ws_align, given=True),
    ),
    options=(Flag("deterministic", False), Int("block_tile", 64, 64, 64), OneOf("q_cluster_mode", ("off",), "off"),
             Float("softmax_scale", None, none=lambda c: 1.0 / math.sqrt(c.sym["d"]), per_call=True)),
    check=_check, plan=_plan, into_returns=("dq", "dkv", "d_sink"),
    note="``q`` (S_q, H, D) bf16, ``kv`` (S_kv, D) (K = V, one KV head; D 576 = QK dim, the first 512 columns are V), ``out``/``dout`` "
         "(S_q, H, 512), ``lse`` (S_q, H) fp32 (KV-only LSE), ``attn_sink`` (H,) fp32, ``topk_idxs`` (S_q, topk) int32 global KV ids (ids "
         "outside [0, S_kv) are ignored), ``topk_length`` (S_q,) int32 optional valid prefix. The allocating form allocates ``dq`` / ``dkv`` "
         "and ``workspace`` on the launch stream when omitted; ``d_sink`` is always new, as upstream. Returns (dq, dkv, d_sink).",
)  # fmt: skip

sparse_attention_backward, sparse_attention_backward_into, SparseAttentionBackward = OP.forms(globals())
