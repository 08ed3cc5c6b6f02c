"""float64 torch reference for the DeepSeek Sparse Attention indexer backward (top-k sparse, BSHD).

Written from the math, not from cudnn's code. The op being checked is cudnn's
``indexer_backward_wrapper``: given the indexer inputs, the target distribution ``attn_score``
(``t``), the predict distribution ``index_score`` (``p``, the softmax of the indexer logits over
the ``topk`` selected slots) and ``topk_indices``, it returns ``d_index_q``, ``d_weights``,
``d_index_k`` and leaves ``attn_score`` holding the per-slot gradient ``grad_signal``.

Forward being differentiated (one query row ``(b, s)``, slot ``j`` with key row ``n_j``)::

    S[h, j]  = q[b, s, h, :] . k[n_j, :]                        (bf16 x bf16, exact in fp64)
    logit_j  = sum_h w[b, s, h] * relu(sm_scale * S[h, j])       (== sm_scale * sum_h w relu(S)
                                                                  for sm_scale > 0, the forward's form)
    p        = softmax_j(logit)                                  (``index_score``)
    L        = loss_coeff * mean_{b,s} sum_j kl_j,  kl_j = exp(lt_j) * (lt_j - lp_j),
               lt_j = clamp(log t_j, -100, 0),  lp_j = clamp(log p_j, -100, 0)
               (``kl_div(lp, lt, log_target=True)``, summed over slots, averaged over the B * S_q rows)

Step 1, score grad (``score_grad_ref``), with ``grad_scale = loss_coeff / (B * S_q)`` and
``c = grad_scale * grad_loss``::

    g_j          = dL/dlp_j = -max(t_j, e^-100) * [p_j >= e^-100] * c
    grad_signal  = dL/dlogit_j = g_j - p_j * sum_i g_i

(``exp(clamp(log t, -100, 0)) = max(t, e^-100)`` for ``t <= 1``; the clamp on ``lp`` passes the
gradient only where ``log p >= -100``; the last line is the softmax Jacobian ``dlp_i/dlogit_j =
[i == j] - p_j`` applied to ``g``.) The sum runs over all ``topk`` slots, valid or not: the kernel
computes it from ``attn_score``/``index_score`` alone (cudnn's contract asks the caller to zero both
on invalid slots, which makes ``g`` and ``grad_signal`` vanish there).

Step 2, GEMM backward (``indexer_backward_ref``), ``G_j = grad_signal_j``, ``A = sm_scale * S``,
gate ``P[h, j] = [A[h, j] > 0]``, over valid slots only::

    dS[h, j]          = P[h, j] * G_j * w_h
    d_weights[h]      = sum_j G_j * relu(A[h, j])
    d_index_q[h, :]   = sm_scale * sum_j dS[h, j] * k[n_j, :]
    d_index_k[n, :]  += sm_scale * sum_h dS[h, j] * q[h, :]      for every (row, slot) with n_j == n

(duplicates accumulate, as the kernel's fp32 atomics / bulk reduce-adds do).

Invalid slots contribute nothing (no dW/dQ term, no dK scatter; their K row is zero-filled so
``A = 0`` fails the ``> 0`` gate). Validity of an id ``n`` of batch ``b``:

* ``topk_indices_global=False`` (local ids): ``0 <= n < S_k``; key row ``(b, n)``.
* ``topk_indices_global=True`` (flat ids ``b * S_k + local``): SM90 subtracts ``b * S_k`` and needs
  ``0 <= n - b * S_k < S_k`` (an id of another batch is dropped); SM100 and ``sm100_v2`` index the
  flattened ``(B * S_k, D)`` key view and need only ``0 <= n < B * S_k`` (an id of another batch is
  used). ``global_cross_batch=False`` (default) is the SM90 rule, ``True`` the SM100 one; the two
  agree on every id that lies in its own batch or is negative (top-k padding is ``-1``).

``sm_scale <= 0``: the default backends gate on ``sm_scale * S`` as above (this reference follows
them; it is then the gradient of ``sum_h w relu(sm_scale * S)``, not of the forward kernel's
``sm_scale * sum_h w relu(S)``); ``sm100_v2`` rejects ``sm_scale <= 0``.

Where these semantics were read from (nvidia-cudnn-frontend 1.32.0,
``cudnn/deepseek_sparse_attention``):

* loss and scale: ``indexer_backward/api.py`` l.222-226, l.748 (``grad_scale = loss_coeff / (B*S_q)``),
  l.1030-1031 (``indexer_loss = loss_coeff * kl.mean()``), l.1014-1018 and l.1032-1035 (``index_score``
  is the predict softmax, slot-aligned with ``topk_indices``; same valid-slot mask for
  ``attn_score``).
* score grad: ``indexer_backward_sm90.py`` l.90-92 (``EPS = 1e-10``, unused by the sparse score
  grad; ``CLIP_LOG_MIN = -100``; ``CLIP_PROB_MIN = exp(-100)``), l.1458 (``grad_scale * grad_loss[0]``),
  l.1470-1481 (``sum_g``), l.1494-1507 (``g_i - predict * sum_g`` written over ``attn_score``),
  l.1567-1571 (the clipped ``kl_div(log_target=True)`` derivation); ``indexer_backward_sm100.py``
  l.3644-3663 and l.3736-3761 (same formula), l.3857-3861.
* GEMM: ``indexer_backward_sm90.py`` l.899-912 (``s = acc * sm_scale``; gate ``s > 0``; ``dS = G w``;
  ``dW += G s``), l.975 (``dK *= sm_scale``), l.997-1004 (dK reduce-add only for
  ``0 <= id < S_k``), l.1028 (``dQ *= sm_scale``, stored bf16), l.1053 (dW stored bf16),
  l.1173-1178 (global ids: ``id - b * S_k``), l.1205-1229 (invalid rows of K zero-filled);
  ``indexer_backward_sm100.py`` l.585-600 and l.812 (flat ``(B*S_k, D)`` view, ``seqlen_k = B*S_k``),
  l.1052-1070 (local ids range-checked against ``S_k`` then offset, others ``-1``), l.2891-2923 (same
  gate / dW / dS), l.3033, l.3211 (``sm_scale`` on dQ / dK), l.3221 and l.3303-3311 (global ids
  checked against ``B*S_k`` only); ``indexer_backward_v2_sm100.py`` docstring l.47-68 (same
  semantics, ``sm_scale`` folded into ``G``).
* forward: ``indexer_forward/indexer_fwd_sm90.py`` l.11 and l.374-380, ``indexer_forward/_interface.py``
  l.136-145 (``sm_scale * sum_h relu(Q_h K^T) W_h``); top-k padding slots are ``-1`` with zero
  softmax, ``indexer_forward/_compressed_top_k_sm100.py`` l.70-75, l.332-337.

Accuracy bounds for the kernel's outputs against this reference (``REL_ERR_BOUNDS``, norm-wise
relative, see ``rel_err``), for inputs like ``make_inputs``'s: the scores ``S`` come from bf16
inputs through an fp32 accumulator (exact to ~1e-7), ``grad_signal`` is fp32, and the default
backends round ``dS`` to bf16 before the dQ/dK MMAs (bf16 keeps 8 significand bits: rounding error
<= 2^-8 relative, ~1.6e-3 rms; ``indexer_backward_v2_sm100.py`` l.20-24 measures 1.66e-3) and store
bf16 outputs (another ~1.6e-3 rms). The errors are independent per element, so dQ and dK land near
``2.4e-3`` and dW (fp32 accumulation, bf16 store) near ``1.6e-3``: that is what a kernel-like
fp32/bf16 emulation measures (tests/unit/test_ref_indexer.py, H=64, D=128, topk=256; grad_signal
~5e-8). ``1e-2`` leaves ~4x headroom while any semantic mistake (a lost ``sm_scale``, a wrong gate,
a dropped or misplaced slot) is O(0.1-1). fp32 ``d_index_k`` / ``d_weights`` buffers do not tighten
the default backend (its ``dS`` is still bf16), so the same bounds apply. ``grad_signal`` (fp32,
sums of ``topk`` terms) is held to ``1e-4``.
"""

from __future__ import annotations

import math

import torch

from refutil import distinct_ids, generator, one_value, rel_err  # noqa: F401 - rel_err: the tests use ref.rel_err

__all__ = [
    "CLIP_LOG_MIN",
    "CLIP_PROB_MIN",
    "REL_ERR_BOUNDS",
    "score_grad_ref",
    "indexer_backward_ref",
    "resolve_topk_rows",
    "make_inputs",
    "rel_err",
]

CLIP_LOG_MIN = -100.0
CLIP_PROB_MIN = math.exp(CLIP_LOG_MIN)

# Norm-wise relative error bounds of the kernel's outputs (module docstring says why).
REL_ERR_BOUNDS = {
    "d_index_q": 1e-2,
    "d_weights": 1e-2,
    "d_index_k": 1e-2,
    "grad_signal": 1e-4,
}

# Rows per chunk are chosen so one gathered [rows, topk, max(H, D)] float64 tensor holds at most
# this many elements (2**24 elements = 128 MiB); a chunk keeps a handful of them alive.
DEFAULT_MAX_CHUNK_ELEMS = 1 << 24


def score_grad_ref(attn_score, index_score, grad_loss, grad_scale):
    """float64 ``grad_signal`` (same shape as ``attn_score``; the last dim is the slot dim).

    ``g = -max(t, e^-100) * [p >= e^-100] * grad_scale * grad_loss``;
    ``grad_signal = g - p * sum(g)`` over the last dim. Inputs are not modified.
    """
    if attn_score.shape != index_score.shape:
        raise ValueError(f"indexer reference: attn_score {tuple(attn_score.shape)} and index_score {tuple(index_score.shape)} differ")
    c = grad_scale * one_value(grad_loss, "indexer reference: grad_loss")
    t = attn_score.detach().to(torch.float64)
    p = index_score.detach().to(torch.float64)
    g = -t.clamp_min(CLIP_PROB_MIN) * (p >= CLIP_PROB_MIN).to(torch.float64) * c
    return g - p * g.sum(dim=-1, keepdim=True)


def resolve_topk_rows(topk_indices, seqlen_k, *, topk_indices_global=False, global_cross_batch=False):
    """``(flat, valid)``: flat key-row ids into the ``(B * S_k, D)`` view of ``index_k`` (int64, 0
    where invalid) and the bool validity mask, both ``(B, S_q, topk)``."""
    if topk_indices.ndim != 3:
        raise ValueError(f"indexer reference: topk_indices must be (B, S_q, topk), got {tuple(topk_indices.shape)}")
    b = topk_indices.shape[0]
    ids = topk_indices.detach().to(torch.int64)
    base = (torch.arange(b, device=ids.device, dtype=torch.int64) * seqlen_k).view(b, 1, 1)
    if not topk_indices_global:
        valid = (ids >= 0) & (ids < seqlen_k)
        flat = ids + base
    elif global_cross_batch:
        valid = (ids >= 0) & (ids < b * seqlen_k)
        flat = ids
    else:
        local = ids - base
        valid = (local >= 0) & (local < seqlen_k)
        flat = ids
    flat = torch.where(valid, flat, torch.zeros_like(flat))
    return flat, valid


def indexer_backward_ref(
    index_q,
    weights,
    index_k,
    attn_score,
    index_score,
    topk_indices,
    grad_loss,
    sm_scale=1.0,
    loss_coeff=1.0,
    topk_indices_global=False,
    *,
    global_cross_batch=False,
    max_chunk_elems=DEFAULT_MAX_CHUNK_ELEMS,
):
    """float64 ``dict(d_index_q, d_weights, d_index_k, grad_signal)``; no input is modified.

    Shapes: ``index_q (B, S_q, H, D)``, ``weights (B, S_q, H)``, ``index_k (B, S_k, D)``,
    ``attn_score`` / ``index_score`` / ``topk_indices`` ``(B, S_q, topk)``, ``grad_loss`` one element
    (tensor or number). ``grad_signal`` is what the kernel leaves in ``attn_score``.
    ``global_cross_batch`` picks the SM100 rule for global ids of another batch (module docstring).
    """
    if index_q.ndim != 4 or weights.ndim != 3 or index_k.ndim != 3:
        raise ValueError("indexer reference: expected index_q (B,S_q,H,D), weights (B,S_q,H), index_k (B,S_k,D)")
    bsz, s_q, h, d = index_q.shape
    _, s_k, _ = index_k.shape
    topk = topk_indices.shape[-1]
    problems = []
    if tuple(weights.shape) != (bsz, s_q, h):
        problems.append(f"weights {tuple(weights.shape)} (expected {(bsz, s_q, h)})")
    if tuple(index_k.shape) != (bsz, s_k, d):
        problems.append(f"index_k {tuple(index_k.shape)} (expected {(bsz, s_k, d)})")
    for name, t in (("attn_score", attn_score), ("index_score", index_score), ("topk_indices", topk_indices)):
        if tuple(t.shape) != (bsz, s_q, topk):
            problems.append(f"{name} {tuple(t.shape)} (expected {(bsz, s_q, topk)})")
    if problems:
        raise ValueError("indexer reference: " + "; ".join(problems))

    dev = index_q.device
    grad_scale = float(loss_coeff) / (bsz * s_q) if bsz * s_q else 0.0
    gs = score_grad_ref(attn_score, index_score, grad_loss, grad_scale)  # (B, S_q, topk)
    flat, valid = resolve_topk_rows(topk_indices, s_k, topk_indices_global=topk_indices_global, global_cross_batch=global_cross_batch)

    rows = bsz * s_q
    q = index_q.detach().to(torch.float64).reshape(rows, h, d)
    w = weights.detach().to(torch.float64).reshape(rows, h)
    k = index_k.detach().to(torch.float64).reshape(bsz * s_k, d)
    g = gs.reshape(rows, topk)
    flat = flat.reshape(rows, topk)
    valid = valid.reshape(rows, topk)
    scale = float(sm_scale)

    d_q = torch.zeros(rows, h, d, dtype=torch.float64, device=dev)
    d_w = torch.zeros(rows, h, dtype=torch.float64, device=dev)
    d_k = torch.zeros(bsz * s_k, d, dtype=torch.float64, device=dev)
    step = max(1, max_chunk_elems // max(1, topk * max(h, d)))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        vm = valid[r0:r1]
        kg = k[flat[r0:r1]] * vm[..., None]  # (R, topk, D), invalid rows zero
        gv = g[r0:r1] * vm  # invalid slots carry nothing
        qc, wc = q[r0:r1], w[r0:r1]
        a = scale * torch.einsum("rhd,rjd->rhj", qc, kg)  # (R, H, topk)
        gate = (a > 0) & vm[:, None, :]
        relu_a = torch.where(gate, a, torch.zeros_like(a))
        d_w[r0:r1] = torch.einsum("rj,rhj->rh", gv, relu_a)
        ds = torch.where(gate, gv[:, None, :] * wc[:, :, None], torch.zeros_like(a))
        d_q[r0:r1] = scale * torch.einsum("rhj,rjd->rhd", ds, kg)
        dk_rows = scale * torch.einsum("rhj,rhd->rjd", ds, qc)  # (R, topk, D)
        d_k.index_add_(0, flat[r0:r1][vm], dk_rows[vm])

    return dict(
        d_index_q=d_q.reshape(bsz, s_q, h, d),
        d_weights=d_w.reshape(bsz, s_q, h),
        d_index_k=d_k.reshape(bsz, s_k, d),
        grad_signal=gs,
    )


# ----------------------------------------------------------------------------------------------
# Input generation shared by the unit and GPU tests.
# ----------------------------------------------------------------------------------------------


def _softmax_masked(logits, valid):
    x = torch.where(valid, logits, torch.full_like(logits, -math.inf))
    p = torch.softmax(x, dim=-1)
    return torch.nan_to_num(p, nan=0.0)  # rows without a valid slot: all zero


def make_inputs(
    B,
    S_q,
    S_k,
    H,
    D,
    topk,
    *,
    topk_indices_global=False,
    device="cpu",
    seed=None,
    invalid_frac=0.0,
    target_temp=2.0,
    predict_temp=1.5,
):
    """Random inputs for ``indexer_backward_wrapper`` / ``indexer_backward_ref`` (keyword names).

    Returns ``dict(index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss)``:

    * ``index_q`` (B,S_q,H,D), ``index_k`` (B,S_k,D): bf16 ``N(0, 1) * D**-0.25``, so ``q . k`` is
      ~N(0, 1); ``weights`` (B,S_q,H): bf16 ``N(0, 1) / sqrt(H)``, so logits are O(1) at
      ``sm_scale = 1``.
    * ``topk_indices`` (B,S_q,topk) int32: ``topk`` distinct random key rows per query row (needs
      ``topk <= S_k``), in random slot order; local ids, or ``b * S_k + local`` when
      ``topk_indices_global``. Each slot is independently made invalid (``-1``, top-k padding) with
      probability ``invalid_frac``.
    * ``attn_score`` (target) and ``index_score`` (predict), fp32: softmaxes of independent random
      logits (``N(0, 1) * target_temp`` / ``* predict_temp``) over the valid slots of each row,
      exactly 0 on invalid slots (all zero in a row without a valid slot).
    * ``grad_loss`` (1,) fp32 in ``[0.5, 1.5)``.

    Values are drawn on the CPU from ``torch.Generator().manual_seed(seed)`` (a fresh random seed
    when ``seed`` is None), so a seed gives the same inputs on every device.
    """
    if topk > S_k:
        raise ValueError(f"make_inputs: topk={topk} distinct ids need S_k >= topk, got S_k={S_k}")
    gen = generator(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    index_q = randn(B, S_q, H, D) * D**-0.25
    index_k = randn(B, S_k, D) * D**-0.25
    weights = randn(B, S_q, H) / math.sqrt(H)

    rows = B * S_q
    ids = distinct_ids(rows, S_k, topk, gen)
    ids = ids.view(B, S_q, topk)
    valid = torch.rand(B, S_q, topk, generator=gen) >= invalid_frac
    if topk_indices_global:
        ids = ids + (torch.arange(B, dtype=torch.int64) * S_k).view(B, 1, 1)
    ids = torch.where(valid, ids, torch.full_like(ids, -1))

    attn_score = _softmax_masked(randn(B, S_q, topk) * target_temp, valid)
    index_score = _softmax_masked(randn(B, S_q, topk) * predict_temp, valid)
    grad_loss = 0.5 + torch.rand(1, generator=gen, dtype=torch.float32)

    return dict(
        index_q=index_q.to(device=device, dtype=torch.bfloat16),
        weights=weights.to(device=device, dtype=torch.bfloat16),
        index_k=index_k.to(device=device, dtype=torch.bfloat16),
        attn_score=attn_score.to(device=device, dtype=torch.float32).contiguous(),
        index_score=index_score.to(device=device, dtype=torch.float32).contiguous(),
        topk_indices=ids.to(device=device, dtype=torch.int32).contiguous(),
        grad_loss=grad_loss.to(device=device),
    )
