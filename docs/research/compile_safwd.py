"""Compile cudnn's sparse attention forward (SM100) on the CPU, two ways, and lift both host functions.

usage: CUTE_DSL_ARCH=sm_100a python compile_safwd.py <tag> [k=v ...]
  keys: H (64|128) D (512|576) dt (bf16|fp16) K (logical top-k) topk (indexer_topk) sink (0/1) tl (0/1)
        Tq Skv scale (None = upstream default 1/sqrt(D)) ptx (1: keep PTX, compare it) spec (0: skip spec build)
        nolift (1: skip lift/verify) spec_opts (spec's options string) div (0: spec drops the divisibility)
        salign (spec's alignment of indices/max_logits/lse/lse_indexer/sink/topk_length, default 4)
  "upstream" build: cudnn's own sparse_attention_forward_wrapper on CUDA-presenting CPU tensors (aot Upstream helper):
                    exactly the cute.compile call upstream makes (to_cute_tensor(divisibility=...), CUstream(0),
                    "--enable-tvm-ffi --gpu-arch sm_100a --opt-level 2")
  "spec" build:     make_fake_tensor with sym ints (extents i32, strides i64, unit innermost; the last extent and the
                    outer strides of q/kv/out with divisibility = last dim), align 16 (q/kv/out) or 4 (the rest),
                    CUstream(0), options "--opt-level 2"
Writes <tag>-{upstream,spec}.{mlir,cubin,launcher.py} and <tag>.json under this directory.
"""
import contextlib
import hashlib
import json
import math
import os
import sys
import tempfile
import time

ARCH = os.environ["CUTE_DSL_ARCH"]
HERE = os.path.dirname(os.path.abspath(__file__))
tag = sys.argv[1]
cfg = dict(H=64, D=512, dt="bf16", K=2048, topk=2048, sink=0, tl=0, Tq=8, Skv=4096, scale="None", ptx=0, spec=1, nolift=0,
           spec_opts="--opt-level 2", div=1, salign=4)
for a in sys.argv[2:]:
    k, v = a.split("=", 1)
    cfg[k] = type(cfg[k])(v) if not isinstance(cfg[k], str) else v
if cfg["ptx"]:
    os.environ["CUTE_DSL_KEEP"] = "ptx"
    os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="safwd-ptx-")
sys.path.insert(0, "/work/main")

import torch  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from dsa_aot.toolchain import lift  # noqa: E402
from dsa_aot.toolchain.compile import _embedded_cubin  # noqa: E402
from dsa_aot.toolchain.fidelity import Upstream  # noqa: E402

res = {"arch": ARCH, "cfg": cfg}


def dump(name, fn):
    host = fn.ir_module.operation.get_asm(print_generic_op_form=True)
    cub = bytes(_embedded_cubin(host))
    open(f"{HERE}/{tag}-{name}.mlir", "w").write(host)
    open(f"{HERE}/{tag}-{name}.cubin", "wb").write(cub)
    r = {"function_name": fn.function_name, "symbols": list(fn.kernel_info.keys()), "cubin_sha": hashlib.sha256(cub).hexdigest(),
         "cubin_bytes": len(cub), "host_chars": len(host)}
    if cfg["ptx"]:
        p = fn.__ptx__
        if isinstance(p, str):
            r["ptx_sha"] = hashlib.sha256(p.encode()).hexdigest()
    if cfg["nolift"]:
        return r
    try:
        src = lift.lift(host, fn.function_name, f"{tag}-{name}", lift.cubin_param_layout(cub))
        open(f"{HERE}/{tag}-{name}.launcher.py", "w").write(src)
        r["lift"] = "ok"
        try:
            from dsa_aot.toolchain import verify
            rep = verify.verify(host, fn.function_name, src, cub, samples=20)
            r["verify"] = {k: v for k, v in rep.items() if k in ("verdict", "samples", "launches")} or str(rep)[:300]
        except Exception as e:  # noqa: BLE001
            r["verify"] = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        r["lift"] = f"{type(e).__name__}: {e}"
    return r


tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg["dt"]]
H, D, K, Tq, Skv, itopk = cfg["H"], cfg["D"], cfg["K"], cfg["Tq"], cfg["Skv"], cfg["topk"]
scale = None if cfg["scale"] == "None" else float(cfg["scale"])

# ---------------- upstream route ----------------
with Upstream(ARCH, 148) as up:
    from cudnn.deepseek_sparse_attention.sparse_attention_forward import _interface_sm100 as iface
    from cudnn.deepseek_sparse_attention.sparse_attention_forward import api

    up.clear_lru(iface._validated_device_capability)
    # no device: torch's current stream is a handle-0 stand-in; record_stream is a no-op
    import types
    up.patch(torch.cuda, "current_stream", lambda *a, **k: types.SimpleNamespace(cuda_stream=0))
    up.no_op(iface, "_record_stream")
    T = up.tensor
    like = type(T(torch.int32, 1))
    real_empty, real_full = torch.empty, torch.full
    up.patch(torch, "empty", lambda *shape, dtype=None, device=None, **k: like(real_empty(*shape, dtype=dtype)))
    up.patch(torch, "full", lambda size, fill, dtype=None, device=None, **k: like(real_full(size, fill, dtype=dtype)))
    seen = []
    real_compile = cute.compile

    def spy(fn, *args, **kw):
        seen.append((type(fn).__name__, [repr(a)[:300] for a in args], {k: repr(v) for k, v in kw.items()},
                     {k: repr(v)[:80] for k, v in vars(fn).items()} if hasattr(fn, "__dict__") else None))
        return real_compile(fn, *args, **kw)

    up.patch(cute, "compile", spy)
    cache = up.cache(iface, "_compile_cache")
    q, kv, idx = T(tdt, Tq, H, D), T(tdt, Skv, D), T(torch.int32, Tq, K)
    kw = {}
    if cfg["sink"]:
        kw["attn_sink"] = T(torch.float32, H)
    if cfg["tl"]:
        kw["topk_length"] = T(torch.int32, Tq)
    t0 = time.time()
    outd = api.sparse_attention_forward_wrapper(q, kv, idx, softmax_scale=scale, indexer_topk=itopk, **kw)
    res["upstream_seconds"] = round(time.time() - t0, 2)
    res["outputs"] = {k: (tuple(v.shape), tuple(v.stride()), str(v.dtype)) if v is not None else None for k, v in outd.items()}
    keys = list(cache)
    res["upstream_key"] = repr(keys)
    rec = cache[keys[0]]
    res["upstream_options"] = rec.options
    res["upstream_calls"] = rec.calls
    res["upstream_compile_seconds"] = round(rec.seconds, 2)
    res["kernel_class"] = seen[0][0]
    res["compile_args"] = seen[0][1]
    res["compile_kwargs"] = seen[0][2]
    res["ctor_state"] = seen[0][3]
    res["upstream"] = dump("upstream", rec.fn)

if cfg["spec"]:
    # ---------------- spec-like build ----------------
    import cuda.bindings.driver as cuda_driver  # noqa: E402
    from cutlass.cute.runtime import make_fake_tensor  # noqa: E402

    def TT(dtype, rank, div=1, align=16):
        div = div if cfg["div"] else 1
        align = align if align == 16 else cfg["salign"]
        shape = [cute.sym_int() for _ in range(rank)]
        if div != 1:
            shape[-1] = cute.sym_int(divisibility=div)
        stride = tuple(cute.sym_int64(divisibility=div) for _ in range(rank - 1)) + (1,)
        return make_fake_tensor(dtype, tuple(shape), stride, memspace=cute.AddressSpace.gmem, assumed_align=align)

    cdt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[cfg["dt"]]
    f32, i32 = cutlass.Float32, cutlass.Int32
    if H == 64:
        from cudnn.deepseek_sparse_attention.sparse_attention_forward.dsa_fwd_sm100_head64 import SparseAttentionForwardSm100Head64
        obj = SparseAttentionForwardSm100Head64(head_dim=D, indexer_topk=itopk)
    else:
        from cudnn.deepseek_sparse_attention.sparse_attention_forward.dsa_fwd_sm100_head128_small_topk import \
            SparseAttentionForwardSm100Head128SmallTopKPrefill
        obj = SparseAttentionForwardSm100Head128SmallTopKPrefill(d_qk=D, indexer_topk=itopk)
    args = (TT(cdt, 3, D), TT(cdt, 2, D), TT(i32, 2, align=4), TT(cdt, 3, 512), TT(f32, 2, align=4), TT(f32, 2, align=4),
            TT(f32, 2, align=4) if itopk else None, TT(f32, 1, align=4) if cfg["sink"] else None,
            TT(i32, 1, align=4) if cfg["tl"] else None, f32(1.0), cuda_driver.CUstream(0))
    t0 = time.time()
    fn = cute.compile(obj, *args, options=cfg["spec_opts"]) if cfg["spec_opts"] else cute.compile(obj, *args)
    res["spec_seconds"] = round(time.time() - t0, 2)
    res["spec"] = dump("spec", fn)
    res["same_cubin"] = res["spec"]["cubin_sha"] == res["upstream"]["cubin_sha"]
    if cfg["ptx"]:
        res["same_ptx"] = res["spec"].get("ptx_sha") == res["upstream"].get("ptx_sha")
json.dump(res, open(f"{HERE}/{tag}.json", "w"), indent=1)
print(json.dumps(res, indent=1))
