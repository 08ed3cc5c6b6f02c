"""dsa_aot.runtime.index: lookups by the op's key fields, the bucket a miss names, a missing build."""

import tomllib

import pytest

from dsa_aot.errors import ArchMismatchError, KernelNotFoundError
from dsa_aot.runtime.index import Index


def test_find_names_the_manifest_bucket_that_would_cover_a_missing_key(one_entry_build):
    ix, entry = one_entry_build
    assert ix.find("csa_compressor", "dape_reduce", {"split": True}, "sm_90a") == entry
    with pytest.raises(KernelNotFoundError) as ei:
        ix.find("csa_compressor", "fwd", {"ratio": 4, "d": 64, "coff": 2}, "sm_90a")
    msg = str(ei.value)
    assert "[[bucket]]" in msg and "op = 'fwd'" in msg and "d = 64" in msg and "rebuild" in msg
    # the suggested bucket is TOML a user can paste (it was one comma-joined line before, which TOML refuses)
    bucket = tomllib.loads(msg.split("Add to the manifest:\n", 1)[1].rsplit("\nand rebuild", 1)[0].replace("[[bucket]]", "", 1))
    assert bucket == {"family": "csa_compressor", "op": "fwd", "ratio": 4, "d": 64, "coff": 2}
    with pytest.raises(ArchMismatchError, match=r"no cubins for sm_100a \(it has: sm_90a\)"):
        ix.find("csa_compressor", "dape_reduce", {"split": True}, "sm_100a")


def test_missing_build_says_how_to_make_one(tmp_path):
    with pytest.raises(KernelNotFoundError, match="python -m dsa_aot build"):
        Index(tmp_path / "nothing")


def test_lookup_ignores_what_the_spec_derived(packed):
    """index.json keeps the spec's derived fields (grid, persistence, ...) next to the key; the runtime
    looks entries up by the op's own fields."""
    name = "dsa_indexer_backward.gemm.nodeterministic.heads64.pdl.persistent.planes96.topk512.notopk_global.sm_100a"
    ix = packed(name)
    e = ix.find("dsa_indexer_backward", "gemm", {"heads": 64, "topk": 512, "topk_global": False, "persistent": True, "pdl": True,
                                                 "deterministic": False, "planes": 96}, "sm_100a")
    assert e["id"] == name and e["key"]["grid"] == 148 and "grid" in e["derived"]
    assert ix.target_sm_count("sm_100a", 148) == 148
    with pytest.raises(ArchMismatchError, match="sm_count = 160"):
        ix.target_sm_count("sm_100a", 160)


def test_derived_fields_need_not_be_hashable(packed):
    """A ratio-128 CSA entry's derived schedule is a list: the index loads, and the op's own fields find it."""
    name = "csa_compressor.bwd_r128.default.coff2.d512.deterministic.ratio128.sm_100a"
    ix = packed(name)
    (e,) = ix.entries
    assert isinstance(e["key"]["schedule"], list) and "schedule" in e["derived"]
    assert ix.find("csa_compressor", "bwd_r128", {k: v for k, v in e["key"].items() if k not in e["derived"]}, "sm_100a") is e


def test_a_debug_build_is_refused_unless_asked_for(one_entry_build, monkeypatch):
    """A build compiled with --debug-dump (keep/dump files on) is marked not for shipping."""
    import json

    from dsa_aot.errors import LaunchError

    from build_files import write_index

    ix, entry = one_entry_build
    doc = json.loads((ix.root / "index.json").read_text())
    write_index(ix.root, doc | {"for_shipping": False})
    with pytest.raises(LaunchError, match="debug build"):
        Index(ix.root)
    monkeypatch.setenv("AOT_ALLOW_DEBUG_BUILD", "1")
    assert Index(ix.root).entries == [entry]


def test_a_changed_missing_or_malformed_index_is_refused(one_entry_build):
    import json

    from dsa_aot.errors import LaunchError
    from build_files import edit_family, write_index

    ix, entry = one_entry_build
    root = ix.root
    text = (root / "index.json").read_text()
    (root / "index.json").write_text(text.replace('"for_shipping": true', '"for_shipping": false'))  # edited after the build
    with pytest.raises(LaunchError, match="index.json is corrupted"):
        Index(root)
    (root / "index.json").write_text(text)
    (root / "index.sha256").unlink()
    with pytest.raises(LaunchError, match="index.sha256 is missing"):
        Index(root)
    (root / "index.json").write_text("{not json")
    (root / "index.sha256").write_text(__import__("hashlib").sha256(b"{not json").hexdigest())
    with pytest.raises(LaunchError, match="not valid JSON"):
        Index(root)
    write_index(root, json.loads(text) | {"indexes": {"csa_compressor.sm_9x": {"index": 3}}})
    with pytest.raises(LaunchError, match="malformed table of indexes"):
        Index(root)
    write_index(root, json.loads(text))
    fam = json.loads((root / "index" / "csa_compressor.sm_9x.json").read_text())
    (raw,) = fam["entries"]  # its kernels by their place in the index's table
    assert [fam["kernels"][i] for i in raw["kernels"]] == [[k, entry["params"][k]] for k in entry["kernels"]]
    assert {k: v for k, v in raw.items() if k != "kernels"} == {k: v for k, v in entry.items() if k not in ("kernels", "params")}
    for change in (lambda d: d["entries"][0].update(key=["split"]), lambda d: d["entries"][0].pop("launcher_sha256"),
                   lambda d: d["entries"][0].update(family="dsa_topk_utils"), lambda d: d["entries"][0].update(arch="sm_100a"),
                   lambda d: d["entries"][0].update(kernels=[len(d["kernels"])]), lambda d: d["entries"][0].update(kernels=["k"])):
        edit_family(root, "csa_compressor", lambda d: (d.clear(), d.update(json.loads(json.dumps(fam))), change(d)))
        with pytest.raises(LaunchError, match="1 malformed entries"):
            Index(root).find("csa_compressor", "dape_reduce", {"split": True}, "sm_90a")
    for change in (lambda d: d.pop("kernels"), lambda d: d.update(kernels=[["k", [8, -1]]]), lambda d: d.update(kernels={"k": [8]})):
        edit_family(root, "csa_compressor", lambda d: (d.clear(), d.update(json.loads(json.dumps(fam))), change(d)))
        with pytest.raises(LaunchError, match="not a family index"):
            Index(root).find("csa_compressor", "dape_reduce", {"split": True}, "sm_90a")
