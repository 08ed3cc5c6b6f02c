"""Runtime: load the shipped cubins with cuda-python and launch them.

Imports no toolchain module and does nothing at import (stdlib and cuda-python only; the generated
launchers are loaded on first use). Public API:

  preload(device=None)  load every entry of this build for the device's arch; returns {entry id: load ms}
  entries()             the build's index entries
  load_stats()          {(entry id, device): load ms} of every entry loaded so far

The contract the ops keep (details in :mod:`dsa_aot.runtime.loaded`):

* Threads: any number of threads may call any op at once, each on its own tensors and stream. An
  entry's parameter buffers are filled and launched under that entry's lock, so each launch carries
  its own call's bytes, dims and stream; the first load of an entry on a device happens once.
* Devices: an op runs on the device of its tensors, whatever the current device; a stream of another
  device is refused (InputError).
* Refusals: every argument is checked before the first write, allocation, memset or launch; a refused
  call raises an dsa_aot.errors class and leaves nothing behind.
* Integrity: index.json is checked against index.sha256, a family's index and every group of cubins
  against the sha256 the index above it records, every cubin and launcher against its own after
  decompression, and the launcher's kernels and parameter sizes against the index, before the
  first launch (LaunchError naming the file otherwise). A cubin or launcher an earlier process kept
  (dsa_aot/runtime/cache.py) is used only if it hashes to the index's sha256, and its group's file is
  still read and checked.
* CUDA graphs: the first call of an op may be inside torch.cuda.graph capture: loading an entry only
  reads files and calls cuLibraryLoadData / cuKernelSetAttribute, which are not stream work, and the
  launches and memsets are captured. preload() before capture keeps file reads and loads out of it.
"""

from __future__ import annotations

__all__ = ["preload", "entries", "load_stats"]


def entries() -> list:
    from .index import index

    return list(index().entries)


def preload(device=None) -> dict:
    """Load (cuLibraryLoadData + per-device set-up) every entry this device would run: its arch's, of the
    target its SM count picks where the build has several.

    After this, no op call on ``device`` reads a file or queries the driver before launching; call it
    before CUDA-graph capture or latency-sensitive serving. Returns {entry id: load ms}.

    The cubins and launchers no earlier process kept (dsa_aot/runtime/cache.py) are decompressed first, in
    threads; then the entries load one after another:
    with 8 threads the 93 ``sm_90a`` entries took longer on the H200 (107-122 ms against 85-87 ms,
    bench/preload.py), the driver's module loads do not overlap.
    """
    from .device import device as device_info
    from .device import device_index, primary_context
    from .index import index, nearest

    dev = device_index(device)
    ix = index()
    arch = ix.arch_for(dev)
    primary_context(dev)
    sms = device_info(dev).sm_count
    # per key, the target this GPU's SM count picks (its own, else the nearest): not the other targets' copies
    chosen = [nearest(by_sms, sms) for by_sms in ix.keys(arch).values()]
    ix.prefetch([e for e in chosen if (e["id"], dev) not in ix._loaded])
    loads = {e["id"]: ix.loaded(e, dev).load_ms for e in chosen}
    ix.drop_groups()  # every entry this device runs is loaded: its groups' bytes are not needed again
    return loads


def load_stats() -> dict:
    """{(entry id, device): load ms} for every entry loaded so far in this process."""
    from .index import index

    return {k: v.load_ms for k, v in index()._loaded.items()}
