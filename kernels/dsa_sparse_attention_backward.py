"""Spec of the DSA sparse attention backward family (cudnn.deepseek_sparse_attention.sparse_attention_backward, 1.32.0).

The ops, their keys and the run-time policy are dsa_aot/policy/dsa_sparse_attention_backward.py;
``check_policy`` holds each policy function against upstream's own on every build.

Arguments mirror upstream exactly. SM100 plans compile from storage-free fake tensors
(``make_fake_compact_tensor`` row-major with static H / D / topk extents and one symbolic S_q and S_kv
shared by every tensor, dq/dkv/d_sink/dout aliasing q/kv/sink/out; lse aligned 8, topk_length 4, the rest
16; the byte workspaces (1, H, ?, 8) and (1, planes, ?, 4*D) [D576: flat Int64 extents, dKV aligned 32
when deterministic]; ``make_fake_stream``), or in wide mode fully dynamic ``make_fake_tensor`` types
with head-dim divisibility. SM90 converts live tensors with ``to_cute_tensor``: every extent dynamic
Int32, every stride dynamic Int64 but the unit innermost, gmem, 16-byte aligned (lse: 4). Options:
upstream passes ``--enable-tvm-ffi --gpu-arch <arch>`` (SM90: ``--enable-tvm-ffi``); here the arch comes
from CUTE_DSL_ARCH and the TVM-FFI wrapper is left out (it does not change the cubin).
"""

from dsa_aot.policy import dsa_sparse_attention_backward as policy
from dsa_aot.policy.arch import CAPABILITY
from dsa_aot.policy.dsa_sparse_attention_backward import (
    D576_BACKENDS,
    HEAD_DIM_V,
    SM90_PRE_THREADS,
    SM90_THREADS,
    SM90_TILE_M,
    SM90_TILE_N,
    TWO_CTA_TOPK,
    d576_compact_slots,
    d576_split_count,
    deterministic_dkv,
    needs_wide,
    select_backend,
    sm90_post_chunk,
    sm100_workspace_bytes,
    sm100_workspace_shapes,
)
from dsa_aot.toolchain.fakes import dlpack

FAMILY = policy.FAMILY
OPS = policy.OPS


def build(op, key, target):
    """Return (jit_object, args, options, extra_key) for one entry. Imports the toolchain."""
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    dt = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}[key.get("dtype", "bf16")]
    f32, i32, u8 = cutlass.Float32, cutlass.Int32, cutlass.Uint8

    def compact(dtype, shape, align=16):
        """cudnn's plan-time _fake_compact_tensor: row-major, storage-free."""
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=align)

    def runtime(dtype, rank, divisibility=1, align=16):
        """cudnn's plan-time _fake_runtime_tensor (wide mode): fully dynamic, divisibility on the last extent."""
        shape = [cute.sym_int() for _ in range(rank)]
        if divisibility != 1:
            shape[-1] = cute.sym_int(divisibility=divisibility)
        stride = [cute.sym_int64(divisibility=divisibility) for _ in range(rank - 1)] + [1]
        return make_fake_tensor(dtype, tuple(shape), tuple(stride), assumed_align=align)

    if op in ("bwd", "bwd_d576"):
        if target.arch not in CAPABILITY or CAPABILITY[target.arch][0] != 10:
            raise ValueError(f"{op} is an SM100-family kernel, not {target.arch}")

    if op == "bwd":
        from cudnn.deepseek_sparse_attention.sparse_attention_backward import _interface_sm100 as iface
        from cudnn.deepseek_sparse_attention.sparse_attention_backward import dsa_bwd_sm100_deterministic as detmod

        H, D, topk, det = key["heads"], key["dim"], key["topk"], key["deterministic"]
        Dv = HEAD_DIM_V
        backend, block_tile = select_backend(H, D, key["dtype"], topk, det)
        if backend == "generic_m64" and det:
            cls = detmod._deterministic_kernel_class_for_config(key["planes"], key["relay"])
        else:
            cls = iface._get_sm100_kernel_class(backend, det)
        planes = cls.num_dkv_shards if det else 1  # upstream's _compile_sm100_artifact(dkv_planes=...)
        relay = getattr(cls, "dkv_relay_cluster_size", 1) if det else 1
        if (planes, relay) != (key["planes"], key["relay"]):
            raise ValueError(f"bwd {key}: upstream's {cls.__name__} has (planes, relay) = ({planes}, {relay})")
        sq, skv = cute.sym_int(), cute.sym_int()
        if key["wide"]:
            q, kv = runtime(dt, 3, D), runtime(dt, 2, D)
            out, dout = runtime(dt, 3, Dv), runtime(dt, 3, Dv)
            lse, sink = runtime(f32, 2, align=8), runtime(f32, 1)
            lengths = runtime(i32, 1, align=4) if key["topk_length"] else None
            dq, dkv, d_sink = runtime(dt, 3, D), runtime(dt, 2, D), runtime(f32, 1)
            ws_lse, ws_dkv = runtime(u8, 4), runtime(u8, 4)
            indices = make_fake_tensor(i32, (cute.sym_int(), topk), (cute.sym_int64(divisibility=max(topk, 1)), 1), assumed_align=16)
        else:
            q, kv, out = compact(dt, (sq, H, D)), compact(dt, (skv, D)), compact(dt, (sq, H, Dv))
            dout = out
            lse, sink = compact(f32, (sq, H), 8), compact(f32, (H,))
            lengths = compact(i32, (sq,), 4) if key["topk_length"] else None
            dq, dkv, d_sink = q, kv, sink
            ws_lse = compact(u8, (1, H, cute.sym_int(), 8))
            ws_dkv = compact(u8, (1, planes, cute.sym_int(), D * 4))
            indices = compact(i32, (sq, topk))
        problem = (i32(1), i32(1), i32(D), (i32(H), i32(1)))
        obj = cls(element_dtype=dt, head_dim=D, head_dim_v=Dv, block_tile=block_tile, max_topk=topk)
        args = (problem, q, kv, out, dout, lse, sink, indices, lengths, dq, dkv, d_sink, ws_lse, ws_dkv, f32(1.0), make_fake_stream(use_tvm_ffi_env_stream=False))
        extra = {"backend": backend, "block_tile": block_tile, "kernel_class": cls.__name__, "dkv_shards": getattr(obj, "num_dkv_shards", planes)}
        return obj, args, None, extra

    if op == "bwd_d576":
        from cudnn.deepseek_sparse_attention.sparse_attention_backward import dsa_bwd_sm100_h128_d576_2cta as k576

        H, topk, det = key["heads"], key["topk"], key["deterministic"]
        if key["single_query"] and not det and d576_split_count(1, topk, target.sm_count) == 1:
            raise ValueError(f"on {target.sm_count} SMs upstream does not split a single query: key split must be False")
        sq, skv = cute.sym_int(), cute.sym_int()
        if key["wide"]:
            q, kv = runtime(cutlass.BFloat16, 3, 576), runtime(cutlass.BFloat16, 2, 576)
            out, dout = runtime(cutlass.BFloat16, 3, 512), runtime(cutlass.BFloat16, 3, 512)
            lse, sink = runtime(f32, 2, align=8), runtime(f32, 1)
            lengths = runtime(i32, 1, align=4) if key["topk_length"] else None
            dq, dkv, d_sink = runtime(cutlass.BFloat16, 3, 576), runtime(cutlass.BFloat16, 2, 576), runtime(f32, 1)
            indices = make_fake_tensor(i32, (cute.sym_int(), topk), (cute.sym_int64(divisibility=max(topk, 1)), 1), assumed_align=16)
        else:
            q, kv = compact(cutlass.BFloat16, (sq, H, 576)), compact(cutlass.BFloat16, (skv, 576))
            out = compact(cutlass.BFloat16, (sq, H, 512))
            dout = out
            lse, sink = compact(f32, (sq, H), 8), compact(f32, (H,))
            lengths = compact(i32, (sq,), 4) if key["topk_length"] else None
            dq, dkv, d_sink = q, kv, sink
            indices = compact(i32, (sq, topk))
        ws_stats = compact(u8, (cute.sym_int64(),))
        ws_dkv = compact(u8, (cute.sym_int64(),), 32 if det else 16)
        kwargs = dict(element_dtype=cutlass.BFloat16, head_dim=576, head_dim_v=512, block_tile=64, max_topk=topk, single_query=key["single_query"], num_heads=H)
        slots = d576_compact_slots(target.sm_count) if det else 74
        if det:
            obj = k576.FlashAttentionDSABackwardSm100H128D576TwoCTADeterministic(**kwargs, compact_slots=slots)
        else:
            obj = k576.FlashAttentionDSABackwardSm100H128D576TwoCTA(**kwargs)
        problem = (i32(1), i32(1), i32(576), (i32(H), i32(1)))
        args = (
            problem, q, kv, out, dout, lse, sink, indices, lengths, dq, dkv, d_sink, ws_stats, ws_dkv,
            f32(1.0), i32(1), make_fake_stream(use_tvm_ffi_env_stream=False), key["split"] and not det,
        )  # fmt: skip
        backend = "h96_d576_2cta_m64" if H == 96 else "h128_d576_2cta_m64"
        return obj, args, None, {"backend": backend, "compact_slots": slots, "kernel_class": type(obj).__name__}

    if target.arch != "sm_90a":
        raise ValueError(f"{op} is an SM90 kernel, not {target.arch}")
    from cudnn.deepseek_sparse_attention.sparse_attention_backward import dsa_bwd_sm90 as k90

    stream = cuda_driver.CUstream(0)
    if op == "pre_sm90":
        obj = k90._FlashAttentionDSABackwardPreprocessSm90(dt, HEAD_DIM_V, 90, SM90_TILE_M, num_threads=SM90_PRE_THREADS)
        # out4, dout4 (1, S_q, H, Dv); dpsum, lse_log2 (1, S_q_rounded, H) f32; lse4 (1, S_q, H) f32 align 4; sink, d_sink (H,)
        args = (dlpack(dt, 4), dlpack(dt, 4), dlpack(f32, 3), dlpack(f32, 3, 4), dlpack(f32, 3), dlpack(f32, 1), dlpack(f32, 1), None, None, None, stream)
        return obj, args, None, {}
    if op == "main_sm90":
        obj = k90.FlashAttentionDSABackwardSm90(
            dt, key["dim"], HEAD_DIM_V, key["heads"], tile_m=SM90_TILE_M, tile_n=SM90_TILE_N, KV_stage=1, PdS_stage=1,
            SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False, num_threads=SM90_THREADS,
            have_topk_length=key["topk_length"], max_topk=key["topk"],
        )  # fmt: skip
        # q4, kv4 (1, S_kv, 1, D), dout4, lse_log2, dpsum, dq4, dkv_accum (1, 1, S_kv_r * D_r), topk4 (1, S_q, topk), tlen4 (1, S_q)
        args = (
            dlpack(dt, 4), dlpack(dt, 4), dlpack(dt, 4), dlpack(f32, 3), dlpack(f32, 3), dlpack(dt, 4), dlpack(f32, 3), dlpack(i32, 3),
            dlpack(i32, 2) if key["topk_length"] else None, 1.0, stream,
        )  # fmt: skip
        return obj, args, None, {}
    if op == "post_sm90":
        chunk = sm90_post_chunk(key["dim"])
        obj = k90._FlashAttentionDSABackwardPostprocessSm90(dt, hdim_chunk=chunk, tile_n=SM90_TILE_N, head_dim=key["dim"], num_threads=chunk, N_hdim_chunks=key["dim"] // chunk)
        return obj, (dlpack(f32, 3), dlpack(dt, 4), 1, stream), None, {"hdim_chunk": chunk}
    raise KeyError(op)


def check_policy(targets):
    """The policy (and the op's run-time selection built on it) against upstream's own functions, for
    every SM100 target."""
    for target in targets:
        if target.arch in CAPABILITY and CAPABILITY[target.arch][0] == 10:
            _check_target(target)


def _check_target(target):
    import torch

    from cudnn.deepseek_sparse_attention.sparse_attention_backward import _interface_sm100 as iface
    from cudnn.deepseek_sparse_attention.sparse_attention_backward import _interface_sm100_common as common
    from cudnn.deepseek_sparse_attention.sparse_attention_backward import _interface_sm100_d576 as d576
    from cudnn.deepseek_sparse_attention.sparse_attention_backward import dsa_bwd_sm100_deterministic as detmod

    cap = CAPABILITY[target.arch]
    tdt = {"bf16": torch.bfloat16, "f16": torch.float16}
    for heads in (16, 32, 64, 96, 128):
        for dim in (512, 576):
            for dtype in tdt:
                for topk in (64, 128, 256, 512, 640, 1024, 1152, 1536, 2048):
                    for det in (False, True):
                        theirs = iface._select_sm100_backend(heads, dim, head_dim_v=HEAD_DIM_V, dtype=tdt[dtype], max_topk=topk, device_capability=cap, deterministic=det)
                        if select_backend(heads, dim, dtype, topk, det) != tuple(theirs):
                            raise ValueError(f"upstream selects {theirs} for H{heads} D{dim} {dtype} topk {topk} det={det}; select_backend disagrees")
    shapes = [(1, 1), (4, 4096), (128, 4096), (129, 65536), (512, 1 << 17), (513, 1 << 20), (4096, 1 << 20), (8192, 1 << 21), (8192, 1 << 22), (100000, 1 << 22), (20000, 1 << 23)]
    for s_q, s_kv in shapes:
        for dim in (512, 576):
            for heads in (64, 128):
                cls = detmod.deterministic_kernel_class(s_q, s_kv, dim, heads)
                ours = deterministic_dkv(s_q, s_kv, dim, heads)
                if (cls.num_dkv_shards, getattr(cls, "dkv_relay_cluster_size", 1)) != ours:
                    raise ValueError(f"upstream picks {cls.__name__} for S_q {s_q} S_kv {s_kv} D{dim} H{heads}; deterministic_dkv says {ours}")
                if ours[1] > 1 and not common._requires_wide_data_addressing(s_q, s_kv, dim, HEAD_DIM_V, heads, 512, True, "generic_m64", include_workspace=True):
                    raise ValueError(f"upstream runs relay {ours} without wide addressing for S_q {s_q} S_kv {s_kv}: _bwd_check must allow it")
                for det in (False, True):
                    for backend in ("generic_m64", "h128_2cta_m64", "h128_d576_2cta_m64"):
                        theirs = common._workspace_shapes_sm100(s_q, s_kv, dim, heads, det, backend)
                        if tuple(map(tuple, theirs)) != sm100_workspace_shapes(s_q, s_kv, dim, heads, det, backend):
                            raise ValueError(f"upstream workspace {theirs} != {sm100_workspace_shapes(s_q, s_kv, dim, heads, det, backend)} ({s_q}, {s_kv}, {dim}, {heads}, {det}, {backend})")
                        if common.flash_attn_bwd_sm100_workspace_size(s_q, s_kv, dim, heads, det, backend=backend) != sm100_workspace_bytes(s_q, s_kv, dim, heads, det, backend):
                            raise ValueError(f"upstream workspace bytes differ for ({s_q}, {s_kv}, {dim}, {heads}, {det}, {backend})")
                        for topk in (512, 2048):
                            up = common._requires_wide_data_addressing(s_q, s_kv, dim, HEAD_DIM_V, heads, topk, det, backend, include_workspace=backend not in D576_BACKENDS)
                            if up != needs_wide(s_q, s_kv, dim, heads, topk, det, backend):
                                raise ValueError(f"upstream wide addressing {up} for ({s_q}, {s_kv}, {dim}, {heads}, {topk}, {det}, {backend})")
    for sm in (132, 148, target.sm_count):
        if d576._deterministic_compact_slots(sm) != d576_compact_slots(sm):
            raise ValueError(f"upstream compact slots for {sm} SMs: {d576._deterministic_compact_slots(sm)}")
        for s_q in (1, 2, 3, 17, 18, 37, 38, 74, 75, 4096):
            for topk in TWO_CTA_TOPK:
                if d576._split_count(s_q, topk, sm) != d576_split_count(s_q, topk, sm):
                    raise ValueError(f"upstream split count for S_q {s_q} topk {topk} on {sm} SMs: {d576._split_count(s_q, topk, sm)}")


# --- fidelity: cudnn's own route for each key (dsa_aot/toolchain/fidelity.py runs it) --------------------

FIDELITY_ROUTES = {
    "pre_sm90": "_interface_sm90.flash_attn_bwd_sm90(...) -> compile_cache_pre",
    "main_sm90": "_interface_sm90.flash_attn_bwd_sm90(...) -> compile_cache",
    "post_sm90": "_interface_sm90.flash_attn_bwd_sm90(...) -> compile_cache_post",
    "bwd": "SparseAttentionBackward(...).check_support(); .compile() -> _compile_(non)deterministic_sm100",
    "bwd_d576": "SparseAttentionBackward(...).check_support(); .compile() -> _compile_d576_2cta",
}
_SA = "cudnn.deepseek_sparse_attention.sparse_attention_backward"
PRELOAD = (f"{_SA}.api", f"{_SA}._interface_sm90", f"{_SA}._interface_sm100", f"{_SA}._interface_sm100_d576", f"{_SA}.dsa_bwd_sm90",
           f"{_SA}.dsa_bwd_sm100_deterministic", f"{_SA}.dsa_bwd_sm100_h128_d576_2cta")
# SM90: any S_q / S_kv gives the same kernels (every extent is dynamic); the key pins the rest.
SM90_SQ, SM90_SKV = 256, 1024


def fidelity(op, key, target, up):
    """Run upstream's route for (op, key) on ``up``; return (its compile cache, the key it must hold, calls)."""
    import cutlass
    import torch

    from cudnn.deepseek_sparse_attention.sparse_attention_backward import _interface_sm90 as i90
    from cudnn.deepseek_sparse_attention.sparse_attention_backward import _interface_sm100 as i100
    from cudnn.deepseek_sparse_attention.sparse_attention_backward import _interface_sm100_d576 as d576
    from cudnn.deepseek_sparse_attention.sparse_attention_backward import api

    up.cudnn_route()
    f32, i32, Dv = torch.float32, torch.int32, HEAD_DIM_V
    if op in ("pre_sm90", "main_sm90", "post_sm90"):
        # flash_attn_bwd_sm90 compiles three kernels per call; the caches of the two not under check answer "cached"
        fn = i90.flash_attn_bwd_sm90
        caches = {o: up.cache(fn, attr, keep=(lambda k: True) if o == op else (lambda k: False))
                  for o, attr in (("pre_sm90", "compile_cache_pre"), ("main_sm90", "compile_cache"), ("post_sm90", "compile_cache_post"))}
        up.no_op(i90, "memset_zero_async")
        tdt, cdt = {"bf16": (torch.bfloat16, cutlass.BFloat16), "f16": (torch.float16, cutlass.Float16)}[key["dtype"]]
        # pre_sm90 depends on the dtype only, post_sm90 on dtype and dim: the other fields take anchor values
        H, D, topk, tl = key.get("heads", 64), key.get("dim", 512), key.get("topk", 512), key.get("topk_length", False)
        Sq, Skv, T = SM90_SQ, SM90_SKV, up.tensor
        fn(T(tdt, Sq, H, D), T(tdt, Skv, D), T(tdt, Sq, H, Dv), T(tdt, Sq, H, Dv), T(f32, Sq, H), T(f32, H), T(i32, Sq, topk), T(tdt, Sq, H, D),
           T(tdt, Skv, D), T(f32, H), T(torch.uint8, i90.flash_attn_bwd_sm90_workspace_size(Sq, Skv, D, H)), softmax_scale=0.05,
           topk_length=T(i32, Sq) if tl else None, current_stream=up.stream)  # fmt: skip
        chunk = sm90_post_chunk(D)
        want = {
            "pre_sm90": (cdt, Dv, SM90_TILE_M, SM90_PRE_THREADS),
            "main_sm90": (cdt, D, Dv, H, SM90_TILE_M, SM90_TILE_N, SM90_THREADS, 1, 1, False, False, False, tl, topk),
            "post_sm90": (cdt, chunk, SM90_TILE_N, D, chunk, D // chunk),
        }[op]
        return caches[op], want, 1
    if op not in ("bwd", "bwd_d576"):
        raise KeyError(f"no fidelity route for op {op!r}")
    # SM100: upstream's prepared plan for a shape that selects the key; its lru_cache-d plan compilers
    # are recorded (their arguments are upstream's compile key); the plan reads tensor metadata only
    cache = up.plan_compilers((i100, "_compile_nondeterministic_sm100"), (i100, "_compile_deterministic_sm100"), (d576, "_compile_d576_2cta"))
    H, topk, tl, det, wide = key["heads"], key["topk"], key["topk_length"], key["deterministic"], key["wide"]
    D, dtype = (576, "bf16") if op == "bwd_d576" else (key["dim"], key["dtype"])
    tdt = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    backend, tile = select_backend(H, D, dtype, topk, det)
    Sq, Skv = policy.sm100_shape(op, key, target.sm_count)
    M = up.meta
    plan = api.SparseAttentionBackward(
        M(tdt, Sq, H, D), M(tdt, Skv, D), M(tdt, Sq, H, Dv), M(tdt, Sq, H, Dv), M(f32, Sq, H), M(f32, H), M(i32, Sq, topk),
        sample_topk_length=M(i32, Sq) if tl else None, deterministic=det,
    )  # fmt: skip
    if not plan.check_support():
        raise RuntimeError(f"upstream's check_support() declines S_q {Sq} S_kv {Skv} for {key}")
    plan.compile()
    cap = up.capability
    if op == "bwd_d576":
        want = ("_compile_d576_2cta", (cap, topk, tl, key["single_query"], key["split"], det, H, d576_compact_slots(target.sm_count) if det else 74, wide))
    elif det:
        want = ("_compile_deterministic_sm100", (0, cap, backend, tdt, D, Dv, H, topk, tl, key["planes"], key["relay"], wide))
    else:
        want = ("_compile_nondeterministic_sm100", (0, cap, backend, tdt, D, Dv, H, topk, tl, tile, wide))
    return cache, want, 0
