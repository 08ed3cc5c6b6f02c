"""Compiled launchers, kept between processes: what makes ``preload()`` fast.

Compiling a lifted launcher's source to bytecode was 209 of the 285 ms that loading the 93 ``sm_90a``
entries took on the H200's host (bench/preload.py): each launcher is mostly literal data (kernel
names, parameter templates). The first process to load a launcher compiles it and writes the code
object here; later ones read it back (marshal, the format of Python's own .pyc files).

A cached file is used only for the launcher source whose sha256 the caller has just checked against
the build's index, and only if it is intact: it is named by that sha256 and the interpreter's cache
tag (and the launcher's path), and holds the source sha256 and the sha256 of the marshalled code it carries; anything else is
ignored and rewritten. The directory is ``$AOT_BYTECODE_CACHE``, else ``$XDG_CACHE_HOME/dsa-aot/
bytecode``, else ``~/.cache/dsa-aot/bytecode``; ``AOT_BYTECODE_CACHE=off`` (or a directory that cannot
be written) compiles every time. Writes are atomic (a temporary file renamed into place), so
processes and threads may share the directory.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import sys
import tempfile
from pathlib import Path

__all__ = ["code_for", "cache_dir"]

_MAGIC = b"dsa-aot bytecode 1\n"


def cache_dir() -> Path | None:
    """Where compiled launchers are kept (None: off)."""
    env = os.environ.get("AOT_BYTECODE_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsa-aot" / "bytecode"


def code_for(source: bytes, source_sha256: str, filename: str):
    """The code object of ``source`` (whose sha256, already checked by the caller, is ``source_sha256``)."""
    d = cache_dir()
    where = hashlib.sha256(filename.encode()).hexdigest()[:16]  # per install path: tracebacks name the file that runs
    path = d / f"{source_sha256}.{where}.{sys.implementation.cache_tag}" if d is not None else None
    if path is not None:
        try:
            blob = path.read_bytes()
        except OSError:
            blob = b""
        head = len(_MAGIC) + 64 + 64
        if blob.startswith(_MAGIC) and len(blob) > head:
            src_hex = blob[len(_MAGIC) : len(_MAGIC) + 64].decode("ascii", "replace")
            body_hex = blob[len(_MAGIC) + 64 : head].decode("ascii", "replace")
            body = blob[head:]
            if src_hex == source_sha256 and hashlib.sha256(body).hexdigest() == body_hex:
                try:
                    code = marshal.loads(body)
                except (EOFError, ValueError, TypeError):
                    code = None
                if code is not None and getattr(code, "co_filename", None) == filename:
                    return code
    code = compile(source, filename, "exec")
    if path is not None:
        _write(path, code, source_sha256)
    return code


def _write(path: Path, code, source_sha256: str) -> None:
    """Keep ``code`` for the next process; a cache that cannot be written is not an error."""
    body = marshal.dumps(code)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + source_sha256.encode() + hashlib.sha256(body).hexdigest().encode() + body)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass
