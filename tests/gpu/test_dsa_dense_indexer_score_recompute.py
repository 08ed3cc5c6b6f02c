"""dsa_aot.dsa.dense_indexer_score_recompute on the GPU against the fp64 reference of the indexer's logits
and their LSE (tests/gpu/ref_indexer_forward.py: the same ratio-causal scores the indexer forward
computes, ``lse_of`` their log-sum-exp).

Every shipped SM90 ``dense_indexer_sm90`` entry (heads, ratio, offsets, the float32 scale the cubin
bakes in) at two BSHD shapes: B 2, S_q 256 over S_k 64, and S_q 203 over S_k 77 (S_k % 4 != 0: the fp32
``out`` rows break the 16-byte stride ``_assume_strides`` promises, research §7 trap 7; S_q odd: the
transposed weights too). Each call at the entry's scale given as a double that is not its float32
value (a training script's ``1/sqrt(128)``), allocating and ``_into``, ``out`` / ``denom`` NaN-poisoned,
the workspace 0xFF. Checks: the -inf mask exactly the reference's (``out`` is filled with -inf as upstream
does, and the kernel skips hidden K blocks), no NaN, the finite logits and LSE within 1e-5 (the indexer
forward's bound: fp32 sums of exact bf16 products), every input's bits kept. Also: a scale the build does
not ship, an SM90 THD plan (upstream's classes refuse it too), capture and replay. SM90 THD itself:
test_dsa_dense_score_thd.py.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

import ref_indexer_forward as ref  # noqa: E402
from refutil import both_forms, captured, generator, refusals_write_nothing, rel_err, replay_on, shipped_keys  # noqa: E402

DEV = "cuda:0"
FAMILY = "dsa_score_recompute"
OP = "dense_indexer_sm90"
FIELDS = ("heads", "ratio", "offsets", "scale")
SHAPES = ((2, 256, 64), (2, 203, 77))
BOUND = 1e-5


def _entries():
    return shipped_keys(FAMILY, FIELDS, OP)


@pytest.fixture(scope="module")
def dsa():
    if torch.cuda.get_device_capability(DEV)[0] != 9:
        pytest.skip("the sm_90a entries (and the SM90 workspace) need an SM90 GPU")
    import dsa_aot.dsa

    return dsa_aot.dsa


def _double(scale):
    """A double whose float32 rounding is ``scale`` but that is not it (1.0 stays 1.0: another value
    would be another kernel upstream)."""
    return scale if scale == 1.0 else scale * (1 + 2**-40)


def _inputs(shape, heads, ratio, offsets, seed):
    B, S_q, S_k = shape
    q, k, w, _, _ = ref.random_inputs((B, S_q), (B, S_k), heads, generator(seed))
    offs = torch.tensor([0, 2 * ratio + 1][:B], dtype=torch.int32) if offsets else None
    return q, k, w, offs


def _check(got, want, what):
    assert not torch.isnan(got).any(), f"{what}: NaN left (an element the op never wrote)"
    assert torch.equal(torch.isinf(got) & (got < 0), torch.isinf(want) & (want < 0)), f"{what}: the -inf mask differs"
    fin = torch.isfinite(want)
    err = rel_err(got[fin], want[fin]) if fin.any() else 0.0
    assert err <= BOUND, f"{what}: rel err {err:.3g} > {BOUND}"
    return err


@pytest.mark.parametrize("entry", _entries(), ids=lambda e: "H%d-ratio%d-offsets%d-scale%g" % e)
def test_every_shipped_entry_matches_the_reference(dsa, entry, record_property):
    heads, ratio, offsets, scale = entry
    worst = 0.0
    for i, shape in enumerate(SHAPES):
        q, k, w, offs = _inputs(shape, heads, ratio, offsets, seed=heads + ratio + 7 * offsets + i)
        sm_scale = _double(scale)
        want = ref.scores_bshd(q, k, w, ratio, sm_scale, offs).to(DEV)
        want_lse = ref.lse_of(want)
        q, k, w = q.to(DEV), k.to(DEV), w.to(DEV)
        kw = dict(sm_scale=sm_scale, ratio=ratio, q_causal_offsets=None if offs is None else offs.to(DEV))
        out = torch.full(want.shape, math.nan, device=DEV)
        den = torch.full(want.shape[:-1], math.nan, device=DEV)
        n = dsa.dense_indexer_score_recompute_workspace_bytes(w.shape, DEV)
        ws = torch.full((n,), 0xFF, dtype=torch.uint8, device=DEV)
        worst = max(worst, both_forms(
            lambda: dsa.dense_indexer_score_recompute_into(out, den, q, k, w, workspace=ws, **kw),
            lambda: dsa.dense_indexer_score_recompute(q, k, w, **kw),
            (out, den), (want, want_lse), (q, k, w), f"{dict(zip(FIELDS, entry))} shape {shape}", _check))
    record_property("worst_rel_err", worst)
    print(f"\n{dict(zip(FIELDS, entry))}: worst rel err {worst:.2e}")


def test_the_entry_list_covers_the_manifest():
    want = [(64, r, o, s) for r in (1, 4) for o in (False, True) for s in (0.0883883461356163, 1.0)]
    assert _entries() == sorted(want)


def test_the_into_form_captures_in_a_cuda_graph_and_replays_on_new_values(dsa):
    if (64, 4, True, 1.0) not in _entries():
        pytest.skip("the build ships no H64 ratio-4 entry with offsets at scale 1.0")
    shape = (2, 128, 40)
    q, k, w, offs = (t.to(DEV) for t in _inputs(shape, 64, 4, True, seed=5))
    out, den = torch.full(shape, math.nan, device=DEV), torch.full(shape[:2], math.nan, device=DEV)
    ws = torch.full((dsa.dense_indexer_score_recompute_workspace_bytes(w.shape, DEV),), 0xFF, dtype=torch.uint8, device=DEV)
    g = captured(lambda: dsa.dense_indexer_score_recompute_into(out, den, q, k, w, ratio=4, q_causal_offsets=offs, workspace=ws))
    assert torch.isnan(out).all(), "captured, not run"
    for seed in (6, 7):
        q2, k2, w2, offs2 = _inputs(shape, 64, 4, True, seed=seed)
        offs2 = torch.tensor([3, 0], dtype=torch.int32) if seed == 7 else offs2
        replay_on(g, ((q, q2), (k, k2), (w, w2), (offs, offs2)), (out, den, ws))
        want = ref.scores_bshd(q2, k2, w2, 4, 1.0, offs2).to(DEV)
        _check(out, want, f"replay {seed} out")
        _check(den, ref.lse_of(want), f"replay {seed} denom")

def test_refused_calls_write_nothing(dsa):
    from dsa_aot.errors import InputError, KernelNotFoundError

    if (64, 4, False, 1.0) not in _entries():
        pytest.skip("the build ships no H64 ratio-4 entry at scale 1.0")
    shape = (2, 64, 40)
    q, k, w, _ = (t.to(DEV) if t is not None else None for t in _inputs(shape, 64, 4, False, seed=9))
    out, den = torch.full(shape, math.nan, device=DEV), torch.full(shape[:2], math.nan, device=DEV)
    ws = torch.full((dsa.dense_indexer_score_recompute_workspace_bytes(w.shape, DEV),), 0xFF, dtype=torch.uint8, device=DEV)
    cu_q = torch.tensor([0, 64, 128], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 40, 80], dtype=torch.int32, device=DEV)

    def into(**over):
        a = dict(out=out, denom_out=den, q=q, k=k, weights=w, ratio=4, workspace=ws)
        a.update(over)
        return lambda: dsa.dense_indexer_score_recompute_into(**a)

    cases = [
        ("a scale the build does not ship", KernelNotFoundError, r"(?s)dense_indexer_sm90.*scale = 0\.5", into(sm_scale=0.5)),
        ("ratio 2 not shipped", KernelNotFoundError, r"(?s)ratio = 2", into(ratio=2)),
        ("SM90 THD plan", InputError, "THD on SM90 in a plan",  # as upstream's plan classes (the functional forms run it)
         lambda: dsa.DenseIndexerScoreRecompute(out.view(-1, 40), den.view(-1), q.view(-1, 64, 128), k.view(-1, 1, 128), w.view(-1, 64), cu_q, cu_k,
                                                workspace=ws, ratio=4, max_seqlen_q=64, max_seqlen_k=40)),
        ("weights fp32", InputError, "weights", into(weights=w.float())),
        ("mxfp8", InputError, "precision", lambda: dsa.dense_indexer_score_recompute(q, k, w, precision="mxfp8")),
        ("no workspace", InputError, "workspace", into(workspace=None)),
        ("out over q", InputError, "overlap", into(out=q.view(torch.float32).reshape(-1)[: out.numel()].view(shape))),
    ]
    refusals_write_nothing(cases, [out, den, ws, q, k, w])
