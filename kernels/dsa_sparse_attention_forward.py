"""Spec of the DSA sparse attention forward (cudnn.deepseek_sparse_attention.sparse_attention_forward, 1.32.0).

``build`` presents what ``_interface_sm100._compile_kernel`` passes to ``cute.compile``: every tensor
through ``to_cute_tensor`` (gmem, dynamic Int32 extents, dynamic Int64 strides but the unit innermost
one); q, kv and out with the last extent and the outer strides divisible by their last dim and 16-byte
aligned, the rest 4-byte aligned; the scale a Float32 (a run-time value); the stream. Options:
upstream's ``--opt-level 2`` (its ``--enable-tvm-ffi --gpu-arch`` left out: the arch comes from
CUTE_DSL_ARCH, the TVM-FFI wrapper does not change the cubin). Without the divisibility or without
O2 the cubin differs (docs/research/sparse-attention-forward.md: 27 configurations built both ways,
byte-identical).
"""

from dsa_aot.policy import dsa_sparse_attention_forward as policy
from dsa_aot.toolchain.fakes import dlpack as _T

FAMILY = policy.FAMILY
OPS = policy.OPS
OPTIONS = "--opt-level 2"


def build(op, key, target):
    import cuda.bindings.driver as cuda_driver
    import cutlass

    h, d, it = key["heads"], key["dim"], key["indexer_topk"]
    if h == 64:
        from cudnn.deepseek_sparse_attention.sparse_attention_forward.dsa_fwd_sm100_head64 import SparseAttentionForwardSm100Head64

        obj = SparseAttentionForwardSm100Head64(head_dim=d, indexer_topk=it)
        if not obj.use_tma_gather4:  # an environment capability of the DSL (4.8.1 has it): it changes the kernel
            raise RuntimeError("SparseAttentionForwardSm100Head64: TMA gather4 unavailable in this cutlass-dsl; the pinned 4.8.1 has it")
    else:
        from cudnn.deepseek_sparse_attention.sparse_attention_forward.dsa_fwd_sm100_head128_small_topk import (
            SparseAttentionForwardSm100Head128SmallTopKPrefill,
        )

        obj = SparseAttentionForwardSm100Head128SmallTopKPrefill(d_qk=d, indexer_topk=it)
    dt = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}[key["dtype"]]
    f32, i32 = cutlass.Float32, cutlass.Int32
    args = (_T(dt, 3, div=d), _T(dt, 2, div=d), _T(i32, 2, align=4), _T(dt, 3, div=policy.DV), _T(f32, 2, align=4), _T(f32, 2, align=4),
            _T(f32, 2, align=4) if it else None, _T(f32, 1, align=4) if key["sink"] else None, _T(i32, 1, align=4) if key["topk_length"] else None,
            cutlass.Float32(1.0), cuda_driver.CUstream(0))
    return obj, args, OPTIONS, {"threads": 384 if h == 64 else 512, "cluster": 1 if h == 64 else 2}


def check_policy(targets):
    """The shipped variants and their indexer_topk sets are upstream's (api._SUPPORTED_VARIANTS)."""
    from cudnn.deepseek_sparse_attention.sparse_attention_forward import api

    mine = {(h, d): policy.INDEXER_TOPK[h] for h in policy.HEADS for d in policy.DIMS if not (h == 128 and d != 512)}
    have = {k: tuple(v) for k, v in api._SUPPORTED_VARIANTS.items()}
    if have != mine:
        raise ValueError(f"upstream's variants {have} differ from the policy's {mine}: review dsa_aot/policy/dsa_sparse_attention_forward.py")


FIDELITY_ROUTES = {"fwd": "api.sparse_attention_forward_wrapper -> _interface_sm100.sparse_attention_forward_sm100"}
PRELOAD = ("cudnn.deepseek_sparse_attention.sparse_attention_forward.api", "cudnn.deepseek_sparse_attention.sparse_attention_forward._interface_sm100",
           "cudnn.deepseek_sparse_attention.sparse_attention_forward.dsa_fwd_sm100_head64",
           "cudnn.deepseek_sparse_attention.sparse_attention_forward.dsa_fwd_sm100_head128_small_topk")


def fidelity(op, key, target, up):
    """Run sparse_attention_forward_wrapper for the key on ``up``: S_q 8, S_kv 4096, 2100 index slots,
    torch's current stream a handle-0 stand-in."""
    import types

    import torch

    from cudnn.deepseek_sparse_attention.sparse_attention_forward import _interface_sm100 as iface
    from cudnn.deepseek_sparse_attention.sparse_attention_forward import api

    up.clear_lru(iface._validated_device_capability)
    up.patch(torch.cuda, "current_stream", lambda *a, **k: types.SimpleNamespace(cuda_stream=0))
    up.no_op(iface, "_record_stream")
    T = up.tensor
    up.on_host("empty", "full")
    cache = up.cache(iface, "_compile_cache")
    h, d = key["heads"], key["dim"]
    dt = {"bf16": torch.bfloat16, "f16": torch.float16}[key["dtype"]]
    q, kv, idx = T(dt, 8, h, d), T(dt, 4096, d), T(torch.int32, 8, 2100)  # 2100 slots: upstream pads them to 2112
    kw = {}
    if key["sink"]:
        kw["attn_sink"] = T(torch.float32, h)
    if key["topk_length"]:
        kw["topk_length"] = T(torch.int32, 8)
    api.sparse_attention_forward_wrapper(q, kv, idx, softmax_scale=0.05, indexer_topk=key["indexer_topk"], **kw)
    variant = "head64_regular" if h == 64 else "head128_small_topk_prefill"
    want = (torch.device("cuda", 0), up.capability, variant, h, d, dt, dt, torch.int32, key["sink"], key["topk_length"], key["indexer_topk"])
    return cache, want, 1
