"""dsa_aot.ops.dsa_dense_indexer_backward without a GPU: what a call records (zero the fp32 dK, score-grad,
GEMM; the bf16 cast), the grids upstream launches, the refusals, the workspace size against cudnn's
plan, and the SM100 path through the real lifted host functions (a capability-10.0 stand-in)."""

from build_files import entries_of, launcher_source
import struct

import pytest
import torch

import op_calls
import stand_in
from dsa_aot.errors import InputError, KernelNotFoundError


@pytest.fixture
def torch_steps(monkeypatch):
    """The op's torch steps (the bf16 cast, zeroing, allocation, the THD maxima) on the stand-in's CPU
    tensors: no CUDA stream or capture state to enter on a CPU-only torch."""
    import contextlib

    import dsa_aot.ops.gpu as support
    import dsa_aot.ops.dsa_dense_indexer_backward as op
    import dsa_aot.ops.dsa_indexer_backward as ib

    for mod in (op, ib, support):  # (gpu.max_lengths reads the THD maxima)
        monkeypatch.setattr(mod, "alloc_on", lambda stream, dev: contextlib.nullcontext())
    monkeypatch.setitem(op.dense_indexer_backward.__globals__, "alloc_on", lambda stream, dev: contextlib.nullcontext())  # the declared form's own
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def _ptr_in(t, blob) -> bool:
    return struct.pack("<Q", t.data_ptr()) in blob


@pytest.mark.parametrize("varlen", [False, True])
def test_a_call_zeroes_dk_then_runs_score_grad_and_the_gemm_on_its_stream(env, varlen):
    stream = env.new_stream(0)
    fn, args, kw, _ = op_calls.dense_indexer_backward(0, stream, s_q=8, varlen=varlen)
    dq, dw, dk, q, w, k, att, den, isc, lse, gl = args
    env.launches.clear()
    env.memsets.clear()
    fn(*args, **kw)
    assert [(m[0], m[1]) for m in env.memsets] == [(dk.data_ptr(), dk.numel() * 4)]  # the fp32 dK, before the kernels
    sg, gemm = env.launches
    b = 2
    assert sg.dims[:6] == (8, b, 1, 128, 1, 1) and gemm.dims[:6] == (8, b, 1, 384, 1, 1)  # (max_seqlen_q, batch) both on SM90
    assert sg.dims[7] == gemm.dims[7] == stream
    for t in (isc, att, lse, den, gl):
        assert _ptr_in(t, sg.params), "score-grad reads the raw scores, denominators and grad_loss"
    assert not _ptr_in(dk, sg.params)
    assert _ptr_in(dk, gemm.params) and _ptr_in(w, gemm.params) and _ptr_in(isc, gemm.params)  # the signal left in index_score
    if varlen:
        assert _ptr_in(kw["cu_seqlens_q"], sg.params) and _ptr_in(kw["cu_seqlens_k"], gemm.params)
    # grad_scale = loss_coeff / rows (B*S_q, or total_q in THD), an fp32 parameter of the score-grad launch
    rows = q.shape[0] if varlen else q.shape[0] * q.shape[1]
    assert struct.pack("<f", 0.5 / rows) in sg.params and struct.pack("<f", 0.1) in gemm.params


def test_a_bf16_dk_accumulates_in_the_workspace_and_is_cast_after(env, torch_steps):
    stream = env.new_stream(0)
    fn, args, kw, _ = op_calls.dense_indexer_backward(0, stream, dk_dtype=torch.bfloat16)
    dk, ws = args[2], kw["workspace"]
    ws.view(torch.float32)[: dk.numel()].copy_(torch.arange(dk.numel(), dtype=torch.float32))  # what the GEMM would leave
    env.launches.clear()
    env.memsets.clear()
    fn(*args, **kw)
    assert [(m[0], m[1]) for m in env.memsets] == [(ws.data_ptr(), dk.numel() * 4)]
    assert _ptr_in(ws, env.launches[1].params) and not _ptr_in(dk, env.launches[1].params)
    # the stand-in memset does not write: the cast copies what the workspace holds
    assert torch.equal(dk.view(-1).float(), torch.arange(dk.numel(), dtype=torch.float32).bfloat16().float())


def test_calls_with_nothing_to_do_launch_nothing_and_zero_the_outputs(env, torch_steps):
    fn, args, kw, _ = op_calls.dense_indexer_backward(0, env.new_stream(0), s_q=0)
    env.launches.clear()
    env.memsets.clear()
    fn(*args, **kw)
    assert not env.launches and not env.memsets
    assert not args[2].any()  # dK: no query reaches a key


def test_refusals_name_every_problem_before_anything_runs(env):
    import dsa_aot.dsa

    fn, args, kw, writes = op_calls.dense_indexer_backward(0, env.new_stream(0))
    before = [stand_in.contents(t) for t in writes]
    env.launches.clear()
    env.memsets.clear()
    bad = list(args)
    bad[4] = stand_in.cuda_tensor(torch.zeros(args[4].shape, dtype=torch.float32))  # weights fp32
    with pytest.raises(InputError) as e:
        fn(*bad, **{**kw, "block_I": 64, "ratio": 0, "max_seqlen_q": 8})
    msg = str(e.value)
    for want in ("nothing was launched", "weights: dtype torch.float32", "block_I=64", "ratio=0", "max_seqlen_q=8: only with cu_seqlens"):
        assert want in msg, (want, msg)
    for extra, want in ((dict(loss_coeff=float("nan")), "loss_coeff"), (dict(sm_scale="x"), "sm_scale")):
        with pytest.raises(InputError, match=want):
            fn(*args, **{**kw, **extra})
    aliased = list(args)
    aliased[2] = args[8]  # d_index_k over index_score
    with pytest.raises(InputError, match="overlaps|shape"):
        fn(*aliased, **kw)
    fn32, a32, kw32, _ = op_calls.dense_indexer_backward(0, env.new_stream(0), dk_dtype=torch.bfloat16)
    small = stand_in.cuda_tensor(torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(InputError, match="workspace: 16 bytes"):
        fn32(*a32, **{**kw32, "workspace": small})
    with pytest.raises(InputError, match="workspace: missing"):
        fn32(*a32, **{**kw32, "workspace": None})
    fnt, at, kwt, _ = op_calls.dense_indexer_backward(0, env.new_stream(0), varlen=True)
    with pytest.raises(InputError, match="THD needs max_seqlen_q and max_seqlen_k"):
        fnt(*at, **{**kwt, "max_seqlen_q": None})
    h32 = list(args)
    h32[3] = stand_in.cuda_tensor(torch.zeros(2, 8, 32, 128, dtype=torch.bfloat16))
    with pytest.raises(InputError, match="H=32"):
        fn(*h32, **kw)
    with pytest.raises(KernelNotFoundError, match="ratio = 3"):  # a ratio the build does not ship: the bucket to add
        fn(*args, **{**kw, "ratio": 3})
    with pytest.raises(InputError, match=r"index_q: expected a CUDA tensor \(B, S_q, H, 128\)"):
        dsa_aot.dsa.dense_indexer_backward(args[3][0], *args[4:11])
    assert not env.launches and not env.memsets
    assert [stand_in.contents(t) for t in writes] == before


def test_the_allocating_form_reads_thd_maxima_and_allocates_like_the_inputs(env, torch_steps):
    import dsa_aot.dsa

    stream = env.new_stream(0)
    _, args, kw, _ = op_calls.dense_indexer_backward(0, stream, varlen=True)
    kw = {k: v for k, v in kw.items() if k not in ("max_seqlen_q", "max_seqlen_k", "workspace")}
    env.launches.clear()
    out = dsa_aot.dsa.dense_indexer_backward(*args[3:], d_index_k=args[2], **kw)  # fp32 d_index_k given: no workspace (a CPU torch cannot allocate one)
    assert set(out.keys()) == {"d_index_q", "d_weights", "d_index_k"} and out["d_index_k"] is args[2]
    assert out["d_index_q"].shape == args[3].shape and out["d_weights"].shape == args[4].shape
    assert env.launches[0].dims[:2] == (8, 2)  # max_seqlen_q read from cu_seqlens_q (segments of 8 and 5)


def test_workspace_bytes_equal_upstream_plan():
    """Against cudnn's own DenseIndexerBackward.scratch_workspace_bytes (its plan object needs no GPU)."""
    api = pytest.importorskip("cudnn.deepseek_sparse_attention.indexer_backward.api")
    import dsa_aot.dsa

    for b, s_q, s_k in ((1, 4, 1), (2, 3, 1000), (3, 5, 33)):
        q, w = torch.zeros(b, s_q, 64, 128, dtype=torch.bfloat16), torch.zeros(b, s_q, 64, dtype=torch.bfloat16)
        k, sc, dn = torch.zeros(b, s_k, 128, dtype=torch.bfloat16), torch.zeros(b, s_q, s_k), torch.zeros(b, s_q)
        for dt in (torch.bfloat16, torch.float32):
            dk = torch.zeros(b, s_k, 128, dtype=dt)
            plan = api.DenseIndexerBackward(q, w, k, q, w, dk, sc, dn, sc, dn)
            assert dsa_aot.dsa.dense_indexer_backward_workspace_bytes(k.shape, dt) == plan.scratch_workspace_bytes(), (b, s_k, dt)
    with pytest.raises(InputError):
        dsa_aot.dsa.dense_indexer_backward_workspace_bytes((2, -1, 128))


@pytest.mark.parametrize("varlen", [False, True])
def test_the_sm100_call_runs_through_the_lifted_host_functions(sm100_env, varlen):
    """Upstream's SM100 grids: score-grad (max_seqlen_q, B) x 128 threads, the 2Q GEMM (ceil(max_seqlen_q / 2), B) x 384."""
    stream = sm100_env.new_stream(0)
    fn, args, kw, _ = op_calls.dense_indexer_backward(0, stream, s_q=9, varlen=varlen)
    sm100_env.launches.clear()
    fn(*args, **kw)
    sg, gemm = sm100_env.launches
    assert sg.dims[:6] == (9, 2, 1, 128, 1, 1) and gemm.dims[:6] == (5, 2, 1, 384, 1, 1)
    assert _ptr_in(args[8], sg.params) and _ptr_in(args[2], gemm.params)


def test_the_sm100_calls_feed_the_lifted_host_functions_in_upstreams_order(sm100_build, sm100_calls):
    """ci/check_sm100_calls.check_dense_indexer_backward on the SM100 build's dense entries (score-grad and
    GEMM, BSHD and THD): the op's argument lists equal upstream's order written down in the checker, run
    through the lifted host functions, launch upstream's grids; swapped raw scores / target is caught."""

    import dsa_aot.ops.dsa_dense_indexer_backward as op
    from dsa_aot.toolchain import verify

    index = {"entries": entries_of(sm100_build)}
    entries = [e for e in index["entries"] if e["family"] == "dsa_dense_indexer_backward"]
    assert {e["op"] for e in entries} == {"score_grad", "gemm"} and len(entries) == 4
    real = op._launch_args

    def swapped(o, ts, p, *rest):
        p = list(p)
        p[6], p[8] = p[8], p[6]  # attn_score where index_score goes
        return real(o, ts, p, *rest)

    for e in entries:
        key = {k: v for k, v in e["key"].items() if k not in e.get("derived", ())}
        ns = verify.load_launcher(launcher_source(sm100_build, e), e["id"])
        for b, s_q, s_k in ((2, 256, 64), (1, 8191, 8191), (3, 5, 2)):
            assert sm100_calls.check_dense_indexer_backward(ns, e["op"], key, b, s_q, s_k) == [], e["id"]
        op._launch_args = swapped
        try:
            assert sm100_calls.check_dense_indexer_backward(ns, e["op"], key, 2, 256, 64) != []
        finally:
            op._launch_args = real
