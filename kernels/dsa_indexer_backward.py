"""Spec of the DSA indexer backward family (cudnn.deepseek_sparse_attention.indexer_backward, 1.32.0).

The ops and their keys are the policy's (aot/policy/dsa_indexer_backward.py). Tensors mirror cudnn's
``to_cute_tensor`` on contiguous CUDA tensors: gmem, 16-byte aligned, every extent dynamic Int32,
every stride dynamic Int64 except the unit innermost one (v2 adds divisibility 128 on the innermost
extent and the strides). The fidelity stage builds the same keys through upstream's factories and
proves the cubins byte-identical; ``check_policy`` holds the policy's plane set and persistence rule
against upstream's on every build.
"""

from aot.policy import dsa_indexer_backward as policy

FAMILY = policy.FAMILY
OPS = policy.OPS
DIM, BLOCK_I = policy.DIM, policy.BLOCK_I


def build(op, key, target):
    """Return (jit_callable, args, options, extra_key) for one entry. Imports the toolchain."""
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from cudnn.deepseek_sparse_attention.indexer_backward import deterministic_dk_sm100 as det
    from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_sm100 as k100
    from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_sm90 as k90
    from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_v2_sm100 as kv2

    def T(dtype, rank, div=None):
        """What to_cute_tensor makes of a contiguous CUDA tensor of this rank."""
        if div is None:
            shape = tuple(cute.sym_int() for _ in range(rank))
            stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
        else:
            shape = tuple(cute.sym_int() for _ in range(rank - 1)) + (cute.sym_int(divisibility=div),)
            stride = tuple(cute.sym_int64(divisibility=div) for _ in range(rank - 1)) + (1,)
        return make_fake_tensor(dtype, shape, stride, memspace=cute.AddressSpace.gmem, assumed_align=16)

    bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    stream = cuda_driver.CUstream(0)

    if op == "score_grad":
        obj = k100.ScoreGradSm100(topk=key["topk"], zero_dk_f32=key["zero_dk"])
        # score-only mode passes grad_loss again as the (unused) 4th tensor, like upstream
        dk = T(f32, 3) if key["zero_dk"] else T(f32, 1)
        args = (T(f32, 3), T(f32, 3), T(f32, 1), dk, cutlass.Float32(1.0), stream)
        return obj, args, "--opt-level 2", {"threads": obj.threads_per_cta, "rows_per_cta": obj.rows_per_cta}

    if op == "gemm":
        grid = key["planes"] if key["deterministic"] else target.sm_count
        # upstream picks persistence from B*S_q against the grid; present the row count that gives
        # this key's choice and check upstream agrees (topk 512 ignores it).
        rows = grid + 1 if key["persistent"] else 1
        obj = k100.IndexerBackwardSm100(
            head_dim=DIM,
            heads=key["heads"],
            block_I=BLOCK_I,
            topk=key["topk"],
            total_seqlen_k=1,
            total_rows=rows,
            persistent_grid_size=grid,
            topk_indices_global=key["topk_global"],
            enable_score_pdl=key["pdl"],
            deterministic=key["deterministic"],
        )
        if obj.use_persistent != key["persistent"]:
            raise ValueError(f"gemm {key}: upstream decides persistent={obj.use_persistent} for {rows} rows on a {grid} grid")
        dk_rank = 3  # (B, S_k, D) accumulator, or (planes, B*S_k, D) deterministic planes
        args = (T(bf16, 4), T(bf16, 3), T(bf16, 3), T(bf16, 4), T(bf16, 3), T(f32, dk_rank), T(f32, 3), T(i32, 3), cutlass.Float32(1.0), stream)
        extra = {"grid": grid, "use_persistent": obj.use_persistent, "cross_row": obj.use_cross_row_persistent, "tma_gather": obj.use_tma_gather}
        return obj, args, "--opt-level 2", extra

    if op == "reduce_dk":
        obj = det.DeterministicDkReduceSm100(DIM, key["planes"])
        out = bf16 if key["out"] == "bf16" else f32
        return obj, (T(f32, 3), T(out, 3), stream), "--opt-level 2", {}

    if op == "gemm_v2":
        slots, ring = policy.v2_schedule(key["rows_per_cta"], key["deterministic"])
        num_ctas = key["planes"] if key["deterministic"] else target.sm_count
        obj = kv2.IndexerBackwardV2Sm100(
            num_heads=64,
            head_dim=DIM,
            topk=key["topk"],
            num_ctas=num_ctas,
            ticket_slots=slots,
            ring_depth=ring,
            dw_out_bf16=key["dw"] == "bf16",
            idx_local=key["idx_local"],
            deterministic=key["deterministic"],
        )
        dw = bf16 if key["dw"] == "bf16" else f32
        args = (
            T(bf16, 3, DIM), T(bf16, 2, DIM), T(bf16, 2), T(i32, 2), T(f32, 2), T(bf16, 3, DIM), T(dw, 2), T(f32, 2, DIM),
            cutlass.Float32(1.0), cutlass.Int32(1), cutlass.Int32(1), stream, T(i32, 1),
        )  # fmt: skip
        return obj, args, None, {"num_ctas": num_ctas, "ticket_slots": slots, "ring_depth": ring}

    if op == "score_grad_sm90":
        obj = k90.ScoreGradSm90(topk=key["topk"], index_is_log=False)
        return obj, (T(f32, 3), T(f32, 3), T(f32, 1), cutlass.Float32(1.0), stream), None, {}

    if op == "gemm_sm90":
        obj = k90.IndexerBackwardSm90(head_dim=DIM, heads=key["heads"], block_I=BLOCK_I, topk=key["topk"], topk_indices_global=key["topk_global"])
        args = (
            T(bf16, 4), T(bf16, 3), T(bf16, 3), T(bf16, 4), T(bf16, 3), T(f32, 3), T(f32, 3), T(i32, 3),
            cutlass.Float32(1.0), stream, None, None, cutlass.Int32(1), cutlass.Int32(1),
        )  # fmt: skip
        return obj, args, None, {}
    raise KeyError(op)


def check_policy(targets):
    """The policy against upstream: the deterministic plane set and the non-deterministic GEMM's persistence rule."""
    from cudnn.deepseek_sparse_attention.indexer_backward import deterministic_dk_sm100 as det
    from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_sm100 as k100

    if tuple(det.SUPPORTED_DK_PLANES) != policy.PLANES or det.DEFAULT_DK_PLANES != policy.DEFAULT_PLANES:
        raise ValueError(f"cudnn's deterministic dK planes are {det.SUPPORTED_DK_PLANES} (default {det.DEFAULT_DK_PLANES}); "
                         f"aot/policy/dsa_indexer_backward.py assumes {policy.PLANES}")
    grids = sorted({96, 132, 148, *(t.sm_count for t in targets)})
    for heads in (32, 64):
        for topk in (128, 256, 384, 512, 640, 1024, 2048):
            for grid in grids:
                for rows in (1, grid - 1, grid, grid + 1, 4 * grid):
                    theirs = k100.IndexerBackwardSm100(DIM, heads, BLOCK_I, topk, 1, rows, grid).use_persistent
                    if policy.gemm_persistent(topk, rows, grid) != theirs:
                        raise ValueError(f"upstream runs heads {heads} topk {topk} with {rows} rows on {grid} SMs persistent={theirs}; "
                                         f"aot/policy/dsa_indexer_backward.py gemm_persistent disagrees")
