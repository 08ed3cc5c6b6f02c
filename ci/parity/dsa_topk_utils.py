#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA top-k index utilities (local_to_global, compactify): ci/parity/harness.py runs it.

Both sides make the same public calls: cudnn's ``local_to_global_wrapper`` / ``compactify_wrapper``
(``preserve_negative=False``: every negative id becomes -1) and ``dsa_aot.dsa.local_to_global`` /
``compactify`` (and their ``_into`` forms). Cases: int32 and int64 ids, (B, S_q, K) ids and THD ids (an
empty batch; ``seqlen_k`` non-zero there, where upstream ignores it), K 2048 and 300 (a partial second
256-thread block), THD rows past ``cu_seqlens_q[-1]`` (the last batch's), int64 sums and ids past int32
(the low 32 bits are stored), a 1 x 1 x 1 case; every input holds -1 and other negatives (-2..-4,
INT32_MIN, -2**40). compactify at every width the default manifest ships on 8192 rows (whole 4-row CTAs)
and 1001 (a last CTA of one row), rows all -1, all valid or valid at one end only, and a 3-D input.
Every output is bitwise equal JIT vs AOT and to the integer reference (tests/gpu/ref_topk_utils.py).
"""

import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BITWISE, Aot, Jit, Parity, bitwise, load_ref  # noqa: E402

COLS = (512, 1024, 2048)  # manifests/default.toml: the compactify widths shipped
BASE = "cudnn.deepseek_sparse_attention.indexer_top_k"


def cases(quick):
    out = []

    def add(name, **spec):
        out.append((name, dict(spec, seed=7000 + zlib.crc32(name.encode()) % 100000)))

    s = 256 if quick else 1024
    for dt in ("int32", "int64"):  # the first case of each compile key has every extent > 1
        add(f"l2g-bshd-{dt}-b2-s{s}-k2048", op="local_to_global", dtype=dt, varlen=False, b=2, s_q=s, k=2048, seqlen_k=4096, hi=4096)
    for dt in ("int32", "int64"):
        add(f"l2g-thd-{dt}-b5-k2048", op="local_to_global", dtype=dt, varlen=True, batches=5, max_q=s // 2, max_k=5000, k=2048, pad_rows=0,
            seqlen_k=12345, hi=5000)
    add("l2g-bshd-int32-b3-s37-k300", op="local_to_global", dtype="int32", varlen=False, b=3, s_q=37, k=300, seqlen_k=4096, hi=4096)
    add("l2g-thd-int64-b9-k300-pad3", op="local_to_global", dtype="int64", varlen=True, batches=9, max_q=40, max_k=5000, k=300, pad_rows=3,
        seqlen_k=777, hi=5000)
    add("l2g-bshd-int64-b2-s16-k256-wrap", op="local_to_global", dtype="int64", varlen=False, b=2, s_q=16, k=256, seqlen_k=2**31 - 1,
        hi=2**31 - 1, wrap=True)
    add("l2g-bshd-int32-b1-s1-k1", op="local_to_global", dtype="int32", varlen=False, b=1, s_q=1, k=1, seqlen_k=7, hi=7)
    for cols in COLS:
        for r in (1001,) if quick else (8192, 1001):
            add(f"cmp-c{cols}-r{r}", op="compactify", cols=cols, shape=[r, cols])
    add("cmp-c2048-3d-b2-s333", op="compactify", cols=2048, shape=[2, 333, 2048])
    return out


def _ids(gen, shape, hi, dtype, invalid=0.3):
    """Ids in [0, hi), about ``invalid`` of them negative: mostly -1, some -2..-4, INT32_MIN (and -2**40 in int64)."""
    import torch

    x = torch.randint(0, hi, shape, generator=gen, dtype=torch.int64)
    u = torch.rand(shape, generator=gen)
    pool = torch.tensor([-2, -3, -4, -(2**31)] + ([-(2**40)] if dtype == torch.int64 else []), dtype=torch.int64)
    x = torch.where(u < invalid * 0.8, torch.full_like(x, -1), x)
    x = torch.where((u >= invalid * 0.8) & (u < invalid), pool[torch.randint(0, len(pool), shape, generator=gen)], x)
    return x.to(dtype)


def _segments(gen, batches, hi, empty):
    import torch

    lens = torch.randint(1, hi + 1, (batches,), generator=gen)
    if empty and batches > 1:
        lens[batches // 2] = 0
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)


def inputs(spec):
    import torch

    gen = torch.Generator().manual_seed(spec["seed"])
    if spec["op"] == "local_to_global":
        dtype = getattr(torch, spec["dtype"])
        cu_q = cu_k = None
        if spec["varlen"]:
            cu_q, cu_k = _segments(gen, spec["batches"], spec["max_q"], True), _segments(gen, spec["batches"], spec["max_k"], False)
            shape = (int(cu_q[-1]) + spec["pad_rows"], spec["k"])
        else:
            shape = (spec["b"], spec["s_q"], spec["k"])
        local = _ids(gen, shape, spec["hi"], dtype)
        if spec.get("wrap"):  # ids and sums past int32: the kernel stores the low 32 bits
            special = torch.tensor([2**31 - 1, 2**31, 2**32 + 5, 2**40 + 3, -(2**40), -(2**31) - 1, 0, -1], dtype=torch.int64)
            local.view(-1)[torch.randperm(local.numel(), generator=gen)[: 4 * special.numel()]] = special.repeat(4)
        return dict(local=local, seqlen_k=spec["seqlen_k"], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    rows, cols = spec["shape"][0] * (spec["shape"][1] if len(spec["shape"]) == 3 else 1), spec["cols"]
    x = torch.randint(0, 1 << 20, (rows, cols), generator=gen, dtype=torch.int64)
    pool = torch.tensor([-1, -1, -1, -1, -2, -7, -(2**31)], dtype=torch.int64)
    x = torch.where(torch.rand(rows, cols, generator=gen) < torch.rand(rows, 1, generator=gen), pool[torch.randint(0, 7, (rows, cols), generator=gen)], x)
    x[0] = -1  # nothing valid
    x[1] = torch.randint(0, 1 << 20, (cols,), generator=gen)  # everything valid
    x[2, :-1], x[2, -1] = -1, 12345  # the last id only
    x[3, 1:], x[3, 0] = -1, 54321  # the first id only
    return dict(ids=x.to(torch.int32).reshape(spec["shape"]))


def outputs(spec):
    return {"indices": BITWISE} if spec["op"] == "local_to_global" else {"indices": BITWISE, "topk_length": BITWISE}


def reference(spec, x, outs):
    ref = load_ref("ref_topk_utils.py")
    if spec["op"] == "local_to_global":
        want = {"indices": ref.local_to_global(x["local"], x["seqlen_k"], x["cu_seqlens_q"], x["cu_seqlens_k"])}
    else:
        want = dict(zip(("indices", "topk_length"), ref.compactify(x["ids"])))
    return [f"{n}: {bitwise(w, outs[n])[1]} elements differ from the integer reference" for n, w in want.items() if not bitwise(w, outs[n])[0]]


def _call(l2g, cmp, spec, x):
    if spec["op"] == "local_to_global":
        return l2g(x["local"], x["seqlen_k"], cu_seqlens_q=x["cu_seqlens_q"], cu_seqlens_k=x["cu_seqlens_k"])
    return cmp(x["ids"])


def _setup():
    import importlib

    return importlib.import_module(BASE)


def _index_key(kind, k):
    if kind == "l2g":
        return "local_to_global", {"dtype": str(k[0]).removeprefix("torch."), "varlen": bool(k[1]), "preserve_negative": bool(k[2])}
    return "compactify", {"cols": int(k[0])}


def _into(dsa, spec, x, b):
    if spec["op"] == "local_to_global":
        dsa.local_to_global_into(b["indices"], x["local"], x["seqlen_k"], x["cu_seqlens_q"], x["cu_seqlens_k"])
    else:
        dsa.compactify_into(b["indices"].view(-1, spec["cols"]), b["topk_length"].view(-1), x["ids"].view(-1, spec["cols"]))
    return b


PARITY = Parity(
    family="dsa_topk_utils", doc=__doc__, cases=cases, inputs=inputs, outputs=outputs, reference=reference,
    label=lambda s: f"l2g {s['dtype']} {'thd' if s['varlen'] else 'bshd'}" if s["op"] == "local_to_global" else f"cmp cols {s['cols']}",
    jit=Jit(setup=_setup, caches={"l2g": (BASE + ".local_to_global_dsl", "_compile_cache"), "cmp": (BASE + ".compactify", "_compile_cache")},
            index_key=_index_key, call=lambda api, spec, x, b: _call(api.local_to_global_wrapper, api.compactify_wrapper, spec, x)),
    aot=Aot(call=lambda dsa, spec, x, b: _call(dsa.local_to_global, dsa.compactify, spec, x), into=_into),
    quick="S_q 256 and 1001 compactify rows only", bench=("l2g-bshd-int32-b2-s1024-k2048", "cmp-c2048-r8192"),
)

if __name__ == "__main__":
    sys.exit(PARITY.main())
