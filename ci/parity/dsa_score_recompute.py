#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA score recompute (sparse / dense, indexer / attention): ci/parity/harness.py runs it.

Both sides make the same public call: cudnn's ``score_recompute.api.{sparse_indexer, sparse_attn, dense_indexer,
dense_attn}_score_recompute_wrapper`` (on the H200 the SM90 path: the weights / LSE copied transposed, one
launch; THD dense: one per segment) and ``dsa_aot.dsa``'s function of the same name without ``_wrapper`` (and
its ``_into`` form, with host ``cu_seqlens`` for THD and a 0xFF workspace sized by its ``_workspace_bytes``;
cudnn takes none), with NaN-poisoned ``out`` (and ``denom_out``).

Cases: the sparse indexer at H64 D128, top-k 512 / 1024 / 2048, local and global ids with 5 % empty (-1)
slots, with ``topk_length`` (the slots past it -1); the sparse attention at H64 / H96 / H128, D512 / D576,
each at its own softmax_scale (SM90 compiles one scale per compile key upstream), the LSE that of the scaled
scores; the dense indexer and attention at ratio 1 and 4, with and without q causal offsets, BSHD and THD
(every segment with queries has keys: upstream leaves a no-key segment's denominators unwritten); two
prefill-sized ones (not in --quick).

Rules: ``out`` and ``denom`` within the JIT's own run-to-run jitter (bitwise where the JIT reproduces itself).
SM90 only, as before: cudnn's SM100 compile caches and keys are not mapped here.
"""

import importlib
import os
import struct
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import JITTER, Aot, Jit, Parity, poisoned, poisoned_workspace  # noqa: E402

H, D = 64, 128  # the indexer's
THD = ([0, 100, 100, 228], [0, 64, 80, 181])  # cu_seqlens_q / _k: 100 queries over 64 keys, none over 16, 128 over 101
API = "cudnn.deepseek_sparse_attention.score_recompute"
FN = {"indexer": "sparse_indexer", "attention": "sparse_attn", "dense": "dense_indexer", "dattn": "dense_attn"}  # + _score_recompute
DENSE = ("dense", "dattn")


def cases(quick):
    out = []

    def add(name, **spec):
        spec = {"length": False, "glob": False, "op": "indexer", "h": H, "d": D, **spec}
        out.append((name, dict(spec, seed=8000 + zlib.crc32(name.encode()) % 100000)))

    add("b2-sq256-topk512", b=2, s_q=256, s_k=4096, topk=512)
    add("b2-sq256-topk1024-global", b=2, s_q=256, s_k=4096, topk=1024, glob=True)
    add("b2-sq200-topk2048-length", b=2, s_q=200, s_k=3000, topk=2048, length=True)
    add("b3-sq100-topk512-length-global", b=3, s_q=100, s_k=1000, topk=512, length=True, glob=True)
    add("attn-h64-d512-topk512", op="attention", h=64, d=512, scale=512**-0.5, b=2, s_q=128, s_k=2048, topk=512)
    add("attn-h64-d512-topk512-scale0.05", op="attention", h=64, d=512, scale=0.05, b=2, s_q=128, s_k=2048, topk=512)
    add("attn-h128-d576-topk2048-length-global", op="attention", h=128, d=576, scale=576**-0.5, b=2, s_q=64, s_k=4096, topk=2048, length=True,
        glob=True)
    add("attn-h96-d576-topk1024-length", op="attention", h=96, d=576, scale=576**-0.5, b=1, s_q=100, s_k=3000, topk=1024, length=True)
    add("dense-r4-offsets-scale1", op="dense", h=64, ratio=4, offsets=True, scale=1.0, b=2, s_q=256, s_k=64, topk=0)
    add("dense-r1-scale-rsqrt128", op="dense", h=64, ratio=1, offsets=False, scale=128**-0.5, b=2, s_q=300, s_k=300, topk=0)
    add("dattn-h64-d512-r4-offsets", op="dattn", h=64, d=512, ratio=4, offsets=True, scale=512**-0.5, b=2, s_q=256, s_k=64, topk=0)
    add("dattn-h128-d576-r1", op="dattn", h=128, d=576, ratio=1, offsets=False, scale=576**-0.5, b=2, s_q=200, s_k=200, topk=0)
    add("dense-thd-r4-offsets", op="dense", h=64, ratio=4, offsets=True, scale=1.0, b=3, s_q=0, s_k=0, topk=0, thd=THD)
    add("dattn-thd-h64-d512-r4", op="dattn", h=64, d=512, ratio=4, offsets=False, scale=512**-0.5, b=3, s_q=0, s_k=0, topk=0, thd=THD)
    if not quick:
        add("b1-sq4096-topk2048-prefill", b=1, s_q=4096, s_k=4096, topk=2048)
        add("attn-b1-sq4096-h64-d512-topk2048-prefill", op="attention", h=64, d=512, scale=512**-0.5, b=1, s_q=4096, s_k=4096, topk=2048)
    return out


def label(spec):
    thd = " THD" if spec.get("thd") else ""
    if spec["op"] in DENSE:
        what = f"dense attention{thd} H{spec['h']} D{spec['d']}" if spec["op"] == "dattn" else f"dense indexer{thd} H{spec['h']}"
        return f"{what} ratio {spec['ratio']}{' offsets' if spec['offsets'] else ''} scale {spec['scale']:.4g}"
    what = f"attention H{spec['h']} D{spec['d']} scale {spec['scale']:.4g}" if spec["op"] == "attention" else "indexer"
    return f"{what} top-k {spec['topk']}{' length' if spec['length'] else ''}{' global' if spec['glob'] else ' local'}"


def inputs(spec):
    """bf16 q, k with O(1) scores, w (bf16) or the LSE (fp32: the log-sum-exp of the scaled scores, over each
    row's first S_k / 4 keys for the sparse attention, over all (THD: its segment's) for the dense one, so the
    target is O(1)). Sparse: per row distinct ids in [0, S_k) (+ b * S_k when global), 5 % of the slots -1;
    with lengths, every slot at or past the row's length -1 (upstream's contract). Dense: full KV (k (B, S_k,
    1, D)), q causal offsets; THD: device cu_seqlens for the allocating forms, host ones (``cu_host``) for _into."""
    import torch

    gen = torch.Generator().manual_seed(int(spec["seed"]))
    if spec["op"] in DENSE:
        b, s_q, s_k, h, d = spec["b"], spec["s_q"], spec["s_k"], spec["h"], spec["d"]
        thd = spec.get("thd")
        lead, k_lead = ((thd[0][-1],), (thd[1][-1],)) if thd else ((b, s_q), (b, s_k))  # THD: packed rows
        sd = 1.0 if spec["op"] == "dattn" else 0.25
        q = (torch.randn(*lead, h, d, generator=gen) * sd).bfloat16()
        k = (torch.randn(*k_lead, 1, d, generator=gen) * sd).bfloat16()
        if spec["op"] == "dattn":
            def lse(q, k):
                return torch.logsumexp(spec["scale"] * torch.einsum("bqhd,bkd->bqhk", q.float(), k[:, :, 0].float()), dim=-1)
            if thd:
                w = torch.cat([lse(q[None, q0:q1], k[None, k0:k1])[0] if k1 > k0 else torch.zeros(q1 - q0, h)
                               for q0, q1, k0, k1 in zip(thd[0], thd[0][1:], thd[1], thd[1][1:])]).contiguous()
            else:
                w = lse(q, k).contiguous()
        else:
            w = (torch.randn(*lead, h, generator=gen) * 0.5).bfloat16()
        offs = torch.tensor([0, 3 * spec["ratio"] + 1, 5][:b], dtype=torch.int32) if spec["offsets"] else None
        x = dict(q=q, k=k, w=w, q_causal_offsets=offs)
        if thd:
            x.update(cu_seqlens_q=torch.tensor(thd[0], dtype=torch.int32), cu_seqlens_k=torch.tensor(thd[1], dtype=torch.int32), cu_host=thd)
        return x
    b, s_q, s_k, topk, h, d = spec["b"], spec["s_q"], spec["s_k"], spec["topk"], spec["h"], spec["d"]
    att = spec["op"] == "attention"
    q = (torch.randn(b, s_q, h, d, generator=gen) * (1.0 if att else d**-0.25)).bfloat16()
    k = (torch.randn(b, s_k, d, generator=gen) * (1.0 if att else d**-0.25)).bfloat16()
    if att:
        w = torch.logsumexp(spec["scale"] * torch.einsum("bqhd,bkd->bqhk", q.float(), k[:, : max(1, s_k // 4)].float()), dim=-1).contiguous()
    else:
        w = (torch.randn(b, s_q, h, generator=gen) / h**0.5).bfloat16()
    ids = torch.rand(b * s_q, s_k, generator=gen).topk(topk, dim=-1).indices.view(b, s_q, topk).int()
    valid = torch.rand(b, s_q, topk, generator=gen) >= 0.05
    length = None
    if spec["length"]:
        length = torch.randint(1, topk + 1, (b, s_q), generator=gen, dtype=torch.int32)
        valid &= torch.arange(topk)[None, None, :] < length[..., None]
    if spec["glob"]:
        ids = ids + (torch.arange(b, dtype=torch.int32) * s_k).view(b, 1, 1)
    ids = torch.where(valid, ids, torch.full_like(ids, -1)).contiguous()
    return dict(q=q, k=k, w=w, topk_indices=ids, topk_length=length)


def buffers(side, api, spec, x):
    """Poisoned fp32 ``out`` (THD: packed rows over the longest segment's keys) and, dense, ``denom``."""
    import torch

    if spec["op"] not in DENSE:
        return {"out": poisoned(x["topk_indices"].shape, torch.float32)}
    rows = x["q"].shape[:-2]
    cols = max(b - a for a, b in zip(spec["thd"][1], spec["thd"][1][1:])) if spec.get("thd") else x["k"].shape[1]
    return {"out": poisoned((*rows, cols), torch.float32), "denom": poisoned(rows, torch.float32)}


def _scale(spec):
    """The sparse attention's positional softmax_scale (the sparse indexer takes none)."""
    return () if spec["op"] == "indexer" else (spec["scale"],)


def _call(fn, spec, x, b):
    if spec["op"] == "dense":
        fn(x["q"], x["k"], x["w"], sm_scale=spec["scale"], **_dense_kw(spec, x, b))
    elif spec["op"] == "dattn":
        fn(x["q"], x["k"], x["w"], spec["scale"], **_dense_kw(spec, x, b))
    else:
        fn(x["q"], x["k"], x["w"], x["topk_indices"], *_scale(spec), topk_length=x["topk_length"], topk_indices_global=spec["glob"], out=b["out"])
    return b


def _dense_kw(spec, x, b):
    cu = {n: x[n] for n in ("cu_seqlens_q", "cu_seqlens_k") if n in x}  # THD: the device offsets (both sides read them back)
    return dict(out=b["out"], denom_out=b["denom"], ratio=spec["ratio"], q_causal_offsets=x["q_causal_offsets"], **cu)


def _into(dsa, spec, x, b):
    name = FN[spec["op"]] + "_score_recompute"
    cu = dict(zip(("cu_seqlens_q", "cu_seqlens_k"), x["cu_host"])) if "cu_host" in x else {}  # THD: the host bounds, sync-free
    if "workspace" not in b:  # not a compared buffer (cudnn takes none); made once per b, which the warm _into calls share
        b["workspace"] = poisoned_workspace(getattr(dsa, name + "_workspace_bytes")(x["w"].shape, **cu))
    into, ws = getattr(dsa, name + "_into"), b["workspace"]
    if spec["op"] in DENSE:
        into(b["out"], b["denom"], x["q"], x["k"], x["w"], spec["scale"], spec["ratio"], q_causal_offsets=x["q_causal_offsets"], workspace=ws, **cu)
    else:
        into(b["out"], x["q"], x["k"], x["w"], x["topk_indices"], *_scale(spec), x["topk_length"], spec["glob"], workspace=ws)
    return b


def _index_key(kind, k):
    """cudnn's SM90 cache key -> (op, key) as in the index (fields the shipped keys fix added only when they differ;
    the attention's scale is the launcher's argument, not a key field; the dense indexer's the float32 in its cubin)."""
    if kind == "sm90dense":
        _dt, d, h, _tm, _tn, _st, _thr, _swap, is_index, scale, _len, _tiles, _sparse, _log, ratio, offsets = k
        if not is_index:
            return "dense_attention_sm90", {"heads": h, "dim": d, "ratio": ratio, "offsets": offsets}
        return "dense_indexer_sm90", {"heads": h, "ratio": ratio, "offsets": offsets, "scale": struct.unpack("<f", struct.pack("<f", scale))[0]}
    _dt, d, h, _tm, _tn, _st, _thr, _swap, topk, is_index, scale, length, _tiles, _sparse, log_probs, glob = k
    key = {"heads": h, "topk": topk, "length": length, "topk_global": glob}
    if not is_index:
        return "sparse_attention_sm90", dict(key, dim=d, **({"log_probs": log_probs} if log_probs else {}))
    key.update({n: v for n, v, want in (("dim", d, D), ("scale", scale, 1.0), ("log_probs", log_probs, False)) if v != want})
    return "sparse_indexer_sm90", key


SM90 = API + "._interface_sm90"  # its compile caches are attributes of its two functions, read at call time

PARITY = Parity(
    family="dsa_score_recompute", doc=__doc__, cases=cases, inputs=inputs, buffers=buffers, label=label, covers=("sm_90a",),
    outputs=lambda spec: {"out": JITTER, **({"denom": JITTER} if spec["op"] in DENSE else {})},
    jit=Jit(setup=lambda: importlib.import_module(API + ".api"), caches={"sm90": (SM90, "_sparse_score_recompute.compile_cache"), "sm90dense": (SM90, "_dense_score_recompute.compile_cache")},
            index_key=_index_key, call=lambda api, spec, x, b: _call(getattr(api, FN[spec["op"]] + "_score_recompute_wrapper"), spec, x, b)),
    aot=Aot(call=lambda dsa, spec, x, b: _call(getattr(dsa, FN[spec["op"]] + "_score_recompute"), spec, x, b), into=_into),
    quick="no prefill-sized case", bench=("b1-sq4096-topk2048-prefill", "attn-b1-sq4096-h64-d512-topk2048-prefill"),
)

if __name__ == "__main__":
    sys.exit(PARITY.main())
