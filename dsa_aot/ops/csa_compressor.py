"""CSA compressor ops: cudnn's csa_compressor_{forward,backward}_wrapper, launched from shipped cubins.

Which compiled entry serves a call is :mod:`dsa_aot.policy.csa_compressor`, checked against upstream's
schedule functions on every build.
"""

from __future__ import annotations

from ..policy import csa_compressor as policy
from ._support import (aliasing, alloc_on, allocate, check, flag, footprint, input_error, integer, launcher, one_of, overlapping, require,
                       sm_count_of, stream_handle, writes_only)
from .outputs import Outputs
from .library import call
from .plan import ALLOC, Plan, Recorder, cached, compile_call, fresh, probe_for, remember, remembered

__all__ = ["compressor", "compressor_forward", "compressor_backward", "compressor_forward_into", "compressor_backward_into",
           "backward_workspace_bytes", "CompressorForward", "CompressorBackward"]

FAMILY = policy.FAMILY
_I32 = 2**31


def _rows_r128(total_comp, head_dim, coff, dev) -> int:
    """rows_per_cta of a ratio-128 backward on GPU ``dev`` (upstream reads the device's SM count)."""
    _, key = policy.backward_kernels(128, head_dim, coff, total_comp, True)["main"]
    entry = launcher(FAMILY, "bwd_r128", key, dev, _hint(128)).entry
    return policy.rows_r128(total_comp, head_dim, coff, entry["key"]["schedule"], sm_count_of(dev))


def backward_workspace_bytes(total_comp, ratio, head_dim, coff, device=None) -> int:
    """Bytes of uint8 workspace the deterministic backward needs (0 when total_comp == 0)."""
    problems = []
    integer(problems, "total_comp", total_comp, 0, _I32 - 1)
    one_of(problems, "ratio", ratio, (2, 4, 128))
    one_of(problems, "coff", coff, (1, 2))
    integer(problems, "head_dim", head_dim, 1, policy.MAX_HEAD_DIM)
    if not (device is None or (isinstance(device, (int, str)) and not isinstance(device, bool)) or type(device).__name__ == "device"):
        problems.append(f"device={device!r} (expected None, an int, 'cuda:N' or a torch.device)")  # checked where unused too (ratio != 128)
    if problems:
        raise input_error(problems)
    if total_comp == 0:
        return 0
    rows = None
    if ratio == 128:
        from ..runtime.device import device_index

        rows = _rows_r128(total_comp, head_dim, coff, device_index(device))
    return policy.backward_workspace(total_comp, ratio, head_dim, coff, rows)[2]


def _common(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp):
    """Validate the inputs both ops share; return (problems, dev, head_dim, total_tokens, width)."""
    import torch

    problems = []
    one_of(problems, "ratio", ratio, (2, 4, 128))
    one_of(problems, "coff", coff, (1, 2))
    if head_dim is not None:
        integer(problems, "head_dim", head_dim, 1, policy.MAX_HEAD_DIM)
    if not isinstance(kv, torch.Tensor) or kv.layout != torch.strided or kv.ndim != 2:
        problems.append(f"kv: must be a dense 2-D tensor (total_tokens, coff * head_dim), got {getattr(kv, 'shape', type(kv).__name__)}")
    if problems:
        raise input_error(problems)
    dev = kv.device.index if kv.device.type == "cuda" else None
    total_tokens, width = kv.shape
    if head_dim is None:
        head_dim = width // coff
    if width != coff * head_dim:
        problems.append(f"kv: width {width} (expected coff * head_dim = {coff} * {head_dim})")
    if not 1 <= head_dim <= policy.MAX_HEAD_DIM:
        problems.append(f"head_dim={head_dim} (expected 1..{policy.MAX_HEAD_DIM})")
    if ratio == 128 and head_dim not in policy.R128_HEAD_DIMS:
        problems.append(f"head_dim={head_dim} at ratio 128 (expected 128 or 512, upstream's validated envelope)")
    n = cu_seqlens.shape[0] if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.layout == torch.strided and cu_seqlens.ndim == 1 else 0
    if n < 2:
        problems.append(f"cu_seqlens: shape {tuple(getattr(cu_seqlens, 'shape', ()))} (expected (B + 1,) with B >= 1)")
    check(problems, kv, "kv", (total_tokens, width), torch.bfloat16, dev, 16)
    check(problems, score, "score", (total_tokens, width), torch.bfloat16, dev, 16)
    check(problems, ape, "ape", (ratio, width), torch.float32, dev, 16)
    check(problems, cu_seqlens, "cu_seqlens", (max(n, 2),), torch.int32, dev, 4)
    check(problems, cu_seqlens_comp, "cu_seqlens_comp", (max(n, 2),), torch.int32, dev, 4)
    if n >= _I32:
        problems.append(f"cu_seqlens: {n - 1} sequences (expected < 2**31)")
    if total_tokens * width >= _I32:
        problems.append(f"total_tokens * coff * head_dim = {total_tokens * width} (expected < 2**31: the kernels use int32 offsets)")
    if total_comp is not None and total_comp * head_dim >= _I32:
        problems.append(f"total_comp * head_dim = {total_comp * head_dim} (expected < 2**31)")
    if total_comp is not None and total_comp > 0 and total_tokens < ratio:
        problems.append(f"total_comp={total_comp} > 0 needs at least ratio={ratio} tokens, got total_tokens={total_tokens}")
    return problems, dev, head_dim, total_tokens, width


def _hint(ratio):
    return " (the ratio-128 bucket policy is in dsa_aot/policy/csa_compressor.py)" if ratio == 128 else ""


# --- ops ---------------------------------------------------------------------------------------------

# signature (types, shapes, dtypes, devices, layouts, contiguity, options) -> the compiled Call: it proves
# every check but the per-call ones (pointer alignment, outputs overlapping anything: recheck(); the
# stream), which every call makes again
_FWD: dict = {}
_BWD: dict = {}
_FWD_TENSORS = ("out", "kv", "score", "ape", "cu_seqlens", "cu_seqlens_comp")
_BWD_TENSORS = ("grad_kv", "grad_score", "grad_ape", "kv", "score", "ape", "cu_seqlens", "cu_seqlens_comp", "grad_out", "workspace")


def compressor_forward_into(out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, head_dim=None, coff=2, stream=None):
    """Forward into caller-provided ``out`` (total_comp, head_dim) bf16; same contract as cudnn's execute().

    Capture-safe from the first call (loading a cubin is not stream work, see dsa_aot.runtime);
    ``dsa_aot.runtime.preload()`` before capturing keeps the file reads out of the capture."""
    ts = (out, kv, score, ape, cu_seqlens, cu_seqlens_comp)
    call, p = cached(_FWD, ts, (ratio, head_dim, coff),
                     lambda: _plan_forward(out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff))
    call.run(p, stream_handle(stream, call.dev), call.x, ts, stream)
    return out


def _plan_forward(out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, head_dim=None, coff=2):
    """Validate a forward call and compile what it does (:class:`dsa_aot.ops.plan.Call`)."""
    import torch

    total_comp = out.shape[0] if isinstance(out, torch.Tensor) and out.layout == torch.strided and out.ndim == 2 else None
    problems, dev, head_dim, total_tokens, width = _common(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp)
    check(problems, out, "out", (total_comp if total_comp is not None else -1, head_dim), torch.bfloat16, dev, 16)
    if not problems:
        problems += aliasing((("out", out),), (("kv", kv), ("score", score), ("ape", ape), ("cu_seqlens", cu_seqlens), ("cu_seqlens_comp", cu_seqlens_comp)))
    if problems:
        raise input_error(problems)
    ts = (out, kv, score, ape, cu_seqlens, cu_seqlens_comp)
    rec = Recorder(len(ts))
    p = rec.p
    if total_comp:
        launch = launcher(FAMILY, *policy.forward_kernel(ratio, head_dim, coff, total_comp), dev, _hint(ratio))
        rec.launch(launch, p[1], p[2], p[3], p[4], p[5], p[0], total_comp, cu_seqlens.shape[0] - 1, rec.s)
    foot = footprint(ts, writes=(0,), masks=(15, 15, 15, 15, 3, 3))
    return compile_call("csa_compressor.fwd", rec, dev, ts, foot)


class CompressorForward(Plan):
    """cudnn's CSACompressorForward shape: ``CompressorForward(out, kv, score, ape, cu_seqlens,
    cu_seqlens_comp, ratio=4, head_dim=None, coff=2)`` validates and resolves everything once;
    ``execute(out, kv, score, ape, cu_seqlens, cu_seqlens_comp, stream=None)`` then launches on tensors
    of the same shapes (see :class:`dsa_aot.ops.plan.Plan`)."""

    _build = staticmethod(_plan_forward)
    _tensors = _FWD_TENSORS


def compressor_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, head_dim=None, coff=2, total_comp=None, stream=None):
    """cudnn's csa_compressor_forward_wrapper: returns {'out': (total_comp, head_dim) bf16}.

    ``total_comp`` defaults to ``cu_seqlens_comp[-1]`` (a device sync); pass it to stay capture-safe.
    """
    import torch

    ins, extra = (kv, score, ape, cu_seqlens, cu_seqlens_comp), (ratio, head_dim, coff, total_comp)
    hit = remembered(_FWD, ALLOC, ins, extra) if total_comp is not None else None
    if hit is not None:  # the same options, inputs like the last validated call's, aligned
        dev, hd, box = hit[0]
        s = stream_handle(stream, dev)
    else:
        if total_comp is not None:
            bad = []
            integer(bad, "total_comp", total_comp, 0, _I32 - 1)
            if bad:
                raise input_error(bad)
        problems, dev, hd, *_ = _common(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp)
        if problems:
            raise input_error(problems)
        s = stream_handle(stream, dev)  # refuse a bad stream before allocating on it
        box = [None]  # the _into call, once known (plan.fresh)
        if total_comp is None:  # a device sync: what cudnn's wrapper does too
            total_comp = int(cu_seqlens_comp[-1].item())
            problems = _common(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp)[0]
            if total_comp < 0 or problems:
                raise input_error(problems or [f"cu_seqlens_comp[-1] = {total_comp} (expected >= 0)"])
        if total_comp:
            require(FAMILY, {"main": policy.forward_kernel(ratio, hd, coff, total_comp)}, dev, {"main": _hint(ratio)})
        if extra[3] is not None:
            remember(_FWD, ALLOC, extra, probe_for(ins, dev, footprint(ins, writes=(), masks=(15, 15, 15, 3, 3))), (dev, hd, box))
    with alloc_on(stream, dev):
        out = allocate(lambda: torch.empty(total_comp, hd, dtype=torch.bfloat16, device=kv.device))
    ts = (out, *ins)
    call, p = fresh(box, _FWD, ts, (ratio, head_dim, coff), lambda: _plan_forward(*ts, ratio, head_dim, coff))
    call.run(p, s, call.x, ts, stream)
    return Outputs(out=out)


def compressor_backward_into(grad_kv, grad_score, grad_ape, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out,
                             ratio=4, head_dim=None, coff=2, stream=None, deterministic=False, workspace=None):
    """Backward into caller-provided grads; same contract as cudnn's CSACompressorBackward.execute().

    grad_kv / grad_score are fully written; grad_ape must be zeroed by the caller on the atomic path
    (deterministic=False) and is fully overwritten on the deterministic path, which needs ``workspace``
    of ``backward_workspace_bytes(...)`` uint8 bytes. Nothing is written before every input is checked.
    """
    ts = (grad_kv, grad_score, grad_ape, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, workspace)
    call, p = cached(_BWD, ts, (ratio, head_dim, coff, deterministic),
                     lambda: _plan_backward(*ts[:9], ratio, head_dim, coff, deterministic, workspace))
    if call.guard is not None:
        call.guard()
    call.run(p, stream_handle(stream, call.dev), call.x, ts, stream)
    return grad_kv, grad_score, grad_ape


def _atomic_guard(launches: bool):
    """Per call of the atomic (non-deterministic) backward: torch's deterministic mode refuses it (or warns)."""
    import torch

    def guard():
        if torch.are_deterministic_algorithms_enabled():
            if not torch.is_deterministic_algorithms_warn_only_enabled():
                raise input_error(["deterministic=False: the CSA compressor backward accumulates dAPE with fp32 atomics, and "
                                   "torch.use_deterministic_algorithms(True) is set; call it with deterministic=True"])
            if launches:
                import warnings

                warnings.warn("CSA compressor backward accumulates dAPE with fp32 atomics and is not deterministic; "
                              "torch.use_deterministic_algorithms(True, warn_only=True) is set. Call it with deterministic=True", RuntimeWarning,
                              stacklevel=3)

    return guard


def _plan_backward(grad_kv, grad_score, grad_ape, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio=4, head_dim=None, coff=2,
                   deterministic=False, workspace=None):
    """Validate a backward call and compile what it does (:class:`dsa_aot.ops.plan.Call`)."""
    import torch

    total_comp = grad_out.shape[0] if isinstance(grad_out, torch.Tensor) and grad_out.layout == torch.strided and grad_out.ndim == 2 else None
    flags = []
    deterministic = flag(flags, "deterministic", deterministic)
    problems, dev, head_dim, total_tokens, width = _common(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp)
    problems = flags + problems
    if total_comp is None:
        problems.append(f"grad_out: must be a dense 2-D tensor (total_comp, head_dim), got {getattr(grad_out, 'shape', type(grad_out).__name__)}")
        raise input_error(problems)
    check(problems, grad_out, "grad_out", (total_comp, head_dim), torch.bfloat16, dev, 16)
    check(problems, grad_kv, "grad_kv", (total_tokens, width), torch.bfloat16, dev, 16)
    check(problems, grad_score, "grad_score", (total_tokens, width), torch.bfloat16, dev, 16)
    check(problems, grad_ape, "grad_ape", (ratio, width), torch.float32, dev, 16)
    if not deterministic and workspace is not None:
        problems.append("workspace: given, but deterministic=False uses the atomic dAPE path (pass workspace=None)")
    inputs = (("kv", kv), ("score", score), ("ape", ape), ("cu_seqlens", cu_seqlens), ("cu_seqlens_comp", cu_seqlens_comp), ("grad_out", grad_out))
    outputs = (("grad_kv", grad_kv), ("grad_score", grad_score), ("grad_ape", grad_ape))
    if not problems:
        problems += aliasing(outputs, inputs)
    if problems:
        raise input_error(problems)
    guard = None if deterministic else _atomic_guard(bool(total_comp))
    if guard is not None:
        guard()  # refused before anything is resolved
    ts = (grad_kv, grad_score, grad_ape, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, workspace)
    rec = Recorder(len(ts))
    p, s = rec.p, rec.s
    need = 0
    if total_comp:
        ks = policy.backward_kernels(ratio, head_dim, coff, total_comp, deterministic)
        launch = launcher(FAMILY, *ks["main"], dev, _hint(ratio))
        rows = policy.rows_r128(total_comp, head_dim, coff, launch.entry["key"]["schedule"], sm_count_of(dev)) if ratio == 128 else None
        npartials, split, need = policy.backward_workspace(total_comp, ratio, head_dim, coff, rows)
        if deterministic:
            wp = []
            check(wp, workspace, "workspace", (workspace.numel() if isinstance(workspace, torch.Tensor) and workspace.layout == torch.strided else need,),
                  torch.uint8, dev, 16)
            if not wp and workspace.numel() < need:
                wp.append(f"workspace: {workspace.numel()} bytes (expected at least {need}; see dsa_aot.csa.backward_workspace_bytes)")
            if not wp:
                wp += [f"workspace: overlaps {(inputs + outputs)[i][0]}" for i in overlapping(workspace, need, [t for _, t in inputs + outputs])]
            if wp:
                raise input_error(wp)
        partial = p[9] if deterministic else p[2]
        n_seq = cu_seqlens.shape[0] - 1
        args = (*p[3:8], p[8], p[0], p[1], partial, total_comp, n_seq, total_tokens, *((rows,) if ratio == 128 else ()), s)
        rec.launch(launch, *args)
        if deterministic:
            nelems = ratio * width
            stage = partial + (npartials * nelems * 4 if split else 0)
            rec.launch(launcher(FAMILY, *ks["reduce"], dev), partial, stage, p[2], npartials, nelems, s)
    elif deterministic and workspace is not None:
        wp = []
        check(wp, workspace, "workspace", (workspace.numel() if isinstance(workspace, torch.Tensor) and workspace.layout == torch.strided else 0,),
              torch.uint8, dev, 16)
        if wp:
            raise input_error(wp)
    foot = footprint(ts, writes=(0, 1, 2, 9), masks=(15, 15, 15, 15, 15, 15, 3, 3, 15, 15), sizes={9: need})
    return compile_call("csa_compressor.bwd", rec, dev, ts, foot, guard=guard)


class CompressorBackward(Plan):
    """cudnn's CSACompressorBackward shape: ``CompressorBackward(grad_kv, grad_score, grad_ape, kv, score,
    ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio=4, head_dim=None, coff=2, deterministic=False,
    workspace=None)``; ``execute(grad_kv, grad_score, grad_ape, kv, score, ape, cu_seqlens,
    cu_seqlens_comp, grad_out, workspace=None, stream=None)`` (see :class:`dsa_aot.ops.plan.Plan`)."""

    _build = staticmethod(_plan_backward)
    _tensors = _BWD_TENSORS


def _validate_backward_allocating(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, head_dim, coff, stream, deterministic):
    """The allocating backward's checks before it allocates: (device, total_comp, workspace bytes, deterministic)."""
    import torch

    problems = []
    deterministic = flag(problems, "deterministic", deterministic)
    total_comp = grad_out.shape[0] if isinstance(grad_out, torch.Tensor) and grad_out.layout == torch.strided and grad_out.ndim == 2 else None
    if total_comp is None:
        problems.append(f"grad_out: must be a dense 2-D tensor (total_comp, head_dim), got {getattr(grad_out, 'shape', type(grad_out).__name__)}")
        raise input_error(problems)
    flags = problems
    problems, dev, head_dim, *_ = _common(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp)
    problems = flags + problems
    check(problems, grad_out, "grad_out", (total_comp, head_dim), torch.bfloat16, dev, 16)
    if problems:
        raise input_error(problems)
    stream_handle(stream, dev)  # refuse a bad stream before allocating on it
    if total_comp:
        require(FAMILY, policy.backward_kernels(ratio, head_dim, coff, total_comp, deterministic), dev, {"main": _hint(ratio)})
    n = backward_workspace_bytes(total_comp, ratio, head_dim, coff, dev) if deterministic and total_comp else 0
    return dev, total_comp, n, deterministic


def compressor_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio=4, head_dim=None, coff=2, stream=None, deterministic=False):
    """cudnn's csa_compressor_backward_wrapper: returns {'grad_kv', 'grad_score', 'grad_ape'}."""
    import torch

    ins, extra = (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out), (ratio, head_dim, coff, deterministic)
    hit = remembered(_BWD, ALLOC, ins, extra)
    if hit is not None:  # the same options, inputs like the last validated call's, aligned
        dev, total_comp, n, deterministic, box = hit[0]
    else:
        dev, total_comp, n, deterministic = _validate_backward_allocating(*ins, ratio, head_dim, coff, stream, deterministic)
        box = [None]  # the _into call, once known (plan.fresh)
        remember(_BWD, ALLOC, extra, probe_for(ins, dev, footprint(ins, writes=(), masks=(15, 15, 15, 3, 3, 15))), (dev, total_comp, n, deterministic, box))
    s = stream_handle(stream, dev)

    def outputs():
        with alloc_on(stream, dev):
            gkv = torch.zeros_like(kv) if total_comp == 0 else torch.empty_like(kv)
            gs = torch.zeros_like(score) if total_comp == 0 else torch.empty_like(score)
            gape = torch.empty_like(ape) if deterministic and total_comp else torch.zeros_like(ape)
            ws = torch.empty(n, dtype=torch.uint8, device=kv.device) if n else None
        return gkv, gs, gape, ws

    gkv, gs, gape, ws = allocate(outputs)
    ts = (gkv, gs, gape, *ins, ws)
    call, p = fresh(box, _BWD, ts, (ratio, head_dim, coff, deterministic),
                    lambda: _plan_backward(*ts[:9], ratio, head_dim, coff, deterministic, ws))
    if call.guard is not None:
        call.guard()
    call.run(p, s, call.x, ts, stream)
    return Outputs(grad_kv=gkv, grad_score=gs, grad_ape=gape)


def compressor(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, head_dim=None, coff=2, total_comp=None, deterministic=False):
    """The CSA compressor as one differentiable op (``torch.ops.dsa_aot.csa_compressor``): returns
    ``out`` (total_comp, head_dim) bf16, computed by :func:`compressor_forward`, with
    :func:`compressor_backward` as its autograd formula: gradients flow to ``kv``, ``score`` and
    ``ape`` (the backward's three outputs; the int32 ``cu_seqlens*`` have none). ``deterministic``
    is the backward's (fixed-order dAPE instead of fp32 atomics). Runs on torch's current stream,
    traces under ``torch.compile(fullgraph=True)`` and captures in CUDA graphs (forward and backward)
    when ``total_comp`` is given; None reads ``cu_seqlens_comp[-1]`` (a device sync), as the forward.
    Every argument is checked by the forward's own checks before anything runs."""
    return call("csa_compressor", kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp, deterministic)


# --- torch.library (dsa_aot.library registers these as torch.ops.dsa_aot.<name>: schema, CUDA impl, fake) ---
# The ops run on torch's current stream. Sizes the fake needs and a tensor cannot give (total_comp,
# whose value lives on the device) are arguments.


def _t_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, head_dim=None):
    return compressor_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp)["out"]


def _f_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, head_dim=None):
    return kv.new_empty((total_comp, head_dim if head_dim is not None else kv.shape[1] // coff))


def _t_forward_into(out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim=None):
    compressor_forward_into(out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff)


def _t_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, deterministic=False, head_dim=None):
    return tuple(compressor_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, head_dim, coff, None, deterministic))


def _f_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, deterministic=False, head_dim=None):
    return kv.new_empty(kv.shape), score.new_empty(score.shape), ape.new_empty(ape.shape)


def _t_backward_into(grad_kv, grad_score, grad_ape, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, deterministic=False,
                     workspace=None, head_dim=None):
    compressor_backward_into(grad_kv, grad_score, grad_ape, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, head_dim, coff, None,
                             deterministic, workspace)


def _t_compressor(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, head_dim=None, coff=2, total_comp=None, deterministic=False):
    return compressor_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp)["out"]


def _f_compressor(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, head_dim=None, coff=2, total_comp=None, deterministic=False):
    if total_comp is None:  # cu_seqlens_comp[-1]: a value on the device, a data-dependent size for the tracer
        import torch

        total_comp = torch.library.get_ctx().new_dynamic_size()
    return _f_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, head_dim)


def _compressor_setup(ctx, inputs, output):
    kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, _, deterministic = inputs
    ctx.save_for_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp)
    ctx.options = ratio, coff, deterministic, head_dim


def _compressor_grad(ctx, grad_out):
    """The backward op on the saved inputs: (grad_kv, grad_score, grad_ape), the rest None."""
    import torch

    ratio, coff, deterministic, head_dim = ctx.options
    grads = torch.ops.dsa_aot.csa_compressor_backward(*ctx.saved_tensors, grad_out.contiguous(), ratio, coff, deterministic, head_dim)
    return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), *(None,) * 7)


_IN = "Tensor kv, Tensor score, Tensor ape, Tensor cu_seqlens, Tensor cu_seqlens_comp"
TORCH_OPS = {
    "csa_compressor_forward": (f"({_IN}, int ratio, int coff, SymInt total_comp, SymInt? head_dim=None) -> Tensor", _t_forward, _f_forward),
    "csa_compressor_forward_into": (f"(Tensor(a!) out, {_IN}, int ratio, int coff, SymInt? head_dim=None) -> ()", _t_forward_into, writes_only),
    "csa_compressor_backward": (f"({_IN}, Tensor grad_out, int ratio, int coff, bool deterministic=False, SymInt? head_dim=None) -> (Tensor, Tensor, Tensor)",
                                _t_backward, _f_backward),
    "csa_compressor_backward_into": (f"(Tensor(a!) grad_kv, Tensor(b!) grad_score, Tensor(c!) grad_ape, {_IN}, Tensor grad_out, int ratio, int coff, "
                                     f"bool deterministic=False, Tensor(d!)? workspace=None, SymInt? head_dim=None) -> ()", _t_backward_into, writes_only),
    "csa_compressor": (f"({_IN}, int ratio=4, SymInt? head_dim=None, int coff=2, SymInt? total_comp=None, bool deterministic=False) -> Tensor",
                       _t_compressor, _f_compressor, (_compressor_setup, _compressor_grad)),
}  # fmt: skip
