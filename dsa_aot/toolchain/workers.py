"""Worker pools for the fidelity stage's second look: cudnn's own compile path and the spec's, run the
way cudnn's JIT runs in production, keeping the PTX. (The first look runs in the canonical zygote.)

The DSL reads its environment once per process (``CUTE_DSL_ARCH`` among it), so workers are spawned
per target arch and import the DSL once each (about 2 s). The environment is production mode: no
``CUTE_DSL_KEEP`` / ``CUTE_DSL_DUMP_DIR``, and the DSL's file cache off, so every verdict rests on a
compile of this check. ``keep_ptx`` (a directory) is the one exception, for the second look the
fidelity stage takes at a kernel whose cubin depends on the compile process (docs/fidelity.md): it
keeps the PTX (keeping it does not change the PTX).

Public function: :func:`run_per_arch`.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

__all__ = ["run_per_arch", "production_env"]


def production_env(arch: str, keep_ptx: str | None = None) -> None:
    """Set this process's DSL environment (before the DSL is imported): only what cudnn's JIT has."""
    for k in [k for k in os.environ if k.startswith("CUTE_DSL_")]:
        del os.environ[k]
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"  # every artifact from a compile of this check, none from /tmp
    if keep_ptx:
        d = os.path.join(keep_ptx, arch, str(os.getpid()))  # kept files are named by kernel symbol, shared across keys
        os.makedirs(d, exist_ok=True)  # the DSL writes kept files only into an existing directory
        os.environ["CUTE_DSL_KEEP"] = "ptx"
        os.environ["CUTE_DSL_DUMP_DIR"] = d


def _init(arch: str, path: list, keep_ptx: str | None) -> None:
    sys.path[:] = path
    production_env(arch, keep_ptx)
    import cutlass  # noqa: F401  (pay the import once per worker)


def run_per_arch(items, arch_of, task, args_of, on_done, jobs=None, keep_ptx=None) -> None:
    """Run ``task(*args_of(item))`` for every item in spawned workers grouped by ``arch_of(item)``;
    call ``on_done(item, future)`` as each finishes (the future holds the result or the exception)."""
    jobs = max(1, jobs or os.cpu_count() or 1)
    by_arch: dict = {}
    for item in items:
        by_arch.setdefault(arch_of(item), []).append(item)
    for arch, group in sorted(by_arch.items()):
        with ProcessPoolExecutor(max_workers=min(jobs, len(group)), mp_context=get_context("spawn"), initializer=_init,
                                 initargs=(arch, list(sys.path), keep_ptx)) as pool:
            futs = {pool.submit(task, *args_of(item)): item for item in group}
            for fut in as_completed(futs):
                on_done(futs[fut], fut)
