#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA sparse attention backward op on SM90: ci/parity/harness.py runs it.

Both sides make the same public call with the same keyword arguments: cudnn's
``sparse_attention_backward_wrapper`` (on SM90 ``_interface_sm90.flash_attn_bwd_sm90``: zero the fp32
dKV accumulator and d_sink, preprocess, main, postprocess) and ``dsa_aot.dsa.sparse_attention_backward``
(and its ``_into`` form), given NaN-poisoned ``dq`` / ``dkv`` and a 0xFF workspace sized by each side's
own function; ``d_sink`` is allocated by the op. Default block_tile, non-deterministic, attention sink given.

Cases (bf16): the seed repro S_q = S_kv = 2048, H64, D512, topk 512; S_q 1024, S_kv 4096, H {64, 128} x
D {512, 576} x topk {512, 1024, 2048}, topk 512 with and without ``topk_length``; S_kv 3072 with 5 %
padded (-1) ids, ``topk_length`` and an explicit softmax_scale (the others pass None). Inputs:
tests/gpu/ref_sparse_attention.make_inputs (out / lse from its fp64 forward over the selected keys).

Rules: ``dq`` bitwise equal and NaN-free (one CTA writes each dQ tile with TMA stores, no atomics);
``dkv`` and ``d_sink`` within the JIT's own run-to-run jitter (fp32 atomics upstream too). Both sides
must return the ``dq`` / ``dkv`` they were given. Kernels: cudnn's compile caches pre / main / post
against the op's entry lookups (ops pre_sm90 / main_sm90 / post_sm90).
"""

import importlib
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import JITTER, Aot, Jit, Parity, bitwise, load_ref, nan_like, poisoned_workspace  # noqa: E402

BASE = "cudnn.deepseek_sparse_attention.sparse_attention_backward"
SM90 = BASE + "._interface_sm90"  # imported by setup: the package's attribute from then on (cudnn imports it lazily)
SEED = dict(s_q=2048, s_kv=2048, h=64, d=512, topk=512)  # the seed repro
PAD = dict(s_q=1024, s_kv=3072, h=128, d=576, topk=512, tl=True, invalid_frac=0.05, scale=0.05)
ARGS = ("q", "kv", "out", "dout", "lse", "attn_sink", "topk_idxs", "topk_length", "softmax_scale")
# SM90 launch constants of flash_attn_bwd_sm90 (kernels/dsa_sparse_attention_backward.py builds with them): a JIT key
# that differs gets the differing fields added to its index key, so that it matches no shipped entry
TILE_M, TILE_N, THREADS = 64, 64, 256
MAIN_FIXED = (("tile_m", TILE_M), ("tile_n", TILE_N), ("threads", THREADS), ("KV_stage", 1), ("PdS_stage", 1), ("SdP_swapAB", False),
              ("dKV_swapAB", False), ("dQ_swapAB", False))


def case(s_q, s_kv, h, d, topk, tl=False, invalid_frac=0.0, scale=None, label=""):
    """(name, spec); the seed is the name's, so it is stable across runs and --only filters."""
    name = (f"{label}sq{s_q}-skv{s_kv}-h{h}-d{d}-topk{topk}" + ("-len" if tl else "") + ("-pad" if invalid_frac else "")
            + (f"-scale{scale:g}" if scale is not None else ""))
    return name, dict(s_q=s_q, s_kv=s_kv, h=h, d=d, topk=topk, tl=bool(tl), invalid_frac=invalid_frac, scale=scale,
                      seed=7000 + zlib.crc32(name.encode()) % 100000)


def cases(quick):
    if quick:
        grid = [(64, 512, 512, False), (64, 512, 512, True), (128, 576, 2048, False)]
    else:
        grid = [(h, d, topk, tl) for h in (64, 128) for d in (512, 576) for topk in (512, 1024, 2048)
                for tl in ((False, True) if topk == 512 else (False,))]
    return [case(**SEED, label="seed-")] + [case(1024, 4096, h, d, topk, tl) for h, d, topk, tl in grid] + [case(**PAD)]


def make_inputs(spec, device=None):
    """CPU inputs of one case (out / lse from the fp64 forward, on ``device``: None, the GPU if any); (dict, generator name)."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    x = load_ref("ref_sparse_attention.py").make_inputs(spec["s_q"], spec["s_kv"], spec["h"], spec["d"], spec["topk"], device=device,
                                                        with_topk_length=spec["tl"], seed=spec["seed"], invalid_frac=spec["invalid_frac"],
                                                        softmax_scale=spec["scale"])
    x = {k: (v.to("cpu").contiguous() if isinstance(v, torch.Tensor) else v) for k, v in x.items()}
    x["softmax_scale"] = spec["scale"]  # what both sides pass (None: the op's default 1/sqrt(D))
    return x, "tests/gpu/ref_sparse_attention.make_inputs"


def _dq(spec, jo, ao):
    eq, n = bitwise(jo["dq"], ao["dq"])
    nan = int(ao["dq"].isnan().sum())
    return eq and not nan, "bitwise" if eq and not nan else f"NO ({n} differ, {nan} NaN)"


def buffers(side, api, spec, x):
    s = (spec["s_q"], spec["s_kv"], spec["d"], spec["h"])
    if side == "jit":  # each side's own workspace function: the harness compares the sizes
        ws = api._interface_sm90.flash_attn_bwd_sm90_workspace_size(*s)
    else:
        ws = api.sparse_attention_backward_workspace_bytes(*s, topk=spec["topk"])
    return dict(dq=nan_like(x["q"]), dkv=nan_like(x["kv"]), workspace=poisoned_workspace(ws))


def _call(fn, x, b):
    r = fn(**{k: x[k] for k in ARGS}, dq=b["dq"], dkv=b["dkv"], workspace=b["workspace"])
    assert r["dq"] is b["dq"] and r["dkv"] is b["dkv"], "the op did not return the dq / dkv it was given"  # as upstream's wrapper does
    return r


def _into(dsa, spec, x, b):
    dsa.sparse_attention_backward_into(b["dq"], b["dkv"], b["d_sink"], **{k: x[k] for k in ARGS}, workspace=b["workspace"])
    return b


def _extras(key, pairs):
    """Add the fields whose value differs from the shipped constant (then the key matches no entry)."""
    return dict(key, **{k: v for k, v, want in pairs if v != want})


def _index_key(kind, k):
    """flash_attn_bwd_sm90's compile keys -> (op, key) as policy.kernels looks them up (its entries' own fields)."""
    dt = {"BFloat16": "bf16", "Float16": "f16"}.get(getattr(k[0], "__name__", str(k[0])), str(k[0]))
    if kind == "pre":
        _, dv, tile_m, threads = k
        return "pre_sm90", _extras({"dtype": dt}, (("head_dim_v", dv, 512), ("tile_m", tile_m, TILE_M), ("threads", threads, THREADS)))
    if kind == "main":
        _, dim, dv, heads, *fixed, tl, topk = k
        return "main_sm90", _extras({"dtype": dt, "heads": heads, "dim": dim, "topk": topk, "topk_length": bool(tl)},
                                    [("head_dim_v", dv, 512)] + [(n, v, want) for (n, want), v in zip(MAIN_FIXED, fixed)])
    _, chunk, tile_n, dim, threads, n_chunks = k
    want = 64 if dim == 576 else min(128, dim)  # upstream's postprocess hdim_chunk (and thread count)
    return "post_sm90", _extras({"dtype": dt, "dim": dim}, (("hdim_chunk", chunk, want), ("tile_n", tile_n, TILE_N), ("threads", threads, want),
                                                            ("N_hdim_chunks", n_chunks, dim // want)))


PARITY = Parity(
    family="dsa_sparse_attention_backward", doc=__doc__, cases=cases, inputs=lambda spec: make_inputs(spec)[0], buffers=buffers,
    outputs=lambda spec: {"dq": _dq, "dkv": JITTER, "d_sink": JITTER},
    label=lambda s: f"H{s['h']} D{s['d']} topk {s['topk']}" + (" len" if s["tl"] else ""),
    jit=Jit(setup=lambda: [importlib.import_module(m) for m in (SM90, BASE)][1],  # the caches: attributes of the function, read at every call
            caches={kind: (SM90, "flash_attn_bwd_sm90." + attr) for kind, attr in (("pre", "compile_cache_pre"), ("main", "compile_cache"),
                                                                                   ("post", "compile_cache_post"))},
            index_key=_index_key, call=lambda api, spec, x, b: _call(api.sparse_attention_backward_wrapper, x, b)),
    aot=Aot(call=lambda dsa, spec, x, b: _call(dsa.sparse_attention_backward, x, b), into=_into),
    covers=("sm_90a",),  # the JIT caches above are SM90's; SM100 runs another cudnn path
    sync_every=8, quick="the seed repro, H64 D512 topk 512 with and without topk_length, H128 D576 topk 2048, the padded case",
)

if __name__ == "__main__":
    sys.exit(PARITY.main())
