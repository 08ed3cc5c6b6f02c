"""Fake tensors for the specs (kernels/<family>.py): what upstream hands ``cute.compile`` (their ``build``), and the
inputs of an upstream wrapper more than one family's fidelity route calls.

Build time only; cutlass and torch are imported when a helper is called, not when this module loads (a spec
imports it at load, see :mod:`dsa_aot.toolchain.specs`).
"""

__all__ = ["dlpack", "indexer_inputs"]


def dlpack(dtype, rank, align=16, div=1):
    """A dense tensor as upstream's ``to_cute_tensor`` presents a contiguous CUDA tensor: gmem, ``align``-byte
    aligned, dynamic extents, dynamic strides but the unit innermost one; ``div``: the innermost extent and
    every stride divisible by it (a ``mark_compact_shape_dynamic`` divisibility)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    if div == 1:
        shape = tuple(cute.sym_int() for _ in range(rank))
        stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
    else:
        shape = tuple(cute.sym_int() for _ in range(rank - 1)) + (cute.sym_int(divisibility=div),)
        stride = tuple(cute.sym_int64(divisibility=div) for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(dtype, shape, stride, memspace=cute.AddressSpace.gmem, assumed_align=align)


def indexer_inputs(T, precision, heads, w_dtype, varlen, b, s_q, s_k, offsets=False, dim=128):
    """(q, k, w, keywords) of cudnn's indexer forward wrappers (``indexer_forward_wrapper`` and the fused top-k's), from
    ``T(dtype, *shape)`` (:meth:`dsa_aot.toolchain.fidelity.Upstream.tensor`): BSHD or THD (cu_seqlens and both maxima
    given, so nothing is read back), one KV head, the block-scaled precisions' e8m0 scales in upstream's packed layout
    (THD: with their scale-padded offsets), the causal offsets."""
    import torch

    qdt = {"bf16": torch.bfloat16, "mxfp8": torch.float8_e4m3fn, "mxfp4": torch.float4_e2m1fn_x2}[precision]
    wdt, e8, i32 = getattr(torch, w_dtype), torch.float8_e8m0fnu, torch.int32
    d = dim // 2 if precision == "mxfp4" else dim  # e2m1 pairs: two values a stored element
    kw = {}
    if varlen:
        q, k, w = T(qdt, b * s_q, heads, d), T(qdt, b * s_k, 1, d), T(wdt, b * s_q, heads)
        kw.update(cu_seqlens_q=T(i32, b + 1), cu_seqlens_k=T(i32, b + 1), max_seqlen_q=s_q, max_seqlen_k=s_k)
    else:
        q, k, w = T(qdt, b, s_q, heads, d), T(qdt, b, s_k, 1, d), T(wdt, b, s_q, heads)
    if precision != "bf16" and varlen:
        kw.update(q_scale=T(e8, 1, 128 * b * -(-s_q * heads // 128), 4), k_scale=T(e8, 1, 128 * b * -(-s_k // 128), 4),
                  cu_seqlens_q_scale_padded=T(i32, b + 1), cu_seqlens_k_scale_padded=T(i32, b + 1))
    elif precision != "bf16":
        kw.update(q_scale=T(e8, b, -(-s_q * heads // 128) * 128, 4), k_scale=T(e8, b, -(-s_k // 128) * 128, 4))
    if offsets:
        kw["q_causal_offsets"] = T(i32, b)
    return q, k, w, kw
