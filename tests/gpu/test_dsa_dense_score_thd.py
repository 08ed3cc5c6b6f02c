"""SM90 THD of the two dense score recomputes: upstream's per-segment host loop (one BSHD launch per segment
with queries and keys, through workspace temporaries copied into the packed outputs), run from host
segment bounds.

Five segments of the packed rows: 37 queries over 64 keys, none over 9, 13 over none (upstream leaves
their ``denom`` unwritten; we write the kernel's value for a row that sees no key: -inf for the LSE, 0 for
the attention's sum), none over none, 128 over 101; ratio 4, with and without ``q_causal_offsets``.
Checks, for each op:
- the packed ``out`` / ``denom`` (NaN-poisoned) against the fp64 reference of each segment (the -inf mask
  exact, 1e-5 on the finite part: the BSHD tests' bound), and bitwise against the BSHD op run on each
  segment alone (the same kernel on the same rows); the columns past a segment's keys -inf;
- the bounds as CPU tensors (``_into``), as lists (capture, then replays on new values), on the device (the
  allocating form reads them back, as upstream);
- device bounds under capture refused, nothing written.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

import ref_indexer_forward as iref  # noqa: E402
import ref_score_recompute as aref  # noqa: E402
from refutil import captured, generator, replay_on, same_bits, shipped_keys  # noqa: E402
from test_dsa_dense_indexer_score_recompute import DEV, FAMILY, _check  # noqa: E402

CU_Q = [0, 37, 37, 50, 50, 178]
CU_K = [0, 64, 73, 73, 73, 174]
MAX_K = 101
RATIO = 4
OFFSETS = [0, 5, 0, 0, 9]


@pytest.fixture(scope="module")
def dsa():
    if torch.cuda.get_device_capability(DEV)[0] != 9:
        pytest.skip("SM90 THD is the per-segment form of the sm_90a entries: an SM90 GPU")
    import dsa_aot.dsa

    return dsa_aot.dsa


def _shipped(attention, offsets):
    if attention:
        return (64, 512, RATIO, offsets) in shipped_keys(FAMILY, ("heads", "dim", "ratio", "offsets"), "dense_attention_sm90")
    return (64, RATIO, offsets, 1.0) in shipped_keys(FAMILY, ("heads", "ratio", "offsets", "scale"), "dense_indexer_sm90")


def _segments():
    return [(b, CU_Q[b], CU_Q[b + 1] - CU_Q[b], CU_K[b], CU_K[b + 1] - CU_K[b]) for b in range(len(CU_Q) - 1)]


def _case(attention, offsets, seed):
    """Packed q (T_q, 64, D), k (T_k, 1, D), the weights / LSE (T_q, 64), the offsets, the scale, and the fp64
    (out, denom) the packed call must give; each segment drawn as a batch-1 BSHD case."""
    gen = generator(seed)
    qs, ks, auxs, outs, dens = [], [], [], [], []
    scale = 512**-0.5 if attention else 1.0
    for b, _, sq, _, sk in _segments():
        off = torch.tensor([OFFSETS[b]], dtype=torch.int32) if offsets else None
        if attention:
            q, k, aux, _ = aref.make_dense_attn_inputs(1, sq, sk, 64, 512, RATIO, off, softmax_scale=scale, seed=seed * 10 + b)
            o, d = aref.dense_attn_ref(q, k, aux, scale, RATIO, off) if sq and sk else (None, torch.zeros(1, sq, dtype=torch.float64))
        else:
            q, k, aux, _, _ = iref.random_inputs((1, sq), (1, sk), 64, gen)
            o = iref.scores_bshd(q, k, aux, RATIO, scale, off) if sq and sk else None
            d = iref.lse_of(o) if o is not None else torch.full((1, sq), -math.inf, dtype=torch.float64)
        full = torch.full((sq, MAX_K), -math.inf, dtype=torch.float64)
        if o is not None:
            full[:, :sk] = o[0]
        qs.append(q[0]), ks.append(k[0]), auxs.append(aux[0]), outs.append(full), dens.append(d[0])
    offs = torch.tensor(OFFSETS, dtype=torch.int32, device=DEV) if offsets else None
    cat = [torch.cat(x).to(DEV) for x in (qs, ks, auxs)]
    return (*cat, offs, scale, torch.cat(outs).to(DEV), torch.cat(dens).to(DEV))


def _ops(dsa, attention):
    if attention:
        return (dsa.dense_attn_score_recompute, dsa.dense_attn_score_recompute_into, dsa.dense_attn_score_recompute_workspace_bytes,
                lambda scale: {"softmax_scale": scale})
    return (dsa.dense_indexer_score_recompute, dsa.dense_indexer_score_recompute_into, dsa.dense_indexer_score_recompute_workspace_bytes,
            lambda scale: {"sm_scale": scale})


def _per_segment_bits(dsa, attention, q, k, aux, offs, scale):
    """(out, denom) assembled from the BSHD op on each segment alone: what the packed call must equal bit for bit."""
    alloc, _, _, sc = _ops(dsa, attention)
    out = torch.full((q.shape[0], MAX_K), -math.inf, device=DEV)
    den = torch.full((q.shape[0],), -math.inf if not attention else 0.0, device=DEV)
    for b, q0, sq, k0, sk in _segments():
        if sq and sk:
            r = alloc(q[q0:q0 + sq][None], k[k0:k0 + sk][None], aux[q0:q0 + sq][None], ratio=RATIO, **sc(scale),
                      q_causal_offsets=None if offs is None else offs[b:b + 1].clone())
            out[q0:q0 + sq, :sk], den[q0:q0 + sq] = r["out"][0], r["denom"][0]
    return out, den


@pytest.mark.parametrize("offsets", [False, True], ids=["no-offsets", "offsets"])
@pytest.mark.parametrize("attention", [False, True], ids=["indexer", "attention"])
def test_packed_segments_match_the_reference_and_the_bshd_op_bit_for_bit(dsa, attention, offsets):
    if not _shipped(attention, offsets):
        pytest.skip("the build ships no H64 ratio-4 entry for this op")
    alloc, into, sizer, sc = _ops(dsa, attention)
    q, k, aux, offs, scale, want, want_den = _case(attention, offsets, seed=3 + offsets)
    bits = _per_segment_bits(dsa, attention, q, k, aux, offs, scale)
    keep = [t.clone() for t in (q, k, aux)]
    cpu = [torch.tensor(c, dtype=torch.int32) for c in (CU_Q, CU_K)]
    out, den, ws = _poisoned(q, aux, sizer)
    into(out, den, q, k, aux, **sc(scale), ratio=RATIO, cu_seqlens_q=cpu[0], cu_seqlens_k=cpu[1], q_causal_offsets=offs, workspace=ws)
    dev_cu = [c.to(DEV) for c in cpu]
    r = alloc(q, k, aux, **sc(scale), ratio=RATIO, cu_seqlens_q=dev_cu[0], cu_seqlens_k=dev_cu[1], q_causal_offsets=offs)
    torch.cuda.synchronize()
    for form, (o, d) in (("_into, CPU bounds", (out, den)), ("allocating, device bounds", (r["out"], r["denom"]))):
        _check(o, want, f"{form} out")
        _check(d, want_den, f"{form} denom")
        assert same_bits(o, bits[0]) and same_bits(d, bits[1]), f"{form}: not the BSHD op's bits on each segment"
    for t, b in zip((q, k, aux), keep):
        assert same_bits(t, b), "an input was modified"


def _poisoned(q, aux, sizer):
    """NaN ``out`` / ``denom`` for the packed rows, and the 0xFF workspace of the host bounds."""
    return (torch.full((q.shape[0], MAX_K), math.nan, device=DEV), torch.full((q.shape[0],), math.nan, device=DEV),
            torch.full((sizer(aux.shape, DEV, CU_Q, CU_K),), 0xFF, dtype=torch.uint8, device=DEV))


@pytest.mark.parametrize("attention", [False, True], ids=["indexer", "attention"])
def test_host_bounds_capture_and_replay_on_new_values(dsa, attention):
    if not _shipped(attention, True):
        pytest.skip("the build ships no H64 ratio-4 entry with offsets for this op")
    _, into, sizer, sc = _ops(dsa, attention)
    q, k, aux, offs, scale, _, _ = _case(attention, True, seed=11)
    out, den, ws = _poisoned(q, aux, sizer)
    # the first call of this shape, inside the capture
    g = captured(lambda: into(out, den, q, k, aux, **sc(scale), ratio=RATIO, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, q_causal_offsets=offs,
                               workspace=ws))
    assert torch.isnan(out).all() and torch.isnan(den).all(), "captured, not run"
    for seed in (12, 13):
        q2, k2, aux2, _, _, want, want_den = _case(attention, True, seed=seed)
        replay_on(g, ((q, q2), (k, k2), (aux, aux2)), (out, den, ws))
        _check(out, want, f"replay {seed} out")
        _check(den, want_den, f"replay {seed} denom")


def test_device_bounds_under_capture_are_refused_before_any_write(dsa):
    from dsa_aot.errors import InputError

    if not _shipped(False, False):
        pytest.skip("the build ships no H64 ratio-4 indexer entry")
    _, into, sizer, _ = _ops(dsa, False)
    q, k, w, _, _, _, _ = _case(False, False, seed=21)
    out, den, ws = _poisoned(q, w, sizer)
    cu = [torch.tensor(c, dtype=torch.int32, device=DEV) for c in (CU_Q, CU_K)]
    before = [t.clone() for t in (out, den, ws)]
    with pytest.raises(InputError, match="under CUDA-graph capture.*CPU tensors or lists"):
        captured(lambda: into(out, den, q, k, w, ratio=RATIO, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], workspace=ws))
    torch.cuda.synchronize()
    for t, b in zip((out, den, ws), before):
        assert same_bits(t, b), "a refused call wrote"
