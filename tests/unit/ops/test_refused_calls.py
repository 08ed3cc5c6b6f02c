"""The refused calls measured in issue 11, one by one: each raises an dsa_aot.errors class before anything
is written, launched or memset, and leaves no state behind for the next call (stand-in driver)."""

import pytest
import torch

import op_calls
import stand_in
from dsa_aot.errors import InputError


def _refused(env, fn, args, kw, writes):
    before = [stand_in.contents(t) for t in writes]
    env.launches.clear()
    env.memsets.clear()
    with pytest.raises(InputError) as raised:
        fn(*args, **kw)
    assert not env.launches and not env.memsets, raised.value
    assert [stand_in.contents(t) for t in writes] == before
    return str(raised.value)


def test_an_overlapping_workspace_is_refused_after_a_valid_call_of_the_same_shapes(env, monkeypatch):
    """Problem 4: the indexer's fast path once re-checked workspace overlap only when deterministic, but a
    bf16 d_index_k is accumulated in fp32 in the workspace on the default path too."""
    import dsa_aot.dsa
    import dsa_aot.ops.dsa_indexer_backward as ib

    monkeypatch.setattr(ib, "_cast_into", lambda *a, **k: None)  # torch's fp32 -> bf16 copy needs a real GPU
    fn, args, kw, writes = op_calls.indexer_backward(0, env.new_stream(0))
    args = list(args)
    shape = args[5].shape
    args[2] = stand_in.cuda_tensor(torch.zeros(shape, dtype=torch.bfloat16))  # d_index_k
    need = dsa_aot.dsa.indexer_backward_workspace_bytes(1, shape[1], 128, d_index_k_dtype=torch.bfloat16)
    assert need >= 4 * args[5].numel()
    big = torch.zeros(need, dtype=torch.uint8)  # index_k lives in the first bytes of it
    args[5] = index_k = stand_in.cuda_tensor(big[: args[5].numel() * 2].view(torch.bfloat16).view(shape))
    fn(*args, **kw, workspace=stand_in.cuda_tensor(torch.zeros(need, dtype=torch.uint8)))  # valid: fills the fast path
    assert env.launches
    msg = _refused(env, fn, args, dict(kw, workspace=stand_in.cuda_tensor(big)), (*writes, args[2], index_k))
    assert "overlap" in msg and "index_k" in msg


@pytest.mark.parametrize("scale", [1e39, -1e39, float("nan"), float("inf")])
def test_a_scale_fp32_cannot_hold_is_refused_before_any_write(env, scale):
    """Problem 5: sm_scale / softmax_scale above FLT_MAX once raised OverflowError after attn_score and
    d_sink were written."""
    fn, args, kw, writes = op_calls.indexer_backward(0, env.new_stream(0))
    assert "sm_scale" in _refused(env, fn, args, dict(kw, sm_scale=scale), writes)
    fn, args, kw, writes = op_calls.sparse_backward(0, env.new_stream(0))
    assert "softmax_scale" in _refused(env, fn, args, dict(kw, softmax_scale=scale), writes)


def test_a_float_ratio_is_refused_before_the_main_kernel_launches(env):
    """Problem 5: compressor_backward_into(ratio=4.0, deterministic=True) once launched the main kernel,
    then the dAPE-reduce launcher raised TypeError."""
    fn, args, kw, writes = op_calls.csa_backward(0, env.new_stream(0))
    assert "ratio" in _refused(env, fn, args, dict(kw, ratio=4.0), writes)


def test_indexer_with_no_keys_and_bf16_dk_without_workspace(env):
    """Problem 5: S_k = 0 with a bf16 d_index_k and no workspace once launched, then subscripted None. Now no key
    row is refused by name, before anything is written or launched."""
    fn, args, kw, writes = op_calls.indexer_backward(0, env.new_stream(0), s_k=0)
    args = list(args)
    args[2] = stand_in.cuda_tensor(torch.zeros(args[2].shape, dtype=torch.bfloat16))
    msg = _refused(env, fn, args, kw, (*writes, args[2]))
    assert "index_k: S_k = 0 (expected at least one key row)" in msg and msg.startswith("1 invalid input(s)"), msg


@pytest.mark.parametrize("bad", [{"ratio": None}, {"ratio": [4]}, {"head_dim": "128"}, {"stream": "s0"}, {"total_comp": -1}, {"total_comp": 2**40}])
def test_malformed_csa_forward_scalars_raise_input_error(env, bad):
    """Problem 6: the measured malformed calls once raised TypeError / ValueError / AttributeError."""
    import dsa_aot.csa

    fn, args, kw, writes = op_calls.csa_forward(0, env.new_stream(0))
    out, *inputs = args
    call = dict(kw, total_comp=out.shape[0], head_dim=128) | bad
    _refused(env, dsa_aot.csa.compressor_forward, inputs, call, ())


def test_compressor_forward_checks_its_inputs_even_when_sizes_are_given(env):
    """Problem 6: with head_dim and total_comp given, compressor_forward once skipped validation (kv=None: AttributeError)."""
    import dsa_aot.csa

    fn, args, kw, writes = op_calls.csa_forward(0, env.new_stream(0))
    out, kv, *rest = args
    assert "kv" in _refused(env, dsa_aot.csa.compressor_forward, (None, *rest), dict(kw, total_comp=out.shape[0], head_dim=128), ())


@pytest.mark.parametrize("bad", [{"sm_scale": None}, {"block_I": [128]}])
def test_malformed_indexer_scalars_raise_input_error(env, bad):
    fn, args, kw, writes = op_calls.indexer_backward(0, env.new_stream(0))
    _refused(env, fn, args, kw | bad, writes)


@pytest.mark.parametrize("bad", [{"softmax_scale": "x"}, {"q_cluster_mode": ["off"]}])
def test_malformed_sparse_attention_scalars_raise_input_error(env, bad):
    fn, args, kw, writes = op_calls.sparse_backward(0, env.new_stream(0))
    _refused(env, fn, args, kw | bad, writes)
