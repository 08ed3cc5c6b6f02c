"""Integer helpers the policies share."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers."""
    return -(-int(a) // int(b))


def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m``."""
    return cdiv(x, m) * int(m)


def prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out
