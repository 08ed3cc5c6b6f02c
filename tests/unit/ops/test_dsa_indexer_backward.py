"""dsa_aot.ops.dsa_indexer_backward without a GPU: input refusal, and the workspace size against cudnn's plan."""

import pytest

from dsa_aot.errors import InputError


def _indexer_inputs(torch, B=1, S_q=4, S_k=256, H=64, D=128, topk=128, dev="cpu"):
    return dict(
        index_q=torch.zeros(B, S_q, H, D, dtype=torch.bfloat16, device=dev), weights=torch.zeros(B, S_q, H, dtype=torch.bfloat16, device=dev),
        index_k=torch.zeros(B, S_k, D, dtype=torch.bfloat16, device=dev), attn_score=torch.zeros(B, S_q, topk, device=dev),
        index_score=torch.zeros(B, S_q, topk, device=dev), topk_indices=torch.zeros(B, S_q, topk, dtype=torch.int32, device=dev),
        grad_loss=torch.ones(1, device=dev),
    )


def test_indexer_backward_reports_every_bad_input_before_anything_runs():
    torch = pytest.importorskip("torch")
    import dsa_aot.dsa

    x = _indexer_inputs(torch, topk=200)
    x["weights"] = x["weights"].float()
    dq, dw, dk = torch.empty_like(x["index_q"]), torch.empty_like(x["weights"]), torch.empty_like(x["index_k"])
    with pytest.raises(InputError) as ei:
        dsa_aot.dsa.indexer_backward_into(dq, dw, dk, *x.values(), block_I=64, backend="v3", deterministic_dk_planes=100)
    msg = str(ei.value)
    for want in ("nothing was launched", "backend='v3'", "deterministic_dk_planes=100", "weights: dtype torch.float32", "block_I=64",
                 "topk=200", "index_q: on cpu (expected"):
        assert want in msg, (want, msg)
    with pytest.raises(InputError, match="4-D"):
        dsa_aot.dsa.indexer_backward(x["index_q"][0], *list(x.values())[1:])


def test_indexer_workspace_bytes_equal_upstream_plan():
    """Against cudnn's own IndexerBackward.scratch_workspace_bytes (its plan object needs no GPU)."""
    torch = pytest.importorskip("torch")
    api = pytest.importorskip("cudnn.deepseek_sparse_attention.indexer_backward.api")
    import dsa_aot.dsa

    x = _indexer_inputs(torch, B=2, S_q=3, S_k=1000)
    for dk_dtype in (torch.bfloat16, torch.float32):
        for backend in ("default", "sm100_v2"):
            for det, planes in ((False, 96), (True, 96), (True, 148)):
                dk = torch.empty(2, 1000, 128, dtype=dk_dtype)
                plan = api.IndexerBackward(x["index_q"], x["weights"], x["index_k"], x["index_q"], x["weights"], dk, x["attn_score"],
                                           x["index_score"], x["topk_indices"], backend=backend, deterministic=det, deterministic_dk_planes=planes)
                mine = dsa_aot.dsa.indexer_backward_workspace_bytes(2, 1000, 128, d_index_k_dtype=dk_dtype, backend=backend, deterministic=det,
                                                                deterministic_dk_planes=planes)
                assert mine == plan.scratch_workspace_bytes(), (dk_dtype, backend, det, planes)
