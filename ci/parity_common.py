"""What the JIT-vs-AOT parity scripts share (ci/parity_csa.py, ci/parity_indexer.py).

* the import blocker of the AOT side (cutlass and cudnn must not be importable there);
* timing: first call (synchronised) and warm host microseconds per call, ``torch.add`` yardstick;
* NaN / 0xFF poisoning of outputs and workspaces;
* the cubin a JIT-compiled function really loads (``loaded_cubin``);
* bitwise comparison, index.json key matching, run metadata.

torch is imported lazily (the compare step and ``--help`` need no GPU).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import platform
import statistics
import sys
import time

__all__ = [
    "Blocker",
    "install_blocker",
    "first_call",
    "warm_us",
    "device_us",
    "torch_add_us",
    "nan_like",
    "poisoned_workspace",
    "loaded_cubin",
    "runtime_stats",
    "meta",
    "bitwise",
    "key_match",
    "selected",
]

# ------------------------------------------------------------------------------------------------
# AOT side: the JIT toolchain must not be importable
# ------------------------------------------------------------------------------------------------


class Blocker(importlib.abc.MetaPathFinder):
    """Makes the JIT toolchain unimportable in this process: the AOT runtime must not need it."""

    BLOCKED = ("cutlass", "cudnn")

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.BLOCKED:
            raise ImportError(f"{fullname} is blocked in the aot parity process (the runtime must not import it)")
        return None


def install_blocker():
    """Put a :class:`Blocker` first on sys.meta_path; refuse if the toolchain is already imported."""
    if not any(isinstance(f, Blocker) for f in sys.meta_path):
        sys.meta_path.insert(0, Blocker())
    for mod in list(sys.modules):
        if mod.split(".")[0] in Blocker.BLOCKED:
            raise SystemExit(f"{mod} was imported before the blocker was installed")
    try:
        spec = importlib.util.find_spec("cutlass")
    except ImportError:
        spec = None
    assert spec is None, "cutlass is importable in the aot process"


# ------------------------------------------------------------------------------------------------
# Timing (torch only)
# ------------------------------------------------------------------------------------------------


def first_call(fn):
    """Wall seconds of one synchronised call."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def warm_us(fn, calls, sync_every=None):
    """Median host microseconds per call; the device is synchronised only outside the timed calls.

    ``sync_every``: synchronise (untimed) after every that many calls, so that ops whose device time
    exceeds their host time cannot fill the launch queue and make the host wait inside a call.
    None: only before and after the loop.
    """
    import torch

    fn()
    torch.cuda.synchronize()
    samples = []
    for i in range(calls):
        if sync_every and i and i % sync_every == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    return statistics.median(samples) / 1e3


def device_us(fn, calls=20):
    """Device microseconds per call, back to back: CUDA events around ``calls`` calls, synchronised.

    When the device is the bottleneck this is the kernels' time per call; when the host is, it is
    the host's (the device idles between launches)."""
    import torch

    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / calls


def torch_add_us(calls):
    import torch

    a = torch.ones(16, device="cuda")
    b = torch.ones(16, device="cuda")
    return warm_us(lambda: torch.add(a, b), calls)


# ------------------------------------------------------------------------------------------------
# Poisoning
# ------------------------------------------------------------------------------------------------


def nan_like(t):
    import torch

    return torch.full_like(t, float("nan"))


def poisoned_workspace(nbytes):
    import torch

    return torch.full((max(int(nbytes), 1),), 0xFF, dtype=torch.uint8, device="cuda")


# ------------------------------------------------------------------------------------------------
# JIT side: the cubin a compiled function loads
# ------------------------------------------------------------------------------------------------


def loaded_cubin(fn):
    """The cubin the JIT loads: the one embedded in the host module's fatbin (kernels_binary).

    ``fn.__cubin__`` is bytes with some DSL library builds and a dump-file path with others.
    """
    from aot import ir
    from aot.cubin import extract_cubins_from_fatbin

    host = fn.ir_module.operation.get_asm(print_generic_op_form=True)
    cubins = extract_cubins_from_fatbin(ir.attr_bytes(ir.parse_module(host).globals["kernels_binary"].props["value"]))
    return cubins[0] if len(cubins) == 1 else None


# ------------------------------------------------------------------------------------------------
# Metadata
# ------------------------------------------------------------------------------------------------


def _jsonable(v):
    if isinstance(v, dict):
        return {(k if isinstance(k, str) else repr(k)): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)


def runtime_stats(aot_pkg=None):
    """Whatever cubin-load statistics aot.runtime exposes (optional; probed defensively)."""
    try:
        runtime = importlib.import_module("aot.runtime")
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return {"error": repr(exc)}
    found = {}
    for name in ("load_stats", "cubin_load_ms", "stats", "load_times"):
        obj = getattr(runtime, name, None)
        if obj is None:
            continue
        try:
            found[name] = _jsonable(obj() if callable(obj) else obj)
        except Exception as exc:  # noqa: BLE001
            found[name] = repr(exc)
    return found


def meta(torch):
    props = torch.cuda.get_device_properties(0)
    return {"python": platform.python_version(), "torch": torch.__version__, "device": props.name, "sm_count": props.multi_processor_count}


# ------------------------------------------------------------------------------------------------
# Compare helpers
# ------------------------------------------------------------------------------------------------


def bitwise(a, b):
    """(equal, differing element count) for same-shape tensors, NaN-safe."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False, -1
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    n = int((a.view(view) != b.view(view)).sum())
    return n == 0, n


def key_match(entry, want):
    """Every field of the JIT key equals the entry's (looked up in entry["key"], then the entry)."""
    key = entry.get("key", {})
    return all(key.get(k, entry.get(k)) == v for k, v in want.items())


def selected(args, name):
    """--only: comma-separated substrings of case names (empty: every case)."""
    return not args.only or any(part and part in name for part in args.only.split(","))
