"""dsa_aot.toolchain.build's own logic: the lift+verify cache (the stages have their own tests)."""

import json
import shutil
from pathlib import Path

import pytest

from dsa_aot.toolchain import build, verify
from dsa_aot.errors import VerifyError

DATA = Path(__file__).resolve().parents[2] / "data"
NAME = "csa_compressor.dape_reduce.split.sm_90a"


def test_lift_verify_cache_replays_a_passing_result_and_keys_on_the_artifacts(tmp_path, monkeypatch):
    d = tmp_path / "e" / NAME
    shutil.copytree(DATA / NAME, d)
    rep = json.loads(json.dumps(build.lift_and_verify(d, samples=50, cache_dir=tmp_path / "cache")))
    src = (d / "launcher.py").read_text()
    (d / "launcher.py").unlink()
    calls = []
    real = verify.verify
    monkeypatch.setattr(verify, "verify", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert build.lift_and_verify(d, samples=50, cache_dir=tmp_path / "cache") == rep and not calls
    assert (d / "launcher.py").read_text() == src and json.loads((d / "verify.json").read_text()) == rep
    # another sample count, or a changed cubin, is checked again
    build.lift_and_verify(d, samples=51, cache_dir=tmp_path / "cache")
    assert calls == [1]
    cubin = bytearray((d / "kernel.cubin").read_bytes())
    cubin[-1] ^= 1
    (d / "kernel.cubin").write_bytes(bytes(cubin))
    with pytest.raises(VerifyError):  # the host module no longer embeds this cubin: verified again, and refused
        build.lift_and_verify(d, samples=50, cache_dir=tmp_path / "cache")
    assert calls == [1, 1]


def test_every_build_checks_each_family_policy_against_cudnn(monkeypatch):
    """check_policies runs before the compile stage (cache or not): the shipped policies agree with
    cudnn, and a policy that drifts from upstream's stops the build naming the disagreement."""
    import sys

    pytest.importorskip("cudnn")
    from dsa_aot.errors import PolicyError
    from dsa_aot.policy import csa_compressor, dsa_indexer_backward
    from dsa_aot.toolchain import manifest

    m = manifest.load(Path(__file__).resolve().parents[3] / "manifests" / "default.toml")
    build.check_policies(m)  # a fresh process, as in a build
    targets = list(m.targets)
    monkeypatch.setattr(csa_compressor, "BWD_ROWS", 16)
    monkeypatch.setattr(dsa_indexer_backward, "SHORT_TOPK", (128, 256, 512))
    failures = build._check_policies(["csa_compressor", "dsa_indexer_backward", "dsa_sparse_attention_backward"], targets, list(sys.path))
    assert len(failures) == 2, failures
    assert "assumes 16" in failures[0] and "persistent" in failures[1]
    with pytest.raises(PolicyError, match=r"2 family policies disagree(.|\n)*assumes 16"):
        build.check_policies(m, isolated=False)
