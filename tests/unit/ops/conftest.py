"""The ops' CPU tests run on the small build with the stand-in driver in place of the GPU."""

import contextlib

import pytest
import torch

import stand_in
from dsa_aot.ops import declare
from dsa_aot.runtime.index import Index


def _fresh_caches(monkeypatch) -> None:
    """Every op's per-process caches emptied (every op is declared: declare.clear_caches)."""
    declare.clear_caches()


@pytest.fixture
def env(small_build, monkeypatch) -> stand_in.Driver:
    """The stand-in driver over the small build, with every op's per-process caches emptied."""
    _fresh_caches(monkeypatch)
    return stand_in.install(monkeypatch, Index(small_build))


@pytest.fixture
def sm100_env(sm100_build, monkeypatch) -> stand_in.Driver:
    """The stand-in driver, as a capability-10.0 GPU with 148 SMs, over the SM100 build."""
    _fresh_caches(monkeypatch)
    return stand_in.install(monkeypatch, Index(sm100_build), capability=(10, 0), sm_count=148)


@pytest.fixture
def torch_steps(monkeypatch):
    """The ops' torch steps (the score recomputes' transposed weights / LSE copy) on the stand-in's CPU
    tensors: no CUDA stream to enter on a CPU-only torch."""
    import dsa_aot.ops.gpu as support
    import dsa_aot.ops.dsa_score_recompute as op

    for mod in (op, support):  # (gpu.max_lengths reads THD maxima)
        monkeypatch.setattr(mod, "alloc_on", lambda stream, dev: contextlib.nullcontext())
    for fn in (op.sparse_indexer_score_recompute, op.sparse_attn_score_recompute):  # declared: the generated forms hold their own
        monkeypatch.setitem(fn.__globals__, "alloc_on", lambda stream, dev: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
