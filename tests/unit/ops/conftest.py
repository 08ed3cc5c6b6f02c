"""The ops' CPU tests run on the small build with the stand-in driver in place of the GPU."""

import contextlib

import pytest
import torch

import stand_in
from dsa_aot.ops import declare
from dsa_aot.runtime.index import Index


@pytest.fixture
def env(small_build, monkeypatch) -> stand_in.Driver:
    """The stand-in driver over the small build, with every op's per-process caches emptied."""
    import dsa_aot.ops.csa_compressor as csa
    import dsa_aot.ops.dsa_dense_indexer_backward as didx
    import dsa_aot.ops.dsa_score_recompute as srec
    import dsa_aot.ops.dsa_indexer_backward as ib
    import dsa_aot.ops.dsa_indexer_forward as ifw
    import dsa_aot.ops.dsa_sparse_attention_backward as sab
    import dsa_aot.ops.dsa_sparse_attention_forward as saf
    import dsa_aot.ops.dsa_indexer_top_k  # noqa: F401 (declared ops: declare.clear_caches below)
    import dsa_aot.ops.dsa_topk_utils  # noqa: F401

    for mod, name in ((csa, "_FWD"), (csa, "_BWD"), (ib, "_CALLS"), (sab, "_CALLS"), (ifw, "_CALLS"), (saf, "_CALLS"), (didx, "_CALLS"), (srec, "_CALLS"), (srec, "_ATTN_CALLS"), (srec, "_DENSE_CALLS"), (srec, "_DATTN_CALLS")):
        monkeypatch.setattr(mod, name, {})
    declare.clear_caches()
    return stand_in.install(monkeypatch, Index(small_build))


@pytest.fixture
def sm100_env(sm100_build, monkeypatch) -> stand_in.Driver:
    """The stand-in driver, as a capability-10.0 GPU with 148 SMs, over the SM100 build."""
    import dsa_aot.ops.dsa_indexer_forward as ifw
    import dsa_aot.ops.dsa_sparse_attention_forward as saf

    import dsa_aot.ops.dsa_indexer_forward_top_k as ftk

    import dsa_aot.ops.dsa_dense_indexer_backward as didx

    import dsa_aot.ops.dsa_score_recompute as srec

    for mod in (ifw, saf, ftk, didx, srec):
        monkeypatch.setattr(mod, "_CALLS", {})
    for name in ("_ATTN_CALLS", "_DENSE_CALLS", "_DATTN_CALLS"):
        monkeypatch.setattr(srec, name, {})
    return stand_in.install(monkeypatch, Index(sm100_build), capability=(10, 0), sm_count=148)


@pytest.fixture
def torch_steps(monkeypatch):
    """The ops' torch steps (the score recomputes' transposed weights / LSE copy) on the stand-in's CPU
    tensors: no CUDA stream to enter on a CPU-only torch."""
    import dsa_aot.ops._support as support
    import dsa_aot.ops.dsa_score_recompute as op

    for mod in (op, support):  # (_support.max_lengths reads THD maxima)
        monkeypatch.setattr(mod, "alloc_on", lambda stream, dev: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
