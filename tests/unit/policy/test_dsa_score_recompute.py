"""aot.policy.dsa_score_recompute: the sparse indexer's calls land on shipped entries on both arches; the
SM100 stage sizing and the SM90 tiles are upstream's (checked against cudnn's own functions where it
has them; the stage sizing is proved per entry by fidelity)."""

from pathlib import Path

import pytest

from aot.policy import dsa_score_recompute as policy
from aot.toolchain import manifest

ROOT = Path(__file__).resolve().parents[3]


def test_sparse_indexer_calls_land_on_shipped_entries():
    m = manifest.load(ROOT / "manifests" / "default.toml")
    have = {(e.target.arch, e.op, e.key) for e in m.entries if e.family == policy.FAMILY}
    for arch in ("sm_90a", "sm_100a"):
        for topk in (512, 1024, 2048):
            for length in (False, True):
                for glob in (False, True):
                    op, key = policy.kernels(arch, 64, topk, length, glob)["main"]
                    assert (arch, op, tuple(sorted(key.items()))) in have, (arch, op, key)


def test_stages_and_tiles():
    assert policy.sm100_stages(64, 512) == (4, True)
    stage, in_smem = policy.sm100_stages(64, 2048)
    assert 1 <= stage <= 4 and in_smem in (True, False)
    assert policy.sm90_tiles(64) == (64, 1) and policy.sm90_tiles(128) == (64, 2) and policy.sm90_tiles(32) == (32, 1)
    assert policy.workspace_bytes("sm_100a", 2, 64, 64) == 0 and policy.workspace_bytes("sm_90a", 2, 64, 64) == 2 * 64 * 64 * 2


def test_sm90_tiles_are_upstreams():
    h = pytest.importorskip("cudnn.deepseek_sparse_attention.score_recompute._interface_sm90")
    for heads in (2, 16, 32, 64, 128, 256):
        assert h._compute_tile_m(heads) == policy.sm90_tiles(heads), heads
