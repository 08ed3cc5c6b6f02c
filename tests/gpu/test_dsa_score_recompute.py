"""dsa_aot.dsa.sparse_indexer_score_recompute on the GPU against the fp64 reference (tests/gpu/ref_score_recompute.py).

Every shipped SM90 ``sparse_indexer_sm90`` entry (enumerated from the index: heads, topk, length,
topk_global) at two shapes, B 2: S_q 64 with S_k 4096 (every row sees more keys than topk), and S_q
203 with S_k 1000 (rows see fewer keys than topk 1024 / 2048: slots past S_k padded; S_q not a
multiple of 8, so the (B, H, S_q) transposed weights break the 16-byte stride ``_assume_strides``
promises, docs/research/score-recompute.md §7 trap 7). For each: the allocating form (``out`` and
the workspace allocated by the op), the allocating form into a caller's ``out``, and ``_into``, with
``out`` NaN-poisoned and the workspace 0xFF-poisoned before the call.

Inputs (``ref.make_inputs``, invalid_frac 0.1): ``-1`` slots scattered (no length) or compact ``-1``
padding at and past ``topk_length``, rows with no valid slot, one, and all. Checks: no NaN (every
column written), the slots that are not scored exactly 0, each row summing to 1 (0 without a scored
slot), and ``rel_err <= ref.REL_ERR_BOUNDS["predict"]`` (1e-5; a kernel-like fp32 emulation measures
0.8-2.0e-7, tests/unit/refs/test_ref_score_recompute.py). Every input keeps its bits: the op copies the
weights transposed into its workspace, it must not touch the caller's.

Also: CUDA-graph capture of ``_into`` replayed on new values, and the refusals that must come before
anything is written (the outputs, the workspace and the inputs keep their bits).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

import ref_score_recompute as ref  # noqa: E402 - tests/gpu is on sys.path (tests/conftest.py)
from refutil import captured, poison, refusals_write_nothing, rel_err, replay_on, same_bits, shipped_keys  # noqa: E402

DEV = "cuda:0"
FAMILY = "dsa_score_recompute"
OP = "sparse_indexer_sm90"
H = 64
SHAPES = ((2, 64, 4096), (2, 203, 1000))  # (B, S_q, S_k)
FORMS = ("allocating", "allocating-out", "into")
INPUTS = ("q_indexer", "k_indexer", "weights", "topk_indices", "topk_length")


def _entries():
    """The shipped SM90 entries, (heads, topk, length, topk_global) (none where there is no build:
    collection must not fail on a machine without one; the count is checked by
    test_the_entry_list_covers_the_manifest)."""
    return shipped_keys(FAMILY, ("heads", "topk", "length", "topk_global"), OP)


def _need(topk, length, glob):
    """Skip unless the build ships the (H64) entry a hand-written test below runs."""
    if (H, topk, length, glob) not in _entries():
        pytest.skip(f"the build ships no {FAMILY} {OP} entry for H{H} topk {topk} length {length} topk_global {glob}")


@pytest.fixture(scope="module")
def dsa():
    if torch.cuda.get_device_capability(DEV)[0] != 9:
        pytest.skip("the sm_90a entries (and the SM90 workspace) need an SM90 GPU")
    import dsa_aot.dsa

    return dsa_aot.dsa


def _inputs(shape, topk, length, glob, seed):
    B, S_q, S_k = shape
    return ref.make_inputs(B, S_q, S_k, H, topk, with_length=length, topk_indices_global=glob, invalid_frac=0.1, device=DEV, seed=seed)


def _ws_bytes(B, S_q):
    return -(-B * S_q * H * 2 // 128) * 128  # the (B, H, S_q) bf16 weights, 128-byte rounded


def _workspace(dsa, x):
    n = dsa.sparse_indexer_score_recompute_workspace_bytes(x["weights"].shape, x["weights"].device)
    B, S_q, _ = x["weights"].shape
    assert n >= B * S_q * H * 2 and n == _ws_bytes(B, S_q), f"SM90 workspace {n} bytes"
    return torch.full((n,), 0xFF, dtype=torch.uint8, device=DEV)


def _out(x):
    return poison(torch.empty(x["topk_indices"].shape, dtype=torch.float32, device=DEV))


def run_form(form, op, op_into, ins, kw, key, out_of, workspace_of):
    """One call of a sparse score recompute op in ``form`` (allocating, allocating into a given ``out``, or
    ``_into`` with a 0xFF workspace); ``out_of()`` makes a NaN-poisoned ``out``; returns the result."""
    if form == "allocating":
        got = op(*ins, **kw)[key]
        want = out_of()
        assert got.dtype == torch.float32 and got.shape == want.shape and got.device == want.device
    elif form == "allocating-out":
        out = out_of()
        got = op(*ins, out=out, **kw)[key]
        assert got is out
    else:
        out = out_of()
        got = op_into(out, *ins, workspace=workspace_of(), **kw)
        assert got is out
    torch.cuda.synchronize()
    return got


def _run(dsa, x, form, glob):
    """One call; returns predict."""
    ins = (x["q_indexer"], x["k_indexer"], x["weights"], x["topk_indices"])
    return run_form(form, dsa.sparse_indexer_score_recompute, dsa.sparse_indexer_score_recompute_into, ins,
                    dict(topk_length=x["topk_length"], topk_indices_global=glob), "predict", lambda: _out(x), lambda: _workspace(dsa, x))


def check_rows(got, x, want, what, key="predict"):
    """A distribution over each row's scored slots (``key``: predict or target): no NaN, the slots not
    scored exactly 0, rows summing to 1 (0 without a scored slot), within the reference's bound; returns
    the rel err."""
    assert not torch.isnan(got).any(), f"{what}: {key} holds NaN (a column not written)"
    scored = ref.scored_mask(x["topk_indices"], x["topk_length"])
    assert (got[~scored] == 0).all(), f"{what}: a slot that is not scored is not exactly 0"
    has = scored.any(-1)
    sums = got.double().sum(-1)
    assert (sums[~has] == 0).all(), f"{what}: a row without a scored slot is not all 0"
    assert ((sums[has] - 1).abs() < 1e-5).all(), f"{what}: a row's {key} does not sum to 1 (worst {(sums[has] - 1).abs().max():.2e})"
    e = rel_err(got, want)
    assert e <= ref.REL_ERR_BOUNDS[key], f"{what}: rel err {e:.3e} > {ref.REL_ERR_BOUNDS[key]}"
    return e


@pytest.mark.parametrize("entry", _entries(), ids=lambda e: "H%d-topk%d-length%d-global%d" % e)
def test_every_shipped_entry_matches_the_reference(dsa, entry):
    heads, topk, length, glob = entry
    assert heads == H
    for i, shape in enumerate(SHAPES):
        x = _inputs(shape, topk, length, glob, seed=topk + 10 * length + 20 * glob + i)
        want = ref.reference(x, glob)  # fp64 on the GPU, from the untouched inputs
        keep = {n: x[n].clone() for n in INPUTS if x[n] is not None}
        for form in FORMS:
            what = f"topk {topk} length {length} global {glob} shape {shape} {form}"
            check_rows(_run(dsa, x, form, glob), x, want, what)
            for n, t in keep.items():
                assert same_bits(x[n], t), f"{what}: {n} was modified (read-only)"


def test_the_entry_list_covers_the_manifest():
    """The build ships H64, topk 512 / 1024 / 2048, with and without topk_length, local and global ids."""
    assert _entries() == sorted((H, t, ln, g) for t in (512, 1024, 2048) for ln in (False, True) for g in (False, True))


def capture_and_replay(call, x, make, check, names, out, ws):
    """``call(bufs)`` (an ``_into`` call on copies of ``x``'s tensors ``names``, into ``out`` and ``ws``)
    captured in a CUDA graph, not run; then for seeds 32 and 33 ``make(seed)``'s tensors copied into the
    buffers, ``out`` NaN and ``ws`` 0xFF, a replay, ``check(out, y, what)``, and the inputs' bits kept."""
    bufs = {n: x[n].clone() for n in names}
    g = captured(lambda: call(bufs))
    assert torch.isnan(out).all(), "captured, not run"
    for n in names:
        assert same_bits(bufs[n], x[n]), f"capture modified {n}"
    for seed in (32, 33):  # new values in the captured buffers
        y = make(seed)
        replay_on(g, [(bufs[n], y[n]) for n in names], (out, ws))
        check(out, y, f"replay {seed}")
        for n in names:
            assert same_bits(bufs[n], y[n]), f"replay {seed}: {n} was modified"


def test_the_into_form_captures_in_a_cuda_graph_and_replays_on_new_values(dsa):
    _need(512, True, True)
    shape = (2, 40, 700)
    x = _inputs(shape, 512, True, True, seed=31)
    out, ws = _out(x), _workspace(dsa, x)
    capture_and_replay(lambda b: dsa.sparse_indexer_score_recompute_into(out, b["q_indexer"], b["k_indexer"], b["weights"], b["topk_indices"],
                                                                         topk_length=b["topk_length"], topk_indices_global=True, workspace=ws),
                       x, lambda seed: _inputs(shape, 512, True, True, seed=seed), lambda o, y, what: check_rows(o, y, ref.reference(y, True), what),
                       INPUTS, out, ws)


def test_refused_calls_write_nothing(dsa):
    """Each refusal raises before any write: the output, the workspace and the inputs keep their bits."""
    from dsa_aot.errors import InputError, KernelNotFoundError

    _need(512, False, False)
    _need(512, True, False)
    x = _inputs((2, 16, 600), 512, False, False, seed=41)
    xl = _inputs((2, 16, 600), 512, True, False, seed=42)
    out, ws = _out(x), _workspace(dsa, x)
    q32 = x["q_indexer"][:, :, :32].contiguous()
    w32 = x["weights"][:, :, :32].contiguous()
    ids384 = x["topk_indices"][..., :384].contiguous()
    out384 = poison(torch.empty(ids384.shape, dtype=torch.float32, device=DEV))
    # out (fp32) over the same bytes as topk_indices (int32, the same shape)
    alias_buf = x["topk_indices"].clone()
    alias_out = alias_buf.view(torch.float32)
    # the workspace over the caller's weights: the transposed copy would overwrite what it reads
    ws_over = torch.full((ws.numel(),), 0xFF, dtype=torch.uint8, device=DEV)
    w_over = ws_over[: x["weights"].numel() * 2].view(torch.bfloat16).view(x["weights"].shape)
    w_over.copy_(x["weights"])

    def into(**over):
        a = dict(out=out, q_indexer=x["q_indexer"], k_indexer=x["k_indexer"], weights=x["weights"], topk_indices=x["topk_indices"],
                 topk_length=None, topk_indices_global=False, workspace=ws)
        a.update(over)
        return lambda: dsa.sparse_indexer_score_recompute_into(**a)

    def alloc(**over):
        a = dict(q_indexer=x["q_indexer"], k_indexer=x["k_indexer"], weights=x["weights"], topk_indices=x["topk_indices"], topk_length=None,
                 topk_indices_global=False, out=out)
        a.update(over)
        return lambda: dsa.sparse_indexer_score_recompute(**a)

    bucket = r"(?s)dsa_score_recompute.*topk = 384"
    cases = [
        ("weights dtype", InputError, "weights", into(weights=x["weights"].float())),
        ("weights dtype (allocating)", InputError, "weights", alloc(weights=x["weights"].float())),
        ("topk_length dtype", InputError, "topk_length", into(topk_length=xl["topk_length"].long(), topk_indices=xl["topk_indices"])),
        # the op has no H check of its own: H=32 is a bucket the build does not ship (heads = 32 named);
        # an InputError naming H=32 would do as well
        ("H=32", (InputError, KernelNotFoundError), r"(?s)heads = 32|H=32", into(q_indexer=q32, weights=w32)),
        ("H=32 (allocating)", (InputError, KernelNotFoundError), r"(?s)heads = 32|H=32", alloc(q_indexer=q32, weights=w32)),
        ("qhead_per_kv_head 32", InputError, "qhead_per_kv_head", alloc(qhead_per_kv_head=32)),
        ("topk 384", KernelNotFoundError, bucket, into(topk_indices=ids384, out=out384)),
        ("topk 384 (allocating)", KernelNotFoundError, bucket, alloc(topk_indices=ids384, out=out384)),
        ("no workspace on SM90", InputError, "workspace", into(workspace=None)),
        ("workspace too small", InputError, "workspace", into(workspace=ws[: ws.numel() - 128])),
        ("out aliases topk_indices", InputError, "overlap", into(out=alias_out, topk_indices=alias_buf)),
        ("workspace over the weights", InputError, "overlap", into(weights=w_over, workspace=ws_over)),
    ]
    watched = [out, ws, out384, alias_buf, ws_over, ids384, q32, w32] + [t[n] for t in (x, xl) for n in INPUTS if t[n] is not None]
    refusals_write_nothing(cases, watched)
