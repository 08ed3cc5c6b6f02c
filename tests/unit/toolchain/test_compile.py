"""dsa_aot.toolchain.compile on the CPU: both arches from one manifest, artifacts, and the content-addressed cache."""

import json

import pytest

pytest.importorskip("cutlass")  # the build toolchain: installed by ci/setup.sh

from dsa_aot.toolchain import compile as compile_stage  # noqa: E402
from dsa_aot.toolchain import manifest  # noqa: E402
from dsa_aot.toolchain.cubin import read_cubin  # noqa: E402

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


def test_cache_key_changes_with_every_part(monkeypatch):
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
    # another canonical directory can make another cubin of a layout-sensitive kernel (docs/fidelity.md)
    monkeypatch.setenv("AOT_CANONICAL_DIR", "/tmp/dsa-aot-canonical-elsewhere")
    assert compile_stage.cache_key(e, v) != base


def test_editing_a_policy_module_invalidates_the_entries_that_depend_on_it(tmp_path):
    """The compile key hashes each family's spec and every aot module it imports: an edit of one
    family's policy recompiles that family only; an edit of a module every compile process imports
    recompiles everything; an edit of the registry recompiles nothing."""
    import shutil

    from dsa_aot.toolchain.sources import REPO

    shutil.copytree(REPO / "dsa_aot", tmp_path / "dsa_aot", ignore=shutil.ignore_patterns("_generated", "__pycache__"))
    shutil.copytree(REPO / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    m = manifest.loads(SMALL + EXTRA + '[[bucket]]\nfamily = "dsa_indexer_backward"\nop = "score_grad_sm90"\ntopk = 512\ntargets = ["h200"]\n')
    v = compile_stage.tool_versions()

    def keys():
        return {e.id: compile_stage.cache_key(e, v, tmp_path) for e in m.entries}

    base = keys()
    assert base == {e.id: compile_stage.cache_key(e, v) for e in m.entries}  # the copy hashes like the checkout

    def changed_after(rel):
        p = tmp_path / rel
        p.write_text(p.read_text() + "\n# edited\n")
        now = keys()
        return {i.split(".")[0] for i in now if now[i] != base[i]}

    assert changed_after("dsa_aot/policy/csa_compressor.py") == {"csa_compressor"}
    base = keys()
    # every compile process imports the arch table (through the manifest): its code is in their heap
    assert changed_after("dsa_aot/policy/arch.py") == {"csa_compressor", "dsa_indexer_backward"}
    base = keys()
    assert changed_after("dsa_aot/policy/families.py") == set()
    base = keys()
    assert changed_after("kernels/dsa_indexer_backward.py") == {"dsa_indexer_backward"}
    base = keys()
    assert changed_after("dsa_aot/toolchain/cubin.py") == {"csa_compressor", "dsa_indexer_backward"}  # a stage source: everything
    base = keys()
    # imported by every compile process: its code is part of the heap the compiles start from
    assert changed_after("dsa_aot/toolchain/manifest.py") == {"csa_compressor", "dsa_indexer_backward"}


def test_debug_dump_keeps_the_dsl_files_and_marks_the_build_not_for_shipping(tmp_path):
    """--debug-dump: the DSL's PTX and cubin files land in the given directory, the entry says so, the
    compile cache is bypassed, and a pack of it is marked not for shipping."""
    from dsa_aot.toolchain import build, pack

    m = manifest.loads(SMALL)
    e = [x for x in m.entries if x.target.arch == "sm_90a"]
    (r,) = compile_stage.compile_entries(e, tmp_path / "w", cache_dir=tmp_path / "c", jobs=1, progress=False, debug_dump=str(tmp_path / "dump"))
    assert json.loads((r.dir / "meta.json").read_text())["debug_dump"] == str(tmp_path / "dump")
    kept = sorted(p.suffix for p in (tmp_path / "dump" / "sm_90a").iterdir())
    assert ".ptx" in kept and ".cubin" in kept, kept
    assert not (tmp_path / "c").exists()  # never cached: it may not be what a production compile makes
    build.lift_and_verify(r.dir)
    index = pack.pack([r.dir], tmp_path / "gen")
    pack.write_build_report(tmp_path / "work", index, {}, None)
    assert index["for_shipping"] is False and "NOT FOR SHIPPING" in (tmp_path / "work" / "report.md").read_text()


def test_the_build_refuses_a_missing_or_other_version_of_a_pinned_distribution(monkeypatch):
    """Every family names its upstream; the build compiles only against the pinned versions (the policies were
    checked against those kernels), and says which pip install fixes it."""
    from importlib import metadata

    from dsa_aot.errors import CompileError
    from dsa_aot.policy.families import FAMILIES

    pins = compile_stage.pins()
    assert {f.upstream.partition("==")[0] for f in FAMILIES.values()} <= set(pins)
    assert pins["nvidia-cudnn-frontend"] == "1.32.0" and pins["nvidia-cutlass-dsl"] == "4.8.1"
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda d: "1.31.0" if d == "nvidia-cudnn-frontend" else real(d))
    with pytest.raises(CompileError, match=r"nvidia-cudnn-frontend 1\.31\.0 is installed; the build is pinned to 1\.32\.0 \(pip install nvidia-cudnn-frontend==1\.32\.0\)"):
        compile_stage.tool_versions()

    def missing(d):
        raise metadata.PackageNotFoundError(d)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(CompileError, match=r"is not installed: the build needs it \(pip install nvidia-cutlass-dsl==4\.8\.1\)"):
        compile_stage.tool_versions()


def test_two_families_cannot_pin_one_distribution_at_two_versions(monkeypatch):
    from dsa_aot.policy import families

    monkeypatch.setitem(families.FAMILIES, "zz_other", families.Family("dsa", "nvidia-cudnn-frontend==1.30.0"))
    with pytest.raises(ValueError, match="families pin nvidia-cudnn-frontend at 1.32.0 and 1.30.0"):
        families.upstreams()


def test_every_pin_is_what_the_build_environments_install():
    """pip wheel's isolated build (pyproject's build requirements), the [build] extra and ci/setup.sh install each
    pinned distribution at its pin: a family's new upstream is added to all three, or the build refuses to run."""
    import tomllib

    from dsa_aot.toolchain.sources import REPO

    py = tomllib.loads((REPO / "pyproject.toml").read_text())
    setup = (REPO / "ci/setup.sh").read_text()
    for dist, version in compile_stage.pins().items():
        if dist.startswith("nvidia-cutlass-dsl"):  # both come as nvidia-cutlass-dsl[cu13] (libs-cu13 is the extra)
            dist = "nvidia-cutlass-dsl[cu13]"
        want = f"{dist}=={version}"
        assert want in py["build-system"]["requires"], want
        assert want in py["project"]["optional-dependencies"]["build"], want
        assert f'"{want}"' in setup, want
