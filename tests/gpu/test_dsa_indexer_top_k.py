"""The indexer top-k on the GPU against the reference (tests/gpu/ref_indexer_top_k.py): the shipped
entries at two shapes each (bucket edges, both occupancy variants), outputs poisoned before each
launch, rows of every length (0, < top_k, all columns), ties under every tie-break, the
speculative stagger, the row-chunk loop past the int32 scratch limit, graph capture, empty calls and
the refusals that must come before any write. Threads, devices and torch.ops run over this op in
test_runtime_safety.py / test_library.py / test_plans.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

import ref_indexer_top_k as ref  # noqa: E402
from refutil import generator  # noqa: E402

DEV = "cuda:0"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _inputs(rows, cols, dtype=torch.float32, seed=0, next_n=1, levels=None):
    """Values (distinct unless ``levels``: that many distinct values, ties everywhere) and lengths
    covering 0, fewer than 2048, and every column."""
    g = generator(seed)
    if levels:
        x = torch.randint(0, levels, (rows, cols), generator=g).float() - levels / 2
    else:
        x = torch.randn((rows, cols), generator=g)
    batch = rows // next_n
    lens = torch.randint(0, cols + 1, (batch,), generator=g, dtype=torch.int32)
    lens[0] = cols
    if batch > 2:
        lens[1], lens[2] = 0, min(cols, 700)
    return x.to(dtype).to(DEV), lens.to(DEV)


def _run(x, lens, top_k, **kw):
    """The _into form into poisoned outputs (every element must be written), then the allocating form."""
    import dsa_aot.dsa

    rows = x.shape[0]
    rv = kw.get("return_val", True)
    idx = torch.full((rows, top_k), 0x7EADBEEF, dtype=torch.int32, device=DEV)
    val = torch.full((rows, top_k), float("nan"), dtype=x.dtype, device=DEV) if rv else None
    ws = torch.empty(dsa_aot.dsa.indexer_top_k_workspace_bytes(x), dtype=torch.uint8, device=DEV)
    dsa_aot.dsa.indexer_top_k_into(idx, val, x, lens, top_k, workspace=ws, **kw)
    out = dsa_aot.dsa.indexer_top_k(x, lens, top_k, **kw)
    torch.cuda.synchronize()
    assert (out["values"] is None) == (not rv)
    return idx, val, out


def _check(x, lens, idx, val, top_k, next_n=1, tie_break=0, deterministic=False):
    problems = ref.check(x, lens, idx, val, top_k, next_n, tie_break, deterministic)
    assert not problems, problems[:5]


# (rows, cols): both occupancy variants (rows > 148), a bucket's top edge, one past it, the middle
SHAPES = [(8, 4096), (200, 4097), (37, 65536), (160, 100000)]


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_float32_top_2048_matches_the_reference(rows, cols, deterministic):
    x, lens = _inputs(rows, cols, seed=rows + cols)
    idx, val, out = _run(x, lens, 2048, deterministic=deterministic)
    _check(x, lens, idx, val, 2048, deterministic=deterministic)
    _check(x, lens, out["indices"], out["values"], 2048, deterministic=deterministic)
    if deterministic:  # one defined answer: bitwise the reference's, and the same from both forms
        want, want_v = ref.expected(x, lens, 2048)
        assert torch.equal(idx.cpu(), want) and torch.equal(out["indices"].cpu(), want) and torch.equal(val.cpu(), want_v)


@pytest.mark.parametrize("cols", [1, 3, 100, 2048])
@pytest.mark.parametrize("rows", [2, 150])
def test_short_contexts_use_their_own_small_buckets(rows, cols):
    """A decode at a short context: fewer columns than top_k, every valid id chosen, the rest padded."""
    x, lens = _inputs(rows, cols, seed=cols)
    idx, val, out = _run(x, lens, 2048, deterministic=True)
    want, want_v = ref.expected(x, lens, 2048)
    assert torch.equal(idx.cpu(), want) and torch.equal(val.cpu(), want_v) and torch.equal(out["indices"].cpu(), want)
    idx, val, _ = _run(x, lens, 2048)
    _check(x, lens, idx, val, 2048)


@pytest.mark.parametrize("rows,cols", [(8, 8192), (300, 131072)])
def test_without_values(rows, cols):
    x, lens = _inputs(rows, cols, seed=3)
    idx, _, out = _run(x, lens, 2048, return_val=False)
    _check(x, lens, idx, None, 2048)
    _check(x, lens, out["indices"], None, 2048)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("rows,cols", [(16, 16384), (150, 32768)])
def test_half_precision_values_with_ties(dtype, rows, cols):
    x, lens = _inputs(rows, cols, DTYPES[dtype], seed=5)  # 16-bit values of randn: many equal values in a row
    idx, val, out = _run(x, lens, 2048)
    _check(x, lens, idx, val, 2048)
    _check(x, lens, out["indices"], out["values"], 2048)


@pytest.mark.parametrize("top_k", [512, 1024])
@pytest.mark.parametrize("rows,cols", [(4, 4096), (149, 16000)])
def test_smaller_top_k(top_k, rows, cols):
    x, lens = _inputs(rows, cols, seed=top_k)
    idx, val, _ = _run(x, lens, top_k)
    _check(x, lens, idx, val, top_k)


@pytest.mark.parametrize("rows,cols", [(16, 8192), (300, 32768)])
def test_next_n_2_staggers_the_lengths(rows, cols):
    x, lens = _inputs(rows, cols, seed=11, next_n=2)
    idx, val, _ = _run(x, lens, 2048, next_n=2)
    _check(x, lens, idx, val, 2048, next_n=2)
    n = ref.lengths(lens, rows, 2, cols)
    assert n[0] == cols - 1 and n[1] == cols and (idx[0] >= 0).sum() == min(cols - 1, 2048)  # batch 0: all columns, staggered


@pytest.mark.parametrize("tie_break", [1, 2])
@pytest.mark.parametrize("rows,cols", [(8, 4096), (200, 65536)])
def test_tie_breaks_choose_the_defined_ids(tie_break, rows, cols):
    x, lens = _inputs(rows, cols, seed=tie_break, levels=40)  # every cutoff falls in a run of equal values
    idx, val, _ = _run(x, lens, 2048, tie_break=tie_break)
    _check(x, lens, idx, val, 2048, tie_break=tie_break)


def test_deterministic_with_ties_keeps_the_smaller_ids_and_repeats():
    x, lens = _inputs(64, 65536, seed=9, levels=16)
    a, _, _ = _run(x, lens, 2048, deterministic=True)
    b, _, _ = _run(x, lens, 2048, deterministic=True)
    _check(x, lens, a, None, 2048, deterministic=True)
    assert torch.equal(a, b)


def test_rows_past_the_int32_scratch_are_launched_in_chunks():
    """fp32, 65536 columns: 2 x 65536 scratch words per row, so 16384 rows fit one launch; 16392 rows
    take two (16384 + 8), as upstream's loop launches them."""
    import dsa_aot.dsa

    rows, cols = 16392, 65536
    g = torch.Generator(device=DEV).manual_seed(21)
    x = torch.randn((rows, cols), generator=g, device=DEV)  # 4.3 GB, made on the GPU
    lens = torch.randint(2000, 3000, (rows,), generator=g, dtype=torch.int32, device=DEV)
    idx = torch.full((rows, 2048), 0x7EADBEEF, dtype=torch.int32, device=DEV)
    val = torch.full((rows, 2048), float("nan"), device=DEV)
    ws = torch.empty(dsa_aot.dsa.indexer_top_k_workspace_bytes(x), dtype=torch.uint8, device=DEV)
    plan = dsa_aot.dsa.IndexerTopK(idx, val, x, lens, 2048, deterministic=True, workspace=ws)
    assert "l1.fire()" in plan.source and "l2" not in plan.source  # two launches
    plan.execute(idx, val, x, lens, ws)
    torch.cuda.synchronize()
    for lo, hi in ((0, 4), (16380, 16392)):  # both sides of the chunk boundary, and the last rows
        _check(x[lo:hi], lens[lo:hi], idx[lo:hi], val[lo:hi], 2048, deterministic=True)
    assert not (idx == 0x7EADBEEF).any() and not torch.isnan(val).any()


def test_the_first_call_captures_in_a_cuda_graph_and_replays_on_new_values():
    import dsa_aot.dsa
    import dsa_aot.ops.dsa_indexer_top_k as op

    op.TOP_K.cache.clear()
    x, lens = _inputs(96, 32768, seed=30)
    idx = torch.full((96, 2048), -1, dtype=torch.int32, device=DEV)
    val = torch.full((96, 2048), float("nan"), device=DEV)
    ws = torch.empty(dsa_aot.dsa.indexer_top_k_workspace_bytes(x), dtype=torch.uint8, device=DEV)
    s = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        dsa_aot.dsa.indexer_top_k_into(idx, val, x, lens, 2048, deterministic=True, workspace=ws)
    for seed in (31, 32):
        nx, nl = _inputs(96, 32768, seed=seed)
        x.copy_(nx)
        lens.copy_(nl)
        idx.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        want, want_v = ref.expected(x, lens, 2048)
        assert torch.equal(idx.cpu(), want) and torch.equal(val.cpu(), want_v)


def test_empty_calls():
    import dsa_aot.dsa

    none = dsa_aot.dsa.indexer_top_k(torch.empty((0, 4096), device=DEV), torch.empty((0,), dtype=torch.int32, device=DEV), 2048)
    assert none["indices"].shape == (0, 2048) and none["values"].shape == (0, 2048)
    cols0 = dsa_aot.dsa.indexer_top_k(torch.empty((3, 0), device=DEV), torch.zeros((3,), dtype=torch.int32, device=DEV), 16)
    torch.cuda.synchronize()
    assert (cols0["indices"] == -1).all() and (cols0["values"] == float("-inf")).all()


def test_strided_and_misaligned_inputs_are_staged_as_upstream():
    import dsa_aot.dsa

    x, lens = _inputs(64, 8192, seed=40)
    strided = x.t().contiguous().t()  # same values, column-major
    shifted = torch.empty(x.numel() + 1, device=DEV)[1:].view(x.shape).copy_(x)  # 4 bytes off 32-byte alignment
    want = dsa_aot.dsa.indexer_top_k(x, lens, 2048, deterministic=True)
    for y in (strided, shifted):
        got = dsa_aot.dsa.indexer_top_k(y, lens, 2048, deterministic=True)
        assert torch.equal(got["indices"], want["indices"]) and torch.equal(got["values"], want["values"])


def test_refused_calls_write_nothing():
    import dsa_aot.dsa
    from dsa_aot.errors import InputError, KernelNotFoundError

    x, lens = _inputs(8, 4096, seed=50)
    idx = torch.full((8, 2048), 7, dtype=torch.int32, device=DEV)
    val = torch.full((8, 2048), 7.0, device=DEV)
    ws = torch.empty(dsa_aot.dsa.indexer_top_k_workspace_bytes(x), dtype=torch.uint8, device=DEV)

    def refused(exc, match, *a, **k):
        with pytest.raises(exc, match=match):
            dsa_aot.dsa.indexer_top_k_into(*a, **k)

    refused(InputError, "top_k", idx, val, x, lens, 4096, workspace=ws)
    refused(InputError, "tie_break", idx, val, x, lens, 2048, tie_break=3, workspace=ws)
    refused(InputError, "num_copy_bits", idx, val, x, lens, 2048, num_copy_bits=128, workspace=ws)
    refused(InputError, "seq_lens.numel", idx, val, x, lens[:4], 2048, workspace=ws)
    refused(InputError, "workspace: missing", idx, val, x, lens, 2048)
    refused(InputError, "needs", idx, val, x, lens, 2048, workspace=ws[:-128])
    refused(InputError, "must be None", idx, val, x, lens, 2048, return_val=False, workspace=ws)
    refused(InputError, "32-byte aligned", idx, val, torch.empty(x.numel() + 1, device=DEV)[1:].view(x.shape), lens, 2048, workspace=ws)
    both = torch.full((idx.numel() * 4 + ws.numel(),), 7, dtype=torch.uint8, device=DEV)  # indices and the workspace share bytes
    refused(InputError, "overlaps", both[: idx.numel() * 4].view(torch.int32).view(idx.shape), val, x, lens, 2048, workspace=both[128:])
    refused(KernelNotFoundError, "cols = 524288", idx, val, torch.zeros((8, 300000), device=DEV), lens, 2048,
            workspace=torch.empty(8 * 2 * 300000 * 4, dtype=torch.uint8, device=DEV))
    idx100, val100 = torch.full((8, 100), 7, dtype=torch.int32, device=DEV), torch.full((8, 100), 7.0, device=DEV)
    refused(KernelNotFoundError, "top_k = 100", idx100, val100, x, lens, 100, workspace=ws)
    torch.cuda.synchronize()
    assert (idx == 7).all() and (val == 7.0).all() and (both == 7).all() and (idx100 == 7).all() and (val100 == 7.0).all()
