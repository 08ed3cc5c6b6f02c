#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA sparse attention backward op, in two processes on one GPU machine.

    python ci/parity/dsa_sparse_attention_backward.py jit --dir D      # cudnn + cutlass importable: JIT path, writes D/jit.json
    python ci/parity/dsa_sparse_attention_backward.py aot --dir D      # cutlass NOT importable: dsa_aot.dsa, writes D/aot.json
    python ci/parity/dsa_sparse_attention_backward.py compare --dir D  # markdown table + D/parity.json; exit status 1 on any mismatch

``dsa_aot`` imports the ``dsa_aot`` package from the environment (the installed wheel, or
``PYTHONPATH=<repo root>`` for a source checkout with a build in ``dsa_aot/_generated``).

Both sides make the same public call, with the same arguments::

    sparse_attention_backward(q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=S,
                              topk_length=L, dq=.., dkv=.., workspace=..)  -> {dq, dkv, d_sink}

JIT: ``cudnn.deepseek_sparse_attention.sparse_attention_backward.sparse_attention_backward_wrapper`` (on
SM90 it runs ``_interface_sm90.flash_attn_bwd_sm90``: zero the fp32 dKV accumulator and d_sink,
preprocess (sum O*dO, LSE*log2e, d_sink), main, postprocess (fp32 dKV -> bf16)); AOT:
``dsa_aot.dsa.sparse_attention_backward``. Default block_tile, non-deterministic (the only mode upstream's
SM90 has), default stream, attention sink always given.

Cases (bf16): the seed repro S_q = S_kv = 2048, H64, D512, topk 512; S_q 1024, S_kv 4096, H in {64, 128}
x D in {512, 576} x topk in {512, 1024, 2048}, with and without ``topk_length`` at topk 512 (16 main
kernels); one case with 5 % padded (-1) ids and ``topk_length`` at S_kv 3072 with an explicit
softmax_scale (the others pass None: the op's default 1/sqrt(D)). Every case has its own shapes, so
no per-signature cache of either side can hide a lookup. ``--quick``: the seed repro, H64 D512 topk 512
with and without ``topk_length``, H128 D576 topk 2048, the padded case.
``jit`` generates the inputs from fixed seeds (``tests/gpu/ref_sparse_attention.make_inputs`` when
present: out / lse from an fp64 forward over the selected keys; else an equivalent generator here with
an fp32 forward), saves them under D/inputs with the case list (D/inputs/cases.json, which ``dsa_aot``
follows; ``--quick`` and ``--only`` need only be given to ``jit``).

Every call gets NaN-poisoned ``dq`` / ``dkv`` and a 0xFF-poisoned workspace (sized by each side's own
workspace function); ``d_sink`` is allocated by the op on both sides (not an argument). Timing:

* first call: wall time of the first call of the case, synchronised (JIT: includes the compile when
  a compile key is new in the process, and cudnn's plan construction; AOT: includes the lazy cubin
  load when an entry is new in the process); ``*`` marks first calls that compiled/loaded nothing;
* warm: median host time per call over ``--calls`` calls; the device is synchronised only outside
  the timed calls, every 8 calls so that the launch queue never fills (these kernels run longer on
  the device than on the host). ``torch.add`` on 16-element tensors is timed the same way as a
  yardstick; device time per call (CUDA events) is reported too.

``compare`` checks, per case: ``dq`` bitwise equal, no NaN (SM90's main kernel writes each dQ tile
once, with TMA stores from one CTA: no atomics); ``dkv`` and ``d_sink`` (order-dependent upstream too:
dKV is scattered with fp32 float4 atomics into the accumulator, d_sink with one fp32 atomic per warp)
within the JIT's own jitter: the JIT runs each case ``1 + --reruns`` times on the same inputs; bf16
``dkv`` elementwise |aot - jit| <= 1 bf16 ulp + 2 * the JIT's max |self-difference|, fp32 ``d_sink``
max |diff| <= max(4 * jitter, 1e-6 * max|ref|); bitwise where the JIT reruns were all bitwise equal.
Also: no input modified on either side; both return the ``dq`` / ``dkv`` tensors they were given
(or both not); the same workspace size, and the same workspace function over a grid of shapes (odd
S_q / S_kv included); both sides ran the same kernels (the AOT entries launched in the first call,
in launch order, equal the JIT compile keys pre, main, post). Every cubin the JIT compiled
(``flash_attn_bwd_sm90.compile_cache_pre`` / ``compile_cache`` / ``compile_cache_post``, taken from the
host module's fatbin) must have the sha256 of the shipped ``dsa_aot/_generated/index.json`` entry (family
dsa_sparse_attention_backward, ops pre_sm90 / main_sm90 / post_sm90, arch of the JIT device).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import sys
import time
import traceback
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from parity_common import (  # noqa: E402
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
    host_copy,
    install_blocker,
    jitter_verdict,
    key_str,
    load_json,
    md_table,
    meta,
    nan_like,
    poisoned_workspace,
    runtime_stats,
    same,
    selected,
    sha_status,
    shipped_index,
    to_cuda,
    torch_add_us,
    torch_isnan,
    warm_us,
)

SCRIPT = "ci/parity/dsa_sparse_attention_backward.py"
FAMILY = "dsa_sparse_attention_backward"
SEED = dict(s_q=2048, s_kv=2048, h=64, d=512, topk=512)  # the seed repro
GRID_SQ, GRID_SKV = 1024, 4096
HEADS, DIMS, TOPKS = (64, 128), (512, 576), (512, 1024, 2048)
TL_TOPKS = (512,)  # topk widths run with and without topk_length
PAD = dict(s_q=1024, s_kv=3072, h=128, d=576, topk=512, tl=True, invalid_frac=0.05, scale=0.05)
SYNC_EVERY = 8
INPUTS = ("q", "kv", "out", "dout", "lse", "attn_sink", "topk_idxs", "topk_length")
EXACT = ("dq",)  # single writer (TMA store of one CTA's tile): must be bitwise equal
JITTERY = ("dkv", "d_sink")  # fp32 atomics upstream too: held against the JIT's run-to-run jitter

# SM90 launch constants of _interface_sm90.flash_attn_bwd_sm90 (also kernels/dsa_sparse_attention_backward.py);
# a JIT key that differs from them gets the differing fields added to its index key, so it matches no entry
HEAD_DIM_V = 512
TILE_M, TILE_N, THREADS = 64, 64, 256
MAIN_FIXED = (("tile_m", TILE_M), ("tile_n", TILE_N), ("threads", THREADS), ("KV_stage", 1), ("PdS_stage", 1), ("SdP_swapAB", False),
              ("dKV_swapAB", False), ("dQ_swapAB", False))  # fmt: skip

# workspace function of both sides over these shapes (odd extents included: S_q and S_kv are rounded up to 64)
WS_GRID = [(s_q, s_kv, d, h) for s_q in (1, 63, 64, 65, 1000, 2048, 4097) for s_kv in (1, 100, 2048, 3000, 65537) for d in DIMS for h in HEADS]


def post_chunk(dim):
    """hdim_chunk of upstream's SM90 postprocess (also its thread count)."""
    return 64 if dim == 576 else min(128, dim)


def head_dim_v(dim):
    return 512 if dim == 576 else dim


# ------------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------------


def case(s_q, s_kv, h, d, topk, tl=False, invalid_frac=0.0, scale=None, label=""):
    """(name, spec): the name is also the inputs file tag; seed stable across runs and --only filters."""
    tag = (f"{label}sq{s_q}-skv{s_kv}-h{h}-d{d}-topk{topk}" + ("-len" if tl else "") + ("-pad" if invalid_frac else "")
           + (f"-scale{scale:g}" if scale is not None else ""))  # fmt: skip
    seed = 7000 + zlib.crc32(tag.encode()) % 100000
    return tag, dict(s_q=s_q, s_kv=s_kv, h=h, d=d, topk=topk, tl=bool(tl), invalid_frac=invalid_frac, scale=scale, seed=seed, inputs=tag)


def build_cases(quick=False):
    """[(name, spec)], every case with its own shapes (S_q, S_kv, H, D, topk, topk_length present)."""
    cases = [case(**SEED, label="seed-")]
    if quick:
        grid = [(64, 512, 512, False), (64, 512, 512, True), (128, 576, 2048, False)]
    else:
        grid = [(h, d, topk, tl) for h in HEADS for d in DIMS for topk in TOPKS for tl in ((False, True) if topk in TL_TOPKS else (False,))]
    cases += [case(GRID_SQ, GRID_SKV, h, d, topk, tl) for h, d, topk, tl in grid]
    cases.append(case(**PAD))
    sigs = [(s["s_q"], s["s_kv"], s["h"], s["d"], s["topk"], s["tl"]) for _, s in cases]
    assert len(set(sigs)) == len(sigs), "two cases share shapes: a per-signature cache could hide a kernel lookup"
    return cases


# ------------------------------------------------------------------------------------------------
# Inputs (torch only)
# ------------------------------------------------------------------------------------------------


def _own_inputs(s_q, s_kv, h, d, topk, *, with_topk_length=False, device="cpu", seed=0, invalid_frac=0.0, softmax_scale=None):
    """Fallback generator (same contract as ref_sparse_attention.make_inputs): bf16 q (S_q, H, D) with
    O(1) logits, kv (S_kv, D), dout (S_q, H, Dv); topk distinct ids per row in [0, S_kv), -1 padding;
    topk_length uniform in [0, topk]; attn_sink log(topk) + 1.5 N(0, 1); out (bf16) and the KV-only
    lse (fp32, +inf in empty rows) from an fp32 forward over the selected keys with the sink."""
    import torch

    dv = head_dim_v(d)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    gen = torch.Generator().manual_seed(int(seed))
    q = (torch.randn(s_q, h, d, generator=gen) / (scale * math.sqrt(d))).bfloat16()
    kv = torch.randn(s_kv, d, generator=gen).bfloat16()
    ids = torch.empty(s_q, topk, dtype=torch.int64)
    step = max(1, (1 << 24) // max(1, s_kv))
    for r0 in range(0, s_q, step):
        r1 = min(s_q, r0 + step)
        chosen = torch.rand(r1 - r0, s_kv, generator=gen).topk(topk, dim=-1).indices
        ids[r0:r1] = chosen.gather(-1, torch.rand(r1 - r0, topk, generator=gen).argsort(dim=-1))
    ids = torch.where(torch.rand(s_q, topk, generator=gen) >= invalid_frac, ids, torch.full_like(ids, -1)).int()
    length = torch.randint(0, topk + 1, (s_q,), generator=gen).int() if with_topk_length else None
    sink = math.log(max(1, topk)) + 1.5 * torch.randn(h, generator=gen)
    dout = torch.randn(s_q, h, dv, generator=gen).bfloat16()

    q, kv, ids, sink, dout = (t.to(device) for t in (q, kv, ids, sink, dout))
    length = None if length is None else length.to(device)
    valid = ids >= 0
    if length is not None:
        valid &= torch.arange(topk, device=device)[None, :] < length[:, None].long()
    rows = torch.where(valid, ids, torch.zeros_like(ids)).long()
    out = torch.zeros(s_q, h, dv, device=device)
    lse = torch.empty(s_q, h, device=device)
    kvf, qf = kv.float(), q.float()
    step = max(1, (1 << 24) // (topk * max(h, d)))
    for r0 in range(0, s_q, step):
        r1 = min(s_q, r0 + step)
        vm = valid[r0:r1][:, None, :]
        kg = kvf[rows[r0:r1]]  # (R, T, D)
        s = (scale * torch.einsum("rhd,rtd->rht", qf[r0:r1], kg)).masked_fill(~vm, -math.inf)
        l_kv = torch.logsumexp(s, dim=-1)
        l_kv = torch.where(~valid[r0:r1].any(dim=-1, keepdim=True), torch.full_like(l_kv, math.inf), l_kv)
        l_tot = torch.logaddexp(l_kv, sink[None, :])
        p = torch.where(vm, torch.exp(s - l_tot[..., None]), torch.zeros_like(s))
        out[r0:r1] = torch.einsum("rht,rtc->rhc", p, kg[..., :dv])
        lse[r0:r1] = l_kv
    return dict(q=q, kv=kv, out=out.bfloat16(), dout=dout, lse=lse.contiguous(), attn_sink=sink.float().contiguous(), topk_idxs=ids.contiguous(),
                topk_length=length, softmax_scale=softmax_scale)  # fmt: skip


def make_inputs(spec, device="cpu"):
    """CPU inputs of one case (out / lse computed on ``device``); (dict, generator name)."""
    import torch

    ref = load_ref("ref_sparse_attention.py")
    args = (spec["s_q"], spec["s_kv"], spec["h"], spec["d"], spec["topk"])
    kw = dict(with_topk_length=spec["tl"], device=device, seed=spec["seed"], invalid_frac=spec["invalid_frac"])
    if ref is not None:
        if "softmax_scale" in inspect.signature(ref.make_inputs).parameters:
            kw["softmax_scale"] = spec["scale"]
        x, gen = ref.make_inputs(*args, **kw), "tests/gpu/ref_sparse_attention.make_inputs"
    else:
        x, gen = _own_inputs(*args, softmax_scale=spec["scale"], **kw), "ci/parity/dsa_sparse_attention_backward._own_inputs"
    x = {k: (v.to("cpu").contiguous() if isinstance(v, torch.Tensor) else v) for k, v in x.items()}
    x.setdefault("topk_length", None)
    x["softmax_scale"] = spec["scale"]  # what both sides pass (None: the op's default 1/sqrt(D))
    return x, gen


# ------------------------------------------------------------------------------------------------
# One case, either side
# ------------------------------------------------------------------------------------------------


def _op_kwargs(x, outs, ws):
    """The arguments both sides pass: cudnn's sparse_attention_backward_wrapper signature."""
    return dict(
        q=x["q"], kv=x["kv"], out=x["out"], dout=x["dout"], lse=x["lse"], attn_sink=x["attn_sink"], topk_idxs=x["topk_idxs"],
        softmax_scale=x["softmax_scale"], topk_length=x["topk_length"], dq=outs["dq"], dkv=outs["dkv"], workspace=ws,
    )  # fmt: skip


def run_case(name, spec, x, api, args, out_dir):
    """First call, reruns, warm timing of one case through ``api``; saves outputs, returns the row."""
    import torch

    ws_bytes = api.workspace_bytes(spec)
    pristine = {k: x[k].clone() for k in INPUTS if isinstance(x.get(k), torch.Tensor)}

    def fresh():
        outs = dict(dq=nan_like(x["q"]), dkv=nan_like(x["kv"]))
        return outs, (poisoned_workspace(ws_bytes) if ws_bytes else None)

    row = {"case": name, "spec": spec, "ws_bytes": ws_bytes}
    saved = {}
    outs, ws = fresh()
    res = {}
    api.begin_first(spec)
    try:
        row["first_s"] = first_call(lambda: res.update(out=api.call(x, outs, ws)))
    finally:
        row.update(api.end_first(spec))  # keys (op, key) used, new (compiled / loaded inside the call), key_error
    got = res["out"]
    row["returns_given"] = {n: got[n].data_ptr() == outs[n].data_ptr() for n in ("dq", "dkv")}
    for n in ("dq", "dkv", "d_sink"):
        saved[n] = host_copy(got[n])
    row["inputs_modified"] = [k for k, t in pristine.items() if not same(x[k], t)]
    del pristine

    # reruns on the same inputs: run-to-run jitter of the dKV / d_sink atomics (and dQ reproducibility)
    rerun_same = {n: True for n in ("dq", "dkv", "d_sink")}
    for r in range(api.reruns(args)):
        o2, w2 = fresh()
        g2 = api.call(x, o2, w2)
        torch.cuda.synchronize()
        for n in JITTERY:
            saved[f"{n}.run{r + 2}"] = host_copy(g2[n])
        for n in rerun_same:
            rerun_same[n] &= same(g2[n], got[n])
        del o2, w2, g2
    row["reruns"] = api.reruns(args)
    row["rerun_bitwise"] = rerun_same

    def call():
        api.call(x, outs, ws)

    row["warm_us"] = warm_us(call, args.calls, sync_every=SYNC_EVERY)
    if getattr(api, "call_into", None):
        d_sink = torch.empty_like(x["attn_sink"])
        row["warm_into_us"] = warm_us(lambda: api.call_into(x, outs, d_sink, ws), args.calls, sync_every=SYNC_EVERY)
    row["device_us"] = device_us(call)
    torch.save(saved, os.path.join(out_dir, f"{name}.pt"))
    return row


def run_cases(side, cases, load, api, args, out_dir):
    """Every case through ``run_case``; a case that raises is recorded (``error``) and the next one runs."""
    rows = {}
    for name, spec in cases:
        try:
            rows[name] = r = run_case(name, spec, load(spec), api, args, out_dir)
        except Exception as exc:  # noqa: BLE001 - recorded; compare fails the case
            traceback.print_exc()
            rows[name] = {"case": name, "spec": spec, "error": f"{type(exc).__name__}: {exc}"[:4000]}
            print(f"{side} {name}: ERROR {rows[name]['error'][:300]}", flush=True)
            continue
        first = f"{r['first_s']:.3f} s" if side == "jit" else f"{1e3 * r['first_s']:.2f} ms"
        into = f" (into {r['warm_into_us']:.1f} us)" if "warm_into_us" in r else ""
        print(f"{side} {name}: first {first}{'' if r['new'] else ' (nothing new)'}, warm {r['warm_us']:.1f} us{into}, device {r['device_us']:.1f} us"
              + (f"  KEY ERROR: {r['key_error']}" if r.get("key_error") else ""), flush=True)
    return rows


# ------------------------------------------------------------------------------------------------
# JIT side (cudnn + cutlass)
# ------------------------------------------------------------------------------------------------


def _dtype_name(dt):
    name = getattr(dt, "__name__", str(dt))
    return {"BFloat16": "bf16", "Float16": "f16"}.get(name, name)


def _extras(key, pairs):
    """Add the fields whose value differs from the shipped constant (then the key matches no entry)."""
    key.update({k: v for k, v, want in pairs if v != want})
    return key


def index_key(kind, jit_key):
    """cudnn's SM90 cache key -> (op, key dict) as in dsa_aot/_generated/index.json."""
    if kind == "pre":
        dt, dv, tile_m, threads = jit_key
        return "pre_sm90", _extras({"dtype": _dtype_name(dt)}, (("head_dim_v", dv, HEAD_DIM_V), ("tile_m", tile_m, TILE_M), ("threads", threads, THREADS)))
    if kind == "main":
        dt, dim, dv, heads, *fixed, tl, topk = jit_key
        key = {"dtype": _dtype_name(dt), "heads": heads, "dim": dim, "topk": topk, "topk_length": bool(tl)}
        return "main_sm90", _extras(key, [("head_dim_v", dv, head_dim_v(dim))] + [(k, v, want) for (k, want), v in zip(MAIN_FIXED, fixed)])
    if kind == "post":
        dt, chunk, tile_n, dim, threads, n_chunks = jit_key
        want = post_chunk(dim)
        return "post_sm90", _extras({"dtype": _dtype_name(dt), "dim": dim}, (("hdim_chunk", chunk, want), ("tile_n", tile_n, TILE_N),
                                                                             ("threads", threads, want), ("N_hdim_chunks", n_chunks, dim // want)))
    raise ValueError(f"unknown cudnn cache {kind!r}")


class JitApi:
    def __init__(self):
        import cutlass
        from cudnn.deepseek_sparse_attention.sparse_attention_backward import _interface_sm90 as i90
        from cudnn.deepseek_sparse_attention.sparse_attention_backward import sparse_attention_backward_wrapper

        self.cutlass, self.i90, self.wrapper = cutlass, i90, sparse_attention_backward_wrapper
        self._before = None

    def reruns(self, args):
        return args.reruns

    def caches(self):
        f = self.i90.flash_attn_bwd_sm90
        return (("pre", f.compile_cache_pre), ("main", f.compile_cache), ("post", f.compile_cache_post))

    def _snapshot(self):
        return {(kind, k) for kind, table in self.caches() for k in table}

    def jit_keys(self, spec):
        """The compile keys upstream's SM90 path uses for a case, in launch order (pre, main, post)."""
        dt, d = self.cutlass.BFloat16, spec["d"]
        dv, chunk = head_dim_v(d), post_chunk(d)
        return [
            ("pre", (dt, dv, TILE_M, THREADS)),
            ("main", (dt, d, dv, spec["h"], TILE_M, TILE_N, THREADS, 1, 1, False, False, False, bool(spec["tl"]), spec["topk"])),
            ("post", (dt, chunk, TILE_N, d, chunk, d // chunk)),
        ]

    def workspace_bytes(self, spec):
        return self.workspace_fn(spec["s_q"], spec["s_kv"], spec["d"], spec["h"])

    def workspace_fn(self, s_q, s_kv, d, h):
        return int(self.i90.flash_attn_bwd_sm90_workspace_size(s_q, s_kv, d, h))

    def begin_first(self, spec):
        self._before = self._snapshot()

    def end_first(self, spec):
        want = self.jit_keys(spec)
        after = self._snapshot()
        res = {"keys": [list(index_key(*k)) for k in want], "new": any(k not in self._before for k in want)}
        missing = [k for k in want if k not in after]
        unexpected = sorted(repr(k) for k in after - self._before if k not in want)
        if missing or unexpected:
            res["key_error"] = f"predicted compile keys not in cudnn's caches: {missing}; compiled besides: {unexpected}"
        return res

    def call(self, x, outs, ws):
        return self.wrapper(**_op_kwargs(x, outs, ws))

    def cubins(self):
        return jit_cubins(self.caches(), index_key)


def cmd_jit(args):
    keep_cubins()
    import torch

    t_start = t0 = time.perf_counter()
    api = JitApi()  # imports cutlass and the cudnn kernel modules
    import_s = time.perf_counter() - t0
    in_dir, out_dir = os.path.join(args.dir, "inputs"), os.path.join(args.dir, "jit")
    os.makedirs(in_dir, exist_ok=True)
    os.makedirs(out_dir, exist_ok=True)
    cases = [(n, s) for n, s in build_cases(args.quick) if selected(args, n)]
    with open(os.path.join(in_dir, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)
    generator = []

    def load(spec):
        t = time.perf_counter()
        x, gen = make_inputs(spec, device="cuda")
        torch.save(x, os.path.join(in_dir, f"{spec['inputs']}.pt"))
        generator.append(gen)
        print(f"inputs {spec['inputs']}: {time.perf_counter() - t:.1f} s ({gen})", flush=True)
        return to_cuda(x)

    rows = run_cases("jit", cases, load, api, args, out_dir)
    cap = torch.cuda.get_device_capability()
    m = meta(torch)
    m.update(import_s=import_s, arch=f"sm_{cap[0]}{cap[1]}a", torch_add_us=torch_add_us(args.calls), inputs=generator[0] if generator else None,
             calls=args.calls, reruns=args.reruns, workspace_grid=[[list(a), api.workspace_fn(*a)] for a in WS_GRID])  # fmt: skip
    with open(os.path.join(args.dir, "jit.json"), "w") as f:
        json.dump({"meta": m, "rows": rows, "cubins": api.cubins()}, f, indent=1)
    print(f"wrote {os.path.join(args.dir, 'jit.json')} ({time.perf_counter() - t_start:.0f} s in all)")


# ------------------------------------------------------------------------------------------------
# AOT side (no cutlass, no cudnn)
# ------------------------------------------------------------------------------------------------

WS_NAMES = ("sparse_attention_backward_workspace_bytes", "sparse_attention_backward_workspace_size")


class AotApi:
    def __init__(self, dsa, runtime):
        from dsa_aot.runtime import index, loaded

        self.dsa, self.runtime, self.index, self.loaded = dsa, runtime, index, loaded
        self.op = dsa.sparse_attention_backward
        self.ws_fn = next((getattr(dsa, n) for n in WS_NAMES if hasattr(dsa, n)), None)
        self.into = getattr(dsa, "sparse_attention_backward_into", None)
        self._spied = None
        if self.into is None:
            self.call_into = None

    def reruns(self, args):
        return 1  # the AOT jitter is reported, not used

    def workspace_bytes(self, spec):
        return self.workspace_fn(spec["s_q"], spec["s_kv"], spec["d"], spec["h"], spec["topk"])

    def workspace_fn(self, s_q, s_kv, d, h, topk=512):
        """The AOT workspace helper (None if dsa_aot.dsa has none); optional parameters filled when it takes them."""
        if self.ws_fn is None:
            return None
        params = inspect.signature(self.ws_fn).parameters
        kw = {}
        if "topk" in params:
            kw["topk"] = topk
        if "arch" in params:
            import torch

            cap = torch.cuda.get_device_capability()
            kw["arch"] = f"sm_{cap[0]}{cap[1]}a"
        return int(self.ws_fn(s_q, s_kv, d, h, **kw))

    def _entry_key(self, e):
        """An entry's lookup key: its key without the fields the spec derived (as the runtime's index looks it up)."""
        return dict(self.index._key(e["key"], e.get("derived", ("schedule",))))

    def begin_first(self, spec):
        """Spy on the first call: the entries it launches (LoadedEntry.__call__, or .prepare where a plan
        prepares its launches before firing them) and looks up (Index.find).

        Launches are what ran, whatever the op caches; the spies are removed before any timing loop."""
        launched, looked = [], []
        ix = self.index.index()
        cls = self.loaded.LoadedEntry
        orig_call, orig_prepare, orig_find = cls.__call__, cls.prepare, ix.find

        def call_spy(le, *a):
            if le.entry.get("family") == FAMILY:
                launched.append([le.entry["op"], self._entry_key(le.entry)])
            return orig_call(le, *a)

        def prepare_spy(le, *a):  # a plan of several launches prepares each (then fires it): a launch as well
            if le.entry.get("family") == FAMILY:
                launched.append([le.entry["op"], self._entry_key(le.entry)])
            return orig_prepare(le, *a)

        def find_spy(family, op, key, arch, hint=""):
            if family == FAMILY:
                looked.append([op, dict(key)])
            return orig_find(family, op, key, arch, hint)

        cls.__call__, cls.prepare, ix.find = call_spy, prepare_spy, find_spy
        self._spied = (cls, orig_call, orig_prepare, ix, launched, looked, set(self.runtime.load_stats()))

    def end_first(self, spec):
        cls, orig_call, orig_prepare, ix, launched, looked, loaded = self._spied
        cls.__call__, cls.prepare = orig_call, orig_prepare
        ix.__dict__.pop("find", None)
        new = {k: v for k, v in self.runtime.load_stats().items() if k not in loaded}
        keys, source = (launched, "launches") if launched else (looked, "lookups" if looked else "none")
        return {"keys": keys, "keys_from": source, "lookups": looked, "new": bool(new),
                "loaded": {f"{k[0]}@{k[1]}" if isinstance(k, tuple) else str(k): v for k, v in new.items()}}  # fmt: skip

    def call(self, x, outs, ws):
        return self.op(**_op_kwargs(x, outs, ws))

    def call_into(self, x, outs, d_sink, ws):
        """The capture-safe entry point (nothing allocated), for its warm host time."""
        self.into(outs["dq"], outs["dkv"], d_sink, x["q"], x["kv"], x["out"], x["dout"], x["lse"], x["attn_sink"], x["topk_idxs"],
                  x["softmax_scale"], x["topk_length"], workspace=ws)


def cmd_aot(args):
    install_blocker()
    import torch

    t0 = time.perf_counter()
    import dsa_aot
    import dsa_aot.dsa
    import dsa_aot.runtime

    import_s = time.perf_counter() - t0
    in_dir, out_dir = os.path.join(args.dir, "inputs"), os.path.join(args.dir, "aot")
    cases_path = os.path.join(in_dir, "cases.json")
    if not os.path.exists(cases_path):
        raise SystemExit(f"missing {cases_path}: run `python {SCRIPT} jit --dir {args.dir}` first")
    if not hasattr(dsa_aot.dsa, "sparse_attention_backward"):
        raise SystemExit(f"{dsa_aot.dsa.__file__} has no sparse_attention_backward")
    api = AotApi(dsa_aot.dsa, dsa_aot.runtime)
    with open(cases_path) as f:
        cases = [(n, s) for n, s in json.load(f) if selected(args, n)]
    os.makedirs(out_dir, exist_ok=True)

    def load(spec):
        path = os.path.join(in_dir, f"{spec['inputs']}.pt")
        if not os.path.exists(path):
            raise SystemExit(f"missing inputs {path}: run `python {SCRIPT} jit --dir {args.dir}` first")
        return to_cuda(torch.load(path))

    rows = run_cases("aot", cases, load, api, args, out_dir)
    index_path, index = shipped_index(aot, FAMILY)
    grid = None
    if api.ws_fn is not None:
        grid = [[list(a), api.workspace_fn(*a)] for a in WS_GRID]
    m = meta(torch)
    m.update(import_s=import_s, torch_add_us=torch_add_us(args.calls), index_path=index_path, runtime_stats=runtime_stats(aot), calls=args.calls,
             workspace_fn=getattr(api.ws_fn, "__name__", None), workspace_grid=grid)  # fmt: skip
    with open(os.path.join(args.dir, "aot.json"), "w") as f:
        json.dump({"meta": m, "rows": rows, "index": index}, f, indent=1, default=str)
    print(f"wrote {os.path.join(args.dir, 'aot.json')}")


# ------------------------------------------------------------------------------------------------
# Compare
# ------------------------------------------------------------------------------------------------


def compare_row(jr, ar, jo, ao, cubins, entries):
    """(failures, table cells, report dict) of one case run on both sides."""
    fails, rep, verdicts = [], {}, []
    for n in EXACT:
        eq, cnt = bitwise(jo[n], ao[n])
        nans = int(torch_isnan(ao[n]))
        good = eq and nans == 0
        verdicts.append("yes" if good else f"NO({cnt} diff, {nans} NaN)")
        rep[n] = {"bitwise": eq, "differing": cnt, "aot_nan": nans, "jit_rerun_bitwise": jr["rerun_bitwise"].get(n)}
        if not good:
            note = "" if jr["rerun_bitwise"].get(n, True) else " (the JIT itself is not run-to-run reproducible here)"
            fails.append(f"{n} not bitwise equal ({cnt} elements differ, {nans} NaN on the aot side){note}")
    texts = []
    for n in JITTERY:
        ok_n, text_n, nums_n = jitter_verdict(jo, ao, n)
        rep[n] = dict(nums_n, ok=ok_n, jit_rerun_bitwise=jr["rerun_bitwise"].get(n))
        texts.append(text_n)
        if not ok_n:
            fails.append(f"{n} {text_n}; limit {nums_n.get('limit', float('nan')):.3g}{nums_n['unit']}")
    for side, r in (("jit", jr), ("aot", ar)):
        if r.get("inputs_modified"):
            fails.append(f"inputs modified on the {side} side: {r['inputs_modified']}")
    if jr["returns_given"] != ar["returns_given"]:
        fails.append(f"returned tensors: JIT returns the given dq/dkv {jr['returns_given']}, AOT {ar['returns_given']}")
    if jr.get("key_error"):
        fails.append(jr["key_error"])
    if ar["ws_bytes"] is None:
        fails.append("dsa_aot.dsa has no workspace function (" + " / ".join(WS_NAMES) + "): the AOT call ran without a workspace")
    elif jr["ws_bytes"] != ar["ws_bytes"]:
        fails.append(f"workspace bytes JIT {jr['ws_bytes']} != AOT {ar['ws_bytes']}")
    same_kernels = sorted(map(key_str, jr["keys"])) == sorted(map(key_str, ar["keys"]))
    if not ar["keys"]:
        fails.append("the AOT first call launched and looked up no entry of the family (spies saw nothing)")
    elif not same_kernels:
        fails.append(f"kernels differ: JIT compile keys {jr['keys']}, AOT {ar.get('keys_from')} {ar['keys']}")
    elif ar.get("keys_from") == "launches" and [k[0] for k in ar["keys"]] != [k[0] for k in jr["keys"]]:
        same_kernels = False
        fails.append(f"launch order differs: JIT {[k[0] for k in jr['keys']]}, AOT {[k[0] for k in ar['keys']]}")
    sha = sha_status(jr["keys"], cubins, entries)
    if sha != "yes":
        fails.append(f"cubin sha256 {sha} for {jr['keys']}")
    rep.update(kernels_same=same_kernels, sha256=sha, ok=not fails)
    cells = (
        " / ".join(verdicts), texts[0], texts[1], "same" if same_kernels else "NO", sha,
        f"{jr['first_s']:.3f}{'' if jr.get('new') else '*'}", f"{1e3 * ar['first_s']:.2f}{'' if ar.get('new') else '*'}",
        f"{jr['warm_us']:.1f}", f"{ar['warm_us']:.1f}", f"{jr['device_us']:.0f} / {ar['device_us']:.0f}",
    )  # fmt: skip
    return fails, cells, rep


def compare_workspace_grid(jm, am):
    """Failures of the AOT workspace function against cudnn's over WS_GRID."""
    jg, ag = jm.get("workspace_grid"), am.get("workspace_grid")
    if not jg:
        return ["the JIT side recorded no workspace grid"]
    if ag is None:
        return ["dsa_aot.dsa has no workspace function (" + " / ".join(WS_NAMES) + ")"]
    want = {tuple(a): b for a, b in jg}
    got = {tuple(a): b for a, b in ag}
    bad = [f"(S_q, S_kv, D, H) = {a}: JIT {b}, AOT {got.get(a)}" for a, b in want.items() if got.get(a) != b]
    return [f"workspace function differs at {len(bad)} of {len(want)} shapes, e.g. " + "; ".join(bad[:4])] if bad else []


def cmd_compare(args):
    import torch

    jit = load_json(os.path.join(args.dir, "jit.json"), SCRIPT, "jit", args.dir)
    aot = load_json(os.path.join(args.dir, "aot.json"), SCRIPT, "aot", args.dir)
    if jit is None or aot is None:
        return 1
    arch = jit["meta"].get("arch", "sm_90a")
    entries = family_entries(aot.get("index"), FAMILY, arch)
    failures, lines, report = [], [], []
    header = ("case", "dq bitwise", "dkv vs JIT (max diff, JIT jitter)", "d_sink vs JIT", "kernels", "sha256", "JIT 1st s", "AOT 1st ms",
              "JIT warm us", "AOT warm us", "device us JIT/AOT")  # fmt: skip

    for name, jr in jit["rows"].items():
        spec = jr["spec"]
        ar = aot["rows"].get(name)
        rep = {"case": name, "spec": spec, "jit": {k: jr.get(k) for k in ("first_s", "warm_us", "device_us", "new", "keys", "error")}}
        report.append(rep)
        blank = ("",) * (len(header) - 2)
        if jr.get("error") or ar is None or ar.get("error"):
            why = "JIT: " + jr["error"] if jr.get("error") else ("not run on the aot side" if ar is None else "AOT: " + ar["error"])
            failures.append(f"{name}: {why}")
            lines.append((name, why[:120]) + blank)
            rep.update(ok=False, aot={"error": ar.get("error")} if ar else None)
            continue
        rep["aot"] = {k: ar.get(k) for k in ("first_s", "warm_us", "warm_into_us", "device_us", "new", "keys", "keys_from", "lookups", "loaded")}
        jo = torch.load(os.path.join(args.dir, "jit", f"{name}.pt"))
        ao = torch.load(os.path.join(args.dir, "aot", f"{name}.pt"))
        fails, cells, more = compare_row(jr, ar, jo, ao, jit.get("cubins", []), entries)
        rep.update(more)
        failures += [f"{name}: {f}" for f in fails]
        lines.append((name,) + cells)
    for name in aot["rows"]:
        if name not in jit["rows"]:
            failures.append(f"{name}: run on the aot side only")

    # every cubin the JIT compiled, against the shipped one
    cubins, cubin_fails = cubin_report(jit.get("cubins", []), entries)
    failures += cubin_fails
    jm, am = jit["meta"], aot["meta"]
    ws_fail = compare_workspace_grid(jm, am)
    failures += ws_fail

    print(md_table(header, lines))
    print("\n(* = the first call compiled (JIT) / loaded (AOT) nothing new: its key was already used by an earlier case)")
    print(f"device: {jm.get('device')} ({jm.get('sm_count')} SMs), arch {arch}; torch {jm.get('torch')}; inputs {jm.get('inputs')}")
    print(f"workspace function ({am.get('workspace_fn')}) vs cudnn's flash_attn_bwd_sm90_workspace_size over {len(WS_GRID)} shapes: "
          + ("equal" if not ws_fail else "DIFFERENT"))
    print_summary(jm, am, cubins, jit["rows"], aot["rows"], into_label="sparse_attention_backward_into")
    write_report(args.dir, failures, arch, report, cubins, jm, am)
    return verdict(failures, f"{len(lines)} cases: dq bitwise equal, dkv and d_sink within the JIT's own jitter, same kernels, every cubin sha256 equal, "
                   "same workspace")


def main(argv=None):
    return cli(__doc__, cmd_jit, cmd_aot, cmd_compare, argv, extra=(
        ("--reruns", dict(type=int, default=2, help="jit: extra runs per case to measure the dkv / d_sink jitter")),
        ("--quick", dict(action="store_true", help="jit: 5 cases (seed repro, H64 D512 topk 512 +-topk_length, H128 D576 topk 2048, padded)")),
    ))


if __name__ == "__main__":
    sys.exit(main())
