"""Compiled launchers, kept between processes: what makes ``preload()`` fast.

Compiling a lifted launcher's source to bytecode was 209 of the 285 ms that loading the 93 ``sm_90a``
entries took on the H200's host (bench/preload.py): each launcher is mostly literal data (kernel
names, parameter templates). The first process to load a launcher compiles it and writes the code
object here; later ones read it back (marshal, the format of Python's own .pyc files).

A kept file is used only for the launcher source whose sha256 the caller has just checked against
the build's index, and only if it is intact: it is named by that sha256 and the interpreter's cache
tag (and the launcher's path), and holds the source sha256 and the sha256 of the marshalled code it carries; anything else is
ignored and rewritten. Where it is kept, and how to turn it off: dsa_aot/runtime/cache.py.
"""

from __future__ import annotations

import hashlib
import marshal
import sys

from . import cache

__all__ = ["code_for"]

_MAGIC = b"dsa-aot bytecode 1\n"


def code_for(source: bytes, source_sha256: str, filename: str):
    """The code object of ``source`` (whose sha256, already checked by the caller, is ``source_sha256``)."""
    where = hashlib.sha256(filename.encode()).hexdigest()[:16]  # per install path: tracebacks name the file that runs
    name = f"{source_sha256}.{where}.{sys.implementation.cache_tag}"
    blob = cache.read("bytecode", name) or b""
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
    body = marshal.dumps(code)
    cache.write("bytecode", name, _MAGIC + source_sha256.encode() + hashlib.sha256(body).hexdigest().encode() + body)
    return code
