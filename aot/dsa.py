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

from ._opsupport import _alloc_on, _check, _index, _input_error, _overlapping, _state, _stream_handle
from .errors import InputError

__all__ = [
    "indexer_backward", "indexer_backward_into", "indexer_backward_workspace_bytes", "indexer_backward_kernels", "BACKENDS", "PLANES",
    "sparse_attention_backward", "sparse_attention_backward_into", "sparse_attention_backward_workspace_bytes", "sparse_attention_backward_kernels",
]

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
    return _launcher_family(FAMILY, op, key, dev, hint)


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
    if plan is None or _misaligned(ts) or (deterministic and _overlaps(workspace, plan[-1], ts)):
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


def _overlaps(workspace, need, ts):
    """Fast-path re-check: do the first ``need`` bytes of ``workspace`` (the last of ``ts``) overlap the others?"""
    return bool(_overlapping(workspace, need, ts[:-1]))


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
                    named = (("index_q", index_q), ("weights", weights), ("index_k", index_k), ("attn_score", attn_score), ("index_score", index_score),
                             ("topk_indices", topk_indices), ("grad_loss", grad_loss), ("d_index_q", d_index_q), ("d_weights", d_weights),
                             ("d_index_k", d_index_k))
                    for i in _overlapping(workspace, need, [t for _, t in named]):
                        wp.append(f"workspace: its first {need} bytes overlap {named[i][0]}")
            problems += wp
    if problems:
        raise _input_error(problems)
    return dev, arch, b, s_q, s_k, h, d, topk, need


# =====================================================================================================
# Sparse attention backward: upstream's policy, re-implemented (kernels/dsa_sparse_attention_backward.py
# checks each function against cudnn's own at build time)
# =====================================================================================================

HEAD_DIM_V = 512  # D 512 -> D_v 512; D 576 (MLA: 512 + 64 rope) -> D_v 512
TWO_CTA_TOPK = (128, 512, 1024, 1152, 2048)  # upstream's tuned two-CTA widths (H128 D512, H96/H128 D576)
DETERMINISTIC_HEADS = (16, 32, 64, 96, 128)
D576_BACKENDS = ("h96_d576_2cta_m64", "h128_d576_2cta_m64")



def select_backend(heads: int, dim: int, dtype: str, topk: int, deterministic: bool) -> tuple:
    """(backend, block_tile) of ``_select_sm100_backend`` for a contiguous plan on an SM100/SM103 device."""
    bf16 = dtype == "bf16"
    if bf16 and heads == 128 and dim == 512 and topk in TWO_CTA_TOPK:
        return "h128_2cta_m64", 64
    if bf16 and heads == 128 and dim == 576 and topk in TWO_CTA_TOPK:
        return "h128_d576_2cta_m64", 64
    if bf16 and heads == 96 and dim == 576 and topk in TWO_CTA_TOPK:
        return "h96_d576_2cta_m64", 64
    if heads == 96 and dim == 576:
        return "h96_h64_h32", 64
    if deterministic:
        return "generic_m64", 64
    if heads == 16 and dim == 576:
        return "h16_m128", 128
    if heads == 32 and dim == 576:
        return "h32_m64", 64
    return "generic_m64", 64


def deterministic_dkv(s_q: int, s_kv: int, dim: int, heads: int) -> tuple:
    """(planes, relay) upstream's generic deterministic policy picks (``deterministic_kernel_class``)."""
    k, d = (s_kv + 7) // 8 * 8, (dim + 7) // 8 * 8
    need = (s_q + 3) // 4
    planes = next((p for p in (32, 64, 128) if need <= p), 128)
    if planes * k * d * 4 <= 16 << 30:
        return planes, 1
    relay = 4 if s_q >= 8192 else 8
    if _relay_bytes(s_q, k, d, heads, relay) > 32 << 30:
        relay = 16
    return 128 // relay, relay


def _relay_bytes(s_q, k, d, heads, relay):
    return (128 // relay) * (k + _relay_mask_rows(s_q, k, d, heads, relay)) * d * 4


def _relay_mask_rows(s_q, k, d, heads, relay):
    words = -(-s_q // 128) * -(-heads // 64) * -(-k // (32 // relay))
    return -(-words // d)


def d576_split_count(s_q: int, topk: int, sm_count: int) -> int:
    """``_interface_sm100_d576._split_count``: query splitting for short batches (run-time Int32 argument)."""
    return max(1, min((sm_count // 2) // max(s_q, 1), 1 + ((topk + 63) // 64) // 2, 8))


def d576_compact_slots(sm_count: int) -> int:
    """``_deterministic_compact_slots``: deterministic D576 wave width (one slot per two-SM cluster)."""
    return max(1, min(sm_count // 2, 76))


def sm100_workspace_shapes(s_q, s_kv, dim, heads, deterministic, backend) -> tuple:
    """The byte-shaped (LSE/OdO, dKV) workspaces of one SM100 call (``_workspace_shapes_sm100``)."""
    r8 = lambda x: (x + 7) // 8 * 8  # noqa: E731
    lse = (1, heads, r8(s_q), 8)
    k, d = r8(s_kv), r8(dim)
    if not deterministic:
        return lse, (1, 1, k, d * 4)
    if backend in D576_BACKENDS:
        return lse, (1, 96, k, d * 4)
    if backend != "generic_m64":
        return lse, (1, 128, k, d * 4)
    planes, relay = deterministic_dkv(s_q, s_kv, dim, heads)
    rows = k + (_relay_mask_rows(s_q, k, d, heads, relay) if relay > 1 else 0)
    return lse, (1, planes, rows, d * 4)


def sm100_workspace_bytes(s_q, s_kv, dim, heads, deterministic, backend) -> int:
    """Caller workspace of one SM100 call: both segments, each rounded up to 128 bytes."""
    a = lambda n: -(-n // 128) * 128  # noqa: E731
    lse, dkv = sm100_workspace_shapes(s_q, s_kv, dim, heads, deterministic, backend)
    return a(_prod(lse)) + a(_prod(dkv))


def needs_wide(s_q, s_kv, dim, heads, topk, deterministic, backend) -> bool:
    """``_requires_wide_data_addressing``: any tensor (or, off the D576 route, workspace) past 2**31 elements."""
    spans = [s_q * heads * dim, s_q * heads * HEAD_DIM_V, s_q * heads, s_q * topk, s_kv * dim]
    if backend not in D576_BACKENDS:
        spans += [_prod(s) for s in sm100_workspace_shapes(s_q, s_kv, dim, heads, deterministic, backend)]
    return any(s > 1 << 31 for s in spans)


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


# =====================================================================================================
# Sparse attention backward: the op
# =====================================================================================================

_SM90_TILE = 64  # flash_attn_bwd_sm90: S_q and S_kv extents of its fp32 scratch are rounded to the tile
_SM90_DIM_MULTIPLE = 32


def _r(x, m):
    return -(-int(x) // m) * m


def sparse_attention_backward_workspace_bytes(total_s_q, total_s_kv, head_dim, num_heads, *, arch="sm_90a", topk=None, deterministic=False) -> int:
    """cudnn's ``SparseAttentionBackward.scratch_workspace_bytes()``: uint8 bytes ``workspace=`` must hold.

    SM90: dPsum and log2-scaled LSE (each S_q rounded to 64 x H fp32) and the fp32 dKV accumulator
    (S_kv rounded to 64 x D rounded to 32), each chunk 128-byte aligned. SM100: the LSE/OdO and dKV
    workspaces of the selected backend.
    """
    if not _sm100(arch):
        stats = _ws_align(_r(total_s_q, _SM90_TILE) * num_heads * 4)
        return 2 * stats + _ws_align(_r(total_s_kv, _SM90_TILE) * _r(head_dim, _SM90_DIM_MULTIPLE) * 4)
    if topk is None:
        raise InputError("sparse_attention_backward_workspace_bytes: pass topk= (the index row width) for an SM100 arch: it selects the backend")
    backend, _ = select_backend(num_heads, head_dim, "bf16", topk, deterministic)
    return sm100_workspace_bytes(total_s_q, total_s_kv, head_dim, num_heads, deterministic, backend)


def sparse_attention_backward_kernels(arch, heads, head_dim, topk, *, has_topk_length=False, dtype="bf16", deterministic=False, s_q=1, s_kv=1,
                                      sm_count=148) -> dict:
    """Which shipped (op, key) serves each stage of one call: role -> (op, key). Pure (no GPU).

    SM90: three artifacts (pre, main, post). SM100: one artifact ("bwd") whose host function launches
    every kernel; its key follows upstream's plan: the backend, the deterministic dKV layout (from S_q
    and S_kv), wide addressing (from the extents) and, on the D576 route, the query-split regime (from
    the device's SM count) and S_q == 1.
    """
    if not _sm100(arch):
        return {
            "pre": ("pre_sm90", {"dtype": dtype}),
            "main": ("main_sm90", {"dtype": dtype, "heads": heads, "dim": head_dim, "topk": topk, "topk_length": bool(has_topk_length)}),
            "post": ("post_sm90", {"dtype": dtype, "dim": head_dim}),
        }
    det = bool(deterministic)
    backend, _ = select_backend(heads, head_dim, dtype, topk, det)
    wide = needs_wide(s_q, s_kv, head_dim, heads, topk, det, backend)
    if backend in D576_BACKENDS:
        split = not det and d576_split_count(s_q, topk, sm_count) > 1
        return {"bwd": ("bwd_d576", {"heads": heads, "topk": topk, "topk_length": bool(has_topk_length), "single_query": s_q == 1, "split": split,
                                     "deterministic": det, "wide": wide})}
    planes, relay = (1, 1) if not det else deterministic_dkv(s_q, s_kv, head_dim, heads) if backend == "generic_m64" else (128, 1)
    return {"bwd": ("bwd", {"dtype": dtype, "heads": heads, "dim": head_dim, "topk": topk, "topk_length": bool(has_topk_length),
                            "deterministic": det, "planes": planes, "relay": relay, "wide": wide})}


def _cute_args(ptr, shape, dynamic, fully_dynamic=False):
    """A row-major buffer as a compiled host function takes it: pointer, its dynamic extents (the modes
    in ``dynamic``), then its dynamic strides: every stride but the unit one when the tensor type is
    fully dynamic (wide mode), else those that span a dynamic extent (compact types)."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    stride.reverse()
    last = max(dynamic, default=-1)
    strides = [stride[i] for i in range(len(shape) - 1) if fully_dynamic or i < last]
    return (ptr, *(shape[i] for i in dynamic), *strides)


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

    from .outputs import Outputs

    problems = []
    for t, name, nd in ((q, "q", 3), (kv, "kv", 2), (attn_sink, "attn_sink", 1), (topk_idxs, "topk_idxs", 2)):
        if not isinstance(t, torch.Tensor) or t.ndim != nd:
            problems.append(f"{name}: must be a {nd}-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if problems:
        raise _input_error(problems)
    with _alloc_on(stream):
        dq = torch.empty_like(q) if dq is None else dq
        dkv = torch.empty_like(kv) if dkv is None else dkv
        d_sink = torch.empty_like(attn_sink)
        if workspace is None and q.device.type == "cuda":
            n = sparse_attention_backward_workspace_bytes(q.shape[0], kv.shape[0], q.shape[2], q.shape[1], arch=_state(q.device.index).arch,
                                                          topk=topk_idxs.shape[1], deterministic=deterministic)
            workspace = torch.empty(n, dtype=torch.uint8, device=q.device)
    sparse_attention_backward_into(dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale, topk_length, block_tile,
                                   deterministic, stream, workspace, q_cluster_mode)
    return Outputs(dq=dq, dkv=dkv, d_sink=d_sink)


def sparse_attention_backward_into(dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None, topk_length=None,
                                   block_tile=64, deterministic=False, stream=None, workspace=None, q_cluster_mode="off"):
    """``sparse_attention_backward`` into caller-provided ``dq``, ``dkv``, ``d_sink`` and ``workspace``
    (capture-safe; allocates nothing). Returns (dq, dkv, d_sink)."""
    import math

    ts = (dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, workspace)
    sig = _sig(ts, (block_tile, bool(deterministic), q_cluster_mode))
    plan = _VALIDATED.get(sig) if sig is not None else None
    # a repeated signature skips the full validation; pointer alignment (lse: 4 on SM90, 8 on SM100;
    # workspace: 32 for the deterministic D576 layout) and workspace overlap are per call
    if plan is None or _misaligned(ts[:7] + ts[8:]) or lse.data_ptr() & plan[9] or workspace.data_ptr() & plan[10] or _overlaps(workspace, plan[7], ts):
        plan = _validate_sparse(dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, block_tile, deterministic, workspace,
                                q_cluster_mode)
        if sig is not None and len(_VALIDATED) < 4096:
            _VALIDATED[sig] = plan
    dev, arch, s_q, s_kv, h, d, topk, _need, ks = plan[:9]
    s = _stream_handle(stream, dev)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    if s_q == 0:  # no query: nothing flows back
        with _alloc_on(stream):
            dkv.zero_()
            d_sink.zero_()
        return dq, dkv, d_sink
    if "bwd" in ks:
        _sm100_call(ks["bwd"], dev, s_q, s_kv, h, d, topk, q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, dq, dkv, d_sink,
                    workspace, scale, s)
        return dq, dkv, d_sink
    pre, main, post = (_launcher_family(SPARSE_FAMILY, *ks[r], dev) for r in ("pre", "main", "post"))
    sqr, skr, dr = _r(s_q, _SM90_TILE), _r(s_kv, _SM90_TILE), _r(d, _SM90_DIM_MULTIPLE)
    stats = _ws_align(sqr * h * 4)
    ws = workspace.data_ptr()
    dpsum, lse_log2, acc = (ws, 1, sqr, h), (ws + stats, 1, sqr, h), ws + 2 * stats
    dpsum, lse_log2 = _flat_ptr(dpsum[0], dpsum[1:]), _flat_ptr(lse_log2[0], lse_log2[1:])
    acc3 = _flat_ptr(acc, (1, 1, skr * dr))
    # upstream's order: clear the dKV accumulator and d_sink (both are atomically accumulated)
    _memset0(acc, skr * dr * 4, s)
    _memset0(d_sink.data_ptr(), h * 4, s)
    o4, do4 = _targs(out.unsqueeze(0)), _targs(dout.unsqueeze(0))
    pre(*o4, *do4, *dpsum, *_targs(lse.unsqueeze(0)), *lse_log2, *_targs(attn_sink), *_targs(d_sink), s)
    tl = _targs(topk_length.unsqueeze(0)) if topk_length is not None else ()
    main(*_targs(q.unsqueeze(0)), *_targs(kv.unsqueeze(0).unsqueeze(2)), *do4, *lse_log2, *dpsum, *_targs(dq.unsqueeze(0)), *acc3,
         *_targs(topk_idxs.unsqueeze(0)), *tl, scale, s)
    post(*acc3, *_targs(dkv.unsqueeze(0).unsqueeze(2)), s_kv, s)
    return dq, dkv, d_sink


def _sm100_call(op_key, dev, s_q, s_kv, h, d, topk, q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, dq, dkv, d_sink, workspace,
                scale, s):
    """One SM100 call: upstream's d_sink clear where its kernels accumulate into it, then the one
    artifact whose host function launches every kernel (zero-init, sum_OdO, backward, convert,
    sum_dSink, shard fold) on stream ``s``."""
    op, key = op_key
    fn = _launcher_family(SPARSE_FAMILY, op, key, dev)
    det, wide = key["deterministic"], key["wide"]
    dv = HEAD_DIM_V
    c = lambda t, shape, dyn: _cute_args(t if isinstance(t, int) else t.data_ptr(), shape, tuple(range(len(shape))) if wide else dyn, wide)  # noqa: E731
    tensors = [
        c(q, (s_q, h, d), (0,)), c(kv, (s_kv, d), (0,)), c(out, (s_q, h, dv), (0,)), c(dout, (s_q, h, dv), (0,)), c(lse, (s_q, h), (0,)),
        c(attn_sink, (h,), ()), _cute_args(topk_idxs.data_ptr(), (s_q, topk), (0,), wide),  # topk is a static extent even when wide
    ]  # fmt: skip
    if topk_length is not None:
        tensors.append(c(topk_length, (s_q,), (0,)))
    tensors += [c(dq, (s_q, h, d), (0,)), c(dkv, (s_kv, d), (0,)), c(d_sink, (h,), ())]
    backend = select_backend(h, d, "bf16", topk, det)[0]
    lse_shape, dkv_shape = sm100_workspace_shapes(s_q, s_kv, d, h, det, backend)
    ws = workspace.data_ptr()
    ws_dkv = ws + _ws_align(_prod(lse_shape))
    problem = (s_q, s_kv, d, h, 1)
    if op == "bwd_d576":
        # flat byte workspaces; split_count is a run-time argument (1 when deterministic)
        split = 1 if det else d576_split_count(s_q, topk, _state(dev).sm_count)
        flat = ((ws, _prod(lse_shape)), (ws_dkv, _prod(dkv_shape)))
        fn(*problem, *(a for t in tensors for a in t), *(a for t in flat for a in t), scale, split, s)
        return
    if backend != "h128_2cta_m64" and not det:
        _memset0(d_sink.data_ptr(), h * 4, s)  # ordinary sum_dSink accumulates atomically
    fn(*problem, *(a for t in tensors for a in t), *c(ws, lse_shape, (2,)), *c(ws_dkv, dkv_shape, (2,)), scale, s)


SPARSE_FAMILY = "dsa_sparse_attention_backward"


def _launcher_family(family, op, key, dev, hint=""):
    ix = _index()
    return ix.loaded(ix.find(family, op, key, _state(dev).arch, hint), dev)


def _validate_sparse(dq, dkv, d_sink, q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, block_tile, deterministic, workspace,
                     q_cluster_mode):
    """Every problem with the inputs, raised together before anything is launched or written."""
    import torch

    problems = []
    for t, name, nd in ((q, "q", 3), (kv, "kv", 2), (topk_idxs, "topk_idxs", 2)):
        if not isinstance(t, torch.Tensor) or t.ndim != nd:
            problems.append(f"{name}: must be a {nd}-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if problems:
        raise _input_error(problems)
    dev = q.device.index if q.device.type == "cuda" else None
    arch = _state(dev).arch if dev is not None else None
    sm100 = arch is not None and _sm100(arch)
    s_q, h, d = q.shape
    s_kv, topk = kv.shape[0], topk_idxs.shape[1]
    bf16, f32 = torch.bfloat16, torch.float32
    if d not in (512, 576):
        problems.append(f"head dim D={d} (expected 512 or 576)")
    _check(problems, q, "q", (s_q, h, d), bf16, dev, 16)
    _check(problems, kv, "kv", (s_kv, d), bf16, dev, 16)
    _check(problems, out, "out", (s_q, h, HEAD_DIM_V), bf16, dev, 16)
    _check(problems, dout, "dout", (s_q, h, HEAD_DIM_V), bf16, dev, 16)
    _check(problems, lse, "lse", (s_q, h), f32, dev, 8 if sm100 else 4)  # SM100 copies LSE in fp32 pairs
    _check(problems, attn_sink, "attn_sink", (h,), f32, dev, 16)
    _check(problems, topk_idxs, "topk_idxs", (s_q, topk), torch.int32, dev, 16)
    if topk_length is not None:
        _check(problems, topk_length, "topk_length", (s_q,), torch.int32, dev, 4 if sm100 else 16)
    _check(problems, dq, "dq", (s_q, h, d), bf16, dev, 16)
    _check(problems, dkv, "dkv", (s_kv, d), bf16, dev, 16)
    _check(problems, d_sink, "d_sink", (h,), f32, dev, 16)
    if s_kv < 1:
        problems.append("kv: S_kv = 0 (expected at least one key row: the sink alone has no gradient path upstream supports)")
    if block_tile != 64:
        problems.append(f"block_tile={block_tile!r} (expected 64)")
    if q_cluster_mode != "off":
        problems.append(f"q_cluster_mode={q_cluster_mode!r}: 'adaptive_pair' is an SM100 H16/H32 D576 path this build does not ship")
    if deterministic and arch is not None and not sm100:
        problems.append("deterministic=True needs an SM100 GPU; upstream refuses it on SM90 too")
    if deterministic and sm100 and h not in DETERMINISTIC_HEADS:
        problems.append(f"deterministic=True: upstream's deterministic kernels exist for heads {DETERMINISTIC_HEADS}, not H{h}")
    need, ks, ws_align = 0, None, 16
    if not problems and dev is not None:
        st = _state(dev)
        ks = sparse_attention_backward_kernels(arch, h, d, topk, has_topk_length=topk_length is not None, deterministic=deterministic, s_q=s_q,
                                               s_kv=s_kv, sm_count=st.sm_count)
        op, key = ks.get("bwd", (None, None))
        if op == "bwd_d576" and deterministic:
            ws_align = 32  # the compact 96-plane dKV layout
            built = d576_compact_slots(_index().target_sm_count(arch))
            if d576_compact_slots(st.sm_count) != built:
                problems.append(f"deterministic D576: this GPU has {st.sm_count} SMs, so upstream would compile {d576_compact_slots(st.sm_count)} "
                                f"compact slots; the build's {arch} target has {built}. Add a target with sm_count = {st.sm_count} and rebuild")
    if not problems:
        need = sparse_attention_backward_workspace_bytes(s_q, s_kv, d, h, arch=arch, topk=topk, deterministic=deterministic)
        n = workspace.numel() if isinstance(workspace, torch.Tensor) else -1
        _check(problems, workspace, "workspace", (n,), torch.uint8, dev, ws_align)
        if not problems and n < need:
            problems.append(f"workspace: {n} bytes (expected at least {need}; see aot.dsa.sparse_attention_backward_workspace_bytes)")
        if not problems:
            named = (("q", q), ("kv", kv), ("out", out), ("dout", dout), ("lse", lse), ("attn_sink", attn_sink), ("topk_idxs", topk_idxs),
                     ("topk_length", topk_length), ("dq", dq), ("dkv", dkv), ("d_sink", d_sink))
            for i in _overlapping(workspace, need, [t for _, t in named]):
                problems.append(f"workspace: its first {need} bytes overlap {named[i][0]}")
    if problems:
        raise _input_error(problems)
    return dev, arch, s_q, s_kv, h, d, topk, need, ks, 7 if sm100 else 3, ws_align - 1
