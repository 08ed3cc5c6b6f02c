"""DSA indexer backward op: cudnn's ``indexer_backward_wrapper``, launched from shipped cubins.

The same arguments, outputs and side effects as upstream (``attn_score`` is overwritten with the
score-grad signal, ``index_score`` is read-only), the same kernels in the same order on one stream
(:mod:`dsa_aot.policy.dsa_indexer_backward` lists them and holds the dispatch, checked against cudnn on
every build). Every input is validated before anything is launched or written.
"""

from __future__ import annotations

from ..policy.families import FAMILIES
from ..policy import dsa_indexer_backward as policy
from ..policy.arch import is_sm100
from .args import flat_args, tensor_args
from .checks import _FLT_MAX, flag, input_error, int32_extents, integer, one_of, scalar_f32
from .gpu import alloc_on, arch_of, target_sm_count
from .gpu import cast_into as _cast_into  # (a module global: the CPU tests stub it
from .declare import Flag, Float, In, Int, OneOf, Op, Out, Workspace

FAMILY = policy.FAMILY
__all__ = list(FAMILIES[FAMILY].exports)  # the registry lists them: dsa_aot.<namespace> imports this module for them
DEFAULT_PLANES = policy.DEFAULT_PLANES
_I32 = 2**31
_V2_SCALE = "sm_scale={} (backend='sm100_v2' requires sm_scale > 0: its relu gate reads unscaled scores)"


def indexer_backward_workspace_bytes(batch, seqlen_k, head_dim=policy.DIM, *, d_index_k_dtype=None, backend="default", deterministic=False,
                                     deterministic_dk_planes=DEFAULT_PLANES) -> int:
    """cudnn's ``IndexerBackward.scratch_workspace_bytes()``: uint8 bytes ``workspace=`` must hold
    (``d_index_k_dtype``: torch.bfloat16, the default, or torch.float32)."""
    import torch

    problems = []
    for name, v, lo, hi in (("batch", batch, 0, _I32 - 1), ("seqlen_k", seqlen_k, 0, _I32 - 1), ("head_dim", head_dim, 1, 1024)):
        integer(problems, name, v, lo, hi)
    one_of(problems, "backend", backend, policy.BACKENDS)
    flag(problems, "deterministic", deterministic)
    one_of(problems, "deterministic_dk_planes", deterministic_dk_planes, policy.PLANES)
    if d_index_k_dtype not in (None, torch.bfloat16, torch.float32):
        problems.append(f"d_index_k_dtype={d_index_k_dtype!r} (expected torch.bfloat16 or torch.float32)")
    if problems:
        raise input_error(problems)
    return policy.workspace_bytes(batch, seqlen_k, head_dim, d_index_k_f32=d_index_k_dtype == torch.float32, backend=backend,
                                  deterministic=bool(deterministic), deterministic_dk_planes=deterministic_dk_planes)


def _f32(t) -> bool:  # an fp32 output (None: allocated bf16, like the inputs)
    return str(getattr(t, "dtype", "")) == "torch.float32"


def _dims(c) -> tuple:
    return tuple(c.sym[k] for k in ("b", "s_q", "s_k", "h", "d", "topk"))


def _need(c) -> int:
    return policy.workspace_bytes(c.sym["b"], c.sym["s_k"], c.sym["d"], d_index_k_f32=_f32(c.d_index_k), backend=c.backend,
                                  deterministic=bool(c.deterministic), deterministic_dk_planes=c.deterministic_dk_planes)


def _early_rules(c, problems):
    """What the declared shapes and dtypes do not say, reported with every other problem."""
    if hasattr(c.grad_loss, "numel") and c.grad_loss.numel() != 1:
        problems.append(f"grad_loss: shape {tuple(c.grad_loss.shape)} (must be a single-element float32 tensor)")
    if c.backend != "sm100_v2" and _f32(c.d_weights):
        problems.append("d_weights: dtype torch.float32 (expected torch.bfloat16)")  # fp32: backend='sm100_v2' only
    if not {"b", "s_q", "s_k", "h", "d", "topk"} <= c.sym.keys():
        return
    b, s_q, s_k, h, d, topk = _dims(c)
    if s_k == 0:
        problems.append("index_k: S_k = 0 (expected at least one key row)")
    if topk % 128:
        problems.append(f"topk={topk} (expected a multiple of block_I = 128)")
    if d != 128:
        problems.append(f"D={d} (expected 128)")
    int32_extents(problems, ("B*S_q*H*D", b * s_q * h * d), ("B*S_k*D", b * s_k * d), ("B*S_q*topk", b * s_q * topk))


def _rules(c, problems):
    b, s_q, _, h, _, _ = _dims(c)
    v2, det, planes = c.backend == "sm100_v2", bool(c.deterministic), c.deterministic_dk_planes
    if not det and planes != DEFAULT_PLANES:
        problems.append("deterministic_dk_planes is only configurable when deterministic=True")
    c.arch = arch = arch_of(c.dev)
    sm100 = is_sm100(arch)
    if not sm100 and (v2 or det):
        problems.append(f"{'backend=sm100_v2' if v2 else 'deterministic=True'} needs an SM100 GPU (this one runs {arch}); upstream refuses it too")
    if sm100 and not v2 and h not in (32, 64):
        problems.append(f"H={h} (the SM100 kernels ship H=32 and H=64)")
    if not sm100 and h < 64:
        problems.append(f"H={h} (the SM90 kernel needs H >= 64)")
    if v2 and h != 64:
        problems.append(f"H={h} (backend='sm100_v2' requires H=64)")
    if v2 and not problems and not float(c.sm_scale) > 0.0:
        problems.append(_V2_SCALE.format(c.sm_scale))
    if det and b * s_q and b * s_q < planes:
        problems.append(f"B*S_q = {b * s_q} < deterministic_dk_planes = {planes}: upstream compiles a smaller grid for such a call, "
                        f"which this build does not ship (use deterministic_dk_planes <= B*S_q or deterministic=False)")


def _entries(c):
    b, s_q, _, h, _, topk = _dims(c)
    if not (b * s_q and topk):
        return {}  # nothing launches
    v2 = c.backend == "sm100_v2"
    return policy.kernels(c.arch, b, s_q, h, topk, topk_indices_global=bool(c.topk_indices_global), backend=c.backend,
                          deterministic=bool(c.deterministic), deterministic_dk_planes=c.deterministic_dk_planes, d_index_k_f32=_f32(c.d_index_k),
                          d_weights_f32=v2 and _f32(c.d_weights), target_sm_count=target_sm_count(c.dev) if is_sm100(c.arch) else None)


def _hint(c, key) -> str:
    rpc = key.get("rows_per_cta")
    return "" if rpc is None else f" (the v2 kernel is compiled per ceil(B*S_q / CTAs) = {rpc}; add rows_per_cta = {rpc})"


def _scalars(c):
    """The per-call scalars (sm_scale, grad_scale = loss_coeff / (B*S_q)) of a call like ``c``, checked."""
    rows, v2 = c.sym["b"] * c.sym["s_q"], c.backend == "sm100_v2"

    def scalars(sm_scale, loss_coeff):
        if (type(sm_scale) is float and type(loss_coeff) is float and rows and (sm_scale > 0.0 or not v2)  # the common case
                and -_FLT_MAX <= sm_scale <= _FLT_MAX and -_FLT_MAX <= loss_coeff <= _FLT_MAX):
            return (sm_scale, loss_coeff / rows)  # |loss_coeff / rows| <= |loss_coeff|
        problems = []
        sm = scalar_f32(problems, "sm_scale", sm_scale)
        if v2 and not problems and not sm > 0.0:
            problems.append(_V2_SCALE.format(sm_scale))
        lc = scalar_f32(problems, "loss_coeff", loss_coeff)
        if problems:
            raise input_error(problems)
        return (sm, lc / rows if rows else 0.0)

    return scalars


def _plan(rec, c):
    p, s, dev, arch = c.p, rec.s, c.dev, c.arch
    b, s_q, s_k, h, d, topk = _dims(c)
    rows = b * s_q
    if not c.entry:
        # nothing reads or writes a slot: dK is all zero, dQ/dW are empty or zero
        def zero(ts, stream):
            with alloc_on(stream, dev):
                for t in ts[:3]:
                    t.zero_()

        rec.then(zero)
        return
    sm_scale, grad_scale = c.x["sm_scale"], c.x["loss_coeff"]
    q4, w3, k3 = tensor_args(c.index_q, p.index_q), tensor_args(c.weights, p.weights), tensor_args(c.index_k, p.index_k)
    dq4, dw3 = tensor_args(c.d_index_q, p.d_index_q), tensor_args(c.d_weights, p.d_weights)
    a3, i3, t3 = tensor_args(c.attn_score, p.attn_score), tensor_args(c.index_score, p.index_score), tensor_args(c.topk_indices, p.topk_indices)
    gl1 = (p.grad_loss, 1)  # grad_loss.reshape(1)
    ws = p.workspace if c.workspace is not None else 0
    kbytes = b * s_k * d * 4
    planes, dk_f32 = int(c.deterministic_dk_planes), _f32(c.d_index_k)
    sg, gemm, red = c.entry["score_grad"], c.entry["gemm"], c.entry.get("reduce")

    # each path: the memsets, the entry calls in order, where the bf16 cast reads the fp32 dK (None: no cast)
    cast = None if dk_f32 else 0
    if not is_sm100(arch):  # SM90 twins: zero fp32 dK, score-grad, GEMM, cast
        dk = p.d_index_k if dk_f32 else ws
        memsets = [(dk, kbytes)]
        calls = [(sg, (*a3, *i3, *gl1, grad_scale, s)), (gemm, (*q4, *w3, *k3, *dq4, *dw3, *flat_args(dk, (b, s_k, d)), *a3, *t3, sm_scale, s, s_q, s_k))]
    elif c.backend == "sm100_v2":
        if c.deterministic:
            dk_rows, dk_ptr, cnt = planes * b * s_k, ws, (ws, 1)
            memsets, cast = [(ws, planes * kbytes)], None
        else:
            cnt = (ws, 2)
            dk_ptr = p.d_index_k if dk_f32 else ws + policy.V2_COUNTER_CHUNK
            dk_rows = b * s_k
            memsets = [(ws, 8), (dk_ptr, kbytes)]
            cast = None if dk_f32 else policy.V2_COUNTER_CHUNK
        calls = [(sg, (*a3, *i3, *gl1, *gl1, grad_scale, s)),
                 (gemm, (*flat_args(p.index_q, (rows, h, d)), *flat_args(p.index_k, (b * s_k, d)), *flat_args(p.weights, (rows, h)),
                         *flat_args(p.topk_indices, (rows, topk)), *flat_args(p.attn_score, (rows, topk)), *flat_args(p.d_index_q, (rows, h, d)),
                         *flat_args(p.d_weights, (rows, h)), *flat_args(dk_ptr, (dk_rows, d)), sm_scale, s_q, s_k, s, *cnt))]
        if c.deterministic:
            calls.append((red, (*flat_args(ws, (planes, b * s_k, d)), *tensor_args(c.d_index_k, p.d_index_k), s)))
    elif c.deterministic:  # zero planes, score-grad, GEMM on fixed-owner planes, fixed-order reduction
        memsets, cast = [(ws, planes * kbytes)], None
        calls = [(sg, (*a3, *i3, *gl1, *gl1, grad_scale, s)), (gemm, (*q4, *w3, *k3, *dq4, *dw3, *flat_args(ws, (planes, b * s_k, d)), *a3, *t3, sm_scale, s)),
                 (red, (*flat_args(ws, (planes, b * s_k, d)), *tensor_args(c.d_index_k, p.d_index_k), s))]
    else:  # default: score-grad clears the fp32 dK in the same launch, GEMM (PDL), cast
        dk = flat_args(p.d_index_k if dk_f32 else ws, (b, s_k, d))
        memsets = []
        calls = [(sg, (*a3, *i3, *gl1, *dk, grad_scale, s)), (gemm, (*q4, *w3, *k3, *dq4, *dw3, *dk, *a3, *t3, sm_scale, s))]
    for ptr, n in memsets:
        rec.memset(ptr, n)
    for le, args in calls:
        rec.launch(le, *args)
    if cast is not None:
        def cast_dk(ts, stream, offset=cast, shape=(b, s_k, d)):
            _cast_into(ts[2], ts[10], shape, stream, dev, offset)

        rec.then(cast_dk)


_OPTS = "sm_scale=1.0, loss_coeff=1.0, block_I=128, topk_indices_global=False"
_KW = f"backend='default', workspace=None, deterministic=False, deterministic_dk_planes={DEFAULT_PLANES}"
_INS = "index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss"
BACKWARD = Op(
    FAMILY, "indexer_backward", plan_class="IndexerBackward",
    into=f"d_index_q, d_weights, d_index_k, {_INS}, {_OPTS}, stream=None, *, {_KW}",
    alloc=f"{_INS}, {_OPTS}, d_index_q=None, d_weights=None, d_index_k=None, stream=None, *, {_KW}",
    tensors=(
        Out("d_index_q", "bfloat16", "like index_q", given=True, alloc_like=True),
        Out("d_weights", ("bfloat16", "float32"), "like weights", given=True, alloc_like=True),  # fp32: backend='sm100_v2' only
        Out("d_index_k", ("bfloat16", "float32"), "like index_k", given=True, alloc_like=True),
        In("index_q", "bfloat16", ("b", "s_q", "h", "d")),
        In("weights", "bfloat16", ("b", "s_q", "h")),
        In("index_k", "bfloat16", ("b", "s_k", "d")),
        In("attn_score", "float32", ("b", "s_q", "topk"), written=True),  # overwritten with the score-grad signal
        In("index_score", "float32", ("b", "s_q", "topk")),
        In("topk_indices", "int32", ("b", "s_q", "topk")),
        In("grad_loss", "float32", None),  # any single-element tensor (upstream's reshape(1))
        Workspace("workspace", _need, "dsa_aot.dsa.indexer_backward_workspace_bytes", given=True),
    ),
    options=(
        Float("sm_scale", 1.0, per_call=True), Float("loss_coeff", 1.0, per_call=True), Int("block_I", policy.BLOCK_I, policy.BLOCK_I, policy.BLOCK_I),
        Flag("topk_indices_global", False), OneOf("backend", policy.BACKENDS, "default"), Flag("deterministic", False),
        OneOf("deterministic_dk_planes", policy.PLANES, DEFAULT_PLANES),
    ),
    early_rules=_early_rules, rules=_rules, entries=_entries, hint=_hint, scalar_fn=_scalars, plan=_plan,
    note="``attn_score`` (fp32, B x S_q x topk) is overwritten with the score-grad signal; ``index_score`` is only read. Outputs not given "
         "are allocated like the inputs (bf16) and ``workspace`` (uint8, ``indexer_backward_workspace_bytes(...)``) per call: pass them to "
         "capture the op in a CUDA graph.",
)  # fmt: skip

indexer_backward, indexer_backward_into, IndexerBackward = BACKWARD.forms(globals())
