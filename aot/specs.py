"""The table of kernel families and the small vocabulary their spec files use.

Spec files live in the repository's ``kernels/`` directory (one per family) and are loaded by file
path from the fixed table below, never from a name found in a manifest. They are build-time only:
the wheel does not ship them, and loading one imports neither cutlass nor cudnn (those are imported
inside ``build``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["Choice", "IntRange", "Op", "FAMILIES", "KNOWN_ARCHES", "kernels_dir", "spec_source_hash"]

# Arches CuTe DSL compiles for without a GPU (DESIGN.md); the wheel can hold any of them.
KNOWN_ARCHES = frozenset({"sm_90a", "sm_100a", "sm_100f", "sm_103a"})

# family name -> spec file in kernels/. Adding a family = adding a file and a line here.
FAMILY_FILES = {
    "csa_compressor": "csa_compressor.py",
    "dsa_indexer_backward": "dsa_indexer_backward.py",
    "dsa_sparse_attention_backward": "dsa_sparse_attention_backward.py",
}


@dataclass(frozen=True)
class Choice:
    """A field that takes one of a fixed set of values (bools compared as bools, not ints)."""

    values: tuple

    def __init__(self, *values):
        object.__setattr__(self, "values", tuple(values))

    def accepts(self, v) -> bool:
        return any(type(v) is type(a) and v == a for a in self.values)

    def describe(self) -> str:
        return ", ".join(repr(v) for v in self.values)


@dataclass(frozen=True)
class IntRange:
    """An integer field in [lo, hi] that is a multiple of ``step``."""

    lo: int
    hi: int
    step: int = 1

    def accepts(self, v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and self.lo <= v <= self.hi and v % self.step == 0

    def describe(self) -> str:
        s = f"integers in [{self.lo}, {self.hi}]"
        return s + (f", multiples of {self.step}" if self.step > 1 else "")


@dataclass(frozen=True)
class Op:
    """One compiled entry point of a family: its key fields and cross-field rules.

    ``check(key) -> str | None`` explains an invalid combination; ``requires(key)`` lists other
    (op, key) entries the runtime will need alongside this one (e.g. a reduction kernel).
    """

    fields: dict
    check: Callable[[dict], Any] = field(default=lambda key: None)
    requires: Callable[[dict], list] = field(default=lambda key: [])
    arches: frozenset | None = None  # the arches the kernel exists for (None: any)

    def invalid(self, key: dict):
        return self.check(key)

    def normalise(self, key: tuple) -> tuple:
        return tuple(sorted(key))


def kernels_dir() -> Path:
    """Where spec files are read from: $AOT_KERNELS_DIR or the repository's kernels/."""
    env = os.environ.get("AOT_KERNELS_DIR")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "kernels"


def spec_source_hash(family: str) -> str:
    return hashlib.sha256((kernels_dir() / FAMILY_FILES[family]).read_bytes()).hexdigest()


class _Families(Mapping):
    """family -> loaded spec module, loaded on first use (no work at import)."""

    def __init__(self):
        self._mods = {}

    def __getitem__(self, name):
        if name not in FAMILY_FILES:
            raise KeyError(name)
        if name not in self._mods:
            path = kernels_dir() / FAMILY_FILES[name]
            spec = importlib.util.spec_from_file_location(f"aot_kernels_{name}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            self._mods[name] = mod
        return self._mods[name]

    def __iter__(self):
        return iter(FAMILY_FILES)

    def __len__(self):
        return len(FAMILY_FILES)


FAMILIES = _Families()
