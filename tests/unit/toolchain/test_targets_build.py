"""A real build of a manifest with two SM counts of one arch (the build toolchain installed): both ship, an op
free of the SM count is one cubin for both (pack checks it), and the runtime serves each GPU its target."""


import pytest

import stand_in
from build_files import entries_of

MANIFEST = """
[[target]]
name = "b200"
arch = "sm_100a"
sm_count = 148
[[target]]
name = "b200_160"
arch = "sm_100a"
sm_count = 160
[[bucket]]
family = "dsa_indexer_backward"
op = "reduce_dk"
out = "f32"
planes = 96
[[bucket]]
family = "csa_compressor"
op = "dape_reduce"
split = false
"""


def test_two_sm_counts_of_one_arch_build_and_serve_their_gpus(tmp_path, monkeypatch):
    pytest.importorskip("cutlass")
    pytest.importorskip("cudnn")
    from dsa_aot.ops import gpu as _support
    from dsa_aot.runtime.index import Index
    from dsa_aot.toolchain import build

    (tmp_path / "m.toml").write_text(MANIFEST)
    index = build.build(tmp_path / "m.toml", tmp_path / "gen", tmp_path / "work", tmp_path / "cache", jobs=2, progress=False)
    ids = sorted(e["id"] for e in index["entries"])
    assert ids == sorted(f"{f}.sm_100a.sm{n}" for f in ("csa_compressor.dape_reduce.nosplit", "dsa_indexer_backward.reduce_dk.f32.planes96")
                         for n in (148, 160))
    shas = {}
    assert all(e["fidelity"]["verdict"] == "identical" for e in index["entries"]), "the build's records"
    for e in entries_of(tmp_path / "gen"):
        shas.setdefault(e["op"], set()).add(e["sha256"])
    assert all(len(s) == 1 for s in shas.values()), "ops free of the SM count: one cubin for both targets"
    for sms, want in ((148, 148), (160, 160), (150, 148)):
        stand_in.install(monkeypatch, Index(tmp_path / "gen"), capability=(10, 0), sm_count=sms)
        e = _support.launcher("dsa_indexer_backward", "reduce_dk", {"out": "f32", "planes": 96}, 0).entry
        assert e["target"]["sm_count"] == want and e["id"].endswith(f".sm{want}")
