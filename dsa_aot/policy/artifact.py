"""The shipped build's on-disk contract, one piece for both sides of it.

A build directory holds ``index.json`` (its sha256 in ``index.sha256`` beside it) whose entries name their
cubin and launcher by relative path and sha256. :mod:`dsa_aot.toolchain.pack` writes it and checks a finished
build with this code before it ships (``check-build``); :mod:`dsa_aot.runtime.index` checks it with the same
code when it loads, so what passes the build's check is what the runtime accepts. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import KernelNotFoundError, LaunchError

__all__ = ["load_index", "read_checked", "lookup_key", "lookup_fields"]


def read_checked(root: Path, rel, sha256: str, what: str) -> bytes:
    """The bytes of build file ``rel`` (inside ``root``), refused unless their sha256 is ``sha256``."""
    if not isinstance(rel, str) or not isinstance(sha256, str):
        raise LaunchError(f"the build's index names a {what} as {rel!r} with sha256 {sha256!r} (expected strings). Reinstall or rebuild the wheel")
    # a relative path of plain names stays inside the build (checked on the string: resolving every file's
    # path took 26 ms of a 93-entry preload on the H200's host)
    parts = rel.split("/")
    if rel.startswith("/") or "\\" in rel or any(x in ("", ".", "..") for x in parts):
        raise LaunchError(f"the build's index names {what} {rel!r}, outside the build directory {root}. Reinstall or rebuild the wheel; nothing was launched")
    path = os.path.join(root, rel)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise LaunchError(f"cannot read {what} {path}: {e.strerror}. Reinstall or rebuild the wheel; nothing was launched") from None
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise LaunchError(f"{what} {path} is corrupted: sha256 {got} != {sha256} recorded at build time. Reinstall or rebuild the wheel; nothing was launched")
    return data


def lookup_fields(d: dict, derived=()) -> tuple:
    """Key fields ``d`` as the index looks them up (hashable, in order), ``derived`` ones left out."""
    return tuple(sorted((k, v) for k, v in d.items() if k not in derived))


_FIELDS = {"id": str, "family": str, "op": str, "key": dict, "arch": str, "cubin": str, "sha256": str, "launcher": str,
           "launcher_sha256": str, "kernels": list, "params": dict}


def lookup_key(e):
    """The key ``e`` is looked up by (the op's own key fields: derived ones, such as a schedule list,
    are not looked up), or None when the entry lacks a field the runtime needs."""
    if not isinstance(e, dict) or any(not isinstance(e.get(k), t) for k, t in _FIELDS.items()):
        return None
    derived = e.get("derived", ("schedule",))
    if not isinstance(derived, list | tuple):
        return None
    if "target" in e and not (isinstance(e["target"], dict) and isinstance(e["target"].get("sm_count"), int)):
        return None
    try:
        k = lookup_fields(e["key"], derived)
        hash(k)
    except TypeError:
        return None
    return k


def load_index(root: Path):
    """``index.json`` of build directory ``root``, checked: against ``index.sha256``, its format, not a debug build
    (unless AOT_ALLOW_DEBUG_BUILD=1), every entry's fields. Returns (the document, each entry's lookup key)."""
    path = root / "index.json"
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise KernelNotFoundError(
            f"no build found: {path} is missing. Build the kernels first: `python -m dsa_aot build` (from a source checkout) or install the dsa-aot wheel"
        ) from None
    except OSError as e:
        raise LaunchError(f"cannot read {path}: {e.strerror}. Reinstall or rebuild the wheel") from None
    try:
        want = (root / "index.sha256").read_text().strip()
    except OSError:
        raise LaunchError(f"{root / 'index.sha256'} is missing: the build is incomplete. Reinstall or rebuild the wheel") from None
    if hashlib.sha256(text).hexdigest() != want:
        raise LaunchError(f"{path} is corrupted: its sha256 is not the one in index.sha256. Reinstall or rebuild the wheel; nothing was launched")
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise LaunchError(f"{path} is not valid JSON ({e}). Reinstall or rebuild the wheel") from None
    if not isinstance(doc, dict) or doc.get("format") != 1:
        raise KernelNotFoundError(f"{path}: index format {doc.get('format') if isinstance(doc, dict) else None!r} is not 1; rebuild with this version of dsa-aot")
    if doc.get("for_shipping") is False and os.environ.get("AOT_ALLOW_DEBUG_BUILD") != "1":
        raise LaunchError(f"{path} is a debug build (compiled with --debug-dump), not for shipping; rebuild without it, "
                          f"or set AOT_ALLOW_DEBUG_BUILD=1 to use it anyway")
    entries = doc.get("entries")
    keys = [lookup_key(e) for e in (entries if isinstance(entries, list) else [None])]  # each entry's key, built once
    bad = [i for i, k in enumerate(keys) if k is None]
    if bad:
        raise LaunchError(f"{path}: {len(bad)} malformed entries (first: #{bad[0]}). Reinstall or rebuild the wheel")
    return doc, keys
