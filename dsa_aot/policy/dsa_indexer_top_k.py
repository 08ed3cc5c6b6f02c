"""Policy of the DSA indexer top-k (cudnn.deepseek_sparse_attention.indexer_top_k, 1.32.0):
``indexer_top_k_wrapper`` / ``IndexerTopK``.

One op, ``top_k``: ``IndexerTopKKernelVarlenDecode`` (indexer_top_k_decode_varlen.py), a SIMT radix
select that builds the same way for sm_90a and sm_100a. Upstream's compile key
(``compile_topk_kernel``) and what each field is here:

  dtype          the values' dtype (float32, float16, bfloat16)
  cols           next power of two of the call's column count (upstream's bucket; the kernel reads the
                 real count from the tensor, the bucket sizes its shared memory)
  top_k          static: the outputs' row width (1..2048)
  next_n         the speculative-decoding stagger, static
  return_val     whether values are written too
  tie_break      0 arbitrary, 1 smaller column wins, 2 larger column wins
  deterministic  repeatable cutoff, ascending valid ids
  large          ``n_rows > 148``: a literal in upstream (not the SM count), the 512-thread variant
                 with a smaller shared-memory tile

``num_copy_bits`` (256, upstream's default, the only value shipped) and the deterministic ordering
(derived per target: :func:`ordering`) complete upstream's key. Every field changes the cubin
(measured on sm_90a). One launch per row chunk, no memset; an int32 radix scratch the caller's
workspace holds.
"""

from .keys import Choice, IntRange, Op

__all__ = ["FAMILY", "OPS", "DTYPES", "MAX_TOP_K", "LARGE_ROWS", "COPY_BITS", "bucket", "top_k_kernel", "ordering", "buffer_numbers",
           "workspace_bytes", "row_chunks", "ALIGN"]

FAMILY = "dsa_indexer_top_k"
DTYPES = ("float32", "float16", "bfloat16")
MAX_TOP_K = 2048
LARGE_ROWS = 148  # large_occupancy = n_rows > 148 (compile_topk_kernel: a literal, the same on every GPU)
COPY_BITS = 256  # num_copy_bits: upstream's default
ALIGN = 32  # INPUT_ALIGN / BUFFER_ALIGN: the input and the radix scratch are 32-byte aligned
MAX_COLS = 1 << 20
MAX_ROWS = (1 << 31) - 1  # the kernel indexes rows with int32
_I32 = (1 << 31) - 1
_BOOL = Choice(False, True)
_SM100_CAPABILITY = (10, 0)
_BITMAP_MAX_COLS = 262144  # DETERMINISTIC_BITMAP_MAX_NUM_COLS

# Ops whose cubins bake the target's SM count (one entry per SM count; a GPU needs its own): none here, so
# any target of the GPU's arch serves it (the build checks the cubins agree when a manifest has several)
SM_COUNT_OPS = frozenset()

OPS = {
    "top_k": Op(fields={
        "dtype": Choice(*DTYPES),
        "cols": Choice(*(1 << i for i in range(MAX_COLS.bit_length()))),
        "top_k": IntRange(1, MAX_TOP_K),
        "next_n": IntRange(1, 1024),
        "return_val": _BOOL,
        "tie_break": Choice(0, 1, 2),
        "deterministic": _BOOL,
        "large": _BOOL,
    }),
}  # fmt: skip


def bucket(num_cols: int) -> int:
    """Upstream's column bucket: the next power of two (1 for none)."""
    return 1 if num_cols <= 0 else 1 << (num_cols - 1).bit_length()


def top_k_kernel(dtype: str, num_cols: int, top_k: int, next_n: int, return_val: bool, tie_break: int, deterministic: bool, n_rows: int) -> tuple:
    """(op, key) of the entry that serves a call (upstream's compile key, from the call's shapes)."""
    return "top_k", {"dtype": dtype, "cols": bucket(num_cols), "top_k": int(top_k), "next_n": int(next_n), "return_val": bool(return_val),
                     "tie_break": int(tie_break), "deterministic": bool(deterministic), "large": n_rows > LARGE_ROWS}


def ordering(capability: tuple, key: dict) -> str:
    """The deterministic ordering upstream resolves for ``key`` on a GPU of ``capability`` ("auto"
    when not deterministic): compute capability (10, 0) has its own table, every other one
    (9, 0; 10, 3) the generic rule."""
    if not key["deterministic"]:
        return "auto"
    cols = key["cols"]
    if tuple(capability) == _SM100_CAPABILITY:
        if key["top_k"] < 256:
            limit = 0
        elif not key["large"] or (key["dtype"] != "float32" and key["top_k"] > 1024):
            limit = 262144
        else:
            limit = 65536 if key["top_k"] <= 512 else 131072
        return "bitmap" if cols <= limit else "bitonic"
    return "bitmap" if cols <= _BITMAP_MAX_COLS else "bitonic"


def buffer_numbers(dtype: str) -> int:
    """int32 radix-scratch words per input element: two histogram passes for float32."""
    return 2 if dtype == "float32" else 1


def workspace_bytes(n_rows: int, num_cols: int, dtype: str) -> int:
    """Bytes of the radix scratch (upstream's ``scratch_workspace_bytes``: rounded up to 128)."""
    n = n_rows * buffer_numbers(dtype) * num_cols * 4
    return -(-n // 128) * 128


def row_chunks(n_rows: int, num_cols: int, dtype: str, next_n: int, esize: int):
    """The row ranges upstream launches (``launch_topk_kernel``): one, unless the int32 scratch index
    would overflow; then chunks of a multiple of lcm(next_n, 32 / element size) rows. Returns a list of
    (lo, hi), or a str saying why no chunk fits."""
    elems = buffer_numbers(dtype) * num_cols
    if n_rows * elems <= _I32:
        return [(0, n_rows)]
    max_rows = (_I32 + 1) // elems if elems else n_rows
    align = max(1, ALIGN // esize)
    step = next_n * align // _gcd(next_n, align)
    if max_rows < step:
        return (f"num_cols={num_cols} makes one aligned row chunk ({step} rows) exceed the int32 scratch indexing limit; "
                "reduce num_cols or next_n")
    rows = max_rows // step * step
    return [(lo, min(lo + rows, n_rows)) for lo in range(0, n_rows, rows)]


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
