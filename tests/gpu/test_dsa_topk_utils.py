"""local_to_global and compactify on the GPU against the integer references (tests/gpu/ref_topk_utils.py):
every shipped bucket, outputs poisoned before each launch, THD with an empty batch, ids past one
256-thread block, 3-D and non-contiguous inputs, and the refusals that must come before any write.
Threads, devices, capture and torch.ops run over these ops in test_runtime_safety.py / test_library.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

import ref_topk_utils as ref  # noqa: E402
from refutil import generator  # noqa: E402

DEV = "cuda:0"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 37, 300), (3, 64, 2048)])
def test_local_to_global_matches_the_reference(dtype, shape):
    import dsa_aot.dsa

    gen = generator(sum(shape))
    local = ref.random_ids(shape, 4096, gen, dtype=dtype).to(DEV)
    out = torch.full(shape, 0x7EADBEEF, dtype=torch.int32, device=DEV)  # poisoned: every element must be written
    dsa_aot.dsa.local_to_global_into(out, local, 4096)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), ref.local_to_global(local, 4096))
    got = dsa_aot.dsa.local_to_global(local, 4096)["indices"]
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), ref.local_to_global(local, 4096))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("batches,k", [(1, 512), (5, 2048), (9, 300)])
def test_local_to_global_thd_matches_the_reference(dtype, batches, k):
    import dsa_aot.dsa

    gen = generator(batches * k)
    cu_q = ref.random_segments(batches, 40, gen)
    cu_k = ref.random_segments(batches, 5000, gen, empty=False)
    total = int(cu_q[-1])
    local = ref.random_ids((total, k), 5000, gen, dtype=dtype).to(DEV)
    out = torch.full((total, k), 0x7EADBEEF, dtype=torch.int32, device=DEV)
    dsa_aot.dsa.local_to_global_into(out, local, 0, cu_q.to(DEV), cu_k.to(DEV))
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), ref.local_to_global(local, 0, cu_q, cu_k))


def test_local_to_global_int64_ids_keep_their_low_32_bits():
    import dsa_aot.dsa

    local = torch.tensor([[[2**31 - 1, 3]], [[5, -(2**40)]]], dtype=torch.int64, device=DEV)
    got = dsa_aot.dsa.local_to_global(local, 2**31 - 1)["indices"].cpu()
    assert torch.equal(got, ref.local_to_global(local, 2**31 - 1)) and got.flatten().tolist() == [2**31 - 1, 3, -(2**31) + 4, -1]


@pytest.mark.parametrize("cols", [512, 1024, 2048])
@pytest.mark.parametrize("rows", [1, 37, 1000])
def test_compactify_matches_the_reference(cols, rows):
    import dsa_aot.dsa

    ids = ref.random_ids((rows, cols), 1 << 20, generator(rows + cols), invalid_frac=0.4).to(DEV)
    ids[0] = -1  # a row of nothing
    out = torch.full((rows, cols), 0x7EADBEEF, dtype=torch.int32, device=DEV)
    n = torch.full((rows,), 0x7EADBEEF, dtype=torch.int32, device=DEV)
    dsa_aot.dsa.compactify_into(out, n, ids)
    torch.cuda.synchronize()
    want, want_n = ref.compactify(ids)
    assert torch.equal(out.cpu(), want) and torch.equal(n.cpu(), want_n)


def test_compactify_takes_3d_and_strided_inputs_as_upstream():
    import dsa_aot.dsa

    ids = ref.random_ids((2, 8, 2048), 4096, generator(3)).to(DEV)
    got = dsa_aot.dsa.compactify(ids)
    want, want_n = ref.compactify(ids)
    assert got["indices"].shape == (16, 2048) and torch.equal(got["indices"].cpu(), want) and torch.equal(got["topk_length"].cpu(), want_n)
    strided = ref.random_ids((1024, 16), 4096, generator(4)).to(DEV).t()  # (16, 1024), not contiguous
    c, n = dsa_aot.dsa.compactify(strided)
    want, want_n = ref.compactify(strided)
    assert torch.equal(c.cpu(), want) and torch.equal(n.cpu(), want_n)


def test_refused_calls_write_nothing():
    import dsa_aot.dsa
    from dsa_aot.errors import InputError, KernelNotFoundError

    ids = ref.random_ids((4, 300), 4096, generator(5)).to(DEV)
    out, n = torch.full((4, 300), 7, dtype=torch.int32, device=DEV), torch.full((4,), 7, dtype=torch.int32, device=DEV)
    with pytest.raises(KernelNotFoundError, match="cols = 300"):
        dsa_aot.dsa.compactify_into(out, n, ids)
    local = ref.random_ids((2, 4, 64), 100, generator(6)).to(DEV)
    g = torch.full((2, 4, 64), 7, dtype=torch.int32, device=DEV)
    with pytest.raises(InputError, match="seqlen_k"):
        dsa_aot.dsa.local_to_global_into(g, local, 2**31)
    with pytest.raises(InputError, match="THD needs both"):
        dsa_aot.dsa.local_to_global_into(g[0], local[0], 10, torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(InputError, match="overlaps"):
        dsa_aot.dsa.local_to_global_into(local, local, 10)
    torch.cuda.synchronize()
    assert (out == 7).all() and (n == 7).all() and (g == 7).all()
