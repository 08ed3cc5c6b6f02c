"""The compiled-launcher cache (dsa_aot/runtime/bytecode.py, kept where dsa_aot/runtime/cache.py says): a second load reads the code it kept; a
damaged, foreign or unwritable cache is never used and never an error."""

import hashlib

import pytest

from build_files import launcher_source, rewrite_group

from dsa_aot.runtime import bytecode
from dsa_aot.runtime.index import Index

SRC = b"X = 1\ndef launch(a):\n    return a + X\n"
SHA = hashlib.sha256(SRC).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AOT_CACHE", str(tmp_path / "c"))
    compiled = []
    real = compile
    monkeypatch.setattr(bytecode, "compile", lambda *a: (compiled.append(a[1]), real(*a))[1], raising=False)
    return tmp_path / "c" / "bytecode", compiled


def _run(code):
    ns = {}
    exec(code, ns)  # noqa: S102
    return ns["launch"](41)


def test_the_second_load_uses_the_kept_code(cache):
    d, compiled = cache
    assert _run(bytecode.code_for(SRC, SHA, "/x/l.py")) == 42
    assert _run(bytecode.code_for(SRC, SHA, "/x/l.py")) == 42
    assert compiled == ["/x/l.py"] and len(list(d.iterdir())) == 1
    # another install path of the same launcher: its own file, so tracebacks name the file that runs
    assert bytecode.code_for(SRC, SHA, "/y/l.py").co_filename == "/y/l.py"
    assert compiled == ["/x/l.py", "/y/l.py"]


@pytest.mark.parametrize("damage", ["flip a body byte", "truncate", "garbage", "other source sha"])
def test_a_damaged_or_foreign_cache_file_is_ignored_and_rewritten(cache, damage):
    d, compiled = cache
    bytecode.code_for(SRC, SHA, "/x/l.py")
    (f,) = d.iterdir()
    blob = bytearray(f.read_bytes())
    if damage == "flip a body byte":
        blob[-5] ^= 0xFF
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    elif damage == "garbage":
        blob = bytearray(b"\0" * 300)
    else:  # a file under this name whose header names another source
        blob = blob.replace(SHA.encode(), hashlib.sha256(b"other").hexdigest().encode(), 1)
    f.write_bytes(bytes(blob))
    assert _run(bytecode.code_for(SRC, SHA, "/x/l.py")) == 42
    assert compiled == ["/x/l.py", "/x/l.py"]  # compiled again
    assert _run(bytecode.code_for(SRC, SHA, "/x/l.py")) == 42
    assert compiled == ["/x/l.py", "/x/l.py"]  # and the rewritten file is used


def test_off_or_unwritable_compiles_every_time(cache, monkeypatch, tmp_path):
    _, compiled = cache
    monkeypatch.setenv("AOT_CACHE", "off")
    for _ in range(2):
        assert _run(bytecode.code_for(SRC, SHA, "/x/l.py")) == 42
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("AOT_CACHE", str(blocker / "c"))
    for _ in range(2):
        assert _run(bytecode.code_for(SRC, SHA, "/x/l.py")) == 42
    assert len(compiled) == 4


def test_a_launcher_changed_on_disk_is_refused_before_any_kept_code_is_used(one_entry_build, monkeypatch, tmp_path):
    from dsa_aot.errors import LaunchError
    from dsa_aot.runtime import loaded

    monkeypatch.setenv("AOT_CACHE", str(tmp_path / "c"))
    ix, entry = one_entry_build
    loaded._launcher_module(ix, entry)  # keeps its source and its code
    assert list((tmp_path / "c" / "bytecode").iterdir()) and list((tmp_path / "c" / "members").iterdir())
    rewrite_group(ix.root, entry, "launcher", lambda b: b"# changed\n" + b)  # and the index resealed over it
    # the kept source stands for the one the index names (its sha256): the changed bytes never run
    assert Index(ix.root).member(entry, "launcher") == launcher_source(ix.root, entry).encode()
    assert not launcher_source(ix.root, entry).startswith("# changed")
    for f in (tmp_path / "c" / "members").iterdir():
        f.unlink()
    with pytest.raises(LaunchError, match="launcher of .* is corrupted: sha256"):
        loaded._launcher_module(Index(ix.root), entry)
