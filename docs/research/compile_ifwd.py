"""Compile the dense indexer forward on the CPU, two ways, and lift both host functions.

usage: CUTE_DSL_ARCH=sm_90a|sm_100a python compile_ifwd.py <tag> [k=v ...]
  "upstream" build: cudnn's own indexer_forward_wrapper on CUDA-presenting CPU tensors (aot Upstream helper),
                    exactly the cute.compile call upstream makes (to_cute_tensor, CUstream, --enable-tvm-ffi)
  "spec" build:     make_fake_tensor with sym ints (extents i32, strides i64, unit innermost), align 16,
                    CUstream(0), options None (the way kernels/dsa_indexer_backward.py does it)
Writes <tag>-{upstream,spec}.{mlir,cubin,launcher.py} and <tag>.json under this directory.
"""
import contextlib
import hashlib
import json
import os
import sys
import time

ARCH = os.environ["CUTE_DSL_ARCH"]
sys.path.insert(0, "/work/main")
HERE = os.path.dirname(os.path.abspath(__file__))
tag = sys.argv[1]
cfg = dict(H=64, prec="bf16", wdt="bfloat16", B=2, Sq=256, Sk=64, ratio=4, varlen=0, offs=0, lse=0, scale=1.0, m=128)
for a in sys.argv[2:]:
    k, v = a.split("=")
    cfg[k] = type(cfg[k])(v) if not isinstance(cfg[k], str) else v

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


qdt = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "mxfp8": torch.float8_e4m3fn, "mxfp4": torch.float4_e2m1fn_x2}[cfg["prec"]]
wdt = getattr(torch, cfg["wdt"])
B, Sq, Sk, H, D = cfg["B"], cfg["Sq"], cfg["Sk"], cfg["H"], 128

# ---------------- upstream route ----------------
with Upstream(ARCH, {"sm_90a": 132, "sm_100a": 148, "sm_103a": 148}[ARCH]) as up:
    from cudnn.deepseek_sparse_attention.indexer_forward import api, _interface, _interface_sm90
    from cudnn.deepseek_sparse_attention.utils import compiler, runtime

    up.clear_lru(compiler.gpu_arch_flag, runtime._device_capability)
    for mod in (_interface, _interface_sm90):
        up.patch(mod, "_torch_stream_context", lambda *a, **k: contextlib.nullcontext())
    T = up.tensor
    real_empty, like = torch.empty, type(T(torch.int32, 1))
    up.patch(torch, "empty", lambda *shape, dtype=None, device=None, **k: like(real_empty(*shape, dtype=dtype)))
    seen = []
    real_compile = cute.compile

    def spy(fn, *args, **kw):
        seen.append((type(fn).__name__, [repr(a)[:200] for a in args], {k: repr(v) for k, v in kw.items()}, dict(vars(fn)) if hasattr(fn, "__dict__") else None))
        return real_compile(fn, *args, **kw)

    up.patch(cute, "compile", spy)
    cache = up.cache(_interface_sm90 if ARCH == "sm_90a" else _interface, "_compile_cache")
    kw = {}
    if cfg["varlen"]:
        cu_q, cu_k = T(torch.int32, B + 1), T(torch.int32, B + 1)
        q, k, w = T(qdt, B * Sq, H, D), T(qdt, B * Sk, 1, D), T(wdt, B * Sq, H)
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=Sq, max_seqlen_k=Sk)
    else:
        Ds = D // 2 if cfg["prec"] == "mxfp4" else D
        q, k, w = T(qdt, B, Sq, H, Ds), T(qdt, B, Sk, 1, Ds), T(wdt, B, Sq, H)
    if cfg["prec"] in ("mxfp8", "mxfp4"):
        e8 = torch.float8_e8m0fnu
        kw.update(precision=cfg["prec"], q_scale=T(e8, B, -(-Sq * H // 128) * 128, 4), k_scale=T(e8, B, -(-Sk // 128) * 128, 4))
    if cfg["offs"]:
        kw["q_causal_offsets"] = T(torch.int32, B)
    if cfg["prec"] == "fp8":
        kw.update(precision="fp8", q_scale=T(torch.float32, *q.shape[:-1]), k_scale=T(torch.float32, *k.shape[:-1]))
    if cfg["lse"]:
        kw["return_lse"] = True
    t0 = time.time()
    outd = api.indexer_forward_wrapper(q, k, w, ratio=cfg["ratio"], sm_scale=cfg["scale"], stream=up.stream, **kw)
    res["upstream_seconds"] = round(time.time() - t0, 2)
    res["outputs"] = {k: (tuple(v.shape), tuple(v.stride()), str(v.dtype)) for k, v in outd.items()}
    keys = list(cache)
    res["upstream_key"] = repr(keys)
    rec = cache[keys[0]]
    res["upstream_options"] = rec.options
    res["upstream_calls"] = rec.calls
    res["compile_args"] = seen[0][1]
    res["compile_kwargs"] = seen[0][2]
    res["ctor_state"] = {k: repr(v)[:80] for k, v in (seen[0][3] or {}).items()}
    res["upstream"] = dump("upstream", rec.fn)

# ---------------- spec-like build ----------------
import cuda.bindings.driver as cuda_driver  # noqa: E402
from cutlass.cute.runtime import make_fake_tensor  # noqa: E402


def TT(dtype, rank):
    shape = tuple(cute.sym_int() for _ in range(rank))
    stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(dtype, shape, stride, memspace=cute.AddressSpace.gmem, assumed_align=16)


cdt = {torch.bfloat16: cutlass.BFloat16, torch.float8_e4m3fn: cutlass.Float8E4M3FN, torch.float4_e2m1fn_x2: cutlass.Uint8}[qdt]
cw = {torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32}[wdt]
vl = bool(cfg["varlen"])
qr, wr, orr = (3, 2, 2) if vl else (4, 3, 3)
stream = cuda_driver.CUstream(0)
cu = (TT(cutlass.Int32, 1), TT(cutlass.Int32, 1)) if vl else (None, None)
offs = TT(cutlass.Int32, 1) if cfg["offs"] else None
if ARCH == "sm_90a":
    from cudnn.deepseek_sparse_attention.indexer_forward.indexer_fwd_sm90 import IndexerForwardSm90

    fp8 = qdt == torch.float8_e4m3fn
    st = res["ctor_state"]
    unc, msk = st.get("use_unchecked_qh64_full") == "True", st.get("use_unchecked_qh64_masked") == "True"
    obj = IndexerForwardSm90(cdt, cw, head_dim=D, qhead_per_kvhead=H, ratio=cfg["ratio"], is_varlen=vl, use_unchecked_qh64=unc,
                             use_unchecked_qh64_masked=msk, compute_lse=bool(cfg["lse"]))
    qs = TT(cutlass.Float32, wr) if fp8 else None
    ks = TT(cutlass.Float32, wr) if fp8 else None
    lse = TT(cutlass.Float32, orr - 1) if cfg["lse"] else None
    args = (TT(cdt, qr), TT(cdt, qr), TT(cw, wr), qs, ks, TT(cutlass.Float32, orr), lse, cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1),
            cutlass.Float32(1.0), *cu, offs, stream)
elif cfg["prec"] in ("mxfp8", "mxfp4"):
    from cudnn.deepseek_sparse_attention.score_recompute._block_scaled import BLOCK_SCALED_FORMATS
    obj = BLOCK_SCALED_FORMATS[cfg["prec"]].kernel_cls(head_dim=D, qhead_per_kvhead=H, m_block_size=128, n_block_size=128, k_block_size=64,
                                                       kv_stage=24, ratio=cfg["ratio"], is_varlen=vl, sf_vec_size=32, compute_lse=False,
                                                       is_compressed_logits=False)
    cus = (TT(cutlass.Int32, 1), TT(cutlass.Int32, 1)) if vl else (None, None)
    args = (TT(cdt, qr), TT(cdt, qr), TT(cw, wr), TT(cutlass.Float8E8M0FNU, 3), TT(cutlass.Float8E8M0FNU, 3), TT(cutlass.Float32, orr), None,
            cutlass.Float32(1.0), cutlass.Int32(1), cutlass.Int32(1), *cu, *cus, offs, stream)
else:
    from cudnn.deepseek_sparse_attention.score_recompute.indexer_score_unified_sm100 import IndexerScoreUnifiedSm100

    from cudnn.deepseek_sparse_attention.indexer_forward._support import resolve_m_block_size
    m = resolve_m_block_size(128, H, D, compressed=False, path="x")
    obj = IndexerScoreUnifiedSm100(head_dim=D, qhead_per_kvhead=H, m_block_size=m, n_block_size=128, k_block_size=64, kv_stage=4,
                                   ratio=cfg["ratio"], is_varlen=vl, compute_lse=False, is_compressed_logits=False)
    args = (TT(cdt, qr), TT(cdt, qr), TT(cw, wr), TT(cutlass.Float32, orr), None, cutlass.Float32(1.0), cutlass.Int32(1), cutlass.Int32(1),
            *cu, offs, stream)
t0 = time.time()
fn = cute.compile(obj, *args)
res["spec_seconds"] = round(time.time() - t0, 2)
res["spec"] = dump("spec", fn)
res["same_cubin"] = res["spec"]["cubin_sha"] == res["upstream"]["cubin_sha"]
json.dump(res, open(f"{HERE}/{tag}.json", "w"), indent=1)
print(json.dumps(res, indent=1))
