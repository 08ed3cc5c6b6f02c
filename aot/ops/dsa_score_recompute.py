"""DSA score recompute ops: cudnn's ``sparse_indexer_score_recompute_wrapper``, launched from shipped cubins.

The indexer's predicted distribution over each query's top-k slots,
``predict[b, s, i] = softmax_i(sum_h relu(q[b, s, h] . k[b, topk[b, s, i]]) w[b, s, h])``, which the
indexer loss compares with the attention's (:mod:`aot.policy.dsa_score_recompute`). One launch per
call; on SM90 the weights are first copied transposed into the caller's workspace, on the call's
stream, as upstream copies them on every call. Every input is validated before anything is written
or launched. (The other three score-recompute wrappers are not shipped yet: the README's coverage table.)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..policy import dsa_score_recompute as policy
from ._support import (aliasing, alloc_on, allocate, arch_or_refuse, check, flag, flat_args, footprint, input_error, integer, launcher, require,
                       stream_handle, tensor_args, workspace_problems, writes_only)
from .outputs import Outputs
from .plan import ALLOC, Plan, Recorder, cached, compile_call, probe_for, remember, remembered

__all__ = ["sparse_indexer_score_recompute", "sparse_indexer_score_recompute_into", "sparse_indexer_score_recompute_workspace_bytes",
           "SparseIndexerScoreRecompute"]

FAMILY = policy.FAMILY
_I32 = 2**31
_TENSORS = ("out", "q_indexer", "k_indexer", "weights", "topk_indices", "topk_length", "workspace")


def sparse_indexer_score_recompute_workspace_bytes(weights_shape, device=None) -> int:
    """uint8 bytes the ``workspace`` of a call with ``weights`` of this shape (B, S_q, H) needs on GPU
    ``device`` (None: the current one): the transposed bf16 copy of the weights on SM90, none on SM100."""
    import torch

    from ..runtime.device import device_index

    shape = tuple(weights_shape) if isinstance(weights_shape, (tuple, list, torch.Size)) else None
    problems = []
    if shape is None or len(shape) != 3:
        problems.append(f"weights_shape={weights_shape!r} (expected (B, S_q, H))")
    else:
        for i, n in enumerate(shape):
            integer(problems, f"weights_shape[{i}]", n, 0, _I32 - 1)
    if problems:
        raise input_error(problems)
    arch, _ = arch_or_refuse(problems, device_index(device))
    if problems:
        raise input_error(problems)
    return policy.workspace_bytes(arch, *shape)


@dataclass(frozen=True)
class _Call:
    """What validating one call proved."""

    dev: int
    arch: str
    need: int
    kernel: tuple | None  # (op, key); None when nothing launches
    foot: list


def sparse_indexer_score_recompute(q_indexer, k_indexer, weights, topk_indices, qhead_per_kv_head=None, topk_length=None, topk_indices_global=False,
                                   out=None, stream=None, *, workspace=None):
    """cudnn's ``sparse_indexer_score_recompute_wrapper``: returns ``{'predict'}``, (B, S_q, topk) fp32.

    q_indexer (B, S_q, H, 128), k_indexer (B, S_k, 128), weights (B, S_q, H) bf16; topk_indices (B, S_q,
    topk) int32, per-batch local ids unless ``topk_indices_global`` (``b * S_k + local``), a negative id
    for an empty slot (its predict is 0); topk_length (B, S_q) int32 or None: the slots at and past it
    are 0 whatever they hold. Device values the op cannot check, as upstream: every scored id must be a
    key row of its own batch and ``0 <= topk_length <= topk`` (the arches differ otherwise: SM90 scores
    such a slot as 0, SM100 reads stale shared memory; tests/gpu/ref_score_recompute.py cites the code).
    ``out`` is allocated when not given, and on SM90 the ``workspace``
    (``sparse_indexer_score_recompute_workspace_bytes``). Every tensor contiguous."""
    import torch

    ts = (out, q_indexer, k_indexer, weights, topk_indices, topk_length, workspace)
    if out is None or workspace is None:
        extra = (qhead_per_kv_head, topk_indices_global)
        hit = remembered(_CALLS, ALLOC, ts, extra)
        call = hit and hit[0]
        if call is None:
            call = _validate(ts, qhead_per_kv_head, topk_indices_global, allocating=True)
            remember(_CALLS, ALLOC, extra, probe_for(ts, call.dev, call.foot), call)
        dev = call.dev
        stream_handle(stream, dev)  # refuse a bad stream before allocating on it

        def outputs():
            with alloc_on(stream, dev):
                b, s_q, k = topk_indices.shape
                return (torch.empty(b, s_q, k, dtype=torch.float32, device=q_indexer.device) if out is None else out,
                        torch.empty(call.need, dtype=torch.uint8, device=q_indexer.device) if workspace is None and call.need else workspace)

        out, workspace = allocate(outputs)
    sparse_indexer_score_recompute_into(out, q_indexer, k_indexer, weights, topk_indices, topk_length, topk_indices_global, stream,
                                        workspace=workspace, qhead_per_kv_head=qhead_per_kv_head)
    return Outputs(predict=out)


def sparse_indexer_score_recompute_into(out, q_indexer, k_indexer, weights, topk_indices, topk_length=None, topk_indices_global=False, stream=None, *,
                                        workspace=None, qhead_per_kv_head=None):
    """``sparse_indexer_score_recompute`` into a caller's ``out`` (and, on SM90, ``workspace``):
    capture-safe from the first call, allocates nothing. Returns ``out``."""
    ts = (out, q_indexer, k_indexer, weights, topk_indices, topk_length, workspace)
    extra = (qhead_per_kv_head, topk_indices_global)
    call, p = cached(_CALLS, ts, extra, lambda: _plan(*ts, topk_indices_global=topk_indices_global, qhead_per_kv_head=qhead_per_kv_head))
    call.run(p, stream_handle(stream, call.dev), call.x, ts, stream)
    return out


def _plan(out, q_indexer, k_indexer, weights, topk_indices, topk_length=None, workspace=None, *, topk_indices_global=False, qhead_per_kv_head=None):
    """Validate a call and compile what it does (:class:`aot.ops.plan.Call`)."""
    ts = (out, q_indexer, k_indexer, weights, topk_indices, topk_length, workspace)
    c = _validate(ts, qhead_per_kv_head, topk_indices_global)
    rec = Recorder(len(ts))
    if c.kernel is not None:
        op, key = c.kernel
        if op == "sparse_indexer_sm90":
            b, s_q, h = weights.shape

            def transpose_weights(ts, stream, n=b * h * s_q, shape=(b, h, s_q)):
                """The (B, H, S_q) copy the SM90 kernel reads (S_q the unit stride), as upstream makes it."""
                import torch

                with alloc_on(stream, c.dev):
                    ts[6][: 2 * n].view(torch.bfloat16).view(shape).copy_(ts[3].transpose(1, 2))

            rec.first(transpose_weights)
        rec.launch(launcher(FAMILY, op, key, c.dev), *_launch_args(op, ts, rec.p, rec.s))
    return compile_call("dsa_score_recompute.sparse_indexer", rec, c.dev, ts, c.foot)


def _launch_args(op, ts, p, s) -> tuple:
    """The host-function arguments of entry ``op`` in upstream's order (``ts``: anything with ``shape`` and
    ``stride()``, in :data:`_TENSORS` order; ``p``: their pointers)."""
    out, q, k, w, idx, length, _ = ts
    lens = tensor_args(length, p[5]) if length is not None else ()
    if op == "sparse_indexer":  # SM100: q, k, w, ids, out, [lengths], scale (no wrapper passes one: 1.0), stream
        return (*tensor_args(q, p[1]), *tensor_args(k, p[2]), *tensor_args(w, p[3]), *tensor_args(idx, p[4]), *tensor_args(out, p[0]), *lens, 1.0, s)
    b, s_k, d = k.shape
    b, s_q, h = w.shape
    kv4 = (p[2], b, s_k, 1, d, s_k * d, d, d)  # k.unsqueeze(2): the SM90 kernel takes kv as (B, S_k, H_kv = 1, D)
    # SM90: q, kv, ids, stream, out, the weights transposed (B, H, S_q) in the workspace, [lengths], (no L1 denominator)
    return (*tensor_args(q, p[1]), *kv4, *tensor_args(idx, p[4]), s, *tensor_args(out, p[0]), *flat_args(p[6], (b, h, s_q)), *lens)


class SparseIndexerScoreRecompute(Plan):
    """cudnn's SparseIndexerScoreRecompute shape: ``SparseIndexerScoreRecompute(out, q_indexer, k_indexer,
    weights, topk_indices, topk_length=None, workspace=None, *, topk_indices_global=False,
    qhead_per_kv_head=None)``; ``execute(<the tensors>, stream=None)``."""

    _build = staticmethod(_plan)
    _tensors = _TENSORS


_CALLS: dict = {}


def _validate(ts, qhead_per_kv_head, topk_indices_global, allocating=False) -> _Call:
    """Every problem with a call, raised together before anything is touched (``allocating``: ``out``
    and ``workspace`` given as None will be allocated)."""
    import torch

    out, q, k, w, idx, length, workspace = ts
    problems = []
    glob = flag(problems, "topk_indices_global", topk_indices_global)
    if not isinstance(q, torch.Tensor) or q.layout != torch.strided or q.ndim != 4 or q.device.type != "cuda":
        problems.append(f"q_indexer: expected a (B, S_q, H, 128) CUDA tensor, got {getattr(q, 'shape', type(q).__name__)}")
        raise input_error(problems)
    if not isinstance(k, torch.Tensor) or k.ndim != 3 or not isinstance(idx, torch.Tensor) or idx.ndim != 3:
        problems.append("k_indexer: expected (B, S_k, 128) and topk_indices (B, S_q, topk) tensors")
        raise input_error(problems)
    dev = q.device.index
    arch, sm100 = arch_or_refuse(problems, dev)
    b, s_q, h, d = q.shape
    s_k, topk = k.shape[1], idx.shape[2]
    bf16 = torch.bfloat16
    check(problems, q, "q_indexer", (b, s_q, h, policy.DIM), bf16, dev, 16)
    check(problems, k, "k_indexer", (b, s_k, policy.DIM), bf16, dev, 16)
    check(problems, w, "weights", (b, s_q, h), bf16, dev, 16)
    check(problems, idx, "topk_indices", (b, s_q, topk), torch.int32, dev, 16)
    if length is not None:
        check(problems, length, "topk_length", (b, s_q), torch.int32, dev, 16)
    if not (allocating and out is None):
        check(problems, out, "out", (b, s_q, topk), torch.float32, dev, 16)
    if qhead_per_kv_head is not None and qhead_per_kv_head != h:
        problems.append(f"qhead_per_kv_head={qhead_per_kv_head!r}: must equal q's heads ({h}; k has one KV head)")
    if d != policy.DIM:
        problems.append(f"D={d} (expected {policy.DIM})")
    if topk % 128 or not 128 <= topk <= 2048:
        problems.append(f"topk={topk} (the kernels take 128..2048 slots in multiples of 128: pad the rows with -1)")
    if not s_k and b * s_q:
        problems.append("k_indexer: S_k = 0 (expected at least one key row)")
    if not problems:
        for what, n in (("B*S_q*H*D", b * s_q * h * d), ("B*S_k*D", b * s_k * d), ("B*S_q*topk", b * s_q * topk)):
            if n >= _I32:
                problems.append(f"{what} = {n} (expected < 2**31: the kernels index with int32)")
    kernel = None
    need = 0
    if not problems:
        ks = policy.kernels(arch, h, topk, length is not None, glob)
        require(FAMILY, ks, dev)  # the entry ships, before anything is allocated or written (an empty call too)
        kernel = ks["main"] if b * s_q else None
        need = policy.workspace_bytes(arch, b, s_q, h)
        if need and not (allocating and workspace is None):
            problems += workspace_problems(workspace, need, dev, list(zip(_TENSORS, ts[:6])),
                                           "aot.dsa.sparse_indexer_score_recompute_workspace_bytes")
    if not problems:
        problems += aliasing([("out", out)], list(zip(_TENSORS[1:6], ts[1:6])))
    if problems:
        raise input_error(problems)
    foot = footprint(ts, writes=(0, 6), masks=(15,) * 6 + ((15,) if need else (0,),), sizes={6: need})
    return _Call(dev, arch, need, kernel, foot)


# --- torch.library (aot.library registers these as torch.ops.dsa_aot.<name>) -------------------------


def _t_sparse_indexer(q_indexer, k_indexer, weights, topk_indices, topk_length=None, topk_indices_global=False):
    return sparse_indexer_score_recompute(q_indexer, k_indexer, weights, topk_indices, topk_length=topk_length,
                                          topk_indices_global=topk_indices_global)["predict"]


def _f_sparse_indexer(q_indexer, k_indexer, weights, topk_indices, *args, **kwargs):
    import torch

    return topk_indices.new_empty(topk_indices.shape, dtype=torch.float32)


def _t_sparse_indexer_into(out, q_indexer, k_indexer, weights, topk_indices, topk_length=None, topk_indices_global=False, workspace=None):
    sparse_indexer_score_recompute_into(out, q_indexer, k_indexer, weights, topk_indices, topk_length, topk_indices_global, workspace=workspace)


_IN = "Tensor q_indexer, Tensor k_indexer, Tensor weights, Tensor topk_indices, Tensor? topk_length=None, bool topk_indices_global=False"
TORCH_OPS = {
    "dsa_sparse_indexer_score_recompute": (f"({_IN}) -> Tensor", _t_sparse_indexer, _f_sparse_indexer),
    "dsa_sparse_indexer_score_recompute_into": (f"(Tensor(a!) out, {_IN}, Tensor(b!)? workspace=None) -> ()", _t_sparse_indexer_into, writes_only),
}
