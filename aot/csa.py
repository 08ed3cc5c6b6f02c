"""CSA compressor ops: cudnn's csa_compressor_{forward,backward}_wrapper, launched from shipped cubins.

Bucket policy (which compiled entry serves a call) is data here, and the build proves it equal to
upstream's schedule functions for every bucket it ships (kernels/csa_compressor.py).
"""

from __future__ import annotations

__all__ = [
    "compressor_forward",
    "compressor_backward",
    "compressor_forward_into",
    "compressor_backward_into",
    "backward_workspace_bytes",
    "bucket_of",
    "bucket_range",
]

# nb_total (= total_comp, output rows) ranges of the ratio-128 schedule buckets, inclusive.
# Upstream: compressor_sm100_r128._SMALL_NB_MAX = 128, _LARGE_NB_MIN = 1024, _BWD_SMALL_NB_MAX = 192.
_INF = 2**31 - 1
_BUCKETS = {
    "fwd_r128": (("small", 1, 128), ("default", 129, 1023), ("large", 1024, _INF)),
    "bwd_r128": (("small", 1, 192), ("default", 193, _INF)),
}


def bucket_range(op: str, bucket: str) -> tuple:
    for name, lo, hi in _BUCKETS[op]:
        if name == bucket:
            return lo, hi
    raise KeyError(f"{op} has no bucket {bucket!r} (buckets: {[b[0] for b in _BUCKETS[op]]})")


def bucket_of(op: str, nb_total: int) -> str:
    for name, lo, hi in _BUCKETS[op]:
        if lo <= nb_total <= hi:
            return name
    raise ValueError(f"nb_total={nb_total} is outside every {op} bucket")


from ._opsupport import _alloc_on, _check, _index, _input_error, _overlapping, _state, _stream_handle

# --- constants upstream bakes into its launch code (checked against cudnn at build time) -----------
BWD_ROWS = 8  # compressor_sm100._BWD_ROWS: output rows per CTA of the ratio-2/4 backward
DAPE_GROUP_PARTIALS = 32  # compressor_sm100._DAPE_REDUCTION_GROUP_PARTIALS (split reduction stage)
_I32 = 2**31
_MAX_HEAD_DIM = 128 * 65535
FAMILY = "csa_compressor"


def _rows_r128(nb_total, d, coff, schedule, sm_count):
    vec, tchunks, threads_x = schedule[0], schedule[1], schedule[2]
    gy = (d // vec + threads_x - 1) // threads_x
    ctas_per_sm = 2 if coff == 2 else (4 if tchunks <= 4 else 3)
    slots = ctas_per_sm * sm_count
    return max(1, min(16, -((nb_total * gy) // -slots)))


def backward_workspace_bytes(total_comp, ratio, head_dim, coff, device=None) -> int:
    """Bytes of uint8 workspace the deterministic backward needs (0 when total_comp == 0)."""
    if total_comp <= 0:
        return 0
    nelems = ratio * coff * head_dim
    if ratio == 128:
        from .runtime.registry import device_index

        dev = device_index(device)
        entry = _index().find(FAMILY, "bwd_r128", _bwd_r128_key(total_comp, head_dim, coff, True), _state(dev).arch)
        rows = _rows_r128(total_comp, head_dim, coff, entry["key"]["schedule"], _state(dev).sm_count)
        return -(-total_comp // rows) * nelems * 4
    npartials = -(-total_comp // BWD_ROWS)
    stage = -(-npartials // DAPE_GROUP_PARTIALS) * nelems if ratio == 4 else 0
    return (npartials * nelems + stage) * 4


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
        raise _input_error(problems)
    dev = kv.device.index if kv.device.type == "cuda" else None
    total_tokens, width = kv.shape
    if head_dim is None:
        head_dim = width // coff if coff in (1, 2) else 0
    if coff in (1, 2) and width != coff * head_dim:
        problems.append(f"kv: width {width} (expected coff * head_dim = {coff} * {head_dim})")
    if head_dim < 1 or head_dim > _MAX_HEAD_DIM:
        problems.append(f"head_dim={head_dim} (expected 1..{_MAX_HEAD_DIM})")
    if ratio == 128 and head_dim not in (128, 512):
        problems.append(f"head_dim={head_dim} at ratio 128 (expected 128 or 512, upstream's validated envelope)")
    n = getattr(cu_seqlens, "shape", (0,))[0] if getattr(cu_seqlens, "ndim", 0) == 1 else 0
    if n < 2:
        problems.append(f"cu_seqlens: shape {tuple(getattr(cu_seqlens, 'shape', ()))} (expected (B + 1,) with B >= 1)")
    _check(problems, kv, "kv", (total_tokens, width), torch.bfloat16, dev, 16)
    _check(problems, score, "score", (total_tokens, width), torch.bfloat16, dev, 16)
    _check(problems, ape, "ape", (ratio, width), torch.float32, dev, 16)
    _check(problems, cu_seqlens, "cu_seqlens", (max(n, 2),), torch.int32, dev, 4)
    _check(problems, cu_seqlens_comp, "cu_seqlens_comp", (max(n, 2),), torch.int32, dev, 4)
    if total_tokens * width >= _I32:
        problems.append(f"total_tokens * coff * head_dim = {total_tokens * width} (expected < 2**31: the kernels use int32 offsets)")
    if total_comp is not None and total_comp * head_dim >= _I32:
        problems.append(f"total_comp * head_dim = {total_comp * head_dim} (expected < 2**31)")
    if total_comp is not None and total_comp > 0 and total_tokens < ratio:
        problems.append(f"total_comp={total_comp} > 0 needs at least ratio={ratio} tokens, got total_tokens={total_tokens}")
    return problems, dev, head_dim, total_tokens, width


def _fwd_r128_key(nb_total, d, coff):
    return {"ratio": 128, "d": d, "coff": coff, "bucket": bucket_of("fwd_r128", nb_total)}


def _bwd_r128_key(nb_total, d, coff, deterministic):
    return {"ratio": 128, "d": d, "coff": coff, "bucket": bucket_of("bwd_r128", nb_total), "deterministic": bool(deterministic)}


def _hint(op):
    return f" (the bucket policy for {op} is in aot/csa.py)" if op in _BUCKETS else ""


def _launcher(op, key, dev):
    ix = _index()
    st = _state(dev)
    e = ix.find(FAMILY, op, key, st.arch, _hint(op))
    return ix.loaded(e, dev), e


# --- ops ---------------------------------------------------------------------------------------------


def _sig(ts, extra):
    """What full validation depends on, except data pointers: a hit skips re-validating it."""
    try:
        return tuple([(t.shape, t.dtype, t.get_device(), t.is_contiguous()) for t in ts]) + extra
    except AttributeError:  # not tensors: take the slow path, which reports them
        return None


_FWD_FAST: dict = {}
_BWD_FAST: dict = {}
_FAST_MAX = 4096


def compressor_forward_into(out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, head_dim=None, coff=2, stream=None):
    """Forward into caller-provided ``out`` (total_comp, head_dim) bf16; same contract as cudnn's execute()."""
    sig = _sig((out, kv, score, ape, cu_seqlens, cu_seqlens_comp), (ratio, head_dim, coff))
    hit = _FWD_FAST.get(sig)
    if hit is not None:
        p0, p1, p2, p3, p4, p5 = kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu_seqlens.data_ptr(), cu_seqlens_comp.data_ptr(), out.data_ptr()
        if not ((p0 | p1 | p2 | p5) & 15 or (p3 | p4) & 3):
            launch, total_comp, n_seq, dev = hit
            if launch is not None:
                launch(p0, p1, p2, p3, p4, p5, total_comp, n_seq, _stream_handle(stream, dev))
            return out
    return _forward_into_slow(sig, out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, stream)


def _forward_into_slow(sig, out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, stream):
    import torch

    total_comp = out.shape[0] if isinstance(out, torch.Tensor) and out.ndim == 2 else None
    problems, dev, head_dim, total_tokens, width = _common(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp)
    _check(problems, out, "out", (total_comp if total_comp is not None else -1, head_dim), torch.bfloat16, dev, 16)
    if problems:
        raise _input_error(problems)
    launch = None
    if total_comp:
        op, key = ("fwd_r128", _fwd_r128_key(total_comp, head_dim, coff)) if ratio == 128 else ("fwd", {"ratio": ratio, "d": head_dim, "coff": coff})
        launch, _ = _launcher(op, key, dev)
        launch(kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu_seqlens.data_ptr(), cu_seqlens_comp.data_ptr(), out.data_ptr(),
               total_comp, cu_seqlens.shape[0] - 1, _stream_handle(stream, dev))
    if sig is not None and len(_FWD_FAST) < _FAST_MAX:
        _FWD_FAST[sig] = (launch, total_comp, cu_seqlens.shape[0] - 1, dev)
    return out


def compressor_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, head_dim=None, coff=2, total_comp=None, stream=None):
    """cudnn's csa_compressor_forward_wrapper: returns {'out': (total_comp, head_dim) bf16}.

    ``total_comp`` defaults to ``cu_seqlens_comp[-1]`` (a device sync); pass it to stay capture-safe.
    """
    import torch

    from .outputs import Outputs

    hd = head_dim if head_dim is not None else (kv.shape[1] // coff if isinstance(kv, torch.Tensor) and kv.ndim == 2 and coff in (1, 2) else None)
    if total_comp is None or hd is None or hd < 1 or total_comp < 0:
        problems, dev, hd, *_ = _common(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp)
        if problems:
            raise _input_error(problems)
        if total_comp is None:
            total_comp = int(cu_seqlens_comp[-1].item())
    with _alloc_on(stream):
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
        raise _input_error(problems)
    _check(problems, grad_out, "grad_out", (total_comp, head_dim), torch.bfloat16, dev, 16)
    _check(problems, grad_kv, "grad_kv", (total_tokens, width), torch.bfloat16, dev, 16)
    _check(problems, grad_score, "grad_score", (total_tokens, width), torch.bfloat16, dev, 16)
    _check(problems, grad_ape, "grad_ape", (ratio, width), torch.float32, dev, 16)
    if not deterministic and workspace is not None:
        problems.append("workspace: given, but deterministic=False uses the atomic dAPE path (pass workspace=None)")
    if problems:
        raise _input_error(problems)
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
    nelems = ratio * width
    if ratio == 128:
        launch, e = _launcher("bwd_r128", _bwd_r128_key(total_comp, head_dim, coff, deterministic), dev)
        rows = _rows_r128(total_comp, head_dim, coff, e["key"]["schedule"], _state(dev).sm_count)
        npartials, split = -(-total_comp // rows), False
        need = npartials * nelems * 4
    else:
        launch, e = _launcher("bwd", {"ratio": ratio, "d": head_dim, "coff": coff, "deterministic": bool(deterministic)}, dev)
        npartials, split = -(-total_comp // BWD_ROWS), ratio == 4
        need = (npartials * nelems + (-(-npartials // DAPE_GROUP_PARTIALS) * nelems if split else 0)) * 4
    if deterministic:
        wp = []
        _check(wp, workspace, "workspace", (workspace.numel() if isinstance(workspace, torch.Tensor) else need,), torch.uint8, dev, 16)
        if not wp and workspace.numel() < need:
            wp.append(f"workspace: {workspace.numel()} bytes (expected at least {need}; see aot.csa.backward_workspace_bytes)")
        if not wp:
            named = (("kv", kv), ("score", score), ("ape", ape), ("cu_seqlens", cu_seqlens), ("cu_seqlens_comp", cu_seqlens_comp),
                     ("grad_out", grad_out), ("grad_kv", grad_kv), ("grad_score", grad_score), ("grad_ape", grad_ape))
            wp += [f"workspace: overlaps {named[i][0]}" for i in _overlapping(workspace, need, [t for _, t in named])]
        if wp:
            raise _input_error(wp)
        reduce_, _ = _launcher("dape_reduce", {"split": split}, dev)
    s = _stream_handle(stream, dev)
    partial = workspace.data_ptr() if deterministic else grad_ape.data_ptr()
    ptrs = (kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu_seqlens.data_ptr(), cu_seqlens_comp.data_ptr(),
            grad_out.data_ptr(), grad_kv.data_ptr(), grad_score.data_ptr(), partial)
    n_seq = cu_seqlens.shape[0] - 1
    if ratio == 128:
        launch(*ptrs, total_comp, n_seq, total_tokens, rows, s)
    else:
        launch(*ptrs, total_comp, n_seq, total_tokens, s)
    if deterministic:
        stage = partial + (npartials * nelems * 4 if split else 0)
        reduce_(partial, stage, grad_ape.data_ptr(), npartials, nelems, s)
    return grad_kv, grad_score, grad_ape


def compressor_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio=4, head_dim=None, coff=2, stream=None, deterministic=False):
    """cudnn's csa_compressor_backward_wrapper: returns {'grad_kv', 'grad_score', 'grad_ape'}."""
    import torch

    from .outputs import Outputs

    problems, dev, head_dim, *_ = _common(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, None)
    if problems:
        raise _input_error(problems)
    if not isinstance(grad_out, torch.Tensor) or grad_out.ndim != 2:
        raise _input_error([f"grad_out: must be 2-D (total_comp, head_dim), got {getattr(grad_out, 'shape', type(grad_out).__name__)}"])
    total_comp = grad_out.shape[0]
    with torch.cuda.device(dev):
        with _alloc_on(stream):
            if total_comp == 0:
                gkv, gs = torch.zeros_like(kv), torch.zeros_like(score)
            else:
                gkv, gs = torch.empty_like(kv), torch.empty_like(score)
            gape = torch.empty_like(ape) if deterministic and total_comp else torch.zeros_like(ape)
            ws = torch.empty(backward_workspace_bytes(total_comp, ratio, head_dim, coff, dev), dtype=torch.uint8, device=kv.device) if deterministic and total_comp else None
    compressor_backward_into(gkv, gs, gape, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, head_dim, coff, stream, deterministic, ws)
    return Outputs(grad_kv=gkv, grad_score=gs, grad_ape=gape)
