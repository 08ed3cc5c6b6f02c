"""The README's coverage table names every public name of cudnn.DSA (the pinned nvidia-cudnn-frontend):
a wrapper upstream adds cannot go unmentioned."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _table() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Coverage of `cudnn.DSA`")
    return text[start : text.index("\n## ", start + 1)]


def test_every_cudnn_dsa_name_is_in_the_readme_coverage_table():
    dsa = pytest.importorskip("cudnn.deepseek_sparse_attention")
    table = _table()
    missing = [n for n in dsa._SYMBOLS if f"`{n}`" not in table]
    assert not missing, f"README coverage table lacks {missing}"
    assert len(dsa._SYMBOLS) >= 29


def test_every_shipped_op_the_table_names_exists():
    import re

    import dsa_aot.csa
    import dsa_aot.dsa

    table = _table()
    for ns, mod in (("csa", dsa_aot.csa), ("dsa", dsa_aot.dsa)):
        for name in re.findall(rf"`dsa_aot\.{ns}\.(\w+)", table):
            assert hasattr(mod, name), f"README names dsa_aot.{ns}.{name}, which does not exist"
