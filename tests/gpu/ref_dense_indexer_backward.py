"""float64 torch reference for the DSA dense indexer backward (cudnn's ``dense_indexer_backward_wrapper``).

Written from the math, not from cudnn's code. The op takes the indexer inputs ``q, w, k``, the raw
dense attention scores ``attn_score`` with their row sums ``attn_l1norm`` (the target), the raw dense
indexer scores ``index_score`` (the indexer logits) with their row log-sum-exp ``index_lse`` (the
predict), and returns ``d_index_q``, ``d_weights``, ``d_index_k``; it overwrites ``index_score``
with the score-grad signal (``grad_signal`` here) and only reads ``attn_score``.

Layouts. BSHD: ``index_q (B, S_q, H, D)``, ``weights (B, S_q, H)``, ``index_k (B, S_k, D)``, scores
``(B, S_q, S_k)``, denominators ``(B, S_q)``. THD (``cu_seqlens_q`` / ``cu_seqlens_k``, ``B + 1``
offsets): ``(total_q, H, D)``, ``(total_q, H)``, ``(total_k, D)``, scores ``(total_q, max_seqlen_k)``
with *batch-local* key columns, denominators ``(total_q,)``. Below, ``b`` is a batch (segment),
``i`` a query row local to it, ``j`` a key column local to it.

Causal limit (the only columns that exist for row ``i``)::

    lim_i = clamp((off_b + i + 1) // ratio, 0, S_k_b)          off_b = q_causal_offsets[b] or 0

Step 1, score grad, for ``j < lim_i`` (``c = grad_scale * grad_loss``, ``grad_scale = loss_coeff /
max(rows, 1)``, ``rows = B * S_q`` for BSHD and ``total_q`` for THD)::

    x_j          = index_score[i, j] - index_lse[i]            (log predict)
    predict_j    = exp(x_j)
    target_j     = attn_score[i, j] / (attn_l1norm[i] + 1e-10)
    g_j          = -max(target_j, e^-100) * [x_j >= -100] * c
    grad_signal_j = g_j - predict_j * sum_{j' < lim_i} g_j'

and ``grad_signal = 0`` for ``j >= lim_i``. This is ``dL/dlogit`` of the clipped KL loss
``L = -c * sum_rows sum_{j < lim} max(target_j, e^-100) * clamp(log_softmax(logit)_j, min=-100)``
(plus terms constant in the logits) when ``index_score`` are the logits and ``index_lse`` their
log-sum-exp over ``j < lim_i``; tests/unit/refs/test_ref_dense_indexer_backward.py checks it against
torch.autograd of that loss.

Step 2, GEMM backward, ``G = grad_signal``, over ``j < lim_i`` only::

    A[h, j]          = sm_scale * (q[i, h, :] . k[j, :])
    dS[h, j]         = [A[h, j] > 0] * G[i, j] * w[i, h]
    d_weights[i, h]  = sum_j G[i, j] * relu(A[h, j])
    d_index_q[i, h]  = sm_scale * sum_j dS[h, j] * k[j, :]
    d_index_k[j, :]  = sm_scale * sum_{i, h} dS[h, j] * q[i, h, :]    (0 for key rows no query reaches)

i.e. the gradient of ``sum_{i, j < lim_i} G[i, j] * logit[i, j]`` with ``logit = sum_h w relu(sm_scale
q . k)`` (the backward kernels gate on ``sm_scale * S``; for ``sm_scale > 0`` that is the forward's
``sm_scale * sum_h w relu(S)``).

Columns ``j >= lim_i`` of ``attn_score`` / ``index_score`` are never read here (``make_inputs`` fills
them with NaN: an output NaN on the GPU then means a kernel read one). ``limits`` returns ``lim``.
THD rows in no segment contribute nothing and get zero outputs (the kernels leave them unwritten);
every segment's key count must fit the score width (``max_seqlen_k``), else ValueError.

Where the semantics were read from (nvidia-cudnn-frontend 1.32.0, ``cudnn/deepseek_sparse_attention/
indexer_backward``):

* ``api.py`` l.766-776 (the class docstring: raw scores + denominators in, dK reduce-added into zeroed
  fp32), l.822-835 (``normalization_tokens`` = ``total_q`` for THD, ``B * S_q`` for BSHD), l.864-885
  (the shapes above), l.952 (``grad_scale = loss_coeff / max(normalization_tokens, 1)``), l.959-984
  (fp32 dK zeroed, bf16 cast after), l.1225-1270 (the wrapper: ``index_score`` consumed in place,
  ``grad_loss`` read at run time).
* score grad: ``dense_indexer_backward_sm100.py`` l.46-51 (the causal rule), l.113-115 (``DENOM_EPS =
  1e-10``, ``CLIP_LOG_MIN = -100``, ``CLIP_PROB_MIN = exp(-100)``), ScoreGradDense l.131-385: l.265
  (``grad_scale * grad_loss[0]``), l.301-303 (``col_limit``), l.306-327 (``sum_grad`` over
  ``pos < col_limit``), l.347-364 (``g - predict * sum_grad`` written over ``index_score`` for
  ``pos < col_limit``, 0 up to the zero limit); ``dense_indexer_backward_sm90.py`` l.126-233
  (ScoreGradDenseSm90: the same formula; zero limit ``ceil(col_limit / block_I) * block_I``).
* GEMM: ``dense_indexer_backward_sm100.py`` l.774-788 (K blocks bounded by the causal limit),
  l.1519-1583 (``s = acc * sm_scale``; gate ``s > 0``; ``dW += G * relu(s)``; ``dS = G * w``),
  l.1930-1940 (``dQ * sm_scale``), l.2150-2156 (``dK * sm_scale``); ``indexer_backward_sm90.py``
  (``is_dense=True``, what ``dense_indexer_backward_sm90.py`` l.266-300 builds) l.179-185 and l.812
  (the per-row K-block count), l.820-831 (grad signal read for ``k < S_k_b``, 0 beyond), l.897-912
  (gate, dS, dW), l.975 and l.993-1004 (``dK * sm_scale``, reduce-added for ``k < S_k_b``), l.1028
  (``dQ * sm_scale``), l.1053 (dW stored bf16).

Accuracy bounds (``REL_ERR_BOUNDS``, norm-wise relative, ``rel_err``): as for the sparse indexer
backward (tests/gpu/ref_indexer.py says why): the kernels round ``dS`` to bf16 before the dQ/dK MMAs
and store bf16 dQ/dW (and dK unless fp32), ~2.5e-3; ``1e-2`` for dQ/dW/dK. ``grad_signal`` is fp32
arithmetic on fp32 inputs (``exp2`` approximate): ``1e-4``. The unit test measures a kernel-like
fp32/bf16 emulation against them.
"""

from __future__ import annotations

import math

import torch

from refutil import generator, one_value, rel_err  # noqa: F401 - rel_err: the tests use ref.rel_err

__all__ = [
    "CLIP_LOG_MIN",
    "CLIP_PROB_MIN",
    "DENOM_EPS",
    "REL_ERR_BOUNDS",
    "segments",
    "limits_of",
    "dense_indexer_backward_ref",
    "reference",
    "make_inputs",
    "rel_err",
]

CLIP_LOG_MIN = -100.0
CLIP_PROB_MIN = math.exp(CLIP_LOG_MIN)
DENOM_EPS = 1e-10

# Norm-wise relative error bounds of the kernels' outputs (module docstring says why).
REL_ERR_BOUNDS = {
    "d_index_q": 1e-2,
    "d_weights": 1e-2,
    "d_index_k": 1e-2,
    "grad_signal": 1e-4,
}

# Rows per GEMM chunk are chosen so one (rows, H, keys) float64 tensor holds at most this many elements.
DEFAULT_MAX_CHUNK_ELEMS = 1 << 24


def _ints(t) -> list:
    return [int(v) for v in (t.detach().reshape(-1).tolist() if isinstance(t, torch.Tensor) else t)]


def segments(index_q, index_k, cu_seqlens_q=None, cu_seqlens_k=None) -> list:
    """``[(q0, q1, k0, k1)]``: each batch's query rows and key rows in the flattened ``(rows, H, D)`` /
    ``(keys, D)`` views (BSHD: ``b * S_q`` / ``b * S_k`` strides; THD: the ``cu_seqlens``)."""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("dense indexer backward reference: THD needs both cu_seqlens_q and cu_seqlens_k")
    if cu_seqlens_q is None:
        b, s_q = index_q.shape[:2]
        s_k = index_k.shape[1]
        return [(i * s_q, (i + 1) * s_q, i * s_k, (i + 1) * s_k) for i in range(b)]
    cq, ck = _ints(cu_seqlens_q), _ints(cu_seqlens_k)
    problems = []
    if len(cq) != len(ck) or len(cq) < 1:
        problems.append(f"cu_seqlens_q ({len(cq)}) and cu_seqlens_k ({len(ck)}) must both hold B + 1 >= 1 offsets")
    for name, c, n in (("cu_seqlens_q", cq, index_q.shape[0]), ("cu_seqlens_k", ck, index_k.shape[0])):
        if c and (c[0] < 0 or any(b < a for a, b in zip(c, c[1:])) or c[-1] > n):
            problems.append(f"{name}={c}: must be non-decreasing within [0, {n}]")
    if problems:
        raise ValueError("dense indexer backward reference: " + "; ".join(problems))
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def limits_of(n_q: int, n_k: int, ratio: int, off: int = 0, device=None) -> torch.Tensor:
    """(n_q,) int64: ``clamp((off + i + 1) // ratio, 0, n_k)`` (floor division; the kernels' Int32
    division differs only for negative numerators, which the clamp sends to 0 either way)."""
    i = torch.arange(n_q, dtype=torch.int64, device=device)
    return torch.div(off + i + 1, int(ratio), rounding_mode="floor").clamp(0, n_k)


def dense_indexer_backward_ref(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse, grad_loss, sm_scale=1.0,
                               loss_coeff=1.0, ratio=1, cu_seqlens_q=None, cu_seqlens_k=None, q_causal_offsets=None, *,
                               max_chunk_elems=DEFAULT_MAX_CHUNK_ELEMS):
    """float64 ``dict(d_index_q, d_weights, d_index_k, grad_signal, limits)``; no input is modified.

    Outputs have the shapes of ``index_q``, ``weights``, ``index_k``, ``index_score`` (what the op
    leaves in it on columns ``j < lim``; 0 beyond) and ``index_lse`` (``limits``: ``lim`` per row, int64).
    Runs on the inputs' device. Module docstring: the math.
    """
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if int(ratio) < 1:
        raise ValueError(f"dense indexer backward reference: ratio={ratio} (expected >= 1)")
    if index_q.ndim != (3 if varlen else 4) or index_k.ndim != (2 if varlen else 3):
        raise ValueError(f"dense indexer backward reference: index_q {tuple(index_q.shape)} / index_k {tuple(index_k.shape)} "
                         f"(expected {'(total_q, H, D) / (total_k, D)' if varlen else '(B, S_q, H, D) / (B, S_k, D)'})")
    h, d = index_q.shape[-2:]
    lead = tuple(index_q.shape[:-2])
    # the score width: S_k (BSHD), max_seqlen_k (THD: whatever attn_score has)
    width = attn_score.shape[-1] if varlen and attn_score.ndim else (index_k.shape[1] if not varlen else -1)
    score = lead + (width,)
    problems = []
    if index_k.shape[-1] != d or (not varlen and index_k.shape[0] != lead[0]):
        problems.append(f"index_k {tuple(index_k.shape)} (expected {'(total_k, D)' if varlen else '(B, S_k, D)'}, D = {d})")
    for name, t, want in (("weights", weights, lead + (h,)), ("attn_score", attn_score, score), ("index_score", index_score, score),
                          ("attn_l1norm", attn_l1norm, lead), ("index_lse", index_lse, lead)):
        if tuple(t.shape) != want:
            problems.append(f"{name} {tuple(t.shape)} (expected {want})")
    if problems:
        raise ValueError("dense indexer backward reference: " + "; ".join(problems))
    segs = segments(index_q, index_k, cu_seqlens_q, cu_seqlens_k)
    offs = [0] * len(segs) if q_causal_offsets is None else _ints(q_causal_offsets)
    if len(offs) != len(segs):
        raise ValueError(f"dense indexer backward reference: q_causal_offsets has {len(offs)} values (expected B = {len(segs)})")
    too_long = [b for b, (_, _, k0, k1) in enumerate(segs) if k1 - k0 > width]
    if too_long:
        raise ValueError(f"dense indexer backward reference: segment(s) {too_long} hold more keys than the score width {width} (max_seqlen_k)")

    dev = index_q.device
    f64 = torch.float64
    rows = math.prod(lead)
    q = index_q.detach().to(f64).reshape(rows, h, d)
    w = weights.detach().to(f64).reshape(rows, h)
    k = index_k.detach().to(f64).reshape(-1, d)
    s_raw = index_score.detach().reshape(rows, width)
    t_raw = attn_score.detach().reshape(rows, width)
    lse = index_lse.detach().to(f64).reshape(rows)
    l1 = attn_l1norm.detach().to(f64).reshape(rows)
    c = float(loss_coeff) / max(rows, 1) * one_value(grad_loss, "dense indexer backward reference: grad_loss")
    scale = float(sm_scale)

    G = torch.zeros(rows, width, dtype=f64, device=dev)
    lim = torch.zeros(rows, dtype=torch.int64, device=dev)
    d_q = torch.zeros(rows, h, d, dtype=f64, device=dev)
    d_w = torch.zeros(rows, h, dtype=f64, device=dev)
    d_k = torch.zeros_like(k)
    zero = torch.zeros((), dtype=f64, device=dev)
    for (q0, q1, k0, k1), off in zip(segs, offs):
        n_q, n_k = q1 - q0, k1 - k0
        if n_q <= 0:
            continue
        lim_b = limits_of(n_q, n_k, ratio, off, dev)
        lim[q0:q1] = lim_b
        m = int(lim_b.max())  # the columns any row of the batch reaches
        if m == 0:
            continue
        valid = torch.arange(m, device=dev)[None, :] < lim_b[:, None]  # (n_q, m)
        # NaN (or anything) past the limit is never used: select before any arithmetic
        s = torch.where(valid, s_raw[q0:q1, :m].to(f64), zero)
        t = torch.where(valid, t_raw[q0:q1, :m].to(f64), zero)
        x = s - lse[q0:q1, None]
        predict = torch.exp(x)
        target = t / (l1[q0:q1, None] + DENOM_EPS)
        g = torch.where(valid & (x >= CLIP_LOG_MIN), -target.clamp_min(CLIP_PROB_MIN) * c, zero)
        gs = torch.where(valid, g - predict * g.sum(-1, keepdim=True), zero)
        G[q0:q1, :m] = gs

        kb = k[k0:k0 + m]
        step = max(1, max_chunk_elems // (h * max(m, d)))
        for r0 in range(0, n_q, step):
            r1 = min(n_q, r0 + step)
            qc, wc, gc, vc = q[q0 + r0:q0 + r1], w[q0 + r0:q0 + r1], gs[r0:r1], valid[r0:r1]
            a = scale * torch.einsum("ihd,jd->ihj", qc, kb)
            gate = (a > 0) & vc[:, None, :]
            d_w[q0 + r0:q0 + r1] = torch.einsum("ij,ihj->ih", gc, torch.where(gate, a, zero))
            ds = torch.where(gate, gc[:, None, :] * wc[:, :, None], zero)
            d_q[q0 + r0:q0 + r1] = scale * torch.einsum("ihj,jd->ihd", ds, kb)
            d_k[k0:k0 + m] += scale * torch.einsum("ihj,ihd->jd", ds, qc)

    return dict(
        d_index_q=d_q.reshape(index_q.shape),
        d_weights=d_w.reshape(weights.shape),
        d_index_k=d_k.reshape(index_k.shape),
        grad_signal=G.reshape(index_score.shape),
        limits=lim.reshape(index_lse.shape),
    )


_REF_ARGS = ("index_q", "weights", "index_k", "attn_score", "attn_l1norm", "index_score", "index_lse", "grad_loss", "cu_seqlens_q",
             "cu_seqlens_k", "q_causal_offsets")


def reference(x: dict, sm_scale=1.0, loss_coeff=1.0, ratio=1, **kw):
    """``dense_indexer_backward_ref`` on the tensors of a ``make_inputs`` dict (its ``max_seqlen_*`` dropped)."""
    return dense_indexer_backward_ref(**{n: x[n] for n in _REF_ARGS if n in x}, sm_scale=sm_scale, loss_coeff=loss_coeff, ratio=ratio, **kw)


# ----------------------------------------------------------------------------------------------
# Input generation shared by the unit and GPU tests.
# ----------------------------------------------------------------------------------------------


def make_inputs(B, S_q, S_k, H, D=128, *, ratio=1, sm_scale=1.0, q_causal_offsets=None, thd=None, device="cpu", seed=None,
                score_dtype=torch.float32, target_temp=1.0):
    """Consistent random inputs for ``dense_indexer_backward`` / ``dense_indexer_backward_ref`` (keyword names).

    BSHD (``thd=None``): ``B`` batches of ``S_q`` queries and ``S_k`` keys. THD (``thd=(lens_q,
    lens_k)``, ``B`` lengths each): segment ``b`` holds ``lens_q[b] <= S_q`` query rows and
    ``lens_k[b] <= S_k`` key rows, packed without gaps (``cu_seqlens`` cover every row); ``S_q`` /
    ``S_k`` are ``max_seqlen_q`` / ``max_seqlen_k`` (the score width is ``S_k``).

    Returns ``dict(index_q, weights, index_k, attn_score, attn_l1norm, index_score, index_lse,
    grad_loss)`` plus ``cu_seqlens_q``, ``cu_seqlens_k`` (int32), ``max_seqlen_q``, ``max_seqlen_k``
    for THD and ``q_causal_offsets`` (int32 (B,)) when given; the op takes the dict as keywords.

    * ``index_q``, ``index_k``: bf16 ``N(0, 1) * D**-0.25`` (``q . k`` ~ N(0, 1)); ``weights``: bf16
      ``N(0, 1) / sqrt(H)`` (logits O(1) at ``sm_scale = 1``).
    * over the valid columns ``j < lim_i`` of each row: ``index_score`` = the indexer logits ``sum_h
      w relu(sm_scale q . k)`` (fp64 from the bf16 values, rounded to ``score_dtype``), ``index_lse``
      their log-sum-exp (of the rounded values); ``attn_score`` = ``exp(N(0, 1) * target_temp)``
      (positive), ``attn_l1norm`` its row sum. Rows with ``lim = 0``: lse and l1norm 0.
    * every column ``j >= lim_i`` of ``attn_score`` and ``index_score`` is NaN.
    * ``grad_loss`` (1,) fp32 in ``[0.5, 1.5)``.

    Drawn on the CPU from ``generator(seed)``, then moved to ``device``.
    """
    gen = generator(seed)
    if thd is None:
        lens_q, lens_k = [S_q] * B, [S_k] * B
    else:
        lens_q, lens_k = [int(n) for n in thd[0]], [int(n) for n in thd[1]]
        if len(lens_q) != B or len(lens_k) != B or max(lens_q + [0]) > S_q or max(lens_k + [0]) > S_k or min(lens_q + lens_k + [0]) < 0:
            raise ValueError(f"make_inputs: thd lengths {lens_q} / {lens_k} (expected {B} each, within [0, {S_q}] / [0, {S_k}])")
    offs = [0] * B if q_causal_offsets is None else _ints(q_causal_offsets)
    if len(offs) != B:
        raise ValueError(f"make_inputs: q_causal_offsets has {len(offs)} values (expected {B})")
    rows, keys = sum(lens_q), sum(lens_k)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    q = (randn(rows, H, D) * D**-0.25).bfloat16()
    k = (randn(keys, D) * D**-0.25).bfloat16()
    w = (randn(rows, H) / math.sqrt(H)).bfloat16()
    nan = math.nan
    index_score = torch.full((rows, S_k), nan, dtype=torch.float64)
    attn_score = torch.full((rows, S_k), nan, dtype=torch.float64)
    index_lse = torch.zeros(rows, dtype=torch.float64)
    attn_l1norm = torch.zeros(rows, dtype=torch.float64)
    q0 = k0 = 0
    for n_q, n_k, off in zip(lens_q, lens_k, offs):
        lim = limits_of(n_q, n_k, ratio, off)
        m = int(lim.max()) if n_q else 0
        if m:
            valid = torch.arange(m)[None, :] < lim[:, None]
            logits = torch.einsum("ih,ihj->ij", w[q0:q0 + n_q].double(),
                                  torch.relu(sm_scale * torch.einsum("ihd,jd->ihj", q[q0:q0 + n_q].double(), k[k0:k0 + m].double())))
            logits = logits.to(score_dtype).double()
            att = torch.exp(randn(n_q, m).double() * target_temp).to(score_dtype).double()
            index_score[q0:q0 + n_q, :m] = torch.where(valid, logits, nan)
            attn_score[q0:q0 + n_q, :m] = torch.where(valid, att, nan)
            lse = torch.logsumexp(torch.where(valid, logits, -math.inf), dim=-1)
            index_lse[q0:q0 + n_q] = torch.where(lim > 0, lse, 0.0)
            attn_l1norm[q0:q0 + n_q] = torch.where(valid, att, 0.0).sum(-1)
        q0, k0 = q0 + n_q, k0 + n_k
    grad_loss = 0.5 + torch.rand(1, generator=gen, dtype=torch.float32)

    if thd is None:
        shp = dict(q=(B, S_q, H, D), w=(B, S_q, H), k=(B, S_k, D), score=(B, S_q, S_k), den=(B, S_q))
    else:
        shp = dict(q=(rows, H, D), w=(rows, H), k=(keys, D), score=(rows, S_k), den=(rows,))

    def put(t, shape, dtype=None):
        return t.reshape(shape).to(device=device, dtype=dtype or t.dtype).contiguous()

    out = dict(
        index_q=put(q, shp["q"]),
        weights=put(w, shp["w"]),
        index_k=put(k, shp["k"]),
        attn_score=put(attn_score, shp["score"], score_dtype),
        attn_l1norm=put(attn_l1norm, shp["den"], score_dtype),
        index_score=put(index_score, shp["score"], score_dtype),
        index_lse=put(index_lse, shp["den"], score_dtype),
        grad_loss=grad_loss.to(device),
    )
    if thd is not None:
        cum = [0]
        for n in lens_q:
            cum.append(cum[-1] + n)
        cuk = [0]
        for n in lens_k:
            cuk.append(cuk[-1] + n)
        out.update(cu_seqlens_q=torch.tensor(cum, dtype=torch.int32, device=device), cu_seqlens_k=torch.tensor(cuk, dtype=torch.int32, device=device),
                   max_seqlen_q=S_q, max_seqlen_k=S_k)
    if q_causal_offsets is not None:
        out["q_causal_offsets"] = torch.tensor(offs, dtype=torch.int32, device=device)
    return out
