"""dsa_aot.policy.dsa_score_recompute: the sparse indexer's calls land on shipped entries on both arches; the
SM100 stage sizing and the SM90 tiles are upstream's (checked against cudnn's own functions where it
has them; the stage sizing is proved per entry by fidelity)."""

from pathlib import Path

import pytest

from dsa_aot.policy import dsa_score_recompute as policy
from dsa_aot.toolchain import manifest

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


def test_dense_attention_calls_land_on_shipped_entries_in_upstreams_k_block_bucket():
    """Every SM100 dense attention call the manifest covers lands on a shipped entry, the mxfp8 D512 ones in
    upstream's S_k bucket (k_block 128 below S_k 4096, 256 from it) and the bf16 / D128 ones on one K block
    whatever S_k; the dispatch and stage rules equal upstream's own, and the keys upstream refuses (or fails
    to compile) are refused."""
    m = manifest.load(ROOT / "manifests" / "default.toml")
    have = {(e.op, e.key) for e in m.entries if e.family == policy.FAMILY and e.target.arch == "sm_100a"}
    cases = [("bf16", d, h) for d in (512, 576) for h in (64, 128)] + [("mxfp8", 512, h) for h in (64, 128)] + [("mxfp8", 128, 64)]
    for prec, d, h in cases:
        for s_k, long in ((1, False), (4095, False), (4096, True), (1 << 20, True)):
            op, key = policy.dense_attention_kernels("sm_100a", h, d, 4, True, False, prec, s_k)["main"]
            assert (op, tuple(sorted(key.items()))) in have, key
            assert key["k_block"] == (256 if long else 128) if (prec, d) == ("mxfp8", 512) else key["k_block"] in (64, 128), key
    with pytest.raises(ValueError, match="SM100 only"):
        policy.dense_attention_kernels("sm_90a", 64, 512, 4, False, False, "mxfp8", 64)
    check = policy.OPS["dense_attention"].invalid
    base = dict(precision="mxfp8", heads=64, dim=512, k_block=128, ratio=1, varlen=False, offsets=False)
    assert check(base) is None and check(dict(base, k_block=256)) is None
    for bad in (dict(heads=32, dim=128, k_block=64), dict(heads=32), dict(dim=576, k_block=64), dict(k_block=64), dict(dim=128, k_block=128),
                dict(precision="bf16", k_block=256), dict(precision="bf16", dim=128, k_block=64)):
        assert check(dict(base, **bad)), bad
    i = pytest.importorskip("cudnn.deepseek_sparse_attention.score_recompute._interface_sm100")
    for d, h in ((512, 64), (512, 128), (128, 64)):
        for s_k in (4095, 4096):
            kb = policy.dense_attention_k_block("mxfp8", d, h, s_k)
            assert tuple(i._dispatch_dense_attn_tile_params(d, h, precision="mxfp8", seqlen_k_hint=s_k)) == policy.mx_attention_tiles(d, h, kb)[:3]
