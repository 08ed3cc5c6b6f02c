"""dsa_aot.toolchain.pack: the shipped tree is a function of the entries (no timings, paths or notes that vary)."""

import json
import shutil

import pytest

from dsa_aot.errors import PackError
from dsa_aot.toolchain import pack
from build_files import lifted_entries

NAMES = ("dsa_indexer_backward.gemm_sm90.heads64.topk512.notopk_global.sm_90a", "dsa_sparse_attention_backward.main_sm90.dim512.bf16.heads64.topk512.notopk_length.sm_90a")


def _entries(root):
    return lifted_entries(root, NAMES)


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_two_packs_in_different_places_are_byte_identical(tmp_path):
    a, b = _entries(tmp_path / "a"), _entries(tmp_path / "b" / "deeper")
    meta = json.loads((b[0] / "meta.json").read_text())
    (b[0] / "meta.json").write_text(json.dumps(meta | {"compile_seconds": meta["compile_seconds"] + 1.0}))  # another build's timing
    verdict = {"verdict": "identical", "route": "r", "options": None, "seconds": 0.5, "note": "this run", "cached": False}
    fa = {json.loads((d / "meta.json").read_text())["id"]: verdict | {"shipped_sha256": _sha(d)} for d in a}
    fb = {i: v | {"seconds": 0.9, "note": "another run", "cached": True} for i, v in fa.items()}
    pack.pack(a, tmp_path / "a" / "gen", tmp_path / "a" / "m.toml", fidelity=fa)
    pack.pack(b, tmp_path / "b" / "gen", tmp_path / "b" / "deeper" / "m.toml", fidelity=fb)
    ta, tb = _tree(tmp_path / "a" / "gen"), _tree(tmp_path / "b" / "gen")
    assert ta.keys() == tb.keys() and ta == tb
    index = json.loads(ta["index.json"])
    assert index["manifest"] == "m.toml"
    entries = [e for f in index["indexes"].values() for e in json.loads(ta[f["index"]])["entries"]]
    assert len(entries) == 2 and all("compile_seconds" not in e and "fidelity" not in e for e in entries)


def test_the_tree_holds_what_the_runtime_reads_and_the_build_records_go_to_the_work_dir(tmp_path):
    from dsa_aot.runtime.index import Index

    dirs = _entries(tmp_path)
    full = pack.pack(dirs, tmp_path / "gen")
    shipped = sorted(str(p.relative_to(tmp_path / "gen")) for p in (tmp_path / "gen").rglob("*") if p.is_file())
    assert shipped == sorted(["index.json", "index.sha256", "index/dsa_indexer_backward.sm_9x.json", "index/dsa_sparse_attention_backward.sm_9x.json",
                              "packs/sm_9x.dsa_indexer_backward.gemm_sm90.0.xz", "packs/sm_9x.dsa_indexer_backward.launchers.0.xz",
                              "packs/sm_9x.dsa_sparse_attention_backward.main_sm90.0.xz",
                              "packs/sm_9x.dsa_sparse_attention_backward.launchers.0.xz"]), shipped
    ix = Index(tmp_path / "gen")
    assert ix.entries and all(not {"verify", "resources", "fidelity", "cubin_bytes"} & set(e) for e in ix.entries)
    for e, d in zip(ix.entries, dirs):
        assert ix.member(e, "cubin") == (d / "kernel.cubin").read_bytes() and ix.member(e, "launcher") == (d / "launcher.py").read_bytes()
    assert pack.unpack(tmp_path / "gen", tmp_path / "unpacked") == 2  # the files a person reads
    for d in dirs:
        meta = json.loads((d / "meta.json").read_text())
        assert (tmp_path / "unpacked" / "launchers" / f"{meta['id']}.py").read_bytes() == (d / "launcher.py").read_bytes()
        assert (tmp_path / "unpacked" / "cubins" / f"{_sha(d)}.cubin").read_bytes() == (d / "kernel.cubin").read_bytes()
    pack.write_build_report(tmp_path / "work", full, {}, None)
    verify = json.loads((tmp_path / "work" / "verify.json").read_text())
    rows = json.loads((tmp_path / "work" / "report.json").read_text())
    fid = json.loads((tmp_path / "work" / "fidelity.json").read_text())
    assert verify == {e["id"]: e["verify"] for e in full["entries"]} and all(v["verdict"] == "ok" for v in verify.values())
    assert fid == {e["id"]: {"verdict": "not checked"} for e in full["entries"]}
    assert {r["id"] for r in rows} == set(verify) and all("registers" in r for r in rows)


def test_the_build_report_keeps_timings_and_notes(tmp_path):
    dirs = _entries(tmp_path)
    index = pack.pack(dirs, tmp_path / "gen")
    pack.write_build_report(tmp_path / "work", index, {index["entries"][0]["id"]: {"compile_s": 1.25, "lift_verify_s": 0.5, "fidelity_s": 2.0}},
                            {index["entries"][0]["id"]: {"note": "why"}}, {"compile": 3.0})
    md = (tmp_path / "work" / "report.md").read_text()
    assert "| 1.25 |" in md and "why" in md
    assert json.loads((tmp_path / "work" / "report.json").read_text())[0]["compile_s"] == 1.25


def test_a_failing_verdict_or_another_arch_is_refused(tmp_path):
    dirs = _entries(tmp_path)
    ident = json.loads((dirs[0] / "meta.json").read_text())["id"]
    with pytest.raises(PackError, match="refusing to ship"):
        pack.pack(dirs, tmp_path / "gen", fidelity={ident: {"verdict": "differs", "note": "x", "shipped_sha256": _sha(dirs[0])}})
    meta = json.loads((dirs[0] / "meta.json").read_text())
    (dirs[0] / "meta.json").write_text(json.dumps(meta | {"arch": "sm_100a"}))
    with pytest.raises(PackError, match="cubin is for sm_90a, entry says sm_100a"):
        pack.pack(dirs, tmp_path / "gen")


def _sha(d):
    import hashlib

    return hashlib.sha256((d / "kernel.cubin").read_bytes()).hexdigest()


def test_an_op_free_of_the_sm_count_must_be_one_cubin_for_every_sm_count(tmp_path):
    """Two targets of one arch: an op whose policy says its cubins do not depend on the SM count (the runtime
    serves any SM count with either) must have the same cubin for both; pack refuses a difference, naming the
    policy to fix. An op in SM_COUNT_OPS may differ."""
    a = _entries(tmp_path / "x")[0]  # dsa_indexer_backward.gemm_sm90 (free: not in SM_COUNT_OPS)
    meta = json.loads((a / "meta.json").read_text())
    pairs = []
    for sms in (132, 114):
        d = tmp_path / "two" / f"{meta['id']}.sm{sms}"
        shutil.copytree(a, d)
        (d / "meta.json").write_text(json.dumps(meta | {"id": f"{meta['id']}.sm{sms}", "target": {"name": f"t{sms}", "sm_count": sms}}))
        pairs.append(d)
    index = pack.pack(pairs, tmp_path / "gen-same")
    assert len(index["entries"]) == 2 and len({e["sha256"] for e in index["entries"]}) == 1
    cubin = bytearray((pairs[1] / "kernel.cubin").read_bytes())
    cubin[-1] ^= 1  # another cubin for 114 SMs (the ELF's last byte: still parses)
    (pairs[1] / "kernel.cubin").write_bytes(bytes(cubin))
    with pytest.raises(PackError, match="different cubins for 114 and 132 SMs.*SM_COUNT_OPS"):
        pack.pack(pairs, tmp_path / "gen-differ")
    assert not (tmp_path / "gen-differ").exists()
