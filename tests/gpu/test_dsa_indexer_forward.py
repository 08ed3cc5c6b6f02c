"""The indexer forward on the GPU against the fp64 reference (tests/gpu/ref_indexer_forward.py):
every shipped SM90 entry at two shapes (S_q odd and even, S_k a multiple of 64 or not: the fp8 H64
variants and the S_k % 4 != 0 row stride), outputs NaN-poisoned before each launch, the allocating
form and the ``_into`` form, THD with an empty segment and a segment past ``max_seqlen``, causal
offsets, LSE, graph capture, empty calls, strided inputs and the refusals that must come before any
write. Threads, devices and torch.ops run over this op in test_runtime_safety.py / test_library.py."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

import ref_indexer_forward as ref  # noqa: E402
from refutil import generator, rel_err, shipped_keys  # noqa: E402

DEV = "cuda:0"
BOUND = {"bf16": 1e-5, "fp8": 2e-3}  # measured on the H200 (docs/gpu-logs/indexer-forward): bf16 1.3e-7, fp8 1.3e-4


def _entries():
    """The shipped SM90 entries (none where there is no build: collection must not fail on a machine
    without one; the count is checked by test_the_entry_list_covers_the_manifest)."""
    return shipped_keys("dsa_indexer_forward", ("precision", "w_dtype", "heads", "ratio", "varlen", "offsets", "lse", "unchecked", "masked"))


def _shapes(unchecked, masked):
    """Two (S_q, S_k) that land on the entry's fp8 H64 variant (both odd S_q for the checked one)."""
    if masked:
        return [(66, 64), (130, 192)]
    if unchecked:
        return [(66, 63), (130, 190)]
    return [(65, 63), (130, 64)]


def _check(got, want, bound, what):
    assert torch.equal(torch.isinf(got) & (got < 0), torch.isinf(want)), f"{what}: the -inf mask differs"
    assert not torch.isnan(got).any(), f"{what}: NaN left (an element the op never wrote)"
    fin = torch.isfinite(want)
    err = rel_err(got[fin], want[fin]) if fin.any() else 0.0
    assert err < bound, f"{what}: rel err {err:.3g} >= {bound}"


def _case(precision, w_dtype, heads, ratio, varlen, offsets, lse, s_q, s_k, seed, sm_scale=0.37):
    import dsa_aot.dsa

    fp8 = precision == "fp8"
    wdt = getattr(torch, w_dtype)
    gen = generator(seed)
    kw = {"ratio": ratio, "sm_scale": sm_scale, "precision": precision}
    if varlen:
        lens_q, lens_k = [s_q, 0, s_q - 5, 3], [s_k, s_k - 7, s_k, 1]
        cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
        cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
        q, k, w, qs, ks = ref.random_inputs((int(cu_q[-1]),), (int(cu_k[-1]),), heads, gen, fp8, wdt)
        offs = torch.tensor([0, 5, 3 * ratio, 17], dtype=torch.int32) if offsets else None
        want = ref.scores_thd(q, k, w, cu_q, cu_k, s_q, s_k, ratio, sm_scale, offs, qs, ks, prescaled=fp8 and wdt == torch.float32)
        kw.update(cu_seqlens_q=cu_q.to(DEV), cu_seqlens_k=cu_k.to(DEV), max_seqlen_q=s_q, max_seqlen_k=s_k)
    else:
        q, k, w, qs, ks = ref.random_inputs((2, s_q), (2, s_k), heads, gen, fp8, wdt)
        offs = torch.tensor([0, 2 * ratio + 1], dtype=torch.int32) if offsets else None
        want = ref.scores_bshd(q, k, w, ratio, sm_scale, offs, qs, ks, prescaled=fp8 and wdt == torch.float32)
    if offs is not None:
        kw["q_causal_offsets"] = offs.to(DEV)
    if fp8:
        kw.update(q_scale=qs.to(DEV), k_scale=ks.to(DEV))
    q, k, w = q.to(DEV), k.to(DEV), w.to(DEV)
    scores = torch.full(want.shape, math.nan, dtype=torch.float32, device=DEV)
    lse_t = torch.full(want.shape[:-1], math.nan, dtype=torch.float32, device=DEV) if lse else None
    dsa_aot.dsa.indexer_forward_into(scores, lse_t, q, k, w, **kw)
    out = dsa_aot.dsa.indexer_forward(q, k, w, return_lse=lse, **kw)
    torch.cuda.synchronize()
    what = f"{precision} W {w_dtype} H{heads} ratio {ratio} THD {varlen} offsets {offsets} S_q {s_q} S_k {s_k}"
    bound = BOUND[precision]
    for name, got in (("_into", scores), ("allocating", out["scores"])):
        _check(got.cpu().double(), want, bound, f"{what} {name}")
    if lse:
        for name, got in (("_into", lse_t), ("allocating", out["lse"])):
            _check(got.cpu().double(), ref.lse_of(want), bound, f"{what} {name} lse")
    else:
        assert "lse" not in out
    return out


@pytest.mark.parametrize("entry", _entries(), ids=lambda e: "-".join(map(str, e)))
def test_every_shipped_entry_matches_the_reference(entry):
    precision, w_dtype, heads, ratio, varlen, offsets, lse, unchecked, masked = entry
    for i, (s_q, s_k) in enumerate(_shapes(unchecked, masked)):
        _case(precision, w_dtype, heads, ratio, varlen, offsets, lse, s_q, s_k, seed=hash(entry) % 1000 + i)


def test_the_entry_list_covers_the_manifest():
    entries = _entries()
    assert len(entries) == 120 and {e[0] for e in entries} == {"bf16", "fp8"}


def test_the_first_call_captures_in_a_cuda_graph_and_replays_on_new_values():
    import dsa_aot.dsa

    gen = generator(11)
    q, k, w, _, _ = ref.random_inputs((2, 64), (2, 40), 64, gen)
    q, k, w = q.to(DEV), k.to(DEV), w.to(DEV)
    scores = torch.full((2, 64, 40), math.nan, device=DEV)
    lse = torch.full((2, 64), math.nan, device=DEV)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            dsa_aot.dsa.indexer_forward_into(scores, lse, q, k, w, ratio=4, sm_scale=0.5)
    assert torch.isnan(scores).all()  # captured, not run
    q2, k2, w2, _, _ = ref.random_inputs((2, 64), (2, 40), 64, generator(12))
    q.copy_(q2.to(DEV)), k.copy_(k2.to(DEV)), w.copy_(w2.to(DEV))
    g.replay()
    torch.cuda.synchronize()
    want = ref.scores_bshd(q2, k2, w2, 4, 0.5)
    _check(scores.cpu().double(), want, BOUND["bf16"], "replay")
    _check(lse.cpu().double(), ref.lse_of(want), BOUND["bf16"], "replay lse")


def test_empty_calls():
    import dsa_aot.dsa

    q, k, w, _, _ = ref.random_inputs((2, 0), (2, 16), 64, generator(1))
    out = dsa_aot.dsa.indexer_forward(q.to(DEV), k.to(DEV), w.to(DEV), return_lse=True)
    assert out["scores"].shape == (2, 0, 16) and out["lse"].shape == (2, 0)
    q, k, w, _, _ = ref.random_inputs((2, 8), (2, 0), 64, generator(1))
    out = dsa_aot.dsa.indexer_forward(q.to(DEV), k.to(DEV), w.to(DEV), return_lse=True)
    torch.cuda.synchronize()
    assert out["scores"].shape == (2, 8, 0) and torch.isinf(out["lse"]).all() and (out["lse"] < 0).all()  # no key: -inf, no launch


def test_strided_inputs_are_staged_as_upstream():
    import dsa_aot.dsa

    gen = generator(5)
    q, k, w, _, _ = ref.random_inputs((2, 33), (2, 70), 32, gen)
    want = ref.scores_bshd(q, k, w, 4, 1.0)
    qt = q.transpose(0, 1).contiguous().transpose(0, 1).to(DEV)  # strided: batch is not the outer dim in memory
    wt = torch.empty(2, 33, 64, dtype=w.dtype, device=DEV)[..., ::2]
    wt.copy_(w)
    out = dsa_aot.dsa.indexer_forward(qt, k.to(DEV), wt)
    torch.cuda.synchronize()
    _check(out["scores"].cpu().double(), want, BOUND["bf16"], "strided")


def test_refused_calls_write_nothing():
    import dsa_aot.dsa
    from dsa_aot.errors import InputError, KernelNotFoundError

    q, k, w, _, _ = ref.random_inputs((2, 16), (2, 8), 64, generator(2))
    q, k, w = q.to(DEV), k.to(DEV), w.to(DEV)
    scores = torch.full((2, 16, 8), math.nan, device=DEV)
    bad = [
        dict(ratio=0), dict(precision="mxfp8"), dict(precision="fp8"),  # fp8 with bf16 q / without scales
        dict(q_causal_offsets=torch.zeros(3, dtype=torch.int32, device=DEV)), dict(sm_scale=float("nan")),
    ]
    for kw in bad:
        with pytest.raises(InputError):
            dsa_aot.dsa.indexer_forward_into(scores, None, q, k, w, **kw)
    with pytest.raises(InputError):  # k with two KV heads
        dsa_aot.dsa.indexer_forward_into(scores, None, q, k.expand(2, 8, 2, 128).contiguous(), w)
    with pytest.raises(InputError):  # scores of the wrong shape
        dsa_aot.dsa.indexer_forward_into(scores[:, :, :4], None, q, k, w)
    with pytest.raises(InputError):  # the tuning knobs upstream refuses on SM90
        dsa_aot.dsa.indexer_forward(q, k, w, m_block_size=64)
    with pytest.raises(KernelNotFoundError):  # a ratio the build does not ship
        dsa_aot.dsa.indexer_forward_into(scores, None, q, k, w, ratio=3)
    torch.cuda.synchronize()
    assert torch.isnan(scores).all()


def test_a_padded_scores_buffer_and_a_staged_out():
    """``_into`` takes a (..., ceil4(S_k)) buffer (the SM100 layout, accepted on SM90 too): the first
    S_k columns are the scores, the rest -inf; the allocating form's ``out`` that is not contiguous
    is filled through a buffer of its own and copied back, its neighbours untouched."""
    import dsa_aot.dsa

    q, k, w, _, _ = ref.random_inputs((2, 40), (2, 37), 64, generator(21))
    want = ref.scores_bshd(q, k, w, 4, 0.3)
    q, k, w = q.to(DEV), k.to(DEV), w.to(DEV)
    buf = torch.full((2, 40, 40), math.nan, device=DEV)
    dsa_aot.dsa.indexer_forward_into(buf, None, q, k, w, ratio=4, sm_scale=0.3)
    big = torch.full((2, 40, 50), 7.0, device=DEV)
    out = dsa_aot.dsa.indexer_forward(q, k, w, ratio=4, sm_scale=0.3, out=big[..., 3:40])["scores"]
    torch.cuda.synchronize()
    _check(buf[..., :37].cpu().double(), want, BOUND["bf16"], "padded _into")
    assert torch.isinf(buf[..., 37:]).all() and (buf[..., 37:] < 0).all()
    assert out.data_ptr() == big[..., 3:40].data_ptr()
    _check(big[..., 3:40].cpu().double(), want, BOUND["bf16"], "staged out")
    assert (big[..., :3] == 7).all() and (big[..., 40:] == 7).all()
