"""An entry directory (``<build>/entries/<id>/``) as the stages share it: the one reader of its ``meta.json``.

Compile writes ``meta.json`` last (its presence marks a finished compile: family, op, key, arch, target, tool
versions, cache key, seconds); lift, verify, fidelity, shards and pack read it through :func:`read_meta`.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CompileError

__all__ = ["META", "read_meta"]

META = "meta.json"


def read_meta(entry_dir) -> dict:
    """The entry's meta.json; CompileError naming the directory when it is missing or unreadable."""
    p = Path(entry_dir) / META
    try:
        meta = json.loads(p.read_text())
    except FileNotFoundError:
        raise CompileError(f"{p}: missing: the entry was not compiled (or its compile was cut off); run python -m dsa_aot build") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CompileError(f"{p}: unreadable ({e}); delete the entry directory and rebuild it") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("id"), str):
        raise CompileError(f"{p}: not an entry's metadata (no id); delete the entry directory and rebuild it")
    return meta
