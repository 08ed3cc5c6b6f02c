"""What a wrapper passes to ``cute.compile``, taken from the wrapper itself (build time, inside a spec).

Most specs mirror upstream's fake arguments by hand (``kernels/<family>.py``'s ``build``). cudnn's MoE grouped
GEMM wrappers build theirs deep inside (operand descriptors, symbolic extents and divisibilities per recipe,
layout form and weight mode: ``gemm/cutedsl/grouped/*/_blockscaled_api.py``), so a spec of theirs runs the
wrapper on CUDA-presenting CPU tensors (a :class:`dsa_aot.toolchain.fidelity.Upstream`) and stops it at its
``cute.compile``: the kernel object and arguments it would have compiled are the spec's, by construction.
Fidelity still runs the wrapper unstopped and compares the cubins.

A module of its own, imported only by the specs that use it: what the compile processes import is part of
every entry's compile key (dsa_aot.toolchain.zygote).
"""

from __future__ import annotations

__all__ = ["compile_args", "aligned_on_host"]


class _Stop(Exception):
    pass


def compile_args(route):
    """Run ``route()`` (under an Upstream) until its first ``cute.compile``: ``(fn, args, kwargs)`` it was called with.

    Refuses a route that returns without compiling (upstream answered from a cache the route did not clear)."""
    import cutlass.cute as cute

    seen = []

    def stop(fn, *args, **kwargs):
        seen.append((fn, args, kwargs))
        raise _Stop

    real = cute.compile
    cute.compile = stop
    try:
        route()
    except _Stop:
        return seen[0]
    finally:
        cute.compile = real
    raise RuntimeError("the route returned without calling cute.compile (a compile cache it did not clear?)")


def aligned_on_host(up, *names, align=256):
    """``up.on_host(*names)`` with every allocation ``align``-byte aligned: upstream wraps its compile-time
    workspace with ``from_dlpack(..., assumed_align=128)``, which refuses a CPU allocation that is not."""
    import torch

    from .fidelity import _cuda_like

    like, real_empty = _cuda_like(), torch.empty  # the real factory: the patched ones call it

    def make(*size, dtype=None, fill=None):
        size = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        dtype = dtype or torch.get_default_dtype()
        nbytes = real_empty(size, dtype=dtype, device="meta").numel() * real_empty((), dtype=dtype).element_size()
        raw = real_empty(nbytes + align, dtype=torch.uint8)
        t = raw[(-raw.data_ptr()) % align:][:nbytes].view(dtype).view(size)
        return like(t.fill_(fill) if fill is not None else t)

    def strided(size, stride, dtype=None, device=None, **k):
        base = make(max(1, 1 + sum((s - 1) * st for s, st in zip(size, stride))), dtype=dtype)
        return like(torch.Tensor.as_subclass(base, torch.Tensor).as_strided(size, stride))

    factories = {"empty": lambda *size, dtype=None, device=None, **k: make(*size, dtype=dtype),
                 "full": lambda size, fill_value, dtype=None, device=None, **k: make(size, dtype=dtype, fill=fill_value),
                 "empty_strided": strided}
    for name in names:
        if name not in factories:
            raise ValueError(f"aligned_on_host: no aligned {name}")
        up.patch(torch, name, factories[name])
