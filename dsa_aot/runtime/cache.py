"""What a process keeps on disk for the next one: decompressed cubins and launchers, and compiled launchers.

A fresh process's first call would otherwise decompress the xz group holding its cubin (up to 10 ms of a
36 ms first call on the H100's host) and compile its launcher's source (most of ``preload()``'s time before
the bytecode was kept: dsa_aot/runtime/bytecode.py). Everything kept is named by a sha256 the caller has
just taken from the build's checked index, and is used only if it still hashes to it: a damaged, foreign
or stale file is ignored and written again, so a cache can make a process faster but never load other
bytes than the build's.

The directory is ``$AOT_CACHE``, else ``$XDG_CACHE_HOME/dsa-aot``, else ``~/.cache/dsa-aot``, with one
subdirectory per kind (``members``, ``bytecode``); ``AOT_CACHE=off`` (or a directory that cannot be
written) keeps nothing. Writes are atomic (a temporary file renamed into place), so processes and threads
may share it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

__all__ = ["cache_dir", "read", "write", "member", "keep_member", "kept_members"]


def cache_dir(kind: str) -> Path | None:
    """Where things of ``kind`` are kept (None: off)."""
    env = os.environ.get("AOT_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0") else Path(env) / kind
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsa-aot" / kind


def read(kind: str, name: str) -> bytes | None:
    """The bytes kept as ``name``, or None."""
    d = cache_dir(kind)
    if d is None:
        return None
    try:
        with open(d / name, "rb") as f:
            return f.read()
    except OSError:
        return None


def write(kind: str, name: str, data: bytes) -> None:
    """Keep ``data`` as ``name``; a cache that cannot be written is not an error."""
    d = cache_dir(kind)
    if d is None:
        return
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, d / name)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def member(sha256: str) -> bytes | None:
    """A cubin or launcher source kept by an earlier process, if it still has this sha256."""
    data = read("members", sha256)
    return data if data is not None and hashlib.sha256(data).hexdigest() == sha256 else None


def kept_members() -> set:
    """The sha256 names of the kept copies (listed, not read nor checked: :func:`member` does that when one is used)."""
    d = cache_dir("members")
    try:
        return set(os.listdir(d)) if d is not None else set()
    except OSError:
        return set()


def keep_member(sha256: str, data: bytes) -> None:
    write("members", sha256, data)
