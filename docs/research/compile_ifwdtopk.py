"""Compile cudnn's compressed indexer forward + top-k (indexer_forward_top_k_wrapper) on the CPU, two ways,
and lift / verify every host function.

usage: CUTE_DSL_ARCH=sm_100a|sm_90a python compile_ifwdtopk.py <tag> [k=v ...]

  route=wrapper (default): api.indexer_forward_top_k_wrapper on CUDA-presenting CPU tensors under
      dsa_aot.toolchain.fidelity.Upstream; records every cute.compile it makes (GEMM, stage 2, l2g).
      Which kernels really compile is chosen with up=gemm,s2,l2g (the others answer "cached" with a
      no-op stub, so the host control flow still runs to the end and every key is still seen).
  route=s2: compress_top_k_sm100.compress_stage2_topk alone (its gate is SM90+), for sm_90a.
  route=l2g: local_to_global_dsl._local_to_global_inplace alone.
  spec=gemm,s2,l2g: also build those kernels spec-style (make_fake_tensor with sym ints) and compare.

Writes <tag>.json and <tag>-<kernel>-{upstream,spec}.{mlir,cubin,launcher.py} beside this file.
"""
import contextlib
import hashlib
import json
import os
import sys
import time
import types

ARCH = os.environ["CUTE_DSL_ARCH"]
sys.path.insert(0, "/work/main")
HERE = os.path.dirname(os.path.abspath(__file__))
tag = sys.argv[1]
cfg = dict(route="wrapper", prec="bf16", H=64, wdt="bfloat16", B=2, Sq=256, Sk=64, ratio=4, topk=2048, scale=1.0, offs=0, lse=0,
           softmax=1, det=0, mb=-1, varlen=0, glob=1, bt=-1, up="gemm,s2,l2g", spec="", verify=1, candbuf=0)
for a in sys.argv[2:]:
    k, v = a.split("=", 1)
    cfg[k] = type(cfg[k])(v) if not isinstance(cfg[k], str) else v
UP = set(filter(None, cfg["up"].split(",")))
SPEC = set(filter(None, cfg["spec"].split(",")))

import torch  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from dsa_aot.toolchain import lift  # noqa: E402
from dsa_aot.toolchain.compile import _embedded_cubin  # noqa: E402
from dsa_aot.toolchain.fidelity import Upstream  # noqa: E402

res = {"arch": ARCH, "cfg": cfg, "kernels": {}}


def dump(kname, name, fn):
    host = fn.ir_module.operation.get_asm(print_generic_op_form=True)
    cub = bytes(_embedded_cubin(host))
    base = f"{HERE}/{tag}-{kname}-{name}"
    open(f"{base}.mlir", "w").write(host)
    open(f"{base}.cubin", "wb").write(cub)
    r = {"function_name": fn.function_name, "symbols": list(fn.kernel_info.keys()), "cubin_sha": hashlib.sha256(cub).hexdigest(),
         "cubin_bytes": len(cub), "host_chars": len(host)}
    try:
        src = lift.lift(host, fn.function_name, f"{tag}-{kname}-{name}", lift.cubin_param_layout(cub))
        open(f"{base}.launcher.py", "w").write(src)
        r["lift"] = "ok"
        if cfg["verify"]:
            try:
                from dsa_aot.toolchain import verify
                rep = verify.verify(host, fn.function_name, src, cub, samples=20)
                r["verify"] = {k: v for k, v in rep.items() if k in ("verdict", "samples", "launches")} or str(rep)[:300]
            except Exception as e:  # noqa: BLE001
                r["verify"] = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        r["lift"] = f"{type(e).__name__}: {e}"
    return r


qdt = {"bf16": torch.bfloat16, "mxfp8": torch.float8_e4m3fn, "mxfp4": torch.float4_e2m1fn_x2}[cfg["prec"]]
wdt = getattr(torch, cfg["wdt"])
B, Sq, Sk, H, D, r = cfg["B"], cfg["Sq"], cfg["Sk"], cfg["H"], 128, cfg["ratio"]
seen = []  # every cute.compile call: (kernel class, args, kwargs, ctor state)
keys = {"gemm": [], "s2": [], "l2g": []}  # every key each cache was asked for, in order
compiled = {}  # kernel name -> (key, _Compiled) for the first key really compiled

# ---------------- upstream route ----------------
with Upstream(ARCH, {"sm_90a": 132, "sm_100a": 148}[ARCH]) as up:
    from cudnn.deepseek_sparse_attention.indexer_forward import api, _interface, _compressed_top_k_sm100 as ctk
    from cudnn.deepseek_sparse_attention.indexer_top_k import compress_top_k_sm100 as s2m, local_to_global_dsl as l2gm
    from cudnn.deepseek_sparse_attention.utils import compiler, runtime

    up.clear_lru(compiler.gpu_arch_flag, runtime._device_capability)
    up.patch(_interface, "_torch_stream_context", lambda *a, **k: contextlib.nullcontext())
    # resolve_stream(None) reads torch's current stream: answer the null stream
    up.patch(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    like = type(up.tensor(torch.int32, 1))
    real = {n: getattr(torch, n) for n in ("empty", "full", "arange", "zeros")}
    allocs = []

    def T(dtype, *shape):
        return like(real["empty"](*shape, dtype=dtype))

    real_item = torch.Tensor.item

    def item(self):
        v = real_item(self)
        allocs.append(("item", tuple(self.shape), v))
        return v

    up.patch(like, "item", item)

    def mk(name):
        def f(*a, device=None, **k):
            t = like(real[name](*a, **k))
            allocs.append((name, tuple(t.shape), str(t.dtype)))
            return t
        return f

    for n in real:
        up.patch(torch, n, mk(n))
    real_compile = cute.compile

    def spy(fn, *args, **kw):
        seen.append((type(fn).__name__, [repr(a)[:240] for a in args], {k: repr(v) for k, v in kw.items()},
                     {k: repr(v)[:80] for k, v in vars(fn).items()} if hasattr(fn, "__dict__") else None))
        return real_compile(fn, *args, **kw)

    cute.compile = spy  # under Upstream's own wrapper (restored on exit: Upstream saved the original)

    def keeper(kname):
        def keep(key):
            if key not in keys[kname]:
                keys[kname].append(key)
            # compile only the first key of a kernel that is under study
            return kname in UP and key == keys[kname][0]
        return keep

    caches = {"gemm": up.cache(ctk, "_compile_cache", keeper("gemm")), "s2": up.cache(s2m, "_compile_cache", keeper("s2")),
              "l2g": up.cache(l2gm, "_compile_cache", keeper("l2g"))}
    t0 = time.time()
    i32 = torch.int32
    if cfg["route"] == "wrapper":
        kw = {}
        if cfg["varlen"]:
            cu_q, cu_k = T(i32, B + 1), T(i32, B + 1)
            cu_q.copy_(real["arange"](B + 1, dtype=i32) * Sq)
            cu_k.copy_(real["arange"](B + 1, dtype=i32) * Sk)
            q, k, w = T(qdt, B * Sq, H, D), T(qdt, B * Sk, 1, D), T(wdt, B * Sq, H)
            kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=Sq, max_seqlen_k=Sk)
        else:
            Ds = D // 2 if cfg["prec"] == "mxfp4" else D
            q, k, w = T(qdt, B, Sq, H, Ds), T(qdt, B, Sk, 1, Ds), T(wdt, B, Sq, H)
        if cfg["prec"] != "bf16":
            e8 = torch.float8_e8m0fnu
            if cfg["varlen"]:
                kw.update(q_scale=T(e8, 1, 128 * B * -(-Sq * H // 128), 4), k_scale=T(e8, 1, 128 * B * -(-Sk // 128), 4),
                          cu_seqlens_q_scale_padded=T(i32, B + 1), cu_seqlens_k_scale_padded=T(i32, B + 1))
            else:
                kw.update(q_scale=T(e8, B, -(-Sq * H // 128) * 128, 4), k_scale=T(e8, B, -(-Sk // 128) * 128, 4))
        if cfg["offs"]:
            o = T(i32, B)
            o.copy_(real["arange"](B, dtype=i32) * r)  # offsets 0, r, 2r, ...
            kw["q_causal_offsets"] = o
        if cfg["lse"]:
            kw["return_lse"] = True
        if cfg["candbuf"]:
            kw["cand_buffer"] = T(torch.float32, cfg["candbuf"])
        outd = api.indexer_forward_top_k_wrapper(q, k, w, cfg["topk"], ratio=r, sm_scale=cfg["scale"], stream=up.stream, precision=cfg["prec"],
                                                 microbatch_rows=cfg["mb"], return_softmax=bool(cfg["softmax"]), topk_indices_global=bool(cfg["glob"]),
                                                 deterministic=bool(cfg["det"]), **kw)
        res["outputs"] = {kk: (tuple(v.shape), tuple(v.stride()), str(v.dtype)) for kk, v in outd.items()}
    elif cfg["route"] == "s2":
        bt = cfg["bt"] if cfg["bt"] > 0 else 512
        pbf = s2m.per_batch_floats(Sq, Sk, r)
        s2m.compress_stage2_topk(T(torch.float32, B * pbf), B, Sq, Sk, cfg["topk"], r, block_threads=bt, stream=up.stream,
                                 return_softmax=bool(cfg["softmax"]), deterministic=bool(cfg["det"]))
    elif cfg["route"] == "l2g":
        l2gm._local_to_global_inplace(T(i32, B, Sq, cfg["topk"]), Sk, stream=up.stream)
    res["upstream_seconds"] = round(time.time() - t0, 2)
    res["allocs"] = allocs
    res["keys"] = {kk: [repr(x) for x in v] for kk, v in keys.items()}
    res["calls"] = {}
    for kname, cache in caches.items():
        res["calls"][kname] = None
        for key in list(dict.keys(cache)):
            rec = dict.__getitem__(cache, key)
            compiled[kname] = (key, rec)
            res["calls"][kname] = rec.calls
    res["compile_calls"] = [{"cls": s[0], "args": s[1], "kwargs": s[2], "ctor": s[3]} for s in seen]
    for kname, (key, rec) in compiled.items():
        res["kernels"][kname] = {"key": repr(key), "options": rec.options, "upstream": dump(kname, "upstream", rec.fn)}

# ---------------- spec-like builds ----------------
import cuda.bindings.driver as cuda_driver  # noqa: E402
from cutlass.cute.runtime import make_fake_tensor  # noqa: E402


def TT(dtype, rank, align=16):
    shape = tuple(cute.sym_int() for _ in range(rank))
    stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(dtype, shape, stride, memspace=cute.AddressSpace.gmem, assumed_align=align)


stream = cuda_driver.CUstream(0)
I32, I64, F32 = cutlass.Int32, cutlass.Int64, cutlass.Float32


def ctor_of(cls):
    for s in seen:
        if s[0] == cls:
            return s[3]
    raise KeyError(cls)


def spec_gemm():
    from cudnn.deepseek_sparse_attention.score_recompute.indexer_score_unified_sm100 import IndexerScoreUnifiedSm100
    from cudnn.deepseek_sparse_attention.score_recompute._block_scaled import BLOCK_SCALED_FORMATS
    from cudnn.deepseek_sparse_attention.indexer_forward._support import resolve_m_block_size
    vl, lse, offs = bool(cfg["varlen"]), bool(cfg["lse"]), bool(cfg["offs"])
    c2d = (not vl) and cfg["prec"] == "bf16" and not offs and not (0 < cfg["mb"] or (cfg["mb"] < 0 and Sq >= 32768 and Sq % r == 0 and not lse))
    qr, wr = (3, 2) if vl else (4, 3)
    wc = {torch.bfloat16: cutlass.BFloat16, torch.float32: F32}[wdt]
    cand = ctk._make_i64_cand_buffer_compile_tensor() if vl else TT(F32, 2 if c2d else 1)
    denom = TT(F32, 1 if vl else 2) if lse else None
    qco = TT(I32, 1) if offs else None
    cbo = TT(I64, 1) if (vl or offs) else None
    cu = (TT(I32, 1), TT(I32, 1)) if vl else (None, None)
    if cfg["prec"] == "bf16":
        m = resolve_m_block_size(128, H, D, compressed=True, path="x")
        obj = IndexerScoreUnifiedSm100(head_dim=D, qhead_per_kvhead=H, m_block_size=m, n_block_size=128, k_block_size=64, kv_stage=4, ratio=r,
                                       is_varlen=vl, compute_lse=lse, is_compressed_logits=True, **({} if vl else {"cand_2d": c2d}))
        args = (TT(cutlass.BFloat16, qr), TT(cutlass.BFloat16, qr), TT(wc, wr), cand, denom, F32(1.0), I32(1), I32(1), *cu, qco, stream, cbo)
    else:
        qk = cutlass.Float8E4M3FN if cfg["prec"] == "mxfp8" else cutlass.Uint8
        obj = BLOCK_SCALED_FORMATS[cfg["prec"]].kernel_cls(head_dim=D, qhead_per_kvhead=H, m_block_size=128, n_block_size=128, k_block_size=64,
                                                           kv_stage=24, ratio=r, is_varlen=vl, sf_vec_size=32, compute_lse=lse, is_compressed_logits=True)
        cus = (TT(I32, 1), TT(I32, 1)) if vl else (None, None)
        e8 = cutlass.Float8E8M0FNU
        args = (TT(qk, qr), TT(qk, qr), TT(wc, wr), TT(e8, 3), TT(e8, 3), cand, denom, F32(1.0), I32(1), I32(1), *cu, *cus, qco, stream, cbo)
    res["spec_ctor_gemm"] = {k: repr(v)[:80] for k, v in vars(obj).items()}
    return obj, args, None


def spec_s2():
    st = ctor_of("CompressTopkStage2")
    vl = st["is_varlen"] == "True"
    obj = s2m.CompressTopkStage2(topk=int(st["topk"]), ratio=int(st["ratio"]), block_threads=int(st["block_threads"]), is_varlen=vl,
                                 deterministic=st["deterministic"] == "True")
    offs = bool(cfg["offs"]) or (cfg["route"] == "wrapper" and cfg["mb"] != 0 and Sq >= 32768 and not cfg["varlen"])
    sm = TT(F32, 3, 4) if cfg["softmax"] else None
    if vl:
        args = (s2m._make_i64_cand_buffer_compile_tensor(), TT(I32, 3, 4), TT(F32, 3, 4), I32(1), I32(1), stream, TT(I32, 1), TT(I32, 1),
                TT(I64, 1), TT(I32, 1) if cfg["offs"] else None, sm)
    else:
        args = (TT(F32, 1), TT(I32, 3, 4), TT(F32, 3, 4), I32(1), I32(1), stream, None, None, TT(I64, 1) if offs else None,
                TT(I32, 1) if offs else None, sm)
    return obj, args, "--opt-level 3"


def spec_l2g():
    vl = bool(cfg["varlen"])
    obj = l2gm.LocalToGlobalTopK(is_varlen=vl, preserve_negative=True)
    cu = (TT(I32, 1), TT(I32, 1)) if vl else (None, None)
    return obj, (TT(I32, 2 if vl else 3), TT(I32, 2 if vl else 3), I32(1), *cu, stream), "--opt-level 3"


for kname in ("gemm", "s2", "l2g"):
    if kname not in SPEC:
        continue
    obj, args, opts = {"gemm": spec_gemm, "s2": spec_s2, "l2g": spec_l2g}[kname]()
    t0 = time.time()
    fn = cute.compile(obj, *args, options=opts) if opts else cute.compile(obj, *args)
    d = res["kernels"].setdefault(kname, {})
    d["spec_seconds"] = round(time.time() - t0, 2)
    d["spec_options"] = opts
    d["spec"] = dump(kname, "spec", fn)
    if "upstream" in d:
        d["same_cubin"] = d["spec"]["cubin_sha"] == d["upstream"]["cubin_sha"]
json.dump(res, open(f"{HERE}/{tag}.json", "w"), indent=1, default=repr)
short = {kn: {"key": v.get("key"), "up": v.get("upstream", {}).get("cubin_sha", "")[:8], "up_bytes": v.get("upstream", {}).get("cubin_bytes"),
              "spec": v.get("spec", {}).get("cubin_sha", "")[:8], "same": v.get("same_cubin"),
              "lift": (v.get("upstream") or v.get("spec") or {}).get("lift"), "verify": (v.get("upstream") or v.get("spec") or {}).get("verify"),
              "spec_lift": v.get("spec", {}).get("lift"), "spec_verify": v.get("spec", {}).get("verify")} for kn, v in res["kernels"].items()}
print(json.dumps({"tag": tag, "keys": res["keys"], "calls": res.get("calls"), "kernels": short, "allocs": res.get("allocs"),
                  "outputs": res.get("outputs")}, indent=1, default=repr))
