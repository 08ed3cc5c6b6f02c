"""Score recompute (cudnn 1.32.0 DSA score_recompute) compiled on the CPU two ways, per configuration.

usage: CUTE_DSL_ARCH=sm_90a|sm_100a PYTHONHASHSEED=0 CUTE_DSL_DISABLE_FILE_CACHING=1 \
           python compile_srec.py <out.jsonl> <configs.json | inline JSON list> [--save DIR] [--lift]

Each configuration is a dict: op (sidx | sattn | didx | dattn) and any of
  B, Sq, Sk, H, Hkv (dense only), D, topk, scale, ratio, varlen, offs, len (topk_length given), glob
  (topk_indices_global), prec (bf16 | mxfp8 | mxfp4; SM100 dense only), maxgiven (THD: pass max_seqlen_*),
  cu (THD: explicit cu_seqlens values [[cu_q], [cu_k]], else equal segments), dt (dense Q/K/W dtype, default bfloat16),
  offs_align (spec-side alignment of the SM90 offsets, default 4), up (run upstream, default 1), spec (default 1), tag.

"upstream": cudnn's public *_wrapper, on CPU tensors presenting as CUDA (dsa_aot.toolchain.fidelity.Upstream: device
            queries answer for the arch, cute.compile wrapped, compiled calls launch nothing); the interface's
            compile caches are swapped for recording ones, so every cute.compile upstream makes is seen: its
            kernel class, constructor state, argument reprs (the layouts to_cute_tensor produced), options, key.
"spec":     the same kernel class constructed from this script's own mirror of upstream's tile policy, compiled
            on make_fake_tensor arguments (sym_int extents, sym_int64 strides, unit innermost stride, 16-byte
            alignment unless upstream says otherwise), CUstream(0), options = only what upstream adds beyond
            "--enable-tvm-ffi --gpu-arch <arch>" (the build's convention; the arch comes from CUTE_DSL_ARCH).
One JSON line per configuration: upstream keys/options/calls/cubin sha256 per compile, spec cubin sha256, same.
--save DIR keeps <tag>-{upstream,spec}.{cubin,mlir}; --lift also lifts+verifies the spec host function.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
import traceback

ARCH = os.environ["CUTE_DSL_ARCH"]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root

import torch  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cuda.bindings.driver as cuda_driver  # noqa: E402
from cutlass.cute.runtime import make_fake_tensor  # noqa: E402

from dsa_aot.toolchain.compile import _embedded_cubin  # noqa: E402
from dsa_aot.toolchain.fidelity import Upstream  # noqa: E402

from cudnn.deepseek_sparse_attention.score_recompute import api  # noqa: E402
from cudnn.deepseek_sparse_attention.score_recompute import _interface_sm100 as I100  # noqa: E402
from cudnn.deepseek_sparse_attention.score_recompute import _interface_sm90 as I90  # noqa: E402
from cudnn.deepseek_sparse_attention.utils import compiler, runtime  # noqa: E402

SM_COUNT = {"sm_90a": 132, "sm_100a": 148, "sm_103a": 148}[ARCH]
DEFAULT = dict(op="sidx", B=2, Sq=64, Sk=256, H=64, Hkv=1, D=128, topk=512, scale=1.0, ratio=1, varlen=0, offs=0, len=0, glob=0,
               prec="bf16", dt="bfloat16", maxgiven=1, cu=None, up=1, spec=1, tag=None)


def simple_vars(obj) -> dict:
    """The constructor state that is plain data (IR-backed objects outlive their MLIR context: never repr them)."""
    ok = (int, float, bool, str, type(None))
    out = {}
    for k, v in vars(obj).items():
        if isinstance(v, ok) or (isinstance(v, tuple) and all(isinstance(x, ok) for x in v)):
            out[k] = v
        elif isinstance(v, type):
            out[k] = v.__name__
    return out


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def cubin_of(fn) -> tuple[bytes, str]:
    host = fn.ir_module.operation.get_asm(print_generic_op_form=True)
    return bytes(_embedded_cubin(host)), host


def smem_of(cub: bytes):
    from dsa_aot.toolchain.cubin import read_cubin

    return [(k.name, k.registers, k.shared_bytes, k.stack_bytes, k.spill_stores) for k in read_cubin(cub).kernels]


# ----------------------------------------------------------------------------------------------------------
# upstream route
# ----------------------------------------------------------------------------------------------------------


def run_upstream(c):
    seen = []
    with Upstream(ARCH, SM_COUNT) as up:
        up.clear_lru(compiler.gpu_arch_flag, runtime._device_capability)
        for mod in (api, I90, I100):
            up.patch(mod, "_torch_stream_context", lambda *a, **k: contextlib.nullcontext())
        T = up.tensor
        like = type(T(torch.int32, 1))
        real_empty = torch.empty
        up.patch(torch, "empty", lambda *shape, dtype=None, device=None, **k: like(real_empty(*shape, dtype=dtype)))
        inner = cute.compile

        def spy(fn, *args, **kw):
            rec = inner(fn, *args, **kw)
            seen.append({"cls": type(fn).__name__, "args": [repr(a)[:160] for a in args], "options": kw.get("options"),
                         "ctor": simple_vars(fn), "rec": rec})
            return rec

        up.patch(cute, "compile", spy)
        caches = {}
        for name, fn in (("sm90_sparse", I90._sparse_score_recompute), ("sm90_dense", I90._dense_score_recompute),
                         ("sm100_sidx", I100._sparse_indexer_score_recompute), ("sm100_sattn", I100._sparse_attn_score_recompute),
                         ("sm100_didx", I100._dense_indexer_score_recompute), ("sm100_dattn", I100._dense_attn_score_recompute)):
            caches[name] = up.cache(fn, "compile_cache")
        for d in (api._cache_of_SparseIndexerScoreRecomputeObjects, api._cache_of_SparseAttnScoreRecomputeObjects,
                  api._cache_of_DenseIndexerScoreRecomputeObjects, api._cache_of_DenseAttnScoreRecomputeObjects):
            d.clear()
        calls = call_upstream(c, up, T)
        out = {"compiles": []}
        for name, cache in caches.items():
            for key, rec in dict.items(cache):
                s = next(x for x in seen if x["rec"] is rec)
                cub, host = cubin_of(rec.fn)
                out["compiles"].append({"cache": name, "key": repr(key), "cls": s["cls"], "options": s["options"], "args": s["args"],
                                        "ctor": s["ctor"], "calls": rec.calls, "seconds": round(rec.seconds, 2), "cubin_sha": sha(cub),
                                        "cubin_bytes": len(cub), "kernels": smem_of(cub), "_cubin": cub, "_host": host})
        out.update(calls)
    return out


def _cu(c, n):
    """cu_seqlens values: equal segments of n, or the config's explicit list."""
    if c["cu"] is not None:
        return c["cu"][0] if n == c["Sq"] else c["cu"][1]
    return [i * n for i in range(c["B"] + 1)]


def call_upstream(c, up, T):
    op, B, Sq, Sk, H, D = c["op"], c["B"], c["Sq"], c["Sk"], c["H"], c["D"]
    bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    info = {}
    if op in ("sidx", "sattn"):
        q, k = T(bf16, B, Sq, H, D), T(bf16, B, Sk, D)
        aux = T(bf16, B, Sq, H) if op == "sidx" else T(f32, B, Sq, H)
        idx, out = T(i32, B, Sq, c["topk"]), T(f32, B, Sq, c["topk"])
        ln = T(i32, B, Sq) if c["len"] else None
        if op == "sidx":
            r = api.sparse_indexer_score_recompute_wrapper(q, k, aux, idx, topk_length=ln, topk_indices_global=bool(c["glob"]), out=out,
                                                           stream=up.stream)
        else:
            r = api.sparse_attn_score_recompute_wrapper(q, k, aux, idx, c["scale"], topk_length=ln, topk_indices_global=bool(c["glob"]),
                                                        out=out, stream=up.stream)
        info["result"] = {kk: (tuple(v.shape), v is out) for kk, v in r.items()}
        return info
    prec = c["prec"]
    qdt = {"bf16": getattr(torch, c["dt"]), "mxfp8": torch.float8_e4m3fn, "mxfp4": torch.float4_e2m1fn_x2}[prec]
    if prec == "bf16":
        bf16 = qdt  # the SM90 THD path reaches the kernel without the class's bf16 check: fp16 Q/K/W get through
    Ds = D // 2 if prec == "mxfp4" else D
    Hkv = c["Hkv"]
    kw = {}
    if c["varlen"]:
        cq, ck = _cu(c, Sq), _cu(c, Sk)
        tq, tk = cq[-1], ck[-1]
        maxq = max(b - a for a, b in zip(cq, cq[1:]))
        maxk = max(b - a for a, b in zip(ck, ck[1:]))
        q, k = T(qdt, tq, H, Ds), T(qdt, tk, Hkv, Ds)
        aux = T(bf16, tq, H) if op == "didx" else T(f32, tq, H)
        cu_q, cu_k = T(i32, B + 1), T(i32, B + 1)
        cu_q.copy_(torch.tensor(cq, dtype=i32))
        cu_k.copy_(torch.tensor(ck, dtype=i32))
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        if c["maxgiven"]:
            kw.update(max_seqlen_q=maxq, max_seqlen_k=maxk)
        out, den = T(f32, tq, maxk), T(f32, tq)
    else:
        q, k = T(qdt, B, Sq, H, Ds), T(qdt, B, Sk, Hkv, Ds)
        aux = T(bf16, B, Sq, H) if op == "didx" else T(f32, B, Sq, H)
        out, den = T(f32, B, Sq, Sk), T(f32, B, Sq)
    if prec != "bf16":
        e8 = torch.float8_e8m0fnu
        sfg = -(-(-(-D // 32)) // 4) * 4
        qhp = H // Hkv
        if c["varlen"]:
            kw.update(q_scale=T(e8, Hkv, -(-tq * qhp // 128) * 128 + 128 * B, sfg), k_scale=T(e8, Hkv, -(-tk // 128) * 128 + 128 * B, sfg),
                      cu_seqlens_q_scale_padded=T(i32, B + 1), cu_seqlens_k_scale_padded=T(i32, B + 1))
        else:
            kw.update(q_scale=T(e8, B * Hkv, -(-Sq * qhp // 128) * 128, sfg), k_scale=T(e8, B * Hkv, -(-Sk // 128) * 128, sfg))
        kw["precision"] = prec
    if c["offs"]:
        kw["q_causal_offsets"] = T(i32, B)
    if op == "didx":
        r = api.dense_indexer_score_recompute_wrapper(q, k, aux, out=out, denom_out=den, sm_scale=c["scale"], ratio=c["ratio"], stream=up.stream, **kw)
    else:
        r = api.dense_attn_score_recompute_wrapper(q, k, aux, c["scale"], out=out, denom_out=den, ratio=c["ratio"], stream=up.stream, **kw)
    info["result"] = {kk: (tuple(v.shape), v is out or v is den) for kk, v in r.items()}
    return info


# ----------------------------------------------------------------------------------------------------------
# spec route: this script's own mirror of upstream's policy + fake tensors
# ----------------------------------------------------------------------------------------------------------


def TT(dtype, rank, align=16):
    shape = tuple(cute.sym_int() for _ in range(rank))
    stride = tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,)
    return make_fake_tensor(dtype, shape, stride, memspace=cute.AddressSpace.gmem, assumed_align=align)


SMEM100 = 227 * 1024


def sm90_tile(qhpkv, attention):
    if attention and qhpkv == 96:
        return 48, 2
    assert qhpkv > 1
    tm = min(qhpkv, 64)
    assert qhpkv % tm == 0
    return tm, qhpkv // tm


def sm100_sparse_stages(D, m, n, k, topk, per_head_bytes):
    hp = -(-D // 16) * 16
    sk = n * (k or hp) * 2
    sq = m * hp * 2
    fixed = m * 2 * per_head_bytes + 2048
    over = topk * 8 + fixed
    kvs = min(4, max(1, (SMEM100 - sq - over) // sk))
    if sq + sk * kvs + over <= SMEM100:
        return kvs, True
    kvs = min(4, max(1, (SMEM100 - sq - fixed) // sk))
    assert sq + sk * kvs + fixed <= SMEM100, "smem overflow"
    return kvs, False


def sm100_sattn_tiles(D, H, topk, compact):
    if D == 576 and H == 96:
        return H, 128, 192
    if compact:
        return {(512, 64): (H, 64, None), (512, 128): (H, 128, 128), (576, 64): (H, 64, None), (576, 128): (H, 64, 192)}.get((D, H), (H, 64, None))
    if D == 512 and H == 64:
        return H, 128, 256
    if D == 512 and H == 128:
        return (H, 128, 128) if topk <= 512 else (H, 128, 256)
    if D == 576 and H in (64, 128):
        return H, 128, 192
    return H, 64, None


def sm100_dense_kblock(hp, m, n, per_head_bytes):
    avail = SMEM100 - m * hp * 2 - (m * 2 * per_head_bytes + 2048)
    mx = max(64, avail // (n * 2)) // 64 * 64
    kb = hp
    while kb > mx:
        for cand in range(kb - 64, 63, -64):
            if hp % cand == 0:
                kb = cand
                break
        else:
            kb = 64
            break
    return kb


def sm100_dense_stage(hp, m, n, kb, per_head_bytes):
    return min(4, max(1, (SMEM100 - m * hp * 2 - (m * 2 * per_head_bytes + 2048)) // (n * kb * 2)))


def build_spec(c):
    """(kernel object, args, options) for the config's one kernel."""
    op, D, H = c["op"], c["D"], c["H"]
    bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    stream = cuda_driver.CUstream(0)
    if ARCH == "sm_90a":
        from cudnn.deepseek_sparse_attention.score_recompute.sparse_score_recompute_sm90 import SparseScoreRecomputeSm90
        from cudnn.deepseek_sparse_attention.score_recompute.dense_score_recompute_sm90 import DenseScoreRecomputeSm90

        is_idx = op in ("sidx", "didx")
        bf16 = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[c["dt"]]
        auxdt = bf16 if is_idx else f32
        if op in ("sidx", "sattn"):
            tm, nht = sm90_tile(H, op == "sattn")
            obj = SparseScoreRecomputeSm90(bf16, head_dim=D, qhead_per_kvhead=H, tile_m=tm, tile_n=64, num_threads=256, swap_AB=True,
                                           topk_max=c["topk"], is_index_scores=is_idx,
                                           softmax_scale=1.0 if op == "sidx" else c["scale"], has_topk_length=bool(c["len"]),
                                           num_head_tiles=nht, is_sparse=True, output_log_probs=False, topk_indices_global=bool(c["glob"]))
            args = (TT(bf16, 4), TT(bf16, 4), TT(i32, 3), stream, TT(f32, 3), TT(auxdt, 3), TT(i32, 2) if c["len"] else None, None)
            return obj, args, None
        qh = H // c["Hkv"]
        tm, nht = sm90_tile(qh, False)
        obj = DenseScoreRecomputeSm90(bf16, head_dim=D, qhead_per_kvhead=qh, tile_m=tm, tile_n=64, num_threads=384, swap_AB=True,
                                      topk_max=c["Sk"], is_index_scores=is_idx, softmax_scale=c["scale"], has_topk_length=False,
                                      num_head_tiles=nht, ratio=c["ratio"])
        args = (TT(bf16, 4), TT(bf16, 4), None, stream, TT(f32, 3), TT(auxdt, 3), None, TT(f32, 2), TT(i32, 1, align=c.get("offs_align", 4)) if c["offs"] else None)
        return obj, args, None
    # ---- SM100 ----
    from cudnn.deepseek_sparse_attention.score_recompute.sparse_score_recompute_sm100 import SparseScoreRecomputeSm100
    from cudnn.deepseek_sparse_attention.score_recompute.dense_score_recompute_sm100 import DenseScoreRecomputeSm100
    from cudnn.deepseek_sparse_attention.score_recompute.dense_score_recompute_sm100_mxfp8 import BwdDenseAttnScoreSm100Mxfp8
    from cudnn.deepseek_sparse_attention.score_recompute.indexer_score_unified_sm100 import IndexerScoreUnifiedSm100
    from cudnn.deepseek_sparse_attention.score_recompute._block_scaled import BLOCK_SCALED_FORMATS

    if op in ("sidx", "sattn"):
        ln = bool(c["len"])
        if op == "sidx":
            m, n, kb = H, 128, None
            kvs, tis = sm100_sparse_stages(D, m, n, None, c["topk"], 2)
            obj = SparseScoreRecomputeSm100(head_dim=D, qhead_per_kvhead=H, m_block_size=m, n_block_size=n, topk=c["topk"], kv_stage=kvs,
                                            score_type="indexer", have_topk_length=ln, topk_in_smem=tis, topk_indices_global=bool(c["glob"]))
            auxdt, opts = bf16, None
        else:
            m, n, kb = sm100_sattn_tiles(D, H, c["topk"], ln)
            if ln and (m, n, kb) == sm100_sattn_tiles(D, H, c["topk"], False):
                ln = False  # upstream drops topk_length: the non-compact kernel runs
            kvs, tis = sm100_sparse_stages(D, m, n, kb, c["topk"], 4)
            obj = SparseScoreRecomputeSm100(head_dim=D, qhead_per_kvhead=H, m_block_size=m, n_block_size=n, k_block_size=kb, topk=c["topk"],
                                            kv_stage=kvs, score_type="attention", have_topk_length=ln, topk_in_smem=tis,
                                            topk_indices_global=bool(c["glob"]))
            auxdt, opts = f32, ("--opt-level 2" if n == 128 else None)
        args = (TT(bf16, 4), TT(bf16, 3), TT(auxdt, 3), TT(i32, 3), TT(f32, 3), TT(i32, 2) if ln else None, cutlass.Float32(1.0), stream)
        return obj, args, opts
    vl, prec, Hkv = bool(c["varlen"]), c["prec"], c["Hkv"]
    qh = H // Hkv
    qr, ar, orr = (3, 2, 2) if vl else (4, 3, 3)
    cu = (TT(i32, 1), TT(i32, 1)) if vl else (None, None)
    offs = TT(i32, 1) if c["offs"] else None
    hp = -(-D // 16) * 16
    scal = (cutlass.Float32(1.0), cutlass.Int32(1), cutlass.Int32(1))
    if op == "didx":
        if prec == "bf16":
            m, n, kb = 128, 128, 64
            obj = IndexerScoreUnifiedSm100(head_dim=D, qhead_per_kvhead=qh, m_block_size=m, n_block_size=n, k_block_size=kb,
                                           kv_stage=sm100_dense_stage(hp, m, n, kb, 2), ratio=c["ratio"], is_varlen=vl, compute_lse=True,
                                           is_compressed_logits=False)
            return obj, (TT(bf16, qr), TT(bf16, qr), TT(bf16, ar), TT(f32, orr), TT(f32, orr - 1), *scal, *cu, offs, stream), None
        qdt = {"mxfp8": cutlass.Float8E4M3FN, "mxfp4": cutlass.Uint8}[prec]
        obj = BLOCK_SCALED_FORMATS[prec].kernel_cls(head_dim=D, qhead_per_kvhead=qh, m_block_size=128, n_block_size=128, k_block_size=64,
                                                    kv_stage=24, ratio=c["ratio"], is_varlen=vl, sf_vec_size=32, compute_lse=True,
                                                    is_compressed_logits=False)
        cus = (TT(i32, 1), TT(i32, 1)) if vl else (None, None)
        e8 = cutlass.Float8E8M0FNU
        return obj, (TT(qdt, qr), TT(qdt, qr), TT(bf16, ar), TT(e8, 3), TT(e8, 3), TT(f32, orr), TT(f32, orr - 1), *scal, *cu, *cus, offs,
                     stream), None
    # dense attention
    if prec == "bf16":
        m2 = qh * 2
        m = m2 if m2 * hp * 2 + 128 * 64 * 2 + m2 * 2 * 4 + 4096 <= SMEM100 else qh
        n = 128
        if D in (512,):
            kb = 128 if qh in (64, 128) else 64
        elif D == 576:
            kb = 64
        else:
            kb = sm100_dense_kblock(hp, m, n, 4)
        if kb == hp:
            kb = None  # upstream: None means "no split"; _dense_attn_score_recompute then re-derives it
        if kb is None:
            kb = sm100_dense_kblock(hp, m, n, 4)
        kvs = sm100_dense_stage(hp, m, n, kb, 4)
        obj = DenseScoreRecomputeSm100(head_dim=D, qhead_per_kvhead=qh, m_block_size=m, n_block_size=n, k_block_size=kb, kv_stage=kvs,
                                       score_type="attention", ratio=c["ratio"], is_varlen=vl)
        return obj, (TT(bf16, qr), TT(bf16, qr), TT(f32, ar), TT(f32, orr), TT(f32, orr - 1), *scal, *cu, offs, stream), None
    # mxfp8 attention
    sk_hint = c["Sk"]
    kb = (256 if sk_hint >= 4096 else 128) if D == 512 else 64
    if D == 512:
        kvs = 7 if kb == 64 else 3 if kb == 256 else 9 if qh >= 128 else 7
    else:
        kvs = 4
    obj = BwdDenseAttnScoreSm100Mxfp8(head_dim=D, qhead_per_kvhead=qh, m_block_size=128, n_block_size=128, k_block_size=kb, kv_stage=kvs,
                                      ratio=c["ratio"], is_varlen=vl, sf_vec_size=32)
    cus = (TT(i32, 1), TT(i32, 1)) if vl else (None, None)
    e8 = cutlass.Float8E8M0FNU
    return obj, (TT(cutlass.Float8E4M3FN, qr), TT(cutlass.Float8E4M3FN, qr), TT(f32, ar), TT(e8, 3), TT(e8, 3), TT(f32, orr),
                 TT(f32, orr - 1), *scal, *cu, *cus, offs, stream), None


def run_spec(c):
    obj, args, opts = build_spec(c)
    t0 = time.perf_counter()
    fn = cute.compile(obj, *args, options=opts) if opts else cute.compile(obj, *args)
    secs = time.perf_counter() - t0
    cub, host = cubin_of(fn)
    return {"cls": type(obj).__name__, "options": opts, "ctor": simple_vars(obj), "seconds": round(secs, 2),
            "cubin_sha": sha(cub), "cubin_bytes": len(cub), "kernels": smem_of(cub), "function_name": fn.function_name,
            "_cubin": cub, "_host": host}


def lift_verify(host, fname, cub):
    from dsa_aot.toolchain import lift, verify

    r = {}
    try:
        src = lift.lift(host, fname, "srec", lift.cubin_param_layout(cub))
        r["lift"] = "ok"
        r["_src"] = src
        try:
            rep = verify.verify(host, fname, src, cub, samples=20)
            r["verify"] = {k: v for k, v in rep.items() if k in ("verdict", "samples", "launches")} or str(rep)[:300]
        except Exception as e:  # noqa: BLE001
            r["verify"] = f"{type(e).__name__}: {e}"[:600]
    except Exception as e:  # noqa: BLE001
        r["lift"] = f"{type(e).__name__}: {e}"[:600]
    return r


def main():
    outp = sys.argv[1]
    src = sys.argv[2]
    cfgs = json.load(open(src)) if os.path.exists(src) else json.loads(src)
    save = sys.argv[sys.argv.index("--save") + 1] if "--save" in sys.argv else None
    do_lift = "--lift" in sys.argv
    if save:
        os.makedirs(save, exist_ok=True)
    with open(outp, "a") as fo:
        for i, c0 in enumerate(cfgs):
            c = dict(DEFAULT) | c0
            tag = c["tag"] or f"{ARCH}-{c['op']}-{i}"
            res = {"arch": ARCH, "tag": tag, "cfg": {k: v for k, v in c.items() if k in c0 or k in ("op",)}}
            t0 = time.time()
            try:
                if c["up"]:
                    res["upstream"] = run_upstream(c)
                if c["spec"]:
                    res["spec"] = run_spec(c)
                if c["up"] and c["spec"]:
                    ups = {x["cubin_sha"] for x in res["upstream"]["compiles"]}
                    res["same"] = ups == {res["spec"]["cubin_sha"]}
                    uc = res["upstream"]["compiles"][0]["ctor"] if res["upstream"]["compiles"] else {}
                    res["ctor_diff"] = {k: (uc.get(k), v) for k, v in res["spec"]["ctor"].items() if uc.get(k) != v}
                if do_lift and c["spec"]:
                    res["spec"].update(lift_verify(res["spec"]["_host"], res["spec"]["function_name"], res["spec"]["_cubin"]))
            except Exception as e:  # noqa: BLE001
                res["error"] = f"{type(e).__name__}: {e}"[:1500]
                res["trace"] = traceback.format_exc()[-3000:]
            res["wall"] = round(time.time() - t0, 2)
            if save:
                for side in ("upstream", "spec"):
                    if side not in res:
                        continue
                    items = res[side]["compiles"] if side == "upstream" else [res[side]]
                    for j, x in enumerate(items):
                        suffix = f"{side}{j if side == 'upstream' and j else ''}"
                        open(f"{save}/{tag}-{suffix}.cubin", "wb").write(x["_cubin"])
                        open(f"{save}/{tag}-{suffix}.mlir", "w").write(x["_host"])
                    if side == "spec" and "_src" in res[side]:
                        open(f"{save}/{tag}-spec.launcher.py", "w").write(res[side]["_src"])

            def clean(o):
                if isinstance(o, dict):
                    return {k: clean(v) for k, v in o.items() if not k.startswith("_")}
                if isinstance(o, list):
                    return [clean(v) for v in o]
                return o

            line = json.dumps(clean(res), default=repr)
            fo.write(line + "\n")
            fo.flush()
            short = {"tag": tag, "same": res.get("same"), "ctor_diff": res.get("ctor_diff"), "error": res.get("error"), "wall": res["wall"],
                     "up": [(x["key"][:200], x["cubin_sha"][:12], x["calls"]) for x in res.get("upstream", {}).get("compiles", [])],
                     "spec": res.get("spec", {}).get("cubin_sha", "")[:12]}
            print(json.dumps(short), flush=True)


if __name__ == "__main__":
    main()
