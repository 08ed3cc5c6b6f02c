#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA indexer forward (indexer_forward_wrapper, SM90): ci/parity/harness.py runs it.

Both sides make the same public call with the same arguments::

    indexer_forward(q, k, w, ratio, sm_scale=, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=,
                    q_causal_offsets=, precision=, q_scale=, k_scale=, return_lse=)   -> {'scores'[, 'lse']}

JIT: ``cudnn.deepseek_sparse_attention.indexer_forward.api.indexer_forward_wrapper`` (its SM90 path, the only
one these cases and the key mapping cover: SM100 is checked offline, ci/check_sm100_calls.py); AOT:
``dsa_aot.dsa.indexer_forward`` and ``indexer_forward_into``.

Cases: bf16 and fp8 (per-token descales), W bf16 and fp32, H 64 / 32 / 16, ratio 4 and 1, BSHD and THD
(segments that cover every row, one of them empty), causal offsets, LSE, the three fp8 H64 BSHD variants
upstream picks from S_q % 2 and S_k % 64, and a prefill-sized case (S_q 4096; not in --quick).

Rules: scores and lse bitwise equal JIT vs AOT; both sides within the fp64 reference
(tests/gpu/ref_indexer_forward.py, on the GPU when there is one) by the GPU test's bound (relative error
1e-5 bf16, 2e-3 fp8) with the -inf mask exact and no NaN.
"""

import json
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BITWISE, Aot, Jit, Parity, load_ref  # noqa: E402

BASE = "cudnn.deepseek_sparse_attention.indexer_forward"
REF = "ref_indexer_forward.py"
BOUND = {"bf16": 1e-5, "fp8": 2e-3}  # as tests/gpu/test_dsa_indexer_forward.py
SCALE = 0.0883883  # 1 / sqrt(128)


def cases(quick):
    out = []

    def add(name, **spec):
        spec = {**dict(w="bfloat16", ratio=4, h=64, precision="bf16", offsets=False, lse=False, varlen=False), **spec}
        out.append((name, dict(spec, seed=9000 + zlib.crc32(name.encode()) % 100000)))

    add("bf16-h64-r4-b2-sq512-sk128", b=2, s_q=512, s_k=128)
    add("bf16-h64-r4-w32-lse-offs", b=2, s_q=300, s_k=77, w="float32", lse=True, offsets=True)
    add("bf16-h64-r1-b2-sq256-sk256", b=2, s_q=256, s_k=256, ratio=1)
    add("bf16-h32-r4", b=3, s_q=200, s_k=64, h=32)
    add("bf16-h16-r1", b=1, s_q=129, s_k=130, h=16, ratio=1)
    add("fp8-h64-masked", b=2, s_q=512, s_k=128, precision="fp8")
    add("fp8-h64-unchecked", b=2, s_q=512, s_k=127, precision="fp8")
    add("fp8-h64-checked-lse", b=2, s_q=511, s_k=128, precision="fp8", lse=True)
    add("fp8-h64-w32-prescaled", b=2, s_q=256, s_k=64, precision="fp8", w="float32")
    add("fp8-h32", b=2, s_q=256, s_k=64, precision="fp8", h=32)
    add("thd-bf16-h64-r4-lse-offs", varlen=True, lens_q=[300, 0, 129, 64], lens_k=[80, 10, 33, 16], lse=True, offsets=True)
    add("thd-fp8-h64-r4", varlen=True, lens_q=[256, 100, 1], lens_k=[64, 30, 1], precision="fp8")
    if not quick:
        add("bf16-h64-r4-b1-sq4096-sk1024", b=1, s_q=4096, s_k=1024)
    return out


def label(spec):
    return (f"{spec['precision']} W {spec['w'][:4]} H{spec['h']} r{spec['ratio']} {'thd' if spec['varlen'] else 'bshd'}"
            + (" offs" if spec["offsets"] else "") + (" lse" if spec["lse"] else ""))


def inputs(spec):
    """q, k, w, q_scale, k_scale, cu_seqlens_q/k, max_seqlen_q/k, q_causal_offsets (None where unused)."""
    import torch

    ref = load_ref(REF)
    gen = torch.Generator().manual_seed(int(spec["seed"]))
    fp8, wdt = spec["precision"] == "fp8", getattr(torch, spec["w"])
    x = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, q_causal_offsets=None)
    if spec["varlen"]:
        lq, lk = spec["lens_q"], spec["lens_k"]
        x["cu_seqlens_q"] = torch.tensor([0] + [sum(lq[: i + 1]) for i in range(len(lq))], dtype=torch.int32)
        x["cu_seqlens_k"] = torch.tensor([0] + [sum(lk[: i + 1]) for i in range(len(lk))], dtype=torch.int32)
        x["max_seqlen_q"], x["max_seqlen_k"] = max(lq), max(lk)
        q, k, w, qs, ks = ref.random_inputs((sum(lq),), (sum(lk),), spec["h"], gen, fp8, wdt)
    else:
        q, k, w, qs, ks = ref.random_inputs((spec["b"], spec["s_q"]), (spec["b"], spec["s_k"]), spec["h"], gen, fp8, wdt)
    if spec["offsets"]:
        x["q_causal_offsets"] = torch.randint(0, 64, (len(spec["lens_q"]) if spec["varlen"] else spec["b"],), generator=gen, dtype=torch.int32)
    x.update(q=q, k=k, w=w, q_scale=qs, k_scale=ks)
    return x


def outputs(spec):
    return {"scores": BITWISE, **({"lse": BITWISE} if spec["lse"] else {})}


_WANT = {}  # the last case's fp64 reference: compare checks three output sets of a case (JIT first, AOT first and _into) against it


def _want(spec, x):
    import torch

    key = json.dumps(spec, sort_keys=True)
    if key not in _WANT:
        ref, dev = load_ref(REF), "cuda" if torch.cuda.is_available() else "cpu"
        g = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in x.items()}
        pre = spec["precision"] == "fp8" and spec["w"] == "float32"  # W already holds q_scale * sm_scale
        if spec["varlen"]:
            s = ref.scores_thd(g["q"], g["k"], g["w"], x["cu_seqlens_q"], x["cu_seqlens_k"], x["max_seqlen_q"], x["max_seqlen_k"], spec["ratio"],
                               SCALE, x["q_causal_offsets"], g["q_scale"], g["k_scale"], pre)
        else:
            s = ref.scores_bshd(g["q"], g["k"], g["w"], spec["ratio"], SCALE, x["q_causal_offsets"], g["q_scale"], g["k_scale"], pre)
        _WANT.clear()
        _WANT[key] = {"scores": s, "lse": ref.lse_of(s)}
    return _WANT[key]


def reference(spec, x, outs):
    """The -inf mask exact, no NaN, relative error (over the finite reference elements) under BOUND."""
    import torch

    want, bad = _want(spec, x), []
    from refutil import rel_err  # tests/gpu: on sys.path once load_ref ran (in _want)
    for n, got in outs.items():
        g, w = got.to(want[n].device, torch.float64), want[n]
        fin = torch.isfinite(w)
        err = rel_err(g[fin], w[fin]) if fin.any() else 0.0
        if not torch.equal(torch.isinf(g) & (g < 0), torch.isinf(w)) or bool(torch.isnan(g).any()) or not err < BOUND[spec["precision"]]:
            bad.append(f"{n}: rel err {err:.3g} (bound {BOUND[spec['precision']]}), or the -inf mask / NaN")
    return bad


def _kwargs(spec, x):
    kw = dict(sm_scale=SCALE, precision=spec["precision"], q_scale=x["q_scale"], k_scale=x["k_scale"], q_causal_offsets=x["q_causal_offsets"])
    if spec["varlen"]:
        kw.update(cu_seqlens_q=x["cu_seqlens_q"], cu_seqlens_k=x["cu_seqlens_k"], max_seqlen_q=x["max_seqlen_q"], max_seqlen_k=x["max_seqlen_k"])
    return kw


def _call(fn, spec, x):
    return fn(x["q"], x["k"], x["w"], spec["ratio"], return_lse=spec["lse"], **_kwargs(spec, x))


def _index_key(kind, k):
    """_interface_sm90's compile key (q dtype, w dtype, D, H, ratio, varlen, unchecked, masked, lse, broadcast dims x5, offsets)."""
    import torch

    qdt, wdt, _d, h, ratio, vl, unchecked, masked, lse = k[:9]
    return "fwd_sm90", {"precision": "fp8" if qdt == torch.float8_e4m3fn else "bf16", "w_dtype": str(wdt).replace("torch.", ""), "heads": h,
                        "ratio": ratio, "varlen": vl, "offsets": k[14], "lse": lse, "unchecked": unchecked, "masked": masked}


def _setup():
    import importlib

    return importlib.import_module(BASE + ".api")


def _into(dsa, spec, x, b):
    dsa.indexer_forward_into(b["scores"], b.get("lse"), x["q"], x["k"], x["w"], spec["ratio"], **_kwargs(spec, x))
    return b


PARITY = Parity(
    family="dsa_indexer_forward", doc=__doc__, cases=cases, inputs=inputs, outputs=outputs, reference=reference, label=label,
    jit=Jit(setup=_setup, caches={"fwd": (BASE + "._interface_sm90", "_compile_cache")}, index_key=_index_key,
            call=lambda api, spec, x, b: _call(api.indexer_forward_wrapper, spec, x)),
    aot=Aot(call=lambda dsa, spec, x, b: _call(dsa.indexer_forward, spec, x), into=_into),
    covers=("sm_90a",), quick="no prefill-sized case", bench=("bf16-h64-r4-b1-sq4096-sk1024", "fp8-h64-masked"),
)

if __name__ == "__main__":
    sys.exit(PARITY.main())
