"""The fused indexer forward + top-k (work in progress, branch) on a capability-10.0 stand-in: the BSHD
call's three launches (GEMM, stage 2, local-to-global in place) through the real lifted host functions."""

import struct

import pytest
import torch

import stand_in
from aot.errors import InputError


def test_a_bshd_call_launches_gemm_stage2_and_local_to_global(sm100_env):
    import aot.ops.dsa_indexer_forward_top_k as op

    env = sm100_env
    st = env.new_stream(0)
    b, s_q, s_k, h, top_k = 2, 256, 65, 64, 512

    def t(shape, dtype=torch.float32):
        return stand_in.cuda_tensor(torch.zeros(shape, dtype=dtype))

    q, k, w = t((b, s_q, h, 128), torch.bfloat16), t((b, s_k, 1, 128), torch.bfloat16), t((b, s_q, h), torch.bfloat16)
    idx, val, sm = t((b, s_q, top_k), torch.int32), t((b, s_q, top_k)), t((b, s_q, top_k))
    need = op.compress_topk_cand_buffer_size(b, s_q, s_k, 4)
    env.launches.clear()
    with pytest.raises(InputError, match=f"the call needs {need}"):
        op.indexer_forward_top_k_into(idx, val, sm, None, t((need - 1,)), q, k, w, top_k, stream=st)
    assert not env.launches
    cand = t((need,))
    op.indexer_forward_top_k_into(idx, val, sm, None, cand, q, k, w, top_k, sm_scale=0.5, stream=st)
    gemm, stage2, l2g = env.launches
    assert gemm.dims[:3] == (-(-s_q * h // 128), 1, b) and struct.pack("<f", 0.5) in gemm.params and struct.pack("<Q", cand.data_ptr()) in gemm.params
    assert stage2.dims[:4] == (s_q, b, 1, 256) and struct.pack("<Q", cand.data_ptr()) in stage2.params
    assert struct.pack("<Q", idx.data_ptr()) in l2g.params
    assert all(L.dims[7] == st for L in (gemm, stage2, l2g))
