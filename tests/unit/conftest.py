"""Fixtures the unit tests share: small builds made from the entries in tests/data (no GPU, no toolchain run)."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
CSA_ENTRY = "csa_compressor.dape_reduce.split.sm_90a"


@pytest.fixture
def one_entry_build(tmp_path):
    """A build directory holding the CSA dAPE-reduce entry of tests/data (its launcher lifted here): (Index, entry)."""
    from aot.runtime.index import Index
    from aot.toolchain import lift

    src = DATA / CSA_ENTRY
    meta = json.loads((src / "meta.json").read_text())
    (tmp_path / "cubins").mkdir()
    (tmp_path / "launchers").mkdir()
    cubin = (src / "kernel.cubin").read_bytes()
    sha = hashlib.sha256(cubin).hexdigest()
    (tmp_path / "cubins" / f"{sha}.cubin").write_bytes(cubin)
    (tmp_path / "launchers" / "l.py").write_text(lift.lift((src / "host.mlir").read_text(), meta["host_function"]))
    entry = {"id": CSA_ENTRY, "family": "csa_compressor", "op": "dape_reduce", "key": {"split": True}, "arch": "sm_90a",
             "cubin": f"cubins/{sha}.cubin", "sha256": sha, "launcher": "launchers/l.py"}
    (tmp_path / "index.json").write_text(json.dumps({"format": 1, "entries": [entry]}))
    return Index(tmp_path), entry


@pytest.fixture
def packed(tmp_path):
    """pack(name) -> Index of a build made by the real stages (lift, verify, pack) from tests/data/<name>."""
    from aot.runtime.index import Index
    from aot.toolchain import build, pack

    def make(name):
        d = tmp_path / "entries" / name
        shutil.copytree(DATA / name, d)
        build.lift_and_verify(d)
        pack.pack([d], tmp_path / "gen")
        return Index(tmp_path / "gen")

    return make


def check_sm100_calls_module():
    """ci/check_sm100_calls.py, loaded by path (the offline check of the SM100 sparse-backward call)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_sm100_calls", ROOT / "ci" / "check_sm100_calls.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def sm100_calls():
    return check_sm100_calls_module()
