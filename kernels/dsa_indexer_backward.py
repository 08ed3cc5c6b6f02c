"""Spec of the DSA indexer backward family (cudnn.deepseek_sparse_attention.indexer_backward, 1.32.0).

The ops and their keys are the policy's (dsa_aot/policy/dsa_indexer_backward.py). Tensors mirror cudnn's
``to_cute_tensor`` on contiguous CUDA tensors: gmem, 16-byte aligned, every extent dynamic Int32,
every stride dynamic Int64 except the unit innermost one (v2 adds divisibility 128 on the innermost
extent and the strides). The fidelity stage builds the same keys through upstream's factories and
proves the cubins byte-identical; ``check_policy`` holds the policy's plane set and persistence rule
against upstream's on every build.
"""

from dsa_aot.policy import dsa_indexer_backward as policy
from dsa_aot.toolchain.fakes import dlpack

FAMILY = policy.FAMILY
OPS = policy.OPS
DIM, BLOCK_I = policy.DIM, policy.BLOCK_I


def build(op, key, target):
    """Return (jit_callable, args, options, extra_key) for one entry. Imports the toolchain."""
    import cuda.bindings.driver as cuda_driver
    import cutlass

    from cudnn.deepseek_sparse_attention.indexer_backward import deterministic_dk_sm100 as det
    from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_sm100 as k100
    from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_sm90 as k90
    from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_v2_sm100 as kv2

    T = dlpack  # to_cute_tensor's view of a contiguous CUDA tensor (v2: divisibility 128 innermost)
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
            T(bf16, 3, div=DIM), T(bf16, 2, div=DIM), T(bf16, 2), T(i32, 2), T(f32, 2), T(bf16, 3, div=DIM), T(dw, 2), T(f32, 2, div=DIM),
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
                         f"dsa_aot/policy/dsa_indexer_backward.py assumes {policy.PLANES}")
    grids = sorted({96, 132, 148, *(t.sm_count for t in targets)})
    for heads in (32, 64):
        for topk in (128, 256, 384, 512, 640, 1024, 2048):
            for grid in grids:
                for rows in (1, grid - 1, grid, grid + 1, 4 * grid):
                    theirs = k100.IndexerBackwardSm100(DIM, heads, BLOCK_I, topk, 1, rows, grid).use_persistent
                    if policy.gemm_persistent(topk, rows, grid) != theirs:
                        raise ValueError(f"upstream runs heads {heads} topk {topk} with {rows} rows on {grid} SMs persistent={theirs}; "
                                         f"dsa_aot/policy/dsa_indexer_backward.py gemm_persistent disagrees")


# --- fidelity: cudnn's own factories for each key (dsa_aot/toolchain/fidelity.py runs them) --------------

FIDELITY_ROUTES = {
    "score_grad": "indexer_backward_sm100(...).score_grad -> _score_grad_inplace_cute",
    "gemm": "indexer_backward_sm100(...)(...) [pdl] / .gemm_only [no pdl] -> _ensure_compiled",
    "reduce_dk": "deterministic_dk_sm100.reduce_deterministic_dk",
    "gemm_v2": "indexer_backward_v2_sm100(...)(...)",
    "score_grad_sm90": "indexer_backward_sm90(...).score_grad -> _score_grad_inplace_cute",
    "gemm_sm90": "indexer_backward_sm90(...)(...) -> _ensure_compiled",
}
PRELOAD = (
    "cudnn.deepseek_sparse_attention.indexer_backward.indexer_backward_sm100",
    "cudnn.deepseek_sparse_attention.indexer_backward.indexer_backward_sm90",
    "cudnn.deepseek_sparse_attention.indexer_backward.indexer_backward_v2_sm100",
    "cudnn.deepseek_sparse_attention.indexer_backward.deterministic_dk_sm100",
)
# Anchor shapes (manifests/default.toml): B = 1, S_q = S_k = 4096. Only what the key pins moves away
# from them. Tensors are never touched: their size costs no memory.
S_ANCHOR = 4096


def fidelity(op, key, target, up):
    """Run upstream's factory for (op, key) on ``up``; return (its compile cache, the key it must hold, calls)."""
    import torch

    from cudnn.deepseek_sparse_attention.indexer_backward import deterministic_dk_sm100 as det
    from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_sm90 as k90
    from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_sm100 as k100
    from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_v2_sm100 as kv2

    up.cudnn_route()
    for mod in (k100, kv2, k90):
        up.no_op(mod, "memset_zero_async")
    caches = {name: up.cache(mod, attr) for name, mod, attr in (
        ("k100.gemm", k100, "_compile_cache"), ("k100.score_grad", k100, "_score_grad_cute_cache"), ("det.reduce", det, "_compile_cache"),
        ("kv2.gemm", kv2, "_compile_cache"), ("k90.gemm", k90, "_compile_cache"), ("k90.score_grad", k90, "_score_grad_cute_cache"))}  # fmt: skip
    bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    T, stream = up.tensor, up.stream
    B, Sk, topk = 1, S_ANCHOR, key.get("topk")
    if op in ("score_grad", "score_grad_sm90"):
        Sq = S_ANCHOR
        att, isc, gl = T(f32, B, Sq, topk), T(f32, B, Sq, topk), T(f32, 1)
        if op == "score_grad":
            run = k100.indexer_backward_sm100(B, Sq, Sk, 64, DIM, topk)
            run.score_grad(att, isc, gl, 1.0, dIndexK_f32=T(f32, B, Sk, DIM) if key["zero_dk"] else None, current_stream=stream)
            return caches["k100.score_grad"], (topk, key["zero_dk"]), 1
        run = k90.indexer_backward_sm90(B, Sq, Sk, 64, DIM, topk)
        run.score_grad(att, isc, gl, 1.0, current_stream=stream)
        return caches["k90.score_grad"], (topk, False), 1
    if op == "reduce_dk":
        P = key["planes"]
        out = bf16 if key["out"] == "bf16" else f32
        det.reduce_deterministic_dk(T(f32, P, B * Sk, DIM), T(out, B, Sk, DIM), P, current_stream=stream)
        return caches["det.reduce"], (torch.device("cuda", 0), DIM, out, P), 1
    if op in ("gemm", "gemm_sm90"):
        H, glob = key["heads"], key["topk_global"]
        if op == "gemm":
            deterministic, P, pdl = key["deterministic"], key["planes"], key["pdl"]
            grid = P if deterministic else target.sm_count
            # persistence is upstream's choice from B*S_q vs the grid: more rows than the grid for a
            # persistent key (and >= planes for a deterministic one), no more than the grid otherwise
            Sq = max(S_ANCHOR, grid + 1) if key["persistent"] else grid
            run = k100.indexer_backward_sm100(B, Sq, Sk, H, DIM, topk, 1.0, BLOCK_I, topk_indices_global=glob, deterministic=deterministic,
                                              deterministic_dk_planes=P)
            cache, want = caches["k100.gemm"], (H, DIM, topk, BLOCK_I, glob, key["persistent"], grid, deterministic, P, pdl)
        else:
            Sq = S_ANCHOR
            run = k90.indexer_backward_sm90(B, Sq, Sk, H, DIM, topk, 1.0, BLOCK_I, topk_indices_global=glob)
            cache, want = caches["k90.gemm"], (H, DIM, topk, BLOCK_I, False, glob)
            pdl = True  # the full _run (kernel 1 + kernel 2), the only way upstream's SM90 path runs it
        q, w, k = T(bf16, B, Sq, H, DIM), T(bf16, B, Sq, H), T(bf16, B, Sk, DIM)
        dq, dw, dk = T(bf16, B, Sq, H, DIM), T(bf16, B, Sq, H), T(f32, B, Sk, DIM)
        att, isc, idx, gl = T(f32, B, Sq, topk), T(f32, B, Sq, topk), T(i32, B, Sq, topk), T(f32, 1)
        if pdl:  # the op: score-grad, then the GEMM as its PDL consumer (+ the deterministic reduction)
            ws = T(torch.uint8, det.deterministic_dk_workspace_bytes(B, Sk, DIM, 148) + 4096)
            run(q, w, k, dq, dw, dk, att, isc, idx, gl, 1.0, current_stream=stream, workspace=ws)
        else:
            run.gemm_only(q, w, k, dq, dw, dk, att, idx, current_stream=stream)
        return cache, want, 1
    if op == "gemm_v2":
        deterministic, P, rpc, idx_local = key["deterministic"], key["planes"], key["rows_per_cta"], key["idx_local"]
        n = P if deterministic else target.sm_count
        B = 2 if idx_local else 1  # upstream: idx_local = (not topk_indices_global) and batch > 1
        rows = rpc * n - (rpc * n) % B  # ceil(rows / n) == rows_per_cta (n > 1)
        Sq, H, dwt = rows // B, 64, (bf16 if key["dw"] == "bf16" else f32)
        run = kv2.indexer_backward_v2_sm100(B, Sq, Sk, H, DIM, topk, 1.0, BLOCK_I, topk_indices_global=not idx_local, dw_out_dtype=dwt,
                                            deterministic=deterministic, deterministic_dk_planes=P)
        ctas = min(P, rows) if deterministic else n
        slots, ring = policy.v2_schedule(-(-rows // ctas), deterministic)
        q, w, k = T(bf16, B, Sq, H, DIM), T(bf16, B, Sq, H), T(bf16, B, Sk, DIM)
        dq, dw, dk = T(bf16, B, Sq, H, DIM), T(dwt, B, Sq, H), T(f32, B, Sk, DIM)
        att, isc, idx, gl = T(f32, B, Sq, topk), T(f32, B, Sq, topk), T(i32, B, Sq, topk), T(f32, 1)
        ws = T(torch.uint8, det.deterministic_dk_workspace_bytes(B, Sk, DIM, 148) + 4096)
        run(q, w, k, dq, dw, dk, att, isc, idx, gl, 1.0, current_stream=stream, workspace=ws)
        return caches["kv2.gemm"], (H, DIM, topk, ctas, slots, ring, dwt, idx_local, deterministic, P), 1
    raise KeyError(f"no fidelity route for op {op!r}")
