"""dsa_aot.policy.dsa_indexer_backward: the dispatch lands on entries the default manifest ships."""

from pathlib import Path

from dsa_aot.policy import dsa_indexer_backward as policy
from dsa_aot.toolchain import manifest

ROOT = Path(__file__).resolve().parents[3]


def test_indexer_dispatch_hits_the_default_manifest_for_every_anchor_shape():
    """The runtime's choice of (op, key) per stage, for the anchor shapes, is an entry the default
    manifest ships (same key fields the spec declares), on both arches."""
    m = manifest.load(ROOT / "manifests" / "default.toml")
    have = {(e.target.arch, e.op, e.key) for e in m.entries if e.family == "dsa_indexer_backward"}
    sms = {t.arch: t.sm_count for t in m.targets}
    calls = []
    for s_q in (4096, 8192):
        for topk in (512, 1024, 1536, 2048):
            for glob in (False, True):
                for dkf32 in (False, True):
                    calls.append(("sm_90a", 64, s_q, topk, dict(topk_indices_global=glob, d_index_k_f32=dkf32)))
                    for h in (32, 64):
                        calls.append(("sm_100a", h, s_q, topk, dict(topk_indices_global=glob, d_index_k_f32=dkf32)))
                for h in (32, 64):
                    calls.append(("sm_100a", h, s_q, topk, dict(deterministic=True, d_index_k_f32=glob)))
                calls.append(("sm_100a", 64, s_q, topk, dict(backend="sm100_v2", d_weights_f32=glob, d_index_k_f32=glob)))
                calls.append(("sm_100a", 64, s_q, topk, dict(backend="sm100_v2", deterministic=True, d_weights_f32=True)))
        for planes in (128, 148):
            calls.append(("sm_100a", 64, s_q, 512, dict(deterministic=True, deterministic_dk_planes=planes)))
    for arch, h, s_q, topk, kw in calls:
        ks = policy.kernels(arch, 1, s_q, h, topk, target_sm_count=sms[arch], **kw)
        for role, (op, key) in ks.items():
            assert (arch, op, tuple(sorted(key.items()))) in have, (arch, h, s_q, topk, kw, role, op, key)
