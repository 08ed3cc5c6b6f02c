"""Key vocabulary of the policies: the fields an op is compiled over and the rules between them.

An :class:`Op` is one compiled entry point of a family. A manifest gives each field a value (or a
list), the build compiles one entry per combination, and the runtime looks entries up by these fields.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Choice", "IntRange", "F32", "Op"]


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
class F32:
    """A float field whose value a kernel bakes in as a float32 constant: any finite value that is its own
    float32 rounding (two doubles with one float32 give one cubin: list the float32 value)."""

    def accepts(self, v) -> bool:
        import struct

        if not isinstance(v, float) or v != v or v in (float("inf"), float("-inf")):
            return False
        try:
            return struct.unpack("<f", struct.pack("<f", v))[0] == v
        except OverflowError:
            return False

    def describe(self) -> str:
        return "finite float32 values (write the float32 rounding of the value, e.g. 0.0883883461356163 for 1/sqrt(128))"


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
