"""float64 reference of one DSA layer's training step (examples/dsa_training_step.py), by autograd.

Written from the math of the step, not from the ops: the same loss, differentiated by torch autograd
in fp64, for the slots the step chose (top-k is a discrete choice; the test checks that choice
separately against the op's scores). For one causal sequence of S tokens, slot set ``I_s`` of row
``s`` (the non-negative ids of ``indices[s]``)::

    scores[s, t]  = sum_h w[s, h] relu(qi[s, h] . ki[t])     (t <= s, else -inf)
    a[s, h, j]    = scale * q[s, h] . kv[I_s[j]]              p = softmax_j(a), lse = logsumexp_j(a)
    out[s, h]     = sum_j p[s, h, j] kv[I_s[j], :512]
    target[s, j]  = sum_h p[s, h, j] / sum_{h, i} p[s, h, i]   (no gradient: the attention's distribution)
    logit[s, j]   = sum_h w[s, h] relu(qi[s, h] . ki[I_s[j]])   predict = softmax_j(logit)
    L             = sum(out * dout) + loss_coeff * mean_s sum_j t_j (clamp(log t_j, -100, 0) - clamp(log p_j, -100, 0))

and returns ``L``, the intermediates and ``dL/d{q, kv, qi, w, ki}``. Slots that are -1 take no part
(their target and predict are 0). The KL term is upstream's (``indexer_backward/api.py``:
``kl_div(lp, lt, log_target=True)`` summed over the slots, averaged over the rows; tests/gpu/ref_indexer.py).
"""

from __future__ import annotations

import math

import torch

__all__ = ["step_reference", "BOUNDS"]

# Norm-wise relative error bounds of the step's results against this reference. The step's outputs are
# the ops' outputs, so their bounds are the ops' (tests/gpu/ref_*.py say why): scores and the two
# distributions fp32 (1e-5), the gradients through bf16 operands and bf16 stores (1e-2); ``out``
# (bf16, the forward kernel's or the torch stand-in's) 1e-2.
BOUNDS = {"scores": 1e-5, "target": 1e-5, "predict": 1e-5, "out": 1e-2, "lse": 1e-5, "dq": 1e-2, "dkv": 1e-2, "d_qi": 1e-2, "d_w": 1e-2,
          "d_ki": 1e-2}


def step_reference(x, indices):
    """fp64 dict: loss, scores, out, lse, target, predict (slot-aligned with ``indices``), and the
    gradients dq, dkv, d_qi, d_w, d_ki, for the inputs of ``make_inputs`` and the step's ``indices``."""
    scale, coeff = x["softmax_scale"], x["loss_coeff"]
    q, kv, qi, ki, w = (x[n].detach().double().requires_grad_() for n in ("q", "kv", "qi", "ki", "w"))
    dout = x["dout"].double()
    S = q.shape[0]
    with torch.no_grad():
        causal = torch.arange(S, device=q.device)[None, :] <= torch.arange(S, device=q.device)[:, None]
        scores = torch.einsum("sh,sht->st", w, torch.einsum("shd,td->sht", qi, ki).clamp_min(0)).masked_fill(~causal, -math.inf)
    valid = indices >= 0
    ids = indices.clamp(min=0).long()
    if bool((valid & (indices.long() > torch.arange(S, device=q.device)[:, None])).any()):
        raise ValueError("step reference: a slot holds a key after its query (the causal top-k never picks one)")
    keys = kv[ids]  # (S, K, D)
    a = (scale * torch.einsum("shd,skd->shk", q, keys)).masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(a, dim=-1)
    p = torch.exp(a - lse[..., None])
    out = torch.einsum("shk,skd->shd", p, keys[..., :512])
    with torch.no_grad():
        tsum = p.sum(1)
        target = tsum / tsum.sum(-1, keepdim=True)
    logit = torch.einsum("sh,shk->sk", w, torch.einsum("shd,skd->shk", qi, ki[ids]).clamp_min(0)).masked_fill(~valid, -math.inf)
    lp = torch.log_softmax(logit, dim=-1)
    lt = target.clamp_min(math.exp(-100)).log().clamp(-100, 0)
    kl = torch.where(valid, target * (lt - lp.clamp(-100, 0)), 0.0).sum(-1)
    loss = (out * dout).sum() + coeff * kl.mean()
    loss.backward()
    return dict(loss=loss.detach(), scores=scores, out=out.detach(), lse=lse.detach(), target=target, predict=lp.detach().exp(), dq=q.grad,
                dkv=kv.grad, d_qi=qi.grad, d_w=w.grad, d_ki=ki.grad)
