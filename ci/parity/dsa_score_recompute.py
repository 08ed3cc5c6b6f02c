#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA sparse score recompute (sparse_indexer_ and sparse_attn_score_recompute_wrapper), in two processes on one GPU machine.

    python ci/parity/dsa_score_recompute.py jit --dir D      # cudnn + cutlass importable: JIT path, writes D/jit.json
    python ci/parity/dsa_score_recompute.py aot --dir D      # cutlass NOT importable: dsa_aot.dsa, writes D/aot.json
    python ci/parity/dsa_score_recompute.py compare --dir D  # markdown table + D/parity.json; exit status 1 on any mismatch

Both sides make the same public call with the same arguments::

    sparse_indexer_score_recompute(q_indexer, k_indexer, weights, topk_indices, topk_length=, topk_indices_global=, out=)
    sparse_attn_score_recompute(q_attn, k_attn, lse, topk_indices, softmax_scale, topk_length=, topk_indices_global=, out=)

JIT: ``cudnn.deepseek_sparse_attention.score_recompute.sparse_*_score_recompute_wrapper`` (on the H200 the
SM90 path: the weights / LSE copied transposed, ``SparseScoreRecomputeSm90``); AOT: ``dsa_aot.dsa.sparse_*_score_recompute``
and ``_into``. Indexer cases: H 64, top-k 512 / 1024 / 2048, local and global ids with 5 % empty (-1)
slots, with ``topk_length`` (the slots past it -1), a prefill-sized case. Attention cases: H64 / H96 /
H128, D512 / D576, each at its own softmax_scale (SM90 compiles one scale per cubin key upstream: each
new scale is a new JIT compile there, a new plan here), the LSE a log-sum-exp of the scaled scores.

Every call gets an NaN-poisoned ``out``. ``compare``: the output (``predict`` / ``target``, saved as
``out``) bitwise equal (against the JIT's own run-to-run jitter, which is none when it reproduces
itself), call and ``_into``; no NaN; the inputs untouched; the same kernel (the AOT lookup equals
upstream's compile key); the JIT's cubin has the shipped sha256.
"""

from __future__ import annotations

import importlib
import os
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from parity_common import (  # noqa: E402
    CompileKeys,
    SpiedAot,
    aot_side,
    call_checks,
    cli,
    device_us,
    finish,
    first_call,
    into_verdict,
    jit_cubins,
    jit_side,
    jitter_verdict,
    load_sides,
    timing_cells,
    torch_isnan,
    unrun,
    warm_us,
)
from parity_common import host_copy as _host  # noqa: E402
from parity_common import same as _same  # noqa: E402

FAMILY = "dsa_score_recompute"
SCRIPT = "ci/parity/dsa_score_recompute.py"
H, D = 64, 128  # the indexer's
THD = ([0, 100, 100, 228], [0, 64, 80, 181])  # cu_seqlens_q / _k: 100 queries over 64 keys, none over 16, 128 over 101
SYNC_EVERY = 16


def build_cases(quick=False):
    cases = []

    def add(name, **spec):
        spec.setdefault("length", False)
        spec.setdefault("glob", False)
        spec.setdefault("op", "indexer")
        spec.setdefault("h", H)
        spec.setdefault("d", D)
        spec["seed"] = 8000 + zlib.crc32(name.encode()) % 100000
        cases.append((name, spec))

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
    # SM90 THD: upstream's per-segment loop (cu_seqlens read back); ours from host bounds in _into. Every
    # segment with queries has keys: upstream leaves the denominators of a no-key segment unwritten
    add("dense-thd-r4-offsets", op="dense", h=64, ratio=4, offsets=True, scale=1.0, b=3, s_q=0, s_k=0, topk=0, thd=THD)
    add("dattn-thd-h64-d512-r4", op="dattn", h=64, d=512, ratio=4, offsets=False, scale=512**-0.5, b=3, s_q=0, s_k=0, topk=0, thd=THD)
    if not quick:
        add("b1-sq4096-topk2048-prefill", b=1, s_q=4096, s_k=4096, topk=2048)
        add("attn-b1-sq4096-h64-d512-topk2048-prefill", op="attention", h=64, d=512, scale=512**-0.5, b=1, s_q=4096, s_k=4096, topk=2048)
    return cases


def label(spec):
    thd = " THD" if spec.get("thd") else ""
    if spec["op"] == "dattn":
        return f"dense attention{thd} H{spec['h']} D{spec['d']} ratio {spec['ratio']}{' offsets' if spec['offsets'] else ''} scale {spec['scale']:.4g}"
    if spec["op"] == "dense":
        return f"dense indexer{thd} H{spec['h']} ratio {spec['ratio']}{' offsets' if spec['offsets'] else ''} scale {spec['scale']:.4g}"
    what = f"attention H{spec['h']} D{spec['d']} scale {spec['scale']:.4g}" if spec["op"] == "attention" else "indexer"
    return f"{what} top-k {spec['topk']}{' length' if spec['length'] else ''}{' global' if spec['glob'] else ' local'}"


def make_inputs(spec):
    """CPU inputs: bf16 q, k with O(1) scores, w (bf16) or the LSE (fp32: the log-sum-exp of the scaled
    scores over each row's first S_k / 4 keys, so the target is O(1)); per row distinct ids in [0, S_k)
    (+ b * S_k when global), 5 % of the slots -1; with lengths, every slot at or past the row's length -1
    (upstream's contract)."""
    import torch

    gen = torch.Generator().manual_seed(int(spec["seed"]))
    if spec["op"] in ("dense", "dattn"):  # full KV: q, k (B, S_k, 1, D), w (the indexer's) or the LSE; q causal offsets
        b, s_q, s_k, h, d = spec["b"], spec["s_q"], spec["s_k"], spec["h"], spec["d"]
        thd = spec.get("thd")
        lead, k_lead = ((thd[0][-1],), (thd[1][-1],)) if thd else ((b, s_q), (b, s_k))  # THD: packed rows
        sd = 1.0 if spec["op"] == "dattn" else 0.25
        q = (torch.randn(*lead, h, d, generator=gen) * sd).bfloat16()
        k = (torch.randn(*k_lead, 1, d, generator=gen) * sd).bfloat16()
        if spec["op"] == "dattn":  # each head's log-sum-exp over all keys (THD: of its segment): O(1) probabilities
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
        if thd:  # device offsets for the allocating forms (both read them back); host ones for the _into form
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


def run_case(name, spec, x, api, args, out_dir):
    import torch

    pristine = {k: v.clone() for k, v in x.items() if isinstance(v, torch.Tensor)}
    if spec.get("thd"):  # packed rows over the longest segment's keys
        cu_k = spec["thd"][1]
        shapes = {"out": (x["q"].shape[0], max(b - a for a, b in zip(cu_k, cu_k[1:]))), "denom": (x["q"].shape[0],)}
    else:
        shapes = ({"out": tuple(x["q"].shape[:2]) + (x["k"].shape[1],), "denom": tuple(x["q"].shape[:2])} if spec["op"] in ("dense", "dattn")
                  else {"out": tuple(x["topk_indices"].shape)})

    def fresh():
        return {n: torch.full(sh, float("nan"), device="cuda") for n, sh in shapes.items()}

    def host(outs, prefix="", suffix=""):
        for n, t in outs.items():
            saved[f"{prefix}{n}{suffix}"] = _host(t)

    row = {"case": name, "label": label(spec), "spec": spec}
    saved = {}
    out = fresh()
    api.begin_first(spec)
    row["first_s"] = first_call(lambda: api.call(spec, x, out))
    row.update(api.end_first(spec))
    host(out)
    for r in range(api.reruns(args)):
        o2 = fresh()
        api.call(spec, x, o2)
        torch.cuda.synchronize()
        host(o2, suffix=f".run{r + 2}")
    row["reruns"] = api.reruns(args)
    if hasattr(api, "call_into"):
        o3 = fresh()
        api.call_into(spec, x, o3)
        torch.cuda.synchronize()
        host(o3, prefix="into.")
    row["inputs_untouched"] = all(_same(x[k], v) for k, v in pristine.items())
    row["warm_us"] = warm_us(lambda: api.call(spec, x, out), args.calls, sync_every=SYNC_EVERY)
    if hasattr(api, "call_into"):
        row["warm_into_us"] = warm_us(lambda: api.call_into(spec, x, out), args.calls, sync_every=SYNC_EVERY)
    row["device_us"] = device_us(lambda: api.call(spec, x, out))
    torch.save(saved, os.path.join(out_dir, f"{name}.pt"))
    return row


def failed_row(name, spec, exc, side):
    import traceback

    traceback.print_exc()
    print(f"{side} {name}: FAILED: {exc!r}", flush=True)
    return {"case": name, "label": label(spec), "spec": spec, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}


def _describe(r):
    return f"warm {r['warm_us']:.1f} us" + (f" (into {r['warm_into_us']:.1f} us)" if "warm_into_us" in r else "") + f", device {r['device_us']:.1f} us"


# ------------------------------------------------------------------------------------------------
# JIT side (cudnn + cutlass)
# ------------------------------------------------------------------------------------------------


class JitApi(CompileKeys):
    def __init__(self):
        self.api = importlib.import_module("cudnn.deepseek_sparse_attention.score_recompute.api")
        self.h = importlib.import_module("cudnn.deepseek_sparse_attention.score_recompute._interface_sm90")
        self._before = None

    def reruns(self, args):
        return args.reruns

    def _snapshot(self):
        return {("sm90", k) for k in self.h._sparse_score_recompute.compile_cache} | {("sm90dense", k) for k in self.h._dense_score_recompute.compile_cache}

    @staticmethod
    def jit_keys(spec):
        import cutlass

        if spec["op"] in ("dense", "dattn"):
            h, index = spec["h"], spec["op"] == "dense"
            return [("sm90dense", (cutlass.BFloat16, spec["d"], h, min(h, 64), 64, 2, 384, True, index, spec["scale"], False, h // min(h, 64), False,
                                   False, spec["ratio"], spec["offsets"]))]
        if spec["op"] == "attention":
            h = spec["h"]
            tile_m, tiles = (48, 2) if h == 96 else (min(h, 64), h // min(h, 64))
            return [("sm90", (cutlass.BFloat16, spec["d"], h, tile_m, 64, 2, 256, True, spec["topk"], False, spec["scale"], spec["length"], tiles, True,
                              False, spec["glob"]))]
        return [("sm90", (cutlass.BFloat16, D, H, 64, 64, 2, 256, True, spec["topk"], True, 1.0, spec["length"], 1, True, False, spec["glob"]))]

    @staticmethod
    def index_key(kind, k):
        """cudnn's SM90 cache key -> (op, key) as in the index (fields the shipped keys fix added only when they differ;
        the attention's scale is the launcher's argument, not a key field)."""
        if kind == "sm90dense":
            import struct

            _dt, d, h, _tm, _tn, _st, _thr, _swap, is_index, scale, _len, _tiles, _sparse, _log, ratio, offsets = k
            if not is_index:
                return "dense_attention_sm90", {"heads": h, "dim": d, "ratio": ratio, "offsets": offsets}
            return "dense_indexer_sm90", {"heads": h, "ratio": ratio, "offsets": offsets, "scale": struct.unpack("<f", struct.pack("<f", scale))[0]}
        _dt, d, h, _tm, _tn, _st, _thr, _swap, topk, is_index, scale, length, _tiles, _sparse, log_probs, glob = k
        key = {"heads": h, "topk": topk, "length": length, "topk_global": glob}
        if not is_index:
            key["dim"] = d
            key.update({"log_probs": log_probs} if log_probs else {})
            return "sparse_attention_sm90", key
        key.update({n: v for n, v, want in (("dim", d, D), ("scale", scale, 1.0), ("log_probs", log_probs, False)) if v != want})
        return "sparse_indexer_sm90", key

    def call(self, spec, x, outs):
        out = outs["out"]
        cu = {n: x[n] for n in ("cu_seqlens_q", "cu_seqlens_k") if n in x}
        if spec["op"] == "dattn":
            self.api.dense_attn_score_recompute_wrapper(x["q"], x["k"], x["w"], spec["scale"], out=out, denom_out=outs["denom"], ratio=spec["ratio"],
                                                        q_causal_offsets=x["q_causal_offsets"], **cu)
            return
        if spec["op"] == "dense":
            self.api.dense_indexer_score_recompute_wrapper(x["q"], x["k"], x["w"], out=out, denom_out=outs["denom"], sm_scale=spec["scale"],
                                                           ratio=spec["ratio"], q_causal_offsets=x["q_causal_offsets"], **cu)
            return
        if spec["op"] == "attention":
            self.api.sparse_attn_score_recompute_wrapper(x["q"], x["k"], x["w"], x["topk_indices"], spec["scale"], topk_length=x["topk_length"],
                                                         topk_indices_global=spec["glob"], out=out)
            return
        self.api.sparse_indexer_score_recompute_wrapper(x["q"], x["k"], x["w"], x["topk_indices"], topk_length=x["topk_length"],
                                                        topk_indices_global=spec["glob"], out=out)

    def cubins(self):
        return jit_cubins((("sm90", self.h._sparse_score_recompute.compile_cache), ("sm90dense", self.h._dense_score_recompute.compile_cache)),
                          self.index_key)


def cmd_jit(args):
    jit_side(args, JitApi, build_cases, make_inputs, run_case, _describe, failed_row)


# ------------------------------------------------------------------------------------------------
# AOT side (no cutlass, no cudnn)
# ------------------------------------------------------------------------------------------------


class AotApi(SpiedAot):
    OP_MODULE = "dsa_aot.ops.dsa_score_recompute"

    def __init__(self, dsa, runtime):
        super().__init__(dsa, runtime)
        self._ws = {}  # workspace bytes -> a 0xFF-filled buffer the _into calls share

    def reruns(self, args):
        return 1  # the AOT jitter is reported, not used

    CACHES = ("_CALLS", "_ATTN_CALLS", "_DENSE_CALLS", "_DATTN_CALLS")

    def call(self, spec, x, outs):
        out = outs["out"]
        cu = {n: x[n] for n in ("cu_seqlens_q", "cu_seqlens_k") if n in x}
        if spec["op"] == "dattn":
            self.dsa.dense_attn_score_recompute(x["q"], x["k"], x["w"], spec["scale"], out=out, denom_out=outs["denom"], ratio=spec["ratio"],
                                                q_causal_offsets=x["q_causal_offsets"], **cu)
            return
        if spec["op"] == "dense":
            self.dsa.dense_indexer_score_recompute(x["q"], x["k"], x["w"], out=out, denom_out=outs["denom"], sm_scale=spec["scale"], ratio=spec["ratio"],
                                                   q_causal_offsets=x["q_causal_offsets"], **cu)
            return
        if spec["op"] == "attention":
            self.dsa.sparse_attn_score_recompute(x["q"], x["k"], x["w"], x["topk_indices"], spec["scale"], topk_length=x["topk_length"],
                                                 topk_indices_global=spec["glob"], out=out)
            return
        self.dsa.sparse_indexer_score_recompute(x["q"], x["k"], x["w"], x["topk_indices"], topk_length=x["topk_length"],
                                                topk_indices_global=spec["glob"], out=out)

    def call_into(self, spec, x, outs):
        import torch

        out = outs["out"]
        att = spec["op"] in ("attention", "dattn")  # an fp32 LSE
        cu = dict(zip(("cu_seqlens_q", "cu_seqlens_k"), x["cu_host"])) if "cu_host" in x else {}  # THD: the host bounds, sync-free
        if spec["op"] in ("dense", "dattn"):
            n = (self.dsa.dense_attn_score_recompute_workspace_bytes if att else self.dsa.dense_indexer_score_recompute_workspace_bytes)(x["w"].shape,
                                                                                                                                      None, **cu)
        else:
            n = (self.dsa.sparse_attn_score_recompute_workspace_bytes if att else self.dsa.sparse_indexer_score_recompute_workspace_bytes)(x["w"].shape)
        ws = self._ws.get(n)
        if ws is None:
            ws = self._ws[n] = torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda") if n else None
        if spec["op"] == "dattn":
            self.dsa.dense_attn_score_recompute_into(out, outs["denom"], x["q"], x["k"], x["w"], spec["scale"], spec["ratio"],
                                                     q_causal_offsets=x["q_causal_offsets"], workspace=ws, **cu)
            return
        if spec["op"] == "dense":
            self.dsa.dense_indexer_score_recompute_into(out, outs["denom"], x["q"], x["k"], x["w"], spec["scale"], spec["ratio"],
                                                        q_causal_offsets=x["q_causal_offsets"], workspace=ws, **cu)
            return
        if att:
            self.dsa.sparse_attn_score_recompute_into(out, x["q"], x["k"], x["w"], x["topk_indices"], spec["scale"], x["topk_length"], spec["glob"],
                                                      workspace=ws)
            return
        self.dsa.sparse_indexer_score_recompute_into(out, x["q"], x["k"], x["w"], x["topk_indices"], x["topk_length"], spec["glob"], workspace=ws)


def cmd_aot(args):
    aot_side(args, SCRIPT, FAMILY, AotApi, run_case, _describe, failed_row)


# ------------------------------------------------------------------------------------------------
# Compare
# ------------------------------------------------------------------------------------------------


def cmd_compare(args):
    import torch

    sides = load_sides(args, SCRIPT, FAMILY)
    if sides is None:
        return 1
    jit, aot, _, entries = sides
    failures, lines, report = [], [], []
    header = ("case", "kernel", "output vs JIT (call)", "_into", "kernels", "sha256", "JIT 1st s", "AOT 1st ms", "JIT warm us", "AOT warm us (into)",
              "device us JIT/AOT")
    for name, jr in jit["rows"].items():
        spec = jr["spec"]
        ar = aot["rows"].get(name)
        rep = {"case": name, "spec": spec, "jit": {k: jr.get(k) for k in ("first_s", "warm_us", "device_us", "new", "keys")}}
        report.append(rep)
        why = unrun(name, jr, ar, failures)
        if why:
            lines.append((name, jr["label"], "; ".join(w.split(":")[0] for w in why)) + ("",) * 8)
            continue
        rep["aot"] = {k: ar.get(k) for k in ("first_s", "warm_us", "warm_into_us", "device_us", "new", "keys", "loaded")}
        jo = torch.load(os.path.join(args.dir, "jit", f"{name}.pt"))
        ao = torch.load(os.path.join(args.dir, "aot", f"{name}.pt"))
        ok_row, same_kernels, sha = call_checks(name, jr, ar, jit, entries, failures)
        ok_p, text_p, nums_p = jitter_verdict(jo, ao, "out")
        ok_i, text_i, _ = into_verdict(jo, ao, "out")
        checks = [(ok_p, "output", text_p), (ok_i, "_into output", text_i)]
        if "denom" in jo:  # the dense op's second output, its LSE
            ok_d, text_d, _ = jitter_verdict(jo, ao, "denom")
            ok_di, text_di, _ = into_verdict(jo, ao, "denom")
            checks += [(ok_d, "denom", text_d), (ok_di, "_into denom", text_di)]
            ok_i = ok_i and ok_di
            text_p = f"{text_p}; denom {text_d}"
        for ok, what, text in checks:
            if not ok:
                ok_row = False
                failures.append(f"{name}: {what} {text}")
        if int(torch_isnan(ao["out"])):
            ok_row = False
            failures.append(f"{name}: NaN left in the AOT output (an element never written)")
        rep.update(out=dict(nums_p, ok=ok_p), into_ok=ok_i, kernels_same=same_kernels, sha256=sha, ok=ok_row)
        lines.append((name, jr["label"], text_p, "yes" if ok_i else "NO", "same" if same_kernels else "NO", sha, *timing_cells(jr, ar)))
    return finish(args, sides, failures, header, lines, report,
                  f"{len(lines)} cases: predict / target equal JIT vs AOT (bitwise where the JIT reproduces itself), same kernels, every cubin sha256 equal")


def main(argv=None):
    return cli(__doc__, cmd_jit, cmd_aot, cmd_compare, argv, extra=(
        ("--reruns", dict(type=int, default=2, help="jit: extra runs per case to measure the JIT's own jitter")),
        ("--quick", dict(action="store_true", help="jit: no prefill-sized case")),
    ))


if __name__ == "__main__":
    sys.exit(main())
