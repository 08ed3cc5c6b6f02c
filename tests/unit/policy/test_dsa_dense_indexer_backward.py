"""dsa_aot.policy.dsa_dense_indexer_backward: DeepSeek-style warm-up calls land on shipped entries on both
arches, each GEMM entry ships with the score-grad it needs, and the workspace is cudnn's."""

from pathlib import Path

from dsa_aot.policy import dsa_dense_indexer_backward as policy
from dsa_aot.toolchain import manifest

ROOT = Path(__file__).resolve().parents[3]


def test_warm_up_calls_land_on_shipped_entries_on_both_arches():
    m = manifest.load(ROOT / "manifests" / "default.toml")
    have = {(e.target.arch, e.op, e.key) for e in m.entries if e.family == policy.FAMILY}
    for arch in ("sm_90a", "sm_100a"):
        for ratio in (1, 4):
            for varlen in (False, True):
                for offsets in (False, True):
                    ks = policy.kernels(arch, 64, varlen, ratio, offsets)
                    assert set(ks) == {"score_grad", "gemm"}
                    for op, key in ks.values():
                        assert (arch, op, tuple(sorted(key.items()))) in have, (arch, op, key)
                        assert op.endswith("_sm90") == (arch == "sm_90a")
                    gemm_op, gemm_key = ks["gemm"]
                    assert policy.OPS[gemm_op].requires(gemm_key) == [ks["score_grad"]]


def test_a_ratio_outside_the_build_is_a_key_the_manifest_lacks():
    m = manifest.load(ROOT / "manifests" / "default.toml")
    keys = {e.key for e in m.entries if e.family == policy.FAMILY}
    op, key = policy.kernels("sm_90a", 64, False, 3, False)["gemm"]
    assert tuple(sorted(key.items())) not in keys


def test_workspace_is_the_fp32_dk_rounded_to_128_bytes():
    assert policy.workspace_bytes(1, False) == 128
    assert policy.workspace_bytes(32, False) == 128 and policy.workspace_bytes(33, False) == 256
    assert policy.workspace_bytes(4096 * 128, True) == 0
