"""CSA compressor ops: cudnn's csa_compressor_{forward,backward}_wrapper, launched from shipped cubins.

Which compiled entry serves a call is :mod:`aot.policy.csa_compressor`, checked against upstream's
schedule functions on every build.
"""

from __future__ import annotations

from ..policy import csa_compressor as policy
from ._support import alloc_on, check, input_error, launcher, overlapping, signature, sm_count_of, stream_handle
from .outputs import Outputs

__all__ = ["compressor_forward", "compressor_backward", "compressor_forward_into", "compressor_backward_into", "backward_workspace_bytes"]

FAMILY = policy.FAMILY
_I32 = 2**31


def _rows_r128(total_comp, head_dim, coff, dev) -> int:
    """rows_per_cta of a ratio-128 backward on GPU ``dev`` (upstream reads the device's SM count)."""
    _, key = policy.backward_kernels(128, head_dim, coff, total_comp, True)["main"]
    entry = launcher(FAMILY, "bwd_r128", key, dev, _hint(128)).entry
    return policy.rows_r128(total_comp, head_dim, coff, entry["key"]["schedule"], sm_count_of(dev))


def backward_workspace_bytes(total_comp, ratio, head_dim, coff, device=None) -> int:
    """Bytes of uint8 workspace the deterministic backward needs (0 when total_comp == 0)."""
    if total_comp <= 0:
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
    if ratio not in (2, 4, 128):
        problems.append(f"ratio={ratio!r} (expected 2, 4 or 128)")
    if coff not in (1, 2):
        problems.append(f"coff={coff!r} (expected 1 or 2)")
    if not isinstance(kv, torch.Tensor) or kv.ndim != 2:
        problems.append(f"kv: must be a 2-D tensor (total_tokens, coff * head_dim), got {getattr(kv, 'shape', type(kv).__name__)}")
        raise input_error(problems)
    dev = kv.device.index if kv.device.type == "cuda" else None
    total_tokens, width = kv.shape
    if head_dim is None:
        head_dim = width // coff if coff in (1, 2) else 0
    if coff in (1, 2) and width != coff * head_dim:
        problems.append(f"kv: width {width} (expected coff * head_dim = {coff} * {head_dim})")
    if head_dim < 1 or head_dim > policy.MAX_HEAD_DIM:
        problems.append(f"head_dim={head_dim} (expected 1..{policy.MAX_HEAD_DIM})")
    if ratio == 128 and head_dim not in policy.R128_HEAD_DIMS:
        problems.append(f"head_dim={head_dim} at ratio 128 (expected 128 or 512, upstream's validated envelope)")
    n = getattr(cu_seqlens, "shape", (0,))[0] if getattr(cu_seqlens, "ndim", 0) == 1 else 0
    if n < 2:
        problems.append(f"cu_seqlens: shape {tuple(getattr(cu_seqlens, 'shape', ()))} (expected (B + 1,) with B >= 1)")
    check(problems, kv, "kv", (total_tokens, width), torch.bfloat16, dev, 16)
    check(problems, score, "score", (total_tokens, width), torch.bfloat16, dev, 16)
    check(problems, ape, "ape", (ratio, width), torch.float32, dev, 16)
    check(problems, cu_seqlens, "cu_seqlens", (max(n, 2),), torch.int32, dev, 4)
    check(problems, cu_seqlens_comp, "cu_seqlens_comp", (max(n, 2),), torch.int32, dev, 4)
    if total_tokens * width >= _I32:
        problems.append(f"total_tokens * coff * head_dim = {total_tokens * width} (expected < 2**31: the kernels use int32 offsets)")
    if total_comp is not None and total_comp * head_dim >= _I32:
        problems.append(f"total_comp * head_dim = {total_comp * head_dim} (expected < 2**31)")
    if total_comp is not None and total_comp > 0 and total_tokens < ratio:
        problems.append(f"total_comp={total_comp} > 0 needs at least ratio={ratio} tokens, got total_tokens={total_tokens}")
    return problems, dev, head_dim, total_tokens, width


def _hint(ratio):
    return " (the ratio-128 bucket policy is in aot/policy/csa_compressor.py)" if ratio == 128 else ""


# --- ops ---------------------------------------------------------------------------------------------

# signature (shapes, dtypes, devices, contiguity, options) -> what a repeated call needs: it skips the
# full validation; pointer alignment is checked per call
_FWD_FAST: dict = {}
_FAST_MAX = 4096


def compressor_forward_into(out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, head_dim=None, coff=2, stream=None):
    """Forward into caller-provided ``out`` (total_comp, head_dim) bf16; same contract as cudnn's execute()."""
    sig = signature((out, kv, score, ape, cu_seqlens, cu_seqlens_comp), (ratio, head_dim, coff))
    hit = _FWD_FAST.get(sig)
    if hit is not None:
        p0, p1, p2, p3, p4, p5 = kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu_seqlens.data_ptr(), cu_seqlens_comp.data_ptr(), out.data_ptr()
        if not ((p0 | p1 | p2 | p5) & 15 or (p3 | p4) & 3):
            launch, total_comp, n_seq, dev = hit
            if launch is not None:
                launch(p0, p1, p2, p3, p4, p5, total_comp, n_seq, stream_handle(stream, dev))
            return out
    return _forward_into_slow(sig, out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, stream)


def _forward_into_slow(sig, out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, stream):
    import torch

    total_comp = out.shape[0] if isinstance(out, torch.Tensor) and out.ndim == 2 else None
    problems, dev, head_dim, total_tokens, width = _common(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp)
    check(problems, out, "out", (total_comp if total_comp is not None else -1, head_dim), torch.bfloat16, dev, 16)
    if problems:
        raise input_error(problems)
    launch = None
    if total_comp:
        launch = launcher(FAMILY, *policy.forward_kernel(ratio, head_dim, coff, total_comp), dev, _hint(ratio))
        launch(kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu_seqlens.data_ptr(), cu_seqlens_comp.data_ptr(), out.data_ptr(),
               total_comp, cu_seqlens.shape[0] - 1, stream_handle(stream, dev))
    if sig is not None and len(_FWD_FAST) < _FAST_MAX:
        _FWD_FAST[sig] = (launch, total_comp, cu_seqlens.shape[0] - 1, dev)
    return out


def compressor_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, head_dim=None, coff=2, total_comp=None, stream=None):
    """cudnn's csa_compressor_forward_wrapper: returns {'out': (total_comp, head_dim) bf16}.

    ``total_comp`` defaults to ``cu_seqlens_comp[-1]`` (a device sync); pass it to stay capture-safe.
    """
    import torch

    hd = head_dim if head_dim is not None else (kv.shape[1] // coff if isinstance(kv, torch.Tensor) and kv.ndim == 2 and coff in (1, 2) else None)
    if total_comp is None or hd is None or hd < 1 or total_comp < 0:
        problems, dev, hd, *_ = _common(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp)
        if problems:
            raise input_error(problems)
        if total_comp is None:
            total_comp = int(cu_seqlens_comp[-1].item())
    with alloc_on(stream):
        out = torch.empty(int(total_comp), hd, dtype=torch.bfloat16, device=kv.device)
    compressor_forward_into(out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, stream)
    return Outputs(out=out)


def compressor_backward_into(grad_kv, grad_score, grad_ape, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out,
                             ratio=4, head_dim=None, coff=2, stream=None, deterministic=False, workspace=None):
    """Backward into caller-provided grads; same contract as cudnn's CSACompressorBackward.execute().

    grad_kv / grad_score are fully written; grad_ape must be zeroed by the caller on the atomic path
    (deterministic=False) and is fully overwritten on the deterministic path, which needs ``workspace``
    of ``backward_workspace_bytes(...)`` uint8 bytes.
    """
    import torch

    total_comp = grad_out.shape[0] if isinstance(grad_out, torch.Tensor) and grad_out.ndim == 2 else None
    problems, dev, head_dim, total_tokens, width = _common(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp)
    if total_comp is None:
        problems.append(f"grad_out: must be 2-D (total_comp, head_dim), got {getattr(grad_out, 'shape', type(grad_out).__name__)}")
        raise input_error(problems)
    check(problems, grad_out, "grad_out", (total_comp, head_dim), torch.bfloat16, dev, 16)
    check(problems, grad_kv, "grad_kv", (total_tokens, width), torch.bfloat16, dev, 16)
    check(problems, grad_score, "grad_score", (total_tokens, width), torch.bfloat16, dev, 16)
    check(problems, grad_ape, "grad_ape", (ratio, width), torch.float32, dev, 16)
    if not deterministic and workspace is not None:
        problems.append("workspace: given, but deterministic=False uses the atomic dAPE path (pass workspace=None)")
    if problems:
        raise input_error(problems)
    if not deterministic and torch.are_deterministic_algorithms_enabled():
        msg = ("CSA compressor backward accumulates dAPE with fp32 atomics and is not deterministic; "
               "torch.use_deterministic_algorithms(True) is set. Call it with deterministic=True")
        if torch.is_deterministic_algorithms_warn_only_enabled():
            import warnings

            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        else:
            raise RuntimeError(msg)
    if total_comp == 0:
        return grad_kv, grad_score, grad_ape
    ks = policy.backward_kernels(ratio, head_dim, coff, total_comp, deterministic)
    launch = launcher(FAMILY, *ks["main"], dev, _hint(ratio))
    rows = policy.rows_r128(total_comp, head_dim, coff, launch.entry["key"]["schedule"], sm_count_of(dev)) if ratio == 128 else None
    npartials, split, need = policy.backward_workspace(total_comp, ratio, head_dim, coff, rows)
    if deterministic:
        wp = []
        check(wp, workspace, "workspace", (workspace.numel() if isinstance(workspace, torch.Tensor) else need,), torch.uint8, dev, 16)
        if not wp and workspace.numel() < need:
            wp.append(f"workspace: {workspace.numel()} bytes (expected at least {need}; see aot.csa.backward_workspace_bytes)")
        if not wp:
            named = (("kv", kv), ("score", score), ("ape", ape), ("cu_seqlens", cu_seqlens), ("cu_seqlens_comp", cu_seqlens_comp),
                     ("grad_out", grad_out), ("grad_kv", grad_kv), ("grad_score", grad_score), ("grad_ape", grad_ape))
            wp += [f"workspace: overlaps {named[i][0]}" for i in overlapping(workspace, need, [t for _, t in named])]
        if wp:
            raise input_error(wp)
        reduce_ = launcher(FAMILY, *ks["reduce"], dev)
    s = stream_handle(stream, dev)
    partial = workspace.data_ptr() if deterministic else grad_ape.data_ptr()
    ptrs = (kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu_seqlens.data_ptr(), cu_seqlens_comp.data_ptr(),
            grad_out.data_ptr(), grad_kv.data_ptr(), grad_score.data_ptr(), partial)
    n_seq = cu_seqlens.shape[0] - 1
    if ratio == 128:
        launch(*ptrs, total_comp, n_seq, total_tokens, rows, s)
    else:
        launch(*ptrs, total_comp, n_seq, total_tokens, s)
    if deterministic:
        nelems = ratio * width
        stage = partial + (npartials * nelems * 4 if split else 0)
        reduce_(partial, stage, grad_ape.data_ptr(), npartials, nelems, s)
    return grad_kv, grad_score, grad_ape


def compressor_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio=4, head_dim=None, coff=2, stream=None, deterministic=False):
    """cudnn's csa_compressor_backward_wrapper: returns {'grad_kv', 'grad_score', 'grad_ape'}."""
    import torch

    problems, dev, head_dim, *_ = _common(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, None)
    if problems:
        raise input_error(problems)
    if not isinstance(grad_out, torch.Tensor) or grad_out.ndim != 2:
        raise input_error([f"grad_out: must be 2-D (total_comp, head_dim), got {getattr(grad_out, 'shape', type(grad_out).__name__)}"])
    total_comp = grad_out.shape[0]
    with torch.cuda.device(dev):
        with alloc_on(stream):
            if total_comp == 0:
                gkv, gs = torch.zeros_like(kv), torch.zeros_like(score)
            else:
                gkv, gs = torch.empty_like(kv), torch.empty_like(score)
            gape = torch.empty_like(ape) if deterministic and total_comp else torch.zeros_like(ape)
            ws = torch.empty(backward_workspace_bytes(total_comp, ratio, head_dim, coff, dev), dtype=torch.uint8, device=kv.device) if deterministic and total_comp else None
    compressor_backward_into(gkv, gs, gape, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, head_dim, coff, stream, deterministic, ws)
    return Outputs(grad_kv=gkv, grad_score=gs, grad_ape=gape)
