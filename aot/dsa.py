"""DeepSeek sparse attention ops, launched from the wheel's cubins (cuda-python only).

``indexer_backward`` is cudnn's ``indexer_backward_wrapper``: the same arguments, outputs and side
effects (``attn_score`` is overwritten with the score-grad signal, ``index_score`` is read-only), the
same kernels in the same order on one stream:

  SM90 (H200)            zero fp32 dK -> ScoreGradSm90 -> IndexerBackwardSm90 -> bf16 cast
  SM100 default          ScoreGradSm100 (clears fp32 dK in the same launch) -> GEMM (PDL) -> cast
  SM100 deterministic    zero planes -> ScoreGradSm100 -> GEMM on fixed-owner planes (PDL) -> reduce
  SM100 sm100_v2         zero counter + dK (or planes) -> ScoreGradSm100 -> v2 GEMM -> cast / reduce

Which cubin serves a call is upstream's policy, re-implemented here and checked against cudnn at
build time (kernels/dsa_indexer_backward.py): persistence from B*S_q against the SM count, the v2
schedule from ceil(B*S_q / CTAs). Every input is validated before anything is launched or written.
"""

from __future__ import annotations

from ._opsupport import _alloc_on, _check, _index, _input_error, _state, _stream_handle

__all__ = ["indexer_backward", "indexer_backward_into", "indexer_backward_workspace_bytes", "indexer_backward_kernels", "BACKENDS", "PLANES"]

FAMILY = "dsa_indexer_backward"
BACKENDS = ("default", "sm100_v2")
PLANES = (96, 128, 148)  # deterministic dK plane counts upstream specialises for
DEFAULT_PLANES = 96
_SHORT_TOPK = (128, 256, 384, 512)
_WS_ALIGN = 128  # cudnn.api_base.ws_align: scratch chunks are carved at 128-byte boundaries
_I32 = 2**31


def gemm_persistent(topk: int, rows: int, grid: int) -> bool:
    """Upstream's launch policy for the non-deterministic SM100 GEMM (H32/H64, D128, block_I 128)."""
    return topk in _SHORT_TOPK and (topk == 512 or rows > grid)


def indexer_backward_kernels(arch, batch, seqlen_q, heads, topk, *, topk_indices_global=False, backend="default", deterministic=False,
                             deterministic_dk_planes=DEFAULT_PLANES, d_index_k_f32=False, d_weights_f32=False, target_sm_count=None) -> dict:
    """Which shipped (op, key) serves each stage of one call, by upstream's policy: role -> (op, key).

    Pure (no GPU): the op calls it, and the tests hold it against the manifest. ``target_sm_count`` is
    the SM count the build's target for ``arch`` declared (persistent grids are baked with it).
    """
    glob, planes, rows = bool(topk_indices_global), int(deterministic_dk_planes), batch * seqlen_q
    if not _sm100(arch):
        return {"score_grad": ("score_grad_sm90", {"topk": topk}), "gemm": ("gemm_sm90", {"heads": heads, "topk": topk, "topk_global": glob})}
    out = {}
    if backend == "sm100_v2":
        num_ctas = planes if deterministic else target_sm_count
        out["gemm"] = ("gemm_v2", {"topk": topk, "rows_per_cta": -(-rows // num_ctas), "dw": "f32" if d_weights_f32 else "bf16",
                                   "idx_local": (not glob) and batch > 1, "deterministic": bool(deterministic), "planes": planes})
        out["score_grad"] = ("score_grad", {"topk": topk, "zero_dk": False})
    elif deterministic:
        out["gemm"] = ("gemm", {"heads": heads, "topk": topk, "topk_global": glob, "persistent": True, "pdl": True, "deterministic": True,
                                "planes": planes})
        out["score_grad"] = ("score_grad", {"topk": topk, "zero_dk": False})
    else:
        # the op launches the GEMM right behind score-grad, so always the PDL variant (as upstream's wrapper)
        out["gemm"] = ("gemm", {"heads": heads, "topk": topk, "topk_global": glob, "persistent": gemm_persistent(topk, rows, target_sm_count),
                                "pdl": True, "deterministic": False, "planes": DEFAULT_PLANES})
        out["score_grad"] = ("score_grad", {"topk": topk, "zero_dk": True})
    if deterministic:
        out["reduce"] = ("reduce_dk", {"out": "f32" if d_index_k_f32 else "bf16", "planes": planes})
    return out


def _ws_align(n: int) -> int:
    return -(-int(n) // _WS_ALIGN) * _WS_ALIGN


def _sm100(arch: str) -> bool:
    return arch in ("sm_100a", "sm_103a", "sm_100f")


def indexer_backward_workspace_bytes(batch, seqlen_k, head_dim=128, *, d_index_k_dtype=None, backend="default", deterministic=False,
                                     deterministic_dk_planes=DEFAULT_PLANES) -> int:
    """cudnn's ``IndexerBackward.scratch_workspace_bytes()``: uint8 bytes ``workspace=`` must hold.

    The v2 ticket counter (8 bytes, ordinary v2 only) comes first; then the deterministic fp32 dK
    planes, or the fp32 dK accumulator a bf16 ``d_index_k`` needs (none for an fp32 one).
    """
    import torch

    dt = torch.bfloat16 if d_index_k_dtype is None else d_index_k_dtype
    counter = _ws_align(8) if backend == "sm100_v2" and not deterministic else 0
    if deterministic:
        return counter + _ws_align(int(deterministic_dk_planes) * batch * seqlen_k * head_dim * 4)
    return counter + (0 if dt == torch.float32 else _ws_align(batch * seqlen_k * head_dim * 4))


def _targs(t, shape=None, stride=None):
    """A contiguous tensor as the JIT host code takes it: pointer, extents (i32), strides but the unit one (i64)."""
    shape = tuple(t.shape) if shape is None else shape
    stride = tuple(t.stride()) if stride is None else stride
    return (t.data_ptr(), *shape, *stride[:-1])


def _flat(t, shape):
    """A contiguous tensor viewed with another contiguous shape, as the host code takes it."""
    return _flat_ptr(t.data_ptr(), shape)


def _flat_ptr(ptr, shape):
    """(ptr, extents, strides but the unit one) of a compact row-major buffer."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return (ptr, *shape, *reversed(stride[1:]))


def _memset0(ptr, nbytes, stream):
    from .runtime.driver import check, drv

    if nbytes:
        d = drv()
        if nbytes % 4 == 0:
            check(d.cuMemsetD32Async(ptr, 0, nbytes // 4, stream), "cuMemsetD32Async")
        else:
            check(d.cuMemsetD8Async(ptr, 0, nbytes, stream), "cuMemsetD8Async")


def _launcher(op, key, dev, hint=""):
    ix = _index()
    e = ix.find(FAMILY, op, key, _state(dev).arch, hint)
    return ix.loaded(e, dev)


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

    from .outputs import Outputs

    if workspace is None or d_index_q is None or d_weights is None or d_index_k is None:
        # allocate what is missing like upstream (empty_like the inputs, per-call workspace); the full
        # validation of everything happens in indexer_backward_into, before any launch
        problems = []
        for t, name, nd, what in ((index_q, "index_q", 4, "(B, S_q, H, D)"), (weights, "weights", 3, "(B, S_q, H)"), (index_k, "index_k", 3, "(B, S_k, D)")):
            if not isinstance(t, torch.Tensor) or t.ndim != nd:
                problems.append(f"{name}: must be a {nd}-D tensor {what}, got {getattr(t, 'shape', type(t).__name__)}")
        if problems:
            raise _input_error(problems)
        n = 0
        if workspace is None and backend in BACKENDS and deterministic_dk_planes in PLANES:
            b, s_k, d = index_k.shape
            dt = d_index_k.dtype if isinstance(d_index_k, torch.Tensor) else index_k.dtype
            n = indexer_backward_workspace_bytes(b, s_k, d, d_index_k_dtype=dt, backend=backend, deterministic=deterministic,
                                                 deterministic_dk_planes=deterministic_dk_planes)
        with _alloc_on(stream):  # empty_like keeps the inputs' device; the stream orders the allocator
            d_index_q = torch.empty_like(index_q) if d_index_q is None else d_index_q
            d_weights = torch.empty_like(weights) if d_weights is None else d_weights
            d_index_k = torch.empty_like(index_k) if d_index_k is None else d_index_k
            if n:
                workspace = torch.empty(n, dtype=torch.uint8, device=index_q.device)
    indexer_backward_into(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss,
                          sm_scale, loss_coeff, block_I, topk_indices_global, stream, backend=backend, workspace=workspace,
                          deterministic=deterministic, deterministic_dk_planes=deterministic_dk_planes)
    return Outputs(d_index_q=d_index_q, d_weights=d_weights, d_index_k=d_index_k)


def indexer_backward_into(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss,
                          sm_scale=1.0, loss_coeff=1.0, block_I=128, topk_indices_global=False, stream=None, *, backend="default",
                          workspace=None, deterministic=False, deterministic_dk_planes=DEFAULT_PLANES):
    """``indexer_backward`` into caller-provided outputs and workspace (capture-safe; allocates nothing)."""
    import torch

    ts = (d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, workspace)
    sig = _sig(ts, (block_I, backend, bool(deterministic), deterministic_dk_planes, backend == "sm100_v2" and float(sm_scale) > 0.0))
    plan = _VALIDATED.get(sig) if sig is not None else None
    if plan is None or _misaligned(ts) or (deterministic and _overlaps(workspace, plan, ts)):
        plan = _validate(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss,
                         sm_scale, block_I, backend, workspace, deterministic, deterministic_dk_planes)
        if sig is not None and len(_VALIDATED) < 4096:
            _VALIDATED[sig] = plan
    dev, arch, b, s_q, s_k, h, d, topk, _need = plan
    rows = b * s_q
    s = _stream_handle(stream, dev)
    grad_scale = float(loss_coeff) / rows if rows else 0.0
    sm_scale = float(sm_scale)
    dk_dtype_f32 = d_index_k.dtype == torch.float32
    glob = bool(topk_indices_global)
    if rows == 0 or topk == 0:
        # nothing reads or writes a slot: dK is all zero, dQ/dW are empty or zero
        with _alloc_on(stream):
            d_index_k.zero_()
            d_index_q.zero_()
            d_weights.zero_()
        return d_index_q, d_weights, d_index_k
    gl = grad_loss.detach().reshape(1)
    q4, w3, k3, dq4, dw3 = _targs(index_q), _targs(weights), _targs(index_k), _targs(d_index_q), _targs(d_weights)
    a3, i3, t3, gl1 = _targs(attn_score), _targs(index_score), _targs(topk_indices), _targs(gl)
    ws = workspace.data_ptr() if workspace is not None else 0
    kbytes = b * s_k * d * 4

    planes = int(deterministic_dk_planes)
    sm100 = _sm100(arch)
    ks = indexer_backward_kernels(arch, b, s_q, h, topk, topk_indices_global=glob, backend=backend, deterministic=deterministic,
                                  deterministic_dk_planes=planes, d_index_k_f32=dk_dtype_f32, d_weights_f32=d_weights.dtype == torch.float32,
                                  target_sm_count=_index().target_sm_count(arch) if sm100 else None)
    hint = ""
    if backend == "sm100_v2":
        rpc = ks["gemm"][1]["rows_per_cta"]
        hint = f" (the v2 kernel is compiled per ceil(B*S_q / CTAs) = {rpc}; add rows_per_cta = {rpc})"
    sg = _launcher(*ks["score_grad"], dev)
    gemm = _launcher(*ks["gemm"], dev, hint)
    red = _launcher(*ks["reduce"], dev) if "reduce" in ks else None

    if not sm100:  # SM90 twins: zero fp32 dK, score-grad, GEMM, cast
        dk = d_index_k.data_ptr() if dk_dtype_f32 else ws
        _memset0(dk, kbytes, s)
        sg(*a3, *i3, *gl1, grad_scale, s)
        gemm(*q4, *w3, *k3, *dq4, *dw3, *_flat_ptr(dk, (b, s_k, d)), *a3, *t3, sm_scale, s, s_q, s_k)
        if not dk_dtype_f32:
            _cast_into(d_index_k, workspace, (b, s_k, d), stream)
        return d_index_q, d_weights, d_index_k

    if backend == "sm100_v2":
        if deterministic:
            dk_rows, dk_ptr, cnt = planes * b * s_k, ws, (ws, 1)
            _memset0(ws, planes * kbytes, s)
        else:
            cnt = (ws, 2)
            _memset0(ws, 8, s)
            dk_ptr = d_index_k.data_ptr() if dk_dtype_f32 else ws + _ws_align(8)
            dk_rows = b * s_k
            _memset0(dk_ptr, kbytes, s)
        sg(*a3, *i3, *gl1, *gl1, grad_scale, s)
        gemm(*_flat(index_q, (rows, h, d)), *_flat(index_k, (b * s_k, d)), *_flat(weights, (rows, h)), *_flat(topk_indices, (rows, topk)),
             *_flat(attn_score, (rows, topk)), *_flat(d_index_q, (rows, h, d)), *_flat(d_weights, (rows, h)), *_flat_ptr(dk_ptr, (dk_rows, d)),
             sm_scale, s_q, s_k, s, *cnt)
        if deterministic:
            red(*_flat_ptr(ws, (planes, b * s_k, d)), *_targs(d_index_k), s)
        elif not dk_dtype_f32:
            _cast_into(d_index_k, workspace, (b, s_k, d), stream, offset=_ws_align(8))
        return d_index_q, d_weights, d_index_k

    if deterministic:  # zero planes, score-grad, GEMM on fixed-owner planes, fixed-order reduction
        _memset0(ws, planes * kbytes, s)
        sg(*a3, *i3, *gl1, *gl1, grad_scale, s)
        gemm(*q4, *w3, *k3, *dq4, *dw3, *_flat_ptr(ws, (planes, b * s_k, d)), *a3, *t3, sm_scale, s)
        red(*_flat_ptr(ws, (planes, b * s_k, d)), *_targs(d_index_k), s)
        return d_index_q, d_weights, d_index_k

    # default: score-grad clears the fp32 dK in the same launch, GEMM (PDL), cast
    dk = _flat_ptr(d_index_k.data_ptr() if dk_dtype_f32 else ws, (b, s_k, d))
    sg(*a3, *i3, *gl1, *dk, grad_scale, s)
    gemm(*q4, *w3, *k3, *dq4, *dw3, *dk, *a3, *t3, sm_scale, s)
    if not dk_dtype_f32:
        _cast_into(d_index_k, workspace, (b, s_k, d), stream)
    return d_index_q, d_weights, d_index_k


def _cast_into(d_index_k, workspace, shape, stream, offset=0):
    """The trailing fp32 -> bf16 cast upstream does with torch, on the launch stream (``stream`` is
    the caller's argument: None means torch's current stream, which is where the kernels went)."""
    import torch

    n = shape[0] * shape[1] * shape[2]
    acc = workspace[offset : offset + 4 * n].view(torch.float32).view(shape)
    if stream is None:
        d_index_k.copy_(acc)
        return
    with _alloc_on(stream):
        d_index_k.copy_(acc)


# signature (shapes, dtypes, devices, contiguity, options) -> validated plan: a repeated call skips the
# full validation; pointer alignment and, for deterministic planes, workspace overlap are per call.
_VALIDATED: dict = {}


def _sig(ts, extra):
    try:
        return tuple(None if t is None else (t.shape, t.dtype, t.get_device(), t.is_contiguous()) for t in ts) + extra
    except AttributeError:  # not tensors: the full validation reports them
        return None


def _misaligned(ts):
    return any(t is not None and t.data_ptr() & 15 for t in ts)


def _overlaps(workspace, plan, ts):
    need = plan[-1]
    w0 = workspace.data_ptr()
    w1 = w0 + need
    for t in ts[:-1]:
        t0 = t.data_ptr()
        if t.numel() and w0 < t0 + t.numel() * t.element_size() and t0 < w1:
            return True
    return False


def _validate(d_index_q, d_weights, d_index_k, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss,
              sm_scale, block_I, backend, workspace, deterministic, planes):
    """Every problem with the inputs, raised together before anything is touched; returns the plan."""
    import torch

    problems = []
    if backend not in BACKENDS:
        problems.append(f"backend={backend!r} (expected one of {BACKENDS})")
    if isinstance(planes, bool) or planes not in PLANES:
        problems.append(f"deterministic_dk_planes={planes!r} (expected one of {PLANES})")
    elif not deterministic and planes != DEFAULT_PLANES:
        problems.append("deterministic_dk_planes is only configurable when deterministic=True")
    shapes_ok = True
    for t, name, nd in ((index_q, "index_q", 4), (index_k, "index_k", 3), (topk_indices, "topk_indices", 3)):
        if not isinstance(t, torch.Tensor) or t.ndim != nd:
            problems.append(f"{name}: must be a {nd}-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
            shapes_ok = False
    if not shapes_ok:
        raise _input_error(problems)
    dev = index_q.device.index if index_q.device.type == "cuda" else None
    b, s_q, h, d = index_q.shape
    s_k, topk = index_k.shape[1], topk_indices.shape[2]
    bf16, f32 = torch.bfloat16, torch.float32
    _check(problems, index_q, "index_q", (b, s_q, h, d), bf16, dev, 16)
    _check(problems, weights, "weights", (b, s_q, h), bf16, dev, 16)
    _check(problems, index_k, "index_k", (b, s_k, d), bf16, dev, 16)
    _check(problems, attn_score, "attn_score", (b, s_q, topk), f32, dev, 16)
    _check(problems, index_score, "index_score", (b, s_q, topk), f32, dev, 16)
    _check(problems, topk_indices, "topk_indices", (b, s_q, topk), torch.int32, dev, 16)
    _check(problems, d_index_q, "d_index_q", (b, s_q, h, d), bf16, dev, 16)
    v2 = backend == "sm100_v2"
    dw_dt = d_weights.dtype if v2 and isinstance(d_weights, torch.Tensor) and d_weights.dtype in (bf16, f32) else bf16
    _check(problems, d_weights, "d_weights", (b, s_q, h), dw_dt, dev, 16)
    dk_dt = d_index_k.dtype if isinstance(d_index_k, torch.Tensor) and d_index_k.dtype in (bf16, f32) else bf16
    _check(problems, d_index_k, "d_index_k", (b, s_k, d), dk_dt, dev, 16)
    if not isinstance(grad_loss, torch.Tensor) or grad_loss.numel() != 1 or grad_loss.dtype != f32 or grad_loss.device != index_q.device:
        problems.append(f"grad_loss: must be a single-element float32 tensor on {index_q.device}")
    elif grad_loss.data_ptr() % 16:
        problems.append(f"grad_loss: data pointer 0x{grad_loss.data_ptr():x} is not 16-byte aligned (clone() it)")
    if block_I != 128:
        problems.append(f"block_I={block_I!r} (expected 128, the only block size shipped)")
    if topk % 128:
        problems.append(f"topk={topk} (expected a multiple of block_I = 128)")
    if d != 128:
        problems.append(f"D={d} (expected 128)")
    for what, n in (("B*S_q*H*D", b * s_q * h * d), ("B*S_k*D", b * s_k * d), ("B*S_q*topk", b * s_q * topk)):
        if n >= _I32:
            problems.append(f"{what} = {n} (expected < 2**31: the kernels index with int32)")
    arch = None
    if dev is not None and not problems:
        arch = _state(dev).arch
        sm100 = _sm100(arch)
        if not sm100 and (v2 or deterministic):
            problems.append(f"{'backend=sm100_v2' if v2 else 'deterministic=True'} needs an SM100 GPU (this one runs {arch}); upstream refuses it too")
        if sm100 and not v2 and h not in (32, 64):
            problems.append(f"H={h} (the SM100 kernels ship H=32 and H=64)")
        if not sm100 and h < 64:
            problems.append(f"H={h} (the SM90 kernel needs H >= 64)")
        if v2 and h != 64:
            problems.append(f"H={h} (backend='sm100_v2' requires H=64)")
        if v2 and not float(sm_scale) > 0.0:
            problems.append(f"sm_scale={sm_scale} (backend='sm100_v2' requires sm_scale > 0: its relu gate reads unscaled scores)")
        if deterministic and b * s_q and b * s_q < planes:
            problems.append(f"B*S_q = {b * s_q} < deterministic_dk_planes = {planes}: upstream compiles a smaller grid for such a call, "
                            f"which this build does not ship (use deterministic_dk_planes <= B*S_q or deterministic=False)")
    need = 0
    if not problems:
        need = indexer_backward_workspace_bytes(b, s_k, d, d_index_k_dtype=d_index_k.dtype, backend=backend, deterministic=deterministic,
                                                deterministic_dk_planes=planes)
        if need:
            wp = []
            if workspace is None:
                wp.append(f"workspace: missing ({need} uint8 bytes needed; see aot.dsa.indexer_backward_workspace_bytes)")
            else:
                n = workspace.numel() if isinstance(workspace, torch.Tensor) else -1
                _check(wp, workspace, "workspace", (n,), torch.uint8, dev, 16)
                if not wp and n < need:
                    wp.append(f"workspace: {n} bytes (expected at least {need}; see aot.dsa.indexer_backward_workspace_bytes)")
                if not wp:
                    w0, w1 = workspace.data_ptr(), workspace.data_ptr() + need
                    for name, t in (("index_q", index_q), ("weights", weights), ("index_k", index_k), ("attn_score", attn_score),
                                    ("index_score", index_score), ("topk_indices", topk_indices), ("grad_loss", grad_loss), ("d_index_q", d_index_q),
                                    ("d_weights", d_weights), ("d_index_k", d_index_k)):
                        t0 = t.data_ptr()
                        if t.numel() and w0 < t0 + t.numel() * t.element_size() and t0 < w1:
                            wp.append(f"workspace: its first {need} bytes overlap {name}")
            problems += wp
    if problems:
        raise _input_error(problems)
    return dev, arch, b, s_q, s_k, h, d, topk, need
