"""The differentiable ops on the GPU: ``dsa_aot.csa.compressor`` and ``dsa_aot.dsa.sparse_attention``.

CSA compressor (the shipped sm_90a entries on the H200, a case in every ratio-128 bucket and at
ratio 2 and 4): the op's output and ``torch.autograd.grad`` of kv, score and ape against the fp64
reference of ``ref_csa.py`` (``csa_forward_ref``; ``csa_backward_ref``, autograd through the fp64
forward), with test_csa_ops.py's tolerance table and its exact-zero check of never-consumed positions;
bitwise the outputs of ``compressor_forward`` / ``compressor_backward`` on the same inputs (grad_ape
only when deterministic: the atomic path's order changes from run to run). Then through
``torch.compile(fullgraph=True)``, forward and backward graphs, bitwise equal to eager; and forward
plus ``torch.autograd.grad`` captured in one CUDA graph, replayed on new values and a new
segmentation. The op allocates what it writes, so only the graph's static outputs pre-exist: they
are NaN-poisoned before each replay.

Sparse attention (upstream's training.sparse_attention): the forward has SM100 cubins only. On an
SM100 GPU, out / lse / max_logits against ``ref_sparse_attention.sparse_attention_forward_ref`` and
the gradients of q, kv and the sink against ``sparse_attention_backward_ref`` (on the op's own out and
lse, as the kernels use them; ``REL_ERR_BOUNDS``). On any other GPU (the H200) the op raises the
forward's own error for the call it would make, before anything runs; the numeric tests skip there.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

import ref_csa  # noqa: E402 - tests/gpu is on sys.path (tests/conftest.py)
import ref_sparse_attention as ref  # noqa: E402
from test_csa_ops import Shape, _cuda_kernel_events, _seed, _three_segments, assert_bitwise, check_backward, check_forward, make_case  # noqa: E402

import dsa_aot.library  # noqa: E402,F401 - registering the ops is no graph op: before torch.compile traces one
from dsa_aot.errors import AotError, InputError, KernelNotFoundError  # noqa: E402


@pytest.fixture(scope="module")
def csa():
    import dsa_aot.csa

    return dsa_aot.csa


@pytest.fixture(scope="module")
def dsa():
    import dsa_aot.dsa

    return dsa_aot.dsa


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


def _leaves(x):
    """kv, score and ape of a case as fresh leaves that require grad."""
    return tuple(x[k].detach().clone().requires_grad_() for k in ("kv", "score", "ape"))


# --- CSA compressor -------------------------------------------------------------------------------------

# (ratio, coff, d, shape, deterministic): ratio 128 in the small (nb_total <= 128 / <= 192) and default
# (129..1023 / > 192) forward and backward buckets; ratio 2 and 4 with padding rows and tokens, short
# and empty segments; both dAPE paths.
CASES = [
    (4, 2, 128, Shape(9, pad_rows=3, pad_tokens=2, empty=True), False),
    (4, 1, 512, Shape(300, pad_rows=4), True),
    (2, 2, 512, Shape(40, pad_rows=2, pad_tokens=1), True),
    (2, 1, 128, Shape(120), False),
    (128, 2, 512, Shape(5, pad_rows=1, empty=True), False),
    (128, 1, 128, Shape(193, short=False), True),
]


@pytest.mark.parametrize("ratio,coff,d,shape,deterministic", CASES,
                         ids=[f"r{c[0]}-coff{c[1]}-d{c[2]}-{c[3].id()}-{'det' if c[4] else 'atomic'}" for c in CASES])
def test_compressor_and_its_gradients_match_the_reference(csa, ratio, coff, d, shape, deterministic):
    x = make_case(ratio, coff, d, shape, _seed("autograd", ratio, coff, d, shape.id(), deterministic))
    kv, score, ape = _leaves(x)
    cu, cuc = x["cu_seqlens"], x["cu_seqlens_comp"]
    out = csa.compressor(kv, score, ape, cu, cuc, ratio=ratio, head_dim=d, coff=coff, total_comp=x["total_comp"], deterministic=deterministic)
    grads = torch.autograd.grad(out, (kv, score, ape), x["grad_out"])
    torch.cuda.synchronize()
    assert out.requires_grad and out.dtype == torch.bfloat16
    check_forward(out.detach(), x, ratio, coff, d)
    check_backward(grads, x, ratio, coff, d)
    # the underlying ops on the same inputs: the same kernels, the same bits
    args = (x["kv"], x["score"], x["ape"], cu, cuc)
    want = csa.compressor_forward(*args, ratio=ratio, coff=coff, total_comp=x["total_comp"])["out"]
    g = csa.compressor_backward(*args, x["grad_out"], ratio=ratio, coff=coff, deterministic=deterministic)
    torch.cuda.synchronize()
    assert_bitwise("out", out.detach(), want, x["ctx"])
    assert_bitwise("grad_kv", grads[0], g["grad_kv"], x["ctx"])
    assert_bitwise("grad_score", grads[1], g["grad_score"], x["ctx"])
    if deterministic:
        assert_bitwise("grad_ape", grads[2], g["grad_ape"], x["ctx"])


def test_compressor_total_comp_from_the_device(csa):
    """total_comp=None: the forward reads cu_seqlens_comp[-1] (a device sync), as compressor_forward."""
    ratio, coff, d = 4, 2, 128
    x = make_case(ratio, coff, d, Shape(60, pad_tokens=3), _seed("autograd-none", ratio, coff, d))
    kv, score, ape = _leaves(x)
    out = csa.compressor(kv, score, ape, x["cu_seqlens"], x["cu_seqlens_comp"], ratio=ratio, coff=coff, deterministic=True)
    grads = torch.autograd.grad(out, (kv, score, ape), x["grad_out"])
    torch.cuda.synchronize()
    assert out.shape == (60, d)
    check_forward(out.detach(), x, ratio, coff, d)
    check_backward(grads, x, ratio, coff, d)


@pytest.mark.parametrize("deterministic", (True, False), ids=("det", "atomic"))
def test_compressor_under_torch_compile_fullgraph(csa, deterministic):
    """A function calling the op, compiled with fullgraph=True (the op's fake gives the shapes; the
    backward graph holds the backward op): the reference's numbers, and eager's bits."""
    ratio, coff, d = 4, 2, 128
    x = make_case(ratio, coff, d, Shape(300, pad_rows=4, pad_tokens=3), _seed("autograd-compile", deterministic))
    total = x["total_comp"]

    def step(kv, score, ape, cu, cuc):
        return csa.compressor(kv, score, ape, cu, cuc, ratio=ratio, coff=coff, total_comp=total, deterministic=deterministic)

    compiled = torch.compile(step, fullgraph=True)
    runs = []
    for fn in (compiled, step):
        leaves = _leaves(x)
        out = fn(*leaves, x["cu_seqlens"], x["cu_seqlens_comp"])
        runs.append((out.detach(), *torch.autograd.grad(out, leaves, x["grad_out"])))
        torch.cuda.synchronize()
    got, want = runs
    check_forward(got[0], x, ratio, coff, d)
    check_backward(got[1:], x, ratio, coff, d)
    for i, name in enumerate(("out", "grad_kv", "grad_score", "grad_ape")[: 4 if deterministic else 3]):
        assert_bitwise(name, got[i], want[i], x["ctx"] + " compiled vs eager")


@pytest.mark.parametrize("ratio,coff,d,deterministic", [(4, 2, 128, False), (128, 1, 512, True)])
def test_compressor_forward_and_backward_capture_in_one_cuda_graph(csa, ratio, coff, d, deterministic):
    """The op and torch.autograd.grad captured together (the first call warmed up on a side stream, as
    torch's CUDA graph docs do), replayed with new values and, last, a new segmentation of the same
    token capacity and total_comp; the static outputs NaN-poisoned before each replay."""
    n_blocks = 40
    total_tokens, total_comp = n_blocks * ratio, n_blocks + 2
    gen = torch.Generator().manual_seed(_seed("autograd-graph", ratio, coff, d, deterministic))
    gen_dev = torch.Generator(device="cuda").manual_seed(_seed("autograd-graph-dev", ratio, coff, d, deterministic))
    cu, cuc = _three_segments(ratio, total_tokens, gen)
    x = ref_csa.random_inputs(cu, cuc, ratio, coff, d, gen_dev, pad_rows=total_comp - cuc[-1], device="cuda")
    static = {k: x[k].clone() for k in ("kv", "score", "ape", "cu_seqlens", "cu_seqlens_comp", "grad_out")}
    leaves = tuple(static[k].requires_grad_() for k in ("kv", "score", "ape"))

    def step():
        out = csa.compressor(*leaves, static["cu_seqlens"], static["cu_seqlens_comp"], ratio=ratio, coff=coff, total_comp=total_comp,
                             deterministic=deterministic)
        return (out, *torch.autograd.grad(out, leaves, static["grad_out"]))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = [t.detach() for t in step()]
    torch.cuda.synchronize()

    for trial in range(3):
        if trial == 2:
            cu, cuc = _three_segments(ratio, total_tokens, gen)
        new = ref_csa.random_inputs(cu, cuc, ratio, coff, d, gen_dev, pad_rows=total_comp - cuc[-1], device="cuda")
        with torch.no_grad():
            for k in static:
                static[k].copy_(new[k])
            for t in res:
                t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        new["cu"], new["cuc"] = cu, cuc
        new["ctx"] = f"autograd graph replay {trial} ratio={ratio} coff={coff} d={d} det={deterministic} cu={cu}"
        check_forward(res[0], new, ratio, coff, d)
        check_backward(res[1:], new, ratio, coff, d)


# --- sparse attention -----------------------------------------------------------------------------------


def _sm100() -> bool:
    return torch.cuda.get_device_capability()[0] == 10


_NO_FORWARD = ("needs the SM100 sparse attention forward (dsa_sparse_attention_forward/fwd, sm_100a cubins: upstream has no SM90 kernel); "
               "on this GPU the op raises the forward's own error (test_sparse_attention_without_a_forward_kernel_raises_the_forwards_error)")


def _sparse_case(s_q, s_kv, h, d, topk, tlen, sink, seed):
    """ref.make_inputs, with a few ids past S_kv (the op masks them, the reference skips them); the
    differentiable inputs as fresh leaves."""
    x = ref.make_inputs(s_q, s_kv, h, d, topk, with_topk_length=tlen, device="cuda", seed=seed, invalid_frac=0.05)
    x["topk_idxs"][::7, 3] = s_kv + 11
    x["attn_sink"] = x["attn_sink"] if sink else None
    leaves = [x["q"].clone().requires_grad_(), x["kv"].clone().requires_grad_()] + ([x["attn_sink"].clone().requires_grad_()] if sink else [])
    return x, leaves


def _check_sparse_forward(r, x, h, ctx):
    f = ref.sparse_attention_forward_ref(x["q"], x["kv"], x["attn_sink"], x["topk_idxs"], x["softmax_scale"], x["topk_length"])
    assert [tuple(r[k].shape) for k in ("out", "max_logits", "lse")] == [(x["q"].shape[0], h, 512), (x["q"].shape[0], h), (x["q"].shape[0], h)]
    e = ref.rel_err(r["out"], f["out"])
    assert not torch.isnan(r["out"]).any() and e <= 1e-2, f"out: rel err {e:.3e} > 1e-2 [{ctx}]"  # bf16 rounding: ~2e-3
    for name in ("lse", "max_logits"):  # +inf / -inf in rows without a valid slot
        got, want = r[name].double(), f[name]
        assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got[torch.isinf(got)], want[torch.isinf(want)]), f"{name} [{ctx}]"
        fin = torch.isfinite(want)
        e = ref.rel_err(got[fin], want[fin])
        assert e <= 1e-5, f"{name}: rel err {e:.3e} > 1e-5 [{ctx}]"  # fp32, a few fast exp2 / log2


# (H, D, K, topk_length?, sink?): K = 2000 padded to 2048 slots; with lengths K is a width the manifest ships
# compactify for (512, 1024, 2048: upstream compacts the rows before padding them)
SPARSE_CASES = [(64, 512, 2000, False, True), (64, 576, 512, True, False), (128, 512, 1024, True, True)]


@pytest.mark.parametrize("h,d,topk,tlen,sink", SPARSE_CASES,
                         ids=[f"H{c[0]}D{c[1]}k{c[2]}{'-len' if c[3] else ''}{'-sink' if c[4] else ''}" for c in SPARSE_CASES])
def test_sparse_attention_and_its_gradients_match_the_reference(dsa, h, d, topk, tlen, sink):
    if not _sm100():
        pytest.skip(_NO_FORWARD)
    x, leaves = _sparse_case(130, 3000, h, d, topk, tlen, sink, seed=h + d + topk + tlen)
    ctx = f"H{h} D{d} topk {topk} len {tlen} sink {sink}"
    r = dsa.sparse_attention(leaves[0], leaves[1], x["topk_idxs"], leaves[2] if sink else None, x["softmax_scale"], x["topk_length"])
    torch.cuda.synchronize()
    _check_sparse_forward(r, x, h, ctx)
    assert r["out"].requires_grad and not r["lse"].requires_grad and not r["max_logits"].requires_grad
    grads = torch.autograd.grad(r["out"], leaves, x["dout"])
    torch.cuda.synchronize()
    want = ref.sparse_attention_backward_ref(x["q"], x["kv"], r["out"].detach(), x["dout"], r["lse"], x["attn_sink"], x["topk_idxs"], x["softmax_scale"],
                                             x["topk_length"])
    for name, g in zip(("dq", "dkv", "d_sink"), grads):
        assert not torch.isnan(g).any(), f"{name}: NaN [{ctx}]"
        e = ref.rel_err(g, want[name])
        assert e <= ref.REL_ERR_BOUNDS[name], f"{name}: rel err {e:.3e} > {ref.REL_ERR_BOUNDS[name]} [{ctx}]"


def test_sparse_attention_h16_runs_the_forward_as_h64(dsa):
    """H16: the forward on q padded to 64 heads with a -inf sink, sliced back; the gradients where the
    build ships the H16 backward (the default manifest's SM100 backward buckets are H64 and H128: the
    backward's own KernelNotFoundError then names the bucket)."""
    if not _sm100():
        pytest.skip(_NO_FORWARD)
    x, leaves = _sparse_case(130, 3000, 16, 576, 512, True, True, seed=16)
    r = dsa.sparse_attention(leaves[0], leaves[1], x["topk_idxs"], leaves[2], topk_length=x["topk_length"])
    torch.cuda.synchronize()
    _check_sparse_forward(r, x, 16, "H16 D576")
    try:
        grads = torch.autograd.grad(r["out"], leaves, x["dout"])
    except KernelNotFoundError as e:
        assert "dsa_sparse_attention_backward" in str(e)
        pytest.skip(f"the build ships no H16 SM100 sparse attention backward: {str(e).splitlines()[0]}")
    want = ref.sparse_attention_backward_ref(x["q"], x["kv"], r["out"].detach(), x["dout"], r["lse"], x["attn_sink"], x["topk_idxs"], None,
                                             x["topk_length"])
    for name, g in zip(("dq", "dkv", "d_sink"), grads):
        assert ref.rel_err(g, want[name]) <= ref.REL_ERR_BOUNDS[name], name


def test_sparse_attention_without_a_forward_kernel_raises_the_forwards_error(dsa):
    """On a GPU the forward has no entry for (the H200: upstream has no SM90 forward kernel) the op
    raises exactly what sparse_attention_forward raises for the call it would make (q and the sink
    padded to 64 heads), through the registered torch op too: no fallback, no launch, inputs untouched."""
    if _sm100():
        pytest.skip("this GPU has the SM100 forward: test_sparse_attention_and_its_gradients_match_the_reference checks its numbers")
    x, leaves = _sparse_case(64, 1024, 16, 512, 256, True, True, seed=5)
    before = [t.clone() for t in (x["q"], x["kv"], x["topk_idxs"], x["attn_sink"], x["topk_length"])]
    padded_q = torch.nn.functional.pad(x["q"], (0, 0, 0, 48))
    padded_sink = torch.nn.functional.pad(x["attn_sink"], (0, 48), value=-math.inf)
    with pytest.raises(AotError) as want:
        dsa.sparse_attention_forward(padded_q, x["kv"], x["topk_idxs"], attn_sink=padded_sink, topk_length=x["topk_length"])
    calls = {
        "dsa_aot.dsa.sparse_attention": lambda: dsa.sparse_attention(leaves[0], leaves[1], x["topk_idxs"], leaves[2], topk_length=x["topk_length"]),
        "torch.ops.dsa_aot.dsa_sparse_attention": lambda: torch.ops.dsa_aot.dsa_sparse_attention(leaves[0], leaves[1], x["topk_idxs"], leaves[2], None,
                                                                                                 x["topk_length"]),
    }
    for name, call in calls.items():
        got = []

        def refused():
            with pytest.raises(type(want.value)) as e:
                call()
            got.append(e.value)

        assert _cuda_kernel_events(refused) == [], f"{name} launched CUDA work before its error"
        assert str(got[0]) == str(want.value), name
    if torch.cuda.get_device_capability()[0] == 9:  # the H200: the forward's refusal of an SM90 device, naming it
        assert isinstance(want.value, InputError) and "sparse attention forward exists for SM100 only" in str(want.value), str(want.value)
    assert all(torch.equal(a, b) for a, b in zip(before, (leaves[0], leaves[1], x["topk_idxs"], leaves[2], x["topk_length"])))
    assert all(t.grad is None for t in leaves)
