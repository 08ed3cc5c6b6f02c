"""dsa_aot.dsa.dense_indexer_backward on the GPU against the fp64 reference (tests/gpu/ref_dense_indexer_backward.py).

Every shipped SM90 entry pair (score-grad + GEMM, enumerated from the index by the GEMM's key: heads,
varlen, ratio, offsets) at two shapes: BSHD B 2 (S_q 130 / 256: a partial and a full second K
block at ratio 1; ratio 4: S_k = ceil(S_q / 4) + 1), THD three segments with an empty one. For each:
d_index_k bf16 (fp32 workspace + cast) and fp32 (no workspace), the allocating and the ``_into``
form, with every output and the workspace poisoned (NaN / 0xFF) before the call.

Inputs (``ref.make_inputs``): ``attn_score`` / ``index_score`` are NaN on every column past the causal
limit, so a NaN in dQ / dW / dK means a kernel read a column it must not. Bounds
(``ref.REL_ERR_BOUNDS``): dQ / dW / dK 1e-2 (bf16 dS and outputs, ~2.4e-3 on the CPU emulation of
tests/unit/refs/test_ref_dense_indexer_backward.py), the grad signal left in ``index_score`` 1e-4 on
the columns before the limit (the kernels zero some columns past it, up to a K-block bound: not
asserted). ``attn_score`` and the denominators are read only: bitwise unchanged.

Also: CUDA-graph capture of ``_into`` replayed on new values, empty calls, and the refusals that
must come before anything is written.

Known upstream race (measured on the H200, 2026-12; docs/research/dense-indexer-backward.md): the SM90
dense GEMM (``IndexerBackwardSm90``, ``is_dense=True``, a cubin byte-identical to the one cudnn's JIT
builds) loads a K block that ends past the batch's keys (``S_k_b`` not a multiple of 128) with
per-thread ``cp.async`` in all four warps of its K-load warpgroup, but only an elected thread of warp 0
arrives on the count-1 ``K_LOADED`` mbarrier, after waiting for its own copies alone
(``indexer_backward_sm90.py`` l.505, l.1307-1364): a query row can then read a partly loaded K tile
and one row of dW / dQ (and its dK terms) comes out wrong. Seen in 0.1-7% of such calls; none in 1600
calls whose K blocks are all full (TMA). The entry tests here therefore use key counts that are
multiples of 128 (every K block full); ``ci/parity/dsa_dense_indexer_backward.py race`` counts the
race's calls on both sides, cudnn's JIT and this op, on one shape.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

import ref_dense_indexer_backward as ref  # noqa: E402 - tests/gpu is on sys.path (tests/conftest.py)
from refutil import captured, poison, refusals_write_nothing, rel_err, replay_on, same_bits, shipped_keys  # noqa: E402

DEV = "cuda:0"
FAMILY = "dsa_dense_indexer_backward"
SM_SCALE, LOSS_COEFF = 0.37, 1.3
H = 64


def _entries():
    """The shipped SM90 GEMM entries, (heads, varlen, ratio, offsets) (none where there is no build:
    collection must not fail on a machine without one; the count is checked by
    test_the_entry_list_covers_the_manifest). Each needs its score-grad twin, which the op looks up too."""
    return shipped_keys(FAMILY, ("heads", "varlen", "ratio", "offsets"), "gemm_sm90")


def _need(varlen, ratio, offsets):
    """Skip unless the build ships the (H64) entry a hand-written test below runs."""
    if (H, varlen, ratio, offsets) not in _entries():
        pytest.skip(f"the build ships no {FAMILY} gemm_sm90 entry for H{H} varlen {varlen} ratio {ratio} offsets {offsets}")


@pytest.fixture(scope="module")
def dsa():
    import dsa_aot.dsa

    return dsa_aot.dsa


def _s_k(n_q, ratio, full=True):
    """Keys for n_q queries: S_q at ratio 1 (dense attention), ceil(S_q / 4) + 1 at ratio 4 (the last
    key past every limit without offsets; offsets reach it); ``full``: rounded up to a multiple of 128
    (every K block full: no upstream race, see the module docstring)."""
    if n_q == 0:
        return 0
    n = n_q if ratio == 1 else -(-n_q // ratio) + 1
    return -(-n // 128) * 128 if full else n


def _inputs(varlen, ratio, offsets, s_q, seed, device=DEV, sm_scale=SM_SCALE, full=True):
    """make_inputs on the GPU. BSHD: B 2; THD: segments of s_q, 0 and s_q - 37 queries (max_seqlen_* the
    true maxima, cu_seqlens covering every row). Offsets clamp late rows at S_k."""
    if varlen:
        lens_q = [s_q, 0, s_q - 37]
        lens_k = [_s_k(n, ratio, full) for n in lens_q]
        offs = [0, 11, 4 * ratio + 1] if offsets else None
        return ref.make_inputs(3, s_q, max(lens_k), H, ratio=ratio, sm_scale=sm_scale, q_causal_offsets=offs, thd=(lens_q, lens_k), device=device,
                               seed=seed)
    offs = [0, 37] if offsets else None
    return ref.make_inputs(2, s_q, _s_k(s_q, ratio, full), H, ratio=ratio, sm_scale=sm_scale, q_causal_offsets=offs, device=device, seed=seed)


def _outputs(x, dk_dtype):
    return (poison(torch.empty_like(x["index_q"])), poison(torch.empty_like(x["weights"])),
            poison(torch.empty(x["index_k"].shape, dtype=dk_dtype, device=x["index_k"].device)))


def _workspace(dsa, x, dk_dtype):
    n = dsa.dense_indexer_backward_workspace_bytes(x["index_k"].shape, dk_dtype)
    assert n == (0 if dk_dtype == torch.float32 else -(-x["index_k"].numel() * 4 // 128) * 128)
    return torch.full((n,), 0xFF, dtype=torch.uint8, device=DEV) if n else None


def _rows_off(got, want):
    """Query rows whose dW is off by more than 1% of the largest |dW| (NaN counts): the race's signature."""
    g = got.double().reshape(-1, got.shape[-1])
    w = want.to(g.device).reshape(g.shape)
    return int((((g - w).abs().amax(-1) > 1e-2 * w.abs().max()) | torch.isnan(g).any(-1)).sum())


def _check(got, index_score, want, what):
    """dQ / dW / dK and the grad signal left in index_score against the reference."""
    off = _rows_off(got["d_weights"], want["d_weights"])
    for name in ("d_index_q", "d_weights", "d_index_k"):
        t = got[name]
        assert not torch.isnan(t).any(), f"{what}: {name} holds NaN (an element not written, or a column past the limit read)"
        e = rel_err(t, want[name])
        assert e <= ref.REL_ERR_BOUNDS[name], f"{what}: {name} rel err {e:.3e} > {ref.REL_ERR_BOUNDS[name]} ({off} row(s) off in dW)"
    valid = torch.arange(index_score.shape[-1], device=index_score.device) < want["limits"].to(index_score.device)[..., None]
    gs = index_score[valid]
    assert not torch.isnan(gs).any(), f"{what}: index_score holds NaN before the limit (grad signal not written)"
    e = rel_err(gs, want["grad_signal"][valid])
    assert e <= ref.REL_ERR_BOUNDS["grad_signal"], f"{what}: grad signal rel err {e:.3e} > {ref.REL_ERR_BOUNDS['grad_signal']}"


def _run(dsa, x, form, dk_dtype, ratio):
    """One call on a copy of index_score, outputs (and workspace) poisoned. Returns (outputs, index_score after)."""
    isc = x["index_score"].clone()
    args = dict(x, index_score=isc)
    dq, dw, dk = _outputs(x, dk_dtype)
    if form == "allocating":
        out = dsa.dense_indexer_backward(**args, sm_scale=SM_SCALE, loss_coeff=LOSS_COEFF, ratio=ratio, d_index_q=dq, d_weights=dw, d_index_k=dk)
        assert out["d_index_q"] is dq and out["d_weights"] is dw and out["d_index_k"] is dk
    else:
        ws = _workspace(dsa, x, dk_dtype)
        ret = dsa.dense_indexer_backward_into(dq, dw, dk, **args, sm_scale=SM_SCALE, loss_coeff=LOSS_COEFF, ratio=ratio, workspace=ws)
        assert ret[0] is dq and ret[1] is dw and ret[2] is dk
    torch.cuda.synchronize()
    return dict(d_index_q=dq, d_weights=dw, d_index_k=dk), isc


@pytest.mark.parametrize("entry", _entries(), ids=lambda e: "H%d-varlen%d-ratio%d-offsets%d" % e)
def test_every_shipped_entry_matches_the_reference(dsa, entry):
    heads, varlen, ratio, offsets = entry
    assert heads == H
    for i, s_q in enumerate((130, 256)):
        x = _inputs(varlen, ratio, offsets, s_q, seed=hash(entry) % 1000 + i)
        want = ref.reference(x, SM_SCALE, LOSS_COEFF, ratio)  # fp64 on the GPU, from the untouched inputs
        assert (want["limits"] > 1).any()
        keep = {n: x[n].clone() for n in ("attn_score", "attn_l1norm", "index_lse", "index_q", "weights", "index_k", "grad_loss")}
        for dk_dtype in (torch.bfloat16, torch.float32):
            for form in ("allocating", "into"):
                what = f"H{heads} varlen {varlen} ratio {ratio} offsets {offsets} S_q {s_q} dK {dk_dtype} {form}"
                got, isc = _run(dsa, x, form, dk_dtype, ratio)
                assert got["d_index_k"].dtype == dk_dtype
                _check(got, isc, want, what)
                for n, t in keep.items():
                    assert same_bits(x[n], t), f"{what}: {n} was modified (read-only)"


def test_the_entry_list_covers_the_manifest():
    """manifests/default.toml: H64, BSHD and THD, ratio 1 and 4, with and without offsets."""
    assert _entries() == sorted((H, v, r, o) for v in (False, True) for r in (1, 4) for o in (False, True))


def test_the_allocating_form_allocates_and_reads_the_thd_maxima(dsa):
    """No outputs, no workspace, THD without max_seqlen_*: bf16 outputs allocated like the inputs,
    the maxima read back from cu_seqlens (a synchronisation, as upstream)."""
    _need(True, 4, False)
    x = _inputs(True, 4, False, 70, seed=3)
    want = ref.reference(x, SM_SCALE, LOSS_COEFF, 4)
    isc = x["index_score"].clone()
    args = {n: v for n, v in x.items() if n not in ("max_seqlen_q", "max_seqlen_k")}
    out = dsa.dense_indexer_backward(**dict(args, index_score=isc), sm_scale=SM_SCALE, loss_coeff=LOSS_COEFF, ratio=4)
    torch.cuda.synchronize()
    for n, like in (("d_index_q", "index_q"), ("d_weights", "weights"), ("d_index_k", "index_k")):
        assert out[n].dtype == torch.bfloat16 and out[n].shape == x[like].shape and out[n].device == x[like].device, n
    _check(out, isc, want, "allocating THD without max_seqlen")


def test_the_into_form_captures_in_a_cuda_graph_and_replays_on_new_values(dsa):
    _need(False, 4, False)
    x = _inputs(False, 4, False, 64, seed=11)
    bufs = {n: v.clone() for n, v in x.items()}
    dq, dw, dk = _outputs(x, torch.bfloat16)
    ws = _workspace(dsa, x, torch.bfloat16)
    g = captured(lambda: dsa.dense_indexer_backward_into(dq, dw, dk, **bufs, sm_scale=SM_SCALE, loss_coeff=LOSS_COEFF, ratio=4, workspace=ws))
    assert torch.isnan(dq).all() and torch.isnan(dk).all(), "captured, not run"
    assert same_bits(bufs["index_score"], x["index_score"])
    for seed in (12, 13):  # new q, w, k, scores, denominators and grad_loss in the captured buffers
        y = _inputs(False, 4, False, 64, seed=seed)
        replay_on(g, [(bufs[n], v) for n, v in y.items()], (dq, dw, dk))
        _check(dict(d_index_q=dq, d_weights=dw, d_index_k=dk), bufs["index_score"], ref.reference(y, SM_SCALE, LOSS_COEFF, 4), f"replay {seed}")


def test_empty_calls_zero_dk_without_launching(dsa):
    """No query rows (BSHD S_q 0, THD total_q 0): dK is zero, nothing launches. Ratio 3 ships no entry:
    even a call with nothing to launch is refused for it (KernelNotFoundError naming the bucket), as it
    would be with rows."""
    from dsa_aot.errors import KernelNotFoundError

    k = torch.randn(2, 5, 128, device=DEV).bfloat16()
    f32 = dict(dtype=torch.float32, device=DEV)
    for ratio in (4, 3):
        dk = poison(torch.empty(2, 5, 128, **f32))
        call = lambda: dsa.dense_indexer_backward(torch.empty(2, 0, H, 128, dtype=torch.bfloat16, device=DEV), torch.empty(2, 0, H, dtype=torch.bfloat16, device=DEV),
                                         k, torch.empty(2, 0, 5, **f32), torch.empty(2, 0, **f32), torch.empty(2, 0, 5, **f32),
                                         torch.empty(2, 0, **f32), torch.ones(1, **f32), ratio=ratio, d_index_k=dk)  # noqa: E731
        if ratio == 3:
            with pytest.raises(KernelNotFoundError, match="ratio = 3"):
                call()
            assert torch.isnan(dk).all()
            continue
        out = call()
        torch.cuda.synchronize()
        assert out["d_index_k"] is dk and torch.count_nonzero(dk) == 0 and not torch.isnan(dk).any()
        assert out["d_index_q"].shape == (2, 0, H, 128) and out["d_weights"].shape == (2, 0, H)
    cu_q, cu_k = torch.zeros(3, dtype=torch.int32, device=DEV), torch.tensor([0, 3, 5], dtype=torch.int32, device=DEV)
    dq, dw = torch.empty(0, H, 128, dtype=torch.bfloat16, device=DEV), torch.empty(0, H, dtype=torch.bfloat16, device=DEV)
    dk = poison(torch.empty(5, 128, dtype=torch.bfloat16, device=DEV))
    ws = torch.full((dsa.dense_indexer_backward_workspace_bytes((5, 128)),), 0xFF, dtype=torch.uint8, device=DEV)
    dsa.dense_indexer_backward_into(dq, dw, dk, torch.empty(0, H, 128, dtype=torch.bfloat16, device=DEV), torch.empty(0, H, dtype=torch.bfloat16, device=DEV),
                                    k.reshape(10, 128)[:5].contiguous(), torch.empty(0, 3, **f32), torch.empty(0, **f32), torch.empty(0, 3, **f32),
                                    torch.empty(0, **f32), torch.ones(1, **f32), ratio=4, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=0,
                                    max_seqlen_k=3, workspace=ws)
    torch.cuda.synchronize()
    assert torch.count_nonzero(dk) == 0 and not torch.isnan(dk).any()


def test_refused_calls_write_nothing(dsa):
    """Each refusal raises before any write: the outputs, the workspace and index_score keep their bits."""
    from dsa_aot.errors import InputError, KernelNotFoundError

    _need(False, 4, False)
    _need(True, 4, False)
    x = _inputs(False, 4, False, 16, seed=41, full=False)  # B 2, S_q 16, S_k 5 (nothing runs)
    xt = _inputs(True, 4, False, 40, seed=42, full=False)
    dq, dw, dk = _outputs(x, torch.bfloat16)
    ws = _workspace(dsa, x, torch.bfloat16)
    q32 = torch.randn(2, 16, 32, 128, device=DEV).bfloat16()
    dq32, dw32 = poison(torch.empty_like(q32)), poison(torch.empty(2, 16, 32, dtype=torch.bfloat16, device=DEV))
    tq, tw, tk = _outputs(xt, torch.bfloat16)
    tws = _workspace(dsa, xt, torch.bfloat16)
    # d_index_k (fp32) over the same bytes as index_score: index_score is the first 160 of its 1280 floats
    alias = torch.full((2 * 5 * 128,), math.nan, dtype=torch.float32, device=DEV)
    alias[: x["index_score"].numel()].copy_(x["index_score"].reshape(-1))
    alias_score, alias_dk = alias[: x["index_score"].numel()].view(x["index_score"].shape), alias.view(2, 5, 128)

    def into(**over):
        a = dict(d_index_q=dq, d_weights=dw, d_index_k=dk, **x, sm_scale=SM_SCALE, loss_coeff=LOSS_COEFF, ratio=4, workspace=ws)
        a.update(over)
        return lambda: dsa.dense_indexer_backward_into(**a)

    def alloc(**over):
        a = dict(x, d_index_q=dq, d_weights=dw, d_index_k=dk, sm_scale=SM_SCALE, loss_coeff=LOSS_COEFF, ratio=4)
        a.update(over)
        return lambda: dsa.dense_indexer_backward(**a)

    thd_no_max = {n: v for n, v in xt.items() if n not in ("max_seqlen_q", "max_seqlen_k")}
    cases = [
        ("weights dtype", InputError, "weights", into(weights=x["weights"].float())),
        ("weights dtype (allocating)", InputError, "weights", alloc(weights=x["weights"].float())),
        ("H=32", InputError, "H=32", into(index_q=q32, weights=q32[..., 0].contiguous(), d_index_q=dq32, d_weights=dw32)),
        ("ratio 3", KernelNotFoundError, r"(?s)dsa_dense_indexer_backward.*ratio = 3", into(ratio=3)),
        ("ratio 3 (allocating)", KernelNotFoundError, r"(?s)dsa_dense_indexer_backward.*ratio = 3", alloc(ratio=3)),
        ("block_I 64", InputError, "block_I", into(block_I=64)),
        ("THD _into without max_seqlen", InputError, "max_seqlen",
         lambda: dsa.dense_indexer_backward_into(tq, tw, tk, **thd_no_max, sm_scale=SM_SCALE, ratio=4, workspace=tws)),
        ("workspace too small", InputError, "workspace", into(workspace=ws[: ws.numel() - 128])),
        ("d_index_k aliases index_score", InputError, "overlap", into(index_score=alias_score, d_index_k=alias_dk, workspace=None)),
    ]
    watched = [dq, dw, dk, ws, x["index_score"], dq32, dw32, tq, tw, tk, tws, xt["index_score"], alias]
    refusals_write_nothing(cases, watched)
