"""float64 torch reference for DeepSeek Sparse Attention backward with an attention sink (flat, MQA, K=V).

Written from the math, not from cudnn's code. The op being checked is cudnn's
``sparse_attention_backward_wrapper(q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=None,
topk_length=None, ...) -> {dq, dkv, d_sink}``: flat (unbatched) tensors, one shared latent ``kv`` row
per key that serves as both K and V (MQA, one kv head), global top-k ids into ``kv``, and a per-head
sink logit that adds mass to the softmax denominator but has no value row. Shapes: ``q (S_q, H, D)``,
``kv (S_kv, D)``, ``out`` / ``dout (S_q, H, Dv)``, ``lse (S_q, H)`` fp32, ``attn_sink (H,)`` fp32,
``topk_idxs (S_q, topk)`` int32, ``topk_length (S_q,)`` int32 (optional); outputs ``dq (S_q, H, D)``,
``dkv (S_kv, D)``, ``d_sink (H,)`` fp32.

Forward being differentiated (query row ``i``, head ``h``, slot ``t`` naming KV row ``n_t =
topk_idxs[i, t]``)::

    D in {512, 576};  Dv = 512 if D == 576 else D;  K row = kv[n, :D],  V row = kv[n, :Dv]
    len_i    = clamp(topk_length[i], 0, topk)             (topk when topk_length is None)
    valid_t  = t < len_i  and  0 <= n_t < S_kv             (anything else, e.g. -1 padding, is skipped)
    s[h, t]  = softmax_scale * q[i, h, :] . kv[n_t, :]     softmax_scale defaults to 1 / sqrt(D)
    lse[h]   = log sum_{valid t} exp(s[h, t])               "KV-only": the sink is NOT in it;
                                                            +inf when no slot is valid (empty row)
    lse_tot  = logaddexp(lse, attn_sink[h])                 log of the full denominator
             = log( sum_{valid t} exp(s[h, t]) + exp(attn_sink[h]) )
    P[h, t]  = exp(s[h, t] - lse_tot[h])  on valid slots, 0 elsewhere
    out[i,h] = sum_t P[h, t] * kv[n_t, :Dv]                 (0 in an empty row)

Every slot is its own softmax term: a KV row named by two slots of one row counts twice (duplicates
are allowed), and its gradient rows add up. The sink only enlarges the denominator, so
``sum_t P = 1 - p_sink`` with ``p_sink = exp(attn_sink - lse_tot)``.

Backward (``sparse_attention_backward_ref``), loss ``sum(dout * out)``, built from the *given*
``out`` and ``lse`` as the kernel does::

    Delta[i, h]  = sum_c out[i, h, c] * dout[i, h, c]
    dP[h, t]     = dout[i, h, :] . kv[n_t, :Dv]
    dS[h, t]     = P[h, t] * (dP[h, t] - Delta[h])
    dq[i, h, :]  = softmax_scale * sum_t dS[h, t] * kv[n_t, :D]
    dkv[n, :D]  += softmax_scale * sum_h dS[h, t] * q[i, h, :]      } for every valid (i, t) with
    dkv[n, :Dv] += sum_h P[h, t] * dout[i, h, :]                     } n_t == n (duplicates add)
    p_sink[i,h]  = exp(attn_sink[h] - lse_tot[i, h]) = 1 / (1 + exp(lse - attn_sink));  0 if lse = +inf
    d_sink[h]    = -sum_i p_sink[i, h] * Delta[i, h]

(``d_sink``: ``d P[h, t] / d attn_sink[h] = -P[h, t] * p_sink``, so ``d out / d sink = -p_sink * out`` and
``dL / d sink = -p_sink * (dout . out) = -p_sink * Delta``.)
With the exact forward's ``out`` / ``lse`` these are the exact gradients of ``sum(dout * out)``
(``Delta = sum_t P dP``); with a bf16-rounded ``out`` they are what the kernel computes. Rows of
``dkv`` no slot names are 0; ``dq`` of an empty row is 0.

Out of contract (not modelled): ``lse = -inf`` (the forward never writes it; SM90 maps it to log2-LSE
0 for P but to ``p_sink = 1`` for d_sink, two different conventions; this reference takes
``logaddexp(-inf, sink) = sink`` for both) and ``attn_sink = +inf``. ``attn_sink = -inf`` means no sink
(``p_sink = 0``) and is supported.

Where these semantics were read from (nvidia-cudnn-frontend 1.32.0, ``cudnn/deepseek_sparse_attention``):

* contract: ``sparse_attention_backward/api.py`` l.34-43 (shapes, "KV-only LSE"), l.185-189
  (``head_dim`` in {512, 576}; ``Dv = 512 if D == 576 else D``), l.536-554 (wrapper, returns
  ``dq, dkv, d_sink``); ``_interface_sm90.py`` l.77-94 (global KV ids, "entries outside [0, S_kv) are
  ignored", ``topk_length`` "clamped to [0, topk_max]", default scale), l.104, l.140-141 (``softmax_scale
  = 1/sqrt(head_dim)``, head_dim = q.shape[-1] = 576 for MLA); ``_interface_sm100.py`` l.434 ("KV-only
  LSE excluding sink"), l.467, l.529-530; ``_interface_sm100_d576.py`` l.221 (``1/sqrt(576)``).
* forward: ``sparse_attention_forward/api.py`` l.194 (default scale ``1/sqrt(q.shape[-1])``);
  ``_interface_sm100.py`` l.262-264 (top-k padded with ``-1``), l.307-308 (``Dv = 512``);
  ``dsa_fwd_sm100_head64.py`` l.21 and l.32-34 (invalid rows are ``-inf`` logits; duplicates, dynamic
  lengths, sink-only normalisation, empty-row sentinel O=0 / LSE=+inf), l.140-146 and l.743-746
  (``topk_length`` clamped to ``[0, Kp]``), l.213 (``lse`` "excludes sink"), l.1308 (slot valid iff
  ``slot < length and 0 <= id < S_kv``), l.982 (``s = scale * q.k``), l.1956-1962 (``lse = log sum exp s``
  or ``+inf``), l.1971-1977 (``O /= sum exp s + exp(sink)``); ``dsa_fwd_sm100_head128_small_topk.py``
  l.1450-1466 (same); l.32 of the head64 kernel: K-only tail of D=576 (V = columns ``[0, 512)``).
* backward, SM90: ``dsa_bwd_sm90.py`` l.320 (``Delta = rowsum(O * dO)`` in fp32 from the given O),
  l.337-355 (``d_sink += -p_sink * Delta``, ``p_sink = 1/(1 + 2^(lse_log2 - sink_log2))``, 0 when
  ``lse = +inf``), l.391-403 (``lse_tot = logaddexp(lse, sink)`` in log2 units), l.1167-1178 (length
  clamp), l.1427 and l.1471 (slot valid iff ``t < length and 0 <= id < S_kv``; invalid KV rows
  zero-filled and not scattered), l.1539-1552 (``P = exp2(S * scale_log2 - lse_tot_log2)``, forced 0 on
  invalid slots), l.1555 (P to bf16), l.1572-1580 (``dS = P (dP - Delta) * scale``, then bf16),
  l.1742-1744 (dKV columns 0..511 get ``P^T dO + dS^T Q``, columns 512..575 only ``dS^T Q``), l.1443
  (fp32 atomics per slot, so duplicates add), l.1294-1298 (empty row: dQ = 0);
  ``_interface_sm90.py`` l.154-155 (dKV / d_sink accumulators zeroed).
* backward, SM100: ``dsa_bwd_sm100.py`` l.659 and l.851 (``sum_OdO = -Delta``), l.853-875 (same
  ``lse_tot``, +inf sentinel), l.881-910 (``d_sink = sum p_sink * (-Delta)``);
  ``dsa_bwd_sm100_h128_d576_2cta.py`` l.380-381 (duplicate slots summed, bf16 error fed back).

Accuracy bounds for the kernel's outputs against this reference (``REL_ERR_BOUNDS``, norm-wise
relative, see ``rel_err``), for inputs like ``make_inputs``'s. The kernel computes ``S`` and ``dP``
from bf16 operands in fp32 (products exact, sums ~1e-7), ``Delta`` in fp32, ``P`` in fp32 and then
rounds ``P`` (for ``dV = P^T dO``) and ``dS`` (for ``dQ = dS K`` and ``dK = dS^T Q``) to bf16 (8
significand bits: <= 2^-9 relative, ~1.5e-3 rms), accumulates in fp32 and stores ``dq`` / ``dkv`` in
bf16 (another ~1.5e-3 rms). The errors are independent per element, so ``dq`` and ``dkv`` land near
2.3e-3: a kernel-like fp32/bf16 emulation measures 2.27e-3 / 2.34e-3 (D=512) and 2.32e-3 / 2.36e-3
(D=576) at H=64, topk=256 (tests/unit/test_ref_sparse_attention.py), as the indexer backward's
2.4e-3. ``1e-2`` leaves ~4x headroom, while a semantic slip is O(0.1-1) on the same inputs (sink
dropped from the denominator ~1, topk_length ignored ~0.6-0.7, V = last 512 columns ~1.4, default
scale ``1/sqrt(512)`` for D=576 ~0.09-0.14). ``d_sink`` is fp32 throughout (``Delta`` from exact
bf16 products with fp32 sums, ``p_sink`` from fast exp2, fp32 atomics over ``S_q``): the emulation
measures ~1.2e-7; ``1e-4`` leaves room for fast-math exp2/log2 (~2^-22 relative each) and any
summation order over many rows, and still rejects every slip above (each moves it by > 5e-2).
"""

from __future__ import annotations

import math

import torch

from refutil import distinct_ids, generator, rel_err  # noqa: F401 - rel_err: the tests use ref.rel_err

__all__ = [
    "REL_ERR_BOUNDS",
    "head_dim_v",
    "resolve_slots",
    "sparse_attention_forward_ref",
    "sparse_attention_backward_ref",
    "make_inputs",
    "rel_err",
]

# Norm-wise relative error bounds of the kernel's outputs (module docstring says why).
REL_ERR_BOUNDS = {
    "dq": 1e-2,
    "dkv": 1e-2,
    "d_sink": 1e-4,
}

# Rows per chunk are chosen so one gathered [rows, topk, max(H, D)] float64 tensor holds at most
# this many elements (2**24 elements = 128 MiB); a chunk keeps a handful of them alive.
DEFAULT_MAX_CHUNK_ELEMS = 1 << 24


def head_dim_v(head_dim: int) -> int:
    """Value width: the first 512 columns of a 576-wide latent row (K-only 64-column tail), else all."""
    if head_dim not in (512, 576):
        raise ValueError(f"sparse attention reference: head_dim must be 512 or 576 (as cudnn's kernels), got {head_dim}")
    return 512 if head_dim == 576 else head_dim


def _default_scale(softmax_scale, head_dim):
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def resolve_slots(topk_idxs, seqlen_kv, topk_length=None):
    """``(rows, valid)``, both ``(S_q, topk)``: int64 KV row per slot (0 where invalid) and the bool
    mask ``t < clamp(topk_length, 0, topk) and 0 <= id < seqlen_kv``."""
    if topk_idxs.ndim != 2:
        raise ValueError(f"sparse attention reference: topk_idxs must be (S_q, topk), got {tuple(topk_idxs.shape)}")
    ids = topk_idxs.detach().to(torch.int64)
    s_q, topk = ids.shape
    valid = (ids >= 0) & (ids < seqlen_kv)
    if topk_length is not None:
        if tuple(topk_length.shape) != (s_q,):
            raise ValueError(f"sparse attention reference: topk_length {tuple(topk_length.shape)} (expected {(s_q,)})")
        length = topk_length.detach().to(device=ids.device, dtype=torch.int64).clamp(0, topk)
        valid &= torch.arange(topk, device=ids.device, dtype=torch.int64)[None, :] < length[:, None]
    rows = torch.where(valid, ids, torch.zeros_like(ids))
    return rows, valid


def _check_common(q, kv, attn_sink, topk_idxs):
    if q.ndim != 3 or kv.ndim != 2:
        raise ValueError(f"sparse attention reference: expected q (S_q, H, D) and kv (S_kv, D), got {tuple(q.shape)} and {tuple(kv.shape)}")
    s_q, h, d = q.shape
    problems = []
    if kv.shape[1] != d:
        problems.append(f"kv {tuple(kv.shape)} (expected (S_kv, {d}))")
    if attn_sink is not None and tuple(attn_sink.shape) != (h,):
        problems.append(f"attn_sink {tuple(attn_sink.shape)} (expected {(h,)})")
    if topk_idxs.ndim != 2 or topk_idxs.shape[0] != s_q:
        problems.append(f"topk_idxs {tuple(topk_idxs.shape)} (expected ({s_q}, topk))")
    if problems:
        raise ValueError("sparse attention reference: " + "; ".join(problems))
    return s_q, h, d, head_dim_v(d)


def _sink64(attn_sink, h, device):
    if attn_sink is None:
        return torch.full((h,), -math.inf, dtype=torch.float64, device=device)
    return attn_sink.detach().to(device=device, dtype=torch.float64)


def _fp64_operands(q, kv, attn_sink, topk_idxs, topk_length, softmax_scale):
    """What the forward and the backward both start from, on q's device: the scale, the resolved
    slots (KV row, valid), q and kv in float64, the sink per head (float64)."""
    dev, (_, h, d) = q.device, q.shape
    rows, valid = resolve_slots(topk_idxs.to(dev), kv.shape[0], None if topk_length is None else topk_length.to(dev))
    qf, kvf = q.detach().to(torch.float64), kv.detach().to(device=dev, dtype=torch.float64)
    return _default_scale(softmax_scale, d), rows, valid, qf, kvf, _sink64(attn_sink, h, dev)


def _chunk_rows(topk, h, d, max_chunk_elems):
    return max(1, max_chunk_elems // max(1, topk * max(h, d)))


def sparse_attention_forward_ref(
    q,
    kv,
    attn_sink,
    topk_idxs,
    softmax_scale=None,
    topk_length=None,
    *,
    indexer_topk=0,
    max_chunk_elems=DEFAULT_MAX_CHUNK_ELEMS,
):
    """float64 ``dict(out (S_q, H, Dv), lse (S_q, H), max_logits (S_q, H), lse_indexer (S_q, H) or None)``
    of the sparse forward with a sink.

    ``lse`` is the KV-only log-sum-exp (sink excluded), ``+inf`` in a row without a valid slot
    (whose ``out`` is 0 and ``max_logits`` -inf); ``max_logits`` the largest valid score. With
    ``indexer_topk`` > 0, ``lse_indexer`` is the log-sum-exp over the valid slots among the first
    ``indexer_topk`` (``+inf`` when none), as the forward kernels snapshot it after that many slots:
    a row whose slot count ``clamp(topk_length, 0, topk)`` (``topk`` without ``topk_length``) is at most
    ``indexer_topk - 64`` never reaches the snapshot and has ``+inf`` (SM100 kernels: the snapshot is
    taken at the end of the 64-slot tile ``indexer_topk / 64 - 1``, and a row's loop stops after
    ``ceil(count / 64)`` tiles). ``attn_sink=None`` means no sink. No input is modified.
    """
    s_q, h, d, dv = _check_common(q, kv, attn_sink, topk_idxs)
    dev = q.device
    scale, rows, valid, qf, kvf, sink = _fp64_operands(q, kv, attn_sink, topk_idxs, topk_length, softmax_scale)
    topk = rows.shape[1]

    out = torch.zeros(s_q, h, dv, dtype=torch.float64, device=dev)
    lse = torch.empty(s_q, h, dtype=torch.float64, device=dev)
    max_logits = torch.empty(s_q, h, dtype=torch.float64, device=dev)
    lse_ix = torch.empty(s_q, h, dtype=torch.float64, device=dev) if indexer_topk else None
    count = torch.full((s_q,), topk, dtype=torch.int64, device=dev)
    if topk_length is not None:
        count = topk_length.detach().to(device=dev, dtype=torch.int64).clamp(0, topk)
    step = _chunk_rows(topk, h, d, max_chunk_elems)
    for r0 in range(0, s_q, step):
        r1 = min(s_q, r0 + step)
        vm = valid[r0:r1][:, None, :]  # (R, 1, T)
        kg = kvf[rows[r0:r1]]  # (R, T, D)
        s = scale * torch.einsum("rhd,rtd->rht", qf[r0:r1], kg)
        s = s.masked_fill(~vm, -math.inf)
        l_kv = torch.logsumexp(s, dim=-1)  # -inf where no slot is valid
        empty = ~valid[r0:r1].any(dim=-1, keepdim=True)  # (R, 1)
        l_kv = torch.where(empty, torch.full_like(l_kv, math.inf), l_kv)
        l_tot = torch.logaddexp(l_kv, sink[None, :])
        p = torch.where(vm, torch.exp(s - l_tot[..., None]), torch.zeros_like(s))
        out[r0:r1] = torch.einsum("rht,rtc->rhc", p, kg[..., :dv])
        lse[r0:r1] = l_kv
        max_logits[r0:r1] = s.amax(dim=-1) if topk else torch.full_like(l_kv, -math.inf)
        if indexer_topk:
            l_ix = torch.logsumexp(s[..., :indexer_topk], dim=-1)
            reached = (count[r0:r1] > indexer_topk - 64)[:, None]
            lse_ix[r0:r1] = torch.where(reached & torch.isfinite(l_ix), l_ix, torch.full_like(l_ix, math.inf))
    return dict(out=out, lse=lse, max_logits=max_logits, lse_indexer=lse_ix)


def sparse_attention_backward_ref(
    q,
    kv,
    out,
    dout,
    lse,
    attn_sink,
    topk_idxs,
    softmax_scale=None,
    topk_length=None,
    *,
    max_chunk_elems=DEFAULT_MAX_CHUNK_ELEMS,
):
    """float64 ``dict(dq (S_q, H, D), dkv (S_kv, D), d_sink (H,))``; no input is modified.

    Uses the given ``out`` (for ``Delta``) and KV-only ``lse`` exactly as the kernel does (module
    docstring). ``attn_sink=None`` means no sink (``d_sink`` is then all zero).
    """
    s_q, h, d, dv = _check_common(q, kv, attn_sink, topk_idxs)
    problems = []
    for name, t in (("out", out), ("dout", dout)):
        if tuple(t.shape) != (s_q, h, dv):
            problems.append(f"{name} {tuple(t.shape)} (expected {(s_q, h, dv)})")
    if tuple(lse.shape) != (s_q, h):
        problems.append(f"lse {tuple(lse.shape)} (expected {(s_q, h)})")
    if problems:
        raise ValueError("sparse attention reference: " + "; ".join(problems))

    dev = q.device
    scale, rows, valid, qf, kvf, sink = _fp64_operands(q, kv, attn_sink, topk_idxs, topk_length, softmax_scale)
    topk = rows.shape[1]
    do = dout.detach().to(device=dev, dtype=torch.float64)
    l_kv = lse.detach().to(device=dev, dtype=torch.float64)

    delta = (out.detach().to(device=dev, dtype=torch.float64) * do).sum(dim=-1)  # (S_q, H)
    l_tot = torch.logaddexp(l_kv, sink[None, :])  # +inf stays +inf (empty row)
    p_sink = torch.where(l_kv == math.inf, torch.zeros_like(l_tot), torch.exp(sink[None, :] - l_tot))
    d_sink = -(p_sink * delta).sum(dim=0)

    dq = torch.zeros(s_q, h, d, dtype=torch.float64, device=dev)
    dkv = torch.zeros(kv.shape[0], d, dtype=torch.float64, device=dev)
    step = _chunk_rows(topk, h, d, max_chunk_elems)
    for r0 in range(0, s_q, step):
        r1 = min(s_q, r0 + step)
        vr = valid[r0:r1]
        vm = vr[:, None, :]
        kg = kvf[rows[r0:r1]]  # (R, T, D); V = kg[..., :dv]
        qc, doc = qf[r0:r1], do[r0:r1]
        s = scale * torch.einsum("rhd,rtd->rht", qc, kg)
        p = torch.where(vm, torch.exp(s - l_tot[r0:r1, :, None]), torch.zeros_like(s))
        dp = torch.einsum("rhc,rtc->rht", doc, kg[..., :dv])
        ds = p * (dp - delta[r0:r1, :, None])
        dq[r0:r1] = scale * torch.einsum("rht,rtd->rhd", ds, kg)
        dk_rows = scale * torch.einsum("rht,rhd->rtd", ds, qc)  # (R, T, D)
        dk_rows[..., :dv] += torch.einsum("rht,rhc->rtc", p, doc)
        dkv.index_add_(0, rows[r0:r1][vr], dk_rows[vr])
    return dict(dq=dq, dkv=dkv, d_sink=d_sink)


# ----------------------------------------------------------------------------------------------
# Input generation shared by the unit and GPU tests.
# ----------------------------------------------------------------------------------------------


def make_inputs(
    S_q,
    S_kv,
    H,
    D,
    topk,
    *,
    with_topk_length=False,
    device="cpu",
    seed=None,
    invalid_frac=0.0,
    softmax_scale=None,
):
    """Random inputs for ``sparse_attention_backward_wrapper`` / ``sparse_attention_backward_ref``.

    Returns ``dict(q, kv, out, dout, lse, attn_sink, topk_idxs, topk_length, softmax_scale)`` (the
    wrapper's keyword names; ``topk_length`` is None unless ``with_topk_length``):

    * ``q (S_q, H, D)``, ``kv (S_kv, D)``: bf16; ``kv ~ N(0, 1)``, ``q ~ N(0, 1) / (scale * sqrt(D))``,
      so the logits ``scale * q . k`` are ~N(0, 1) for any ``softmax_scale`` (scale = 1/sqrt(D) when None).
    * ``topk_idxs (S_q, topk)`` int32: ``topk`` distinct random KV rows per query (needs
      ``topk <= S_kv``, like a real top-k), in random slot order; each slot independently ``-1``
      (top-k padding) with probability ``invalid_frac``.
    * ``topk_length (S_q,)`` int32, uniform in ``[0, topk]`` (0 and topk included); slots past it keep
      valid ids, so ignoring the length is visible.
    * ``attn_sink (H,)`` fp32: ``log(topk) + 1.5 * N(0, 1)``, so the sink's share of the denominator
      spreads over ~(0.05, 0.9) across heads.
    * ``out`` (bf16) and ``lse`` (fp32, KV-only, ``+inf`` in empty rows): the fp64
      ``sparse_attention_forward_ref`` of these inputs, rounded, so ``Delta = rowsum(dout * out)``
      is consistent with ``P`` as in a real training step.
    * ``dout (S_q, H, Dv)``: bf16 ``N(0, 1)``.

    Values are drawn on the CPU from ``torch.Generator().manual_seed(seed)`` (a fresh random seed
    when ``seed`` is None), so a seed gives the same inputs on every device; ``out`` / ``lse`` are
    computed in fp64 on ``device`` (they agree across devices up to fp64 rounding before the cast).
    """
    dv = head_dim_v(D)
    if topk > S_kv:
        raise ValueError(f"make_inputs: topk={topk} distinct ids need S_kv >= topk, got S_kv={S_kv}")
    scale = _default_scale(softmax_scale, D)
    gen = generator(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    q = (randn(S_q, H, D) / (scale * math.sqrt(D))).to(torch.bfloat16)
    kv = randn(S_kv, D).to(torch.bfloat16)

    ids = distinct_ids(S_q, S_kv, topk, gen)
    keep = torch.rand(S_q, topk, generator=gen) >= invalid_frac
    ids = torch.where(keep, ids, torch.full_like(ids, -1)).to(torch.int32)
    topk_length = torch.randint(0, topk + 1, (S_q,), generator=gen, dtype=torch.int64).to(torch.int32) if with_topk_length else None
    attn_sink = math.log(max(1, topk)) + 1.5 * randn(H)
    dout = randn(S_q, H, dv).to(torch.bfloat16)

    q, kv, ids, attn_sink, dout = (t.to(device) for t in (q, kv, ids, attn_sink, dout))
    if topk_length is not None:
        topk_length = topk_length.to(device)
    fwd = sparse_attention_forward_ref(q, kv, attn_sink, ids, softmax_scale, topk_length)
    return dict(
        q=q.contiguous(),
        kv=kv.contiguous(),
        out=fwd["out"].to(torch.bfloat16).contiguous(),
        dout=dout.contiguous(),
        lse=fwd["lse"].to(torch.float32).contiguous(),
        attn_sink=attn_sink.to(torch.float32).contiguous(),
        topk_idxs=ids.contiguous(),
        topk_length=None if topk_length is None else topk_length.contiguous(),
        softmax_scale=softmax_scale,
    )
