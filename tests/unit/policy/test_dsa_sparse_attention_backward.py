"""dsa_aot.policy.dsa_sparse_attention_backward: workspace sizes equal upstream's, and the dispatch lands on
entries the default manifest ships."""

from pathlib import Path

import pytest

from dsa_aot.policy import dsa_sparse_attention_backward as policy
from dsa_aot.toolchain import manifest

ROOT = Path(__file__).resolve().parents[3]
SHAPES_SM100 = ((1, 4096), (20, 4096), (100, 2048), (100, 1 << 17), (2048, 2048), (2048, 1 << 18), (4096, 8192), (8192, 65536), (4096, 1 << 20),
                (65536, 131072), (131072, 131072))


def _shipped(arch):
    m = manifest.load(ROOT / "manifests" / "default.toml")
    return {(e.op, e.key) for e in m.entries if e.family == policy.FAMILY and e.target.arch == arch}


def test_sm90_workspace_matches_upstream_and_dispatch_is_shipped():
    iface = pytest.importorskip("cudnn.deepseek_sparse_attention.sparse_attention_backward._interface_sm90")
    for s_q, s_kv, d, h in ((1, 1, 512, 64), (77, 1500, 576, 64), (2048, 2048, 512, 128), (4097, 65, 576, 128)):
        assert policy.workspace_bytes(s_q, s_kv, d, h, arch="sm_90a") == iface.flash_attn_bwd_sm90_workspace_size(s_q, s_kv, d, h)
    have = _shipped("sm_90a")
    for h in (64, 128):
        for d in (512, 576):
            for topk in (512, 1024, 2048):
                for tl in (False, True):
                    for role, (op, key) in policy.kernels("sm_90a", h, d, topk, has_topk_length=tl).items():
                        assert (op, tuple(sorted(key.items()))) in have, (h, d, topk, tl, role)


def test_sm100_workspace_matches_upstream():
    torch = pytest.importorskip("torch")
    iface = pytest.importorskip("cudnn.deepseek_sparse_attention.sparse_attention_backward._interface_sm100")
    common = pytest.importorskip("cudnn.deepseek_sparse_attention.sparse_attention_backward._interface_sm100_common")
    for s_q, s_kv in SHAPES_SM100:
        for h, d, topk in ((64, 512, 512), (64, 576, 2048), (128, 512, 1024), (128, 576, 512), (128, 576, 640), (16, 576, 512)):
            for det in (False, True):
                backend, _ = iface._select_sm100_backend(h, d, head_dim_v=512, dtype=torch.bfloat16, max_topk=topk, device_capability=(10, 0),
                                                         deterministic=det)
                want = common.flash_attn_bwd_sm100_workspace_size(s_q, s_kv, d, h, det, backend=backend)
                assert policy.workspace_bytes(s_q, s_kv, d, h, arch="sm_100a", topk=topk, deterministic=det) == want


def test_sm100_dispatch_is_in_the_default_manifest():
    """Every production shape, either mode, short and long sequences: the SM100 key the op asks for ships."""
    have = _shipped("sm_100a")
    seen = set()
    for h in (64, 128):
        for d in (512, 576):
            for topk in (512, 1024, 2048):
                for tl in (False, True):
                    for det in (False, True):
                        for s_q, s_kv in SHAPES_SM100:
                            op, key = policy.kernels("sm_100a", h, d, topk, has_topk_length=tl, deterministic=det, s_q=s_q, s_kv=s_kv, sm_count=148)["bwd"]
                            assert (op, tuple(sorted(key.items()))) in have, (h, d, topk, tl, det, s_q, s_kv, op, key)
                            seen.add((op, key.get("planes"), key.get("relay"), key["wide"], key.get("split"), key.get("single_query")))
    # the grid reaches the layouts the manifest ships for them: wide addressing, every relay, the split regime
    assert {(1, 1, True), (32, 1, True), (32, 4, True), (16, 8, True), (8, 16, True), (128, 1, True), (128, 1, False)} <= {(p, r, w) for op, p, r, w, _, _ in seen if op == "bwd"}
    assert {(True, False), (False, True), (False, False)} <= {(sp, sq) for op, _, _, _, sp, sq in seen if op == "bwd_d576"}


def test_workspace_bytes_needs_topk_on_sm100():
    with pytest.raises(ValueError, match="topk"):
        policy.workspace_bytes(128, 128, 512, 64, arch="sm_100a")
