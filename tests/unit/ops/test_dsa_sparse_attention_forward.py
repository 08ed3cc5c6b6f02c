"""dsa_aot.ops.dsa_sparse_attention_forward without a GPU (and without SM100: upstream has no SM90 kernel):
the refusal on another arch, input checks, and the SM100 call convention against real lifted host
functions (ci/check_sm100_calls.py runs the same check over every shipped entry at wheel build)."""

import json
import sys
from pathlib import Path

import pytest
import torch

import stand_in
from dsa_aot.errors import InputError

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data" / "sparse_forward_sm100"


def test_an_sm90_device_is_refused_before_anything_runs(env):
    import dsa_aot.dsa

    q = stand_in.cuda_tensor(torch.zeros(4, 64, 512, dtype=torch.bfloat16))
    kv = stand_in.cuda_tensor(torch.zeros(100, 512, dtype=torch.bfloat16))
    idx = stand_in.cuda_tensor(torch.zeros(4, 64, dtype=torch.int32))
    env.launches.clear()
    env.memsets.clear()
    for fn in (dsa_aot.dsa.sparse_attention_forward, lambda *a, **k: dsa_aot.dsa.sparse_attention_forward_into(None, None, None, None, *a, **k)):
        with pytest.raises(InputError, match="SM100 only"):
            fn(q, kv, idx)
    assert not env.launches and not env.memsets


def test_bad_inputs_are_named():
    import dsa_aot.dsa

    with pytest.raises(InputError) as e:
        dsa_aot.dsa.sparse_attention_forward(torch.zeros(4, 64, 512, dtype=torch.float32), torch.zeros(3), torch.zeros(4, 64))
    assert "q: dtype torch.float32 (expected torch.bfloat16 or torch.float16)" in str(e.value)
    with pytest.raises(InputError, match="on cpu"):
        dsa_aot.dsa.sparse_attention_forward(torch.zeros(4, 64, 512, dtype=torch.bfloat16), torch.zeros(3), torch.zeros(4, 64))


@pytest.fixture(scope="module")
def chk():
    sys.path.insert(0, str(ROOT / "ci"))
    import check_sm100_calls

    return check_sm100_calls


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.iterdir()))
def test_sm100_call_feeds_the_lifted_host_function(name, chk):
    from dsa_aot.toolchain import verify

    d = DATA / name
    key = json.loads((d / "meta.json").read_text())["key"]
    ns = verify.load_launcher((d / "launcher.py").read_text(), name)
    for s_q, s_kv, k in ((8, 4096, 2048), (1000, 70000, 2112), (1, 64, 1024)):
        if k >= key["indexer_topk"]:
            assert chk.check_sparse_forward(ns, key, s_q, s_kv, k) == []
    # a call convention that passes kv where q belongs is caught
    import dsa_aot.ops.dsa_sparse_attention_forward as op_mod

    real = op_mod._record

    def swapped(rec, le, ts):
        ts = list(ts)
        ts[4], ts[5] = ts[5], ts[4]
        return real(rec, le, ts)

    op_mod._record = swapped
    try:
        assert chk.check_sparse_forward(ns, key, 8, 4096, 2048) != []
    finally:
        op_mod._record = real


def test_sm100_call_runs_the_lifted_host_function(sm100_env):
    """On an SM100 device (stand-in): index rows of a multiple of 64 slots, one launch through the real
    lifted host function (a CTA per query, the caller's stream, the scale a kernel parameter); an empty
    problem gets upstream's fills (out 0, max_logits -inf, lse and lse_indexer +inf) and no launch."""
    import struct

    import dsa_aot.dsa

    env = sm100_env
    stream = env.new_stream(0)
    s_q, s_kv, k = 8, 300, 512

    def t(shape, dtype=torch.float32):
        return stand_in.cuda_tensor(torch.zeros(shape, dtype=dtype))

    q, kv, sink = t((s_q, 64, 512), torch.bfloat16), t((s_kv, 512), torch.bfloat16), t((64,))
    out, ml, lse, li = t((s_q, 64, 512), torch.bfloat16), t((s_q, 64)), t((s_q, 64)), t((s_q, 64))
    env.launches.clear()
    env.memsets.clear()
    with pytest.raises(InputError, match="pad the rows with -1 to 512"):
        dsa_aot.dsa.sparse_attention_forward_into(out, ml, lse, li, q, kv, t((s_q, 500), torch.int32), attn_sink=sink, indexer_topk=512, stream=stream)
    with pytest.raises(InputError, match="softmax_scale"):
        dsa_aot.dsa.sparse_attention_forward_into(out, ml, lse, li, q, kv, t((s_q, k), torch.int32), attn_sink=sink, indexer_topk=512, softmax_scale=-1.0, stream=stream)
    assert not env.launches and not env.memsets
    dsa_aot.dsa.sparse_attention_forward_into(out, ml, lse, li, q, kv, t((s_q, k), torch.int32), attn_sink=sink, indexer_topk=512, softmax_scale=0.05,
                                          stream=stream)
    (launch,) = env.launches
    assert launch.dims[:3] == (s_q, 1, 1) and launch.dims[7] == stream and struct.pack("<f", 0.05) in launch.params
    assert not env.memsets
    env.launches.clear()
    dsa_aot.dsa.sparse_attention_forward_into(out, ml, lse, li, q, t((0, 512), torch.bfloat16), t((s_q, k), torch.int32), attn_sink=sink,
                                          indexer_topk=512, stream=stream)
    assert not env.launches
    assert [(m[1], m[4]) for m in env.memsets] == [(out.numel() * 2, 0), (ml.numel() * 4, 0xFF800000), (lse.numel() * 4, 0x7F800000),
                                                    (li.numel() * 4, 0x7F800000)]
