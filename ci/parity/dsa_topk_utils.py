#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA top-k index utilities (local_to_global, compactify), in two processes on one GPU machine.

    python ci/parity/dsa_topk_utils.py jit --dir D      # cudnn + cutlass importable: JIT path, writes D/jit.json
    python ci/parity/dsa_topk_utils.py aot --dir D      # cutlass NOT importable: dsa_aot.dsa, writes D/aot.json
    python ci/parity/dsa_topk_utils.py compare --dir D  # markdown table + D/parity.json; exit status 1 on any mismatch

``dsa_aot`` imports the ``dsa_aot`` package from the environment (the installed wheel, or
``PYTHONPATH=<repo root>`` for a source checkout with a build in ``dsa_aot/_generated``).

Both sides make the same public calls with the same arguments::

    local_to_global(local_indices, seqlen_k, cu_seqlens_q=.., cu_seqlens_k=..)   -> {'indices'}
    compactify(indices)                                                            -> {'indices', 'topk_length'}

JIT: ``cudnn.deepseek_sparse_attention.local_to_global_wrapper`` / ``compactify_wrapper`` (upstream's
public wrappers: ``preserve_negative=False``, every negative id becomes -1; the in-place
``preserve_negative`` form is upstream-internal and not shipped); AOT: ``dsa_aot.dsa.local_to_global`` /
``compactify``, and their ``_into`` forms.

Cases: local_to_global on int32 and int64 ids, (B, S_q, K) ids with a fixed ``seqlen_k`` and THD ids
(``cu_seqlens_q`` / ``cu_seqlens_k``, an empty batch; ``seqlen_k`` non-zero there, where upstream
ignores it), K = 2048 and K = 300 (past one 256-thread block, a partial second one), THD rows past
``cu_seqlens_q[-1]`` (counted as the last batch), an int64 case whose sums and ids leave int32 (the
low 32 bits are stored) and a 1 x 1 x 1 case; every input holds -1 ids and other negatives (-2..-4,
INT32_MIN, and -2**40 in int64). compactify at every top-k width the default manifest ships
(512, 1024, 2048) on 8192 rows (whole 4-row CTAs) and 1001 rows (a last CTA of one row), rows that
are all -1, all valid, or valid only at one end, and a 3-D (B, S, 2048) input, flattened as upstream
does. ``--quick``: S_q 256 and 1001 rows only. ``jit`` generates the inputs from fixed seeds and saves
them under D/inputs with the case list (D/inputs/cases.json, which ``dsa_aot`` follows; ``--quick`` and
``--only`` need only be given to ``jit``).

Per case and side: a first call (timed, synchronised; JIT: includes the compile when its compile key
is new in the process; AOT: includes the lazy cubin load when its entry is new), then the allocating
call again with its outputs served from a private torch memory pool whose blocks were just filled
with 0x7EADBEEF (so that an element the kernel does not write shows; not -1, a legitimate output, nor
0xFF bytes, which are -1), then (AOT) the ``_into`` form on 0x7EADBEEF-poisoned outputs. Timing: warm
median host time per call over ``--calls`` calls (allocating form; AOT also ``_into``), the device
synchronised every 16 calls outside the timed calls; ``torch.add`` on 16 elements as a yardstick;
device time per call (CUDA events).

``compare`` checks, per case: every AOT output (first call, poisoned allocating call, ``_into``)
bitwise equal to the JIT's (the ``_into`` one against the JIT's poisoned allocating call); every
output of both sides bitwise equal to the integer reference (``tests/gpu/ref_topk_utils.py`` when
the checkout has it, else an equivalent vectorised one here); the inputs untouched on both sides;
both sides chose the same kernel (the AOT (op, key) lookup equals upstream's compile key); the JIT
cubin of that key (``local_to_global_dsl._compile_cache`` / ``compactify._compile_cache``, taken from
the host module's fatbin) has the sha256 of the shipped ``dsa_aot/_generated/index.json`` entry (family
dsa_topk_utils, arch of the JIT device), as every cubin the JIT compiled must.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from parity_common import (  # noqa: E402
    SpiedAot,
    CompileKeys,
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

FAMILY = "dsa_topk_utils"
COLS = (512, 1024, 2048)  # manifests/default.toml: the compactify widths shipped
POISON = 0x7EADBEEF  # int32 outputs: not -1 (a legitimate output), not an id of these inputs
SYNC_EVERY = 16
SCRIPT = "ci/parity/dsa_topk_utils.py"

# ------------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------------


def build_cases(quick=False):
    """[(name, spec)]; spec: op, shape parameters, seed (stable across runs and --only filters)."""
    cases = []

    def add(name, **spec):
        spec["seed"] = 7000 + zlib.crc32(name.encode()) % 100000
        cases.append((name, spec))

    s = 256 if quick else 1024
    # the first case of each JIT compile key has every extent > 1 (upstream compiles from its tensors)
    for dt in ("int32", "int64"):
        add(f"l2g-bshd-{dt}-b2-s{s}-k2048", op="local_to_global", dtype=dt, varlen=False, b=2, s_q=s, k=2048, seqlen_k=4096, hi=4096)
    for dt in ("int32", "int64"):
        add(f"l2g-thd-{dt}-b5-k2048", op="local_to_global", dtype=dt, varlen=True, batches=5, max_q=s // 2, max_k=5000, k=2048, pad_rows=0,
            seqlen_k=12345, hi=5000)  # fmt: skip
    add("l2g-bshd-int32-b3-s37-k300", op="local_to_global", dtype="int32", varlen=False, b=3, s_q=37, k=300, seqlen_k=4096, hi=4096)
    add("l2g-thd-int64-b9-k300-pad3", op="local_to_global", dtype="int64", varlen=True, batches=9, max_q=40, max_k=5000, k=300, pad_rows=3,
        seqlen_k=777, hi=5000)  # fmt: skip
    add("l2g-bshd-int64-b2-s16-k256-wrap", op="local_to_global", dtype="int64", varlen=False, b=2, s_q=16, k=256, seqlen_k=2**31 - 1,
        hi=2**31 - 1, wrap=True)  # fmt: skip
    add("l2g-bshd-int32-b1-s1-k1", op="local_to_global", dtype="int32", varlen=False, b=1, s_q=1, k=1, seqlen_k=7, hi=7)
    rows = (1001,) if quick else (8192, 1001)
    for cols in COLS:
        for r in rows:
            add(f"cmp-c{cols}-r{r}", op="compactify", cols=cols, rows=r, shape=[r, cols])
    add("cmp-c2048-3d-b2-s333", op="compactify", cols=2048, rows=666, shape=[2, 333, 2048])
    return cases


def label(spec):
    if spec["op"] == "local_to_global":
        return f"l2g {spec['dtype']} {'thd' if spec['varlen'] else 'bshd'}"
    return f"cmp cols {spec['cols']}"


# ------------------------------------------------------------------------------------------------
# Inputs (torch only, CPU)
# ------------------------------------------------------------------------------------------------


def _ids(gen, shape, hi, dtype, invalid=0.3):
    """Ids in [0, hi), about ``invalid`` of them negative: mostly -1, some -2..-4 and INT32_MIN
    (-2**40 too in int64)."""
    import torch

    x = torch.randint(0, hi, shape, generator=gen, dtype=torch.int64)
    u = torch.rand(shape, generator=gen)
    pool = [-2, -3, -4, -(2**31)] + ([-(2**40)] if dtype == torch.int64 else [])
    other = torch.tensor(pool, dtype=torch.int64)[torch.randint(0, len(pool), shape, generator=gen)]
    x = torch.where(u < invalid * 0.8, torch.full_like(x, -1), x)
    x = torch.where((u >= invalid * 0.8) & (u < invalid), other, x)
    return x.to(dtype)


def _segments(gen, batches, lo, hi, empty):
    import torch

    lens = torch.randint(lo, hi + 1, (batches,), generator=gen)
    if empty and batches > 1:
        lens[batches // 2] = 0
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)


def make_inputs(spec):
    """CPU inputs of one case: local_to_global {local, seqlen_k, cu_seqlens_q, cu_seqlens_k};
    compactify {ids}."""
    import torch

    gen = torch.Generator().manual_seed(int(spec["seed"]))
    if spec["op"] == "local_to_global":
        dtype = torch.int32 if spec["dtype"] == "int32" else torch.int64
        cu_q = cu_k = None
        if spec["varlen"]:
            cu_q = _segments(gen, spec["batches"], 1, spec["max_q"], empty=True)
            cu_k = _segments(gen, spec["batches"], 1, spec["max_k"], empty=False)
            shape = (int(cu_q[-1]) + spec["pad_rows"], spec["k"])
        else:
            shape = (spec["b"], spec["s_q"], spec["k"])
        local = _ids(gen, shape, spec["hi"], dtype)
        if spec.get("wrap"):  # ids and sums past int32: the kernel stores the low 32 bits
            flat = local.view(-1)
            special = torch.tensor([2**31 - 1, 2**31, 2**32 + 5, 2**40 + 3, -(2**40), -(2**31) - 1, 0, -1], dtype=torch.int64)
            pos = torch.randperm(flat.numel(), generator=gen)[: 4 * special.numel()]
            flat[pos] = special.repeat(4)
        return dict(local=local.contiguous(), seqlen_k=int(spec["seqlen_k"]), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    rows, cols = spec["rows"], spec["cols"]
    x = torch.randint(0, 1 << 20, (rows, cols), generator=gen, dtype=torch.int64)
    frac = torch.rand(rows, 1, generator=gen)  # a different share of invalid ids per row
    u = torch.rand(rows, cols, generator=gen)
    pool = torch.tensor([-1, -1, -1, -1, -2, -7, -(2**31)], dtype=torch.int64)
    neg = pool[torch.randint(0, pool.numel(), (rows, cols), generator=gen)]
    x = torch.where(u < frac, neg, x)
    x[0] = -1  # nothing valid
    if rows > 3:
        x[1] = torch.randint(0, 1 << 20, (cols,), generator=gen)  # everything valid
        x[2, :-1], x[2, -1] = -1, 12345  # the last id only
        x[3, 1:] = -1  # the first id only
        x[3, 0] = 54321
    return dict(ids=x.to(torch.int32).reshape(spec["shape"]).contiguous())


# ------------------------------------------------------------------------------------------------
# Reference (integer math, CPU)
# ------------------------------------------------------------------------------------------------


def _own_local_to_global(local, seqlen_k, cu_q=None, cu_k=None):
    """Vectorised equivalent of tests/gpu/ref_topk_utils.local_to_global."""
    import torch

    x = local.to(torch.int64)
    if cu_q is None:
        off = (torch.arange(x.shape[0], dtype=torch.int64) * int(seqlen_k)).view(-1, 1, 1)
    else:
        q, k = cu_q.to(torch.int64), cu_k.to(torch.int64)
        batches = q.numel() - 1
        rows = torch.arange(x.shape[0], dtype=torch.int64)
        # upstream's binary search: the last batch in [0, batches) whose start is <= the row
        b = torch.searchsorted(q[1:batches].contiguous(), rows, right=True) if batches > 1 else torch.zeros_like(rows)
        off = k[b].view(-1, 1)
    out = torch.where(x >= 0, x + off, torch.full_like(x, -1))
    return (((out + 2**31) % 2**32) - 2**31).to(torch.int32)


def _own_compactify(ids):
    """Vectorised equivalent of tests/gpu/ref_topk_utils.compactify."""
    import torch

    x = ids.reshape(-1, ids.shape[-1]).to(torch.int32)
    valid = x >= 0
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # valid ones first, in their order
    n = valid.sum(dim=1).to(torch.int32)
    moved = x.gather(1, order)
    pos = torch.arange(x.shape[1]).view(1, -1)
    return torch.where(pos < n.view(-1, 1), moved, torch.full_like(moved, -1)), n


def load_reference():
    """(local_to_global(local, seqlen_k, cu_q, cu_k), compactify(ids), name): tests/gpu/ref_topk_utils
    when the checkout has it, else this script's vectorised equivalent."""
    path = os.path.join(ROOT, "tests", "gpu", "ref_topk_utils.py")
    if os.path.exists(path):
        spec = importlib.util.spec_from_file_location("dsa_aot_parity_ref_topk_utils", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.local_to_global, mod.compactify, "tests/gpu/ref_topk_utils.py"
    return _own_local_to_global, _own_compactify, "ci/parity/dsa_topk_utils.py (vectorised)"


def reference(spec, x, ref):
    """{output name: int32 CPU tensor} of a case, from the reference ``ref`` (load_reference())."""
    l2g, cmp, _ = ref
    if spec["op"] == "local_to_global":
        return {"indices": l2g(x["local"], x["seqlen_k"], x["cu_seqlens_q"], x["cu_seqlens_k"])}
    ind, n = cmp(x["ids"])
    return {"indices": ind, "topk_length": n}


# ------------------------------------------------------------------------------------------------
# One case, either side
# ------------------------------------------------------------------------------------------------


def _out_elems(spec, x):
    """int32 elements of each output the allocating form allocates, in its order."""
    if spec["op"] == "local_to_global":
        return [x["local"].numel()]
    return [x["ids"].numel(), x["ids"].numel() // spec["cols"]]


def poisoned_outputs(spec, x):
    """POISON-filled outputs of the ``_into`` forms."""
    import torch

    if spec["op"] == "local_to_global":
        return {"indices": torch.full(x["local"].shape, POISON, dtype=torch.int32, device="cuda")}
    rows = x["ids"].numel() // spec["cols"]
    return {"indices": torch.full((rows, spec["cols"]), POISON, dtype=torch.int32, device="cuda"),
            "topk_length": torch.full((rows,), POISON, dtype=torch.int32, device="cuda")}  # fmt: skip


def poisoned_alloc_call(fn, elems):
    """fn() with its torch allocations served from a fresh private memory pool whose blocks were just
    filled with POISON (same sizes, same order: the pool hands the same blocks back).
    (result, pool (keep it alive while the result is), how)."""
    import torch

    pool_cls, use = getattr(torch.cuda, "MemPool", None), getattr(torch.cuda, "use_mem_pool", None)
    if pool_cls is None or use is None:
        return fn(), None, "unpoisoned (torch has no MemPool)"
    pool = pool_cls()
    with use(pool):
        bufs = [torch.full((n,), POISON, dtype=torch.int32, device="cuda") for n in elems]
        del bufs  # back to the pool, stream-ordered after the fills
        res = fn()
    return res, pool, "pool"


def run_case(name, spec, x, api, args, out_dir):
    """First call, poisoned allocating call, poisoned ``_into`` call (AOT), warm timing; saves outputs, returns the row."""
    import torch

    pristine = {k: v.clone() for k, v in x.items() if isinstance(v, torch.Tensor)}
    if spec["op"] == "compactify":
        x = dict(x, ids2d=x["ids"].reshape(-1, spec["cols"]))  # the _into form's 2-D view
    row = {"case": name, "op": spec["op"], "label": label(spec), "spec": spec}
    saved, res = {}, {}
    api.begin_first(spec)
    row["first_s"] = first_call(lambda: res.update(api.call(spec, x)))
    row.update(api.end_first(spec))  # keys (op, key) used, new (compiled / loaded inside the call), key_error
    saved.update({f"first.{n}": _host(t) for n, t in res.items()})
    res.clear()

    out, pool, row["alloc_poison"] = poisoned_alloc_call(lambda: api.call(spec, x), _out_elems(spec, x))
    torch.cuda.synchronize()
    saved.update({f"alloc.{n}": _host(t) for n, t in out.items()})
    del out, pool

    outs = None
    if hasattr(api, "call_into"):
        outs = poisoned_outputs(spec, x)
        api.call_into(spec, x, outs)
        torch.cuda.synchronize()
        saved.update({f"into.{n}": _host(t) for n, t in outs.items()})
    row["inputs_untouched"] = all(_same(x[k], v) for k, v in pristine.items())

    row["warm_us"] = warm_us(lambda: api.call(spec, x), args.calls, sync_every=SYNC_EVERY)
    if outs is not None:
        row["warm_into_us"] = warm_us(lambda: api.call_into(spec, x, outs), args.calls, sync_every=SYNC_EVERY)
    row["device_us"] = device_us(lambda: api.call(spec, x))
    torch.save(saved, os.path.join(out_dir, f"{name}.pt"))
    return row


def failed_row(name, spec, exc, side):
    """The row of a case that raised on ``side`` (printed; compare reports it as a failure)."""
    import traceback

    traceback.print_exc()
    print(f"{side} {name}: FAILED: {exc!r}", flush=True)
    return {"case": name, "op": spec["op"], "label": label(spec), "spec": spec, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}


def _l2g_args(x):
    """The arguments both sides pass: cudnn's local_to_global_wrapper signature."""
    return (x["local"], x["seqlen_k"]), dict(cu_seqlens_q=x["cu_seqlens_q"], cu_seqlens_k=x["cu_seqlens_k"])


# ------------------------------------------------------------------------------------------------
# JIT side (cudnn + cutlass)
# ------------------------------------------------------------------------------------------------


class JitApi(CompileKeys):
    def __init__(self):
        base = "cudnn.deepseek_sparse_attention.indexer_top_k"
        api = importlib.import_module(base)
        self.l2g = importlib.import_module(base + ".local_to_global_dsl")
        self.cmp = importlib.import_module(base + ".compactify")
        self.l2g_wrapper, self.cmp_wrapper = api.local_to_global_wrapper, api.compactify_wrapper
        self._before = None

    def _snapshot(self):
        return {("l2g", k) for k in self.l2g._compile_cache} | {("cmp", k) for k in self.cmp._compile_cache}

    @staticmethod
    def jit_keys(spec):
        """The compile key upstream's public wrapper uses for a case (preserve_negative False)."""
        import torch

        if spec["op"] == "local_to_global":
            return [("l2g", (torch.int32 if spec["dtype"] == "int32" else torch.int64, bool(spec["varlen"]), False))]
        return [("cmp", (int(spec["cols"]),))]

    @staticmethod
    def index_key(kind, jit_key):
        """cudnn's cache key -> (op, key dict) as in dsa_aot/_generated/index.json."""
        if kind == "l2g":
            dtype, varlen, preserve = jit_key
            return "local_to_global", {"dtype": str(dtype).replace("torch.", ""), "varlen": bool(varlen), "preserve_negative": bool(preserve)}
        if kind == "cmp":
            (cols,) = jit_key
            return "compactify", {"cols": int(cols)}
        raise ValueError(f"unknown cudnn cache {kind!r}")

    def call(self, spec, x):
        if spec["op"] == "local_to_global":
            a, kw = _l2g_args(x)
            return {"indices": self.l2g_wrapper(*a, **kw)["indices"]}
        r = self.cmp_wrapper(x["ids"])
        return {"indices": r["indices"], "topk_length": r["topk_length"]}

    def cubins(self):
        return jit_cubins((("l2g", self.l2g._compile_cache), ("cmp", self.cmp._compile_cache)), self.index_key)


def cmd_jit(args):
    jit_side(args, JitApi, build_cases, make_inputs, run_case, lambda r: f"warm {r['warm_us']:.1f} us, device {r['device_us']:.1f} us", failed_row)


# ------------------------------------------------------------------------------------------------
# AOT side (no cutlass, no cudnn)
# ------------------------------------------------------------------------------------------------


class AotApi(SpiedAot):
    OP_MODULE = "dsa_aot.ops.dsa_topk_utils"
    CACHES = ("LOCAL_TO_GLOBAL.cache", "COMPACTIFY.cache")

    def call(self, spec, x):
        if spec["op"] == "local_to_global":
            a, kw = _l2g_args(x)
            return {"indices": self.dsa.local_to_global(*a, **kw)["indices"]}
        r = self.dsa.compactify(x["ids"])
        return {"indices": r["indices"], "topk_length": r["topk_length"]}

    def call_into(self, spec, x, outs):
        if spec["op"] == "local_to_global":
            self.dsa.local_to_global_into(outs["indices"], x["local"], x["seqlen_k"], x["cu_seqlens_q"], x["cu_seqlens_k"])
        else:
            self.dsa.compactify_into(outs["indices"], outs["topk_length"], x["ids2d"])


def cmd_aot(args):
    aot_side(args, SCRIPT, FAMILY, AotApi, run_case,
             lambda r: f"warm {r['warm_us']:.1f} us (into {r['warm_into_us']:.1f} us), device {r['device_us']:.1f} us", failed_row)


# ------------------------------------------------------------------------------------------------
# Compare
# ------------------------------------------------------------------------------------------------


def cmd_compare(args):
    import torch

    jit = load_json(os.path.join(args.dir, "jit.json"), SCRIPT, "jit", args.dir)
    aot = load_json(os.path.join(args.dir, "aot.json"), SCRIPT, "aot", args.dir)
    if jit is None or aot is None:
        return 1
    arch = jit["meta"].get("arch", "sm_90a")
    entries = family_entries(aot.get("index"), FAMILY, arch)
    ref = load_reference()
    failures, lines, report = [], [], []
    header = ("case", "kernel", "AOT = JIT (first / alloc / into)", "= reference (JIT / AOT)", "kernels", "sha256", "JIT 1st s", "AOT 1st ms",
              "JIT warm us", "AOT warm us (into)", "device us JIT/AOT")  # fmt: skip

    for name, jr in jit["rows"].items():
        spec = jr["spec"]
        ar = aot["rows"].get(name)
        rep = {"case": name, "spec": spec, "jit": {k: jr.get(k) for k in ("first_s", "warm_us", "device_us", "new", "keys", "alloc_poison")}}
        report.append(rep)
        if ar is None or "error" in ar or "error" in jr:
            why = [f"{side} raised {r['error']}" for side, r in (("jit", jr), ("aot", ar or {})) if "error" in r]
            why += ["not run on the aot side"] if ar is None else []
            failures += [f"{name}: {w}" for w in why]
            lines.append((name, jr["label"], "; ".join(w.split(":")[0] for w in why), "", "", "", "", "", "", "", ""))
            continue
        rep["aot"] = {k: ar.get(k) for k in ("first_s", "warm_us", "warm_into_us", "device_us", "new", "keys", "loaded", "alloc_poison")}
        jo = torch.load(os.path.join(args.dir, "jit", f"{name}.pt"))
        ao = torch.load(os.path.join(args.dir, "aot", f"{name}.pt"))
        want = reference(spec, torch.load(os.path.join(args.dir, "inputs", f"{name}.pt")), ref)
        ok_row = True

        # AOT against JIT, bitwise: first <-> first, alloc <-> alloc, into <-> the JIT's (poisoned) alloc
        forms = []
        for form in ("first", "alloc", "into"):
            verdicts = []
            for out in want:
                n = f"{form}.{out}"
                jn = n if n in jo else f"alloc.{out}"
                if n not in ao or jn not in jo:
                    verdicts.append("missing")
                    ok_row = False
                    failures.append(f"{name}: {n} not saved on the {'aot' if n not in ao else 'jit'} side")
                    continue
                eq, cnt = bitwise(jo[jn], ao[n])
                rep[f"aot {n} = jit {jn}"] = {"bitwise": eq, "differing": cnt}
                verdicts.append("yes" if eq else f"NO({cnt})")
                if not eq:
                    ok_row = False
                    failures.append(f"{name}: AOT {n} not bitwise equal to JIT {jn} ({cnt} elements differ)")
            forms.append("/".join(verdicts))

        # every output of both sides against the integer reference
        ref_text = []
        for side, saved in (("jit", jo), ("aot", ao)):
            bad = []
            for n in sorted(saved):
                out = n.split(".", 1)[1]
                eq, cnt = bitwise(want[out], saved[n])
                poisoned = int((saved[n] == POISON).sum()) if saved[n].dtype == torch.int32 else 0
                rep[f"{side} {n} = reference"] = {"bitwise": eq, "differing": cnt, "poison_left": poisoned}
                if not eq:
                    bad.append(n)
                    failures.append(f"{name}: {side.upper()} {n} differs from the reference ({cnt} elements"
                                    + (f", {poisoned} never written" if poisoned else "") + ")")
            ref_text.append("yes" if not bad else f"NO({','.join(bad)})")
            ok_row &= not bad

        for side, r in (("jit", jr), ("aot", ar)):
            if not r.get("inputs_untouched", False):
                ok_row = False
                failures.append(f"{name}: inputs modified on the {side} side")
            if r.get("alloc_poison") != "pool":
                rep.setdefault("notes", []).append(f"{side}: allocating call {r.get('alloc_poison')}")
        if jr.get("key_error"):
            ok_row = False
            failures.append(f"{name}: {jr['key_error']}")
        same_kernels = sorted(map(_key_str, jr["keys"])) == sorted(map(_key_str, ar["keys"]))
        if not same_kernels:
            ok_row = False
            failures.append(f"{name}: kernels differ: JIT compile keys {jr['keys']}, AOT looked up {ar['keys']}")
        sha = sha_status(jr["keys"], jit["cubins"], entries)
        if sha != "yes":
            ok_row = False
            failures.append(f"{name}: cubin sha256 {sha} for {jr['keys']}")
        rep.update(kernels_same=same_kernels, sha256=sha, ok=ok_row)
        into_us = f" ({ar['warm_into_us']:.1f})" if "warm_into_us" in ar else ""
        lines.append((
            name, jr["label"], " / ".join(forms), " / ".join(ref_text), "same" if same_kernels else "NO", sha,
            f"{jr['first_s']:.3f}{'' if jr.get('new') else '*'}", f"{1e3 * ar['first_s']:.2f}{'' if ar.get('new') else '*'}",
            f"{jr['warm_us']:.1f}", f"{ar['warm_us']:.1f}{into_us}", f"{jr['device_us']:.1f} / {ar['device_us']:.1f}",
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
    print(f"device: {jm.get('device')} ({jm.get('sm_count')} SMs), arch {arch}; torch {jm.get('torch')}; reference {ref[2]}"
          + ("; --quick" if jm.get("quick") else ""))
    polls = sorted({f"{s}: {r.get('alloc_poison')}" for s, rows in (("jit", jit["rows"]), ("aot", aot["rows"])) for r in rows.values()
                    if r.get("alloc_poison") != "pool"})  # fmt: skip
    if polls:
        print(f"note: allocating calls not poisoned ({', '.join(polls)}): their unwritten elements are caught only by the reference")
    print_summary(jm, am, cubins, jit["rows"], aot["rows"], into_label="_into")
    write_report(args.dir, failures, arch, report, cubins, jm, am)
    return verdict(failures, f"{len(lines)} cases: every output bitwise equal JIT vs AOT and to the reference, same kernels, every cubin sha256 equal")


def main(argv=None):
    return cli(__doc__, cmd_jit, cmd_aot, cmd_compare, argv, extra=(
        ("--quick", dict(action="store_true", help="jit: S_q 256 and 1001 compactify rows only")),
    ))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
