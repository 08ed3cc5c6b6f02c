"""The fused indexer forward + top-k on a capability-10.0 stand-in (no SM100 GPU here): BSHD, windowed and
THD calls through the real lifted host functions, and the GEMM's argument order against upstream's."""

import json
import struct
from pathlib import Path

import pytest
import torch

import stand_in
from dsa_aot.errors import InputError, KernelNotFoundError


def _t(shape, dtype=torch.float32):
    """A zeroed stand-in CUDA tensor."""
    return stand_in.cuda_tensor(torch.zeros(shape, dtype=dtype))


def test_a_bshd_call_launches_gemm_stage2_and_local_to_global(sm100_env):
    import dsa_aot.ops.dsa_indexer_forward_top_k as op

    env = sm100_env
    st = env.new_stream(0)
    b, s_q, s_k, h, top_k = 2, 256, 65, 64, 512

    q, k, w = _t((b, s_q, h, 128), torch.bfloat16), _t((b, s_k, 1, 128), torch.bfloat16), _t((b, s_q, h), torch.bfloat16)
    idx, val, sm = _t((b, s_q, top_k), torch.int32), _t((b, s_q, top_k)), _t((b, s_q, top_k))
    need = op.compress_topk_cand_buffer_size(b, s_q, s_k, 4)
    env.launches.clear()
    with pytest.raises(InputError, match=f"the call needs {need}"):
        op.indexer_forward_top_k_into(idx, val, sm, None, _t((need - 1,)), q, k, w, top_k, stream=st)
    assert not env.launches
    cand = _t((need,))
    op.indexer_forward_top_k_into(idx, val, sm, None, cand, q, k, w, top_k, sm_scale=0.5, stream=st)
    gemm, stage2, l2g = env.launches
    assert gemm.dims[:3] == (-(-s_q * h // 128), 1, b) and struct.pack("<f", 0.5) in gemm.params and struct.pack("<Q", cand.data_ptr()) in gemm.params
    assert stage2.dims[:4] == (s_q, b, 1, 256) and struct.pack("<Q", cand.data_ptr()) in stage2.params
    assert struct.pack("<Q", idx.data_ptr()) in l2g.params
    assert all(L.dims[7] == st for L in (gemm, stage2, l2g))


def test_a_windowed_call_runs_each_window_on_views_with_the_plans_offset_tables(sm100_env, monkeypatch):
    """Upstream's long-S_q loop, at a small S_q with explicit windows: per window the offsets GEMM and
    stage 2 on that window's rows (q, w and the outputs at the window's first row, k cut at its last
    key), causal offsets rs for every batch and slabs b * pbf from a table the plan's memsets write,
    then one local-to-global over all rows."""
    import dsa_aot.ops.dsa_indexer_forward_top_k as op

    env = sm100_env
    st = env.new_stream(0)
    b, s_q, s_k, h, top_k, mb = 2, 256, 64, 64, 512, 64
    tables = []

    def table(nbytes, device):
        tables.append(stand_in.cuda_tensor(torch.zeros(nbytes, dtype=torch.uint8)))
        return tables[-1]

    monkeypatch.setattr(op, "_table", table)

    q, k, w = _t((b, s_q, h, 128), torch.bfloat16), _t((b, s_k, 1, 128), torch.bfloat16), _t((b, s_q, h), torch.bfloat16)
    idx, val, sm = _t((b, s_q, top_k), torch.int32), _t((b, s_q, top_k)), _t((b, s_q, top_k))
    need = op.compress_topk_cand_buffer_size(b, s_q, s_k, 4, microbatch_rows=mb)
    wins = op.windows(s_q, s_k, 4, mb)
    pbf = need // b
    assert wins == [(0, 64, 16), (64, 64, 32), (128, 64, 48), (192, 64, 64)] and pbf == policy_g(256, 4) - policy_g(192, 4)
    cand = _t((need,))
    env.launches.clear()
    env.memsets.clear()
    op.indexer_forward_top_k_into(idx, val, sm, None, cand, q, k, w, top_k, stream=st, microbatch_rows=mb)
    assert len(env.launches) == 2 * len(wins) + 1
    base = tables[0].data_ptr()
    # the tables' bytes as the memsets leave them
    mem = bytearray(tables[0].numel())
    for ptr, n, s, _, word in env.memsets:
        assert s == st and base <= ptr and ptr + n <= base + len(mem)
        mem[ptr - base:ptr - base + n] = struct.pack("<I", word) * (n // 4)
    assert list(struct.unpack("<3q", bytes(mem[:24]))) == [0, pbf, 2 * pbf]
    for j, (rs, n, kw) in enumerate(wins):
        gemm, stage2 = env.launches[2 * j:2 * j + 2]
        qco = base + 32 + 16 * j
        assert list(struct.unpack("<2i", bytes(mem[qco - base:qco - base + 8]))) == [rs, rs]
        for L in (gemm, stage2):
            assert struct.pack("<Q", qco) in L.params and struct.pack("<Q", base) in L.params and L.dims[7] == st
        assert struct.pack("<Q", q.data_ptr() + rs * h * 128 * 2) in gemm.params and struct.pack("<Q", w.data_ptr() + rs * h * 2) in gemm.params
        assert struct.pack("<Q", k.data_ptr()) in gemm.params and gemm.dims[:3] == (-(-n * h // 128), 1, b)
        assert struct.pack("<Q", idx.data_ptr() + rs * top_k * 4) in stage2.params and stage2.dims[:2] == (n, b)
        assert struct.pack("<ii", n, kw) in stage2.params  # this window's S_q and S_k
    assert struct.pack("<Q", idx.data_ptr()) in env.launches[-1].params


def policy_g(n, ratio):
    from dsa_aot.policy.dsa_indexer_forward_top_k import cand_floats

    return cand_floats(n, ratio)


def test_a_thd_call_binds_segments_batch_offsets_and_the_outputs_as_upstream_views_them(sm100_env):
    """THD: one GEMM over the segments (cu_seqlens, the longest segments as S_q / S_k, the caller's batch
    offsets), stage 2 over (total_q, 1, top_k) views with grid (total_q, 1), local-to-global with
    cu_seqlens (seqlen_k 0)."""
    import dsa_aot.ops.dsa_indexer_forward_top_k as op

    env = sm100_env
    st = env.new_stream(0)
    b, tq, tk, h, top_k = 2, 600, 180, 64, 512

    q, k, w = _t((tq, h, 128), torch.bfloat16), _t((tk, 1, 128), torch.bfloat16), _t((tq, h), torch.bfloat16)
    cu_q, cu_k, cbo = _t((b + 1,), torch.int32), _t((b + 1,), torch.int32), _t((b + 1,), torch.int64)
    idx, val, sm = _t((tq, top_k), torch.int32), _t((tq, top_k)), _t((tq, top_k))
    cand = _t((1000,))
    env.launches.clear()
    with pytest.raises(InputError, match="cand_batch_offsets"):
        op.indexer_forward_top_k_into(idx, val, sm, None, cand, q, k, w, top_k, stream=st, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=300,
                                      max_seqlen_k=90)
    with pytest.raises(InputError, match="max_seqlen_q 400 > max_seqlen_k"):
        op.indexer_forward_top_k_into(idx, val, sm, None, cand, q, k, w, top_k, stream=st, cand_batch_offsets=cbo, cu_seqlens_q=cu_q,
                                      cu_seqlens_k=cu_k, max_seqlen_q=400, max_seqlen_k=90)
    assert not env.launches
    op.indexer_forward_top_k_into(idx, val, sm, None, cand, q, k, w, top_k, stream=st, cand_batch_offsets=cbo, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                  max_seqlen_q=300, max_seqlen_k=90)
    gemm, stage2, l2g = env.launches
    for L in (gemm, stage2):
        assert all(struct.pack("<Q", x.data_ptr()) in L.params for x in (cand, cu_q, cu_k, cbo)) and L.dims[7] == st
    assert struct.pack("<Q", q.data_ptr()) in gemm.params and stage2.dims[:4] == (tq, 1, 1, 256)
    assert struct.pack("<ii", 300, 90) in stage2.params
    assert all(struct.pack("<Q", x.data_ptr()) in l2g.params for x in (idx, cu_q, cu_k))


DATA = Path(__file__).resolve().parents[2] / "data" / "fused_topk_gemm_sm100"


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.iterdir()))
def test_the_gemm_call_feeds_the_lifted_host_function_in_upstreams_order(name, sm100_calls):
    """ci/check_sm100_calls.check_fused_gemm on four stored launchers (bf16 2-D with LSE, mxfp8 1-D, THD mxfp4
    with causal offsets, THD bf16 fp32-W with LSE): the op's argument list equals upstream's order written
    down in the checker and runs through the lifted host function; a call convention that swaps the
    causal and the batch offsets (or q and k) is caught."""
    import dsa_aot.ops.dsa_indexer_forward_top_k as op
    from dsa_aot.toolchain import verify

    chk = sm100_calls
    meta = json.loads((DATA / name / "meta.json").read_text())
    key = {k: v for k, v in meta["key"].items() if k not in meta["derived"]}
    ns = verify.load_launcher((DATA / name / "launcher.py").read_text(), name)
    for b, s_q, s_k in ((2, 256, 64), (1, 8192, 2048), (3, 5, 2)):
        assert chk.check_fused_gemm(ns, key, b, s_q, s_k) == []
    real = op._record_gemm

    def offsets_swapped(rec, le, q, k, w, scales, cand, lse, s_q, s_k, cu, qco, cbo):
        return real(rec, le, q, k, w, scales, cand, lse, s_q, s_k, cu, cbo, qco)

    def qk_swapped(rec, le, q, k, w, *rest):
        return real(rec, le, k, q, w, *rest)

    for wrong in (qk_swapped, offsets_swapped) if key["offsets"] else (qk_swapped,):
        op._record_gemm = wrong
        try:
            assert chk.check_fused_gemm(ns, key, 2, 256, 64) != []
        finally:
            op._record_gemm = real


@pytest.fixture
def device_allocs(monkeypatch):
    """The allocating form on the stand-in: torch's device allocations made over CPU storage (presenting as
    cuda:0), the launch stream's context a no-op, no capture."""
    import contextlib

    import dsa_aot.ops.gpu as support
    import dsa_aot.ops.declare as declare
    import dsa_aot.ops.dsa_indexer_forward_top_k as op

    for name in ("empty", "zeros", "full", "empty_like", "zeros_like"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, device=None, _real=real, **k: stand_in.cuda_tensor(_real(*a, **k)))
    for mod in (support, declare, op):
        monkeypatch.setattr(mod, "alloc_on", lambda stream, dev: contextlib.nullcontext(), raising=False)
    monkeypatch.setitem(op.indexer_forward_top_k.__globals__, "AO", lambda stream, dev: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def _params_hold(launch, *ts):
    return all(struct.pack("<Q", t.data_ptr()) in launch.params for t in ts)


def test_the_allocating_form_makes_what_is_not_given_and_returns_upstreams_keys(sm100_env, device_allocs):
    """BSHD: the outputs and the candidate buffer made (b * G(S_q) floats), the keys upstream returns
    ({indices, logits, softmax}; return_softmax=False and return_lse pick their entries), a given output
    used as it is when the kernels can bind it, else filled through one of the op's own and copied back,
    and a strided input staged (contiguous) before the launch."""
    import dsa_aot.ops.dsa_indexer_forward_top_k as op

    env = sm100_env
    st = env.new_stream(0)
    b, s_q, s_k, h, top_k = 2, 256, 65, 64, 512

    q, k, w = _t((b, s_q, h, 128), torch.bfloat16), _t((b, s_k, 1, 128), torch.bfloat16), _t((b, s_q, h), torch.bfloat16)
    env.launches.clear()
    r = op.indexer_forward_top_k(q, k, w, top_k, stream=st)
    assert set(r.keys()) == {"indices", "logits", "softmax"}
    assert r["indices"].shape == (b, s_q, top_k) and r["indices"].dtype == torch.int32 and r["softmax"].dtype == torch.float32
    gemm, stage2, l2g = env.launches
    assert _params_hold(stage2, r["indices"], r["logits"], r["softmax"]) and _params_hold(l2g, r["indices"])
    assert struct.pack("<i", b * op.policy.cand_floats(s_q, 4)) in stage2.params  # the buffer made: B * G(S_q) floats
    env.launches.clear()
    with pytest.raises(KernelNotFoundError, match="softmax = false"):  # this build ships the softmax's stage 2 only
        op.indexer_forward_top_k(q, k, w, top_k, stream=st, return_softmax=False)
    with pytest.raises(KernelNotFoundError, match="lse = true"):
        op.indexer_forward_top_k(q, k, w, top_k, stream=st, return_lse=True)
    assert not env.launches
    mine = _t((b, s_q, top_k), torch.int32)
    strided = _t((b, s_q, 2 * top_k), torch.int32)[..., ::2]
    env.launches.clear()
    r = op.indexer_forward_top_k(q, k, w, top_k, stream=st, out_indices=mine)
    assert r["indices"] is mine and _params_hold(env.launches[1], mine)
    env.launches.clear()
    r = op.indexer_forward_top_k(q, k, w, top_k, stream=st, out_indices=strided)
    assert r["indices"] is strided and not _params_hold(env.launches[1], strided)  # bound through the op's own buffer
    env.launches.clear()
    qs = _t((b, s_q, h, 256), torch.bfloat16)[..., :128]  # strided: staged before the launch
    op.indexer_forward_top_k(qs, k, w, top_k, stream=st)
    assert not _params_hold(env.launches[0], qs)


def test_the_allocating_form_works_out_thd_maxima_batch_offsets_and_the_buffer_as_upstream(sm100_env, device_allocs, monkeypatch):
    """THD with nothing but cu_seqlens: the longest segments read back, the batch offsets made on the device and
    the buffer sized from their last value (upstream's .item()); under capture each of those is refused, naming
    what to pass."""
    import dsa_aot.ops.dsa_indexer_forward_top_k as op

    env = sm100_env
    st = env.new_stream(0)
    tq, tk, h, top_k = 600, 180, 64, 512

    q, k, w = _t((tq, h, 128), torch.bfloat16), _t((tk, 1, 128), torch.bfloat16), _t((tq, h), torch.bfloat16)
    cu_q = stand_in.cuda_tensor(torch.tensor([0, 300, 600], dtype=torch.int32))
    cu_k = stand_in.cuda_tensor(torch.tensor([0, 90, 180], dtype=torch.int32))
    env.launches.clear()
    r = op.indexer_forward_top_k(q, k, w, top_k, stream=st, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert set(r.keys()) == {"indices", "logits", "softmax"} and r["indices"].shape == (tq, top_k)
    gemm, stage2, l2g = env.launches
    assert struct.pack("<ii", 300, 90) in stage2.params  # the longest segments
    cbo, total = op.compress_topk_cand_buffer_size_thd(cu_q, cu_k, 4)
    assert struct.pack("<q", total) in gemm.params or struct.pack("<Q", total) in gemm.params  # the buffer's 64-bit extent
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    env.launches.clear()
    with pytest.raises(InputError, match="under CUDA-graph capture pass max_seqlen_q and max_seqlen_k") as e:
        op.indexer_forward_top_k(q, k, w, top_k, stream=st, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert "cand_buffer" in str(e.value) and not env.launches
