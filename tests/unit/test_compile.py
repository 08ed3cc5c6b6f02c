"""aot.compile on the CPU: both arches from one manifest, artifacts, and the content-addressed cache."""

import json

import pytest

pytest.importorskip("cutlass")  # the build toolchain: installed by ci/setup.sh

from aot import compile as compile_stage  # noqa: E402
from aot import manifest  # noqa: E402
from aot.cubin import read_cubin  # noqa: E402

SMALL = """
[[target]]
name = "b200"
arch = "sm_100a"
sm_count = 148
[[target]]
name = "h200"
arch = "sm_90a"
sm_count = 132
[[bucket]]
family = "csa_compressor"
op = "dape_reduce"
split = false
"""
EXTRA = """
[[bucket]]
family = "csa_compressor"
op = "fwd"
ratio = 4
coff = 1
d = 64
targets = ["h200"]
"""


def test_compile_both_arches_then_exactly_one_new_entry(tmp_path):
    m = manifest.loads(SMALL)
    res = compile_stage.compile_entries(m.entries, tmp_path / "w", cache_dir=tmp_path / "c", jobs=2, progress=False)
    assert [r.cached for r in res] == [False, False]
    for r in res:
        cubin = (r.dir / "kernel.cubin").read_bytes()
        assert read_cubin(cubin).arch == r.entry.target.arch
        meta = json.loads((r.dir / "meta.json").read_text())
        assert meta["arch"] == r.entry.target.arch and meta["tools"]["nvidia-cutlass-dsl"] == "4.8.1"
        assert '"llvm.func"' in (r.dir / "host.mlir").read_text()  # generic op form, for the lifter
    a, b = ((r.dir / "kernel.cubin").read_bytes() for r in res)
    assert a != b  # one cubin per arch
    # same inputs -> cache hits, byte-identical artifacts; one new bucket -> one compile
    m2 = manifest.loads(SMALL + EXTRA)
    res2 = compile_stage.compile_entries(m2.entries, tmp_path / "w2", cache_dir=tmp_path / "c", jobs=2, progress=False)
    assert sorted((r.entry.op, r.cached) for r in res2) == [("dape_reduce", True), ("dape_reduce", True), ("fwd", False)]
    for r in res2[:2]:
        assert (r.dir / "kernel.cubin").read_bytes() in (a, b)


def test_cache_key_changes_with_every_part():
    m = manifest.loads(SMALL + EXTRA)
    e = m.entries[-1]
    v = compile_stage.tool_versions()
    base = compile_stage.cache_key(e, v)
    from dataclasses import replace

    assert compile_stage.cache_key(replace(e, key=tuple((k, 128 if k == "d" else x) for k, x in e.key)), v) != base
    assert compile_stage.cache_key(replace(e, target=replace(e.target, arch="sm_100a")), v) != base
    assert compile_stage.cache_key(replace(e, target=replace(e.target, sm_count=148)), v) != base
    assert compile_stage.cache_key(e, dict(v, **{"nvidia-cutlass-dsl": "4.8.2"})) != base
    assert compile_stage.cache_key(e, v) == base
