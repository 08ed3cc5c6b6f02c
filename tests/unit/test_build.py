"""aot.build's own logic: the lift+verify cache (the stages have their own tests)."""

import json
import shutil
from pathlib import Path

import pytest

from aot import build, verify
from aot.errors import VerifyError

DATA = Path(__file__).resolve().parents[1] / "data"
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
