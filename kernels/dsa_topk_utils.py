"""Spec of the DSA top-k index utilities (cudnn.deepseek_sparse_attention.indexer_top_k, 1.32.0):
``LocalToGlobalTopK`` and ``CompactifyKernel``.

The ops and their keys are the policy's (dsa_aot/policy/dsa_topk_utils.py). Upstream compiles both on
their first call from the call's own tensors through ``to_cute_tensor``: gmem, 16-byte aligned, every
extent dynamic Int32, every stride dynamic Int64 but the unit innermost one (1-D cu_seqlens: one
dynamic extent, unit stride), options ``--opt-level 3``. ``build`` presents the same; the fidelity
stage runs upstream's own functions and proves the cubins byte-identical. ``check_policy`` holds the
policy's key fields to the kernels' constructors on every build.
"""

from dsa_aot.policy import dsa_topk_utils as policy

FAMILY = policy.FAMILY
OPS = policy.OPS
_OPTIONS = "--opt-level 3"  # compile_options("--opt-level 3") in both upstream modules


def build(op, key, target):
    """Return (kernel object, args, options, extra_key) for one entry. Imports the toolchain."""
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from cudnn.deepseek_sparse_attention.indexer_top_k import compactify as cmp
    from cudnn.deepseek_sparse_attention.indexer_top_k import local_to_global_dsl as l2g

    def T(dtype, rank):
        """What to_cute_tensor makes of a contiguous CUDA tensor of this rank."""
        shape = tuple(cute.sym_int() for _ in range(rank))
        stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
        return make_fake_tensor(dtype, shape, stride, memspace=cute.AddressSpace.gmem, assumed_align=16)

    i32, stream = cutlass.Int32, cuda_driver.CUstream(0)
    if op == "local_to_global":
        rank = 2 if key["varlen"] else 3
        idx = cutlass.Int32 if key["dtype"] == "int32" else cutlass.Int64
        obj = l2g.LocalToGlobalTopK(is_varlen=key["varlen"], preserve_negative=key["preserve_negative"])
        cu = (T(i32, 1), T(i32, 1)) if key["varlen"] else (None, None)
        return obj, (T(idx, rank), T(i32, rank), cutlass.Int32(1), *cu, stream), _OPTIONS, {"threads": obj.threads_per_cta}
    if op == "compactify":
        obj = cmp.CompactifyKernel(cols=key["cols"])
        return obj, (T(i32, 2), T(i32, 2), T(i32, 1), cutlass.Int32(1), stream), _OPTIONS, {}
    raise KeyError(op)


def check_policy(targets):
    """The key fields are the kernels' constructor parameters (a new one upstream adds would be a new
    key field), and the dtypes local_to_global accepts are the policy's."""
    import inspect

    from cudnn.deepseek_sparse_attention.indexer_top_k import compactify as cmp
    from cudnn.deepseek_sparse_attention.indexer_top_k import local_to_global_dsl as l2g

    for cls, want in ((l2g.LocalToGlobalTopK, {"is_varlen", "preserve_negative", "threads_per_cta"}), (cmp.CompactifyKernel, {"cols"})):
        got = set(inspect.signature(cls.__init__).parameters) - {"self"}
        if got != want:
            raise ValueError(f"cudnn's {cls.__name__} takes {sorted(got)}; dsa_aot/policy/dsa_topk_utils.py keys on {sorted(want)}")
    src = inspect.getsource(l2g.local_to_global)
    if "(torch.int32, torch.int64)" not in src:
        raise ValueError("cudnn's local_to_global no longer accepts exactly int32 and int64 indices; update dsa_aot/policy/dsa_topk_utils.py")


# --- fidelity: cudnn's own functions for each key (dsa_aot/toolchain/fidelity.py runs them) --------------

FIDELITY_ROUTES = {
    "local_to_global": "local_to_global_dsl.local_to_global (preserve_negative: _local_to_global_inplace) -> _launch_local_to_global",
    "compactify": "compactify.compactify -> _compile_or_fetch",
}
PRELOAD = (
    "cudnn.deepseek_sparse_attention.indexer_top_k.local_to_global_dsl",
    "cudnn.deepseek_sparse_attention.indexer_top_k.compactify",
)


def fidelity(op, key, target, up):
    """Run upstream's function for (op, key) on ``up``; return (its compile cache, the key it must hold, calls).

    The public functions allocate their outputs with torch on the inputs' device and switch torch's
    stream: here ``torch.empty(_like)`` give CUDA-presenting CPU tensors and the stream switch is a
    no-op (nothing launches)."""
    import contextlib

    import torch

    from cudnn.deepseek_sparse_attention.indexer_top_k import compactify as cmp
    from cudnn.deepseek_sparse_attention.indexer_top_k import local_to_global_dsl as l2g

    up.cudnn_route()
    T, i32 = up.tensor, torch.int32
    for mod in (l2g, cmp):
        up.patch(mod, "torch_stream_context", lambda *a, **k: contextlib.nullcontext())
    up.on_host("empty_like", "empty")
    if op == "local_to_global":
        cache = up.cache(l2g, "_compile_cache")
        dt = torch.int32 if key["dtype"] == "int32" else torch.int64
        idx = T(dt, 64, 2048) if key["varlen"] else T(dt, 2, 32, 2048)
        cu = (T(i32, 3), T(i32, 3)) if key["varlen"] else (None, None)
        if key["preserve_negative"]:
            l2g._local_to_global_inplace(idx, 0 if key["varlen"] else 4096, *cu, stream=up.stream)
        else:
            l2g.local_to_global(idx, 4096, *cu, stream=up.stream)
        return cache, (dt, key["varlen"], key["preserve_negative"]), 1
    if op == "compactify":
        cache = up.cache(cmp, "_compile_cache")
        cmp.compactify(T(i32, 2, 16, key["cols"]), stream=up.stream)
        return cache, (key["cols"],), 1
    raise KeyError(f"no fidelity route for op {op!r}")
