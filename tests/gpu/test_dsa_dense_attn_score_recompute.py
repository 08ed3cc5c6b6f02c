"""dsa_aot.dsa.dense_attn_score_recompute on the GPU against the fp64 reference (``ref_score_recompute.dense_attn_ref``).

Every shipped SM90 ``dense_attention_sm90`` entry (heads, dim, ratio, offsets) at two BSHD shapes: B 2,
S_q 128 over S_k 64, and S_q 203 over S_k 77 (S_k % 4 != 0 and S_q odd: research §7 trap 7), each at its
own ``softmax_scale`` (the SM90 kernel's scale is the launcher's argument, not the build's), allocating and
``_into``, ``out`` / ``denom`` NaN-poisoned, the workspace 0xFF. Checks: the -inf mask exactly the
reference's, no NaN, the finite scores and the L1 sums within 1e-5 (fp32 sums of exact bf16 products, a
fast exp2 per head: the sparse attention's bound), every input's bits kept. Also: capture and replay, and
the refusals (an SM90 THD plan, block scales, an LSE of the wrong dtype) before any write.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

import ref_score_recompute as ref  # noqa: E402
from refutil import both_forms, captured, refusals_write_nothing, replay_on, shipped_keys  # noqa: E402
# the dense indexer's test: the masked-scores check (NaN, the -inf mask, 1e-5 on the finite part)
from test_dsa_dense_indexer_score_recompute import DEV, FAMILY, _check  # noqa: E402

OP = "dense_attention_sm90"
FIELDS = ("heads", "dim", "ratio", "offsets")
SHAPES = ((2, 128, 64), (2, 203, 77))


def _entries():
    return shipped_keys(FAMILY, FIELDS, OP)


@pytest.fixture(scope="module")
def dsa():
    if torch.cuda.get_device_capability(DEV)[0] != 9:
        pytest.skip("the sm_90a entries (and the SM90 workspace) need an SM90 GPU")
    import dsa_aot.dsa

    return dsa_aot.dsa


def _case(shape, heads, dim, ratio, offsets, seed, scale=None):
    B, S_q, S_k = shape
    offs = torch.tensor([0, 3 * ratio + 1][:B], dtype=torch.int32) if offsets else None
    q, k, lse, scale = ref.make_dense_attn_inputs(B, S_q, S_k, heads, dim, ratio, offs, softmax_scale=scale, seed=seed)
    want = tuple(t.to(DEV) for t in ref.dense_attn_ref(q, k, lse, scale, ratio, offs))
    return q.to(DEV), k.to(DEV), lse.to(DEV), None if offs is None else offs.to(DEV), scale, want


def _workspace(dsa, lse):
    n = dsa.dense_attn_score_recompute_workspace_bytes(lse.shape, DEV)
    return torch.full((n,), 0xFF, dtype=torch.uint8, device=DEV)


@pytest.mark.parametrize("entry", _entries(), ids=lambda e: "H%d-D%d-ratio%d-offsets%d" % e)
def test_every_shipped_entry_matches_the_reference(dsa, entry, record_property):
    heads, dim, ratio, offsets = entry
    worst = 0.0
    for i, shape in enumerate(SHAPES):
        q, k, lse, offs, scale, (want, want_den) = _case(shape, heads, dim, ratio, offsets, seed=heads + dim + ratio + 7 * offsets + i,
                                                         scale=(0.6 + 0.3 * i) * dim**-0.5)
        out, den = torch.full(want.shape, math.nan, device=DEV), torch.full(want_den.shape, math.nan, device=DEV)
        worst = max(worst, both_forms(
            lambda: dsa.dense_attn_score_recompute_into(out, den, q, k, lse, scale, ratio, q_causal_offsets=offs, workspace=_workspace(dsa, lse)),
            lambda: dsa.dense_attn_score_recompute(q, k, lse, scale, ratio=ratio, q_causal_offsets=offs),
            (out, den), (want, want_den), (q, k, lse), f"{dict(zip(FIELDS, entry))} shape {shape}", _check))
    record_property("worst_rel_err", worst)
    print(f"\n{dict(zip(FIELDS, entry))}: worst rel err {worst:.2e}")


def test_the_entry_list_covers_the_manifest():
    assert _entries() == sorted((h, d, r, o) for h in (64, 128) for d in (512, 576) for r in (1, 4) for o in (False, True))


def test_the_into_form_captures_in_a_cuda_graph_and_replays_on_new_values(dsa):
    if (64, 512, 4, True) not in _entries():
        pytest.skip("the build ships no H64 D512 ratio-4 entry with offsets")
    shape = (2, 96, 40)
    q, k, lse, offs, scale, _ = _case(shape, 64, 512, 4, True, seed=3)
    out, den = torch.full(shape, math.nan, device=DEV), torch.full(shape[:2], math.nan, device=DEV)
    ws = _workspace(dsa, lse)
    g = captured(lambda: dsa.dense_attn_score_recompute_into(out, den, q, k, lse, scale, 4, q_causal_offsets=offs, workspace=ws))
    assert torch.isnan(out).all(), "captured, not run"
    for seed in (4, 5):
        q2, k2, lse2, offs2, _, (want, want_den) = _case(shape, 64, 512, 4, True, seed=seed, scale=scale)
        replay_on(g, ((q, q2), (k, k2), (lse, lse2), (offs, offs2)), (out, den, ws))
        _check(out, want, f"replay {seed} out")
        _check(den, want_den, f"replay {seed} denom")

def test_refused_calls_write_nothing(dsa):
    from dsa_aot.errors import InputError

    if (64, 512, 4, False) not in _entries():
        pytest.skip("the build ships no H64 D512 ratio-4 entry")
    shape = (2, 64, 40)
    q, k, lse, _, scale, _ = _case(shape, 64, 512, 4, False, seed=9)
    out, den = torch.full(shape, math.nan, device=DEV), torch.full(shape[:2], math.nan, device=DEV)
    ws = _workspace(dsa, lse)
    cu_q = torch.tensor([0, 64, 128], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 40, 80], dtype=torch.int32, device=DEV)

    def into(**over):
        a = dict(out=out, denom_out=den, q=q, k=k, lse=lse, softmax_scale=scale, ratio=4, workspace=ws)
        a.update(over)
        return lambda: dsa.dense_attn_score_recompute_into(**a)

    cases = [
        ("SM90 THD plan", InputError, "THD on SM90 in a plan",  # as upstream's plan classes (the functional forms run it)
         lambda: dsa.DenseAttnScoreRecompute(out.view(-1, 40), den.view(-1), q.view(-1, 64, 512), k.view(-1, 1, 512), lse.view(-1, 64), cu_q, cu_k,
                                             workspace=ws, softmax_scale=scale, ratio=4, max_seqlen_q=64, max_seqlen_k=40)),
        ("lse bf16", InputError, "lse", into(lse=lse.bfloat16())),
        ("scale 0", InputError, "softmax_scale", into(softmax_scale=0.0)),
        ("mxfp8", InputError, "precision", lambda: dsa.dense_attn_score_recompute(q, k, lse, scale, precision="mxfp8")),
        ("no workspace", InputError, "workspace", into(workspace=None)),
    ]
    refusals_write_nothing(cases, [out, den, ws, q, k, lse])
