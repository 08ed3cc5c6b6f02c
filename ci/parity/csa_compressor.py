#!/usr/bin/env python3
"""JIT-vs-AOT parity of the CSA compressor (forward, atomic and deterministic backward): ci/parity/harness.py runs it.

The JIT side calls cudnn's launch functions ``compressor_sm100_r128.run_fwd_r128`` / ``run_bwd_r128`` (ratio
128) and ``compressor_sm100.run_fwd`` / ``run_bwd`` (ratio 2 / 4): cudnn's public wrappers refuse SM90, these
do not. The AOT side calls ``dsa_aot.csa.compressor_forward_into`` / ``compressor_backward_into``. Both get
NaN outputs (a zeroed ``grad_ape`` on the atomic path, which accumulates into it) and, deterministic, a 0xFF
workspace of cudnn's ``bwd_dape_workspace_bytes[_r128]`` vs dsa_aot's ``backward_workspace_bytes``.

Cases: every bucket of every op. Ratio 128 at coff 1 / 2, d 128 / 512: 64 rows with pad rows and pad tokens
(forward and backward small buckets), 300 rows (default buckets), 1024 rows = 131072 tokens (forward large
bucket; its backward would repeat the default one); ratio 2 / 4 at coff 1 / 2, d 128 / 512, 1003 rows. Each
input (segments with tails, a segment shorter than the ratio and an empty one) serves the case's fwd,
bwd_atomic and bwd_det calls (``--quick``: the same list; every case is small).

Rules: ``out``, ``grad_kv``, ``grad_score`` and the deterministic ``grad_ape`` bitwise; the atomic ``grad_ape``
(fp32 atomics) within the JIT's own run-to-run jitter; no output holds a NaN on either side (an element unwritten).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import BITWISE, JITTER, Aot, Jit, Parity, Recording, nan_like, poisoned, poisoned_workspace  # noqa: E402

BASE = "cudnn.csa.compressor.compressor_sm100"
OPS = ("fwd", "bwd_atomic", "bwd_det")
_CALL = {}  # total_comp of the call whose kernels are being recorded (see _index_key)


def cases(quick):
    out, seed = [], 1000
    for coff in (1, 2):
        for d in (128, 512):
            for tag, valid, pad_rows, pad_tokens, ops in (("s", 60, 4, 5, OPS), ("m", 300, 0, 0, OPS), ("l", 1024, 0, 0, ("fwd",))):
                seed += 1
                name = f"r128-c{coff}-d{d}-{tag}-nb{valid + pad_rows}"
                out += [(f"{name}-{op}", dict(ratio=128, coff=coff, d=d, valid=valid, pad_rows=pad_rows, pad_tokens=pad_tokens, seed=seed, op=op,
                                              inputs=name)) for op in ops]
    for ratio in (2, 4):
        for coff in (1, 2):
            for d in (128, 512):
                seed += 1
                name = f"r{ratio}-c{coff}-d{d}-nb1003"
                out += [(f"{name}-{op}", dict(ratio=ratio, coff=coff, d=d, valid=1000, pad_rows=3, pad_tokens=2, seed=seed, op=op, inputs=name))
                        for op in OPS]
    return out


def inputs(spec):
    """CPU inputs of one case (segments with tails, a short and an empty segment)."""
    import torch

    ratio, coff, d, valid = spec["ratio"], spec["coff"], spec["d"], spec["valid"]
    gen = torch.Generator().manual_seed(spec["seed"])

    def randint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    nseg = min(3, valid)
    cuts = sorted(torch.randperm(valid - 1, generator=gen)[: nseg - 1].add(1).tolist()) if nseg > 1 else []
    bounds = [0] + cuts + [valid]
    lengths = [(bounds[i + 1] - bounds[i]) * ratio + randint(0, ratio - 1) for i in range(nseg)]
    lengths.insert(randint(0, len(lengths)), randint(1, ratio - 1))  # shorter than ratio
    lengths.insert(randint(0, len(lengths)), 0)  # empty
    cu, cuc = [0], [0]
    for n in lengths:
        cu.append(cu[-1] + n)
        cuc.append(cuc[-1] + n // ratio)
    assert cuc[-1] == valid
    total_tokens, total_comp, width = cu[-1] + spec["pad_tokens"], valid + spec["pad_rows"], coff * d
    return dict(
        kv=torch.randn(total_tokens, width, generator=gen).to(torch.bfloat16),
        score=(2.0 * torch.randn(total_tokens, width, generator=gen)).to(torch.bfloat16),
        ape=(0.5 * torch.randn(ratio, width, generator=gen)).float(),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        cu_seqlens_comp=torch.tensor(cuc, dtype=torch.int32),
        grad_out=torch.randn(total_comp, d, generator=gen).to(torch.bfloat16),
        total_comp=total_comp,
    )


def outputs(spec):
    if spec["op"] == "fwd":
        return {"out": BITWISE}
    return {"grad_kv": BITWISE, "grad_score": BITWISE, "grad_ape": BITWISE if spec["op"] == "bwd_det" else JITTER}


def reference(spec, x, outs):
    import torch

    return [f"{n}: {int(torch.isnan(t).sum())} NaN" for n, t in outs.items() if torch.isnan(t).any()]


def _bucket(op, nb):
    from dsa_aot.policy.csa_compressor import bucket_of

    return bucket_of(op, nb)


def label(spec):
    op, nb = spec["op"], spec["valid"] + spec["pad_rows"]
    mode = {"fwd": "", "bwd_atomic": "/atomic", "bwd_det": "/det"}[op]
    if spec["ratio"] != 128:
        return op[:3] + mode
    return f"{op[:3]}_r128/{_bucket(op[:3] + '_r128', nb)}{mode}"


def buffers(side, api, spec, x):
    import torch

    if spec["op"] == "fwd":
        return {"out": poisoned((x["total_comp"], spec["d"]), torch.bfloat16)}
    det = spec["op"] == "bwd_det"
    b = dict(grad_kv=nan_like(x["kv"]), grad_score=nan_like(x["score"]), grad_ape=nan_like(x["ape"]) if det else torch.zeros_like(x["ape"]))
    if not det:
        return b
    nb, ratio, d, coff = x["total_comp"], spec["ratio"], spec["d"], spec["coff"]
    if side == "aot":
        ws = api.backward_workspace_bytes(nb, ratio, d, coff, x["kv"].device)
    elif ratio == 128:
        ws = api[1].bwd_dape_workspace_bytes_r128(nb, ratio, d, coff, x["kv"].device.index)
    else:
        ws = api[0].bwd_dape_workspace_bytes(nb, ratio, d, coff)
    return dict(b, workspace=poisoned_workspace(ws))


def _ins(x):
    return x["kv"], x["score"], x["ape"], x["cu_seqlens"], x["cu_seqlens_comp"]


def _jit(api, spec, x, b):
    g, r = api
    recording = isinstance(g._COMPILED, Recording)
    _CALL["nb"] = x["total_comp"] if recording else None
    if recording:  # a launcher an earlier case cached skips the compile caches: the recorded call takes the slow path
        g._FAST._tls.m, r._FAST._tls.m = {}, {}
    ratio, d, coff, nb = spec["ratio"], spec["d"], spec["coff"], x["total_comp"]
    if spec["op"] == "fwd":
        (r.run_fwd_r128 if ratio == 128 else g.run_fwd)(*_ins(x), b["out"], nb, ratio, d, coff)
    else:
        (r.run_bwd_r128 if ratio == 128 else g.run_bwd)(*_ins(x), x["grad_out"], b["grad_kv"], b["grad_score"], b["grad_ape"], nb, ratio, d, coff,
                                                        deterministic=spec["op"] == "bwd_det", workspace=b.get("workspace"))
    return b


def _aot(csa, spec, x, b):
    if spec["op"] == "fwd":
        csa.compressor_forward_into(b["out"], *_ins(x), ratio=spec["ratio"], coff=spec["coff"])
    else:
        csa.compressor_backward_into(b["grad_kv"], b["grad_score"], b["grad_ape"], *_ins(x), x["grad_out"], ratio=spec["ratio"], coff=spec["coff"],
                                     deterministic=spec["op"] == "bwd_det", workspace=b.get("workspace"))
    return b


def _setup():
    import importlib

    return importlib.import_module(BASE), importlib.import_module(BASE + "_r128")


def _index_key(kind, k):
    """cudnn's _COMPILED key -> (op, key dict) as in the index. A ratio-128 key holds upstream's schedule, which
    two buckets may share (the AOT looks up the bucket): the recorded call's bucket, else (the cubin check after
    the run) the schedule, a derived field of every entry of the buckets it serves."""
    if k[0] == "dape_reduce":
        return "dape_reduce", {"split": bool(k[1])}
    tag, ratio, d, coff, *rest, _dev = k
    op = {"r128fwd": "fwd_r128", "r128bwd": "bwd_r128"}.get(tag, tag)
    key = {"ratio": ratio, "d": d, "coff": coff}
    if op.endswith("_r128"):
        sched = rest.pop(0)
        key.update({"bucket": _bucket(op, _CALL["nb"])} if _CALL.get("nb") else {"schedule": list(sched)})
    return op, dict(key, deterministic=bool(rest[0])) if rest else key


PARITY = Parity(
    family="csa_compressor", doc=__doc__, cases=cases, inputs=inputs, outputs=outputs, reference=reference, buffers=buffers, label=label,
    inputs_of=lambda name, spec: spec["inputs"],
    jit=Jit(setup=_setup, caches={"generic": (BASE, "_COMPILED"), "r128": (BASE + "_r128", "_COMPILED")}, index_key=_index_key, call=_jit),
    aot=Aot(call=_aot, module="dsa_aot.csa"), calls=200,
    quick="the same list (every case is small)", bench=("r128-c2-d128-s-nb64-fwd", "r128-c2-d128-s-nb64-bwd_det"),
)

if __name__ == "__main__":
    sys.exit(PARITY.main())
