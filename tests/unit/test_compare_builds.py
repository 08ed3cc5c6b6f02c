"""ci/compare_builds.py: the tool the closing notes use to compare two builds' cubins and trees."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("compare_builds", ROOT / "ci" / "compare_builds.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build(d: Path, shas: dict, extra=b"x"):
    d.mkdir()
    (d / "index.json").write_text(json.dumps({"format": 1, "entries": [{"id": k, "sha256": v} for k, v in shas.items()]}))
    (d / "f.bin").write_bytes(extra)
    return d


def test_same_builds_pass_and_any_difference_fails(tmp_path, capsys):
    tool = _tool()
    a = _build(tmp_path / "a", {"e1": "11", "e2": "22"})
    assert tool.main([str(a), str(_build(tmp_path / "b", {"e1": "11", "e2": "22"}))]) == 0
    assert "trees: byte-identical" in capsys.readouterr().out
    assert tool.main([str(a), str(_build(tmp_path / "c", {"e1": "11", "e2": "22"}, b"y"))]) == 1  # same index, another file differs
    assert tool.main([str(a), str(_build(tmp_path / "d", {"e1": "11", "e2": "23"}))]) == 1
    assert "differs: e2" in capsys.readouterr().out
    (tmp_path / "shas.json").write_text(json.dumps({"e1": "11"}))
    assert tool.main([str(tmp_path / "shas.json"), str(a)]) == 1  # e2 only on one side


def test_a_packed_build_is_read_through_its_family_indexes(tmp_path, capsys):
    import hashlib

    from build_files import write_build

    def build(d, cubin):
        sha = hashlib.sha256(cubin).hexdigest()
        write_build(d, [{"id": "e1", "family": "csa_compressor", "op": "fwd", "key": {}, "arch": "sm_90a", "sha256": sha,
                         "launcher_sha256": "0" * 64, "kernels": [], "params": {}}], {sha: cubin})
        return d

    tool = _tool()
    a = build(tmp_path / "a", b"one")
    assert tool.shas(a) == {"e1": hashlib.sha256(b"one").hexdigest()}
    assert tool.main([str(a), str(build(tmp_path / "b", b"one"))]) == 0
    assert tool.main([str(a), str(build(tmp_path / "c", b"two"))]) == 1
    assert "differs: e1" in capsys.readouterr().out
