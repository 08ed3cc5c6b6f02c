"""Spec of the CSA compressor family (cudnn.csa.compressor, nvidia-cudnn-frontend==1.32.0).

Ops and their compile keys (KERNELS.md):
  fwd_r128    ratio 128 forward; schedule chosen by cudnn's _fwd_schedule_r128 from the nb_total bucket
  bwd_r128    ratio 128 backward; schedule from _bwd_schedule_r128's bucket; deterministic dAPE or not
  fwd, bwd    ratio 2/4 generic kernels, any head_dim (one compile per d)
  dape_reduce the fixed-order dAPE reduction of deterministic backward (serial, or split in 2 kernels)

``build`` returns cudnn's own ``@cute.jit`` launch function and arguments that mirror the JIT path
exactly: raw gmem pointers made with ``make_ptr`` at the alignments cudnn uses (16 for bf16/fp32, 4 for
int32 cu_seqlens), cutlass.Int32 scalars, a CUstream. Pointer and scalar *values* are not part of the
compile; the build records the upstream schedule that the bucket resolves to, and checks that the
runtime's bucket policy (aot.csa) picks the same schedule upstream would for every nb_total sampled
from the bucket.
"""

from aot.specs import Choice, IntRange, Op

FAMILY = "csa_compressor"

_BOOL = Choice(False, True)


def _needs_reduce(key):
    """Deterministic backward reuses cudnn's fixed-order dAPE reduction: split at ratio 4 only."""
    if not key.get("deterministic"):
        return []
    return [("dape_reduce", {"split": key["ratio"] == 4})]


OPS = {
    "fwd_r128": Op(
        fields={"ratio": Choice(128), "coff": Choice(1, 2), "d": Choice(128, 512), "bucket": Choice("small", "default", "large")},
    ),
    "bwd_r128": Op(
        fields={"ratio": Choice(128), "coff": Choice(1, 2), "d": Choice(128, 512), "bucket": Choice("small", "default"), "deterministic": _BOOL},
        requires=_needs_reduce,
    ),
    "fwd": Op(fields={"ratio": Choice(2, 4), "coff": Choice(1, 2), "d": IntRange(1, 65536)}),
    "bwd": Op(fields={"ratio": Choice(2, 4), "coff": Choice(1, 2), "d": IntRange(1, 65536), "deterministic": _BOOL}, requires=_needs_reduce),
    "dape_reduce": Op(fields={"split": _BOOL}),
}


def build(op, key, target):
    """Return (jit_function, args, options, extra_key) for one entry. Imports the toolchain."""
    import cuda.bindings.driver as cuda_driver
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr
    from cudnn.csa.compressor import compressor_sm100 as g
    from cudnn.csa.compressor import compressor_sm100_r128 as r

    def bf16():
        return make_ptr(cutlass.BFloat16, 0, cute.AddressSpace.gmem, assumed_align=16)

    def f32():
        return make_ptr(cutlass.Float32, 0, cute.AddressSpace.gmem, assumed_align=16)

    def i32():
        return make_ptr(cutlass.Int32, 0, cute.AddressSpace.gmem, assumed_align=4)

    def ints(n):
        return tuple(cutlass.Int32(1) for _ in range(n))

    stream = cuda_driver.CUstream(0)
    fwd_ptrs = (bf16(), bf16(), f32(), i32(), i32(), bf16())
    bwd_ptrs = (bf16(), bf16(), f32(), i32(), i32(), bf16(), bf16(), bf16(), f32())

    if op == "fwd_r128":
        sched = _resolved_schedule(r._fwd_schedule_r128, key, "fwd_r128")
        args = (*fwd_ptrs, *ints(2), stream, key["ratio"], key["d"], key["coff"], *sched)
        return r._compressor_fwd_r128_launch, args, None, {"schedule": list(sched)}
    if op == "bwd_r128":
        sched = _resolved_schedule(r._bwd_schedule_r128, key, "bwd_r128")
        _check_rows_policy(r, key, sched)
        args = (*bwd_ptrs, *ints(4), stream, key["ratio"], key["d"], key["coff"], *sched, key["deterministic"])
        return r._compressor_bwd_r128_launch, args, None, {"schedule": list(sched)}
    if op == "fwd":
        args = (*fwd_ptrs, *ints(2), stream, key["ratio"], key["d"], key["coff"], *g._fwd_schedule(key["d"]))
        return g._compressor_fwd_launch, args, None, {}
    if op == "bwd":
        _check_constants(g)
        args = (*bwd_ptrs, *ints(3), stream, key["ratio"], key["d"], key["coff"], g._BWD_ROWS, g._BWD_THREADS, key["deterministic"])
        return g._compressor_bwd_launch, args, None, {}
    if op == "dape_reduce":
        _check_constants(g)
        args = (f32(), f32(), f32(), *ints(2), stream, key["split"])
        return g._dape_reduce_launch, args, None, {}
    raise KeyError(op)


def _resolved_schedule(upstream, key, op):
    """The upstream schedule of this bucket, after proving the runtime policy agrees with upstream.

    Every nb_total sampled from the bucket's range (its bounds and points inside) must map to the
    same upstream schedule; otherwise the runtime would launch a cubin upstream would not.
    """
    from aot.csa import bucket_range

    lo, hi = bucket_range(op, key["bucket"])
    samples = sorted({lo, hi, (lo + hi) // 2, lo + 1, max(lo, hi - 1)})
    scheds = {nb: upstream(key["ratio"], key["d"], key["coff"], nb) for nb in samples}
    if len(set(scheds.values())) != 1:
        raise ValueError(f"{op} {key}: upstream picks several schedules inside bucket {key['bucket']!r}: {scheds}; the runtime bucket policy in aot/csa.py no longer matches cudnn")
    return next(iter(scheds.values()))


def _check_constants(g):
    """Constants upstream bakes into its launch code, which the runtime (aot.csa) must match."""
    from aot import csa

    for mine, theirs, name in ((csa.BWD_ROWS, g._BWD_ROWS, "_BWD_ROWS"), (csa.DAPE_GROUP_PARTIALS, g._DAPE_REDUCTION_GROUP_PARTIALS, "_DAPE_REDUCTION_GROUP_PARTIALS")):
        if mine != theirs:
            raise ValueError(f"cudnn's compressor_sm100.{name} is {theirs} but aot/csa.py assumes {mine}; update aot/csa.py")


def _check_rows_policy(r, key, sched):
    """aot.csa's run-time rows_per_cta must equal upstream's _bwd_rows_per_cta (which reads the SM count)."""
    from aot import csa

    lo, hi = csa.bucket_range("bwd_r128", key["bucket"])
    hi = min(hi, 1 << 16)
    for sms in (78, 132, 148):
        r._SM_COUNT_CACHE["aot-check"] = sms  # upstream caches the device's SM count under its index
        try:
            for nb in sorted({lo, hi, (lo + hi) // 2, lo + 7}):
                theirs = r._bwd_rows_per_cta(nb, key["ratio"], key["d"], key["coff"], "aot-check")
                mine = csa._rows_r128(nb, key["d"], key["coff"], sched, sms)
                if mine != theirs:
                    raise ValueError(f"rows_per_cta for nb_total={nb}, sm_count={sms}, {key}: aot.csa gives {mine}, cudnn {theirs}")
        finally:
            r._SM_COUNT_CACHE.pop("aot-check", None)
