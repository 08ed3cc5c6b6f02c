"""Integer (and fp32-scale) arithmetic of the host code: how each op is written in launcher code, and
how it folds when both operands are constants.

Folding follows LLVM exactly on unsigned ``bits``-wide values. Where LLVM leaves the result undefined
(division or remainder by zero, INT_MIN / -1, a shift by the width or more) the lift fails instead of
picking a value. The launcher computes the same ops at run time with ``dsa_aot.runtime.lifted``; that is
run-time code, so the toolchain keeps its own folding here rather than importing the runtime.
"""

from __future__ import annotations

import math
import operator
import struct

from ...errors import LiftError
from .values import mask, signed

# op -> (launcher code: a format over {a}, {b}, {m}, or a helper called as fn(a, b, bits); is a helper)
BINOPS = {
    "llvm.fmul": ("f32mul", True),  # host-side scale folding (softmax_scale * log2(e)), on bit patterns
    "llvm.add": ("(({a} + {b}) & {m})", False),
    "llvm.sub": ("(({a} - {b}) & {m})", False),
    "llvm.mul": ("(({a} * {b}) & {m})", False),
    "llvm.and": ("({a} & {b})", False),
    "llvm.or": ("({a} | {b})", False),
    "llvm.xor": ("({a} ^ {b})", False),
    "llvm.shl": ("shl", True),
    "llvm.lshr": ("lshr", True),
    "llvm.ashr": ("ashr", True),
    "llvm.udiv": ("udiv", True),
    "llvm.urem": ("urem", True),
    "llvm.sdiv": ("sdiv", True),
    "llvm.srem": ("srem", True),
}
ICMP = {0: "==", 1: "!=", 2: "slt", 3: "sle", 4: "sgt", 5: "sge", 6: "<", 7: "<=", 8: ">", 9: ">="}
SIGNED = {"slt": "<", "sle": "<=", "sgt": ">", "sge": ">="}  # signed predicate -> its order on sx() values

_WRAP = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "and": operator.and_, "or": operator.or_, "xor": operator.xor}
_F32 = struct.Struct("<f")
_FLT_MAX = _F32.unpack(b"\xff\xff\x7f\x7f")[0]


class _Undefined(Exception):
    """LLVM gives this op no defined result for these operands."""


def fold(name, a, b, bits, where):
    """The constant result of binary op ``name`` on unsigned ``bits``-wide ``a`` and ``b``."""
    kind = name.split(".", 1)[1]  # llvm.udiv -> udiv
    try:
        if kind in _WRAP:
            return _WRAP[kind](a, b) & mask(bits)
        if kind == "fmul":
            return _f32mul(a, b, bits)
        if kind in ("shl", "lshr", "ashr"):
            return _shift(kind, a, b, bits) & mask(bits)
        return _divide(kind, a, b, bits) & mask(bits)
    except _Undefined as e:
        raise LiftError(f"{where}: constant {name} is undefined ({e})") from None


def _shift(kind, a, b, bits):
    if b >= bits:  # LLVM: poison
        raise _Undefined(f"{kind} by {b} of an i{bits}")
    return a << b if kind == "shl" else (a if kind == "lshr" else signed(a, bits)) >> b


def _divide(kind, a, b, bits):
    """udiv/urem/sdiv/srem: the quotient rounds toward zero, so a remainder takes the dividend's sign."""
    x, y = (a, b) if kind[0] == "u" else (signed(a, bits), signed(b, bits))
    if y == 0 or (x == -(1 << (bits - 1)) and y == -1):  # an unsigned x is never negative
        raise _Undefined(f"i{bits} {kind} of {x} by {y}")
    q = abs(x) // abs(y) * (1 if (x < 0) == (y < 0) else -1)
    return q if kind.endswith("div") else x - q * y


def _f32mul(a, b, bits):
    """IEEE fp32 a * b on bit patterns, rounding to nearest even: the double product of two fp32
    values is exact, so converting it to fp32 is the one rounding the fp32 product makes."""
    if bits != 32:
        raise _Undefined(f"fmul of {bits}-bit values (only fp32 is modelled)")
    x = _F32.unpack(a.to_bytes(4, "little"))[0] * _F32.unpack(b.to_bytes(4, "little"))[0]
    if math.isfinite(x) and abs(x) > _FLT_MAX:
        # past FLT_MAX: within half its ulp (2**103) rounds down to FLT_MAX, from there (ties to even) to inf
        x = math.copysign(_FLT_MAX if abs(x) < _FLT_MAX + 2.0**103 else math.inf, x)
    return int.from_bytes(_F32.pack(x), "little")


def compare(pred, a, b, bits):
    """icmp ``pred`` (an ICMP value) on unsigned ``bits``-wide constants."""
    if pred in SIGNED:
        a, b, pred = signed(a, bits), signed(b, bits), SIGNED[pred]
    return {"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[pred]
