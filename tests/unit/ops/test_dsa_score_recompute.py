"""dsa_aot.ops.dsa_score_recompute (the sparse indexer's and the sparse attention's) without a GPU: on SM90
the weights / LSE copied transposed into the workspace before the one launch, the attention's scale
where each arch's kernel reads it, the arguments in upstream's order through the lifted host functions
of both arches, the grids, the refusals, and a plan that refuses other shapes."""

from build_files import entries_of, launcher_source
import struct

import pytest
import torch

import op_calls
import stand_in
from dsa_aot.errors import InputError, KernelNotFoundError


def _ptr_in(t, blob) -> bool:
    return struct.pack("<Q", t.data_ptr()) in blob


@pytest.mark.parametrize("length", [False, True])
def test_sm90_copies_the_weights_transposed_then_launches_once(env, torch_steps, length):
    stream = env.new_stream(0)
    fn, args, kw, writes = op_calls.sparse_indexer_score_recompute(0, stream, s_q=8, length=length)
    out, q, k, w, idx, ln = args
    ws = kw["workspace"]
    assert ws.numel() == -(-2 * 8 * 64 * 2 // 128) * 128
    env.launches.clear()
    env.memsets.clear()
    fn(*args, **kw)
    (launch,) = env.launches
    assert not env.memsets
    assert launch.dims[:6] == (8, 1, 2, 256, 1, 1) and launch.dims[7] == stream  # (S_q, 1, B) x 256 threads, as upstream
    for t in (out, q, idx, ws) + ((ln,) if length else ()):
        assert _ptr_in(t, launch.params), "every tensor the kernel reads or writes reaches a parameter"
    assert not _ptr_in(w, launch.params), "the kernel reads the transposed copy, not the weights"
    # the copy: the workspace holds weights (B, S_q, H) as (B, H, S_q), bf16
    got = ws[: w.numel() * 2].view(torch.bfloat16).view(2, 64, 8)
    assert torch.equal(got, w.transpose(1, 2))


def test_refusals_name_every_problem_before_anything_runs(env, torch_steps):
    import dsa_aot.dsa

    fn, args, kw, writes = op_calls.sparse_indexer_score_recompute(0, env.new_stream(0))
    before = [stand_in.contents(t) for t in writes]
    env.launches.clear()
    bad = list(args)
    bad[3] = stand_in.cuda_tensor(torch.zeros(args[3].shape))  # fp32 weights
    with pytest.raises(InputError) as e:
        fn(*bad, **{**kw, "topk_indices_global": 2, "qhead_per_kv_head": 32})
    for want in ("nothing was launched", "weights: dtype torch.float32", "topk_indices_global", "qhead_per_kv_head=32"):
        assert want in str(e.value), (want, str(e.value))
    with pytest.raises(InputError, match="workspace: missing"):
        fn(*args, **{**kw, "workspace": None})
    with pytest.raises(InputError, match="workspace: 16 bytes"):
        fn(*args, **{**kw, "workspace": stand_in.cuda_tensor(torch.zeros(16, dtype=torch.uint8))})
    ids300 = stand_in.cuda_tensor(torch.full((2, 8, 300), -1, dtype=torch.int32))
    with pytest.raises(InputError, match="topk=300"):  # the kernels read whole tiles of 128 slots
        fn(stand_in.cuda_tensor(torch.zeros(2, 8, 300)), *args[1:4], ids300, None, **kw)
    ids = stand_in.cuda_tensor(torch.full((2, 8, 1024), -1, dtype=torch.int32))
    with pytest.raises(KernelNotFoundError, match="topk = 1024"):  # the small build ships top-k 512 only: the bucket to add
        fn(stand_in.cuda_tensor(torch.zeros(2, 8, 1024)), *args[1:4], ids, None, **kw)
    with pytest.raises(InputError, match="4-D|\\(B, S_q, H, 128\\)"):
        dsa_aot.dsa.sparse_indexer_score_recompute(args[1][0], *args[2:5])
    assert not env.launches
    assert [stand_in.contents(t) for t in writes] == before


def test_workspace_bytes_follow_the_device_arch(env):
    import dsa_aot.dsa

    assert dsa_aot.dsa.sparse_indexer_score_recompute_workspace_bytes((3, 5, 64), 0) == 1920  # the bf16 (B, H, S_q) copy
    assert dsa_aot.dsa.sparse_indexer_score_recompute_workspace_bytes((1, 1, 10), 0) == 128  # rounded to 128 bytes
    with pytest.raises(InputError):
        dsa_aot.dsa.sparse_indexer_score_recompute_workspace_bytes((3, 5), 0)


@pytest.mark.parametrize("length", [False, True])
def test_sm100_launches_once_through_the_lifted_host_function_without_a_workspace(sm100_env, length):
    import dsa_aot.dsa

    stream = sm100_env.new_stream(0)
    fn, args, kw, _ = op_calls.sparse_indexer_score_recompute(0, stream, s_q=9, length=length)
    assert kw["workspace"] is None and dsa_aot.dsa.sparse_indexer_score_recompute_workspace_bytes(args[3].shape, 0) == 0
    sm100_env.launches.clear()
    fn(*args, **kw)
    (launch,) = sm100_env.launches
    assert launch.dims[3] == 384 and launch.dims[7] == stream
    for t in (args[0], args[4]) + ((args[5],) if length else ()):
        assert _ptr_in(t, launch.params)
    with pytest.raises(InputError, match="workspace: got str"):  # none needed: None or a tensor, not anything
        fn(*args, **{**kw, "workspace": "ws"})


def test_the_sm100_call_feeds_upstreams_argument_order(sm100_build, sm100_calls):
    """ci/check_sm100_calls.check_sparse_score on the SM100 build's entries (indexer and attention, with
    and without topk_length): the op's argument list equals upstream's order written down in the checker
    and runs through the lifted host function; swapped q and w / lse pointers and a scale that does not
    reach the kernel are caught."""

    import dsa_aot.ops.dsa_score_recompute as op
    from dsa_aot.toolchain import verify

    index = {"entries": entries_of(sm100_build)}
    entries = [e for e in index["entries"] if e["family"] == "dsa_score_recompute" and e["op"].startswith("sparse")]
    assert sorted(e["op"] for e in entries) == ["sparse_attention"] * 3 + ["sparse_indexer"] * 2
    real = op._launch_args

    def swapped(o, key, ts, p, s, x=()):
        p = list(p)
        p[1], p[3] = p[3], p[1]
        return real(o, key, ts, p, s, x)

    def unscaled(o, key, ts, p, s, x=()):
        return real(o, key, ts, p, s, (1.0,) if x else ())

    for e in entries:
        key = {k: v for k, v in e["key"].items() if k not in e.get("derived", ())}
        ns = verify.load_launcher(launcher_source(sm100_build, e), e["id"])
        for b, s_q, s_k in ((2, 64, 4096), (1, 4096, 300), (3, 5, 2)):
            assert sm100_calls.check_sparse_score(ns, e["op"], key, b, s_q, s_k) == [], e["id"]
        for bad in (swapped, unscaled) if e["op"] == "sparse_attention" else (swapped,):
            op._launch_args = bad
            try:
                assert sm100_calls.check_sparse_score(ns, e["op"], key, 2, 64, 4096) != [], (e["id"], bad.__name__)
            finally:
                op._launch_args = real


def _params_of(env, fn, args, kw):
    env.launches.clear()
    fn(*args, **kw)
    (launch,) = env.launches
    return launch


@pytest.mark.parametrize("length", [False, True])
def test_sm90_attention_copies_the_lse_transposed_and_passes_the_scale_per_call(env, torch_steps, length):
    """The LSE (B, S_q, H) fp32 lands as (B, H, S_q) in the workspace; the kernel parameter upstream's host
    code bakes (f32(scale * log2 e)) is written per call: two scales, two launches that differ in those
    4 bytes only, one plan per scale."""
    stream = env.new_stream(0)
    fn, args, kw, writes = op_calls.sparse_attn_score_recompute(0, stream, s_q=8, length=length)
    out, q, k, lse, idx, scale, ln = args
    ws = kw["workspace"]
    assert ws.numel() == 2 * 8 * 64 * 4  # fp32, already a multiple of 128
    env.memsets.clear()
    a = _params_of(env, fn, args, kw)
    assert not env.memsets
    assert a.dims[:6] == (8, 1, 2, 256, 1, 1) and a.dims[7] == stream
    for t in (out, q, idx, ws) + ((ln,) if length else ()):
        assert _ptr_in(t, a.params)
    assert not _ptr_in(lse, a.params), "the kernel reads the transposed copy"
    assert torch.equal(ws.view(torch.float32).view(2, 64, 8), lse.transpose(1, 2))
    assert struct.pack("<f", scale * 1.4426950408889634) in a.params
    b = _params_of(env, fn, (*args[:5], 0.25, ln), kw)
    diff = [i for i, (x, y) in enumerate(zip(a.params, b.params)) if x != y]
    assert len(diff) == 4 and b.params[diff[0]:diff[0] + 4] == struct.pack("<f", 0.25 * 1.4426950408889634)


@pytest.mark.parametrize("heads,length,dropped", [(64, False, False), (64, True, False), (128, True, True)])
def test_sm100_attention_reads_the_scale_and_drops_topk_length_where_upstream_does(sm100_env, heads, length, dropped):
    import dsa_aot.dsa

    stream = sm100_env.new_stream(0)
    fn, args, kw, _ = op_calls.sparse_attn_score_recompute(0, stream, s_q=9, length=length, heads=heads)
    assert kw["workspace"] is None and dsa_aot.dsa.sparse_attn_score_recompute_workspace_bytes(args[3].shape, 0) == 0
    launch = _params_of(sm100_env, fn, args, kw)
    assert launch.dims[3] == 384 and launch.dims[7] == stream
    assert struct.pack("<f", args[5]) in launch.params
    for t in (args[0], args[4]):
        assert _ptr_in(t, launch.params)
    if length:
        # H128 D512 top-k 512: compact and non-compact tiles are equal, upstream runs the non-compact kernel
        assert _ptr_in(args[6], launch.params) != dropped


def test_attention_refusals_name_every_problem_before_anything_runs(env, torch_steps):
    import dsa_aot.dsa

    fn, args, kw, writes = op_calls.sparse_attn_score_recompute(0, env.new_stream(0))
    out, q, k, lse, idx, scale, ln = args
    before = [stand_in.contents(t) for t in writes]
    env.launches.clear()
    bf_lse = stand_in.cuda_tensor(torch.zeros(lse.shape, dtype=torch.bfloat16))
    with pytest.raises(InputError) as e:
        fn(out, q, k, bf_lse, idx, float("nan"), None, **kw)
    for want in ("nothing was launched", "lse: dtype torch.bfloat16", "softmax_scale=nan"):
        assert want in str(e.value), (want, str(e.value))
    for bad in (0.0, -0.5, "0.1", None):
        with pytest.raises(InputError, match="softmax_scale"):
            fn(out, q, k, lse, idx, bad, None, **kw)
    q128 = stand_in.cuda_tensor(torch.zeros(2, 8, 64, 128, dtype=torch.bfloat16))
    k128 = stand_in.cuda_tensor(torch.zeros(2, 300, 128, dtype=torch.bfloat16))
    with pytest.raises(InputError, match="D=128 \\(expected 512 or 576\\)"):
        fn(out, q128, k128, lse, idx, scale, None, **kw)
    q576 = stand_in.cuda_tensor(torch.zeros(2, 8, 64, 576, dtype=torch.bfloat16))
    k576 = stand_in.cuda_tensor(torch.zeros(2, 300, 576, dtype=torch.bfloat16))
    with pytest.raises(KernelNotFoundError, match="dim = 576"):  # the small build ships D512 only: the bucket to add
        fn(out, q576, k576, lse, idx, scale, None, **kw)
    with pytest.raises(InputError, match="workspace: missing"):
        fn(*args, **{**kw, "workspace": None})
    with pytest.raises(InputError, match="4-D|\\(B, S_q, H, 512 or 576\\)"):
        dsa_aot.dsa.sparse_attn_score_recompute(q[0], k, lse, idx, scale)
    assert not env.launches
    assert [stand_in.contents(t) for t in writes] == before


def test_attention_workspace_bytes_follow_the_device_arch(env):
    import dsa_aot.dsa

    assert dsa_aot.dsa.sparse_attn_score_recompute_workspace_bytes((3, 5, 64), 0) == 3840  # the fp32 (B, H, S_q) copy
    assert dsa_aot.dsa.sparse_attn_score_recompute_workspace_bytes((1, 1, 10), 0) == 128
    with pytest.raises(InputError, match="lse_shape"):
        dsa_aot.dsa.sparse_attn_score_recompute_workspace_bytes((3, 5), 0)


def test_training_form_normalises_pads_and_slices_as_upstream(env, torch_steps, monkeypatch):
    """dsa_aot.dsa.sparse_attention_score_recompute: ids outside [0, S_kv) and slots past the clamped length
    become -1 (positions kept), the rows are padded with -1 to 512 slots, one batch-1 launch with local ids
    and no topk_length, the target sliced back to K columns; refusals before any launch."""
    import dsa_aot.dsa

    import dsa_aot.ops.gpu as support

    stream = env.new_stream(0)
    monkeypatch.setattr(support, "_raw_stream", lambda dev: stream)  # torch's current stream, as the stand-in has it
    def on_stand_in(fn):  # a CPU torch makes no CUDA tensors: the stand-in's instead
        return lambda *a, device=None, **kw: (stand_in.cuda_tensor(fn(*a, **kw)) if device is not None and torch.device(device).type == "cuda"
                                              else fn(*a, device=device, **kw))

    for name in ("arange", "empty"):
        monkeypatch.setattr(torch, name, on_stand_in(getattr(torch, name)))
    s_q, h, d, s_kv, k = 8, 64, 512, 300, 500
    q = stand_in.cuda_tensor(torch.zeros(s_q, h, d, dtype=torch.bfloat16))
    kv = stand_in.cuda_tensor(torch.zeros(s_kv, d, dtype=torch.bfloat16))
    lse = stand_in.cuda_tensor(torch.zeros(s_q, h))
    ids = torch.randint(-3, s_kv + 20, (s_q, k), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    length = torch.tensor([0, 1, 5, 499, 500, 600, -2, 250], dtype=torch.int32)
    env.launches.clear()
    r = dsa_aot.dsa.sparse_attention_score_recompute(q, kv, lse, stand_in.cuda_tensor(ids), topk_length=stand_in.cuda_tensor(length))
    (launch,) = env.launches
    assert launch.dims[:3] == (s_q, 1, 1) and launch.dims[7] == stream, "one batch of S_q rows, on torch's current stream"
    assert r["target"].shape == (s_q, k) and r["target"].dtype == torch.float32
    pos = torch.arange(k)[None, :]
    want = torch.where((ids >= 0) & (ids < s_kv) & (pos < length.clamp(0, k)[:, None]), ids, -1)
    assert torch.equal(r["indices"], want)
    assert struct.pack("<f", d**-0.5 * 1.4426950408889634) in launch.params, "the default scale 1/sqrt(D)"
    env.launches.clear()
    with pytest.raises(InputError, match="lse"):
        dsa_aot.dsa.sparse_attention_score_recompute(q, kv, stand_in.cuda_tensor(torch.zeros(s_q, h, dtype=torch.bfloat16)), stand_in.cuda_tensor(ids))
    with pytest.raises(InputError, match="softmax_scale"):
        dsa_aot.dsa.sparse_attention_score_recompute(q, kv, lse, stand_in.cuda_tensor(ids), softmax_scale=-1.0)
    with pytest.raises(KernelNotFoundError, match="topk = 640"):  # K 600 pads to 640: not in the small build
        dsa_aot.dsa.sparse_attention_score_recompute(q, kv, lse, stand_in.cuda_tensor(torch.zeros(s_q, 600, dtype=torch.int32)))
    assert not env.launches


# --- the dense indexer score recompute ---------------------------------------------------------------


@pytest.mark.parametrize("offsets", [False, True])
def test_sm90_dense_indexer_fills_minus_inf_copies_the_weights_then_launches_once(env, torch_steps, offsets):
    """Upstream's SM90 order: the weights transposed into the workspace, ``out`` filled with -inf (the kernel
    skips hidden K blocks), one launch on grid (.., H_kv, B) with 384 threads; the scale is in the cubin
    (the key), not in the parameters."""
    stream = env.new_stream(0)
    fn, args, kw, writes = op_calls.dense_indexer_score_recompute(0, stream, s_q=8, s_k=40)
    out, den, q, k, w = args
    if offsets:
        kw["q_causal_offsets"] = stand_in.cuda_tensor(torch.tensor([0, 9], dtype=torch.int32))
    env.launches.clear()
    env.memsets.clear()
    fn(*args, **kw)
    (launch,) = env.launches
    ((ptr, n, on, _, word),) = env.memsets
    assert ptr == out.data_ptr() and n == out.numel() * 4 and on == stream and word == 0xFF800000, "out filled with fp32 -inf first"
    assert launch.dims[1:6] == (1, 2, 384, 1, 1) and launch.dims[7] == stream
    for t in (out, den, q, k, kw["workspace"]) + ((kw["q_causal_offsets"],) if offsets else ()):
        assert _ptr_in(t, launch.params)
    assert not _ptr_in(w, launch.params)
    assert torch.equal(kw["workspace"][: w.numel() * 2].view(torch.bfloat16).view(2, 64, 8), w.transpose(1, 2))


@pytest.mark.parametrize("varlen", [False, True])
def test_sm100_dense_indexer_passes_the_scale_and_runs_thd_natively(sm100_env, varlen):
    stream = sm100_env.new_stream(0)
    fn, args, kw, _ = op_calls.dense_indexer_score_recompute(0, stream, s_q=9, s_k=33, varlen=varlen)
    assert kw["workspace"] is None
    sm100_env.launches.clear()
    sm100_env.memsets.clear()
    fn(*args, **{**kw, "sm_scale": 0.37})
    (launch,) = sm100_env.launches
    assert len(sm100_env.memsets) == 1, "out filled with -inf"
    assert launch.dims[3] == 256 and launch.dims[7] == stream
    assert struct.pack("<f", 0.37) in launch.params
    if varlen:
        assert _ptr_in(kw["cu_seqlens_q"], launch.params) and _ptr_in(kw["cu_seqlens_k"], launch.params)


def test_dense_indexer_refusals_before_anything_runs(env, torch_steps):
    import dsa_aot.dsa

    fn, args, kw, writes = op_calls.dense_indexer_score_recompute(0, env.new_stream(0))
    out, den, q, k, w = args
    before = [stand_in.contents(t) for t in writes]
    env.launches.clear()
    env.memsets.clear()
    with pytest.raises(KernelNotFoundError, match="scale = 0.5"):  # SM90 bakes the scale in: the bucket to add
        fn(*args, **{**kw, "sm_scale": 0.5})
    with pytest.raises(InputError, match="THD on SM90 in a plan"):  # as upstream's plan classes
        cu = stand_in.cuda_tensor(torch.tensor([0, 8, 16], dtype=torch.int32))
        dsa_aot.dsa.DenseIndexerScoreRecompute(out.view(16, 40), den.view(16), q.view(16, 64, 128), k.view(80, 1, 128), w.view(16, 64), cu, cu,
                                           ratio=4, max_seqlen_q=8, max_seqlen_k=40, workspace=kw["workspace"])
    with pytest.raises(InputError, match="precision='mxfp8'"):
        dsa_aot.dsa.dense_indexer_score_recompute(q, k, w, precision="mxfp8")
    with pytest.raises(InputError) as e:
        fn(out, den, q, k, stand_in.cuda_tensor(torch.zeros(w.shape)), ratio=0, sm_scale=float("inf"), workspace=kw["workspace"])
    for want in ("weights: dtype torch.float32", "ratio=0", "sm_scale=inf"):
        assert want in str(e.value), (want, str(e.value))
    assert not env.launches and not env.memsets
    assert [stand_in.contents(t) for t in writes] == before
    # two doubles with one float32 are one cubin: 1.0 + 2**-30 is not 1.0, but its float32 is
    fn(*args, **{**kw, "sm_scale": 1.0 + 2**-30})
    assert len(env.launches) == 1


@pytest.mark.parametrize("op_name", ["dense_indexer", "dense_attention"])
def test_the_sm100_dense_call_feeds_upstreams_argument_order(sm100_build, sm100_calls, op_name):
    """ci/check_sm100_calls.check_dense_score on the SM100 build's dense entries (the indexer's bf16, mxfp8 and
    mxfp4, the attention's bf16 and mxfp8 in both D512 S_k buckets and D128; BSHD and THD): the op's arguments in
    upstream's order run through the lifted host function; swapped out / denom pointers, a dropped scale and,
    block-scaled, swapped q / k scales or scale-padded offsets are caught."""

    import dsa_aot.ops.dsa_score_recompute as op
    from dsa_aot.toolchain import verify

    index = {"entries": entries_of(sm100_build)}
    entries = [e for e in index["entries"] if e["family"] == "dsa_score_recompute" and e["op"] == op_name]
    if op_name == "dense_indexer":
        want = [(p, 128, 64, v) for p in ("bf16", "mxfp4", "mxfp8") for v in (False, True)]
    else:
        want = [("bf16", 512, 128, False), ("bf16", 512, 128, True), ("mxfp8", 128, 64, False)] + [("mxfp8", 512, kb, v) for kb in (128, 256)
                                                                                                for v in (False, True)]
    got = sorted((e["key"]["precision"], e["key"].get("dim", 128), e["key"]["k_block"], e["key"]["varlen"]) for e in entries)
    assert got == sorted(want)
    real = op._dense_launch_args

    def swapping(i, j):
        def swapped(o, ts, c, p, s, x=()):
            p = list(p)
            p[i], p[j] = p[j], p[i]
            return real(o, ts, c, p, s, x)

        return swapped

    def unscaled(o, ts, c, p, s, x=()):
        return real(o, ts, c, p, s, (1.0,))

    for e in entries:
        key = {k: v for k, v in e["key"].items() if k not in e.get("derived", ())}
        ns = verify.load_launcher(launcher_source(sm100_build, e), e["id"])
        for b, s_q, s_k in ((2, 64, 4096), (1, 4096, 300), (3, 5, 2)):
            assert sm100_calls.check_dense_score(ns, op_name, key, b, s_q, s_k) == [], e["id"]
        bads = [swapping(0, 1), unscaled]
        if key["precision"] != "bf16":
            bads += [swapping(9, 10)] + ([swapping(11, 12), swapping(5, 11)] if key["varlen"] else [])
        for bad in bads:
            op._dense_launch_args = bad
            try:
                assert sm100_calls.check_dense_score(ns, op_name, key, 2, 64, 4096) != [], (e["id"], bad)
            finally:
                op._dense_launch_args = real


@pytest.mark.parametrize("precision", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("varlen", [False, True])
def test_sm100_block_scaled_dense_indexer_launches_once_with_its_scales(sm100_env, torch_steps, precision, varlen):
    """The block-scaled SM100 call: out filled with -inf, then one launch of upstream's 384-thread kernel on the
    caller's stream, its grid (ceil(S_q * H / 128), 1, B), every tensor (the scales and, THD, their padded
    offsets too) and the scale in the parameters; the allocating form and the plan launch the same."""
    import dsa_aot.dsa

    env = sm100_env
    stream = env.new_stream(0)
    fn, args, kw, _ = op_calls.dense_indexer_score_recompute_mx(0, stream, precision, s_q=9, s_k=33, varlen=varlen)
    out, den, q, k, w = args
    env.launches.clear()
    env.memsets.clear()
    fn(*args, **{**kw, "sm_scale": 0.37})
    (launch,) = env.launches
    ((ptr, n, on, _, word),) = env.memsets
    assert ptr == out.data_ptr() and n == out.numel() * 4 and on == stream and word == 0xFF800000, "out filled with fp32 -inf first"
    assert launch.dims[:4] == (-(-9 * 64 // 128), 1, 2, 384) and launch.dims[7] == stream
    tensors = (out, den, q, k, w) + tuple(v for v in kw.values() if isinstance(v, torch.Tensor))
    assert len(tensors) == (11 if varlen else 7)
    for t in tensors:
        assert _ptr_in(t, launch.params)
    assert struct.pack("<f", 0.37) in launch.params
    want = launch.params
    # the allocating form (upstream's wrapper surface) into the same outputs: the same launch
    env.launches.clear()
    r = dsa_aot.dsa.dense_indexer_score_recompute(q, k, w, out=out, denom_out=den, sm_scale=0.37, **{n: v for n, v in kw.items() if n != "stream"},
                                              stream=stream)
    assert r["out"] is out and r["denom"] is den
    assert [L.params for L in env.launches] == [want]
    # the plan (the functional op's tensors, its scales by name)
    plan = dsa_aot.dsa.DenseIndexerScoreRecompute(*args, sm_scale=0.37, **{n: v for n, v in kw.items() if n != "stream"})
    env.launches.clear()
    plan.execute(*args, stream=stream, **{n: v for n, v in kw.items() if n in type(plan)._tensors})
    assert [L.params for L in env.launches] == [want]


@pytest.mark.parametrize("precision", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("varlen", [False, True])
def test_sm90_refuses_the_block_scaled_dense_indexer(env, torch_steps, monkeypatch, precision, varlen):
    """Upstream's block-scaled dense indexer is SM100 only (NotImplementedError on SM90): an InputError saying so,
    before anything runs; a THD call's device cu_seqlens are not read back for it."""
    import dsa_aot.dsa
    import dsa_aot.ops.dsa_score_recompute as op

    def no_read_back(*a, **k):
        raise AssertionError("cu_seqlens read back for a call that is refused")

    monkeypatch.setattr(op, "_host_offsets", no_read_back)
    fn, args, kw, writes = op_calls.dense_indexer_score_recompute_mx(0, env.new_stream(0), precision, varlen=varlen)
    before = [stand_in.contents(t) for t in writes]
    env.launches.clear()
    env.memsets.clear()
    for call in (lambda: fn(*args, **kw),
                 lambda: dsa_aot.dsa.dense_indexer_score_recompute(*args[2:], **{n: v for n, v in kw.items() if n != "max_seqlen_q"})):
        with pytest.raises(InputError) as e:
            call()
        assert "SM100 only" in str(e.value) and "THD on SM90 in a plan" not in str(e.value), str(e.value)
    assert not env.launches and not env.memsets
    assert [stand_in.contents(t) for t in writes] == before


def test_sm100_block_scaled_dense_indexer_refusals(sm100_env, torch_steps):
    """Every malformed block-scaled call names its problems and runs nothing: missing scales, scales of the wrong
    dtype or packed shape, THD without the scale-padded offsets (and BSHD with them), q heads other than 32 / 64
    or more than one KV head, Q / K not of the precision's dtype, mxfp4 with a last dim of 128, scales with bf16,
    an unknown precision, sf_vec_size 16, a heads count the build does not ship."""
    import dsa_aot.dsa

    env = sm100_env
    stream = env.new_stream(0)
    fn, args, kw, writes = op_calls.dense_indexer_score_recompute_mx(0, stream, "mxfp8")
    out, den, q, k, w = args
    before = [stand_in.contents(t) for t in writes]
    e8 = torch.float8_e8m0fnu

    def e8m0(*shape):
        return stand_in.cuda_tensor(torch.zeros(shape, dtype=torch.uint8).view(e8))

    thd = op_calls.dense_indexer_score_recompute_mx(0, stream, "mxfp4", varlen=True)
    env.launches.clear()
    env.memsets.clear()
    cases = [
        (fn, args, dict(kw, q_scale=None), "requires q_scale and k_scale"),
        (fn, args, dict(kw, k_scale=stand_in.cuda_tensor(torch.zeros(2, 128, 4))), "k_scale: dtype torch.float32"),
        (fn, args, dict(kw, q_scale=e8m0(2, 128, 4)), "q_scale: shape (2, 128, 4) (expected (2, 512, 4))"),  # S_q 8 x H 64 rows
        (fn, args, dict(kw, k_scale=e8m0(2, 128, 8)), "k_scale: shape (2, 128, 8)"),
        (fn, args, dict(kw, cu_seqlens_q_scale_padded=stand_in.cuda_tensor(torch.zeros(3, dtype=torch.int32))), "only with THD"),
        (fn, args, dict(kw, precision="mxfp4"), "mxfp4 stores D 128 as 64"),
        (fn, args, dict(kw, precision="fp8"), "precision='fp8' (expected one of 'bf16', 'mxfp8', 'mxfp4')"),
        (fn, args, dict(kw, precision="bf16"), "block scales go with precision='mxfp8' or 'mxfp4'"),
        (fn, (out, den, stand_in.cuda_tensor(torch.zeros(q.shape, dtype=torch.bfloat16)), k, w), kw, "q: dtype torch.bfloat16"),
        (thd[0], thd[1], dict(thd[2], cu_seqlens_k_scale_padded=None), "cu_seqlens_k_scale_padded: THD mxfp4 needs"),
        (thd[0], thd[1], dict(thd[2], q_scale=e8m0(1, 100, 4)), "q_scale: shape (1, 100, 4) (expected (1, 'a multiple of 128', 4))"),
    ]
    for f, a, k_, want in cases:
        with pytest.raises(InputError) as e:
            f(*a, **k_)
        assert want in str(e.value), (want, str(e.value))
    h16 = op_calls.dense_indexer_score_recompute_mx(0, stream, "mxfp8", heads=16)
    with pytest.raises(InputError, match="32 or 64 q heads"):  # upstream's ValueError, before any lookup
        h16[0](*h16[1], **h16[2])
    h_kv2 = (out, den, stand_in.cuda_tensor(torch.zeros(2, 8, 128, 128, dtype=torch.uint8).view(torch.float8_e4m3fn)),
             stand_in.cuda_tensor(torch.zeros(2, 40, 2, 128, dtype=torch.uint8).view(torch.float8_e4m3fn)), stand_in.cuda_tensor(torch.zeros(2, 8, 128, dtype=torch.bfloat16)))
    with pytest.raises(InputError, match="one KV head"):
        fn(*h_kv2, **kw)
    with pytest.raises(InputError, match="sf_vec_size=16"):
        dsa_aot.dsa.dense_indexer_score_recompute(q, k, w, out=out, denom_out=den, sf_vec_size=16, **{n: v for n, v in kw.items() if n != "stream"})
    h32 = op_calls.dense_indexer_score_recompute_mx(0, stream, "mxfp8", heads=32)
    with pytest.raises(KernelNotFoundError, match="heads = 32"):  # the sm100 build ships H64: the bucket to add
        h32[0](*h32[1], **h32[2])
    assert not env.launches and not env.memsets
    assert [stand_in.contents(t) for t in writes] == before


# --- the dense attention score recompute -------------------------------------------------------------


def test_sm90_dense_attention_copies_the_lse_and_passes_the_scale_per_call(env, torch_steps):
    """The LSE transposed (fp32) into the workspace, out filled with -inf, one launch; the scale is the
    launcher's literal argument: two scales, launches that differ in those 4 bytes only."""
    stream = env.new_stream(0)
    fn, args, kw, writes = op_calls.dense_attn_score_recompute(0, stream)
    out, den, q, k, lse, scale = args
    env.launches.clear()
    env.memsets.clear()
    a = _params_of(env, fn, args, kw)
    ((ptr, n, on, _, word),) = env.memsets
    assert ptr == out.data_ptr() and n == out.numel() * 4 and word == 0xFF800000
    assert a.dims[1:6] == (1, 2, 384, 1, 1)
    assert torch.equal(kw["workspace"][: lse.numel() * 4].view(torch.float32).view(2, 64, 8), lse.transpose(1, 2))
    assert struct.pack("<f", scale * 1.4426950408889634) in a.params
    b = _params_of(env, fn, (*args[:5], 0.25), kw)
    diff = [i for i, (x, y) in enumerate(zip(a.params, b.params)) if x != y]
    assert len(diff) == 4 and b.params[diff[0]:diff[0] + 4] == struct.pack("<f", 0.25 * 1.4426950408889634)


@pytest.mark.parametrize("varlen", [False, True])
def test_sm100_dense_attention_reads_the_scale(sm100_env, varlen):
    stream = sm100_env.new_stream(0)
    fn, args, kw, _ = op_calls.dense_attn_score_recompute(0, stream, s_q=9, s_k=33, varlen=varlen)
    sm100_env.launches.clear()
    sm100_env.memsets.clear()
    launch = _params_of(sm100_env, fn, args, kw)
    assert len(sm100_env.memsets) == 1 and launch.dims[7] == stream
    assert struct.pack("<f", args[5]) in launch.params


def test_dense_attention_refusals(env, torch_steps):
    fn, args, kw, writes = op_calls.dense_attn_score_recompute(0, env.new_stream(0))
    out, den, q, k, lse, scale = args
    before = [stand_in.contents(t) for t in writes]
    env.launches.clear()
    with pytest.raises(InputError) as e:
        fn(out, den, q, k, stand_in.cuda_tensor(torch.zeros(lse.shape, dtype=torch.bfloat16)), -1.0, **kw)
    for want in ("lse: dtype torch.bfloat16", "softmax_scale=-1.0"):
        assert want in str(e.value), (want, str(e.value))
    q128 = stand_in.cuda_tensor(torch.zeros(2, 8, 64, 128, dtype=torch.bfloat16))
    with pytest.raises(InputError, match="D=128"):
        fn(out, den, q128, stand_in.cuda_tensor(torch.zeros(2, 40, 1, 128, dtype=torch.bfloat16)), lse, scale, **kw)
    with pytest.raises(KernelNotFoundError, match="ratio = 2"):
        fn(*args, **{**kw, "ratio": 2})
    assert not env.launches
    assert [stand_in.contents(t) for t in writes] == before


@pytest.mark.parametrize("dim, varlen", [(512, False), (512, True), (128, False)])  # the SM100 test build's mxfp8 kernels
def test_sm100_mxfp8_dense_attention_zeroes_then_launches_once_with_its_scales(sm100_env, torch_steps, dim, varlen):
    """The mxfp8 SM100 call: out zeroed (not -inf filled: the kernel accumulates into it), denom zeroed too where
    upstream zeroes it (D128 H64; not D512 H64), then one launch on the caller's stream of upstream's kernel (384
    threads; D128 H64: 640), every tensor (the scales and, THD, their padded offsets too) and the scale in the
    parameters; the allocating form and the plan launch the same."""
    import dsa_aot.dsa

    env = sm100_env
    stream = env.new_stream(0)
    fn, args, kw, _ = op_calls.dense_attn_score_recompute_mx(0, stream, s_q=9, s_k=33, varlen=varlen, dim=dim)
    out, den, q, k, lse, scale = args
    env.launches.clear()
    env.memsets.clear()
    fn(*args, **kw)
    (launch,) = env.launches
    zeroed = [(ptr, n, on, word) for ptr, n, on, _, word in env.memsets]
    want = [(out.data_ptr(), out.numel() * 4, stream, 0)] + ([(den.data_ptr(), den.numel() * 4, stream, 0)] if dim == 128 else [])
    assert zeroed == want
    assert launch.dims[3] == (640 if dim == 128 else 384) and launch.dims[7] == stream
    tensors = (out, den, q, k, lse) + tuple(v for v in kw.values() if isinstance(v, torch.Tensor))
    assert len(tensors) == (11 if varlen else 7)
    for t in tensors:
        assert _ptr_in(t, launch.params)
    assert struct.pack("<f", scale) in launch.params
    want = launch.params
    extra = {n: v for n, v in kw.items() if n != "stream"}
    env.launches.clear()
    r = dsa_aot.dsa.dense_attn_score_recompute(q, k, lse, scale, out=out, denom_out=den, stream=stream, **extra)
    assert r["out"] is out and r["denom"] is den
    assert [L.params for L in env.launches] == [want]
    plan = dsa_aot.dsa.DenseAttnScoreRecompute(out, den, q, k, lse, softmax_scale=scale, **extra)
    env.launches.clear()
    plan.execute(out, den, q, k, lse, stream=stream, **{n: v for n, v in kw.items() if n in type(plan)._tensors})
    assert [L.params for L in env.launches] == [want]


@pytest.mark.parametrize("varlen", [False, True])
def test_sm100_mxfp8_dense_attention_takes_upstreams_k_block_bucket(sm100_env, torch_steps, monkeypatch, varlen):
    """At D512 the call runs the 128-wide K block entry below 4096 keys (S_k in BSHD, max_seqlen_k in THD) and the
    256-wide one from 4096, as upstream's dispatch picks: S_k 4095 vs 4096 are two entries, two launches."""
    import dsa_aot.ops.dsa_score_recompute as op
    from dsa_aot.ops import declare

    real, keys = declare.launcher, []

    def recording(family, name, key, dev, hint=""):  # the declaration resolves every entry of a declared op
        keys.append((name, key["precision"], key["k_block"]))
        return real(family, name, key, dev, hint)

    monkeypatch.setattr(declare, "launcher", recording)
    stream = sm100_env.new_stream(0)
    for s_k, kb in ((4095, 128), (4096, 256), (40, 128), (5000, 256)):
        fn, args, kw, _ = op_calls.dense_attn_score_recompute_mx(0, stream, s_q=2, s_k=s_k, varlen=varlen)
        keys.clear()
        sm100_env.launches.clear()
        fn(*args, **kw)
        assert keys == [("dense_attention", "mxfp8", kb)] and len(sm100_env.launches) == 1, (s_k, keys)


def test_sm100_mxfp8_dense_attention_refusals(sm100_env, torch_steps):
    """Every malformed mxfp8 call names its problems and runs nothing: missing scales, D512 scales with the D128
    columns, THD without the scale-padded offsets, 32 q heads (upstream's D128 H32 does not compile), more than
    one KV head, D576, bf16 Q / K, mxfp4 (the indexer's only), scales with bf16, a heads count the build does
    not ship (the bucket to add)."""
    stream = sm100_env.new_stream(0)
    fn, args, kw, writes = op_calls.dense_attn_score_recompute_mx(0, stream)
    out, den, q, k, lse, scale = args
    before = [stand_in.contents(t) for t in writes]
    e4 = torch.float8_e4m3fn

    def raw(*shape, dtype=torch.float8_e8m0fnu):
        return stand_in.cuda_tensor(torch.zeros(shape, dtype=torch.uint8).view(dtype))

    thd = op_calls.dense_attn_score_recompute_mx(0, stream, varlen=True)
    h32 = op_calls.dense_attn_score_recompute_mx(0, stream, heads=32, dim=128)
    sm100_env.launches.clear()
    sm100_env.memsets.clear()
    cases = [
        (fn, args, dict(kw, k_scale=None), "requires q_scale and k_scale"),
        (fn, args, dict(kw, q_scale=raw(2, 512, 4)), "q_scale: shape (2, 512, 4) (expected (2, 512, 16))"),  # D512: 16 columns
        (thd[0], thd[1], dict(thd[2], cu_seqlens_q_scale_padded=None), "cu_seqlens_q_scale_padded: THD mxfp8 needs"),
        (h32[0], h32[1], h32[2], "one KV head and 64 or 128 q heads"),
        (fn, (out, den, q, raw(2, 40, 2, 512, dtype=e4), lse, scale), kw, "one KV head"),
        (fn, (out, den, raw(2, 8, 64, 576, dtype=e4), raw(2, 40, 1, 576, dtype=e4), lse, scale), kw, "D=576 (expected 128 or 512)"),
        (fn, (out, den, stand_in.cuda_tensor(torch.zeros(q.shape, dtype=torch.bfloat16)), k, lse, scale), kw, "q: dtype torch.bfloat16"),
        (fn, args, dict(kw, precision="mxfp4"), "precision='mxfp4' (expected one of 'bf16', 'mxfp8')"),
        (fn, args, dict(kw, precision="bf16"), "block scales go with precision='mxfp8'"),
    ]
    for f, a, k_, want in cases:
        with pytest.raises(InputError) as e:
            f(*a, **k_)
        assert want in str(e.value), (want, str(e.value))
    h128 = op_calls.dense_attn_score_recompute_mx(0, stream, heads=128)
    with pytest.raises(KernelNotFoundError, match="heads = 128"):  # the sm100 build ships H64: the bucket to add
        h128[0](*h128[1], **h128[2])
    assert not sm100_env.launches and not sm100_env.memsets
    assert [stand_in.contents(t) for t in writes] == before


@pytest.mark.parametrize("varlen", [False, True])
def test_sm90_refuses_the_mxfp8_dense_attention(env, torch_steps, monkeypatch, varlen):
    """Upstream's mxfp8 dense attention is SM100 only (NotImplementedError on SM90): an InputError saying so,
    before anything runs; a THD call's device cu_seqlens are not read back for it."""
    import dsa_aot.dsa
    import dsa_aot.ops.dsa_score_recompute as op

    def no_read_back(*a, **k):
        raise AssertionError("cu_seqlens read back for a call that is refused")

    monkeypatch.setattr(op, "_host_offsets", no_read_back)
    fn, args, kw, writes = op_calls.dense_attn_score_recompute_mx(0, env.new_stream(0), varlen=varlen)
    before = [stand_in.contents(t) for t in writes]
    env.launches.clear()
    env.memsets.clear()
    for call in (lambda: fn(*args, **kw),
                 lambda: dsa_aot.dsa.dense_attn_score_recompute(*args[2:], **{n: v for n, v in kw.items() if n != "max_seqlen_q"})):
        with pytest.raises(InputError) as e:
            call()
        assert "SM100 only" in str(e.value) and "THD on SM90 in a plan" not in str(e.value), str(e.value)
    assert not env.launches and not env.memsets
    assert [stand_in.contents(t) for t in writes] == before


# --- SM90 THD: upstream's per-segment host loop, from host segment bounds -----------------------------

# four segments: 8 queries over 40 keys, none over 5 (skipped), 5 over none (no key: denom written), 7 over 25
_CU_Q, _CU_K = [0, 8, 8, 13, 20], [0, 40, 45, 45, 70]
_SEGS = ((0, 8, 0, 40), (13, 7, 45, 25))  # (q_start, S_q, k_start, S_k) of the segments launched


def _thd_call(env, attention, cu_q=_CU_Q, cu_k=_CU_K, max_k=40):
    import dsa_aot.dsa

    h, d = 64, 512 if attention else 128
    q = stand_in.cuda_tensor(torch.randn(20, h, d).to(torch.bfloat16))
    k = stand_in.cuda_tensor(torch.randn(70, 1, d).to(torch.bfloat16))
    aux = stand_in.cuda_tensor(torch.randn(20, h).to(torch.float32 if attention else torch.bfloat16))
    out, den = stand_in.cuda_tensor(torch.full((20, max_k), 7.0)), stand_in.cuda_tensor(torch.full((20,), 7.0))
    sizer = dsa_aot.dsa.dense_attn_score_recompute_workspace_bytes if attention else dsa_aot.dsa.dense_indexer_score_recompute_workspace_bytes
    ws = stand_in.cuda_tensor(torch.randint(0, 255, (sizer(aux.shape, 0, cu_q, cu_k),), dtype=torch.uint8))
    fn = dsa_aot.dsa.dense_attn_score_recompute_into if attention else dsa_aot.dsa.dense_indexer_score_recompute_into
    args = (out, den, q, k, aux) + ((512**-0.5,) if attention else ())
    return fn, args, dict(ratio=4, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, workspace=ws, stream=env.new_stream(0))


@pytest.mark.parametrize("attention", [False, True])
@pytest.mark.parametrize("form", ["list", "cpu", "device"])
def test_sm90_thd_launches_once_per_segment_from_host_bounds(env, torch_steps, attention, form):
    """One BSHD launch (grid (.., 1, 1), 384 threads) per segment with queries and keys, at the segment's q /
    k rows, reading its weights / LSE transposed in its workspace region and writing its scores and
    denominators there; ``out`` filled with -inf, each scores region too, the no-key segment's ``denom``
    rows -inf (indexer) or 0 (attention); the regions copied into the packed outputs after the launches.
    The bounds as lists, CPU tensors, or device tensors read back: the same launches."""
    from dsa_aot.policy import dsa_score_recompute as pol

    def as_form(cu):
        t = torch.tensor(cu, dtype=torch.int32)
        return {"list": cu, "cpu": t, "device": stand_in.cuda_tensor(t)}[form]

    fn, args, kw = _thd_call(env, attention, as_form(_CU_Q), as_form(_CU_K))
    out, den, q, k, aux = args[:5]
    ws = kw["workspace"]
    h, d, eb = 64, q.shape[2], aux.element_size()
    regions, need = pol.thd_workspace(((0, 0, 8, 0, 40), (3, 13, 7, 45, 25)), h, eb)
    assert ws.numel() == need
    env.launches.clear()
    env.memsets.clear()
    fn(*args, **kw)
    assert len(env.launches) == 2
    base = ws.data_ptr()
    fills = {(ptr, n): word for ptr, n, _, _, word in env.memsets}
    assert fills.pop((out.data_ptr(), out.numel() * 4)) == 0xFF800000
    assert fills.pop((den.data_ptr() + 8 * 4, 5 * 4)) == (0 if attention else 0xFF800000), "the no-key rows' denominators"
    for launch, (qs, sq, ks, sk), (wo, oo, do) in zip(env.launches, _SEGS, regions):
        assert fills.pop((base + oo, sq * sk * 4)) == 0xFF800000, "the segment's scores region filled as a BSHD call's out"
        assert launch.dims[1:6] == (1, 1, 384, 1, 1)
        for ptr in (q.data_ptr() + qs * h * d * 2, k.data_ptr() + ks * d * 2, base + wo, base + oo, base + do):
            assert struct.pack("<Q", ptr) in launch.params
        got = ws[wo:wo + h * sq * eb].view(aux.dtype).view(h, sq)
        assert torch.equal(got, aux[qs:qs + sq].t()), "the segment's weights / LSE transposed"
        bits = torch.int32  # (the regions hold random bytes: NaNs compare by their bits)
        assert torch.equal(out[qs:qs + sq, :sk].view(bits), ws[oo:oo + sq * sk * 4].view(bits).view(sq, sk)), "scores copied back"
        assert torch.equal(den[qs:qs + sq].view(bits), ws[do:do + sq * 4].view(bits)), "denominators copied back"
    assert not fills
    for ptr in (out.data_ptr(), den.data_ptr()):
        assert all(struct.pack("<Q", ptr) not in launch.params for launch in env.launches), "the kernel writes the regions, not the outputs"
    if attention:
        assert all(struct.pack("<f", 512**-0.5 * 1.4426950408889634) in launch.params for launch in env.launches)


def test_sm90_thd_offsets_point_at_each_segments_entry(env, torch_steps):
    fn, args, kw = _thd_call(env, False)
    offs = stand_in.cuda_tensor(torch.tensor([0, 1, 2, 3], dtype=torch.int32))
    env.launches.clear()
    fn(*args, **kw, q_causal_offsets=offs)
    for launch, b in zip(env.launches, (0, 3)):
        assert struct.pack("<Q", offs.data_ptr() + 4 * b) in launch.params


def test_sm90_thd_allocating_form_takes_the_maxima_from_the_host_bounds(env, torch_steps):
    """No max_seqlen given and device bounds: read back once (upstream's sync), the maxima from them, the
    caller's buffers used (allocation is the GPU tests')."""
    import dsa_aot.dsa

    fn, args, kw = _thd_call(env, False)
    out, den, q, k, w = args
    env.launches.clear()
    cu = [stand_in.cuda_tensor(torch.tensor(c, dtype=torch.int32)) for c in (_CU_Q, _CU_K)]
    r = dsa_aot.dsa.dense_indexer_score_recompute(q, k, w, out=out, denom_out=den, ratio=4, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1],
                                              stream=kw["stream"], workspace=kw["workspace"])
    assert r["out"] is out and r["denom"] is den
    assert len(env.launches) == 2


def test_sm90_thd_refusals(env, torch_steps, monkeypatch):
    fn, args, kw = _thd_call(env, False)
    writes = (args[0], args[1], kw["workspace"])
    before = [stand_in.contents(t) for t in writes]
    env.launches.clear()
    env.memsets.clear()
    cases = [
        (dict(cu_seqlens_q=[0, 8, 4, 13, 20]), "cu_seqlens_q = \\[0, 8, 4"),
        (dict(cu_seqlens_k=[0, 40, 45, 45, 71]), "at most 70"),
        (dict(cu_seqlens_k=[0, 40, 45]), "the same number"),
        (dict(max_seqlen_k=30), "max_seqlen_k=30: expected an integer from 40"),
        (dict(cu_seqlens_q=[0.0, 8.0, 8.0, 13.0, 20.0]), "cu_seqlens_q: list"),
        (dict(workspace=stand_in.cuda_tensor(torch.zeros(64, dtype=torch.uint8))), "workspace: 64 bytes"),
    ]
    for over, want in cases:
        with pytest.raises(InputError, match=want):
            fn(*args, **{**kw, **over})
    with pytest.raises(InputError, match="weights: on cpu"):  # a CPU input with host bounds: refused, not a bare AttributeError
        fn(*args[:4], torch.zeros(args[4].shape, dtype=args[4].dtype), **kw)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    dev_cu = {n: stand_in.cuda_tensor(torch.tensor(kw[n], dtype=torch.int32)) for n in ("cu_seqlens_q", "cu_seqlens_k")}
    with pytest.raises(InputError, match="under CUDA-graph capture.*CPU tensors or lists"):
        fn(*args, **{**kw, **dev_cu})
    assert not env.launches and not env.memsets
    assert [stand_in.contents(t) for t in writes] == before, "a refused call writes nothing"
    fn(*args, **kw)  # host bounds: nothing to read back, capture-safe
    assert len(env.launches) == 2


@pytest.mark.parametrize("attention", [False, True])
def test_queries_over_no_key_get_the_denominator_of_no_key(env, torch_steps, attention):
    """S_k 0 launches nothing; each row's ``denom`` is what the kernel writes for a row that sees no key (the LSE
    of none, -inf; the sum of none, 0), not the caller's old bytes. SM90 THD whose segments have no key: the
    same for their rows only (the rows past the last segment are no segment's, as upstream leaves them)."""
    word = 0 if attention else 0xFF800000
    stream = env.new_stream(0)
    fn, args, kw, _ = (op_calls.dense_attn_score_recompute if attention else op_calls.dense_indexer_score_recompute)(0, stream, s_q=8, s_k=0)
    env.launches.clear()
    env.memsets.clear()
    fn(*args, **kw)
    den = args[1]
    assert not env.launches and [(m[0], m[1], m[4]) for m in env.memsets] == [(den.data_ptr(), den.numel() * 4, word)]
    fn, args, kw = _thd_call(env, attention, [0, 8, 13, 15], [0, 0, 0, 0], max_k=0)
    env.launches.clear()
    env.memsets.clear()
    fn(*args, **kw)
    den = args[1]
    assert not env.launches
    got = sorted((m[0], m[1], m[4]) for m in env.memsets if m[0] != args[0].data_ptr())
    assert got == [(den.data_ptr(), 8 * 4, word), (den.data_ptr() + 32, 5 * 4, word), (den.data_ptr() + 52, 2 * 4, word)]
