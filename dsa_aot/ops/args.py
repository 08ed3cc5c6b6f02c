"""What a compiled call passes and re-checks per call: the host-function argument forms of tensors the lifted
launchers take, and the footprints (pointers, alignment, overlap) the fast paths compare."""

from __future__ import annotations


__all__ = ["lookup", "signature", "footprint", "recheck", "recheck_ptrs", "row_major", "tensor_args", "flat_args", "cute_args", "writes_only"]


def lookup(cache: dict, key):
    """``cache.get(key)``, None for an unhashable key (the full validation then says what is wrong)."""
    try:
        return cache.get(key) if key is not None else None
    except TypeError:
        return None


def signature(ts, extra):
    """What full validation of a call depends on, except data pointers and per-call scalars: (type,
    shape, dtype, device, layout, contiguity) per tensor (None allowed) plus ``extra``; None when an
    argument is not a tensor (the full validation reports it)."""
    try:
        # scalars keyed with their type: 2.0 == 2 and True == 1 hash alike, and are not the same argument
        return tuple(None if t is None else (type(t), t.shape, t.dtype, t.device, t.layout, t.is_contiguous()) for t in ts) + tuple(
            (type(x), x) for x in extra)
    except (AttributeError, RuntimeError, TypeError):
        return None


def footprint(ts, writes, masks=None, sizes=None) -> list:
    """What a cached validation keeps so that :func:`recheck` can redo the per-call checks on integers:
    each tensor's byte size (None: 0; ``sizes`` {index: bytes} overrides, e.g. the workspace bytes
    used), its alignment mask (default 15), the indices of the tensors the op writes, and the last
    pointers that passed (the validated call's own)."""
    nbytes = [0 if t is None else t.numel() * t.element_size() for t in ts]
    for i, n in (sizes or {}).items():
        if ts[i] is not None:
            nbytes[i] = n
    return [tuple(nbytes), tuple(masks or (15,) * len(ts)), tuple(writes), tuple(0 if t is None else t.data_ptr() for t in ts)]


def recheck(ts, foot):
    """The checks a call's signature does not prove, made per call on its data pointers (see
    :func:`recheck_ptrs`): the pointers of ``ts`` when they pass, else None."""
    return recheck_ptrs(tuple([0 if t is None else t.data_ptr() for t in ts]), foot)


def recheck_ptrs(ptrs, foot):
    """``ptrs`` (a call's data pointers, 0 for an absent tensor) when each is aligned to its mask and no
    written tensor overlaps another's bytes; else None (the full validation then runs and says what is
    wrong). ``foot``: from :func:`footprint` at validation.

    The same pointers as the last call that passed (a training loop's usual case) pass at once: sizes,
    masks and pointers are all the checks read. Threads may race on that memo; it only ever holds a
    tuple that passed."""
    nbytes, masks, writes, last = foot
    if ptrs == last:
        return ptrs
    for p, m in zip(ptrs, masks):
        if p & m:
            return None
    for i in writes:
        a0, n = ptrs[i], nbytes[i]
        if n:
            a1 = a0 + n
            for j, b0 in enumerate(ptrs):
                if j != i and nbytes[j] and b0 < a1 and a0 < b0 + nbytes[j]:
                    return None
    foot[3] = ptrs
    return ptrs


def row_major(shape) -> list:
    """Strides of a compact row-major buffer of ``shape``."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return stride[::-1]


def tensor_args(t, ptr):
    """A contiguous tensor as the JIT host code takes it: pointer (``ptr``: the tensor's, as a plan
    records it), extents (i32), every stride but the unit innermost one (i64)."""
    return (ptr, *t.shape, *t.stride()[:-1])


def flat_args(ptr, shape):
    """A device pointer viewed as a compact row-major ``shape``, in the form of :func:`tensor_args`."""
    return (ptr, *shape, *row_major(shape)[:-1])


def cute_args(ptr, shape, dynamic, fully_dynamic=False):
    """A row-major buffer as a compiled host function takes it: pointer, its dynamic extents (the modes
    in ``dynamic``), then its dynamic strides: every stride but the unit one when the tensor type is
    fully dynamic (wide mode), else those that span a dynamic extent (compact types)."""
    stride = row_major(shape)
    last = max(dynamic, default=-1)
    strides = [stride[i] for i in range(len(shape) - 1) if fully_dynamic or i < last]
    return (ptr, *(shape[i] for i in dynamic), *strides)


def writes_only(*args, **kwargs):
    """The torch.library fake of an ``_into`` op: it returns nothing (its schema marks what it writes)."""
    return None
