"""Spec of the DSA indexer top-k (cudnn.deepseek_sparse_attention.indexer_top_k, 1.32.0):
``IndexerTopKKernelVarlenDecode``.

The op and its key are the policy's (dsa_aot/policy/dsa_indexer_top_k.py). ``build`` presents what
``compile_topk_kernel`` does: compact fake tensors with symbolic rows, columns and batch (the input and
the int32 radix scratch 32-byte aligned, the outputs' width static top-k), the kernel object with the
bucket, the flags and the deterministic ordering upstream resolves for the target's capability.

One difference, by design: upstream compiles against the TVM-FFI environment stream (its compiled
function has no stream argument and launches on torch's current stream). The host function the
build lifts takes the stream as its last argument either way (the TVM-FFI wrapper around it fetches
the environment stream and passes it in), and the kernel is the same: here the fake stream is an
explicit one and no TVM-FFI wrapper is generated, so the launcher takes the stream the op passes.
The fidelity stage proves the cubin byte-identical to the one upstream's own route compiles.
"""

from dsa_aot.policy import dsa_indexer_top_k as policy
from dsa_aot.policy.arch import CAPABILITY

FAMILY = policy.FAMILY
OPS = policy.OPS


def _dtype(name):
    import cutlass

    return {"float32": cutlass.Float32, "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[name]


def build(op, key, target):
    """Return (kernel object, args, options, extra_key) for one entry. Imports the toolchain."""
    import cutlass
    import cutlass.cute as cute

    from cudnn.deepseek_sparse_attention.indexer_top_k import indexer_top_k_decode_varlen as m

    if target.arch not in CAPABILITY:
        raise ValueError(f"dsa_indexer_top_k: no capability known for {target.arch} (upstream's deterministic ordering depends on it)")
    dt = _dtype(key["dtype"])
    order = policy.ordering(CAPABILITY[target.arch], key)
    rows, cols, batch = cute.sym_int(), cute.sym_int(), cute.sym_int()
    fake = cute.runtime.make_fake_compact_tensor
    inp = fake(dt, (rows, cols), stride_order=(1, 0), assumed_align=policy.ALIGN)
    buf = fake(cutlass.Int32, (cute.sym_int(), cute.sym_int(), cute.sym_int()), stride_order=(2, 1, 0), assumed_align=policy.ALIGN)
    seq = fake(cute.Int32, (batch,), stride_order=(0,))
    out_i = fake(cutlass.Int32, (rows, key["top_k"]), stride_order=(1, 0))
    out_v = fake(dt, (rows, key["top_k"]), stride_order=(1, 0)) if key["return_val"] else None
    obj = m.IndexerTopKKernelVarlenDecode(dt, key["cols"], key["top_k"], key["next_n"], num_copy_bits=policy.COPY_BITS,
                                          return_val=key["return_val"], large_occupancy=key["large"], tie_break=key["tie_break"],
                                          deterministic=key["deterministic"], deterministic_ordering=order)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=False)
    # upstream passes the stream and the two Constexpr flags by keyword (no persistent scheduling, one
    # block per SM minimum); they are __call__'s trailing parameters, so positionally here
    args = (inp, None, buf, None, seq, out_i, out_v, stream, False, 1)
    return obj, args, None, {"ordering": order, "threads": obj.num_threads_per_cta}


def check_policy(targets):
    """The policy's rules are upstream's: the bucket, the large-occupancy threshold, the deterministic
    ordering per capability, the scratch words per element, the alignment, the copy width default,
    the chunking rule and the kernel's constructor parameters (a new one would be a new key field)."""
    import inspect

    import cutlass
    import torch

    from cudnn.deepseek_sparse_attention.indexer_top_k import api
    from cudnn.deepseek_sparse_attention.indexer_top_k import indexer_top_k_decode_varlen as m
    from cudnn.deepseek_sparse_attention.indexer_top_k import indexer_top_k_varlen_util as u

    problems = []
    for n in (1, 2, 3, 100, 4096, 4097, 65536, 100000, 131072, 131073):
        if m._bucket_num_cols(n) != policy.bucket(n):
            problems.append(f"bucket({n}): upstream {m._bucket_num_cols(n)}, policy {policy.bucket(n)}")
    src = inspect.getsource(m.compile_topk_kernel)
    if f"large_occupancy = num_rows > {policy.LARGE_ROWS}" not in src:
        problems.append(f"compile_topk_kernel no longer sets large_occupancy = num_rows > {policy.LARGE_ROWS}")
    dts = {"float32": cutlass.Float32, "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}
    for t in targets:
        cap = CAPABILITY.get(t.arch)
        if cap is None:
            continue
        for dtype in policy.DTYPES:
            for top_k in (64, 255, 256, 512, 513, 1024, 1025, 2048):
                for large in (False, True):
                    for cols in (1 << i for i in range(10, 20)):
                        key = {"dtype": dtype, "cols": cols, "top_k": top_k, "large": large, "deterministic": True}
                        if cap == (10, 0):
                            lim = m._sm100_deterministic_bitmap_max_cols(dts[dtype], top_k, large)
                            want = "bitmap" if cols <= lim else "bitonic"
                        else:
                            want = u.resolve_deterministic_ordering(cols, True, "auto")
                        got = policy.ordering(cap, key)
                        if got != want:
                            problems.append(f"ordering on {t.arch} {key}: upstream {want}, policy {got}")
    for dtype, tdt in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        if m.buffer_numbers(tdt) != policy.buffer_numbers(dtype):
            problems.append(f"buffer_numbers({dtype}): upstream {m.buffer_numbers(tdt)}, policy {policy.buffer_numbers(dtype)}")
    if (m.INPUT_ALIGN, m.BUFFER_ALIGN) != (policy.ALIGN, policy.ALIGN):
        problems.append(f"alignment: upstream input {m.INPUT_ALIGN} / scratch {m.BUFFER_ALIGN}, policy {policy.ALIGN}")
    sig = inspect.signature(api.indexer_top_k_wrapper).parameters
    if sig["num_copy_bits"].default != policy.COPY_BITS:
        problems.append(f"indexer_top_k_wrapper's num_copy_bits default is {sig['num_copy_bits'].default}, the policy ships {policy.COPY_BITS}")
    got = set(inspect.signature(m.IndexerTopKKernelVarlenDecode.__init__).parameters) - {"self"}
    # the key's fields, and the defaults upstream leaves (multi-CTA, merge, persistent: off; debug)
    want = {"dtype", "max_num_cols", "top_k", "next_n", "num_copy_bits", "return_val", "large_occupancy", "tie_break", "deterministic",
            "deterministic_ordering", "enable_multi_cta", "enable_dynamic_multi_cta", "chunk_size_per_cta", "num_ctas_per_row", "merge_blocks",
            "varlen_merge_input", "num_sms", "debug"}
    if got != want:
        problems.append(f"IndexerTopKKernelVarlenDecode takes {sorted(got)}; the spec knows {sorted(want)}")
    # the chunking rule, against upstream's loop run on a recorder
    for n_rows, num_cols, dtype, next_n in ((16384, 65536, "float32", 1), (16385, 65536, "float32", 1), (40000, 65536, "float32", 2),
                                            (70000, 65536, "bfloat16", 3), (8, 1 << 28, "float32", 1)):
        want = _upstream_chunks(m, n_rows, num_cols, dtype, next_n)
        got = policy.row_chunks(n_rows, num_cols, dtype, next_n, 4 if dtype == "float32" else 2)
        if isinstance(want, str) != isinstance(got, str) or (not isinstance(want, str) and want != got):
            problems.append(f"row chunks of {n_rows} x {num_cols} {dtype} next_n {next_n}: upstream {want}, policy {got}")
    if problems:
        raise ValueError("dsa_aot/policy/dsa_indexer_top_k.py disagrees with cudnn: " + "; ".join(problems))


def _upstream_chunks(m, n_rows, num_cols, dtype, next_n):
    """The row ranges upstream's launch_topk_kernel launches, from shape-only stand-ins."""

    class Rows:
        def __init__(self, shape, esize=4):
            self.shape, self.esize = shape, esize

        def element_size(self):
            return self.esize

        def __getitem__(self, s):
            return (s.start, s.stop)

    seen = []
    esize = 4 if dtype == "float32" else 2
    try:
        m.launch_topk_kernel(lambda inp, *a: seen.append(inp if isinstance(inp, tuple) else (0, n_rows)), Rows((n_rows, num_cols), esize),
                             Rows((n_rows // next_n,)), Rows((n_rows, 1)), None, Rows((n_rows, policy.buffer_numbers(dtype), num_cols)), next_n)
    except ValueError as e:
        return str(e)
    return seen


# --- fidelity: cudnn's own wrapper for each key (dsa_aot/toolchain/fidelity.py runs it) -----------------

FIDELITY_ROUTES = {"top_k": "api.indexer_top_k_wrapper -> IndexerTopK.check_support / compile -> compile_topk_kernel -> launch_topk_kernel"}
PRELOAD = ("cudnn.deepseek_sparse_attention.indexer_top_k.api", "cudnn.deepseek_sparse_attention.indexer_top_k.indexer_top_k_decode_varlen")


def fidelity(op, key, target, up):
    """Run ``indexer_top_k_wrapper`` for (op, key) on ``up``; return (its compile cache, the key it
    must hold, calls). Rows: 8 for the small-occupancy variant, 152 for the large one; columns: the
    bucket's top value less 3 (any count in the bucket compiles the same kernel)."""
    import contextlib

    import torch

    from cudnn.deepseek_sparse_attention.indexer_top_k import api
    from cudnn.deepseek_sparse_attention.indexer_top_k import indexer_top_k_decode_varlen as m

    up.cudnn_route()
    T = up.tensor
    for name in ("_torch_stream_context", "device_context"):
        up.patch(api, name, lambda *a, **k: contextlib.nullcontext())
    up.patch(api, "launch_stream", lambda *a, **k: None)
    up.patch(torch.Tensor, "record_stream", lambda self, s=None: None)
    up.on_host("empty")
    up.patch(api, "_cache_of_IndexerTopKObjects", {})
    cache = up.cache(m, "_compile_cache")
    dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[key["dtype"]]
    next_n = key["next_n"]
    batch = -(-(152 if key["large"] else 8) // next_n)
    cols = max(1, key["cols"] - 3) if key["cols"] > 4 else key["cols"]
    api.indexer_top_k_wrapper(T(dt, batch * next_n, cols), T(torch.int32, batch), key["top_k"], next_n=next_n, return_val=key["return_val"],
                              stream=up.stream, tie_break=key["tie_break"], deterministic=key["deterministic"])
    cdt = _dtype(key["dtype"])
    want = (0, cdt, key["cols"], key["top_k"], next_n, key["return_val"], policy.COPY_BITS, False, key["large"], key["tie_break"],
            key["deterministic"], policy.ordering(up.capability, key))
    return cache, want, 1
