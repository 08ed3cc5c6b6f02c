"""Fake tensors for the specs' ``build`` (kernels/<family>.py): what upstream hands ``cute.compile``.

Build time only; cutlass is imported when a helper is called, not when this module loads (a spec
imports it at load, see :mod:`dsa_aot.toolchain.specs`).
"""

__all__ = ["dlpack"]


def dlpack(dtype, rank, align=16, div=1):
    """A dense tensor as upstream's ``to_cute_tensor`` presents a contiguous CUDA tensor: gmem, ``align``-byte
    aligned, dynamic extents, dynamic strides but the unit innermost one; ``div``: the innermost extent and
    every stride divisible by it (a ``mark_compact_shape_dynamic`` divisibility)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    if div == 1:
        shape = tuple(cute.sym_int() for _ in range(rank))
        stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
    else:
        shape = tuple(cute.sym_int() for _ in range(rank - 1)) + (cute.sym_int(divisibility=div),)
        stride = tuple(cute.sym_int64(divisibility=div) for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(dtype, shape, stride, memspace=cute.AddressSpace.gmem, assumed_align=align)
