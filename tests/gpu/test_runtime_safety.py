"""The runtime as serving engines and training loops use it, on the GPU (the shipped sm_90a entries):

* 32 threads x 200 calls of each op, each thread on its own stream with its own inputs and outputs:
  every output equal to a single-threaded run of the same inputs: bitwise where the kernels have one
  writer per element, within 1e-2 relative (l2) where upstream accumulates with fp32 atomics (indexer
  dW and dK, sparse attention dKV and d_sink), whose order changes from run to run. A call carrying
  another thread's bytes gives an O(1) error either way (each thread has its own random inputs).
* Several GPUs (skipped with one): an op on cuda:1 tensors with the current device 0, and the reverse,
  gives the single-GPU result and leaves the other GPU's memory alone; a stream of GPU 1 with tensors
  on GPU 0 is refused.
* The first call of each op inside CUDA-graph capture (nothing loaded before): captured, replayed,
  equal to an eager run.
* 2,000 malformed calls: each raises an dsa_aot.errors exception and leaves the NaN-poisoned outputs and
  every input as they were.
"""

from __future__ import annotations

import inspect
import random
import threading

import pytest
import torch

pytestmark = pytest.mark.gpu

import ref_csa  # noqa: E402 - tests/gpu is on sys.path (tests/conftest.py)
import ref_indexer  # noqa: E402
import ref_sparse_attention  # noqa: E402
from refutil import generator  # noqa: E402


def same(o, w, exact):
    """``o`` equal to ``w``: bitwise, or (atomics) finite and within 1e-2 relative l2."""
    if exact:
        return torch.equal(o, w)
    o64, w64 = o.double(), w.double()
    return bool(torch.isfinite(o64).all()) and float((o64 - w64).norm()) <= 1e-2 * float(w64.norm())


def _poisoned(t):
    return torch.full_like(t, float("nan")) if t.is_floating_point() else torch.full_like(t, -1)


def csa_forward(dev, seed, nb=300):
    import dsa_aot.csa

    cu, cuc = ref_csa.random_segments(4, nb, generator(seed))
    x = ref_csa.random_inputs(cu, cuc, 4, 2, 128, generator(seed), device=f"cuda:{dev}")
    out = torch.full((x["total_comp"], 128), float("nan"), dtype=torch.bfloat16, device=f"cuda:{dev}")
    args = (out, x["kv"], x["score"], x["ape"], x["cu_seqlens"], x["cu_seqlens_comp"])
    return dsa_aot.csa.compressor_forward_into, args, dict(ratio=4, coff=2), (out,), (True,)


def csa_backward(dev, seed, nb=300):
    import dsa_aot.csa

    cu, cuc = ref_csa.random_segments(4, nb, generator(seed))
    x = ref_csa.random_inputs(cu, cuc, 4, 2, 128, generator(seed), device=f"cuda:{dev}")
    gkv, gs, gape = _poisoned(x["kv"]), _poisoned(x["score"]), _poisoned(x["ape"])
    ws = torch.empty(dsa_aot.csa.backward_workspace_bytes(x["total_comp"], 4, 128, 2, dev), dtype=torch.uint8, device=f"cuda:{dev}")
    args = (gkv, gs, gape, x["kv"], x["score"], x["ape"], x["cu_seqlens"], x["cu_seqlens_comp"], x["grad_out"])
    return dsa_aot.csa.compressor_backward_into, args, dict(ratio=4, coff=2, deterministic=True, workspace=ws), (gkv, gs, gape), (True, True, True)


def indexer_backward(dev, seed, s_q=64, s_k=1024):
    import dsa_aot.dsa

    x = ref_indexer.make_inputs(1, s_q, s_k, 64, 128, 512, device=f"cuda:{dev}", seed=seed, invalid_frac=0.05)
    dq, dw, dk = _poisoned(x["index_q"]), _poisoned(x["weights"]), _poisoned(x["index_k"])
    ws = torch.empty(dsa_aot.dsa.indexer_backward_workspace_bytes(1, s_k, 128), dtype=torch.uint8, device=f"cuda:{dev}")
    args = (dq, dw, dk, x["index_q"], x["weights"], x["index_k"], x["attn_score"], x["index_score"], x["topk_indices"], x["grad_loss"])
    # attn_score is overwritten: each call gets a fresh copy (see _fresh)
    return dsa_aot.dsa.indexer_backward_into, args, dict(sm_scale=0.7, loss_coeff=1.3, workspace=ws), (dq, dw, dk), (True, False, False)


def sparse_backward(dev, seed, s_q=64, s_kv=1024):
    import dsa_aot.dsa

    x = ref_sparse_attention.make_inputs(s_q, s_kv, 64, 512, 512, device=f"cuda:{dev}", seed=seed, invalid_frac=0.05)
    dq, dkv, d_sink = _poisoned(x["q"]), _poisoned(x["kv"]), _poisoned(x["attn_sink"])
    ws = torch.empty(dsa_aot.dsa.sparse_attention_backward_workspace_bytes(s_q, s_kv, 512, 64), dtype=torch.uint8, device=f"cuda:{dev}")
    args = (dq, dkv, d_sink, x["q"], x["kv"], x["out"], x["dout"], x["lse"], x["attn_sink"], x["topk_idxs"])
    return dsa_aot.dsa.sparse_attention_backward_into, args, dict(softmax_scale=x["softmax_scale"], workspace=ws), (dq, dkv, d_sink), (True, False, False)


def local_to_global(dev, seed, s_q=64, k=2048):
    import dsa_aot.dsa
    import ref_topk_utils

    local = ref_topk_utils.random_ids((2, s_q, k), 4096, generator(seed)).to(f"cuda:{dev}")
    out = torch.full((2, s_q, k), -1, dtype=torch.int32, device=f"cuda:{dev}")  # poisoned as _poisoned does ints
    return dsa_aot.dsa.local_to_global_into, (out, local), dict(seqlen_k=4096), (out,), (True,)


def compactify(dev, seed, rows=256, cols=2048):
    import dsa_aot.dsa
    import ref_topk_utils

    ids = ref_topk_utils.random_ids((rows, cols), 1 << 20, generator(seed)).to(f"cuda:{dev}")
    out, n = torch.full((rows, cols), -1, dtype=torch.int32, device=f"cuda:{dev}"), torch.full((rows,), -1, dtype=torch.int32, device=f"cuda:{dev}")
    return dsa_aot.dsa.compactify_into, (out, n, ids), {}, (out, n), (True, True)


def indexer_top_k(dev, seed, rows=200, cols=65536):
    import dsa_aot.dsa

    g = generator(seed)
    x = torch.randn((rows, cols), generator=g).to(f"cuda:{dev}")
    lens = torch.randint(1, cols + 1, (rows,), generator=g, dtype=torch.int32).to(f"cuda:{dev}")
    idx = torch.full((rows, 2048), -1, dtype=torch.int32, device=f"cuda:{dev}")
    val = torch.full((rows, 2048), float("nan"), device=f"cuda:{dev}")
    ws = torch.empty(dsa_aot.dsa.indexer_top_k_workspace_bytes(x), dtype=torch.uint8, device=f"cuda:{dev}")
    # deterministic: the ids come out ascending, so a run is bitwise comparable with another
    return dsa_aot.dsa.indexer_top_k_into, (idx, val, x, lens), dict(top_k=2048, deterministic=True, workspace=ws), (idx, val), (True, True)


def indexer_forward(dev, seed, b=2, s_q=256, s_k=64):
    import dsa_aot.dsa
    import ref_indexer_forward

    q, k, w, _, _ = ref_indexer_forward.random_inputs((b, s_q), (b, s_k), 64, generator(seed))
    q, k, w = q.to(f"cuda:{dev}"), k.to(f"cuda:{dev}"), w.to(f"cuda:{dev}")
    scores = torch.full((b, s_q, s_k), float("nan"), device=f"cuda:{dev}")
    lse = torch.full((b, s_q), float("nan"), device=f"cuda:{dev}")
    return dsa_aot.dsa.indexer_forward_into, (scores, lse, q, k, w), dict(ratio=4, sm_scale=0.3), (scores, lse), (True, True)


def dense_indexer_backward(dev, seed, s_q=256, s_k=128):
    """Key counts a multiple of 128: no tail K block (upstream's SM90 race, docs/research/dense-indexer-backward.md)."""
    import dsa_aot.dsa
    import ref_dense_indexer_backward

    x = ref_dense_indexer_backward.make_inputs(2, s_q, s_k, 64, ratio=4, sm_scale=0.6, device=f"cuda:{dev}", seed=seed)
    dq, dw, dk = _poisoned(x["index_q"]), _poisoned(x["weights"]), _poisoned(x["index_k"])
    ws = torch.empty(dsa_aot.dsa.dense_indexer_backward_workspace_bytes(x["index_k"].shape), dtype=torch.uint8, device=f"cuda:{dev}")
    args = (dq, dw, dk, x["index_q"], x["weights"], x["index_k"], x["attn_score"], x["attn_l1norm"], x["index_score"], x["index_lse"],
            x["grad_loss"])
    # index_score is overwritten: each call gets a fresh copy (see _call)
    return dsa_aot.dsa.dense_indexer_backward_into, args, dict(sm_scale=0.6, loss_coeff=1.3, ratio=4, workspace=ws), (dq, dw, dk), (True, False, False)


def sparse_indexer_score_recompute(dev, seed, s_q=64, s_k=1000):
    import dsa_aot.dsa

    g = generator(seed)
    b, h, topk = 2, 64, 512
    q = (torch.randn(b, s_q, h, 128, generator=g) * 128**-0.25).bfloat16().to(f"cuda:{dev}")
    k = (torch.randn(b, s_k, 128, generator=g) * 128**-0.25).bfloat16().to(f"cuda:{dev}")
    w = (torch.randn(b, s_q, h, generator=g) / 8).bfloat16().to(f"cuda:{dev}")
    ids = torch.rand(b * s_q, s_k, generator=g).topk(topk, dim=-1).indices.int().view(b, s_q, topk).to(f"cuda:{dev}")
    out = torch.full((b, s_q, topk), float("nan"), device=f"cuda:{dev}")
    ws = torch.empty(dsa_aot.dsa.sparse_indexer_score_recompute_workspace_bytes(w.shape, dev), dtype=torch.uint8, device=f"cuda:{dev}")
    return dsa_aot.dsa.sparse_indexer_score_recompute_into, (out, q, k, w, ids), dict(workspace=ws), (out,), (True,)


def sparse_attn_score_recompute(dev, seed, s_q=64, s_k=1000):
    import dsa_aot.dsa

    g = generator(seed)
    b, h, d, topk = 2, 64, 512, 512
    q = torch.randn(b, s_q, h, d, generator=g).bfloat16().to(f"cuda:{dev}")
    k = torch.randn(b, s_k, d, generator=g).bfloat16().to(f"cuda:{dev}")
    lse = (torch.rand(b, s_q, h, generator=g) * 2 + 6).to(f"cuda:{dev}")
    ids = torch.rand(b * s_q, s_k, generator=g).topk(topk, dim=-1).indices.int().view(b, s_q, topk).to(f"cuda:{dev}")
    out = torch.full((b, s_q, topk), float("nan"), device=f"cuda:{dev}")
    ws = torch.empty(dsa_aot.dsa.sparse_attn_score_recompute_workspace_bytes(lse.shape, dev), dtype=torch.uint8, device=f"cuda:{dev}")
    # the scale by keyword: the positional arguments are the call's tensors (what a plan takes)
    return dsa_aot.dsa.sparse_attn_score_recompute_into, (out, q, k, lse, ids), dict(softmax_scale=d**-0.5, workspace=ws), (out,), (True,)


def dense_indexer_score_recompute(dev, seed, s_q=128, s_k=96):
    import dsa_aot.dsa
    import ref_indexer_forward

    q, k, w, _, _ = ref_indexer_forward.random_inputs((2, s_q), (2, s_k), 64, generator(seed))
    q, k, w = q.to(f"cuda:{dev}"), k.to(f"cuda:{dev}"), w.to(f"cuda:{dev}")
    out = torch.full((2, s_q, s_k), float("nan"), device=f"cuda:{dev}")
    den = torch.full((2, s_q), float("nan"), device=f"cuda:{dev}")
    ws = torch.empty(dsa_aot.dsa.dense_indexer_score_recompute_workspace_bytes(w.shape, dev), dtype=torch.uint8, device=f"cuda:{dev}")
    return dsa_aot.dsa.dense_indexer_score_recompute_into, (out, den, q, k, w), dict(ratio=4, workspace=ws), (out, den), (True, True)


def dense_attn_score_recompute(dev, seed, s_q=128, s_k=96):
    import dsa_aot.dsa
    import ref_score_recompute

    q, k, lse, scale = ref_score_recompute.make_dense_attn_inputs(2, s_q, s_k, 64, 512, 4, seed=seed)
    q, k, lse = q.to(f"cuda:{dev}"), k.to(f"cuda:{dev}"), lse.to(f"cuda:{dev}")
    out = torch.full((2, s_q, s_k), float("nan"), device=f"cuda:{dev}")
    den = torch.full((2, s_q), float("nan"), device=f"cuda:{dev}")
    ws = torch.empty(dsa_aot.dsa.dense_attn_score_recompute_workspace_bytes(lse.shape, dev), dtype=torch.uint8, device=f"cuda:{dev}")
    return dsa_aot.dsa.dense_attn_score_recompute_into, (out, den, q, k, lse), dict(softmax_scale=scale, ratio=4, workspace=ws), (out, den), (True, True)


OPS = {"csa_forward": csa_forward, "csa_backward": csa_backward, "indexer_backward": indexer_backward, "sparse_backward": sparse_backward,
       "local_to_global": local_to_global, "compactify": compactify, "indexer_top_k": indexer_top_k, "indexer_forward": indexer_forward,
       "dense_indexer_backward": dense_indexer_backward, "sparse_indexer_score_recompute": sparse_indexer_score_recompute,
       "sparse_attn_score_recompute": sparse_attn_score_recompute, "dense_indexer_score_recompute": dense_indexer_score_recompute,
       "dense_attn_score_recompute": dense_attn_score_recompute}
_OVERWRITTEN = {"indexer_backward_into": 6, "dense_indexer_backward_into": 8}  # the input each op overwrites (attn_score / index_score)


def _call(fn, args, kw, stream=None):
    """One call; the input the op overwrites (the indexer backwards' scores) given as a fresh copy."""
    i = _OVERWRITTEN.get(fn.__name__)
    if i is not None:
        args = list(args)
        args[i] = args[i].clone()
    fn(*args, **kw, **({"stream": stream} if stream is not None else {}))


def in_threads(work, n) -> list:
    """Run ``work(i)`` for i < n, each in its own thread, all at once; the exceptions they raised, once
    every thread has ended and the devices are synchronised."""
    errors = []

    def run(i):
        try:
            work(i)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    torch.cuda.synchronize()
    return errors


@pytest.mark.parametrize("op", sorted(OPS))
def test_32_threads_on_their_own_streams_match_a_single_threaded_run(op):
    threads, calls = 32, 200
    setups = [OPS[op](0, seed=100 + i) for i in range(threads)]
    want = []
    for fn, args, kw, outs, _ in setups:
        _call(fn, args, kw)
        torch.cuda.synchronize()
        want.append([o.clone() for o in outs])
        for o in outs:
            o.fill_(float("nan") if o.is_floating_point() else -1)
    streams = [torch.cuda.Stream() for _ in range(threads)]

    def work(i):
        fn, args, kw, _, _ = setups[i]
        with torch.cuda.stream(streams[i]):
            for _ in range(calls):
                _call(fn, args, kw, streams[i])

    errors = in_threads(work, threads)
    assert not errors, errors[:3]
    for i, (_, _, _, outs, exact) in enumerate(setups):
        for j, (o, w, e) in enumerate(zip(outs, want[i], exact)):
            assert same(o, w, e), f"thread {i}: output {j} differs from its single-threaded run"


needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (the nvidia-h200-x2 machine)")


@needs_two
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("current, data", [(0, 1), (1, 0)])
def test_an_op_runs_on_its_tensors_device_whatever_the_current_device(op, current, data):
    fn, args, kw, outs, exact = OPS[op](data, seed=7)
    ref_fn, ref_args, ref_kw, ref_outs, _ = OPS[op](data, seed=7)
    with torch.cuda.device(data):
        _call(ref_fn, ref_args, ref_kw)
    torch.cuda.synchronize(data)
    other = torch.full((1 << 20,), 7.0, device=f"cuda:{current}")
    with torch.cuda.device(current):
        assert torch.cuda.current_device() == current
        _call(fn, args, kw)
        assert torch.cuda.current_device() == current
    for d in (0, 1):
        torch.cuda.synchronize(d)
    for o, w, e in zip(outs, ref_outs, exact):
        assert same(o, w, e)
    assert bool((other == 7.0).all())


@needs_two
@pytest.mark.parametrize("op", sorted(OPS))
def test_a_stream_of_another_gpu_is_refused(op):
    from dsa_aot.errors import InputError

    fn, args, kw, outs, _ = OPS[op](0, seed=3)
    s1 = torch.cuda.Stream(device=1)
    for stream in (s1, s1.cuda_stream):
        with pytest.raises(InputError, match="cuda:1|not a stream of cuda:0"):
            _call(fn, args, kw, stream)
    torch.cuda.synchronize(0)
    assert all(bool(torch.isnan(o).all()) if o.is_floating_point() else bool((o == -1).all()) for o in outs)


@pytest.mark.parametrize("op", sorted(OPS))
def test_the_first_call_inside_graph_capture_is_captured(op):
    """Run in a fresh process: nothing of the build is loaded before the capture starts."""
    import subprocess
    import sys
    from pathlib import Path

    code = f"""
import sys, torch
sys.path[:0] = {[str(Path(__file__).parent), str(Path(__file__).parents[2])]!r}
import test_runtime_safety as t
import dsa_aot.runtime.index as ix
fn, args, kw, outs, exact = t.OPS[{op!r}](0, seed=11)
ref = t.OPS[{op!r}](0, seed=11)
assert not ix._INDEX or not ix._INDEX._loaded
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    with torch.cuda.graph(g, stream=s):
        t._call(fn, args, kw)
torch.cuda.synchronize()
t._call(*ref[:3])
torch.cuda.synchronize()
for o in outs:
    o.fill_(float("nan") if o.is_floating_point() else -1)
g.replay()
torch.cuda.synchronize()
assert all(t.same(o, w, e) for o, w, e in zip(outs, ref[3], exact)), "replay differs from an eager run"
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]


_ELEMENT_ALIGNED = {"indexer_top_k": ("indices", "values", "seq_lens"), "dense_indexer_backward": ("grad_loss",)}  # per op, where it differs from the default


def test_2000_malformed_calls_change_nothing():
    """Malformed variants of every op's valid call (as tests/unit/ops/test_fuzz.py on the CPU, here on
    the GPU): each raises an dsa_aot.errors class; the poisoned outputs and the inputs stay as they were."""
    from dsa_aot.errors import AotError

    rng = random.Random(7)
    bad_scalars = {"ratio": [3, 4.0, None], "coff": [3, 2.0], "sm_scale": [1e39, float("nan")], "loss_coeff": [float("inf")],
                   "softmax_scale": [1e39, "x"], "deterministic": [2, "yes"], "workspace": ["ws"], "seqlen_k": [-1, 2**31, 3.0]}
    counts = {}
    for op, make in OPS.items():
        fn, args, kw, outs, _ = make(0, seed=5)
        names = list(inspect.signature(fn).parameters)
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + [v for v in kw.values() if isinstance(v, torch.Tensor)]
        before = [t.clone() for t in tensors]
        for _ in range(500):
            a, k = list(args), dict(kw)
            what = rng.choice(["dtype", "cpu", "strides", "misaligned", "alias", "scalar", "stream"])
            i = rng.choice([j for j, v in enumerate(a) if isinstance(v, torch.Tensor)])  # (the attention's scale is positional)
            if what == "dtype":
                a[i] = a[i].to(torch.float64 if a[i].dtype != torch.float64 else torch.float32)
            elif what == "cpu":
                a[i] = a[i].cpu()
            elif what == "strides" and a[i].ndim >= 2 and a[i].shape[-1] > 1 and a[i].shape[-2] > 1:
                a[i] = a[i].transpose(-1, -2)
            elif what == "misaligned" and a[i].element_size() < 16 and names[i] not in _ELEMENT_ALIGNED.get(op, ("cu_seqlens", "cu_seqlens_comp", "lse")):
                # (those need only their element's alignment); the same values, so that a call
                # wrongly accepted computes rather than faulting on garbage
                flat = torch.empty(a[i].numel() + 1, dtype=a[i].dtype, device=a[i].device)[1:]
                a[i] = flat.view(a[i].shape).copy_(a[i])
            elif what == "alias" and i < len(outs):
                a[i] = next(x for x in a[len(outs):] if isinstance(x, torch.Tensor))
            elif what == "scalar" and set(bad_scalars) & set(k):
                name = rng.choice(sorted(set(bad_scalars) & set(k)))
                k[name] = rng.choice(bad_scalars[name])
            else:
                k["stream"] = rng.choice([-1, 2**64, "s0", 3.5, 2**64 - 1])  # a made-up live-looking handle crashes the driver itself
            with pytest.raises(AotError) as raised:
                fn(*a, **k)
            counts[raised.type.__name__] = counts.get(raised.type.__name__, 0) + 1
        torch.cuda.synchronize()
        for t, b in zip(tensors, before):
            assert torch.equal(t.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{op}: a tensor changed"  # bitwise: NaN inputs too
    assert sum(counts.values()) >= 1900, counts
    assert set(counts) <= {"InputError", "KernelNotFoundError"}, counts
