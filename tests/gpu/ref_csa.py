"""float64 torch reference for the CSA compressor (gated-softmax pooling, THD packed layout).

Written from the math, not from cudnn's code. The op being checked is

    out[b, j] = sum_k kv[w(b, k), c(k, j)] * softmax_k(score[w(b, k), c(k, j)] + ape[k % ratio, c(k, j)])

Window of output row ``b`` (segment ``s`` with ``cu_seqlens_comp[s] <= b < cu_seqlens_comp[s+1]``,
block-in-segment ``i = b - cu_seqlens_comp[s]``, first token ``t0 = cu_seqlens[s] + i * ratio``):

* ``coff == 1``: ``k in [0, ratio)``, token ``t0 + k``, column ``j``, APE row ``k``.
* ``coff == 2`` (kv/score are ``2 * head_dim`` wide): ``k in [0, 2 * ratio)``.
  ``k < ratio``: the previous block's token ``t0 - ratio + k``, first-half column ``j``, APE row
  ``k`` (APE column ``j``); this half is invalid when ``i == 0`` (the segment's first block):
  its logits are the constant ``-inf`` (no APE added) and its kv is ``0``.
  ``k >= ratio``: own token ``t0 + k - ratio``, second-half column ``head_dim + j``, APE row
  ``k - ratio`` (APE column ``head_dim + j``).

Tokens of a segment past its last full block (``seqlen % ratio``) are dropped, and
``cu_seqlens_comp[s+1] - cu_seqlens_comp[s] == seqlen_s // ratio``.

Static-capacity padding rows ``b in [cu_seqlens_comp[-1], total_comp)`` are computed with
first-in-segment semantics from token ``cu_seqlens[0]`` (= 0): ``t0 = cu_seqlens[0]``, ``i = 0``.
Their incoming gradients are ignored by the backward.

Backward: ``torch.autograd`` through the float64 forward, with ``grad_out`` rows of padding rows
treated as zero. Positions no window of a real row consumes get exact zeros (segment tails; for
``coff == 2`` the first-half columns of each segment's last block; segments shorter than
``ratio``; tokens past ``cu_seqlens[-1]``), which is what the kernels write there.

Where these semantics were read from (nvidia-cudnn-frontend 1.32.0, ``cudnn/csa/compressor``):
``api.py`` docstring l.12-16 and l.759, 706-728; ``compressor_sm100.py`` docstring l.20-34 and
l.63-67, forward kernel l.384-460 (padding rows: ``seq_idx = 0, bis = 0`` l.393-404; invalid half
``-inf``/``0`` without APE l.411-428), backward l.525-655 (rows ``bb < nb_valid`` only, l.564;
zero-ownership l.527-560 and l.638-655; dAPE sums ``ds`` over real rows, invalid half adds
nothing, l.625-636); ``compressor_sm100_r128.py`` l.199-234 and l.826-851 (same geometry).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "csa_forward_ref",
    "csa_backward_ref",
    "csa_consumed_mask",
    "random_segments",
    "random_inputs",
]

# Rows per chunk are chosen so one gathered [rows, window, head_dim] float64 tensor holds at most
# this many elements (2**25 elements = 256 MiB); a forward/backward chunk keeps ~10 of them alive.
DEFAULT_MAX_CHUNK_ELEMS = 1 << 25


def _as_int_list(t) -> list:
    if isinstance(t, torch.Tensor):
        return [int(v) for v in t.detach().to("cpu", torch.int64).tolist()]
    return [int(v) for v in t]


def _check(kv, score, ape, cu, cuc, ratio, coff, head_dim, total_comp):
    """Validate the documented contract; returns (head_dim, total_comp, total_tokens)."""
    problems = []
    if coff not in (1, 2):
        problems.append(f"coff={coff} (expected 1 or 2)")
    if ratio < 1:
        problems.append(f"ratio={ratio} (expected >= 1)")
    if kv.ndim != 2 or score.shape != kv.shape:
        problems.append(f"kv {tuple(kv.shape)} and score {tuple(score.shape)} must be equal 2-D shapes")
    if problems:
        raise ValueError("csa reference: " + "; ".join(problems))
    total_tokens, width = kv.shape
    if head_dim is None:
        if width % coff:
            raise ValueError(f"csa reference: kv width {width} is not a multiple of coff={coff}")
        head_dim = width // coff
    if width != coff * head_dim:
        problems.append(f"kv width {width} (expected coff * head_dim = {coff * head_dim})")
    if tuple(ape.shape) != (ratio, width):
        problems.append(f"ape shape {tuple(ape.shape)} (expected {(ratio, width)})")
    if len(cu) != len(cuc) or len(cu) < 2:
        problems.append(f"cu_seqlens ({len(cu)}) and cu_seqlens_comp ({len(cuc)}) must both have B + 1 >= 2 entries")
    else:
        if cu[0] != 0 or cuc[0] != 0:
            problems.append(f"cu_seqlens[0]={cu[0]} and cu_seqlens_comp[0]={cuc[0]} (expected 0)")
        for s in range(len(cu) - 1):
            n = cu[s + 1] - cu[s]
            if n < 0:
                problems.append(f"cu_seqlens decreases at segment {s}")
            elif cuc[s + 1] - cuc[s] != n // ratio:
                problems.append(f"segment {s}: {cuc[s + 1] - cuc[s]} blocks for {n} tokens (expected {n // ratio})")
        if cu[-1] > total_tokens:
            problems.append(f"cu_seqlens[-1]={cu[-1]} exceeds total_tokens={total_tokens}")
    nb_valid = cuc[-1] if cuc else 0
    if total_comp is None:
        total_comp = nb_valid
    if total_comp < nb_valid:
        problems.append(f"total_comp={total_comp} < cu_seqlens_comp[-1]={nb_valid}")
    if total_comp > nb_valid and total_tokens < ratio:
        problems.append(f"padding rows need at least ratio={ratio} tokens, got {total_tokens}")
    if problems:
        raise ValueError("csa reference: " + "; ".join(problems))
    return head_dim, total_comp, total_tokens


def _row_geometry(cu, cuc, ratio, rows, device):
    """First token ``t0`` and ``first`` (block-in-segment == 0) for output rows ``rows``."""
    cu_t = torch.tensor(cu, dtype=torch.int64, device=device)
    cuc_t = torch.tensor(cuc, dtype=torch.int64, device=device)
    nb_valid = cuc[-1]
    real = rows < nb_valid
    # Segment of a real row: the unique s with cuc[s] <= b < cuc[s+1] (empty segments never match).
    seg = torch.searchsorted(cuc_t, rows, right=True) - 1
    seg = torch.where(real, seg, torch.zeros_like(seg)).clamp(0, len(cu) - 2)
    bis = torch.where(real, rows - cuc_t[seg], torch.zeros_like(rows))
    tok0 = cu_t[seg] + bis * ratio  # padding rows: cu[0], first-in-segment
    return tok0, bis == 0


def _forward_rows(kv64, score64, ape64, tok0, first, ratio, coff, d):
    """float64 pooled output for a set of rows (differentiable in kv64/score64/ape64)."""
    ar = torch.arange(ratio, device=kv64.device)
    own = tok0[:, None] + ar[None, :]  # [R, ratio] token indices of the block's own tokens
    if coff == 1:
        s = score64[own] + ape64  # [R, ratio, d]
        v = kv64[own]
    else:
        s_own = score64[:, d:][own] + ape64[:, d:]
        v_own = kv64[:, d:][own]
        prev = (own - ratio).clamp_min(0)  # clamped indices are masked out below
        s_prev = score64[:, :d][prev] + ape64[:, :d]
        v_prev = kv64[:, :d][prev]
        invalid = first[:, None, None]
        s_prev = torch.where(invalid, torch.full_like(s_prev, -math.inf), s_prev)
        v_prev = torch.where(invalid, torch.zeros_like(v_prev), v_prev)
        s = torch.cat([s_prev, s_own], dim=1)  # [R, 2 * ratio, d], k < ratio is the previous half
        v = torch.cat([v_prev, v_own], dim=1)
    p = torch.softmax(s, dim=1)
    return (v * p).sum(dim=1)


def _chunks(n_rows, ratio, coff, d, max_chunk_elems):
    per_row = coff * ratio * d
    step = max(1, max_chunk_elems // per_row)
    for r0 in range(0, n_rows, step):
        yield r0, min(n_rows, r0 + step)


def csa_forward_ref(
    kv,
    score,
    ape,
    cu_seqlens,
    cu_seqlens_comp,
    ratio,
    coff,
    head_dim=None,
    total_comp=None,
    *,
    compute_dtype=torch.float64,
    max_chunk_elems=DEFAULT_MAX_CHUNK_ELEMS,
):
    """Pooled output ``(total_comp, head_dim)`` in ``compute_dtype`` (float64 by default).

    Inputs of any float dtype are upcast (bf16/fp32 to float64 is exact). ``compute_dtype=float32``
    gives the fp32-intermediate eager form, used only to calibrate tolerances.
    """
    cu, cuc = _as_int_list(cu_seqlens), _as_int_list(cu_seqlens_comp)
    d, total_comp, _ = _check(kv, score, ape, cu, cuc, ratio, coff, head_dim, total_comp)
    dev = kv.device
    out = torch.empty(total_comp, d, dtype=compute_dtype, device=dev)
    if total_comp == 0:
        return out
    with torch.no_grad():
        kv64, score64, ape64 = (t.detach().to(compute_dtype) for t in (kv, score, ape))
        rows = torch.arange(total_comp, device=dev)
        tok0, first = _row_geometry(cu, cuc, ratio, rows, dev)
        for r0, r1 in _chunks(total_comp, ratio, coff, d, max_chunk_elems):
            out[r0:r1] = _forward_rows(kv64, score64, ape64, tok0[r0:r1], first[r0:r1], ratio, coff, d)
    return out


def csa_backward_ref(
    kv,
    score,
    ape,
    cu_seqlens,
    cu_seqlens_comp,
    grad_out,
    ratio,
    coff,
    head_dim=None,
    *,
    compute_dtype=torch.float64,
    max_chunk_elems=DEFAULT_MAX_CHUNK_ELEMS,
):
    """float64 ``(grad_kv, grad_score, grad_ape)`` by autograd through the float64 forward.

    ``grad_out`` is ``(total_comp, head_dim)``; rows ``>= cu_seqlens_comp[-1]`` (static-capacity
    padding) are ignored, i.e. treated as zero. Row chunks are differentiated one at a time and the
    leaf gradients accumulate, which bounds memory for 131k-token packs. ``compute_dtype=float32``
    (fp32-intermediate eager form) exists only to calibrate tolerances.
    """
    cu, cuc = _as_int_list(cu_seqlens), _as_int_list(cu_seqlens_comp)
    total_comp = grad_out.shape[0]
    d, total_comp, _ = _check(kv, score, ape, cu, cuc, ratio, coff, head_dim, total_comp)
    if tuple(grad_out.shape) != (total_comp, d):
        raise ValueError(f"csa reference: grad_out shape {tuple(grad_out.shape)} (expected {(total_comp, d)})")
    dev = kv.device
    kv64 = kv.detach().to(compute_dtype).requires_grad_(True)
    score64 = score.detach().to(compute_dtype).requires_grad_(True)
    ape64 = ape.detach().to(compute_dtype).requires_grad_(True)
    go64 = grad_out.detach().to(compute_dtype)
    nb_valid = cuc[-1]
    with torch.enable_grad():
        if nb_valid > 0:
            rows = torch.arange(nb_valid, device=dev)  # padding rows carry no gradient
            tok0, first = _row_geometry(cu, cuc, ratio, rows, dev)
            for r0, r1 in _chunks(nb_valid, ratio, coff, d, max_chunk_elems):
                out = _forward_rows(kv64, score64, ape64, tok0[r0:r1], first[r0:r1], ratio, coff, d)
                torch.autograd.backward(out, go64[r0:r1])
    grads = []
    for leaf in (kv64, score64, ape64):
        grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf, requires_grad=False))
    return tuple(g.detach() for g in grads)


def csa_consumed_mask(cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim, total_tokens, device=None):
    """Bool ``(total_tokens, coff * head_dim)``: True where some real row's window reads the element.

    Everywhere else the backward must write exact zeros.
    """
    cu, cuc = _as_int_list(cu_seqlens), _as_int_list(cu_seqlens_comp)
    d = head_dim
    mask = torch.zeros(total_tokens, coff * d, dtype=torch.bool, device=device)
    for s in range(len(cu) - 1):
        nblk = cuc[s + 1] - cuc[s]
        if nblk == 0:
            continue
        t0, t_end = cu[s], cu[s] + nblk * ratio
        if coff == 1:
            mask[t0:t_end] = True
        else:
            mask[t0:t_end, d:] = True  # own half of every block
            mask[t0 : t_end - ratio, :d] = True  # previous half, read by the next block
    return mask


# ----------------------------------------------------------------------------------------------
# Input generation shared by the unit and GPU tests.
# ----------------------------------------------------------------------------------------------


def random_segments(ratio, n_blocks, gen, *, n_segments=None, short=True, empty=False, tails=True):
    """Random segment lengths with ``sum(len // ratio) == n_blocks``.

    ``short`` adds one segment of 1..ratio-1 tokens (zero blocks), ``empty`` one of 0 tokens;
    ``tails`` gives each long segment a random ``seqlen % ratio`` remainder.
    Returns ``(cu_seqlens, cu_seqlens_comp)`` as Python lists.
    """

    def randint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=gen).item())

    if n_segments is None:
        n_segments = randint(1, 4) if n_blocks > 0 else 0
    n_segments = min(n_segments, n_blocks) if n_blocks > 0 else 0
    # Split n_blocks into n_segments positive parts.
    if n_segments > 0:
        cuts = sorted(torch.randperm(max(n_blocks - 1, 1), generator=gen)[: n_segments - 1].add(1).tolist()) if n_segments > 1 else []
        bounds = [0] + cuts + [n_blocks]
        blocks = [bounds[i + 1] - bounds[i] for i in range(n_segments)]
    else:
        blocks = []
    lengths = [b * ratio + (randint(0, ratio - 1) if tails and ratio > 1 else 0) for b in blocks]
    extra = []
    if short and ratio > 1:
        extra.append(randint(1, ratio - 1))
    if empty:
        extra.append(0)
    for length in extra:
        pos = randint(0, len(lengths))
        lengths.insert(pos, length)
    if not lengths:
        lengths = [0]
    cu, cuc = [0], [0]
    for n in lengths:
        cu.append(cu[-1] + n)
        cuc.append(cuc[-1] + n // ratio)
    return cu, cuc


def random_inputs(cu, cuc, ratio, coff, head_dim, gen, *, pad_rows=0, pad_tokens=0, device="cpu", dtype=torch.bfloat16, score_scale=2.0, ape_scale=0.5):
    """Fresh random inputs for a segmentation: dict with kv, score, ape, cu_seqlens, cu_seqlens_comp,
    grad_out (total_comp = cu_seqlens_comp[-1] + pad_rows rows) and total_comp.

    ``pad_tokens`` appends static token-capacity rows past ``cu_seqlens[-1]`` (read by no window).
    """
    width = coff * head_dim
    total_tokens = cu[-1] + pad_tokens
    total_comp = cuc[-1] + pad_rows
    if total_comp > cuc[-1] and total_tokens < ratio:
        total_tokens = ratio  # padding rows read tokens [0, ratio)
    gdev = gen.device  # values are drawn where the generator lives, then moved

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=gdev)

    kv = randn(total_tokens, width).to(device=device, dtype=dtype)
    score = (score_scale * randn(total_tokens, width)).to(device=device, dtype=dtype)
    ape = (ape_scale * randn(ratio, width)).to(device=device, dtype=torch.float32)
    grad_out = randn(total_comp, head_dim).to(device=device, dtype=dtype)
    return dict(
        kv=kv,
        score=score,
        ape=ape,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        cu_seqlens_comp=torch.tensor(cuc, dtype=torch.int32, device=device),
        grad_out=grad_out,
        total_comp=total_comp,
    )
