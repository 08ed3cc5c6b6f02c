#!/usr/bin/env python3
"""Offline check of the SM100 call conventions (sparse attention backward and forward, indexer forward) against a build.

There is no SM100 GPU here, so the op's SM100 path cannot launch. This runs it for every shipped
SM100 entry of ``dsa_aot/_generated`` (or ``--gen DIR``) with the real lifted launcher in place of the
driver, at one (S_q, S_kv) per key that makes the dispatch pick exactly that entry (the shapes the
fidelity check prepares upstream's plan at, up to S_q 100000 / S_kv 8M; pointer-only stand-ins for
the tensors). The op must pass every argument the host function declares, the host code's own checks
must pass, every launch must go to the caller's stream, every tensor and both workspace segments
must reach a kernel parameter, and d_sink must be cleared exactly where upstream's kernels accumulate
into it atomically. The indexer forward (:func:`check_indexer_forward`): at a BSHD and a THD-like shape
per entry, the op's recorded launch passes every argument, reaches every tensor and launches upstream's grid (ceil(S_q * H / m), 1, B) on the caller's stream; the sparse
attention forward (:func:`check_sparse_forward`) likewise, its grid (S_q, 1, 1) for H 64 and (2 S_q,
1, 1) in two-CTA clusters for H 128. Needs no
torch and no GPU. Exit status 1 on any failure.

    python ci/check_sm100_calls.py [--gen dsa_aot/_generated]

``tests/unit/test_runtime_cpu.py`` runs :func:`check_call` on the SM100 entries of ``tests/data``.
"""

from __future__ import annotations

import argparse
import struct
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NAMES = ("q", "kv", "out", "dout", "lse", "attn_sink", "topk_idxs", "topk_length", "dq", "dkv", "d_sink", "workspace")
STREAM = 7


class Buf:
    """A stand-in for a contiguous device tensor: only its address is read."""

    def __init__(self, i):
        self.p = 0x7F00_0000_0000 + ((i + 1) << 36)

    def data_ptr(self):
        return self.p


def check_call(ns: dict, op: str, key: dict, arch: str, sm_count: int, s_q: int, s_kv: int) -> list:
    """Run the op's SM100 call of (op, key) at (S_q, S_kv) on launcher namespace ``ns``; return problems."""
    import dsa_aot.ops.dsa_sparse_attention_backward as op_mod
    from dsa_aot.policy import dsa_sparse_attention_backward as policy
    from dsa_aot.policy._math import prod, round_up

    dim, dtype = (576, "bf16") if op == "bwd_d576" else (key["dim"], key["dtype"])
    h, topk, det, tl = key["heads"], key["topk"], key["deterministic"], key["topk_length"]
    ks = policy.kernels(arch, h, dim, topk, has_topk_length=tl, deterministic=det, s_q=s_q, s_kv=s_kv, sm_count=sm_count)
    if ks["bwd"] != (op, key):
        return [f"at S_q {s_q} S_kv {s_kv} the dispatch picks {ks['bwd']}"]
    runs, memsets, problems = [], [], []

    def run(args):
        if len(args) != len(ns["ARGS"]):
            raise AssertionError(f"{len(args)} arguments, the host function takes {len(ns['ARGS'])}")
        bufs = [bytearray.fromhex(L["template"]) for L in ns["LAUNCHES"]]
        seq = []
        ns["launch"](lambda k, dims: seq.append((k, tuple(dims), bytes(bufs[k]))), *bufs, *args)
        return seq

    from dsa_aot.ops.plan import Recorder, Sym

    saved = op_mod.launcher, op_mod.sm_count_of
    op_mod.launcher = lambda family, op_, key_, dev, hint="": None  # recorded, never called
    op_mod.sm_count_of = lambda dev: sm_count
    t = {k: Buf(i) for i, k in enumerate(NAMES)}
    # the op records its call symbolically (pointers in the order of its tensors); replay it with the stand-ins' addresses
    order = op_mod.SparseAttentionBackward._tensors
    values = {f"p[{i}]": t[k].p for i, k in enumerate(order)} | {"s": STREAM, "x[0]": 0.5}

    def val(a):
        return a.value(values) if isinstance(a, Sym) else a

    try:
        rec = Recorder(len(order), 1)
        op_mod._sm100_call(rec, ks["bwd"], 0, s_q, s_kv, h, dim, topk, tl)
        memsets += [(val(ptr), n) + ((word,) if word else ()) for ptr, n, word in rec.memsets]
        runs += [run([val(a) for a in args]) for _, args in rec.launches]
    except Exception as ex:  # noqa: BLE001 - every failure is reported with its entry
        return [f"{type(ex).__name__}: {ex}"]
    finally:
        op_mod.launcher, op_mod.sm_count_of = saved
    (seq,) = runs
    if len({k for k, _, _ in seq}) < 3 or any(dims[7] != STREAM for _, dims, _ in seq):
        problems.append(f"launch sites {[k for k, _, _ in seq]}, streams {sorted({dims[7] for _, dims, _ in seq})}")
    blob = b"".join(b for _, _, b in seq)
    backend = policy.select_backend(h, dim, dtype, topk, det)[0]
    lse_shape, _ = policy.sm100_workspace_shapes(s_q, s_kv, dim, h, det, backend)
    ptrs = {k: b.p for k, b in t.items() if k != "topk_length" or tl}
    ptrs["workspace (dKV segment)"] = t["workspace"].p + round_up(prod(lse_shape), policy.WS_ALIGN)
    missing = [k for k, p in ptrs.items() if struct.pack("<Q", p) not in blob]
    if missing:
        problems.append(f"{', '.join(missing)} never reach a kernel parameter")
    atomic_sink = op == "bwd" and backend != "h128_2cta_m64" and not det
    if memsets != ([(t["d_sink"].p, h * 4)] if atomic_sink else []):
        problems.append(f"memsets {memsets} (upstream clears d_sink first: {atomic_sink})")
    return problems


class _T:
    """A stand-in for a contiguous tensor of ``shape``: what the op's recording reads (shape, stride())."""

    def __init__(self, shape):
        self.shape = tuple(shape)

    def stride(self):
        out, acc = [], 1
        for n in reversed(self.shape):
            out.append(acc)
            acc *= n
        return tuple(reversed(out))


def _replay(ns, rec, values, want):
    """The single launch ``rec`` holds, its arguments resolved with ``values`` and checked against
    ``want`` (upstream's order, written by the caller), run through launcher namespace ``ns``:
    (launch dims, parameter bytes). AssertionError with what differs otherwise."""
    from dsa_aot.ops.plan import Sym

    ((_, args),) = rec.launches
    args = [a.value(values) if isinstance(a, Sym) else a for a in args]
    if args != want:
        raise AssertionError(f"host-function arguments {args} differ from upstream's order {want}")
    if len(args) != len(ns["ARGS"]):
        raise AssertionError(f"{len(args)} arguments, the host function takes {len(ns['ARGS'])}")
    bufs = [bytearray.fromhex(L["template"]) for L in ns["LAUNCHES"]]
    seq = []
    ns["launch"](lambda k, dims: seq.append((k, tuple(dims), bytes(bufs[k]))), *bufs, *args)
    if len(seq) != 1:
        raise AssertionError(f"{len(seq)} launches (upstream launches one)")
    return seq[0][1], seq[0][2]


def _fakes(shapes, names):
    """What the op-call checks record against: fake tensors of ``shapes`` (None: absent), a made-up distinct
    pointer per tensor, the values a replay binds (those pointers, the stream, the scale 0.5), a Recorder,
    and ``t(i)``: tensor i as upstream's argument list takes it (pointer, extents, non-unit strides)."""
    from dsa_aot.ops.plan import Recorder

    ts = [None if sh is None else _T(sh) for sh in shapes]
    ptr = {f"p[{i}]": 0x7F00_0000_0000 + ((i + 1) << 36) for i in range(len(names))}

    def t(i):
        return [] if ts[i] is None else [ptr[f"p[{i}]"], *ts[i].shape, *ts[i].stride()[:-1]]

    return ts, ptr, ptr | {"s": STREAM, "x[0]": 0.5}, Recorder(len(names), 1), t


def check_indexer_forward(ns: dict, key: dict, s_q: int, s_k: int, batch: int = 3) -> list:
    """Record the op's SM100 indexer-forward launch of ``key`` (BSHD S_q x S_k, or THD segments of at
    most that) and run it through launcher namespace ``ns``; return problems."""
    import dsa_aot.ops.dsa_indexer_forward as op_mod
    from dsa_aot.policy import dsa_indexer_forward as policy

    prec, h, vl = key["precision"], key["heads"], key["varlen"]
    d = 64 if prec == "mxfp4" else 128
    s_kp = policy.padded(s_k)
    if vl:
        tq, tk = batch * s_q, batch * s_k
        shapes = [(tq, s_kp), None, (tq, h, d), (tk, 1, d), (tq, h)]
        scores = (tq, s_k)
    else:
        shapes = [(batch, s_q, s_kp), None, (batch, s_q, h, d), (batch, s_k, 1, d), (batch, s_q, h)]
        scores = (batch, s_q, s_k)
    if prec == "bf16":
        shapes += [None, None]
    elif vl:
        shapes += [(1, 128 * batch * -(-s_q * h // 128), 4), (1, 128 * batch * -(-s_k // 128), 4)]
    else:
        shapes += [(batch, -(-s_q * h // 128) * 128, 4), (batch, -(-s_k // 128) * 128, 4)]
    shapes += [(batch + 1,), (batch + 1,)] if vl else [None, None]
    shapes += [(batch,) if key["offsets"] else None]
    shapes += [(batch + 1,), (batch + 1,)] if vl and prec != "bf16" else [None, None]
    names = op_mod._TENSORS
    ts, ptr, values, rec, t = _fakes(shapes, names)
    c = op_mod._Call(dev=0, arch="sm_100a", sm100=True, varlen=vl, b=batch, s_q=s_q, s_k=s_k, h=h, scores=scores, lse=None, prec=prec,
                     w_dtype=key["w_dtype"])

    # upstream's order (_interface._indexer_fwd_bound's cute.compile call), each tensor as its pointer, extents and non-unit strides
    out = [ptr["p[0]"], *scores, *[st * s_kp for st in _T(scores[:-1]).stride()]]
    want = t(2) + t(3) + t(4) + t(5) + t(6) + out + [0.5, s_q, s_k] + t(7) + t(8) + t(10) + t(11) + t(9) + [STREAM]
    try:
        op_mod._record(rec, c, "fwd_sm100", None, ts)
        dims, blob = _replay(ns, rec, values, want)
    except Exception as ex:  # noqa: BLE001 - every failure is reported with its entry
        return [f"{type(ex).__name__}: {ex}"]
    problems = []
    m = policy.sm100_m_block(prec, h)
    if tuple(dims[:3]) != (-(-s_q * h // m), 1, batch) or dims[7] != STREAM:
        problems.append(f"grid {dims[:3]} on stream {dims[7]} (upstream: ({-(-s_q * h // m)}, 1, {batch}) on the caller's stream {STREAM})")
    for i, (name, tt) in enumerate(zip(names, ts)):
        if tt is not None and struct.pack("<Q", ptr[f"p[{i}]"]) not in blob:
            problems.append(f"{name} never reaches a kernel parameter")
    return problems


def check_sparse_forward(ns: dict, key: dict, s_q: int, s_kv: int, k: int) -> list:
    """Record the op's sparse-attention-forward launch of ``key`` at (S_q, S_kv, K index slots, a
    multiple of 64) and run it through launcher namespace ``ns``; return problems."""
    import dsa_aot.ops.dsa_sparse_attention_forward as op_mod

    h, d, it = key["heads"], key["dim"], key["indexer_topk"]
    shapes = [(s_q, h, 512), (s_q, h), (s_q, h), (s_q, h) if it else None, (s_q, h, d), (s_kv, d), (s_q, k), (h,) if key["sink"] else None,
              (s_q,) if key["topk_length"] else None]
    names = op_mod._TENSORS
    ts, ptr, values, rec, t = _fakes(shapes, names)

    # upstream's order (_interface_sm100._compile_kernel): q, kv, idx, out, max_logits, lse, [lse_indexer], [sink], [topk_length]
    want = t(4) + t(5) + t(6) + t(0) + t(1) + t(2) + t(3) + t(7) + t(8) + [0.5, STREAM]
    try:
        op_mod._record(rec, None, ts)
        dims, blob = _replay(ns, rec, values, want)
    except Exception as ex:  # noqa: BLE001 - every failure is reported with its entry
        return [f"{type(ex).__name__}: {ex}"]
    grid = (s_q, 1, 1) if h == 64 else (2 * s_q, 1, 1)  # H64: a CTA per query; H128: two-CTA clusters over the problem (CLC)
    problems = []
    if tuple(dims[:3]) != grid or dims[7] != STREAM:
        problems.append(f"grid {dims[:3]} on stream {dims[7]} (upstream: {grid} on the caller's stream {STREAM})")
    for i, (name, tt) in enumerate(zip(names, ts)):
        if tt is not None and struct.pack("<Q", ptr[f"p[{i}]"]) not in blob and name not in ("q", "kv", "out"):  # those three: TMA descriptors
            problems.append(f"{name} never reaches a kernel parameter")
    return problems


def check_fused_gemm(ns: dict, key: dict, b: int, s_q: int, s_k: int) -> list:
    """Record the fused top-k's GEMM launch of ``key`` (BSHD B x S_q x S_k, or THD segments of at most
    that) and run it through ``ns``; return problems."""
    import dsa_aot.ops.dsa_indexer_forward_top_k as op_mod
    from dsa_aot.ops.args import tensor_args
    from dsa_aot.policy import dsa_indexer_forward_top_k as policy

    prec, h, ratio, offs, lse, vl = key["precision"], key["heads"], key["ratio"], key["offsets"], key["lse"], key["varlen"]
    d = 64 if prec == "mxfp4" else 128
    pbf = policy.cand_floats(s_q, ratio)
    cand_2d = key["cand"] == "2d"
    cbo = key["cand"] == "1d_cbo"
    mx = prec != "bf16"
    tq, tk = b * s_q, b * s_k
    if vl:
        shapes = [(tq, 512), (tq, 512), None, (tq,) if lse else None, (b * pbf,), (tq, h, d), (tk, 1, d), (tq, h),
                  (1, 128 * b * -(-s_q * h // 128), 4) if mx else None, (1, 128 * b * -(-s_k // 128), 4) if mx else None,
                  (b,) if offs else None, (b + 1,), (b + 1,), (b + 1,), (b + 1,) if mx else None, (b + 1,) if mx else None]
    else:
        shapes = [(b, s_q, 512), (b, s_q, 512), None, (b, s_q) if lse else None, (b * pbf,), (b, s_q, h, d), (b, s_k, 1, d), (b, s_q, h),
                  (b, -(-s_q * h // 128) * 128, 4) if mx else None, (b, -(-s_k // 128) * 128, 4) if mx else None, (b,) if offs else None,
                  (b + 1,) if cbo else None, None, None, None, None]
    names = op_mod._TENSORS
    ts, ptr, values, rec, t = _fakes(shapes, names)

    # upstream's order (_compressed_top_k_sm100's cute.compile calls), written down here, not taken from the op
    cand = [ptr["p[4]"], b, pbf, pbf] if cand_2d else [ptr["p[4]"], b * pbf]
    want = t(5) + t(6) + t(7) + t(8) + t(9) + cand + t(3) + [0.5, s_q, s_k] + t(12) + t(13) + t(14) + t(15) + t(10) + [STREAM] + t(11)
    p = rec.p

    def a(i):
        return None if ts[i] is None else tensor_args(ts[i], p[i])

    try:
        op_mod._record_gemm(rec, None, a(5), a(6), a(7), (a(8), a(9)) if mx else None, (p[4], b, pbf, pbf) if cand_2d else (p[4], b * pbf),
                            a(3), s_q, s_k, [x for x in (a(12), a(13), a(14), a(15)) if x is not None], a(10), a(11))
        dims, blob = _replay(ns, rec, values, want)
    except Exception as ex:  # noqa: BLE001 - every failure is reported with its entry
        return [f"{type(ex).__name__}: {ex}"]
    m = policy.gemm_m_block(prec, h)
    if tuple(dims[:3]) != (-(-s_q * h // m), 1, b) or dims[7] != STREAM:
        return [f"grid {dims[:3]} on stream {dims[7]} (upstream: ({-(-s_q * h // m)}, 1, {b}) on the caller's stream)"]
    missing = [n for i, n in enumerate(names) if ts[i] is not None and n not in ("indices", "logits") and struct.pack("<Q", ptr[f"p[{i}]"]) not in blob]
    return [f"{', '.join(missing)} never reach a kernel parameter"] if missing else []


def check_dense_indexer_backward(ns: dict, op: str, key: dict, b: int, s_q: int, s_k: int) -> list:
    """Record the dense indexer backward's launch of entry (``op``, ``key``) (BSHD B x S_q x S_k, or THD
    B segments of at most that) and run it through ``ns``; return problems."""
    import dsa_aot.ops.dsa_dense_indexer_backward as op_mod
    from dsa_aot.ops.plan import Recorder

    vl, h, d = key["varlen"], key.get("heads", 64), 128
    lead, klead = ((b * s_q,), (b * s_k,)) if vl else ((b, s_q), (b, s_k))
    score = (b * s_q, s_k) if vl else (b, s_q, s_k)
    shapes = [lead + (h, d), lead + (h,), klead + (d,), lead + (h, d), lead + (h,), klead + (d,), score, lead, score, lead, (1,),
              (b + 1,) if vl else None, (b + 1,) if vl else None, (b,) if key["offsets"] else None, None]
    names = op_mod._TENSORS
    ts, ptr, values, _, t = _fakes(shapes, names)
    rec = Recorder(len(names), 2)
    values = values | {"x[1]": 0.25}
    # upstream's order (dense_indexer_backward_sm100's two cute.compile calls), written down here, not taken from the op
    if op == "score_grad":
        want = t(8) + t(6) + t(9) + t(7) + t(11) + t(12) + t(13) + t(10) + [0.5, s_q, s_k, STREAM]
        grid, block = (s_q, b, 1), 128
    else:
        want = t(3) + t(4) + t(5) + t(0) + t(1) + t(2) + t(8) + t(11) + t(12) + t(13) + [0.25, s_q, s_k, STREAM]
        grid, block = (-(-s_q // 2), b, 1), 384
    try:
        rec.launch(None, *op_mod._launch_args(op, ts, rec.p, vl, s_q, s_k, True, rec.x[0], rec.x[1], rec.s))
        dims, blob = _replay(ns, rec, values, want)
    except Exception as ex:  # noqa: BLE001 - every failure is reported with its entry
        return [f"{type(ex).__name__}: {ex}"]
    if tuple(dims[:4]) != (*grid, block) or dims[7] != STREAM:
        return [f"grid {dims[:3]} x {dims[3]} on stream {dims[7]} (upstream: {grid} x {block} on the caller's stream)"]
    reads = (8, 6, 9, 7, 10, 11, 12, 13) if op == "score_grad" else (0, 1, 2, 4, 8, 11, 12, 13)  # q, k and dQ may sit in TMA descriptors
    missing = [names[i] for i in reads if ts[i] is not None and struct.pack("<Q", ptr[f"p[{i}]"]) not in blob]
    return [f"{', '.join(missing)} never reach a kernel parameter"] if missing else []


def check_sparse_score(ns: dict, op: str, key: dict, b: int, s_q: int, s_k: int) -> list:
    """Record the sparse score recompute's launch of entry ``op`` ("sparse_indexer" or "sparse_attention")
    with ``key`` (B x S_q queries over S_k keys, with topk_length given when the key has it) and run it
    through ``ns``; return problems."""
    import dsa_aot.ops.dsa_score_recompute as op_mod

    h, topk, d = key["heads"], key["topk"], key.get("dim", 128)
    names = op_mod._ATTENTION.tensors if op == "sparse_attention" else op_mod._INDEXER.tensors
    shapes = [(b, s_q, topk), (b, s_q, h, d), (b, s_k, d), (b, s_q, h), (b, s_q, topk), (b, s_q) if key["length"] else None, None]
    ts, ptr, values, rec, t = _fakes(shapes, names)
    # upstream's order (_interface_sm100's cute.compile calls of both sparse ops), written down here: the
    # indexer's scale is 1.0 (no wrapper passes one), the attention's the call's
    want = t(1) + t(2) + t(3) + t(4) + t(0) + t(5) + [0.5 if op == "sparse_attention" else 1.0, STREAM]
    try:
        rec.launch(None, *op_mod._launch_args(op, key, ts, rec.p, rec.s, rec.x[:1] if op == "sparse_attention" else ()))
        dims, blob = _replay(ns, rec, values, want)
    except Exception as ex:  # noqa: BLE001 - every failure is reported with its entry
        return [f"{type(ex).__name__}: {ex}"]
    if dims[3] != 384 or dims[7] != STREAM:
        return [f"block {dims[3]} on stream {dims[7]} (upstream: 384 threads on the caller's stream)"]
    missing = [names[i] for i in (0, 4, 5) if ts[i] is not None and struct.pack("<Q", ptr[f"p[{i}]"]) not in blob]  # q, k, w / lse: TMA
    if op == "sparse_attention" and struct.pack("<f", 0.5) not in blob:
        missing.append("softmax_scale")
    return [f"{', '.join(missing)} never reach a kernel parameter"] if missing else []


def check_dense_score(ns: dict, op: str, key: dict, b: int, s_q: int, s_k: int) -> list:
    """Record a dense score recompute's SM100 launch of entry ``op`` ("dense_indexer" or "dense_attention") with
    ``key`` (BSHD B x S_q x S_k, or THD b segments of at most S_q / S_k rows, H_kv 1; the block-scaled indexer
    and attention with their e8m0 scales in upstream's packed shapes) and run it through ``ns``; return problems."""
    import dsa_aot.ops.dsa_score_recompute as op_mod

    h, vl, d = key["heads"], key["varlen"], key.get("dim", 128)
    prec = key.get("precision", "bf16")
    mx = prec != "bf16"
    cols = -(-d // 32 // 4) * 4  # e8m0 scales of a row (one per 32 values), padded to 4 columns: 4 at D128, 16 at D512
    d = 64 if prec == "mxfp4" else d  # e2m1 pairs: two values a stored element
    if vl:
        tq, tk = b * s_q, b * s_k
        shapes = [(tq, s_k), (tq,), (tq, h, d), (tk, 1, d), (tq, h), (b + 1,), (b + 1,), (b,) if key["offsets"] else None, None]
        scales = [(1, 128 * b * -(-s_q * h // 128), cols), (1, 128 * b * -(-s_k // 128), cols), (b + 1,), (b + 1,)]
    else:
        shapes = [(b, s_q, s_k), (b, s_q), (b, s_q, h, d), (b, s_k, 1, d), (b, s_q, h), None, None, (b,) if key["offsets"] else None, None]
        scales = [(b, -(-s_q * h // 128) * 128, cols), (b, -(-s_k // 128) * 128, cols), None, None]
    kind = op_mod._DENSE_INDEXER if op == "dense_indexer" else op_mod._DENSE_ATTENTION
    shapes += scales if mx else [None] * 4
    ts, ptr, values, rec, t = _fakes(shapes, kind.tensors)
    c = types.SimpleNamespace(varlen=vl, s_q=s_q, s_k=s_k)  # what the launch arguments read of a validated call
    # upstream's order (_interface_sm100._dense_indexer_ / _dense_attn_score_recompute's cute.compile calls, bf16 and block-scaled),
    # written down here: q, k, w / lse, [q_scale, k_scale], out, denom, scale, max_seqlen_q, max_seqlen_k, [cu_seqlens_q,
    # cu_seqlens_k, [their scale-padded twins]], [offsets], stream
    want = t(2) + t(3) + t(4) + t(9) + t(10) + t(0) + t(1) + [0.5, s_q, s_k] + (t(5) + t(6) + t(11) + t(12) if vl else []) + t(7) + [STREAM]
    try:
        rec.launch(None, *op_mod._dense_launch_args(op, ts, c, rec.p, rec.s, rec.x))
        dims, blob = _replay(ns, rec, values, want)
    except Exception as ex:  # noqa: BLE001 - every failure is reported with its entry
        return [f"{type(ex).__name__}: {ex}"]
    # bf16 attention 8 warps; the block-scaled 12; the mxfp8 attention's D128 H64 kernel 20 (four epilogue warp groups)
    threads = 256 if not mx else 640 if op == "dense_attention" and key["dim"] == 128 and h == 64 else 384
    if dims[3] != threads or dims[7] != STREAM:
        return [f"block {dims[3]} on stream {dims[7]} (upstream: {threads} threads on the caller's stream)"]
    grid = (-(-s_q * h // 128), 1, b)  # the indexer's M tile: 128 packed (query, head) rows; THD: max_seqlen_q and the segments
    if op == "dense_indexer" and tuple(dims[:3]) != grid:
        return [f"grid {dims[:3]} (upstream: {grid})"]
    # out and denom are plain pointers; the block-scaled kernel takes every tensor's address (its TMA descriptors hold them too)
    reads = [i for i, x in enumerate(ts) if x is not None and i != 8] if mx else (0, 1)
    missing = [kind.tensors[i] for i in reads if struct.pack("<Q", ptr[f"p[{i}]"]) not in blob]
    return [f"{', '.join(missing)} never reach a kernel parameter"] if missing else []


def check_build(gen) -> tuple[dict, list]:
    """Run the op's call of every SM100 entry of the build ``gen`` against its lifted host function:
    (entries checked per kind, problems)."""
    from dsa_aot.policy.dsa_sparse_attention_backward import sm100_shape
    from dsa_aot.runtime.index import Index
    from dsa_aot.toolchain import verify

    ix = Index(Path(gen))  # checked as the runtime checks it
    index = {"entries": ix.entries}
    bad, n = [], 0
    for e in index["entries"]:
        if e["family"] != "dsa_sparse_attention_backward" or e["op"] not in ("bwd", "bwd_d576"):
            continue
        op, key = e["op"], {k: v for k, v in e["key"].items() if k not in e.get("derived", ())}
        sm = e["target"]["sm_count"]  # the SM count this entry's persistent grid was built for
        s_q, s_kv = sm100_shape(op, key, sm)
        ns = verify.load_launcher(ix.member(e, "launcher").decode(), e["id"])
        bad += [f"{e['id']} (S_q {s_q}, S_kv {s_kv}): {p}" for p in check_call(ns, op, key, e["arch"], sm, s_q, s_kv)]
        n += 1
    m = 0
    for e in index["entries"]:
        if e["family"] != "dsa_indexer_forward" or e["op"] != "fwd_sm100":
            continue
        key = {k: v for k, v in e["key"].items() if k not in e.get("derived", ())}
        ns = verify.load_launcher(ix.member(e, "launcher").decode(), e["id"])
        for s_q, s_k in ((252, 63), (1, 4096)):
            bad += [f"{e['id']} (S_q {s_q}, S_k {s_k}): {p}" for p in check_indexer_forward(ns, key, s_q, s_k)]
        m += 1
    f = 0
    for e in index["entries"]:
        if e["family"] != "dsa_sparse_attention_forward":
            continue
        key = {k: v for k, v in e["key"].items() if k not in e.get("derived", ())}
        ns = verify.load_launcher(ix.member(e, "launcher").decode(), e["id"])
        for s_q, s_kv, k in ((8, 4096, 2048), (1, 100, 64), (1000, 70000, 2112)):
            if k >= key["indexer_topk"]:
                bad += [f"{e['id']} (S_q {s_q}, S_kv {s_kv}, K {k}): {p}" for p in check_sparse_forward(ns, key, s_q, s_kv, k)]
        f += 1
    g = 0
    for e in index["entries"]:
        if e["family"] != "dsa_indexer_forward_top_k" or e["op"] != "gemm":
            continue
        key = {k: v for k, v in e["key"].items() if k not in e.get("derived", ())}
        ns = verify.load_launcher(ix.member(e, "launcher").decode(), e["id"])
        for b, s_q, s_k in ((2, 256, 64), (1, 8192, 2048), (3, 5, 2)):
            bad += [f"{e['id']} (B {b}, S_q {s_q}, S_k {s_k}): {p}" for p in check_fused_gemm(ns, key, b, s_q, s_k)]
        g += 1
    dd = 0
    for e in index["entries"]:
        if e["family"] != "dsa_dense_indexer_backward" or e["arch"] == "sm_90a":
            continue
        key = {k: v for k, v in e["key"].items() if k not in e.get("derived", ())}
        ns = verify.load_launcher(ix.member(e, "launcher").decode(), e["id"])
        for b, s_q, s_k in ((2, 256, 64), (1, 8191, 8191), (3, 5, 2)):
            bad += [f"{e['id']} (B {b}, S_q {s_q}, S_k {s_k}): {p}" for p in check_dense_indexer_backward(ns, e["op"], key, b, s_q, s_k)]
        dd += 1
    sr = 0
    for e in index["entries"]:
        if e["family"] != "dsa_score_recompute" or e["op"] not in ("sparse_indexer", "sparse_attention", "dense_indexer", "dense_attention"):
            continue
        key = {k: v for k, v in e["key"].items() if k not in e.get("derived", ())}
        ns = verify.load_launcher(ix.member(e, "launcher").decode(), e["id"])
        for b, s_q, s_k in ((2, 64, 4096), (1, 4096, 300), (3, 5, 2)):
            problems = (check_dense_score(ns, e["op"], key, b, s_q, s_k) if e["op"].startswith("dense") else
                        check_sparse_score(ns, e["op"], key, b, s_q, s_k))
            bad += [f"{e['id']} (B {b}, S_q {s_q}, S_k {s_k}): {p}" for p in problems]
        sr += 1
    counts = {"SM100 sparse-backward": n, "SM100 indexer-forward": m, "sparse-forward": f, "fused top-k GEMM": g,
              "dense indexer backward": dd, "score recompute": sr}
    return counts, bad


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gen", default=str(ROOT / "dsa_aot" / "_generated"))
    a = ap.parse_args(argv)
    counts, bad = check_build(a.gen)
    print(", ".join(f"{v} {k}" for k, v in counts.items()) + f" entries: the op's call runs each lifted host function; {len(bad)} problems")
    for b in bad:
        print("  -", b)
    # a build without one of these kinds is not the default wheel's: nothing checked is not a pass
    missing = [k for k, v in counts.items() if not v]
    if missing:
        print(f"  - no {', '.join(missing)} entries in {a.gen}")
    return 1 if bad or missing else 0


if __name__ == "__main__":
    sys.exit(main())
