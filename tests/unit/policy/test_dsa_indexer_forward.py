"""dsa_aot.policy.dsa_indexer_forward: over a grid of shapes the SM90 dispatch is upstream's own (its
``_interface_sm90.indexer_fwd`` run on the CPU with CUDA-presenting tensors, the compile key it asks
its cache for recorded, nothing compiled), and DeepSeek-style calls land on shipped entries."""

from pathlib import Path

import pytest

from dsa_aot.policy import dsa_indexer_forward as policy
from dsa_aot.toolchain import manifest

ROOT = Path(__file__).resolve().parents[3]


def test_deepseek_calls_land_on_shipped_sm90_entries():
    m = manifest.load(ROOT / "manifests" / "default.toml")
    have = {(e.op, e.key) for e in m.entries if e.family == policy.FAMILY and e.target.arch == "sm_90a"}
    for precision in ("bf16", "fp8"):
        for w in ("bfloat16", "float32"):
            for ratio in (1, 4):
                for varlen in (False, True):
                    for offsets in (False, True):
                        for lse in (False, True):
                            for s_q, s_k in ((1, 1), (255, 63), (256, 63), (4096, 1024)):
                                op, key = policy.sm90_kernel(precision, w, 64, ratio, varlen, offsets, lse, s_q, s_k)
                                assert (op, tuple(sorted(key.items()))) in have, key
    assert policy.sm90_kernel("fp8", "bfloat16", 64, 4, False, False, False, 256, 128)[1]["masked"] is True
    assert policy.sm90_kernel("fp8", "bfloat16", 32, 4, False, False, False, 256, 128)[1]["unchecked"] is False


def test_sm90_dispatch_is_upstreams_over_a_grid():
    pytest.importorskip("cudnn")
    pytest.importorskip("cutlass")
    import contextlib

    import torch

    from dsa_aot.toolchain.fidelity import Upstream
    from cudnn.deepseek_sparse_attention.indexer_forward import _interface, _interface_sm90, api
    from cudnn.deepseek_sparse_attention.utils import compiler, runtime

    asked = []
    with Upstream("sm_90a", 132) as up:
        up.clear_lru(compiler.gpu_arch_flag, runtime._device_capability)
        for mod in (_interface, _interface_sm90):
            up.patch(mod, "_torch_stream_context", lambda *a, **k: contextlib.nullcontext())
        T = up.tensor
        real_empty, like = torch.empty, type(T(torch.int32, 1))
        up.patch(torch, "empty", lambda *shape, dtype=None, device=None, **k: like(real_empty(*shape, dtype=dtype)))
        up.cache(_interface_sm90, "_compile_cache", keep=lambda key: (asked.append(key), False)[1])
        n = 0
        for precision, heads in (("bf16", 64), ("bf16", 16), ("fp8", 64), ("fp8", 32)):
            fp8 = precision == "fp8"
            qdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
            for varlen in (False, True):
                for s_q, s_k in ((1, 1), (2, 64), (3, 64), (255, 128), (256, 127), (256, 128), (64, 4096)):
                    for wdt in (torch.bfloat16, torch.float32):
                        kw = {}
                        if varlen:
                            q, k, w = T(qdt, 2 * s_q, heads, 128), T(qdt, 2 * s_k, 1, 128), T(wdt, 2 * s_q, heads)
                            kw.update(cu_seqlens_q=T(torch.int32, 3), cu_seqlens_k=T(torch.int32, 3), max_seqlen_q=s_q, max_seqlen_k=s_k)
                        else:
                            q, k, w = T(qdt, 2, s_q, heads, 128), T(qdt, 2, s_k, 1, 128), T(wdt, 2, s_q, heads)
                        if fp8:
                            kw.update(precision="fp8", q_scale=T(torch.float32, *q.shape[:-1]), k_scale=T(torch.float32, *k.shape[:-1]))
                        asked.clear()
                        api.indexer_forward_wrapper(q, k, w, ratio=4, stream=up.stream, return_lse=s_q == 3, **kw)
                        key = asked[0]
                        assert all(a == key for a in asked)
                        op, mine = policy.sm90_kernel(precision, str(wdt).removeprefix("torch."), heads, 4, varlen, False, s_q == 3, s_q, s_k)
                        assert (key[0], key[1], key[3], key[4], key[5], key[6], key[7], key[8], key[14]) == (
                            qdt, wdt, mine["heads"], mine["ratio"], mine["varlen"], mine["unchecked"], mine["masked"], mine["lse"], mine["offsets"])
                        n += 1
    assert n == 112
