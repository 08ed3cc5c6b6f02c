#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA sparse attention forward (sparse_attention_forward_wrapper): ci/parity/harness.py runs it.

SM100 only (upstream has no SM90 kernel: on any other GPU each step exits 2, not applicable). Not yet run: the team's
machines have no SM100 GPU (the shipped cubins are fidelity-identical to cudnn's and the op's calls are checked against
their lifted host functions, ci/check_sm100_calls.py).

Both sides call ``sparse_attention_forward(q, kv, topk_idxs, attn_sink=, topk_length=, softmax_scale=0.04, indexer_topk=)``
(cudnn's ``sparse_attention_forward_wrapper``, ``dsa_aot.dsa.sparse_attention_forward``) -> out, max_logits, lse and
lse_indexer (none when indexer_topk is 0); AOT also ``sparse_attention_forward_into`` with the index rows padded with -1
to 64 slots. Cases: H64 D512 / D576 and H128 D512, bf16 and fp16, each indexer_topk class, sink and topk_length, a top-k
width that is not a multiple of 64 (upstream's -1 padding), ids of -1 and out of range, a prefill-sized one (not in --quick).

Rules: every output bitwise; both sides within the fp64 reference (tests/gpu/ref_sparse_attention.py): relative error
below BOUND on the finite values, the infinities the same.
"""

import json
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BITWISE, Aot, Jit, Parity, load_ref  # noqa: E402

OUTS = ("out", "max_logits", "lse", "lse_indexer")
BOUND = {"out": 1e-2, "max_logits": 1e-5, "lse": 1e-5, "lse_indexer": 1e-5}  # out: P rounded to the input dtype before P.V
API = "cudnn.deepseek_sparse_attention.sparse_attention_forward"


def cases(quick):
    out = []

    def add(name, **spec):
        spec = {**dict(h=64, d=512, dt="bf16", it=2048, sink=False, tl=False, s_q=256, s_kv=8192, k=2048), **spec}
        out.append((name, dict(spec, seed=5000 + zlib.crc32(name.encode()) % 100000)))

    add("h64-d512-it2048")
    add("h64-d512-it2048-sink-tl", sink=True, tl=True)
    add("h64-d512-it0-k100", it=0, k=100)
    add("h64-d576-it512-sink", d=576, it=512, sink=True, k=600)
    add("h64-d512-fp16-it1024", dt="fp16", it=1024, k=1024)
    add("h128-d512-it512", h=128, it=512, k=1000)
    add("h128-d512-it0-sink-tl", h=128, it=0, sink=True, tl=True, k=512)
    if not quick:
        add("h64-d512-it2048-prefill", s_q=4096, s_kv=65536)
    return out


def inputs(spec):
    import torch

    x = load_ref("ref_sparse_attention.py").make_inputs(spec["s_q"], spec["s_kv"], spec["h"], spec["d"], spec["k"], with_topk_length=spec["tl"],
                                                         seed=spec["seed"], invalid_frac=0.1)
    dt = torch.float16 if spec["dt"] == "fp16" else torch.bfloat16
    idx = x["topk_idxs"].clone()
    idx[0, :3] = torch.tensor([spec["s_kv"], spec["s_kv"] + 7, -5], dtype=torch.int32)  # out of range / negative: skipped
    return dict(q=x["q"].to(dt), kv=x["kv"].to(dt), topk_idxs=idx, attn_sink=x["attn_sink"] if spec["sink"] else None,
                topk_length=x["topk_length"] if spec["tl"] else None)


_WANT = {}  # the last case's reference: its forms (JIT first, AOT first, _into) share it


def reference(spec, x, outs):
    import torch

    ref = load_ref("ref_sparse_attention.py")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    key = json.dumps(spec, sort_keys=True)
    if key not in _WANT:
        g = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in x.items()}
        _WANT.clear()
        _WANT[key] = ref.sparse_attention_forward_ref(g["q"], g["kv"], g["attn_sink"], g["topk_idxs"], 0.04, g["topk_length"],
                                                      indexer_topk=spec["it"])
    bad = []
    for n, t in outs.items():
        g, w = t.to(dev).double(), _WANT[key][n]
        fin, inf = torch.isfinite(w), torch.isinf(w)
        same_inf = torch.equal(torch.isinf(g), inf) and torch.equal(g[inf], w[inf])
        err = ref.rel_err(g[fin], w[fin]) if fin.any() else 0.0
        if not (same_inf and err < BOUND[n]):  # a NaN makes err NaN
            bad.append(f"{n} off the reference (rel err {err:.3g}, infinities equal {same_inf})")
    return bad


def _call(fn, spec, x):
    r = fn(x["q"], x["kv"], x["topk_idxs"], attn_sink=x["attn_sink"], topk_length=x["topk_length"], softmax_scale=0.04, indexer_topk=spec["it"])
    return {n: r[n] for n in OUTS if r[n] is not None}


def _into(dsa, spec, x, b):
    import torch

    from dsa_aot.policy.dsa_sparse_attention_forward import padded_topk

    idx = x["topk_idxs"]
    kp = padded_topk(idx.shape[1])
    if kp != idx.shape[1]:  # the _into form takes rows of a multiple of 64 slots
        idx = torch.cat([idx, torch.full((idx.shape[0], kp - idx.shape[1]), -1, dtype=idx.dtype, device=idx.device)], 1)
    dsa.sparse_attention_forward_into(b["out"], b["max_logits"], b["lse"], b.get("lse_indexer"), x["q"], x["kv"], idx, attn_sink=x["attn_sink"],
                                      topk_length=x["topk_length"], softmax_scale=0.04, indexer_topk=spec["it"])
    return b


def _index_key(kind, k):
    import torch

    _dev, _cap, _variant, h, d, qdt, _kvdt, _idt, sink, tl, it = k
    return "fwd", {"heads": h, "dim": d, "dtype": "f16" if qdt == torch.float16 else "bf16", "indexer_topk": it, "sink": sink, "topk_length": tl}


def _setup():
    import importlib

    return importlib.import_module(API + ".api")


PARITY = Parity(
    family="dsa_sparse_attention_forward", doc=__doc__, cases=cases, inputs=inputs, reference=reference, arches=("sm_100a", "sm_103a"),
    outputs=lambda spec: {n: BITWISE for n in OUTS if spec["it"] or n != "lse_indexer"},
    label=lambda s: f"H{s['h']} D{s['d']} {s['dt']} it{s['it']}" + (" sink" if s["sink"] else "") + (" tl" if s["tl"] else ""),
    jit=Jit(setup=_setup, caches={"fwd": (API + "._interface_sm100", "_compile_cache")}, index_key=_index_key,
            call=lambda api, spec, x, b: _call(api.sparse_attention_forward_wrapper, spec, x)),
    aot=Aot(call=lambda dsa, spec, x, b: _call(dsa.sparse_attention_forward, spec, x), into=_into),
    quick="no prefill-sized case",
)

if __name__ == "__main__":
    sys.exit(PARITY.main())
