"""Spec of the CSA compressor family (cudnn.csa.compressor, nvidia-cudnn-frontend==1.32.0).

The ops and their keys are the policy's (dsa_aot/policy/csa_compressor.py). ``build`` returns cudnn's own
``@cute.jit`` launch function and arguments that mirror the JIT path exactly: raw gmem pointers made
with ``make_ptr`` at the alignments cudnn uses (16 for bf16/fp32, 4 for int32 cu_seqlens),
cutlass.Int32 scalars, a CUstream. Pointer and scalar *values* are not part of the compile; the entry
records the upstream schedule its bucket resolves to. ``check_policy`` proves, on every build, that
upstream picks one schedule per bucket, and that the policy's rows-per-CTA and constants are upstream's.
"""

from dsa_aot.policy import csa_compressor as policy

FAMILY = policy.FAMILY
OPS = policy.OPS
_SCHEDULED = {"fwd_r128": "_fwd_schedule_r128", "bwd_r128": "_bwd_schedule_r128"}


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
        sched = _bucket_schedule(r, op, key)
        args = (*fwd_ptrs, *ints(2), stream, key["ratio"], key["d"], key["coff"], *sched)
        return r._compressor_fwd_r128_launch, args, None, {"schedule": list(sched)}
    if op == "bwd_r128":
        sched = _bucket_schedule(r, op, key)
        args = (*bwd_ptrs, *ints(4), stream, key["ratio"], key["d"], key["coff"], *sched, key["deterministic"])
        return r._compressor_bwd_r128_launch, args, None, {"schedule": list(sched)}
    if op == "fwd":
        args = (*fwd_ptrs, *ints(2), stream, key["ratio"], key["d"], key["coff"], *g._fwd_schedule(key["d"]))
        return g._compressor_fwd_launch, args, None, {}
    if op == "bwd":
        args = (*bwd_ptrs, *ints(3), stream, key["ratio"], key["d"], key["coff"], g._BWD_ROWS, g._BWD_THREADS, key["deterministic"])
        return g._compressor_bwd_launch, args, None, {}
    if op == "dape_reduce":
        args = (f32(), f32(), f32(), *ints(2), stream, key["split"])
        return g._dape_reduce_launch, args, None, {}
    raise KeyError(op)


def _bucket_schedule(r, op, key):
    """The upstream schedule of a ratio-128 bucket: the one upstream picks for every nb_total sampled
    from the bucket's range (its bounds and points inside); a bucket upstream splits is an error,
    since the runtime would then launch a cubin upstream would not."""
    lo, hi = policy.bucket_range(op, key["bucket"])
    samples = sorted({lo, hi, (lo + hi) // 2, lo + 1, max(lo, hi - 1)})
    upstream = getattr(r, _SCHEDULED[op])
    scheds = {nb: upstream(key["ratio"], key["d"], key["coff"], nb) for nb in samples}
    if len(set(scheds.values())) != 1:
        raise ValueError(f"{op} {key}: upstream picks several schedules inside bucket {key['bucket']!r}: {scheds}; "
                         f"the bucket policy in dsa_aot/policy/csa_compressor.py no longer matches cudnn")
    return next(iter(scheds.values()))


def check_policy(targets):
    """The policy against cudnn: one schedule per bucket, rows_per_cta for several SM counts, constants."""
    from cudnn.csa.compressor import compressor_sm100 as g
    from cudnn.csa.compressor import compressor_sm100_r128 as r

    for name, theirs in (("BWD_ROWS", g._BWD_ROWS), ("DAPE_GROUP_PARTIALS", g._DAPE_REDUCTION_GROUP_PARTIALS)):
        if getattr(policy, name) != theirs:
            raise ValueError(f"cudnn's compressor_sm100 has {name} = {theirs}; dsa_aot/policy/csa_compressor.py assumes {getattr(policy, name)}")
    sm_counts = sorted({78, 132, 148, *(t.sm_count for t in targets)})
    for op, fields in ((op, OPS[op].fields) for op in _SCHEDULED):
        for bucket in fields["bucket"].values:
            for d in fields["d"].values:
                for coff in fields["coff"].values:
                    key = {"ratio": 128, "d": d, "coff": coff, "bucket": bucket}
                    sched = _bucket_schedule(r, op, key)
                    if op == "bwd_r128":
                        _check_rows(r, key, sched, sm_counts)


def _check_rows(r, key, sched, sm_counts):
    """policy.rows_r128 (the run-time rows_per_cta) must equal upstream's _bwd_rows_per_cta, which reads the SM count."""
    lo, hi = policy.bucket_range("bwd_r128", key["bucket"])
    hi = min(hi, 1 << 16)
    for sms in sm_counts:
        r._SM_COUNT_CACHE["aot-check"] = sms  # upstream caches the device's SM count under its index
        try:
            for nb in sorted({lo, hi, (lo + hi) // 2, lo + 7}):
                theirs = r._bwd_rows_per_cta(nb, key["ratio"], key["d"], key["coff"], "aot-check")
                mine = policy.rows_r128(nb, key["d"], key["coff"], sched, sms)
                if mine != theirs:
                    raise ValueError(f"rows_per_cta for nb_total={nb}, sm_count={sms}, {key}: dsa_aot/policy/csa_compressor.py gives {mine}, cudnn {theirs}")
        finally:
            r._SM_COUNT_CACHE.pop("aot-check", None)


# --- fidelity: cudnn's own launch functions for each key (dsa_aot/toolchain/fidelity.py runs them) ------

FIDELITY_ROUTES = {
    "fwd_r128": "compressor_sm100_r128.run_fwd_r128 -> _compile_fwd_r128",
    "bwd_r128": "compressor_sm100_r128.run_bwd_r128 -> _compile_bwd_r128",
    "fwd": "compressor_sm100.run_fwd -> _compile_fwd",
    "bwd": "compressor_sm100.run_bwd -> _compile_bwd",
    "dape_reduce": "compressor_sm100.run_bwd(deterministic=True) -> _run_dape_reduce -> _compile_dape_reduce",
}
PRELOAD = ("cudnn.csa.compressor.compressor_sm100", "cudnn.csa.compressor.compressor_sm100_r128")


def fidelity(op, key, target, up):
    """Run cudnn's run_fwd / run_bwd (the functions its wrappers call) for (op, key) on ``up``; return
    (the compile cache upstream filled, the key it must hold, calls). The reduction of a deterministic
    backward compiles into the same cache as some main kernels: only the entry's own kernel is recorded."""
    import types

    import torch
    from cudnn.csa.compressor import compressor_sm100 as g
    from cudnn.csa.compressor import compressor_sm100_r128 as r

    never = types.SimpleNamespace(get=lambda key: None, put=lambda *a: None)  # their fast-launch caches: always a miss
    up.patch(g, "_FAST", never)
    up.patch(r, "_FAST", never)
    up.patch(r, "_SM_COUNT_CACHE", {})  # read again from the (answered) device properties
    kind = {"fwd_r128": "r128fwd", "bwd_r128": "r128bwd", "fwd": "fwd", "bwd": "bwd", "dape_reduce": "dape_reduce"}[op]
    cache = up.cache(r if op.endswith("_r128") else g, "_COMPILED", keep=lambda k: k[0] == kind)
    if not op.endswith("_r128"):
        up.cache(r, "_COMPILED", keep=lambda k: False)
    else:
        up.cache(g, "_COMPILED", keep=lambda k: False)  # the dAPE reduction of a deterministic r128 backward
    if op == "dape_reduce":  # reached through a deterministic backward: ratio 4 splits the reduction, ratio 2 does not
        ratio, d, coff, nb, det = (4 if key["split"] else 2), 128, 1, 64, True
    else:
        ratio, d, coff, det = key["ratio"], key["d"], key["coff"], key.get("deterministic", False)
        nb = policy.bucket_range(op, key["bucket"])[0] if "bucket" in key else 64
    T, bf16, f32, i32 = up.tensor, torch.bfloat16, torch.float32, torch.int32
    tokens, width = ratio * nb, coff * d
    kv, score, ape, cu, cuc = T(bf16, tokens, width), T(bf16, tokens, width), T(f32, ratio, width), T(i32, 2), T(i32, 2)
    if op in ("fwd_r128", "fwd"):
        run = r.run_fwd_r128 if op == "fwd_r128" else g.run_fwd
        run(kv, score, ape, cu, cuc, T(bf16, nb, d), nb, ratio, d, coff, stream_handle=0)
        want = ("r128fwd", ratio, d, coff, r._fwd_schedule_r128(ratio, d, coff, nb), 0) if op == "fwd_r128" else ("fwd", ratio, d, coff, 0)
        return cache, want, 1
    if op == "bwd_r128":
        ws = T(torch.uint8, r.bwd_dape_workspace_bytes_r128(nb, ratio, d, coff, 0)) if det else None
        run, want = r.run_bwd_r128, ("r128bwd", ratio, d, coff, r._bwd_schedule_r128(ratio, d, coff, nb), det, 0)
    else:
        ws = T(torch.uint8, g.bwd_dape_workspace_bytes(nb, ratio, d, coff)) if det else None
        run = g.run_bwd
        want = ("bwd", ratio, d, coff, det, 0) if op == "bwd" else ("dape_reduce", ratio == 4, 0)
    run(kv, score, ape, cu, cuc, T(bf16, nb, d), T(bf16, tokens, width), T(bf16, tokens, width), T(f32, ratio, width), nb, ratio, d, coff,
        stream_handle=0, deterministic=det, workspace=ws)
    return cache, want, 1
