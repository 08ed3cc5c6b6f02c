"""dsa_aot.ops.csa_compressor without a GPU: every bad input is reported at once, before anything runs."""

import pytest

from dsa_aot.errors import InputError


def test_bad_inputs_are_all_reported_before_anything_runs():
    torch = pytest.importorskip("torch")
    import dsa_aot.csa

    kv = torch.zeros(256, 256, dtype=torch.float16)[:, ::2]  # wrong dtype, wrong strides, on CPU
    score = torch.zeros(256, 128, dtype=torch.bfloat16)
    ape = torch.zeros(4, 128, dtype=torch.float32)
    cu = torch.tensor([0, 256], dtype=torch.int64)
    cuc = torch.tensor([0, 64], dtype=torch.int32)
    with pytest.raises(InputError) as ei:
        dsa_aot.csa.compressor_forward(kv, score, ape, cu, cuc, ratio=4, coff=2, total_comp=64)
    msg = str(ei.value)
    assert "nothing was launched" in msg
    assert "kv: dtype torch.float16 (expected torch.bfloat16)" in msg
    assert "kv: strides" in msg and "contiguous" in msg
    assert "kv: on cpu (expected a CUDA tensor)" in msg
    assert "cu_seqlens: dtype torch.int64" in msg
    with pytest.raises(InputError, match="ratio=3"):
        dsa_aot.csa.compressor_forward(score, score, ape, cuc, cuc, ratio=3, coff=2, total_comp=0)
    with pytest.raises(InputError, match="head_dim=64 at ratio 128"):
        dsa_aot.csa.compressor_forward(score, score, torch.zeros(128, 128), cuc, cuc, ratio=128, coff=2, total_comp=0)
