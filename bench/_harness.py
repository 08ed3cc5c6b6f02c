"""What the host-cost benchmarks share: the AOT side runs with the toolchain blocked, and a call is
timed alone (it only enqueues work; the device is synchronised every ``every`` calls, outside the
timing, so the launch queue never fills). Benchmark subprocesses import it from this directory."""

from __future__ import annotations

import os
import sys
import time

__all__ = ["block_toolchain", "per_call"]


def block_toolchain() -> None:
    """Make cutlass, cudnn and tvm_ffi unimportable in this process (the AOT side needs none of them): the
    parity harness's blocker, one for both."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ci", "parity"))
    from harness import install_blocker

    install_blocker()


def per_call(fn, calls: int, warm: int = 20, every: int = 20) -> list:
    """Nanoseconds of each of ``calls`` calls of ``fn`` after ``warm`` untimed ones."""
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ns = []
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        ns.append(time.perf_counter_ns() - t0)
        if i % every == every - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return ns
