"""Targets: several SM counts of one arch in one build, the runtime choosing between them, and the exact
choice of an arch for every (compute capability, build content) pair."""

import itertools

import pytest

import stand_in
from dsa_aot.errors import ArchMismatchError, ManifestError
from dsa_aot.policy import arch as arch_policy
from dsa_aot.runtime.index import Index
from dsa_aot.toolchain import manifest
from build_files import write_build

GEMM_KEY = {"heads": 64, "topk": 512, "topk_global": False, "persistent": True, "pdl": True, "deterministic": False, "planes": 96}
REDUCE_KEY = {"out": "f32", "planes": 96}


def _entry(op, key, arch, sms, qualified=True):
    ident = f"dsa_indexer_backward.{op}.{arch}" + (f".sm{sms}" if qualified else "")
    return {"id": ident, "family": "dsa_indexer_backward", "op": op, "key": dict(key), "arch": arch, "target": {"name": f"t{sms}", "sm_count": sms},
            "sha256": "0" * 64, "launcher_sha256": "0" * 64,
            "kernels": ["k"], "params": {"k": [8]}}


@pytest.fixture
def two_targets(tmp_path):
    """An index with sm_100a targets of 148 and 160 SMs: the indexer backward's gemm (bakes the SM count in:
    SM_COUNT_OPS) and reduce_dk (does not) for each, and an sm_90a reduce_dk for 132."""
    entries = [_entry(op, key, "sm_100a", sms) for sms in (148, 160) for op, key in (("gemm", GEMM_KEY), ("reduce_dk", REDUCE_KEY))]
    entries.append(_entry("reduce_dk", REDUCE_KEY, "sm_90a", 132, qualified=False))
    write_build(tmp_path, entries)
    return Index(tmp_path)


def test_the_runtime_picks_the_target_of_the_gpus_sm_count(two_targets):
    ix = two_targets
    for sms in (148, 160):
        assert ix.find("dsa_indexer_backward", "gemm", GEMM_KEY, "sm_100a", sms=sms, exact=True)["target"]["sm_count"] == sms
        assert ix.find("dsa_indexer_backward", "reduce_dk", REDUCE_KEY, "sm_100a", sms=sms)["target"]["sm_count"] == sms
        assert ix.target_sm_count("sm_100a", sms) == sms
    # an op that bakes the SM count in: only its own; the error names the target to add
    for sms in (140, 152, 170):
        with pytest.raises(ArchMismatchError, match=rf"has {sms} SMs.*148, 160 SMs.*sm_count = {sms}"):
            ix.find("dsa_indexer_backward", "gemm", GEMM_KEY, "sm_100a", sms=sms, exact=True)
        with pytest.raises(ArchMismatchError, match=rf"sm_count = {sms}"):
            ix.target_sm_count("sm_100a", sms)
    # an op that does not: the nearest target (the lower on a tie)
    for sms, want in ((140, 148), (152, 148), (154, 148), (155, 160), (170, 160)):
        assert ix.find("dsa_indexer_backward", "reduce_dk", REDUCE_KEY, "sm_100a", sms=sms)["target"]["sm_count"] == want, sms
    # one target of the arch: any SM count for a free op
    assert ix.find("dsa_indexer_backward", "reduce_dk", REDUCE_KEY, "sm_90a", sms=114)["target"]["sm_count"] == 132


@pytest.mark.parametrize("sms, ok", [(148, True), (160, True), (132, False)])
def test_the_ops_choose_through_the_devices_sm_count(two_targets, monkeypatch, sms, ok):
    """What every op calls (dsa_aot.ops.gpu.require / target_sm_count) on a stand-in capability-10.0 GPU."""
    from dsa_aot.ops import gpu as _support

    stand_in.install(monkeypatch, two_targets, capability=(10, 0), sm_count=sms)
    kernels = {"gemm": ("gemm", GEMM_KEY), "reduce": ("reduce_dk", REDUCE_KEY)}
    if ok:
        _support.require("dsa_indexer_backward", kernels, 0)
        assert _support.target_sm_count(0) == sms
    else:
        with pytest.raises(ArchMismatchError, match=f"sm_count = {sms}"):
            _support.require("dsa_indexer_backward", kernels, 0)
        _support.require("dsa_indexer_backward", {"reduce": ("reduce_dk", REDUCE_KEY)}, 0)  # the free op alone: served


TWO = """
[[target]]
name = "b200"
arch = "sm_100a"
sm_count = 148
[[target]]
name = "b300ish"
arch = "sm_100a"
sm_count = 160
[[target]]
name = "h200"
arch = "sm_90a"
sm_count = 132
[[bucket]]
family = "csa_compressor"
op = "dape_reduce"
split = [false, true]
"""


def test_a_manifest_holds_several_sm_counts_of_one_arch():
    m = manifest.loads(TWO)
    ids = sorted(e.id for e in m.entries)
    assert ids == sorted(f"csa_compressor.dape_reduce.{s}.{t}" for s in ("split", "nosplit") for t in ("sm_100a.sm148", "sm_100a.sm160", "sm_90a"))
    with pytest.raises(ManifestError, match="is target 'b200' already"):
        manifest.loads(TWO.replace("sm_count = 160", "sm_count = 148"))


# --- every (compute capability, build content) pair ---------------------------------------------------

CAPS = [(9, 0), (10, 0), (10, 3), (8, 0), (12, 0), (10, 1)]
CONTENTS = [frozenset(c) for n in range(len(arch_policy.KNOWN) + 1) for c in itertools.combinations(sorted(arch_policy.KNOWN), n)]


def _want(cap, content):
    """The rule, written out: an 'a' cubin only on its own capability; sm_100f on any 10.x GPU upstream targets,
    only when the build has no exact cubin for it."""
    exact = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}.get(cap)
    if exact in content:
        return exact
    if cap in ((10, 0), (10, 3)) and "sm_100f" in content:
        return "sm_100f"
    return None


@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"cc{c[0]}.{c[1]}")
def test_the_arch_chosen_for_every_capability_and_build_content(cap):
    from dsa_aot.runtime.device import Device, arch_of

    for content in CONTENTS:
        want = _want(cap, content)
        assert arch_policy.best_arch(cap, content) == want, (cap, sorted(content))
        if want is None:
            with pytest.raises(ArchMismatchError, match="Add a \\[\\[target\\]\\]"):
                arch_of(Device(0, "gpu", cap, 100), content)
        else:
            assert arch_of(Device(0, "gpu", cap, 100), content) == want


@pytest.mark.parametrize("sms, want", [(148, 148), (160, 160), (150, 148)])
def test_preload_loads_the_targets_this_gpu_would_run(two_targets, monkeypatch, sms, want):
    """dsa_aot.runtime.preload: per key, the entry of the GPU's own SM count (else the nearest), not every target's."""
    import dsa_aot.runtime
    import dsa_aot.runtime.index as index_mod

    stand_in.install(monkeypatch, two_targets, capability=(10, 0), sm_count=sms)
    monkeypatch.setattr(index_mod, "_INDEX", two_targets)
    loaded, fetched = [], []
    monkeypatch.setattr(two_targets, "loaded", lambda e, dev: loaded.append(e) or type("L", (), {"load_ms": 0.0})())
    monkeypatch.setattr(two_targets, "prefetch", fetched.extend)  # the build's members are empty stand-ins here
    dsa_aot.runtime.preload(0)
    assert sorted((e["op"], e["target"]["sm_count"]) for e in loaded) == [("gemm", want), ("reduce_dk", want)]
    assert fetched == loaded  # fetched ahead: what it loads, nothing else
