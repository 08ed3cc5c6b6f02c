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


def compile_args(up, route):
    """Run ``route()`` under ``up`` until its first ``cute.compile``: ``(fn, args, kwargs)`` it was called with.

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

    def factory(real):
        def make(*size, dtype=None, device=None, fill=None, **kw):
            if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
                size = tuple(size[0])
            dtype = dtype or torch.get_default_dtype()
            n = 1
            for s in size:
                n *= int(s)
            size_b = n * real_empty((), dtype=dtype).element_size()
            raw = real_empty(size_b + align, dtype=torch.uint8)
            off = (-raw.data_ptr()) % align
            t = raw[off:off + size_b].view(dtype).view(size)
            if fill is not None:
                t.fill_(fill)
            return like(t)
        return make

    for name in names:
        if name == "empty":
            up.patch(torch, "empty", factory(torch.empty))
        elif name == "full":
            make = factory(torch.empty)
            up.patch(torch, "full", lambda size, fill_value, dtype=None, device=None, **k: make(size, dtype=dtype, fill=fill_value))
        elif name == "empty_strided":
            make = factory(torch.empty)

            def strided(size, stride, dtype=None, device=None, **k):
                base = make(max(1, 1 + sum((s - 1) * st for s, st in zip(size, stride))), dtype=dtype)
                return like(torch.Tensor.as_subclass(base, torch.Tensor).as_strided(size, stride))
            up.patch(torch, "empty_strided", strided)
        else:
            raise ValueError(f"aligned_on_host: no aligned {name}")
