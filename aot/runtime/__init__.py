"""Runtime: load shipped cubins with cuda-python and launch them. Imports no toolchain.

Nothing happens at import. Public API:
  preload(device=None)  load every entry of this build for the device's arch (returns load ms per entry)
  entries()             the build's index entries
"""

from __future__ import annotations

__all__ = ["preload", "entries", "load_stats"]


def entries() -> list:
    from .registry import index

    return list(index().entries)


def preload(device=None) -> dict:
    """Load (cuLibraryLoadData + per-device set-up) every entry built for this device's arch.

    After this, no op call on ``device`` reads a file or queries the driver before launching;
    use it before CUDA-graph capture or latency-sensitive serving. Returns {entry id: load ms}.
    """
    import torch

    from ..errors import ArchMismatchError
    from .registry import device_arches, device_index, index

    dev = device_index(device)
    ix = index()
    cap = torch.cuda.get_device_capability(dev)
    arches = [a for a in device_arches(cap) if a in ix.arches]
    if not arches:
        raise ArchMismatchError(f"GPU {dev} (compute capability {cap[0]}.{cap[1]}) has no cubins in this build (it has: {', '.join(ix.arches)})")
    out = {}
    for e in ix.entries:
        if e["arch"] == arches[0]:
            out[e["id"]] = ix.loaded(e, dev).load_ms
    return out


def load_stats() -> dict:
    """{(entry id, device): load ms} for every entry loaded so far in this process."""
    from .registry import index

    return {k: v.load_ms for k, v in index()._loaded.items()}
