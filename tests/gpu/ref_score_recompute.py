"""float64 reference for the DSA sparse indexer score recompute (cudnn's ``sparse_indexer_score_recompute_wrapper``).

Written from the math, not from cudnn's code. The op recomputes the indexer's *predict*
distribution over each query row's ``topk`` selected key slots (the ``index_score`` the sparse
indexer backward reads). One query row ``(b, s)``, slot ``j``, id ``n_j = topk_indices[b, s, j]``::

    r_j        = n_j                  local ids (the wrapper's default, topk_indices_global=False)
               = n_j - b * S_k        global ids (topk_indices_global=True: n_j = b * S_k + local)
    S[h, j]    = q[b, s, h, :] . k[b, r_j, :]                 (bf16 x bf16: exact in fp64)
    logit_j    = sum_h w[b, s, h] * relu(S[h, j])             (the scale is 1: no wrapper passes one)
    scored(j)  = j < topk_length[b, s]                        with topk_length
               = n_j < 0 is not scored, n_j >= 0 is           without
    predict_j  = exp(logit_j - m) / sum_{i scored} exp(logit_i - m),  m = max_{i scored} logit_i
                                                               for a scored slot, 0 for any other;
                 a row without a scored slot is all 0.

What happens at the slots that are not scored, and what the contract asks (nvidia-cudnn-frontend
1.32.0, ``cudnn/deepseek_sparse_attention/score_recompute/``; api.py (A), _interface_sm90.py (H),
_interface_sm100.py (I), sparse_score_recompute_sm90.py (SP90), sparse_score_recompute_sm100.py (SP100)):

* The formula: H l.246-248 and I l.379-381 (``softmax(sum_h ReLU(Q_h K^T) W_h)``, "invalid positions
  masked as -inf"); SP90 l.715 (``fmax(acc, 0) * W`` in fp32), l.718 (head reduce); SP100 l.1299-1307
  (ReLU, packed fp32 mul/add, ``* softmax_scale``). The wrapper never passes ``sm_scale`` (A l.290-310),
  whose default is 1.0 (H l.242, I l.372).
* Without ``topk_length`` a slot is masked by the sign of its *raw* id (before any batch offset), so
  every negative id is masked, not only ``-1``: SP90 l.900-904 (``token_idx < 0`` -> -inf), SP100
  l.1318-1323. Its predict is exactly 0 (``exp(-inf)``: SP90 l.949, SP100 l.1340).
* With ``topk_length`` only the position counts: slots at and past the length are 0 whatever their id
  (SP90 l.906-910 and l.976-980: ``idx >= topk_length`` written 0; the K blocks past the length are not
  loaded, SP90 l.438-442, the tail rows zero-filled, l.865-867; SP100 l.1314-1316 masks ``pos >=
  topK_epi`` to -inf, after loading every in-range id, l.829, l.1015-1030). Upstream's docstring still
  asks for ``-1`` there (A l.338-341): :func:`make_inputs` writes ``-1``, the reference does not read them.
  A negative length scores nothing on either arch (SP90 l.442, l.900; SP100 l.1315): taken as 0.
* A row with no scored slot is all 0: SP90 l.929-936 (max ``-inf``), SP100 l.1335 and l.1361-1365.
* SM90 divides by ``sum + 1e-10`` (SP90 l.888, l.974): ``sum >= 1`` (the maximum contributes
  ``exp(0)``), a relative 1e-10, not modelled.
* Outside the contract the arches differ, so the reference refuses (ValueError) rather than pick one:
  - a *scored* slot whose id is not a row of its own batch (local ``r_j`` outside ``[0, S_k)``; with
    ``topk_length`` that includes a negative id before the length; with global ids, an id of another
    batch). SM90 zero-fills that K row (SP90 l.832-864) so the slot scores ``logit 0`` and still enters
    the softmax; SM100 copies only in-range rows and never zero-fills (SP100 l.993-1030, ``_zero_row``
    unused), so the slot scores whatever the shared-memory stage held before.
  - ``topk_length > topk``: SM90 sizes ``sTopk_reduced`` by ``topk`` (SP90 l.156) and runs
    ``ceil(length / 64)`` K blocks (l.442), past the array.
* ``topk`` must be a multiple of 128 for the kernels (SP100 l.116 asserts; SP90 l.883 computes
  ``topk // 128`` elements per thread and leaves the last ``topk % 128`` columns unwritten). The
  reference is defined for any ``topk``; the build ships 512, 1024 and 2048.
* SM90 reads the weights transposed: the interface copies ``(B, S_q, H) -> (B, H, S_q)`` on every call
  (H l.254-259; the packed loader, pack_gqa.py l.145-172, addresses ``h * S_q + s``). The op makes that
  copy into the caller's workspace; the caller's ``weights`` are only read.

Accuracy bounds (``REL_ERR_BOUNDS``, norm-wise relative, ``rel_err``). The kernels' rounding points:
``S`` is an fp32 accumulation of exact bf16 x bf16 products (D = 128 terms, relative error ~1e-7 of
``sum |q_d k_d|``); ``relu(S) * w`` and the head sum are fp32 (64 terms); the softmax subtracts the row
maximum, exponentiates with the approximate ``ex2`` (SP90 ``fastmath=True``, l.949; a few ulp, after
``(x - m) * log2 e`` is rounded to fp32) and normalises by an fp32 sum of ``topk`` terms. An absolute
error ``e`` in a logit is a relative error ``e`` in its predict, so the predict's relative error is the
logits' absolute one, a few 1e-7 at the logit range of :func:`make_inputs` (``|x - m| <~ 15``). The
CPU emulation in tests/unit/refs/test_ref_score_recompute.py (fp32 round-to-nearest accumulation,
round-toward-zero accumulation as a pessimistic tensor-core adder, 2-ulp perturbed ``exp``; H 64,
D 128, topk 512 to 2048, with and without a length, local and global ids, two seeds each) measures
0.8e-7 to 2.0e-7. ``1e-5`` leaves ~50x headroom for summation orders the emulation does not model;
any semantic slip (a dropped ReLU, the weights, the masking, the length, the batch offset) is
O(0.1-1). The slots that are not scored are exactly 0 on both arches (``exp(-inf)`` or a written 0):
the GPU tests assert that exactly.
"""

from __future__ import annotations

import math

import torch

from refutil import distinct_ids, generator, rel_err  # noqa: F401 - rel_err: the tests use ref.rel_err

__all__ = ["REL_ERR_BOUNDS", "D", "scored_mask", "sparse_indexer_predict_ref", "sparse_attn_target_ref", "reference", "attention_reference",
           "make_inputs", "make_attention_inputs", "rel_err"]

# Norm-wise relative error bound of the kernels' predict (module docstring says why).
REL_ERR_BOUNDS = {"predict": 1e-5, "target": 1e-5}

D = 128  # the head dim the kernels are built for

# Rows per chunk: one gathered (rows, topk, max(H, D)) float64 tensor holds at most this many elements.
DEFAULT_MAX_CHUNK_ELEMS = 1 << 24


def scored_mask(topk_indices, topk_length=None):
    """(B, S_q, topk) bool: the slots the softmax runs over (``j < topk_length`` with a length, else
    ``id >= 0``). Does not check the contract (see :func:`sparse_indexer_predict_ref`)."""
    if topk_length is None:
        return topk_indices >= 0
    pos = torch.arange(topk_indices.shape[-1], device=topk_indices.device)
    return pos < topk_length.to(device=topk_indices.device, dtype=torch.int64)[..., None]


def _check_shapes(q, k, w, topk_indices, topk_length):
    problems = []
    if q.ndim != 4 or k.ndim != 3 or w.ndim != 3 or topk_indices.ndim != 3:
        raise ValueError("score recompute reference: expected q (B,S_q,H,D), k (B,S_k,D), w (B,S_q,H), topk_indices (B,S_q,topk); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(w.shape)}, {tuple(topk_indices.shape)}")
    bsz, s_q, h, d = q.shape
    if k.shape[0] != bsz or k.shape[2] != d:
        problems.append(f"k {tuple(k.shape)} (expected ({bsz}, S_k, {d}))")
    if tuple(w.shape) != (bsz, s_q, h):
        problems.append(f"w {tuple(w.shape)} (expected {(bsz, s_q, h)})")
    if tuple(topk_indices.shape[:2]) != (bsz, s_q):
        problems.append(f"topk_indices {tuple(topk_indices.shape)} (expected ({bsz}, {s_q}, topk))")
    if topk_indices.dtype.is_floating_point or topk_indices.dtype == torch.bool:
        problems.append(f"topk_indices dtype {topk_indices.dtype} (expected an integer dtype)")
    if topk_length is not None:
        if tuple(topk_length.shape) != (bsz, s_q):
            problems.append(f"topk_length {tuple(topk_length.shape)} (expected {(bsz, s_q)})")
        elif topk_length.dtype.is_floating_point or topk_length.dtype == torch.bool:
            problems.append(f"topk_length dtype {topk_length.dtype} (expected an integer dtype)")
    if problems:
        raise ValueError("score recompute reference: " + "; ".join(problems))


def _slots(q, k, topk_indices, topk_length, topk_indices_global):
    """(scored (B,S_q,topk) bool, flat key row per slot (B*S_q, topk) into k viewed (B*S_k, D), 0 where
    not scored), after the contract checks both references share."""
    bsz, s_q, h, d = q.shape
    s_k = k.shape[1]
    topk = topk_indices.shape[-1]
    dev = q.device
    ids = topk_indices.detach().to(device=dev, dtype=torch.int64)
    length = None
    if topk_length is not None:
        length = topk_length.detach().to(device=dev, dtype=torch.int64)
        if bool((length > topk).any()):
            raise ValueError(f"score recompute reference: topk_length up to {int(length.max())} > topk={topk} (SM90 overruns its shared array)")
        length = length.clamp_min(0)  # a negative length scores nothing on either arch
    scored = scored_mask(ids, length)
    base = (torch.arange(bsz, device=dev, dtype=torch.int64) * s_k).view(bsz, 1, 1) if topk_indices_global else 0
    local = ids - base
    bad = scored & ((local < 0) | (local >= s_k))
    if bool(bad.any()):
        b, s, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"score recompute reference: {int(bad.sum())} scored slot(s) hold an id that is not a key row of their batch "
                         f"(first: batch {b} row {s} slot {j} id {int(ids[b, s, j])}, S_k={s_k}, global={bool(topk_indices_global)}); "
                         "SM90 scores such a slot 0, SM100 reads stale shared memory: outside the contract")
    flat = torch.where(scored, local + (torch.arange(bsz, device=dev, dtype=torch.int64) * s_k).view(bsz, 1, 1), 0).reshape(bsz * s_q, topk)
    return scored, flat


def _per_row(q, k, aux, topk_indices, topk_length, topk_indices_global, max_chunk_elems, finish):
    """float64 (B, S_q, X): ``finish(S (R, H, topk), aux rows (R, H), scored (R, topk))`` -> (R, X) over chunks
    of rows, S the fp64 ``q_h . k_slot`` of every slot (slots not scored read key row 0)."""
    _check_shapes(q, k, aux, topk_indices, topk_length)
    bsz, s_q, h, d = q.shape
    s_k, topk, dev = k.shape[1], topk_indices.shape[-1], q.device
    scored, flat = _slots(q, k, topk_indices, topk_length, topk_indices_global)
    rows = bsz * s_q
    qf = q.detach().to(torch.float64).reshape(rows, h, d)
    af = aux.detach().to(device=dev, dtype=torch.float64).reshape(rows, h)
    kf = k.detach().to(device=dev, dtype=torch.float64).reshape(bsz * s_k, d)
    sc = scored.reshape(rows, topk)
    out = []
    step = max(1, max_chunk_elems // max(1, topk * max(h, d)))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        s = torch.einsum("rhd,rjd->rhj", qf[r0:r1], kf[flat[r0:r1]])
        out.append(finish(s, af[r0:r1], sc[r0:r1]))
    return torch.cat(out).reshape(bsz, s_q, -1) if out else torch.zeros(bsz, s_q, topk, dtype=torch.float64, device=dev)


def sparse_indexer_predict_ref(q, k, w, topk_indices, topk_length=None, topk_indices_global=False, *, max_chunk_elems=DEFAULT_MAX_CHUNK_ELEMS):
    """float64 ``predict`` (B, S_q, topk) on the inputs' device; no input is modified.

    ``q`` (B,S_q,H,D), ``k`` (B,S_k,D), ``w`` (B,S_q,H) (any float dtype, read as float64),
    ``topk_indices`` (B,S_q,topk) integer, ``topk_length`` (B,S_q) integer or None. ValueError for
    inputs outside the contract on which the arches disagree (module docstring): a scored slot whose
    id is not a key row of its own batch, or a length above ``topk``.
    """

    def finish(s, w, m):
        x = torch.where(m, torch.einsum("rh,rhj->rj", w, s.clamp_min(0.0)), -math.inf)
        mx = x.amax(dim=-1, keepdim=True)
        e = torch.where(m, torch.exp(x - torch.where(torch.isfinite(mx), mx, 0.0)), 0.0)
        tot = e.sum(dim=-1, keepdim=True)
        return torch.where(tot > 0, e / torch.where(tot > 0, tot, 1.0), 0.0)

    return _per_row(q, k, w, topk_indices, topk_length, topk_indices_global, max_chunk_elems, finish)


def sparse_attn_target_ref(q, k, lse, topk_indices, softmax_scale, topk_length=None, topk_indices_global=False, *,
                           max_chunk_elems=DEFAULT_MAX_CHUNK_ELEMS):
    """float64 ``target`` (B, S_q, topk) of cudnn's ``sparse_attn_score_recompute_wrapper``: per scored slot
    ``P_j = sum_h exp(softmax_scale * q_h . k_j - lse_h)`` (the attention probabilities the forward's
    LSE recovers, summed over heads), ``target_j = P_j / sum_i P_i``; 0 for a slot not scored and for
    every slot of a row whose sum is 0. The same slot rules and contract as
    :func:`sparse_indexer_predict_ref` (SP90 l.982-1016 and SP100 l.1505-1535 mask by length or id sign
    alike; both divide by the row sum, SM90 adding 1e-10, SM100 writing 0 below 1e-10)."""

    def finish(s, lse, m):
        p = torch.where(m, torch.exp(softmax_scale * s - lse[:, :, None]).sum(dim=1), 0.0)
        tot = p.sum(dim=-1, keepdim=True)
        return torch.where(tot > 0, p / torch.where(tot > 0, tot, 1.0), 0.0)

    return _per_row(q, k, lse, topk_indices, topk_length, topk_indices_global, max_chunk_elems, finish)


def reference(x, topk_indices_global=False):
    """:func:`sparse_indexer_predict_ref` of a :func:`make_inputs` dict."""
    return sparse_indexer_predict_ref(x["q_indexer"], x["k_indexer"], x["weights"], x["topk_indices"], x.get("topk_length"), topk_indices_global)


def attention_reference(x, topk_indices_global=False):
    """:func:`sparse_attn_target_ref` of a :func:`make_attention_inputs` dict."""
    return sparse_attn_target_ref(x["q_attn"], x["k_attn"], x["lse"], x["topk_indices"], x["softmax_scale"], x.get("topk_length"), topk_indices_global)


# ----------------------------------------------------------------------------------------------
# Input generation shared by the unit and GPU tests.
# ----------------------------------------------------------------------------------------------


def make_inputs(B, S_q, S_k, H, topk, *, with_length=False, topk_indices_global=False, invalid_frac=0.1, device="cpu", seed=None, d=D,
                weight_scale=3.0):
    """Random inputs within upstream's contract, keyed like the op's arguments:
    ``dict(q_indexer, k_indexer, weights, topk_indices, topk_length)`` (``topk_length`` None unless
    ``with_length``).

    * ``q_indexer`` (B,S_q,H,d), ``k_indexer`` (B,S_k,d): bf16 ``N(0, 1) * d**-0.25`` (``q . k`` ~N(0, 1));
      ``weights`` (B,S_q,H): bf16 ``N(0, 1) * weight_scale / sqrt(H)``, both signs. The logits of a row
      then spread with a standard deviation ~0.6 * ``weight_scale`` (~1.75), a predict far from uniform.
    * Each row has ``cap = min(topk, S_k)`` distinct key rows (``topk > S_k``: the row sees fewer keys
      than ``topk``, as a causal top-k does), each kept with probability ``1 - invalid_frac``:
      - without a length, the kept ids sit at random slots and every other slot holds ``-1``;
      - ``with_length``: compact, the kept ids first, ``topk_length`` their count, ``-1`` at and past it
        (A l.338-341: the padding is still required).
    * With ``invalid_frac > 0`` and enough rows, fixed edge rows: row (0, 0) has no valid slot (length
      0), row (0, 1) exactly one, the last row of the last batch all ``cap``.
    * ``topk_indices`` (B,S_q,topk) int32: local ids, or ``b * S_k + local`` when ``topk_indices_global``
      (``-1`` kept).

    Values are drawn on the CPU from ``torch.Generator().manual_seed(seed)`` (fresh entropy when None),
    so a seed gives the same inputs on every device.
    """
    if S_k < 1 or topk < 1:
        raise ValueError(f"make_inputs: S_k={S_k} and topk={topk} must be positive")
    if not 0.0 <= invalid_frac < 1.0:
        raise ValueError(f"make_inputs: invalid_frac={invalid_frac} (expected 0 <= invalid_frac < 1)")
    gen = generator(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    q = randn(B, S_q, H, d) * d**-0.25
    k = randn(B, S_k, d) * d**-0.25
    w = randn(B, S_q, H) * (weight_scale / math.sqrt(H))

    rows, cap = B * S_q, min(topk, S_k)
    ids = distinct_ids(rows, S_k, cap, gen)  # (rows, cap), random order
    keep = torch.rand(rows, cap, generator=gen) >= invalid_frac
    if invalid_frac > 0 and rows >= 3:
        keep[0] = False
        keep[1] = False
        keep[1, int(torch.randint(cap, (1,), generator=gen))] = True
        keep[rows - 1] = True
    count = keep.sum(-1)
    if with_length:
        # compact: the kept ids first (stable sort keeps their random order), -1 after
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)
        slots = torch.full((rows, topk), -1, dtype=torch.int64)
        slots[:, :cap] = torch.where(torch.arange(cap)[None, :] < count[:, None], ids.gather(-1, order), -1)
        length = count.to(torch.int32).view(B, S_q)
    else:
        slots = torch.full((rows, topk), -1, dtype=torch.int64)
        slots[:, :cap] = torch.where(keep, ids, -1)
        if cap < topk:  # scatter the -1 padding over the row
            slots = slots.gather(-1, torch.rand(rows, topk, generator=gen).argsort(dim=-1))
        length = None
    slots = slots.view(B, S_q, topk)
    if topk_indices_global:
        slots = torch.where(slots >= 0, slots + (torch.arange(B, dtype=torch.int64) * S_k).view(B, 1, 1), slots)

    return dict(
        q_indexer=q.to(device=device, dtype=torch.bfloat16),
        k_indexer=k.to(device=device, dtype=torch.bfloat16),
        weights=w.to(device=device, dtype=torch.bfloat16),
        topk_indices=slots.to(device=device, dtype=torch.int32).contiguous(),
        topk_length=None if length is None else length.to(device=device).contiguous(),
    )


def make_attention_inputs(B, S_q, S_k, H, topk, d=512, *, softmax_scale=None, with_length=False, topk_indices_global=False, invalid_frac=0.1,
                          device="cpu", seed=None, lse_jitter=1.0):
    """:func:`make_inputs`' slots and bf16 q / k at head dim ``d`` with N(0, 1) entries (``softmax_scale``,
    by default ``d**-0.5``, makes ``softmax_scale * q . k`` ~N(0, 1)), keyed like the attention op's
    arguments: ``dict(q_attn, k_attn, lse, topk_indices, topk_length, softmax_scale)``. ``lse`` (B,S_q,H)
    fp32 is each head's fp64 log-sum-exp of ``softmax_scale * q_h . k`` over the row's scored slots (what
    the sparse forward returns), plus a per-head offset uniform in ``[-lse_jitter, lse_jitter]`` so the
    heads weigh differently and the LSE visibly matters; 0 for a row without a scored slot."""
    x = make_inputs(B, S_q, S_k, H, topk, with_length=with_length, topk_indices_global=topk_indices_global, invalid_frac=invalid_frac, seed=seed,
                    d=d)
    gen = generator(None if seed is None else seed + 1)
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    q = (x["q_indexer"].float() * d**0.25).to(torch.bfloat16)  # N(0, 1) entries: q . k ~ N(0, d), scale * q . k ~ N(0, 1)
    k = (x["k_indexer"].float() * d**0.25).to(torch.bfloat16)
    ids, length = x["topk_indices"], x["topk_length"]

    def lse_of(s, _aux, m):
        z = torch.where(m[:, None, :], scale * s, -math.inf)
        out = torch.logsumexp(z, dim=-1)
        return torch.where(torch.isfinite(out), out, 0.0)

    lse = _per_row(q, k, torch.zeros(B, S_q, H), ids, length, topk_indices_global, DEFAULT_MAX_CHUNK_ELEMS, lse_of)  # (B, S_q, H)
    lse = lse + (torch.rand(B, S_q, H, generator=gen, dtype=torch.float64) * 2 - 1) * lse_jitter
    return dict(q_attn=q.to(device), k_attn=k.to(device), lse=lse.to(device=device, dtype=torch.float32).contiguous(), topk_indices=ids.to(device),
                topk_length=None if length is None else length.to(device), softmax_scale=scale)


# ----------------------------------------------------------------------------------------------
# The dense attention's scores (dense_attn_score_recompute_wrapper)
# ----------------------------------------------------------------------------------------------


def dense_attn_ref(q, k, lse, softmax_scale, ratio=1, offsets=None):
    """float64 (out, denom) of cudnn's ``dense_attn_score_recompute_wrapper`` (BSHD, one KV head): for key j
    visible to row i of batch b (``j < (offset_b + i + 1) // ratio``, the indexer forward's ratio-causal
    rule), ``out[b, i, j] = sum_h exp(softmax_scale q[b, i, h] . k[b, j] - lse[b, i, h])``, -inf where j is
    hidden; ``denom[b, i]`` the sum of row i's visible entries (0 for a row that sees none). ``out`` is not
    normalised (dense_score_recompute_sm90.py l.1274-1330: the head-summed exp2 written per visible
    position, -inf past the causal limit, the same sums added into the L1 denominator). q (B, S_q, H, D),
    k (B, S_k, 1, D), lse (B, S_q, H)."""
    B, S_q, H, D = q.shape
    S_k = k.shape[1]
    dev = q.device
    outs, dens = [], []
    for b in range(B):
        off = 0 if offsets is None else int(offsets[b])
        vis = torch.arange(S_k, device=dev)[None, :] < torch.div(off + torch.arange(S_q, device=dev)[:, None] + 1, ratio, rounding_mode="floor")
        s = torch.einsum("ihd,jd->ihj", q[b].double(), k[b, :, 0].double()) * softmax_scale - lse[b].double()[..., None]
        p = torch.exp(s).sum(1).masked_fill(~vis, 0.0)  # (S_q, S_k)
        dens.append(p.sum(-1))
        outs.append(p.masked_fill(~vis, -math.inf))
    return torch.stack(outs), torch.stack(dens)


def make_dense_attn_inputs(B, S_q, S_k, H, D, ratio, offsets=None, *, softmax_scale=None, seed=None, lse_jitter=1.0):
    """bf16 q (B, S_q, H, D) and k (B, S_k, 1, D) with N(0, 1) entries, ``softmax_scale`` default D**-0.5, and
    lse (B, S_q, H) fp32: each head's fp64 log-sum-exp over the row's visible keys (what a dense forward
    returns), plus a per-head offset in [-lse_jitter, lse_jitter]; 0 for a row that sees no key."""
    gen = generator(seed)
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    q = torch.randn(B, S_q, H, D, generator=gen).to(torch.bfloat16)
    k = torch.randn(B, S_k, 1, D, generator=gen).to(torch.bfloat16)
    lse = torch.zeros(B, S_q, H, dtype=torch.float64)
    for b in range(B):
        off = 0 if offsets is None else int(offsets[b])
        vis = torch.arange(S_k)[None, :] < torch.div(off + torch.arange(S_q)[:, None] + 1, ratio, rounding_mode="floor")
        s = torch.einsum("ihd,jd->ihj", q[b].double(), k[b, :, 0].double()) * scale
        l = torch.logsumexp(s.masked_fill(~vis[:, None, :], -math.inf), dim=-1)
        lse[b] = torch.where(torch.isfinite(l), l, 0.0)
    lse = lse + (torch.rand(B, S_q, H, generator=gen, dtype=torch.float64) * 2 - 1) * lse_jitter
    return q, k, lse.to(torch.float32).contiguous(), scale
