"""DSA indexer backward op: cudnn's ``indexer_backward_wrapper``, launched from shipped cubins.

The same arguments, outputs and side effects as upstream (``attn_score`` is overwritten with the
score-grad signal, ``index_score`` is read-only), the same kernels in the same order on one stream
(:mod:`dsa_aot.policy.dsa_indexer_backward` lists them and holds the dispatch, checked against cudnn on
every build). Every input is validated before anything is launched or written.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..errors import InputError
from ..policy import dsa_indexer_backward as policy
from ..policy.arch import is_sm100
from ._support import cast_into as _cast_into  # (a module global: the CPU tests stub it)
from ._support import (aliasing, alloc_on, allocate, arch_of, check, flag, flat_args, footprint, input_error, integer, launcher, one_of, require,
                       scalar_f32, stream_handle, target_sm_count, tensor_args, workspace_problems, writes_only)
from .outputs import Outputs
from .plan import ALLOC, Plan, Recorder, cached, compile_call, probe_for, remember, remembered

__all__ = ["indexer_backward", "indexer_backward_into", "indexer_backward_workspace_bytes", "IndexerBackward"]

FAMILY = policy.FAMILY
DEFAULT_PLANES = policy.DEFAULT_PLANES
_I32 = 2**31
_FLT_MAX = 3.4028234663852886e38


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


@dataclass(frozen=True)
class _Call:
    """What validating one call proved: the device, arch and extents it runs with, the workspace bytes it needs."""

    dev: int
    arch: str
    b: int
    s_q: int
    s_k: int
    h: int
    d: int
    topk: int
    need: int
    kernels: dict | None  # role -> (op, key); None when nothing launches (no rows or no slots)
    foot: list  # byte sizes, alignment masks, written tensors, last pointers that passed: for recheck()


def indexer_backward(index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, sm_scale=1.0, loss_coeff=1.0, block_I=128,
                     topk_indices_global=False, d_index_q=None, d_weights=None, d_index_k=None, stream=None, *, backend="default", workspace=None,
                     deterministic=False, deterministic_dk_planes=DEFAULT_PLANES):
    """cudnn's ``indexer_backward_wrapper``: returns ``{'d_index_q', 'd_weights', 'd_index_k'}``.

    Outputs not given are allocated like the inputs (bf16). ``attn_score`` (fp32, B x S_q x topk) is
    overwritten with the score-grad signal; ``index_score`` is only read. ``workspace`` (uint8, at
    least ``indexer_backward_workspace_bytes(...)``) is allocated per call when omitted; pass it, and
    the outputs, to capture the op in a CUDA graph.
    """
    import torch

    if workspace is None or d_index_q is None or d_weights is None or d_index_k is None:
        # allocate what is missing like upstream (empty_like the inputs, per-call workspace), once
        # everything given is known to be valid (the missing outputs and workspace are checked after)
        ins = (d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, workspace)
        extra = (block_I, topk_indices_global, backend, deterministic, deterministic_dk_planes)
        hit = remembered(_CALLS, ALLOC, ins, extra)  # the same options, tensors like the last validated call's, pointers that pass
        call = hit and hit[0]
        if call is not None and call.b * call.s_q:  # and the scalars pass their per-call checks
            try:
                _scalars_of(call.b * call.s_q, backend == "sm100_v2")(sm_scale=sm_scale, loss_coeff=loss_coeff)
            except InputError:
                call = None
        if call is None:
            call = _validate(*ins[:10], sm_scale, loss_coeff, block_I, topk_indices_global, backend, workspace, deterministic,
                             deterministic_dk_planes, allocating=True)
            remember(_CALLS, ALLOC, extra, probe_for(ins, call.dev, call.foot), call)
        dev = call.dev
        stream_handle(stream, dev)  # refuse a bad stream before allocating on it (the _into call checks the rest, scalars and pointers)

        def outputs():
            with alloc_on(stream, dev):  # empty_like keeps the inputs' device; the stream orders the allocator
                return (torch.empty_like(index_q) if d_index_q is None else d_index_q, torch.empty_like(weights) if d_weights is None else d_weights,
                        torch.empty_like(index_k) if d_index_k is None else d_index_k,
                        torch.empty(call.need, dtype=torch.uint8, device=index_q.device) if workspace is None and call.need else workspace)

        d_index_q, d_weights, d_index_k, workspace = allocate(outputs)
    indexer_backward_into(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss,
                          sm_scale, loss_coeff, block_I, topk_indices_global, stream, backend=backend, workspace=workspace,
                          deterministic=deterministic, deterministic_dk_planes=deterministic_dk_planes)
    return Outputs(d_index_q=d_index_q, d_weights=d_weights, d_index_k=d_index_k)


def indexer_backward_into(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss,
                          sm_scale=1.0, loss_coeff=1.0, block_I=128, topk_indices_global=False, stream=None, *, backend="default",
                          workspace=None, deterministic=False, deterministic_dk_planes=DEFAULT_PLANES):
    """``indexer_backward`` into caller-provided outputs and workspace (capture-safe from the first call, see dsa_aot.runtime; allocates nothing)."""
    ts = (d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, workspace)
    # the signature proves every check but the per-call ones: the fp32 scalars' values (below), pointer
    # alignment and the outputs and workspace overlapping anything (recheck), the stream
    extra = (block_I, backend, deterministic, deterministic_dk_planes, topk_indices_global, backend == "sm100_v2" and _positive(sm_scale))
    call, p = cached(_CALLS, ts, extra, lambda: _plan_backward(*ts[:10], sm_scale, loss_coeff, block_I, topk_indices_global, backend=backend,
                                                             workspace=workspace, deterministic=deterministic,
                                                             deterministic_dk_planes=deterministic_dk_planes))
    call.run(p, stream_handle(stream, call.dev), call.scalars(sm_scale=sm_scale, loss_coeff=loss_coeff), ts, stream)
    return d_index_q, d_weights, d_index_k


def _positive(v) -> bool:
    try:
        return float(v) > 0.0
    except (TypeError, ValueError, OverflowError):
        return False


def _scalars_of(rows: int, v2: bool):
    """The per-call scalars (grad_scale = loss_coeff / (B*S_q), sm_scale) of a call with ``rows`` rows, checked."""

    def scalars(sm_scale=1.0, loss_coeff=1.0):
        if (type(sm_scale) is float and type(loss_coeff) is float and rows and (sm_scale > 0.0 or not v2)  # the common case
                and -_FLT_MAX <= sm_scale <= _FLT_MAX and -_FLT_MAX <= loss_coeff <= _FLT_MAX):
            return (loss_coeff / rows, sm_scale)  # |loss_coeff / rows| <= |loss_coeff|
        problems = []
        sm = scalar_f32(problems, "sm_scale", sm_scale, positive=v2)
        lc = scalar_f32(problems, "loss_coeff", loss_coeff)
        g = lc / rows if rows else 0.0
        if not problems and not abs(g) <= 3.4028234663852886e38:
            problems.append(f"loss_coeff / (B*S_q) = {g!r} is not representable in fp32")
        if problems:
            raise input_error(problems)
        return (g, sm)

    return scalars


def _plan_backward(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, sm_scale=1.0,
                   loss_coeff=1.0, block_I=128, topk_indices_global=False, *, backend="default", workspace=None, deterministic=False,
                   deterministic_dk_planes=DEFAULT_PLANES):
    """Validate an indexer backward call and compile what it does (:class:`dsa_aot.ops.plan.Call`)."""
    import torch

    call = _validate(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss,
                     sm_scale, loss_coeff, block_I, topk_indices_global, backend, workspace, deterministic, deterministic_dk_planes)
    dev, arch, b, s_q, s_k, h, d, topk = call.dev, call.arch, call.b, call.s_q, call.s_k, call.h, call.d, call.topk
    rows = b * s_q
    ts = (d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, workspace)
    scalars = _scalars_of(rows, backend == "sm100_v2")
    x = scalars(sm_scale=sm_scale, loss_coeff=loss_coeff)
    defaults = functools.partial(scalars, sm_scale=sm_scale, loss_coeff=loss_coeff)  # a plan's execute overrides some
    rec = Recorder(len(ts), 2)
    P, s, (grad_scale, sm_scale) = rec.p, rec.s, rec.x
    dk_dtype_f32 = d_index_k.dtype == torch.float32
    if rows == 0 or topk == 0:
        # nothing reads or writes a slot: dK is all zero, dQ/dW are empty or zero
        def zero(ts, stream):
            with alloc_on(stream, dev):
                for t in ts[:3]:
                    t.zero_()

        rec.then(zero)
        return compile_call("dsa_indexer_backward", rec, dev, ts, call.foot, x, defaults)
    q4, w3, k3 = tensor_args(index_q, P[3]), tensor_args(weights, P[4]), tensor_args(index_k, P[5])
    dq4, dw3 = tensor_args(d_index_q, P[0]), tensor_args(d_weights, P[1])
    a3, i3, t3 = tensor_args(attn_score, P[6]), tensor_args(index_score, P[7]), tensor_args(topk_indices, P[8])
    gl1 = tensor_args(grad_loss.detach().reshape(1), P[9])
    ws = P[10] if workspace is not None else 0
    kbytes = b * s_k * d * 4

    planes = int(deterministic_dk_planes)
    ks = call.kernels
    sg = launcher(FAMILY, *ks["score_grad"], dev)
    gemm = launcher(FAMILY, *ks["gemm"], dev)
    red = launcher(FAMILY, *ks["reduce"], dev) if "reduce" in ks else None

    # each path: the memsets, the entry calls in order, where the bf16 cast reads the fp32 dK (None: no cast)
    cast = None if dk_dtype_f32 else 0
    if not is_sm100(arch):  # SM90 twins: zero fp32 dK, score-grad, GEMM, cast
        dk = P[2] if dk_dtype_f32 else ws
        memsets = [(dk, kbytes)]
        calls = [(sg, (*a3, *i3, *gl1, grad_scale, s)), (gemm, (*q4, *w3, *k3, *dq4, *dw3, *flat_args(dk, (b, s_k, d)), *a3, *t3, sm_scale, s, s_q, s_k))]
    elif backend == "sm100_v2":
        if deterministic:
            dk_rows, dk_ptr, cnt = planes * b * s_k, ws, (ws, 1)
            memsets, cast = [(ws, planes * kbytes)], None
        else:
            cnt = (ws, 2)
            dk_ptr = P[2] if dk_dtype_f32 else ws + policy.V2_COUNTER_CHUNK
            dk_rows = b * s_k
            memsets = [(ws, 8), (dk_ptr, kbytes)]
            cast = None if dk_dtype_f32 else policy.V2_COUNTER_CHUNK
        calls = [(sg, (*a3, *i3, *gl1, *gl1, grad_scale, s)),
                 (gemm, (*flat_args(P[3], (rows, h, d)), *flat_args(P[5], (b * s_k, d)), *flat_args(P[4], (rows, h)),
                         *flat_args(P[8], (rows, topk)), *flat_args(P[6], (rows, topk)), *flat_args(P[0], (rows, h, d)),
                         *flat_args(P[1], (rows, h)), *flat_args(dk_ptr, (dk_rows, d)), sm_scale, s_q, s_k, s, *cnt))]
        if deterministic:
            calls.append((red, (*flat_args(ws, (planes, b * s_k, d)), *tensor_args(d_index_k, P[2]), s)))
    elif deterministic:  # zero planes, score-grad, GEMM on fixed-owner planes, fixed-order reduction
        memsets, cast = [(ws, planes * kbytes)], None
        calls = [(sg, (*a3, *i3, *gl1, *gl1, grad_scale, s)), (gemm, (*q4, *w3, *k3, *dq4, *dw3, *flat_args(ws, (planes, b * s_k, d)), *a3, *t3, sm_scale, s)),
                 (red, (*flat_args(ws, (planes, b * s_k, d)), *tensor_args(d_index_k, P[2]), s))]
    else:  # default: score-grad clears the fp32 dK in the same launch, GEMM (PDL), cast
        dk = flat_args(P[2] if dk_dtype_f32 else ws, (b, s_k, d))
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
    return compile_call("dsa_indexer_backward", rec, dev, ts, call.foot, x, defaults)


class IndexerBackward(Plan):
    """cudnn's IndexerBackward shape: ``IndexerBackward(d_index_q, d_weights, d_index_k, index_q, weights,
    index_k, attn_score, index_score, topk_indices, grad_loss, sm_scale=1.0, loss_coeff=1.0, block_I=128,
    topk_indices_global=False, *, backend, workspace, deterministic, deterministic_dk_planes)``;
    ``execute(d_index_q, ..., grad_loss, workspace=None, stream=None, sm_scale=..., loss_coeff=...)``
    (the scalars default to the plan's; see :class:`dsa_aot.ops.plan.Plan`)."""

    _build = staticmethod(_plan_backward)
    _tensors = ("d_index_q", "d_weights", "d_index_k", "index_q", "weights", "index_k", "attn_score", "index_score", "topk_indices", "grad_loss",
                "workspace")
    _scalars = ("sm_scale", "loss_coeff")


# signature (shapes, dtypes, devices, contiguity, options) -> the compiled Call: a repeated call skips the
# full validation; pointer alignment, workspace overlap and output aliasing are re-checked per call (recheck).
_CALLS: dict = {}


def _validate(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss,
              sm_scale, loss_coeff, block_I, topk_indices_global, backend, workspace, deterministic, planes, allocating=False):
    """Every problem with the inputs, raised together before anything is touched; returns the validated
    call. ``allocating``: outputs and workspace given as None will be allocated (not checked)."""
    import torch

    problems = []
    one_of(problems, "backend", backend, policy.BACKENDS)
    deterministic = flag(problems, "deterministic", deterministic)
    flag(problems, "topk_indices_global", topk_indices_global)
    one_of(problems, "deterministic_dk_planes", planes, policy.PLANES)
    if not problems and not deterministic and planes != DEFAULT_PLANES:
        problems.append("deterministic_dk_planes is only configurable when deterministic=True")
    integer(problems, "block_I", block_I, 128, 128)
    scalar_f32(problems, "sm_scale", sm_scale)
    scalar_f32(problems, "loss_coeff", loss_coeff)
    shapes_ok = True
    for t, name, nd in ((index_q, "index_q", 4), (index_k, "index_k", 3), (topk_indices, "topk_indices", 3)):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.ndim != nd:
            problems.append(f"{name}: must be a dense {nd}-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
            shapes_ok = False
    if not shapes_ok:
        raise input_error(problems)
    dev = index_q.device.index if index_q.device.type == "cuda" else None
    b, s_q, h, d = index_q.shape
    s_k, topk = index_k.shape[1], topk_indices.shape[2]
    bf16, f32 = torch.bfloat16, torch.float32
    check(problems, index_q, "index_q", (b, s_q, h, d), bf16, dev, 16)
    check(problems, weights, "weights", (b, s_q, h), bf16, dev, 16)
    check(problems, index_k, "index_k", (b, s_k, d), bf16, dev, 16)
    check(problems, attn_score, "attn_score", (b, s_q, topk), f32, dev, 16)
    check(problems, index_score, "index_score", (b, s_q, topk), f32, dev, 16)
    check(problems, topk_indices, "topk_indices", (b, s_q, topk), torch.int32, dev, 16)
    skip = (lambda t: allocating and t is None)  # noqa: E731
    if not skip(d_index_q):
        check(problems, d_index_q, "d_index_q", (b, s_q, h, d), bf16, dev, 16)
    v2 = backend == "sm100_v2"
    dw_dt = d_weights.dtype if v2 and isinstance(d_weights, torch.Tensor) and d_weights.dtype in (bf16, f32) else bf16
    if not skip(d_weights):
        check(problems, d_weights, "d_weights", (b, s_q, h), dw_dt, dev, 16)
    dk_dt = d_index_k.dtype if isinstance(d_index_k, torch.Tensor) and d_index_k.dtype in (bf16, f32) else bf16
    if not skip(d_index_k):
        check(problems, d_index_k, "d_index_k", (b, s_k, d), dk_dt, dev, 16)
    if (not isinstance(grad_loss, torch.Tensor) or grad_loss.layout != torch.strided or grad_loss.numel() != 1 or grad_loss.dtype != f32
            or grad_loss.device != index_q.device):
        problems.append(f"grad_loss: must be a single-element float32 tensor on {index_q.device}")
    elif grad_loss.data_ptr() % 16:
        problems.append(f"grad_loss: data pointer 0x{grad_loss.data_ptr():x} is not 16-byte aligned (clone() it)")
    if s_k == 0:
        problems.append("index_k: S_k = 0 (expected at least one key row)")
    if b * s_q and not problems and not abs(float(loss_coeff) / (b * s_q)) <= 3.4028234663852886e38:
        problems.append(f"loss_coeff / (B*S_q) = {float(loss_coeff) / (b * s_q)!r} is not representable in fp32")
    if topk % 128:
        problems.append(f"topk={topk} (expected a multiple of block_I = 128)")
    if d != 128:
        problems.append(f"D={d} (expected 128)")
    for what, n in (("B*S_q*H*D", b * s_q * h * d), ("B*S_k*D", b * s_k * d), ("B*S_q*topk", b * s_q * topk)):
        if n >= _I32:
            problems.append(f"{what} = {n} (expected < 2**31: the kernels index with int32)")
    arch = None
    if dev is not None and not problems:
        arch = arch_of(dev)
        sm100 = is_sm100(arch)
        if not sm100 and (v2 or deterministic):
            problems.append(f"{'backend=sm100_v2' if v2 else 'deterministic=True'} needs an SM100 GPU (this one runs {arch}); upstream refuses it too")
        if sm100 and not v2 and h not in (32, 64):
            problems.append(f"H={h} (the SM100 kernels ship H=32 and H=64)")
        if not sm100 and h < 64:
            problems.append(f"H={h} (the SM90 kernel needs H >= 64)")
        if v2 and h != 64:
            problems.append(f"H={h} (backend='sm100_v2' requires H=64)")
        if v2 and not problems and not float(sm_scale) > 0.0:
            problems.append(f"sm_scale={sm_scale} (backend='sm100_v2' requires sm_scale > 0: its relu gate reads unscaled scores)")
        if deterministic and b * s_q and b * s_q < planes:
            problems.append(f"B*S_q = {b * s_q} < deterministic_dk_planes = {planes}: upstream compiles a smaller grid for such a call, "
                            f"which this build does not ship (use deterministic_dk_planes <= B*S_q or deterministic=False)")
    ks = None
    if dev is not None and not problems and b * s_q and topk:
        ks = policy.kernels(arch, b, s_q, h, topk, topk_indices_global=bool(topk_indices_global), backend=backend, deterministic=deterministic,
                            deterministic_dk_planes=planes, d_index_k_f32=dk_dt == f32, d_weights_f32=dw_dt == f32,
                            target_sm_count=target_sm_count(dev) if sm100 else None)
        hints = {}
        if v2:
            rpc = ks["gemm"][1]["rows_per_cta"]
            hints["gemm"] = f" (the v2 kernel is compiled per ceil(B*S_q / CTAs) = {rpc}; add rows_per_cta = {rpc})"
        require(FAMILY, ks, dev, hints)  # every entry the call needs ships, before anything is allocated or written
    need = 0
    if not problems:
        need = policy.workspace_bytes(b, s_k, d, d_index_k_f32=dk_dt == f32, backend=backend, deterministic=deterministic,
                                      deterministic_dk_planes=planes)
        if need and not skip(workspace):
            named = (("index_q", index_q), ("weights", weights), ("index_k", index_k), ("attn_score", attn_score), ("index_score", index_score),
                     ("topk_indices", topk_indices), ("grad_loss", grad_loss), ("d_index_q", d_index_q), ("d_weights", d_weights),
                     ("d_index_k", d_index_k))
            problems += workspace_problems(workspace, need, dev, named, "dsa_aot.dsa.indexer_backward_workspace_bytes")
        elif workspace is not None and not isinstance(workspace, torch.Tensor):  # not needed, but given: a tensor or None
            problems.append(f"workspace: got {type(workspace).__name__} (expected None or a 1-D uint8 CUDA tensor)")
    if not problems:
        # attn_score is written too (the score-grad signal): it may alias nothing either
        problems += aliasing((("attn_score", attn_score), ("d_index_q", d_index_q), ("d_weights", d_weights), ("d_index_k", d_index_k)),
                             (("index_q", index_q), ("weights", weights), ("index_k", index_k), ("index_score", index_score),
                              ("topk_indices", topk_indices), ("grad_loss", grad_loss)))  # None: allocated, aliases nothing
    if problems:
        raise input_error(problems)
    ts = (d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, workspace)
    # written: the three outputs, attn_score (the score-grad signal) and the workspace bytes used
    foot = footprint(ts, writes=(0, 1, 2, 6, 10), masks=(15,) * 10 + ((15,) if need else (0,)), sizes={10: need})
    return _Call(dev, arch, b, s_q, s_k, h, d, topk, need, ks, foot)


# --- torch.library (dsa_aot.library registers these as torch.ops.dsa_aot.<name>: schema, CUDA impl, fake) ---
# On torch's current stream. attn_score is overwritten with the score-grad signal: annotated as mutated.


def _t_backward(index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, sm_scale=1.0, loss_coeff=1.0, block_I=128,
                topk_indices_global=False, backend="default", deterministic=False, deterministic_dk_planes=DEFAULT_PLANES):
    return tuple(indexer_backward(index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, sm_scale, loss_coeff, block_I,
                                  topk_indices_global, backend=backend, deterministic=deterministic, deterministic_dk_planes=deterministic_dk_planes))


def _f_backward(index_q, weights, index_k, *args, **kwargs):
    return index_q.new_empty(index_q.shape), weights.new_empty(weights.shape), index_k.new_empty(index_k.shape)


def _t_backward_into(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, sm_scale=1.0,
                     loss_coeff=1.0, block_I=128, topk_indices_global=False, backend="default", workspace=None, deterministic=False,
                     deterministic_dk_planes=DEFAULT_PLANES):
    indexer_backward_into(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, sm_scale,
                          loss_coeff, block_I, topk_indices_global, backend=backend, workspace=workspace, deterministic=deterministic,
                          deterministic_dk_planes=deterministic_dk_planes)


_IN = "Tensor index_q, Tensor weights, Tensor index_k, Tensor(a!) attn_score, Tensor index_score, Tensor topk_indices, Tensor grad_loss"
_OPTS = ("float sm_scale=1.0, float loss_coeff=1.0, int block_I=128, bool topk_indices_global=False, str backend=\"default\"")
_DET = f"bool deterministic=False, int deterministic_dk_planes={DEFAULT_PLANES}"
TORCH_OPS = {
    "dsa_indexer_backward": (f"({_IN}, {_OPTS}, {_DET}) -> (Tensor, Tensor, Tensor)", _t_backward, _f_backward),
    "dsa_indexer_backward_into": (f"(Tensor(b!) d_index_q, Tensor(c!) d_weights, Tensor(d!) d_index_k, {_IN}, {_OPTS}, Tensor(e!)? workspace=None, "
                                  f"{_DET}) -> ()", _t_backward_into, writes_only),
}  # fmt: skip
