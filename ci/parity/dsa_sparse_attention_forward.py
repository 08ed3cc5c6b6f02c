#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA sparse attention forward (sparse_attention_forward_wrapper), in two processes
on one SM100 GPU machine (upstream has no SM90 kernel: on any other GPU each step says so and exits 2).

    python ci/parity/dsa_sparse_attention_forward.py jit --dir D      # cudnn + cutlass importable: writes D/jit.json
    python ci/parity/dsa_sparse_attention_forward.py aot --dir D      # cutlass NOT importable: dsa_aot.dsa, writes D/aot.json
    python ci/parity/dsa_sparse_attention_forward.py compare --dir D  # markdown table + D/parity.json; exit 1 on any mismatch

Both sides call ``sparse_attention_forward(q, kv, topk_idxs, attn_sink=, topk_length=, softmax_scale=,
indexer_topk=)`` -> {out, max_logits, lse, lse_indexer}; AOT also ``sparse_attention_forward_into`` on
NaN-filled outputs with the index rows padded to 64 slots. Cases: H64 D512 / D576 and H128 D512, bf16
and fp16, each indexer_topk class, sink and topk_length, a top-k width that is not a multiple of 64
(upstream's -1 padding), ids of -1 and out of range. ``compare``: every AOT output bitwise equal to
the JIT's, both within the fp64 reference (tests/gpu/ref_sparse_attention.py, on the GPU), the same
kernel, the JIT cubin with the shipped sha256.

Not yet run: the team's machines have no SM100 GPU (the shipped cubins are fidelity-identical to
cudnn's and the op's calls are checked against their lifted host functions, ci/check_sm100_calls.py).
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from parity_common import (  # noqa: E402
    SpiedAot,
    jit_side,
    aot_side,
    bitwise,
    cli,
    cubin_report,
    device_us,
    family_entries,
    first_call,
    jit_cubins,
    load_json,
    md_table,
    print_summary,
    sha_status,
    verdict,
    warm_us,
    write_report,
)
from parity_common import host_copy as _host  # noqa: E402
from parity_common import key_str as _key_str  # noqa: E402
from parity_common import same as _same  # noqa: E402

FAMILY = "dsa_sparse_attention_forward"
SCRIPT = "ci/parity/dsa_sparse_attention_forward.py"
OUTS = ("out", "max_logits", "lse", "lse_indexer")
BOUND = {"out": 1e-2, "max_logits": 1e-5, "lse": 1e-5, "lse_indexer": 1e-5}  # out: P rounded to the input dtype before P.V


def build_cases(quick=False):
    cases = []

    def add(name, **spec):
        spec.update({k: v for k, v in dict(h=64, d=512, dt="bf16", it=2048, sink=False, tl=False, s_q=256, s_kv=8192, k=2048).items()
                     if k not in spec})
        spec["seed"] = 5000 + zlib.crc32(name.encode()) % 100000
        cases.append((name, spec))

    add("h64-d512-it2048")
    add("h64-d512-it2048-sink-tl", sink=True, tl=True)
    add("h64-d512-it0-k100", it=0, k=100)
    add("h64-d576-it512-sink", d=576, it=512, sink=True, k=600)
    add("h64-d512-fp16-it1024", dt="fp16", it=1024, k=1024)
    add("h128-d512-it512", h=128, it=512, k=1000)
    add("h128-d512-it0-sink-tl", h=128, it=0, sink=True, tl=True, k=512)
    if not quick:
        add("h64-d512-it2048-prefill", s_q=4096, s_kv=65536)
    return cases


def label(spec):
    return f"H{spec['h']} D{spec['d']} {spec['dt']} it{spec['it']}" + (" sink" if spec["sink"] else "") + (" tl" if spec["tl"] else "")


def _ref():
    path = os.path.join(ROOT, "tests", "gpu")
    if path not in sys.path:
        sys.path.insert(0, path)
    import ref_sparse_attention

    return ref_sparse_attention


def make_inputs(spec):
    import torch

    ref = _ref()
    x = ref.make_inputs(spec["s_q"], spec["s_kv"], spec["h"], spec["d"], spec["k"], with_topk_length=spec["tl"], seed=spec["seed"], invalid_frac=0.1)
    dt = torch.float16 if spec["dt"] == "fp16" else torch.bfloat16
    idx = x["topk_idxs"].clone()
    idx[0, :3] = torch.tensor([spec["s_kv"], spec["s_kv"] + 7, -5], dtype=torch.int32)  # out of range / negative: skipped
    return dict(q=x["q"].to(dt), kv=x["kv"].to(dt), topk_idxs=idx, attn_sink=x["attn_sink"] if spec["sink"] else None,
                topk_length=x["topk_length"] if spec["tl"] else None)


def _call(fn, spec, x):
    r = fn(x["q"], x["kv"], x["topk_idxs"], attn_sink=x["attn_sink"], topk_length=x["topk_length"], softmax_scale=0.04, indexer_topk=spec["it"])
    return {n: r[n] for n in OUTS if r[n] is not None}


def _require_sm100(step):
    import torch

    major = torch.cuda.get_device_capability()[0]
    if major != 10:
        print(f"{step}: this GPU is sm_{major}x; cudnn's sparse attention forward exists for SM100 only. Nothing run.")
        sys.exit(2)


def run_case(name, spec, x, api, args, out_dir):
    import torch

    pristine = {k: v.clone() for k, v in x.items() if isinstance(v, torch.Tensor)}
    row = {"case": name, "label": label(spec), "spec": spec}
    saved, res = {}, {}
    api.begin_first(spec)
    row["first_s"] = first_call(lambda: res.update(api.call(spec, x)))
    row.update(api.end_first(spec))
    saved.update({f"first.{n}": _host(t) for n, t in res.items()})
    if hasattr(api, "call_into"):
        outs = {n: torch.full_like(t, float("nan")) for n, t in res.items()}
        api.call_into(spec, x, outs)
        torch.cuda.synchronize()
        saved.update({f"into.{n}": _host(t) for n, t in outs.items()})
        row["warm_into_us"] = warm_us(lambda: api.call_into(spec, x, outs), args.calls, sync_every=16)
    res.clear()
    row["inputs_untouched"] = all(_same(x[k], v) for k, v in pristine.items())
    row["warm_us"] = warm_us(lambda: api.call(spec, x), args.calls, sync_every=16)
    row["device_us"] = device_us(lambda: api.call(spec, x))
    torch.save(saved, os.path.join(out_dir, f"{name}.pt"))
    return row


def failed_row(name, spec, exc, side):
    import traceback

    traceback.print_exc()
    return {"case": name, "label": label(spec), "spec": spec, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}


class JitApi:
    def __init__(self):
        self.api = importlib.import_module("cudnn.deepseek_sparse_attention.sparse_attention_forward.api")
        self.iface = importlib.import_module("cudnn.deepseek_sparse_attention.sparse_attention_forward._interface_sm100")

    @staticmethod
    def index_key(kind, k):
        import torch

        _dev, _cap, _variant, h, d, qdt, _kvdt, _idt, sink, tl, it = k
        return "fwd", {"heads": h, "dim": d, "dtype": "f16" if qdt == torch.float16 else "bf16", "indexer_topk": it, "sink": sink, "topk_length": tl}

    def begin_first(self, spec):
        self._before = set(self.iface._compile_cache)

    def end_first(self, spec):
        new = [k for k in self.iface._compile_cache if k not in self._before]
        keys = [list(self.index_key("fwd", k)) for k in (new or list(self.iface._compile_cache)[-1:])]
        return {"keys": keys, "new": bool(new)}

    def call(self, spec, x):
        return _call(self.api.sparse_attention_forward_wrapper, spec, x)

    def cubins(self):
        return jit_cubins((("fwd", self.iface._compile_cache),), self.index_key)


def cmd_jit(args):
    _require_sm100("jit")
    jit_side(args, JitApi, build_cases, make_inputs, run_case, lambda r: f"warm {r['warm_us']:.1f} us, device {r['device_us']:.1f} us", failed_row)


class AotApi(SpiedAot):
    OP_MODULE = "dsa_aot.ops.dsa_sparse_attention_forward"

    def call(self, spec, x):
        return _call(self.dsa.sparse_attention_forward, spec, x)

    def call_into(self, spec, x, outs):
        import torch

        from dsa_aot.policy.dsa_sparse_attention_forward import padded_topk

        idx = x["topk_idxs"]
        kp = padded_topk(idx.shape[1])
        if kp != idx.shape[1]:
            idx = torch.cat([idx, torch.full((idx.shape[0], kp - idx.shape[1]), -1, dtype=idx.dtype, device=idx.device)], 1)
        self.dsa.sparse_attention_forward_into(outs["out"], outs["max_logits"], outs["lse"], outs.get("lse_indexer"), x["q"], x["kv"], idx,
                                               attn_sink=x["attn_sink"], topk_length=x["topk_length"], softmax_scale=0.04, indexer_topk=spec["it"])


def cmd_aot(args):
    _require_sm100("aot")
    aot_side(args, SCRIPT, FAMILY, AotApi, run_case, lambda r: f"warm {r['warm_us']:.1f} us (into {r['warm_into_us']:.1f} us)", failed_row)


def cmd_compare(args):
    import torch

    jit = load_json(os.path.join(args.dir, "jit.json"), SCRIPT, "jit", args.dir)
    aot = load_json(os.path.join(args.dir, "aot.json"), SCRIPT, "aot", args.dir)
    if jit is None or aot is None:
        return 1
    arch = jit["meta"].get("arch", "sm_100a")
    entries = family_entries(aot.get("index"), FAMILY, arch)
    ref = _ref()
    failures, lines, report = [], [], []
    for name, jr in jit["rows"].items():
        spec, ar = jr["spec"], aot["rows"].get(name)
        report.append({"case": name, "spec": spec})
        if ar is None or "error" in ar or "error" in jr:
            failures.append(f"{name}: {jr.get('error') or (ar or {}).get('error') or 'not run on the aot side'}")
            continue
        jo = torch.load(os.path.join(args.dir, "jit", f"{name}.pt"))
        ao = torch.load(os.path.join(args.dir, "aot", f"{name}.pt"))
        x = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in torch.load(os.path.join(args.dir, "inputs", f"{name}.pt")).items()}
        want = ref.sparse_attention_forward_ref(x["q"], x["kv"], x["attn_sink"], x["topk_idxs"], 0.04, x["topk_length"], indexer_topk=spec["it"])
        ok = True
        for n in [o for o in OUTS if f"first.{o}" in jo]:
            for form in ("first", "into"):
                eq, cnt = bitwise(jo[f"first.{n}"], ao[f"{form}.{n}"])
                if not eq:
                    ok = False
                    failures.append(f"{name}: AOT {form}.{n} not bitwise equal to JIT ({cnt} elements)")
            for side, saved in (("jit", jo), ("aot", ao)):
                g, w = saved[f"first.{n}"].cuda().double(), want[n]
                fin = torch.isfinite(w)
                same_inf = torch.equal(torch.isinf(g), torch.isinf(w)) and torch.equal(g[torch.isinf(w)], w[torch.isinf(w)])
                err = ref.rel_err(g[fin], w[fin]) if fin.any() else 0.0
                if not (same_inf and err < BOUND[n]):
                    ok = False
                    failures.append(f"{name}: {side} {n} off the reference (rel err {err:.3g}, infinities equal {same_inf})")
        if not ar.get("inputs_untouched") or not jr.get("inputs_untouched"):
            ok = False
            failures.append(f"{name}: inputs modified")
        same_k = sorted(map(_key_str, jr["keys"])) == sorted(map(_key_str, ar["keys"]))
        sha = sha_status(jr["keys"], jit["cubins"], entries)
        if not same_k or sha != "yes":
            ok = False
            failures.append(f"{name}: kernels {jr['keys']} vs {ar['keys']}, sha256 {sha}")
        lines.append((name, jr["label"], "yes" if ok else "NO", sha, f"{jr['first_s']:.3f}", f"{1e3 * ar['first_s']:.2f}", f"{jr['warm_us']:.1f}",
                      f"{ar['warm_us']:.1f} ({ar.get('warm_into_us', math.nan):.1f})", f"{jr['device_us']:.1f} / {ar['device_us']:.1f}"))
    cubins, cubin_fails = cubin_report(jit.get("cubins", []), entries)
    failures += cubin_fails
    print(md_table(("case", "kernel", "ok", "sha256", "JIT 1st s", "AOT 1st ms", "JIT warm us", "AOT warm us (into)", "device us JIT/AOT"), lines))
    print_summary(jit["meta"], aot["meta"], cubins, jit["rows"], aot["rows"], into_label="_into")
    write_report(args.dir, failures, arch, report, cubins, jit["meta"], aot["meta"])
    return verdict(failures, f"{len(lines)} cases: every output bitwise equal JIT vs AOT and within the reference, same kernels, cubin sha256 equal")


def main(argv=None):
    return cli(__doc__, cmd_jit, cmd_aot, cmd_compare, argv, extra=(("--quick", dict(action="store_true", help="jit: no prefill-sized case")),))


if __name__ == "__main__":
    sys.exit(main())
