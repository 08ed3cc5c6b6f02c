#!/usr/bin/env python3
"""JIT-vs-AOT parity of the fused indexer forward + top-k's tail, stage 2 and local-to-global in place: ci/parity/harness.py runs it.

SM90 or SM100: the SIMT kernels are the same code (the GEMM before them is SM100 only and is checked offline,
ci/check_sm100_calls.py). Both sides run on one candidate buffer (the compact ratio-causal scores the GEMM writes, built
from random scores by tests/gpu/ref_indexer_forward_top_k.compact) into NaN / 0x7EADBEEF-poisoned outputs. JIT: what
cudnn's wrapper calls, ``compress_stage2_topk`` / ``compress_stage2_topk_varlen`` with the wrapper's block size
(``_select_topk_block_threads``), then ``_local_to_global_inplace`` for global ids. AOT:
``dsa_aot.ops.dsa_indexer_forward_top_k._tail_into`` (the same two launches of the fused plan; it is an _into form already).

Cases: every block size (256 / 512 / 1024 threads; --quick: no 1024), BSHD and THD, causal offsets, softmax on and off,
ties with ``deterministic``, local and global ids, top-k 512 / 1024 / 2048, ratio 4 and 1.

Rules: upstream leaves the slot order unspecified, so every call's rows are compared sorted by id (``canon``). The ids and
logits bitwise; the softmax within the JIT's own run-to-run jitter (its fp32 denominator is summed in the slot order the
kernel's atomicAdd slot assignment decides, compress_top_k_sm100.py l.396-517, the sum l.588-591: its last bits vary from
run to run on one cubin). Both sides within the fp64 reference (``ref.check``: ``check_dense``, or
``check_rows`` for tied scores). Stage 2 is this family's entry, local-to-global dsa_topk_utils'.
"""

import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BITWISE, JITTER, Aot, Jit, Parity, load_ref, poisoned  # noqa: E402

TOPK = "cudnn.deepseek_sparse_attention.indexer_top_k"
REF = "ref_indexer_forward_top_k.py"


def cases(quick):
    out = []

    def add(name, **spec):
        spec = {**dict(thd=False, ratio=4, top_k=512, offsets=False, softmax=True, det=False, glob=False, ties=False), **spec}
        out.append((name, dict(spec, seed=9000 + zlib.crc32(name.encode()) % 100000)))

    add("bshd-256t-k512-global", segs=[[2560, 1024]], glob=True)
    add("bshd-256t-k2048-offs", segs=[[256, 1024]] * 2, top_k=2048, offsets=True)
    add("bshd-512t-k512-offs-nosoftmax", segs=[[100, 8191]] * 3, offsets=True, softmax=False, glob=True)
    add("bshd-1024t-k1024-offs", segs=[[200, 10000]] * 2, top_k=1024, offsets=True, glob=True)
    add("bshd-256t-k512-ties-det", segs=[[2560, 1024]], det=True, ties=True)
    add("bshd-ratio1-256t-k2048", segs=[[300, 3000]] * 2, ratio=1, top_k=2048, offsets=True, glob=True)
    add("thd-512t-k512", segs=[[100, 40], [3, 20], [0, 5], [260, 90]], thd=True)
    add("thd-256t-k2048-offs-global", segs=[[300, 200], [0, 3], [400, 300]], thd=True, top_k=2048, offsets=True, glob=True)
    add("thd-1024t-k1024-global", segs=[[50, 9000], [10, 8192]], thd=True, top_k=1024, glob=True)
    add("thd-256t-k512-ties-det-offs", segs=[[600, 700]], thd=True, det=True, ties=True, offsets=True, glob=True)
    return [c for c in out if not (quick and "1024t" in c[0])]


def label(spec):
    return (f"{'THD' if spec['thd'] else 'BSHD'} k{spec['top_k']} r{spec['ratio']}" + (" offs" if spec["offsets"] else "")
            + ("" if spec["softmax"] else " nosm") + (" det" if spec["det"] else "") + (" global" if spec["glob"] else ""))


def problem(spec):
    """(dense scores per batch (float64 of fp32), causal offsets): random normal, or few levels with ``ties``."""
    import torch

    gen = torch.Generator().manual_seed(spec["seed"])
    dense, offs = [], []
    for s_q, s_k in spec["segs"]:
        d = torch.randint(0, 6, (s_q, s_k), generator=gen).double() if spec["ties"] else torch.randn(s_q, s_k, generator=gen).float().double()
        dense.append(d)
        offs.append(int(torch.randint(0, max(0, spec["ratio"] * s_k - s_q) + 1, (1,), generator=gen)) if spec["offsets"] else 0)
    return dense, offs


def inputs(spec):
    import torch

    dense, offs = problem(spec)
    cand, cbo = load_ref(REF).compact(dense, spec["ratio"], offs)
    segs = spec["segs"]
    cu_q = torch.tensor([0] + [sum(s for s, _ in segs[: b + 1]) for b in range(len(segs))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(k for _, k in segs[: b + 1]) for b in range(len(segs))], dtype=torch.int32)
    return dict(cand=cand, cbo=cbo, qco=torch.tensor(offs, dtype=torch.int32), cu_q=cu_q, cu_k=cu_k)


def _geometry(spec):
    """(rows, the outputs' leading shape, the longest S_q, the longest S_k)."""
    segs = spec["segs"]
    rows = sum(s for s, _ in segs)
    return rows, (rows,) if spec["thd"] else (len(segs), segs[0][0]), max(s for s, _ in segs), max(k for _, k in segs)


def outputs(spec):
    return {"indices": BITWISE, "logits": BITWISE, **({"softmax": JITTER} if spec["softmax"] else {})}


def buffers(side, api, spec, x):
    import torch

    shape = _geometry(spec)[1] + (spec["top_k"],)
    return {n: poisoned(shape, torch.int32 if n == "indices" else torch.float32) for n in outputs(spec)}


def _by_id(spec, o):
    """The outputs with every row's slots sorted by id (-1 padding last): ``canon``."""
    import torch

    flat = o["indices"].reshape(-1, o["indices"].shape[-1]).long()
    order = torch.argsort(torch.where(flat < 0, 2**40, flat), dim=1, stable=True)
    return {n: torch.gather(t.reshape(flat.shape), 1, order) for n, t in o.items()}


def reference(spec, x, outs):
    ref = load_ref(REF)
    dense, offs = problem(spec)
    rows, _, _, s_k = _geometry(spec)
    segs, glob = spec["segs"], spec["glob"]
    starts = ([sum(k for _, k in segs[:b]) for b in range(len(segs))] if spec["thd"] else [b * s_k for b in range(len(segs))]) if glob else None
    sm = outs["softmax"].reshape(rows, -1) if spec["softmax"] else None
    try:  # check_dense where it decides, check_rows for ties and deterministic calls
        ref.check(outs["indices"].reshape(rows, -1), outs["logits"].reshape(rows, -1), sm, dense, spec["ratio"], offs, spec["top_k"],
                  deterministic=spec["det"], base=starts)
    except AssertionError as e:
        return [f"off the reference ({e})"]
    return []


def _setup():
    import importlib

    return tuple(importlib.import_module(m) for m in (TOPK + ".compress_top_k_sm100", TOPK + ".local_to_global_dsl",
                                                      "cudnn.deepseek_sparse_attention.indexer_forward._compressed_top_k_sm100"))


def _index_key(kind, k):
    if kind == "l2g":
        dt, vl, keep = k
        return "local_to_global", {"dtype": str(dt).removeprefix("torch."), "varlen": vl, "preserve_negative": keep}
    # BSHD's key also holds B, S_q, S_k and whether batch offsets are given, which the shipped key leaves out
    (top_k, ratio, bt, offs, sm, det), vl = (k[1:], True) if k[0] == "varlen" else (k[3:6] + k[7:], False)
    return "stage2", {"top_k": top_k, "ratio": ratio, "threads": bt, "offsets": offs, "softmax": sm, "deterministic": det, "varlen": vl}


def _jit(api, spec, x, b):
    s2, l2g, ctk = api
    rows, lead, s_q, s_k = _geometry(spec)
    bt = ctk._select_topk_block_threads(rows, s_k)  # the wrapper's: B * S_q (BSHD) or total_q rows
    kw = dict(out_indices=b["indices"], out_logits=b["logits"], out_softmax=b.get("softmax"), return_softmax=spec["softmax"],
              deterministic=spec["det"], q_causal_offsets=x["qco"] if spec["offsets"] else None)
    if spec["thd"]:
        s2.compress_stage2_topk_varlen(x["cand"], x["cu_q"], x["cu_k"], x["cbo"], rows, s_q, s_k, spec["top_k"], spec["ratio"], block_threads=bt,
                                       **kw)
        if spec["glob"]:
            l2g._local_to_global_inplace(b["indices"], 0, x["cu_q"], x["cu_k"])
    else:
        s2.compress_stage2_topk(x["cand"], lead[0], s_q, s_k, spec["top_k"], spec["ratio"], block_threads=bt,
                                cand_batch_offsets=x["cbo"] if spec["offsets"] else None, **kw)
        if spec["glob"]:
            l2g._local_to_global_inplace(b["indices"], s_k)
    return b


def _aot(op, spec, x, b):
    _, _, s_q, s_k = _geometry(spec)
    thd = spec["thd"]
    op._tail_into(b["indices"], b["logits"], b.get("softmax"), x["cand"], s_q, s_k, spec["top_k"], spec["ratio"],
                  cand_batch_offsets=x["cbo"] if thd or spec["offsets"] else None, q_causal_offsets=x["qco"] if spec["offsets"] else None,
                  cu_seqlens_q=x["cu_q"] if thd else None, cu_seqlens_k=x["cu_k"] if thd else None, deterministic=spec["det"],
                  topk_indices_global=spec["glob"])
    return b


PARITY = Parity(
    family="dsa_indexer_forward_top_k", doc=__doc__, cases=cases, inputs=inputs, outputs=outputs, buffers=buffers, reference=reference,
    label=label, families=("dsa_indexer_forward_top_k", "dsa_topk_utils"), quick="no 1024-thread case", canon=_by_id,
    jit=Jit(setup=_setup, index_key=_index_key, call=_jit,
            caches={"stage2": (TOPK + ".compress_top_k_sm100", "_compile_cache"), "l2g": (TOPK + ".local_to_global_dsl", "_compile_cache")}),
    aot=Aot(call=_aot, module="dsa_aot.ops.dsa_indexer_forward_top_k"),
)

if __name__ == "__main__":
    sys.exit(PARITY.main())
