"""dsa_aot.dsa.sparse_attn_score_recompute on the GPU against the fp64 reference (tests/gpu/ref_score_recompute.py).

Every shipped SM90 ``sparse_attention_sm90`` entry (enumerated from the index: heads, dim, topk, length,
topk_global) at two shapes, B 2: S_q 64 with S_k 4096 (every row sees more keys than topk), and S_q 203
with S_k 1000 (rows see fewer keys than topk 1024 / 2048; S_q not a multiple of 4, so the (B, H, S_q)
transposed fp32 LSE breaks the 16-byte stride ``_assume_strides`` promises, research §7 trap 7). For each:
the allocating form, the allocating form into a caller's ``out``, and ``_into``, with ``out``
NaN-poisoned and the workspace 0xFF-poisoned before the call; each at its own ``softmax_scale`` (the
SM90 kernel's scale is the launcher's argument, not the one the build compiled in).

Inputs (``ref.make_attention_inputs``): the slots of the indexer test, q / k with N(0, 1) entries, the
LSE each head's fp64 log-sum-exp over the row's scored slots (what the forward returns) jittered by
up to +-1 per head. Checks: no NaN, the slots that are not scored exactly 0, rows summing to 1 (0
without a scored slot), ``rel_err <= ref.REL_ERR_BOUNDS["target"]``, every input's bits unchanged.
Also: one entry at three scales through one process (a plan per scale, each right), CUDA-graph capture
of ``_into`` replayed on new values, and the refusals that come before anything is written.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

import ref_score_recompute as ref  # noqa: E402 - tests/gpu is on sys.path (tests/conftest.py)
from refutil import poison, refusals_write_nothing, rel_err, same_bits, shipped_keys  # noqa: E402
from test_dsa_score_recompute import capture_and_replay, check_rows, run_form  # noqa: E402 - the indexer's test: the same three forms and row checks

DEV = "cuda:0"
FAMILY = "dsa_score_recompute"
OP = "sparse_attention_sm90"
SHAPES = ((2, 64, 4096), (2, 203, 1000))  # (B, S_q, S_k)
FORMS = ("allocating", "allocating-out", "into")
INPUTS = ("q_attn", "k_attn", "lse", "topk_indices", "topk_length")
FIELDS = ("heads", "dim", "topk", "length", "topk_global")


def _entries():
    """The shipped SM90 entries, (heads, dim, topk, length, topk_global) (none without a build)."""
    return shipped_keys(FAMILY, FIELDS, OP)


def _need(*entry):
    if entry not in _entries():
        pytest.skip(f"the build ships no {FAMILY} {OP} entry {dict(zip(FIELDS, entry))}")


@pytest.fixture(scope="module")
def dsa():
    if torch.cuda.get_device_capability(DEV)[0] != 9:
        pytest.skip("the sm_90a entries (and the SM90 workspace) need an SM90 GPU")
    import dsa_aot.dsa

    return dsa_aot.dsa


def _inputs(shape, heads, dim, topk, length, glob, seed, scale=None):
    B, S_q, S_k = shape
    return ref.make_attention_inputs(B, S_q, S_k, heads, topk, dim, softmax_scale=scale, with_length=length, topk_indices_global=glob,
                                     invalid_frac=0.1, device=DEV, seed=seed)


def _workspace(dsa, x):
    n = dsa.sparse_attn_score_recompute_workspace_bytes(x["lse"].shape, x["lse"].device)
    B, S_q, H = x["lse"].shape
    assert n == -(-B * S_q * H * 4 // 128) * 128, f"SM90 workspace {n} bytes (the (B, H, S_q) fp32 LSE, 128-byte rounded)"
    return torch.full((n,), 0xFF, dtype=torch.uint8, device=DEV)


def _out(x):
    return poison(torch.empty(x["topk_indices"].shape, dtype=torch.float32, device=DEV))


def _run(dsa, x, form, glob):
    ins = (x["q_attn"], x["k_attn"], x["lse"], x["topk_indices"], x["softmax_scale"])
    return run_form(form, dsa.sparse_attn_score_recompute, dsa.sparse_attn_score_recompute_into, ins,
                    dict(topk_length=x["topk_length"], topk_indices_global=glob), "target", lambda: _out(x), lambda: _workspace(dsa, x))


def _check(got, x, want, what):
    return check_rows(got, x, want, what, "target")


@pytest.mark.parametrize("entry", _entries(), ids=lambda e: "H%d-D%d-topk%d-length%d-global%d" % e)
def test_every_shipped_entry_matches_the_reference(dsa, entry, record_property):
    heads, dim, topk, length, glob = entry
    worst = 0.0
    for i, shape in enumerate(SHAPES):
        seed = heads + dim + topk + 10 * length + 20 * glob + i
        x = _inputs(shape, heads, dim, topk, length, glob, seed=seed, scale=(0.5 + 0.25 * i) * dim**-0.5)
        want = ref.attention_reference(x, glob)
        keep = {n: x[n].clone() for n in INPUTS if x[n] is not None}
        for form in FORMS:
            what = f"{dict(zip(FIELDS, entry))} shape {shape} {form}"
            worst = max(worst, _check(_run(dsa, x, form, glob), x, want, what))
            for n, t in keep.items():
                assert same_bits(x[n], t), f"{what}: {n} was modified (read-only)"
    record_property("worst_rel_err", worst)
    print(f"\n{dict(zip(FIELDS, entry))}: worst rel err {worst:.2e}")


def test_the_entry_list_covers_the_manifest():
    """H64 / H128 x D512 / D576 and H96 at D576, topk 512 / 1024 / 2048, with and without topk_length,
    local and global ids."""
    want = [(h, d, t, ln, g) for h in (64, 128) for d in (512, 576) for t in (512, 1024, 2048) for ln in (False, True) for g in (False, True)]
    want += [(96, 576, t, ln, g) for t in (512, 1024, 2048) for ln in (False, True) for g in (False, True)]
    assert _entries() == sorted(want)


def test_each_call_runs_at_its_own_scale(dsa):
    """The scale the build compiled in is not the one that runs: three scales, one process, each matches
    its reference, and the results differ (the scale reaches the kernel)."""
    _need(64, 512, 512, False, False)
    shape = (2, 48, 900)
    outs = []
    for scale in (0.02, 512**-0.5, 0.1):
        x = _inputs(shape, 64, 512, 512, False, False, seed=7, scale=scale)
        outs.append(_run(dsa, x, "into", False).clone())
        _check(outs[-1], x, ref.attention_reference(x), f"scale {scale}")
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


def test_the_into_form_captures_in_a_cuda_graph_and_replays_on_new_values(dsa):
    _need(64, 512, 512, True, True)
    shape = (2, 40, 700)
    x = _inputs(shape, 64, 512, 512, True, True, seed=31)
    out, ws = _out(x), _workspace(dsa, x)
    capture_and_replay(lambda b: dsa.sparse_attn_score_recompute_into(out, b["q_attn"], b["k_attn"], b["lse"], b["topk_indices"], x["softmax_scale"],
                                                                      topk_length=b["topk_length"], topk_indices_global=True, workspace=ws),
                       x, lambda seed: _inputs(shape, 64, 512, 512, True, True, seed=seed),
                       lambda o, y, what: _check(o, y, ref.attention_reference(y, True), what), INPUTS, out, ws)


def test_refused_calls_write_nothing(dsa):
    from dsa_aot.errors import InputError, KernelNotFoundError

    _need(64, 512, 512, False, False)
    x = _inputs((2, 16, 600), 64, 512, 512, False, False, seed=41)
    out, ws = _out(x), _workspace(dsa, x)
    q32, lse32 = x["q_attn"][:, :, :32].contiguous(), x["lse"][:, :, :32].contiguous()
    ids384 = x["topk_indices"][..., :384].contiguous()
    out384 = poison(torch.empty(ids384.shape, dtype=torch.float32, device=DEV))
    ws_over = torch.full((ws.numel(),), 0xFF, dtype=torch.uint8, device=DEV)
    lse_over = ws_over[: x["lse"].numel() * 4].view(torch.float32).view(x["lse"].shape)
    lse_over.copy_(x["lse"])

    def into(**over):
        a = dict(out=out, q_attn=x["q_attn"], k_attn=x["k_attn"], lse=x["lse"], topk_indices=x["topk_indices"], softmax_scale=x["softmax_scale"],
                 topk_length=None, topk_indices_global=False, workspace=ws)
        a.update(over)
        return lambda: dsa.sparse_attn_score_recompute_into(**a)

    cases = [
        ("lse bf16", InputError, "lse", into(lse=x["lse"].bfloat16())),
        ("scale nan", InputError, "softmax_scale", into(softmax_scale=math.nan)),
        ("scale 0", InputError, "softmax_scale", into(softmax_scale=0.0)),
        ("H=32", (InputError, KernelNotFoundError), r"(?s)heads = 32|H=32", into(q_attn=q32, lse=lse32)),
        ("topk 384", KernelNotFoundError, r"(?s)dsa_score_recompute.*topk = 384", into(topk_indices=ids384, out=out384)),
        ("no workspace on SM90", InputError, "workspace", into(workspace=None)),
        ("workspace over the lse", InputError, "overlap", into(lse=lse_over, workspace=ws_over)),
    ]
    watched = [out, ws, out384, ws_over, ids384, q32, lse32] + [x[n] for n in INPUTS if x[n] is not None]
    refusals_write_nothing(cases, watched)


def test_the_training_form_normalises_pads_and_matches_the_reference(dsa):
    """dsa_aot.dsa.sparse_attention_score_recompute (upstream's training.sparse_attention_score_recompute): ids
    outside [0, S_kv) and slots past the clamped length become -1 (positions kept), rows padded to 512 slots,
    one batch-1 launch, the target sliced back to K columns: against the fp64 target of those slots."""
    _need(64, 512, 512, False, False)
    g = torch.Generator().manual_seed(17)
    s_q, s_kv, k = 96, 700, 500
    x = ref.make_attention_inputs(1, s_q, s_kv, 64, 512, 512, seed=17)
    q, kv, lse = x["q_attn"][0].to(DEV), x["k_attn"][0].to(DEV), x["lse"][0].to(DEV)
    ids = torch.randint(-5, s_kv + 50, (s_q, k), generator=g, dtype=torch.int32)
    length = torch.randint(-2, k + 20, (s_q,), generator=g, dtype=torch.int32)
    r = dsa.sparse_attention_score_recompute(q, kv, lse, ids.to(DEV), topk_length=length.to(DEV))
    torch.cuda.synchronize()
    pos = torch.arange(k)[None, :]
    safe = torch.where((ids >= 0) & (ids < s_kv) & (pos < length.clamp(0, k)[:, None]), ids, -1)
    assert torch.equal(r["indices"].cpu(), safe)
    padded = torch.nn.functional.pad(safe, (0, 12), value=-1)
    want = ref.sparse_attn_target_ref(q[None], kv[None], lse[None], padded[None].to(DEV), 512**-0.5)[0, :, :k]
    assert r["target"].shape == (s_q, k) and not torch.isnan(r["target"]).any()
    assert (r["target"].cpu()[safe < 0] == 0).all()
    assert rel_err(r["target"], want) <= ref.REL_ERR_BOUNDS["target"]
