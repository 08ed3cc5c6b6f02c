"""dsa_aot.toolchain.artifacts: the one reader of an entry's meta.json refuses what is not one, naming the file."""

import json

import pytest

from dsa_aot.errors import CompileError
from dsa_aot.toolchain.artifacts import read_meta


def test_read_meta_returns_the_entry_metadata(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"id": "fam.op.k.sm_90a", "arch": "sm_90a"}))
    assert read_meta(tmp_path) == {"id": "fam.op.k.sm_90a", "arch": "sm_90a"}


@pytest.mark.parametrize("text, says", [(None, "missing: the entry was not compiled"), ('{"id": "x"', "unreadable"),
                                        ("[1, 2]", "not an entry's metadata"), ('{"arch": "sm_90a"}', "not an entry's metadata"),
                                        (b"\xff\xfe", "unreadable")])
def test_read_meta_refuses_a_missing_truncated_or_foreign_file(tmp_path, text, says):
    if isinstance(text, bytes):
        (tmp_path / "meta.json").write_bytes(text)
    elif text is not None:
        (tmp_path / "meta.json").write_text(text)
    with pytest.raises(CompileError, match=says) as e:
        read_meta(tmp_path)
    assert str(tmp_path / "meta.json") in str(e.value)


def test_no_stage_reads_meta_json_by_itself():
    """One reader: the stages go through read_meta (pack, build, shards, fidelity, compile)."""
    from dsa_aot.toolchain.sources import REPO

    for p in sorted((REPO / "dsa_aot").rglob("*.py")):
        assert '/ "meta.json").read_text()' not in p.read_text(), p
