"""What a process keeps for the next (dsa_aot/runtime/cache.py) and how much of a group a load decompresses
(dsa_aot/policy/artifact.py): a kept member is used only while it hashes to the index's sha256 and its group's
file is intact; a group is decompressed only up to the member asked for."""

import hashlib
import lzma
import os

import pytest
from build_files import family_index, group_file, write_build

from dsa_aot.errors import LaunchError
from dsa_aot.policy import artifact
from dsa_aot.runtime import cache
from dsa_aot.runtime.index import Index


def _members(d):
    return sorted(p.name for p in (d / "members").iterdir()) if (d / "members").is_dir() else []


def _no_lzma(monkeypatch):
    class Refuse:
        def __init__(self, *a, **k):
            raise AssertionError("decompressed a group")

    monkeypatch.setattr(artifact.lzma, "LZMADecompressor", Refuse)


def test_a_kept_member_serves_the_next_process_without_decompressing(one_entry_build, own_cache, monkeypatch):
    ix, entry = one_entry_build
    cubin, launcher = ix.member(entry, "cubin"), ix.member(entry, "launcher")
    assert _members(own_cache) == sorted([entry["sha256"], entry["launcher_sha256"]])
    _no_lzma(monkeypatch)
    fresh = Index(ix.root)  # the next process
    assert fresh.member(entry, "cubin") == cubin and fresh.member(entry, "launcher") == launcher
    assert hashlib.sha256(cubin).hexdigest() == entry["sha256"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_a_damaged_group_is_refused_even_with_its_members_kept(one_entry_build, damage):
    ix, entry = one_entry_build
    ix.member(entry, "cubin")  # kept
    p = group_file(ix.root, entry)
    data = bytearray(p.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 1
    elif damage == "truncate":
        data = data[:-40]
    else:
        data = bytearray(group_file(ix.root, entry, "launcher").read_bytes())
    p.write_bytes(bytes(data))
    with pytest.raises(LaunchError, match=rf"group {entry['cubin']} .* is corrupted: sha256"):
        Index(ix.root).member(entry, "cubin")


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "another member"])
def test_a_damaged_or_foreign_kept_member_is_ignored_and_written_again(one_entry_build, own_cache, damage):
    ix, entry = one_entry_build
    cubin = ix.member(entry, "cubin")
    kept = own_cache / "members" / entry["sha256"]
    data = bytearray(kept.read_bytes())
    if damage == "flip":
        data[100] ^= 1
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(ix.member(entry, "launcher"))
    kept.write_bytes(bytes(data))
    assert Index(ix.root).member(entry, "cubin") == cubin
    assert kept.read_bytes() == cubin  # rewritten from the group


def test_off_or_unwritable_keeps_nothing_and_still_serves(one_entry_build, monkeypatch, tmp_path):
    ix, entry = one_entry_build
    monkeypatch.setenv("AOT_CACHE", "off")
    assert cache.cache_dir("members") is None
    got = Index(ix.root).member(entry, "cubin")
    assert hashlib.sha256(got).hexdigest() == entry["sha256"]
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("AOT_CACHE", str(blocker))
    assert Index(ix.root).member(entry, "cubin") == got
    monkeypatch.delenv("AOT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir("members") == tmp_path / "xdg" / "dsa-aot" / "members"


def _three_member_build(root):
    """One op's three cubins of 300 kB in one group (and their three launchers in another)."""
    blobs, entries = {}, []
    for n in range(3):
        cubin, launcher = os.urandom(300_000), f"N = {n}\n".encode()
        c, l_ = hashlib.sha256(cubin).hexdigest(), hashlib.sha256(launcher).hexdigest()
        blobs |= {c: cubin, l_: launcher}
        entries.append({"id": f"csa_compressor.fwd.{n}.sm_90a", "family": "csa_compressor", "op": "fwd", "key": {"n": n}, "arch": "sm_90a",
                        "sha256": c, "launcher_sha256": l_, "kernels": ["k"], "params": {"k": [8]}})
    write_build(root, entries, blobs)
    return Index(root), blobs


def test_a_group_is_decompressed_up_to_the_member_asked_for(tmp_path):
    ix, blobs = _three_member_build(tmp_path)
    first, _, last = ix.entries
    assert ix.member(first, "cubin") == blobs[first["sha256"]]
    (stream,) = [s for g, s in ix._groups.items() if g == first["cubin"]]
    assert len(stream.data) == 300_000 and not stream.dec.eof  # the first member only, of 900 kB
    assert ix.member(last, "cubin") == blobs[last["sha256"]]
    assert len(stream.data) == 900_000


def test_a_group_whose_stream_is_longer_or_shorter_than_its_index_says_is_refused(tmp_path):
    from build_files import edit_family

    for said in (899_999, 900_001):
        root = tmp_path / str(said)
        ix, _ = _three_member_build(root)
        edit_family(root, "csa_compressor", lambda d: d["groups"][ix.entries[0]["cubin"]].update(bytes=said))
        ix = Index(root)
        assert ix.member(ix.entries[0], "cubin")  # the stream so far is as long as its index allows
        with pytest.raises(LaunchError, match=rf"holds 900000 bytes, its index says {said}"):
            ix.member(ix.entries[2], "cubin")


def test_prefetch_reads_each_group_once_and_loads_then_read_no_group(tmp_path, monkeypatch):
    ix, blobs = _three_member_build(tmp_path)
    opened = []
    real = artifact._Stream
    monkeypatch.setattr(artifact, "_Stream", lambda root, name, grp: opened.append(name) or real(root, name, grp))
    ix.prefetch(ix.entries)
    assert sorted(opened) == sorted({e["cubin"] for e in ix.entries} | {e["launcher"] for e in ix.entries})
    _no_lzma(monkeypatch)
    for e in ix.entries:
        assert ix.member(e, "cubin") == blobs[e["sha256"]] and ix.member(e, "launcher") == blobs[e["launcher_sha256"]]
    assert len(opened) == 2
    ix.drop_groups()
    assert not ix._members and not ix._groups


def test_prefetch_leaves_kept_members_to_the_loads_and_decompresses_the_others(tmp_path, monkeypatch):
    ix, blobs = _three_member_build(tmp_path)
    first = ix.entries[0]
    for e in ix.entries:
        ix.member(e, "cubin"), ix.member(e, "launcher")  # kept now
    cache.cache_dir("members").joinpath(first["sha256"]).unlink()
    ix = Index(tmp_path)
    fetched = []
    real = ix.member
    monkeypatch.setattr(ix, "member", lambda e, what: fetched.append((e["id"], what)) or real(e, what))
    ix.prefetch(ix.entries)
    assert fetched == [(first["id"], "cubin")] and list(ix._members) == [first["sha256"]]
    _no_lzma(monkeypatch)
    cache.cache_dir("members").joinpath(first["sha256"]).unlink()  # the fetched one is served from memory, the rest kept copies
    assert all(real(e, "cubin") == blobs[e["sha256"]] for e in ix.entries)


def test_launchers_fill_groups_of_group_bytes_too(tmp_path):
    big = [f"# {n}\n".encode() + os.urandom(900_000) for n in range(3)]
    entries, blobs = [], {}
    cubin = b"\x7fELF"
    for n, src in enumerate(big):
        sha = hashlib.sha256(src).hexdigest()
        blobs[sha] = src
        entries.append({"id": f"csa_compressor.fwd.{n}.sm_90a", "family": "csa_compressor", "op": "fwd", "key": {"n": n}, "arch": "sm_90a",
                        "sha256": hashlib.sha256(cubin).hexdigest(), "launcher_sha256": sha, "kernels": ["k"], "params": {"k": [8]}})
    blobs[entries[0]["sha256"]] = cubin
    write_build(tmp_path, entries, blobs)
    groups = family_index(tmp_path, "csa_compressor")["groups"]
    assert {g: v["bytes"] for g, v in groups.items() if "launchers" in g} == {
        "sm_9x.csa_compressor.launchers.0": sum(map(len, big[:2])), "sm_9x.csa_compressor.launchers.1": len(big[2])}
    assert artifact.GROUP_BYTES == 2 << 20 and len(lzma.decompress((tmp_path / groups["sm_9x.csa_compressor.launchers.1"]["file"]).read_bytes())) == len(big[2])
