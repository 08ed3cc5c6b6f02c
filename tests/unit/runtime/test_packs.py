"""The packed build (dsa_aot/policy/artifact.py): every way a group or an index can be damaged is a LaunchError
naming what is wrong and the fix, raised before the driver is touched; a sound group serves its members."""

import json
import lzma

import pytest
from build_files import edit_family, family_index, group_file, rewrite_group, write_build

from dsa_aot.errors import LaunchError
from dsa_aot.runtime import loaded
from dsa_aot.runtime.index import Index


def _copy(build, tmp_path, name):
    """A copy of the one-entry build to damage in another way."""
    import shutil

    shutil.copytree(build[0].root, tmp_path / name)
    return tmp_path / name, build[1]


def _load(root, entry):
    ix = Index(root)  # a fresh process's view: nothing decompressed yet
    return loaded.LoadedEntry(ix, ix.find(entry["family"], entry["op"], entry["key"], entry["arch"]), 0)


def test_a_flipped_bit_in_a_group_is_refused_naming_the_group(one_entry_build):
    ix, entry = one_entry_build
    p = group_file(ix.root, entry)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x10
    p.write_bytes(bytes(data))
    with pytest.raises(LaunchError, match=rf"group {entry['cubin']} .*{p.name} is corrupted: sha256.*Reinstall or rebuild"):
        _load(ix.root, entry)


def test_a_truncated_or_missing_group_is_refused(one_entry_build):
    ix, entry = one_entry_build
    p = group_file(ix.root, entry)
    p.write_bytes(p.read_bytes()[:-40])
    with pytest.raises(LaunchError, match=rf"group {entry['cubin']} .* is corrupted"):
        _load(ix.root, entry)
    p.unlink()
    with pytest.raises(LaunchError, match=rf"cannot read group {entry['cubin']} .*Reinstall or rebuild"):
        _load(ix.root, entry)


def test_a_group_swapped_with_another_is_refused(one_entry_build):
    ix, entry = one_entry_build
    cubins, launchers = group_file(ix.root, entry, "cubin"), group_file(ix.root, entry, "launcher")
    assert cubins != launchers
    cubins.write_bytes(launchers.read_bytes())
    with pytest.raises(LaunchError, match=rf"group {entry['cubin']} .* is corrupted: sha256"):
        _load(ix.root, entry)


def test_an_index_naming_a_member_its_group_lacks_is_refused_at_lookup(one_entry_build, tmp_path):
    """Before any file of the group is read: the family index does not hold together."""
    root, entry = _copy(one_entry_build, tmp_path, "a")
    edit_family(root, entry["family"], lambda doc: doc["entries"][0].update(sha256="ab" * 32))
    with pytest.raises(LaunchError, match=r"names cubin abab.* in group .*which does not hold it"):
        Index(root).find(entry["family"], entry["op"], entry["key"], entry["arch"])
    root, entry = _copy(one_entry_build, tmp_path, "b")
    edit_family(root, entry["family"], lambda doc: doc["entries"][0].update(launcher="sm_9x.nowhere.0"))
    with pytest.raises(LaunchError, match=r"names launcher .* in group 'sm_9x.nowhere.0'"):
        Index(root).find(entry["family"], entry["op"], entry["key"], entry["arch"])


def test_a_member_whose_bytes_differ_is_refused_by_its_own_sha256(one_entry_build, tmp_path):
    """A group consistent with the index above it (a build that wrote the wrong bytes): the cubin's sha256."""
    root, entry = _copy(one_entry_build, tmp_path, "a")
    rewrite_group(root, entry, "cubin", lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:])
    with pytest.raises(LaunchError, match=r"cubin of .* in group .* is corrupted: sha256"):
        _load(root, entry)
    root, entry = _copy(one_entry_build, tmp_path, "b")  # a member said to reach past its group's end
    edit_family(root, entry["family"], lambda doc: doc["groups"][entry["cubin"]]["members"][entry["sha256"]].__setitem__(1, 10**9))
    with pytest.raises(LaunchError, match=r"corrupted: sha256"):
        _load(root, entry)


def test_a_stream_that_does_not_decompress_or_has_another_length(one_entry_build, tmp_path):
    root, entry = _copy(one_entry_build, tmp_path, "a")

    def garbage(doc):
        grp = doc["groups"][entry["cubin"]]
        blob = b"not xz at all"
        (root / grp["file"]).write_bytes(blob)
        grp["sha256"] = __import__("hashlib").sha256(blob).hexdigest()

    edit_family(root, entry["family"], garbage)
    with pytest.raises(LaunchError, match=rf"group {entry['cubin']} .* does not decompress"):
        _load(root, entry)
    root, entry = _copy(one_entry_build, tmp_path, "b")
    edit_family(root, entry["family"], lambda doc: doc["groups"][entry["cubin"]].update(bytes=7))
    with pytest.raises(LaunchError, match=r"holds \d+ bytes, its index says 7"):
        _load(root, entry)


def test_group_paths_outside_the_build_are_refused(one_entry_build, tmp_path):
    ix, entry = one_entry_build
    outside = tmp_path.parent / "outside.xz"
    outside.write_bytes(group_file(ix.root, entry).read_bytes())
    for where in ("../outside.xz", str(outside)):
        edit_family(ix.root, entry["family"], lambda doc: doc["groups"][entry["cubin"]].update(file=where))
        with pytest.raises(LaunchError, match="outside the build directory"):
            _load(ix.root, entry)


def test_a_family_index_changed_after_the_build_is_refused(one_entry_build):
    ix, entry = one_entry_build
    p = ix.root / "index" / f"{entry['family']}.sm_9x.json"
    text = p.read_text()
    assert '"split":true' in text
    p.write_text(text.replace('"split":true', '"split":false'))
    with pytest.raises(LaunchError, match=rf"index {entry['family']}.sm_9x .* is corrupted: sha256"):
        Index(ix.root).find(entry["family"], entry["op"], {"split": False}, entry["arch"])


def test_members_are_stored_once_and_groups_split_by_size(tmp_path):
    """One index per (family, arch series); in it identical cubins share one member, an op's cubins fill groups
    of about GROUP_BYTES, twins of one key on sm_100a and sm_103a side by side, and a few small launchers one
    group (big ones: tests/unit/runtime/test_cache.py); the tree is a function of its entries."""
    import hashlib

    from dsa_aot.policy.artifact import GROUP_BYTES

    shas = [hashlib.sha256(bytes([i]) * 800_000).hexdigest() for i in range(4)]
    blobs = {s: bytes([i]) * 800_000 for i, s in enumerate(shas)}
    lsha = hashlib.sha256(b"L = 1\n").hexdigest()
    launcher = {lsha: b"L = 1\n"}

    def entry(n, sha):
        return {"id": f"fam.op.{n}", "family": "csa_compressor", "op": "fwd", "key": {"n": n}, "arch": "sm_90a", "sha256": sha,
                "launcher_sha256": lsha, "kernels": ["k"], "params": {"k": [8]}}

    entries = [entry(0, shas[0]), entry(1, shas[0]), entry(2, shas[1]), entry(3, shas[2]), entry(4, shas[3])]
    twin = {(n, a): bytes([n]) * 599_999 + a.encode()[-2:-1] for n in (7, 8) for a in ("sm_100a", "sm_103a")}  # twins: one byte apart
    blobs |= {hashlib.sha256(b).hexdigest(): b for b in twin.values()}
    entries += [dict(entry(n, hashlib.sha256(twin[n, a]).hexdigest()), id=f"fam.op.{n}.{a}", arch=a) for a in ("sm_103a", "sm_100a") for n in (7, 8)]
    for root in (tmp_path / "a", tmp_path / "b"):
        write_build(root, entries, blobs | launcher)
    nine, ten = family_index(tmp_path / "a", "csa_compressor"), family_index(tmp_path / "a", "csa_compressor", "sm_100a")
    sizes = {g: v["bytes"] for doc in (nine, ten) for g, v in doc["groups"].items()}
    assert GROUP_BYTES == 2 << 20
    assert sizes == {"sm_9x.csa_compressor.fwd.0": 1_600_000, "sm_9x.csa_compressor.fwd.1": 1_600_000, "sm_9x.csa_compressor.launchers.0": 6,
                     "sm_10x.csa_compressor.fwd.0": 1_800_000, "sm_10x.csa_compressor.fwd.1": 600_000, "sm_10x.csa_compressor.launchers.0": 6,
                     }, sizes  # 0.8 MB members: two to a 2 MiB group
    assert [sum(len(v["members"]) for v in doc["groups"].values()) for doc in (nine, ten)] == [4 + 1, 4 + 1]  # distinct cubins, one launcher
    assert [e["cubin"] for e in nine["entries"]] == ["sm_9x.csa_compressor.fwd.0"] * 3 + ["sm_9x.csa_compressor.fwd.1"] * 2
    # sm_10x fills in the entries' order, the two arches of a key side by side: 7 sm_100a, 7 sm_103a, 8 sm_100a | 8 sm_103a
    assert [e["cubin"] for e in ten["entries"]] == [
        "sm_10x.csa_compressor.fwd.0", "sm_10x.csa_compressor.fwd.1", "sm_10x.csa_compressor.fwd.0", "sm_10x.csa_compressor.fwd.0"]
    members = ten["groups"]["sm_10x.csa_compressor.fwd.0"]["members"]
    assert sorted(members, key=lambda m: members[m][0]) == [  # in the stream's order
        hashlib.sha256(twin[k]).hexdigest() for k in ((7, "sm_100a"), (7, "sm_103a"), (8, "sm_100a"))]
    for f in sorted((tmp_path / "a").rglob("*")):
        if f.is_file():
            assert f.read_bytes() == (tmp_path / "b" / f.relative_to(tmp_path / "a")).read_bytes(), f
    ix = Index(tmp_path / "a")
    assert all(ix.member(e, "cubin") == blobs[e["sha256"]] for e in ix.entries)
    assert len(lzma.decompress((tmp_path / "a" / "packs" / "sm_9x.csa_compressor.fwd.0.xz").read_bytes())) == 1_600_000
    assert json.loads((tmp_path / "a" / "index.json").read_text())["arches"] == {"sm_90a": [0], "sm_100a": [0], "sm_103a": [0]}
