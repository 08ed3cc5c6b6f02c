"""Helpers the generated launchers call: exact LLVM integer semantics on unsigned Python ints.

Values are kept unsigned in [0, 2**bits). Where LLVM would leave a result undefined (division by zero,
signed overflow of INT_MIN / -1, shifting by the width or more), raise instead of guessing.
"""

from ..errors import LaunchError

__all__ = ["LaunchError", "f32bits", "f32mul", "sx", "shl", "lshr", "ashr", "udiv", "urem", "sdiv", "srem"]


_F32 = __import__("struct").Struct("<f")


def f32bits(x):
    """A Python float -> the bit pattern of the fp32 the kernel receives (round to nearest)."""
    return int.from_bytes(_F32.pack(x), "little")


def sx(v, bits):
    """Unsigned ``bits``-wide value -> Python signed int."""
    return v - (1 << bits) if v >> (bits - 1) else v


def _undefined(what):
    raise LaunchError(f"launcher arithmetic is undefined: {what}. The op wrapper should have rejected these inputs; please report it")


def shl(a, b, bits):
    if b >= bits:
        _undefined(f"shift left by {b} of an i{bits}")
    return (a << b) & ((1 << bits) - 1)


def lshr(a, b, bits):
    if b >= bits:
        _undefined(f"shift right by {b} of an i{bits}")
    return a >> b


def ashr(a, b, bits):
    if b >= bits:
        _undefined(f"shift right by {b} of an i{bits}")
    return (sx(a, bits) >> b) & ((1 << bits) - 1)


def udiv(a, b, bits):
    if b == 0:
        _undefined(f"i{bits} division by zero")
    return a // b


def urem(a, b, bits):
    if b == 0:
        _undefined(f"i{bits} remainder by zero")
    return a % b


def sdiv(a, b, bits):
    x, y = sx(a, bits), sx(b, bits)
    if y == 0 or (x == -(1 << (bits - 1)) and y == -1):
        _undefined(f"i{bits} signed division {x} / {y}")
    q = abs(x) // abs(y)
    return (q if (x < 0) == (y < 0) else -q) & ((1 << bits) - 1)


def srem(a, b, bits):
    x, y = sx(a, bits), sx(b, bits)
    if y == 0 or (x == -(1 << (bits - 1)) and y == -1):
        _undefined(f"i{bits} signed remainder {x} % {y}")
    r = abs(x) % abs(y)
    return (r if x >= 0 else -r) & ((1 << bits) - 1)


_FLT_MAX = 3.4028234663852886e38


def f32mul(a, b, bits=32):
    """IEEE fp32 a * b on bit patterns, round to nearest even: the double product of two fp32 values
    is exact, so one rounding to fp32 is the fp32 product."""
    x = _F32.unpack(a.to_bytes(4, "little"))[0] * _F32.unpack(b.to_bytes(4, "little"))[0]
    try:
        return int.from_bytes(_F32.pack(x), "little")
    except OverflowError:  # beyond FLT_MAX: rounds to FLT_MAX within half an ulp (2**103), else to inf
        m = _FLT_MAX if abs(x) < _FLT_MAX + 2.0**103 else float("inf")
        return int.from_bytes(_F32.pack(m if x > 0 else -m), "little")
