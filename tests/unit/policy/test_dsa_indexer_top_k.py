"""dsa_aot.policy.dsa_indexer_top_k: the dispatch lands on entries the default manifest ships, and the
scratch size and row chunks are upstream's (CPU; the upstream half where cudnn is installed)."""

from pathlib import Path

import pytest

from dsa_aot.policy import dsa_indexer_top_k as policy
from dsa_aot.toolchain import manifest

ROOT = Path(__file__).resolve().parents[3]


def test_decode_and_prefill_calls_land_on_shipped_entries_on_both_arches():
    m = manifest.load(ROOT / "manifests" / "default.toml")
    have = {(e.target.arch, e.op, e.key) for e in m.entries if e.family == policy.FAMILY}
    calls = []
    for num_cols in (1, 100, 1000, 4096, 4097, 60000, 65536, 131072):
        for n_rows in (1, 64, 148, 149, 4096):
            calls.append(("float32", num_cols, 2048, 1, True, 0, False, n_rows))
            calls.append(("float32", num_cols, 2048, 1, False, 0, True, n_rows))
            calls.append(("bfloat16", num_cols, 2048, 1, True, 0, False, n_rows))
            calls.append(("float32", num_cols, 512, 1, True, 0, False, n_rows))
            calls.append(("float32", num_cols, 2048, 2, True, 0, False, n_rows * 2))
            calls.append(("float32", num_cols, 2048, 1, True, 2, False, n_rows))
    for arch in ("sm_90a", "sm_100a"):
        for c in calls:
            op, key = policy.top_k_kernel(*c)
            shipped = (arch, op, tuple(sorted(key.items()))) in have
            # every bucket for fp32 top-k 2048 (decode at any context length); the variants from 4K columns
            assert shipped == (c[1] > 2048 or c in calls[::6] or c in calls[1::6]), (arch, c, key)
    assert policy.top_k_kernel("float32", 100, 2048, 1, True, 0, False, 149)[1]["large"] is True  # n_rows > 148, whatever the GPU


def test_bucket_ordering_and_chunks_by_hand():
    assert [policy.bucket(n) for n in (0, 1, 2, 3, 4096, 4097)] == [1, 1, 2, 4, 4096, 8192]
    key = {"dtype": "float32", "cols": 131072, "top_k": 2048, "large": True, "deterministic": True}
    assert policy.ordering((10, 0), key) == "bitmap" and policy.ordering((9, 0), key) == "bitmap"
    assert policy.ordering((10, 0), dict(key, cols=262144)) == "bitonic" and policy.ordering((9, 0), dict(key, cols=262144)) == "bitmap"
    assert policy.ordering((10, 0), dict(key, top_k=128)) == "bitonic"  # SM100's table: no bitmap below top-k 256
    assert policy.ordering((9, 0), dict(key, deterministic=False)) == "auto"
    assert policy.workspace_bytes(3, 100, "float32") == 2432 and policy.workspace_bytes(3, 100, "bfloat16") == 1280  # 2400, 1200 rounded to 128
    assert policy.row_chunks(16384, 65536, "float32", 1, 4) == [(0, 16384)]
    assert policy.row_chunks(16392, 65536, "float32", 1, 4) == [(0, 16384), (16384, 16392)]
    assert policy.row_chunks(40000, 65536, "float32", 3, 4) == [(0, 16368), (16368, 32736), (32736, 40000)]  # lcm(3, 8) = 24 rows a step
    assert isinstance(policy.row_chunks(8, 1 << 28, "float32", 1, 4), str)


def test_scratch_size_is_upstreams():
    pytest.importorskip("cudnn")
    pytest.importorskip("cutlass")
    import torch
    from cudnn.api_base import ws_align

    from cudnn.deepseek_sparse_attention.indexer_top_k import indexer_top_k_decode_varlen as m

    for n_rows, num_cols, dt, name in ((7, 4097, torch.float32, "float32"), (300, 65536, torch.bfloat16, "bfloat16"), (1, 1, torch.float16, "float16")):
        assert policy.workspace_bytes(n_rows, num_cols, name) == ws_align(n_rows * m.buffer_numbers(dt) * num_cols * 4)
