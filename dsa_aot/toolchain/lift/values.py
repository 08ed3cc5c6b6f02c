"""The abstract values of the lifter and the host memory they live in.

A value is a constant (:class:`K`), a residual expression over the entry's arguments (:class:`S`),
constant bytes (:class:`B`), a pointer into a modelled :class:`Region` (:class:`P`), an aggregate
(:class:`A`), a kernel handle (:class:`KH`), a host pointer cast to an integer (:class:`PI`) or
:data:`POISON`. Integers are kept unsigned, ``bits`` wide, like the launcher code computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import ir
from ...errors import LiftError


@dataclass(frozen=True)
class K:  # constant integer, stored unsigned
    v: int
    bits: int


@dataclass(frozen=True)
class S:  # residual expression, bound to a local name in the emitted code
    name: str
    bits: int
    status: bool = False  # result of a shim call (a CUDA status)
    okwhen: object = None  # for icmp(status, 0): the truth value that means success


@dataclass(frozen=True)
class B:  # constant bytes (string constants)
    data: bytes


@dataclass(frozen=True)
class P:  # pointer into a modelled region
    region: "Region"
    off: int


@dataclass(frozen=True)
class A:  # aggregate (struct / array value)
    items: tuple


@dataclass(frozen=True)
class KH:  # a kernel handle, named by its kernel global
    glob: str


@dataclass(frozen=True)
class PI:  # a host-memory pointer cast to an integer: only an inttoptr back is understood
    ptr: object


class _Poison:
    def __repr__(self):
        return "poison"


POISON = _Poison()


class Region:
    """Memory of one alloca or global: offset -> (size, scalar value)."""

    # where a kernel parameter's slot goes in the param buffer when the cubin gives no layout; an
    # alloca overrides it with its own alignment (a TMA descriptor is 64-byte aligned)
    align = 8

    def __init__(self, name, size):
        self.name, self.size, self.fields = name, size, {}

    def __repr__(self):
        return f"<{self.name}>"

    def store(self, off, size, value, where):
        if off < 0 or off + size > self.size:
            raise LiftError(f"{where}: store of {size} bytes at offset {off} outside {self.name} ({self.size} bytes)")
        for o, (s, _) in list(self.fields.items()):
            if not (o < off + size and off < o + s):
                continue
            # a store may replace whole earlier fields; half-overwriting one would need byte-level memory
            if not (off <= o and o + s <= off + size):
                raise LiftError(f"{where}: store [{off}, {off + size}) partly overlaps an earlier store [{o}, {o + s}) in {self.name}")
            del self.fields[o]
        self.fields[off] = (size, value)

    def load(self, off, size, where):
        f = self.fields.get(off)
        if f is None:
            for o, (s, _) in self.fields.items():
                if o < off + size and off < o + s:
                    raise LiftError(f"{where}: load [{off}, {off + size}) straddles a stored field [{o}, {o + s}) in {self.name}")
            return POISON  # never written: what the JIT leaves there is undefined
        if f[0] != size:
            raise LiftError(f"{where}: load of {size} bytes at {off} reads a {f[0]}-byte field in {self.name}")
        return f[1]


def mask(bits):
    return (1 << bits) - 1


def signed(v, bits):
    """Unsigned ``bits``-wide value -> Python signed int."""
    return v - (1 << bits) if v >> (bits - 1) else v


def flatten(t, value, base=0):
    """(offset, size, scalar value) for every scalar of ``value`` laid out as type ``t``."""
    if isinstance(t, (ir.Int, ir.Float, ir.Ptr)) or isinstance(value, B):
        return [(base, ir.sizeof(t), value)]
    if value is POISON:
        return []
    if not isinstance(t, (ir.Struct, ir.Array)):
        raise LiftError(f"cannot store type {t}")
    if not isinstance(value, A):
        raise LiftError(f"storing {value!r} as {'struct' if isinstance(t, ir.Struct) else 'array'} {t}")
    if isinstance(t, ir.Struct):
        parts = zip(t.fields, ir.field_offsets(t))
    else:
        step = ir.sizeof(t.elem) if t.n == 0 else ir.sizeof(t) // t.n
        parts = ((t.elem, i * step) for i in range(len(value.items)))
    out = []
    for (ft, off), v in zip(parts, value.items):
        out += flatten(ft, v, base + off)
    return out


@dataclass
class Launch:
    kernel: str  # kernel global name
    dims: tuple  # 8 values: grid xyz, block xyz, smem, stream
    attrs: list  # [(id, {offset: K})]
    params: list  # [(type, Region)]
