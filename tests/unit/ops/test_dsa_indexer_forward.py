"""dsa_aot.ops.dsa_indexer_forward without a GPU: what a call records (the -inf fill, then one launch), the
refusals, and the SM100 call convention against real lifted host functions (no SM100 GPU runs it
here; ci/check_sm100_calls.py runs the same check over every shipped SM100 entry at wheel build)."""

import json
import struct
import sys
from pathlib import Path

import pytest
import torch

import op_calls
import stand_in
from dsa_aot.errors import InputError, KernelNotFoundError

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data" / "indexer_forward_sm100"


def test_a_call_fills_the_scores_with_minus_inf_then_launches_once(env):
    fn, args, kw, writes = op_calls.indexer_forward(0, env.new_stream(0))
    env.launches.clear()
    env.memsets.clear()
    fn(*args, **kw)
    scores = args[0]
    assert [(m[0], m[1], m[4]) for m in env.memsets] == [(scores.data_ptr(), scores.numel() * 4, 0xFF800000)]
    assert len(env.launches) == 1 and env.launches[0].dims[7] == kw["stream"]
    blob = env.launches[0].params
    for t in (args[0], args[1], args[4]):  # scores, lse, w: plain pointer parameters (q and k sit in TMA descriptors)
        assert struct.pack("<Q", t.data_ptr()) in blob


def test_empty_calls_launch_nothing(env):
    fn, args, kw, _ = op_calls.indexer_forward(0, env.new_stream(0), s_k=0)
    env.launches.clear()
    env.memsets.clear()
    fn(*args, **kw)
    assert not env.launches and [(m[1], m[4]) for m in env.memsets] == [(args[1].numel() * 4, 0xFF800000)]  # the LSE rows: -inf, no key


def test_refusals_name_every_problem_before_anything_runs(env):
    import dsa_aot.dsa

    fn, args, kw, writes = op_calls.indexer_forward(0, env.new_stream(0))
    scores, lse, q, k, w = args
    env.launches.clear()
    env.memsets.clear()
    cases = [
        (dict(ratio=0), "ratio=0"),
        (dict(precision="mxfp8"), "SM100 only"),
        (dict(precision="fp4"), "unknown"),
        (dict(precision="fp8"), "requires q_scale and k_scale"),
        (dict(sm_scale=float("inf")), "sm_scale"),
        (dict(q_causal_offsets=stand_in.cuda_tensor(torch.zeros(5, dtype=torch.int32))), "q_causal_offsets: shape (5,)"),
        (dict(max_seqlen_q=8), "only with cu_seqlens"),
        (dict(ratio=3), None),  # KernelNotFoundError: a ratio the build does not ship
    ]
    for extra, want in cases:
        with pytest.raises(InputError if want else KernelNotFoundError) as e:
            fn(*args, **dict(kw, **extra))
        assert want is None or want in str(e.value), (extra, str(e.value))
    with pytest.raises(InputError, match="heads"):
        fn(scores, lse, stand_in.cuda_tensor(torch.zeros(2, 8, 48, 128, dtype=torch.bfloat16)), k, stand_in.cuda_tensor(torch.zeros(2, 8, 48)), **kw)
    with pytest.raises(InputError, match="scores: shape"):
        fn(stand_in.cuda_tensor(torch.zeros(2, 8, 41)), lse, q, k, w, **kw)
    with pytest.raises(InputError, match="overlaps"):
        fn(scores, scores.view(-1)[: lse.numel()].view(lse.shape), q, k, w, **kw)
    with pytest.raises(InputError, match="m_block_size"):
        dsa_aot.dsa.indexer_forward(q, k, w, m_block_size=64)
    with pytest.raises(InputError, match="SM90 only|SM100"):
        dsa_aot.dsa.indexer_forward(q, k, w, cu_seqlens_q_scale_padded=stand_in.cuda_tensor(torch.zeros(3, dtype=torch.int32)))
    assert not env.launches and not env.memsets


def test_the_padded_scores_buffer_is_taken_and_filled_whole(env):
    fn, args, kw, _ = op_calls.indexer_forward(0, env.new_stream(0), s_k=37)
    padded = stand_in.cuda_tensor(torch.zeros(2, 8, 40))
    env.launches.clear()
    env.memsets.clear()
    fn(padded, *args[1:], **kw)
    assert env.memsets[0][:2] == (padded.data_ptr(), padded.numel() * 4) and len(env.launches) == 1
    assert struct.pack("<qq", 8 * 40, 40) in env.launches[0].params or struct.pack("<Q", padded.data_ptr()) in env.launches[0].params


@pytest.fixture(scope="module")
def chk():
    sys.path.insert(0, str(ROOT / "ci"))
    import check_sm100_calls

    return check_sm100_calls


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.iterdir()))
def test_sm100_call_feeds_the_lifted_host_function(name, chk):
    from dsa_aot.toolchain import verify

    d = DATA / name
    meta = json.loads((d / "meta.json").read_text())
    ns = verify.load_launcher((d / "launcher.py").read_text(), name)
    key = {k: meta["key"][k] for k in ("precision", "w_dtype", "heads", "ratio", "varlen", "offsets")}
    for s_q, s_k in ((252, 63), (1, 4096), (4096, 1024)):
        assert chk.check_indexer_forward(ns, key, s_q, s_k) == []
    # a call convention that drops the scale (or passes q where k belongs) is caught
    import dsa_aot.ops.dsa_indexer_forward as op_mod

    real = op_mod._record

    def swapped(rec, c, op, le, ts):
        ts = list(ts)
        ts[2], ts[3] = ts[3], ts[2]
        return real(rec, c, op, le, ts)

    op_mod._record = swapped
    try:
        assert chk.check_indexer_forward(ns, key, 252, 63) != []
    finally:
        op_mod._record = real


def test_sm100_takes_the_padded_scores_buffer_and_launches_the_lifted_host_function(sm100_env):
    """On an SM100 device (stand-in, capability 10.0): a (B, S_q, S_k) scores buffer with S_k % 4 != 0
    is refused with the padded shape to use; the padded buffer is filled with -inf whole and bound with
    its 16-byte row stride; the launch goes through the real lifted host function (upstream's grid)."""
    import dsa_aot.dsa

    env = sm100_env
    st = env.new_stream(0)
    b, s_q, s_k, h = 2, 20, 37, 64
    q, k = stand_in.cuda_tensor(torch.zeros(b, s_q, h, 128, dtype=torch.bfloat16)), stand_in.cuda_tensor(torch.zeros(b, s_k, 1, 128, dtype=torch.bfloat16))
    w = stand_in.cuda_tensor(torch.zeros(b, s_q, h, dtype=torch.bfloat16))
    env.launches.clear()
    env.memsets.clear()
    with pytest.raises(InputError, match=r"pass a \(2, 20, 40\) fp32 buffer"):
        dsa_aot.dsa.indexer_forward_into(stand_in.cuda_tensor(torch.zeros(b, s_q, s_k)), None, q, k, w, ratio=4, stream=st)
    with pytest.raises(InputError, match="SM90 only"):
        dsa_aot.dsa.indexer_forward_into(stand_in.cuda_tensor(torch.zeros(b, s_q, 40)), stand_in.cuda_tensor(torch.zeros(b, s_q)), q, k, w, ratio=4, stream=st)
    with pytest.raises(InputError, match="S_k \\* ratio"):  # SM100's geometry rule: S_q <= S_k * ratio + ratio - 1
        dsa_aot.dsa.indexer_forward_into(stand_in.cuda_tensor(torch.zeros(b, 200, 4)), None, stand_in.cuda_tensor(torch.zeros(b, 200, h, 128, dtype=torch.bfloat16)),
                                     stand_in.cuda_tensor(torch.zeros(b, 2, 1, 128, dtype=torch.bfloat16)), stand_in.cuda_tensor(torch.zeros(b, 200, h, dtype=torch.bfloat16)), stream=st)
    assert not env.launches and not env.memsets
    scores = stand_in.cuda_tensor(torch.zeros(b, s_q, 40))
    dsa_aot.dsa.indexer_forward_into(scores, None, q, k, w, ratio=4, sm_scale=0.25, stream=st)
    assert [(m[0], m[1], m[4]) for m in env.memsets] == [(scores.data_ptr(), scores.numel() * 4, 0xFF800000)]
    (launch,) = env.launches
    assert launch.dims[:3] == (-(-s_q * h // 128), 1, b)  # upstream's CLC grid: the whole problem
    assert launch.dims[3] == 256 and struct.pack("<Q", w.data_ptr()) in launch.params and struct.pack("<f", 0.25) in launch.params
