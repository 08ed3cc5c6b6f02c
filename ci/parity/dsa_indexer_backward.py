#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA indexer backward op, in two processes on one GPU machine.

    python ci/parity/dsa_indexer_backward.py jit --dir D      # cudnn + cutlass importable: JIT path, writes D/jit.json
    python ci/parity/dsa_indexer_backward.py aot --dir D      # cutlass NOT importable: dsa_aot.dsa, writes D/aot.json
    python ci/parity/dsa_indexer_backward.py compare --dir D  # markdown table + D/parity.json; exit status 1 on any mismatch

``dsa_aot`` imports the ``dsa_aot`` package from the environment (the installed wheel, or
``PYTHONPATH=<repo root>`` for a source checkout with a build in ``dsa_aot/_generated``).

Both sides make the same public call, with the same arguments::

    indexer_backward(index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss,
                     sm_scale=0.75, loss_coeff=2.0, block_I=128, topk_indices_global=G,
                     d_index_q=.., d_weights=.., d_index_k=.., workspace=..)

JIT: ``cudnn.deepseek_sparse_attention.indexer_backward.indexer_backward_wrapper`` (on SM90 it runs
``indexer_backward_sm90``: zero fp32 dK, ScoreGradSm90, IndexerBackwardSm90, bf16 cast); AOT:
``dsa_aot.dsa.indexer_backward``. Default backend, non-deterministic (the only mode upstream's SM90 has).
sm_scale and loss_coeff are not 1 so that a swapped or dropped scalar shows.

Cases: B=1, H=64, D=128, S_k=4096, S_q in {4096, 8192} (``--quick``: 1024), topk in {512, 1024,
1536, 2048} with local ids; global ids (``topk_indices_global=True``) for every topk at the first S_q
and topk 512 at the second; an fp32 ``d_index_k`` case; a case with 5 % top-k padding (-1 ids).
``jit`` generates the inputs from fixed seeds (``tests/gpu/ref_indexer.make_inputs`` when present,
else an equivalent generator here), saves them under D/inputs with the case list (D/inputs/cases.json,
which ``dsa_aot`` follows; ``--quick`` and ``--only`` need only be given to ``jit``).

Every call gets NaN-poisoned outputs, a 0xFF-poisoned workspace and a fresh copy of ``attn_score``
(both ops overwrite ``attn_score`` with the score-grad signal, copied in before the call, outside the
timed region). Timing:

* first call: wall time of the first call of the case, synchronised (JIT: includes the compile when
  a compile key is new in the process, and cudnn's plan construction; AOT: includes the lazy cubin
  load when an entry is new in the process); ``*`` marks first calls that compiled/loaded nothing;
* warm: median host time per call over ``--calls`` calls; the device is synchronised only outside
  the timed calls, every 8 calls so that the launch queue never fills (these kernels run longer on
  the device than on the host). The warm calls reuse one ``attn_score`` buffer, which each call
  overwrites again: only host time is measured, so its values do not matter. ``torch.add`` on
  16-element tensors is timed the same way as a yardstick; device time per call (CUDA events) is
  reported too.

``compare`` checks, per case: ``d_index_q`` and ``attn_score`` after the call (the grad signal)
bitwise equal, no NaN; ``index_score`` untouched on both sides; ``d_weights`` and ``d_index_k``
(order-dependent in upstream's SM90 kernel: dW is merged across warpgroups with shared-memory
atomics, dK with fp32 reduce-adds, so the JIT does not reproduce itself) within the JIT's own jitter:
the JIT runs each case ``1 + --reruns`` times on the same inputs; bf16 outputs must be within
max(1, the JIT's own worst) bf16 ulps elementwise, fp32 ones within max(4 * jitter,
1e-6 * max|ref|) (bitwise when the JIT reruns were all bitwise equal); both
sides chose the same kernels (the AOT (op, key) lookups equal the JIT compile keys); the same
workspace size. Every cubin the JIT compiled (``indexer_backward_sm90._compile_cache`` and
``_score_grad_cute_cache``, taken from the host module's fatbin) must have the sha256 of the
shipped ``dsa_aot/_generated/index.json`` entry (family dsa_indexer_backward, ops gemm_sm90 /
score_grad_sm90, arch of the JIT device).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from parity_common import (  # noqa: E402
    SpiedAot,
    CompileKeys,
    aot_side,
    jit_cubins,
    keep_cubins,
    cubin_report,
    load_ref,
    print_summary,
    write_report,
    cli,
    verdict,
    bitwise,
    device_us,
    family_entries,
    first_call,
    jitter_verdict,
    load_json,
    md_table,
    meta,
    nan_like,
    poisoned_workspace,
    selected,
    sha_status,
    to_cuda,
    torch_add_us,
    torch_isnan,
    warm_us,
)
from parity_common import host_copy as _host  # noqa: E402
from parity_common import key_str as _key_str  # noqa: E402
from parity_common import same as _same  # noqa: E402

FAMILY = "dsa_indexer_backward"
B, H, D, S_K = 1, 64, 128, 4096
TOPKS = (512, 1024, 1536, 2048)
SM_SCALE, LOSS_COEFF, BLOCK_I = 0.75, 2.0, 128
SYNC_EVERY = 8
WS_ALIGN = 128
OUTPUTS = ("d_index_q", "d_weights", "d_index_k")
EXACT = ("d_index_q", "attn_score")  # must be bitwise equal (single writer, no atomics)
# order-dependent upstream too: SM90 merges dW across warpgroups with shared-memory atomics, dK with
# fp32 reduce-adds; held against the JIT's own run-to-run jitter
JITTERY = ("d_weights", "d_index_k")

# ------------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------------


def build_cases(quick=False):
    """[(name, spec)]; spec: shape, topk, glob, dk dtype, invalid_frac, seed and the inputs file tag."""
    cases = []
    sqs = (1024,) if quick else (4096, 8192)

    def add(s_q, topk, glob, dk="bf16", invalid_frac=0.0):
        tag = f"sq{s_q}-topk{topk}-{'global' if glob else 'local'}" + ("-pad" if invalid_frac else "")
        name = tag + f"-dk{dk}"
        seed = 5000 + zlib.crc32(tag.encode()) % 100000  # stable across runs and --only filters
        cases.append((name, dict(b=B, s_q=s_q, s_k=S_K, h=H, d=D, topk=topk, glob=glob, dk=dk, invalid_frac=invalid_frac, seed=seed, inputs=tag)))

    for i, s_q in enumerate(sqs):
        for topk in TOPKS:
            add(s_q, topk, False)
            if i == 0 and topk == 512:
                add(s_q, topk, False, dk="f32")  # fp32 d_index_k: no workspace, the output is the accumulator
            if i == 0 or topk == 512:
                add(s_q, topk, True)
        if i == 0:
            add(s_q, 512, False, invalid_frac=0.05)
    return cases


# ------------------------------------------------------------------------------------------------
# Inputs (torch only)
# ------------------------------------------------------------------------------------------------


def _own_inputs(b, s_q, s_k, h, d, topk, *, topk_indices_global=False, seed=0, invalid_frac=0.0):
    """Fallback generator (same contract as ref_indexer.make_inputs): bf16 q/k/w with O(1) logits,
    unique ids per row in [0, S_k) (+ b * S_k when global), -1 padding, fp32 softmax rows."""
    import torch

    gen = torch.Generator().manual_seed(int(seed))
    q = torch.randn(b, s_q, h, d, generator=gen) * d**-0.25
    k = torch.randn(b, s_k, d, generator=gen) * d**-0.25
    w = torch.randn(b, s_q, h, generator=gen) / math.sqrt(h)
    rows = b * s_q
    ids = torch.empty(rows, topk, dtype=torch.int64)
    step = max(1, (1 << 24) // s_k)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        chosen = torch.rand(r1 - r0, s_k, generator=gen).topk(topk, dim=-1).indices
        ids[r0:r1] = chosen.gather(-1, torch.rand(r1 - r0, topk, generator=gen).argsort(dim=-1))
    ids = ids.view(b, s_q, topk)
    valid = torch.rand(b, s_q, topk, generator=gen) >= invalid_frac
    if topk_indices_global:
        ids = ids + (torch.arange(b) * s_k).view(b, 1, 1)
    ids = torch.where(valid, ids, torch.full_like(ids, -1))

    def softmax(t):
        return torch.nan_to_num(torch.softmax(torch.where(valid, t, torch.full_like(t, -math.inf)), dim=-1), nan=0.0)

    return dict(
        index_q=q.bfloat16(),
        weights=w.bfloat16(),
        index_k=k.bfloat16(),
        attn_score=softmax(torch.randn(b, s_q, topk, generator=gen) * 2.0).contiguous(),
        index_score=softmax(torch.randn(b, s_q, topk, generator=gen) * 1.5).contiguous(),
        topk_indices=ids.int().contiguous(),
        grad_loss=0.5 + torch.rand(1, generator=gen),
    )


def make_inputs(spec):
    """CPU inputs of one case; (dict, generator name)."""
    ref = load_ref("ref_indexer.py")
    args = (spec["b"], spec["s_q"], spec["s_k"], spec["h"], spec["d"], spec["topk"])
    kw = dict(topk_indices_global=spec["glob"], seed=spec["seed"], invalid_frac=spec["invalid_frac"])
    if ref is not None:
        return ref.make_inputs(*args, device="cpu", **kw), "tests/gpu/ref_indexer.make_inputs"
    return _own_inputs(*args, **kw), "ci/parity/dsa_indexer_backward._own_inputs"


# ------------------------------------------------------------------------------------------------
# One case, either side
# ------------------------------------------------------------------------------------------------


def run_case(name, spec, x, api, args, out_dir):
    """First call, reruns, warm timing of one case through ``api``; saves outputs, returns the row."""
    import torch

    b, s_k, d = spec["b"], spec["s_k"], spec["d"]
    dk_dtype = torch.float32 if spec["dk"] == "f32" else torch.bfloat16
    attn0 = x["attn_score"]  # pristine target distribution: every call gets a copy
    index_score0 = x["index_score"].clone()
    ws_bytes = api.workspace_bytes(spec, dk_dtype)

    def fresh():
        outs = dict(
            d_index_q=nan_like(x["index_q"]),
            d_weights=nan_like(x["weights"]),
            d_index_k=torch.full((b, s_k, d), float("nan"), dtype=dk_dtype, device="cuda"),
        )
        ws = poisoned_workspace(ws_bytes) if ws_bytes else None
        return outs, ws, attn0.clone()

    row = {"case": name, "spec": spec, "ws_bytes": ws_bytes}
    saved = {}
    outs, ws, attn = fresh()
    api.begin_first(spec)
    row["first_s"] = first_call(lambda: api.call(x, attn, outs, ws, spec))
    row.update(api.end_first(spec))  # keys (op, key) used, new (compiled / loaded inside the call), key_error
    for n in OUTPUTS:
        saved[n] = _host(outs[n])
    saved["attn_score"] = _host(attn)
    row["index_score_untouched"] = _same(x["index_score"], index_score0)

    # reruns on the same inputs: run-to-run jitter of the dK reduce-adds (and dQ/dW/grad reproducibility)
    rerun_same = {n: True for n in ("d_index_q", "d_weights", "attn_score")}
    for r in range(api.reruns(args)):
        o2, w2, a2 = fresh()
        api.call(x, a2, o2, w2, spec)
        torch.cuda.synchronize()
        for n in JITTERY:
            saved[f"{n}.run{r + 2}"] = _host(o2[n])
        for n in ("d_index_q", "d_weights"):
            rerun_same[n] &= _same(o2[n], outs[n])
        rerun_same["attn_score"] &= _same(a2, attn)
        del o2, w2, a2
    row["reruns"] = api.reruns(args)
    row["rerun_bitwise"] = rerun_same

    # warm: one attn_score buffer, overwritten by every call (host time only)
    row["warm_us"] = warm_us(lambda: api.call(x, attn, outs, ws, spec), args.calls, sync_every=SYNC_EVERY)
    if hasattr(api, "call_into"):
        row["warm_into_us"] = warm_us(lambda: api.call_into(x, attn, outs, ws, spec), args.calls, sync_every=SYNC_EVERY)
    row["device_us"] = device_us(lambda: api.call(x, attn, outs, ws, spec))
    torch.save(saved, os.path.join(out_dir, f"{name}.pt"))
    return row


def _op_kwargs(x, attn, outs, ws, spec):
    """The arguments both sides pass: cudnn's indexer_backward_wrapper signature."""
    return dict(
        index_q=x["index_q"], weights=x["weights"], index_k=x["index_k"], attn_score=attn, index_score=x["index_score"],
        topk_indices=x["topk_indices"], grad_loss=x["grad_loss"], sm_scale=SM_SCALE, loss_coeff=LOSS_COEFF, block_I=BLOCK_I,
        topk_indices_global=spec["glob"], d_index_q=outs["d_index_q"], d_weights=outs["d_weights"], d_index_k=outs["d_index_k"],
        workspace=ws,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# JIT side (cudnn + cutlass)
# ------------------------------------------------------------------------------------------------


class JitApi(CompileKeys):
    def __init__(self):
        from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_sm90 as k90
        from cudnn.deepseek_sparse_attention.indexer_backward import indexer_backward_wrapper

        self.k90, self.wrapper = k90, indexer_backward_wrapper
        self._before = None

    def reruns(self, args):
        return args.reruns

    def _snapshot(self):
        return {("gemm", k) for k in self.k90._compile_cache} | {("score_grad", k) for k in self.k90._score_grad_cute_cache}

    @staticmethod
    def jit_keys(spec):
        """The compile keys upstream's SM90 path uses for a case (probability-domain scores)."""
        return [("score_grad", (spec["topk"], False)), ("gemm", (spec["h"], spec["d"], spec["topk"], BLOCK_I, False, bool(spec["glob"])))]

    @staticmethod
    def index_key(kind, jit_key):
        """cudnn's cache key -> (op, key dict) as in dsa_aot/_generated/index.json.

        Fields the shipped keys fix (D 128, block_I 128, probability-domain scores) are added only
        when they differ, so that such a kernel can match no entry.
        """
        if kind == "gemm":
            heads, dim, topk, block_i, is_log, glob = jit_key
            key = {"heads": heads, "topk": topk, "topk_global": bool(glob)}
            key.update({k: v for k, v, want in (("dim", dim, D), ("block_I", block_i, BLOCK_I), ("score_input_is_log", bool(is_log), False)) if v != want})
            return "gemm_sm90", key
        if kind == "score_grad":
            topk, is_log = jit_key
            key = {"topk": topk}
            if is_log:
                key["index_is_log"] = True
            return "score_grad_sm90", key
        raise ValueError(f"unknown cudnn cache {kind!r}")

    def workspace_bytes(self, spec, dk_dtype):
        import torch

        from cudnn.api_base import ws_align

        return 0 if dk_dtype == torch.float32 else ws_align(spec["b"] * spec["s_k"] * spec["d"] * 4)

    def call(self, x, attn, outs, ws, spec):
        self.wrapper(**_op_kwargs(x, attn, outs, ws, spec))

    def cubins(self):
        return jit_cubins((("gemm", self.k90._compile_cache), ("score_grad", self.k90._score_grad_cute_cache)), self.index_key)


def cmd_jit(args):
    keep_cubins()
    import torch

    t0 = time.perf_counter()
    api = JitApi()  # imports cutlass and the cudnn kernel modules
    import_s = time.perf_counter() - t0
    in_dir, out_dir = os.path.join(args.dir, "inputs"), os.path.join(args.dir, "jit")
    os.makedirs(in_dir, exist_ok=True)
    os.makedirs(out_dir, exist_ok=True)
    cases = [(n, s) for n, s in build_cases(args.quick) if selected(args, n)]
    with open(os.path.join(in_dir, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)
    rows, made, generator = {}, set(), None
    for name, spec in cases:
        path = os.path.join(in_dir, f"{spec['inputs']}.pt")
        if spec["inputs"] not in made:
            t = time.perf_counter()
            x, generator = make_inputs(spec)
            torch.save(x, path)
            made.add(spec["inputs"])
            print(f"inputs {spec['inputs']}: {time.perf_counter() - t:.1f} s ({generator})", flush=True)
        else:
            x = torch.load(path)
        rows[name] = run_case(name, spec, to_cuda(x), api, args, out_dir)
        del x
        r = rows[name]
        print(f"jit {name}: first {r['first_s']:.3f} s{'' if r['new'] else ' (nothing compiled)'}, warm {r['warm_us']:.1f} us, device {r['device_us']:.1f} us"
              + (f"  KEY ERROR: {r['key_error']}" if r.get("key_error") else ""), flush=True)
    cap = torch.cuda.get_device_capability()
    m = meta(torch)
    m.update(import_s=import_s, arch=f"sm_{cap[0]}{cap[1]}a", torch_add_us=torch_add_us(args.calls), inputs=generator, calls=args.calls,
             reruns=args.reruns, sm_scale=SM_SCALE, loss_coeff=LOSS_COEFF)
    with open(os.path.join(args.dir, "jit.json"), "w") as f:
        json.dump({"meta": m, "rows": rows, "cubins": api.cubins()}, f, indent=1)
    print(f"wrote {os.path.join(args.dir, 'jit.json')}")


# ------------------------------------------------------------------------------------------------
# AOT side (no cutlass, no cudnn)
# ------------------------------------------------------------------------------------------------


class AotApi(SpiedAot):
    OP_MODULE = "dsa_aot.ops.dsa_indexer_backward"

    def reruns(self, args):
        return 1  # the AOT jitter is reported, not used

    def workspace_bytes(self, spec, dk_dtype):
        return self.dsa.indexer_backward_workspace_bytes(spec["b"], spec["s_k"], spec["d"], d_index_k_dtype=dk_dtype)

    def call(self, x, attn, outs, ws, spec):
        self.dsa.indexer_backward(**_op_kwargs(x, attn, outs, ws, spec))

    def call_into(self, x, attn, outs, ws, spec):
        self.dsa.indexer_backward_into(outs["d_index_q"], outs["d_weights"], outs["d_index_k"], x["index_q"], x["weights"], x["index_k"], attn,
                                       x["index_score"], x["topk_indices"], x["grad_loss"], SM_SCALE, LOSS_COEFF, BLOCK_I, spec["glob"],
                                       workspace=ws)


def cmd_aot(args):
    aot_side(args, "ci/parity/dsa_indexer_backward.py", FAMILY, AotApi, run_case,
             lambda r: f"warm {r['warm_us']:.1f} us (into {r['warm_into_us']:.1f} us), device {r['device_us']:.1f} us",
             inputs_of=lambda name, spec: spec["inputs"])


# ------------------------------------------------------------------------------------------------
# Compare
# ------------------------------------------------------------------------------------------------


def cmd_compare(args):
    import torch

    jit = load_json(os.path.join(args.dir, "jit.json"), "ci/parity/dsa_indexer_backward.py", "jit", args.dir)
    aot = load_json(os.path.join(args.dir, "aot.json"), "ci/parity/dsa_indexer_backward.py", "aot", args.dir)
    if jit is None or aot is None:
        return 1
    arch = jit["meta"].get("arch", "sm_90a")
    entries = family_entries(aot.get("index"), FAMILY, arch)
    failures, lines, report = [], [], []
    header = ("case", "dK", "dQ / grad bitwise", "dW / dK vs JIT (max diff, JIT jitter)", "kernels", "sha256", "JIT 1st s", "AOT 1st ms",
              "JIT warm us", "AOT warm us", "device us JIT/AOT")

    for name, jr in jit["rows"].items():
        spec = jr["spec"]
        ar = aot["rows"].get(name)
        rep = {"case": name, "spec": spec, "jit": {k: jr.get(k) for k in ("first_s", "warm_us", "device_us", "new", "keys")}}
        report.append(rep)
        if ar is None:
            failures.append(f"{name}: not run on the aot side")
            lines.append((name, spec["dk"], "not run", "", "", "", f"{jr['first_s']:.3f}", "", f"{jr['warm_us']:.1f}", "", ""))
            continue
        rep["aot"] = {k: ar.get(k) for k in ("first_s", "warm_us", "warm_into_us", "device_us", "new", "keys", "loaded")}
        jo = torch.load(os.path.join(args.dir, "jit", f"{name}.pt"))
        ao = torch.load(os.path.join(args.dir, "aot", f"{name}.pt"))
        ok_row = True

        verdicts = []
        for n in EXACT:
            eq, cnt = bitwise(jo[n], ao[n])
            nans = int(torch_isnan(ao[n]))
            good = eq and nans == 0
            verdicts.append("yes" if good else f"NO({cnt} diff, {nans} NaN)")
            rep[n] = {"bitwise": eq, "differing": cnt, "aot_nan": nans, "jit_rerun_bitwise": jr["rerun_bitwise"].get(n)}
            if not good:
                ok_row = False
                note = "" if jr["rerun_bitwise"].get(n, True) else " (the JIT itself is not run-to-run reproducible here)"
                failures.append(f"{name}: {n} not bitwise equal ({cnt} elements differ, {nans} NaN on the aot side){note}")
        jit_texts = []
        for n in JITTERY:
            ok_n, text_n, nums_n = jitter_verdict(jo, ao, n)
            rep[n] = dict(nums_n, ok=ok_n)
            jit_texts.append(text_n)
            if not ok_n:
                ok_row = False
                failures.append(f"{name}: {n} {text_n}; limit {nums_n.get('limit', float('nan')):.3g}{nums_n['unit']}")
        dk_text = " / ".join(jit_texts)
        for side, r in (("jit", jr), ("aot", ar)):
            if not r.get("index_score_untouched", False):
                ok_row = False
                failures.append(f"{name}: index_score modified on the {side} side")
        if jr.get("key_error"):
            ok_row = False
            failures.append(f"{name}: {jr['key_error']}")
        if jr["ws_bytes"] != ar["ws_bytes"]:
            ok_row = False
            failures.append(f"{name}: workspace bytes JIT {jr['ws_bytes']} != AOT {ar['ws_bytes']}")
        same_kernels = sorted(map(_key_str, jr["keys"])) == sorted(map(_key_str, ar["keys"]))
        if not same_kernels:
            ok_row = False
            failures.append(f"{name}: kernels differ: JIT compile keys {jr['keys']}, AOT looked up {ar['keys']}")
        sha = sha_status(jr["keys"], jit["cubins"], entries)
        if sha != "yes":
            ok_row = False
            failures.append(f"{name}: cubin sha256 {sha} for {jr['keys']}")
        rep.update(kernels_same=same_kernels, sha256=sha, ok=ok_row)
        lines.append((
            name, spec["dk"], " / ".join(verdicts), dk_text, "same" if same_kernels else "NO", sha,
            f"{jr['first_s']:.3f}{'' if jr.get('new') else '*'}", f"{1e3 * ar['first_s']:.2f}{'' if ar.get('new') else '*'}",
            f"{jr['warm_us']:.1f}", f"{ar['warm_us']:.1f}", f"{jr['device_us']:.0f} / {ar['device_us']:.0f}",
        ))  # fmt: skip
    for name in aot["rows"]:
        if name not in jit["rows"]:
            failures.append(f"{name}: run on the aot side only")

    # every cubin the JIT compiled, against the shipped one
    cubins, cubin_fails = cubin_report(jit.get("cubins", []), entries)
    failures += cubin_fails

    print(md_table(header, lines))
    print("\n(* = the first call compiled (JIT) / loaded (AOT) nothing new: its key was already used by an earlier case)")
    jm, am = jit["meta"], aot["meta"]
    print(f"device: {jm.get('device')} ({jm.get('sm_count')} SMs), arch {arch}; torch {jm.get('torch')}; inputs {jm.get('inputs')}; "
          f"sm_scale {jm.get('sm_scale')}, loss_coeff {jm.get('loss_coeff')}")
    print_summary(jm, am, cubins, jit["rows"], aot["rows"])
    write_report(args.dir, failures, arch, report, cubins, jm, am)
    return verdict(failures, f"{len(lines)} cases: dQ and grad signal bitwise equal, dW and dK within the JIT's own jitter, same kernels, every cubin sha256 equal")


def main(argv=None):
    return cli(__doc__, cmd_jit, cmd_aot, cmd_compare, argv, extra=(
        ("--reruns", dict(type=int, default=2, help="jit: extra runs per case to measure the d_index_k jitter")),
        ("--quick", dict(action="store_true", help="jit: S_q 1024 only")),
    ))


if __name__ == "__main__":
    sys.exit(main())
