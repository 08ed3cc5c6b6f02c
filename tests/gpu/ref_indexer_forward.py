"""float64 reference for the DSA indexer forward (cudnn's ``indexer_forward_wrapper``), from the math.

Scores of query row ``i`` of batch ``b`` against key ``j``::

    scores[b, i, j] = sm_scale * sum_h w[b, i, h] * relu(q[b, i, h, :] . k[b, j, :])

where ``j`` is visible: ``j < S_k(b)`` and ``j < (off_b + i + 1) // ratio`` (the ratio-causal mask:
query ``i`` at global position ``off_b + i`` sees the compressed keys that end at or before it;
``off_b`` is ``q_causal_offsets[b]`` or 0). Every other position is ``-inf``. fp8: ``q`` and ``k``
are dequantized by their per-token descales (``q . k`` becomes ``q_scale[b, i, h] * k_scale[b, j] *
(q . k)``); with an fp32 ``w`` the weights are taken as already scaled, so neither ``q_scale`` nor
``sm_scale`` enters (upstream's contract). ``lse[b, i] = log sum_j exp(scores[b, i, j])`` over the
visible keys, ``-inf`` when none is.

THD: segment ``b`` holds rows ``cu_q[b]:cu_q[b+1]`` of q / w and ``cu_k[b]:cu_k[b+1]`` of k; the
scores are (total_q, max_seqlen_k) with local key columns; rows past ``max_seqlen_q`` in a segment,
rows in no segment and columns past the segment's keys (or ``max_seqlen_k``) are ``-inf``.

The functions run on the inputs' device (the parity script computes its large cases on the GPU, in fp64).

Where the semantics were read from (nvidia-cudnn-frontend 1.32.0, ``deepseek_sparse_attention``):
``indexer_forward/api.py`` (the docstring and l.211-338), ``indexer_forward/indexer_fwd_sm90.py``
l.249-253 and 392-400 (the mask, the fp8 descales), l.297-302 (fp32 W pre-scaled), l.170-239 (LSE).
"""

from __future__ import annotations

import math

import torch

__all__ = ["scores_bshd", "scores_thd", "lse_of", "random_inputs"]


def _visible(s_q: int, s_k: int, ratio: int, off: int, device=None) -> torch.Tensor:
    i = torch.arange(s_q, device=device).unsqueeze(1)
    j = torch.arange(s_k, device=device).unsqueeze(0)
    return j < torch.div(off + i + 1, ratio, rounding_mode="floor")


def _segment(q, k, w, ratio, sm_scale, off, q_scale=None, k_scale=None, prescaled=False) -> torch.Tensor:
    """(s_q, s_k) scores of one batch: q (s_q, H, D), k (s_k, D), w (s_q, H); scales (s_q, H) / (s_k,)."""
    q, k, w = q.double(), k.double(), w.double()
    dots = torch.einsum("ihd,jd->ihj", q, k)  # dequantized below: q_scale (s_q, H), k_scale (s_k,)
    if k_scale is not None:
        dots = dots * k_scale.double().view(1, 1, -1)
    if q_scale is not None and not prescaled:  # fp8 with fp32 W: W already holds q_scale * sm_scale
        dots = dots * q_scale.double().unsqueeze(-1)
    s = torch.einsum("ih,ihj->ij", w, dots.clamp_min(0))
    if not prescaled:
        s = sm_scale * s
    return s.masked_fill(~_visible(q.shape[0], k.shape[0], ratio, off, q.device), -math.inf)


def scores_bshd(q, k, w, ratio, sm_scale=1.0, offsets=None, q_scale=None, k_scale=None, prescaled=False) -> torch.Tensor:
    """(B, S_q, S_k) fp64: q (B, S_q, H, D), k (B, S_k, 1, D), w (B, S_q, H)."""
    out = []
    for b in range(q.shape[0]):
        off = 0 if offsets is None else int(offsets[b])
        qs = None if q_scale is None else q_scale[b]
        ks = None if k_scale is None else k_scale[b, :, 0]
        out.append(_segment(q[b], k[b, :, 0], w[b], ratio, sm_scale, off, qs, ks, prescaled))
    return torch.stack(out)


def scores_thd(q, k, w, cu_q, cu_k, max_q, max_k, ratio, sm_scale=1.0, offsets=None, q_scale=None, k_scale=None, prescaled=False) -> torch.Tensor:
    """(total_q, max_k) fp64: q (total_q, H, D), k (total_k, 1, D), w (total_q, H)."""
    out = torch.full((q.shape[0], max_k), -math.inf, dtype=torch.float64, device=q.device)
    for b in range(cu_q.numel() - 1):
        q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
        k0, k1 = int(cu_k[b]), int(cu_k[b + 1])
        q1, k1 = min(q1, q0 + max_q), min(k1, k0 + max_k)
        if q1 <= q0 or k1 <= k0:
            continue
        off = 0 if offsets is None else int(offsets[b])
        qs = None if q_scale is None else q_scale[q0:q1]
        ks = None if k_scale is None else k_scale[k0:k1, 0]
        out[q0:q1, : k1 - k0] = _segment(q[q0:q1], k[k0:k1, 0], w[q0:q1], ratio, sm_scale, off, qs, ks, prescaled)
    return out


def lse_of(scores) -> torch.Tensor:
    """log-sum-exp over the last dim (-inf for a row with no finite score)."""
    return torch.logsumexp(scores, dim=-1) if scores.shape[-1] else torch.full(scores.shape[:-1], -math.inf, dtype=scores.dtype, device=scores.device)


def random_inputs(lead, s_k_lead, h, gen, fp8=False, w_dtype=torch.bfloat16, d=128):
    """(q, k, w, q_scale, k_scale) on the CPU: q (*lead, h, d), k (*s_k_lead, 1, d), w (*lead, h).
    Values spread so that relu cuts about half of the dot products; fp8 values are e4m3-representable
    and their descales positive."""
    qdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    q = (torch.randn(*lead, h, d, generator=gen) * (1.0 if fp8 else 0.25)).to(qdt)
    k = (torch.randn(*s_k_lead, 1, d, generator=gen) * (1.0 if fp8 else 0.25)).to(qdt)
    w = (torch.randn(*lead, h, generator=gen) * 0.5).to(w_dtype)
    if not fp8:
        return q, k, w, None, None
    q_scale = torch.rand(*lead, h, generator=gen) * 0.05 + 0.01
    k_scale = torch.rand(*s_k_lead, 1, generator=gen) * 0.05 + 0.01
    return q, k, w, q_scale, k_scale
