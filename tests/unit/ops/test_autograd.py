"""The differentiable ops without a GPU: ``dsa_aot.csa.compressor`` and ``dsa_aot.dsa.sparse_attention``.

Exported and registered as ``torch.ops.dsa_aot.*`` with an autograd formula; forward and backward
trace into one graph (make_fx, and torch.compile(fullgraph=True) down to the op's own checks); every
malformed call is an aot error before anything runs; and on the stand-in driver (tests/unit/stand_in.py,
the real lifted launchers of the small and SM100 builds) the op's forward and backward launch exactly
what the underlying ops launch for the same tensors. The numbers are tests/gpu/test_autograd.py's.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import stand_in
from dsa_aot.errors import AotError, InputError, KernelNotFoundError

BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32
STREAM = 0x5A00  # torch's "current stream" on the stand-in device


# --- registration -------------------------------------------------------------------------------------


def test_the_differentiable_ops_are_exported_and_registered_with_an_autograd_formula():
    import dsa_aot.csa
    import dsa_aot.dsa
    import dsa_aot.library  # noqa: F401 - registers torch.ops.dsa_aot
    from dsa_aot.ops import csa_compressor, dsa_sparse_attention_forward

    assert dsa_aot.csa.compressor is csa_compressor.compressor and "compressor" in dsa_aot.csa.__all__
    assert dsa_aot.dsa.sparse_attention is dsa_sparse_attention_forward.sparse_attention and "sparse_attention" in dsa_aot.dsa.__all__
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in ("csa_compressor", "dsa_sparse_attention"):
        op = getattr(torch.ops.dsa_aot, name).default
        assert has(f"dsa_aot::{name}", "Autograd"), f"{name}: no autograd formula registered"
        assert not any(a.alias_info is not None for a in op._schema.arguments)  # functional, as register_autograd needs
    # the plain ops have none: the formula is what makes these two differentiable
    assert not has("dsa_aot::csa_compressor_forward", "Autograd") and not has("dsa_aot::dsa_sparse_attention_forward", "Autograd")


def _fake_csa(nb=32, ratio=4, d=128, coff=2):
    """CPU fake tensors (autograd on a fake CUDA tensor needs a CUDA build of torch)."""
    t = ratio * nb
    return (torch.empty(t, coff * d, dtype=BF16).requires_grad_(), torch.empty(t, coff * d, dtype=BF16).requires_grad_(),
            torch.empty(ratio, coff * d).requires_grad_(), torch.empty(2, dtype=I32), torch.empty(2, dtype=I32))


def _fake_sparse(s_q=8, h=16, s_kv=300, k=100):
    return (torch.empty(s_q, h, 512, dtype=BF16).requires_grad_(), torch.empty(s_kv, 512, dtype=BF16).requires_grad_(),
            torch.empty(s_q, k, dtype=I32), torch.empty(h).requires_grad_(), torch.empty(s_q, dtype=I32))


def _targets(g):
    return [str(n.target) for n in g.graph.nodes if n.op == "call_function" and str(n.target).startswith("dsa_aot.")]


def test_forward_and_backward_trace_into_one_graph():
    """make_fx over fake tensors of the op and torch.autograd.grad: the op, then its backward op (the
    autograd formula), each one node; the fakes give the shapes (the index rows padded to 128 slots)."""
    import dsa_aot.csa
    import dsa_aot.dsa

    def csa(kv, score, ape, cu, cuc, go):
        out = dsa_aot.csa.compressor(kv, score, ape, cu, cuc, ratio=4, coff=2, total_comp=32, deterministic=True)
        assert out.shape == (32, 128) and out.dtype == BF16
        return torch.autograd.grad(out, (kv, score, ape), go)

    def sparse(q, kv, idx, sink, length, do):
        r = dsa_aot.dsa.sparse_attention(q, kv, idx, sink, softmax_scale=0.05, topk_length=length)
        assert [tuple(t.shape) for t in r.values()] == [(8, 16, 512), (8, 16), (8, 16)]
        saved = torch.ops.dsa_aot.dsa_sparse_attention(q, kv, idx, sink, 0.05, length)[3:]
        assert [tuple(t.shape) for t in saved] == [(8, 128), (8,)]
        return torch.autograd.grad(r["out"], (q, kv, sink), do)

    with FakeTensorMode():
        a = (*_fake_csa(), torch.empty(32, 128, dtype=BF16))
        b = (*_fake_sparse(), torch.empty(8, 16, 512, dtype=BF16))
    assert _targets(make_fx(csa)(*a)) == ["dsa_aot.csa_compressor.default", "dsa_aot.csa_compressor_backward.default"]
    assert _targets(make_fx(sparse)(*b)) == ["dsa_aot.dsa_sparse_attention.default", "dsa_aot.dsa_sparse_attention.default",
                                             "dsa_aot.dsa_sparse_attention_backward.default"]


@pytest.fixture
def compiled_graphs():
    """A torch.compile backend through AOTAutograd that records the forward and backward graphs and runs them."""
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    graphs = []

    def record(gm, _):
        graphs.append(_targets(gm))
        return gm

    yield graphs, aot_autograd(fw_compiler=record, bw_compiler=record)
    torch._dynamo.reset()


def test_torch_compile_fullgraph_reaches_the_ops_own_checks(compiled_graphs):
    """torch.compile(fullgraph=True) of a function calling the op (total_comp given, and None: a
    data-dependent size): one graph holding the op (its backward graph, once compiled, the backward
    op: make_fx above traces both); running it on CPU tensors is the op's own InputError."""
    import dsa_aot.csa
    import dsa_aot.dsa
    import dsa_aot.library  # noqa: F401 - registering is no graph op: it comes first (the next test)

    graphs, backend = compiled_graphs
    kv, score, ape, cu, cuc = (t.detach().zero_().requires_grad_(t.requires_grad) for t in _fake_csa())
    for total in (32, None):
        graphs.clear()
        f = torch.compile(lambda *a: dsa_aot.csa.compressor(*a, total_comp=total, deterministic=True), fullgraph=True, backend=backend)
        with pytest.raises(InputError, match=r"on cpu \(expected a CUDA tensor\)"):
            f(kv, score, ape, cu, cuc)
        # the backward graph is compiled at the first backward (here only when a size is data-dependent)
        assert graphs[0][0] == "dsa_aot.csa_compressor.default" and graphs[1:] in ([], [["dsa_aot.csa_compressor_backward.default"]]), graphs
    q, kv, idx, sink, length = (t.detach().zero_().requires_grad_(t.requires_grad) for t in _fake_sparse())
    graphs.clear()
    f = torch.compile(lambda *a: dsa_aot.dsa.sparse_attention(*a)["out"], fullgraph=True, backend=backend)
    with pytest.raises(InputError, match="expected a CUDA tensor"):
        f(q, kv, idx, sink)
    assert graphs[0][0] == "dsa_aot.dsa_sparse_attention.default" and graphs[1:] in ([], [["dsa_aot.dsa_sparse_attention_backward.default"]]), graphs


def test_a_first_call_inside_torch_compile_says_to_register_the_ops_first(compiled_graphs, monkeypatch):
    import dsa_aot.csa
    import dsa_aot.ops.library as library

    monkeypatch.setattr(library, "_LIB", None)  # as in a process that has not registered them yet
    monkeypatch.setattr(library, "_OPS", {})
    f = torch.compile(lambda *a: dsa_aot.csa.compressor(*a, total_comp=32), fullgraph=True, backend=compiled_graphs[1])
    with pytest.raises(Exception, match="import dsa_aot.library"):
        f(*(t.detach().zero_() for t in _fake_csa()))


# --- the stand-in device ------------------------------------------------------------------------------


@pytest.fixture
def on_stand_in(monkeypatch):
    """Allocations on the stand-in device: torch's factories given a CUDA device make CPU tensors
    that present as CUDA ones, and so do ``empty_like``, ``zeros_like`` and ``full_like`` of such a
    tensor; torch's current device is 0 and its current stream :data:`STREAM`. Returns the list of the
    tensors the factories made (what :func:`_record` masks)."""
    import dsa_aot.ops.gpu as support

    made = []

    def on(fn):
        def make(*args, device=None, **kw):
            d = torch.device(device) if device is not None else None
            if d is not None and d.type == "cuda":
                made.append(stand_in.cuda_tensor(fn(*args, **kw), d.index or 0))
                return made[-1]
            return fn(*args, device=device, **kw)

        return make

    def like(fn):  # inside a torch op's implementation the subclass does not propagate by itself
        def make(t, *args, **kw):
            r = fn(t, *args, **kw)
            if t.device.type == "cuda":
                made.append(stand_in.cuda_tensor(r, t.device.index) if type(r) is torch.Tensor else r)
                return made[-1]
            return r

        return make

    for name in ("empty", "zeros", "full", "arange"):
        monkeypatch.setattr(torch, name, on(getattr(torch, name)))
    for name in ("empty_like", "zeros_like", "full_like"):
        monkeypatch.setattr(torch, name, like(getattr(torch, name)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(support, "_raw_stream", lambda dev: STREAM)
    return made


def _t(shape, dtype, fill=None, grad=False):
    x = torch.randn(shape).to(dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    return stand_in.cuda_tensor(x).requires_grad_(grad)


def _record(env, made, f):
    """Run ``f``: (its result, its launches, its memsets). A launch is (kernel, dims, parameter bytes),
    with every address inside a tensor the run allocated (``made``) written as (which allocation, byte
    offset), a memset (allocation and offset, bytes, stream, word): two runs that allocate apart compare
    equal when they launch the same kernels on the same inputs and on their own allocations alike."""
    env.launches.clear()
    env.memsets.clear()
    del made[:]
    r = f()
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i) for i, t in enumerate(made) if t.numel()]

    def where(a):
        return next(((i, a - p0) for p0, p1, i in spans if p0 <= a < p1), None)

    launches = []
    for L in env.launches:
        b = bytearray(L.params)
        for o in range(0, len(b) - 7, 4):
            w = where(int.from_bytes(b[o : o + 8], "little"))
            if w is not None:
                b[o : o + 8] = struct.pack("<ii", -1 - w[0], w[1])
        launches.append((L.kernel, L.dims, bytes(b)))
    return r, launches, [(where(m[0]), *m[1:3], *m[4:]) for m in env.memsets]


def _csa_inputs(nb=40, ratio=4, d=128, coff=2, grad=True):
    tokens = ratio * nb + 3
    kv, score = _t((tokens, coff * d), BF16, grad=grad), _t((tokens, coff * d), BF16, grad=grad)
    ape = _t((ratio, coff * d), F32, grad=grad)
    cu = stand_in.cuda_tensor(torch.tensor([0, 2 * ratio + 1, tokens], dtype=I32))
    cuc = stand_in.cuda_tensor(torch.tensor([0, 2, nb], dtype=I32))
    return kv, score, ape, cu, cuc


@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
def test_compressor_launches_what_the_forward_and_backward_launch(env, on_stand_in, deterministic):
    """The op's forward launches what compressor_forward launches and its backward what
    compressor_backward launches (the main kernel; the fixed-order dAPE reduction too when
    deterministic): the same kernels, grids, stream and bytes, but for the pointers of what each
    allocates. Gradients go to kv, score and ape."""
    import dsa_aot.csa

    made = on_stand_in
    ins = _csa_inputs()
    go = _t((40, 128), BF16)
    out, fwd, fwd_sets = _record(env, made, lambda: dsa_aot.csa.compressor(*ins, total_comp=40, deterministic=deterministic))
    assert out.requires_grad and out.shape == (40, 128) and len(fwd) == 1 and fwd[0][1][7] == STREAM
    grads, bwd, bwd_sets = _record(env, made, lambda: torch.autograd.grad(out, ins[:3], go))
    assert [(g.shape, g.dtype) for g in grads] == [(t.shape, t.dtype) for t in ins[:3]]

    plain = [t.detach() for t in ins]
    _, want_fwd, want_fwd_sets = _record(env, made, lambda: dsa_aot.csa.compressor_forward(*plain, total_comp=40))
    _, want_bwd, want_bwd_sets = _record(env, made, lambda: dsa_aot.csa.compressor_backward(*plain, go, deterministic=deterministic))
    assert fwd == want_fwd and fwd_sets == want_fwd_sets
    assert bwd == want_bwd and bwd_sets == want_bwd_sets and (len(bwd) > 1) == deterministic  # + the dAPE reduction


@pytest.mark.parametrize("bad,want", [
    (dict(kv=_t((163, 256), torch.float16)), "kv: dtype torch.float16"),
    (dict(score=stand_in.cuda_tensor(torch.zeros(256, 163, dtype=BF16)).t()), "score: strides"),
    (dict(ape=torch.zeros(4, 256)), "ape: on cpu"),
    (dict(ratio=3), "ratio=3"),
    (dict(ratio=4.0), "ratio: a float (expected int)"),
    (dict(head_dim=64), "kv: width 256 (expected coff * head_dim = 2 * 64)"),
    (dict(total_comp=-1), "total_comp=-1"),
    (dict(deterministic="yes"), "deterministic: a str (expected bool)"),
    (dict(cu_seqlens=[0, 163]), "cu_seqlens: a list (expected Tensor)"),
], ids=lambda x: "" if isinstance(x, str) else next(iter(x)))
def test_malformed_compressor_calls_raise_input_error_before_anything_runs(env, bad, want):
    import dsa_aot.csa

    kv, score, ape, cu, cuc = _csa_inputs()
    args = dict(kv=kv, score=score, ape=ape, cu_seqlens=cu, cu_seqlens_comp=cuc, ratio=4, head_dim=None, coff=2, total_comp=40, deterministic=True)
    env.launches.clear()
    env.memsets.clear()
    with pytest.raises(InputError) as e:
        dsa_aot.csa.compressor(**dict(args, **bad))
    assert want in str(e.value) and not env.launches and not env.memsets


def test_compressor_grads_only_where_asked(env, on_stand_in):
    import dsa_aot.csa

    kv, score, ape, cu, cuc = _csa_inputs(grad=False)
    score.requires_grad_(True)
    out = dsa_aot.csa.compressor(kv, score, ape, cu, cuc, total_comp=40)
    (g,) = torch.autograd.grad(out, (score,), _t((40, 128), BF16))
    assert g.shape == score.shape
    with torch.no_grad():
        assert not dsa_aot.csa.compressor(*_csa_inputs(), total_comp=40).requires_grad


# --- dsa_aot.dsa.sparse_attention -------------------------------------------------------------------------


def _sparse_inputs(s_q=8, h=64, d=512, s_kv=300, k=100, sink=True, length=False, seed=0):
    """q, kv, indices (valid ids, -1, ids past S_kv, negative ids), attn_sink, topk_length (lengths past
    K and negative ones: upstream clamps them)."""
    g = torch.Generator().manual_seed(seed)
    q, kv = _t((s_q, h, d), BF16), _t((s_kv, d), BF16)
    ids = torch.randint(-3, s_kv + 40, (s_q, k), generator=g, dtype=I32)
    lengths = torch.randint(-2, k + 5, (s_q,), generator=g, dtype=I32) if length else None
    return (q, kv, stand_in.cuda_tensor(ids), _t((h,), F32) if sink else None, None if lengths is None else stand_in.cuda_tensor(lengths))


def _safe(ids, lengths, s_kv, padded):
    """Upstream's normalisation (training.py), on the CPU: ids outside [0, S_kv) and slots past the
    clamped length -1; with lengths, each row's valid ids compacted to its front; rows padded with -1."""
    ids = ids.as_subclass(torch.Tensor).clone()
    k = ids.shape[1]
    valid = (ids >= 0) & (ids < s_kv)
    if lengths is not None:
        valid &= torch.arange(k)[None, :] < lengths.as_subclass(torch.Tensor).clamp(0, k)[:, None]
    out = torch.full((ids.shape[0], padded), -1, dtype=I32)
    for r in range(ids.shape[0]):
        row = ids[r][valid[r]] if lengths is not None else torch.where(valid[r], ids[r], -1)
        out[r, : row.numel()] = row
    return out, (None if lengths is None else valid.sum(1).to(I32))


def test_sparse_attention_on_an_sm90_device_raises_the_forwards_own_error(env):
    """Upstream has no SM90 forward kernel: the op raises what the forward raises for the call it would
    make (not a fallback), through the registered torch op too, before anything runs."""
    import dsa_aot.dsa

    for h, length in ((64, False), (16, True)):
        q, kv, idx, sink, tl = _sparse_inputs(h=h, length=length)
        with pytest.raises(AotError) as want:
            dsa_aot.dsa.sparse_attention_forward(_t((8, 64, 512), BF16), kv, idx, attn_sink=_t((64,), F32), topk_length=tl)
        env.launches.clear()
        env.memsets.clear()
        for f in (lambda: dsa_aot.dsa.sparse_attention(q, kv, idx, sink, topk_length=tl), lambda: torch.ops.dsa_aot.dsa_sparse_attention(q, kv, idx, sink)):
            with pytest.raises(type(want.value)) as got:
                f()
            assert str(got.value) == str(want.value) and "SM100 only" in str(got.value)
        assert not env.launches and not env.memsets


def _bad_sparse_calls():
    q, kv, idx, sink, tl = _sparse_inputs(h=16, length=True, k=128)
    return {
        "fp16": (dict(q=_t((8, 16, 512), torch.float16), kv=_t((300, 512), torch.float16)), "bf16 only"),
        "strided kv": (dict(kv=stand_in.cuda_tensor(torch.zeros(512, 300, dtype=BF16)).t()), "kv: strides"),
        "misaligned q": (dict(q=stand_in.cuda_tensor(torch.zeros(8 * 16 * 512 + 1, dtype=BF16)[1:].view(8, 16, 512))), "q: data pointer"),
        "H8": (dict(q=_t((8, 8, 512), BF16), attn_sink=_t((8,), F32)), "q: H 8"),
        "H128 D576": (dict(q=_t((8, 128, 576), BF16), kv=_t((300, 576), BF16), attn_sink=_t((128,), F32)), "q: H 128, D 576"),
        "no query": (dict(q=_t((0, 16, 512), BF16), indices=_t((0, 128), I32, fill=0), topk_length=_t((0,), I32, fill=0)), "S_q = 0"),
        "no slot": (dict(indices=_t((8, 0), I32, fill=0)), "top-k = 0"),
        "sink shape": (dict(attn_sink=_t((64,), F32)), "attn_sink: shape (64,)"),
        "int64 ids": (dict(indices=_t((8, 128), torch.int64, fill=0)), "topk_idxs: dtype torch.int64"),
        "lengths shape": (dict(topk_length=_t((9,), I32, fill=0)), "topk_length: shape (9,)"),
        "scale": (dict(softmax_scale=-1.0), "softmax_scale=-1.0"),
        "scale type": (dict(softmax_scale="0.1"), "softmax_scale: a str"),
        "trusted": (dict(trusted_compact_metadata="yes"), "trusted_compact_metadata: a str"),
        "on cpu": (dict(q=torch.zeros(8, 16, 512, dtype=BF16)), "expected a CUDA tensor"),
    }, dict(q=q, kv=kv, indices=idx, attn_sink=sink, topk_length=tl)


def test_malformed_sparse_attention_calls_raise_input_error_before_anything_runs(sm100_env, monkeypatch):
    import dsa_aot.dsa
    import dsa_aot.ops.dsa_topk_utils as tk

    tk.COMPACTIFY.cache.clear()
    env = sm100_env
    cases, good = _bad_sparse_calls()
    env.launches.clear()
    for name, (over, want) in cases.items():
        with pytest.raises(InputError) as e:
            dsa_aot.dsa.sparse_attention(**dict(good, **over))
        assert want in str(e.value), (name, str(e.value))
        assert not env.launches and not env.memsets, name


def test_a_missing_entry_is_the_forwards_or_compactifys_own_error(sm100_env, monkeypatch):
    """The SM100 build has the forward for H64 D512 only and compactify for rows of 128 slots: another
    call is a KernelNotFoundError naming the bucket to add, before anything runs (never a fallback)."""
    import dsa_aot.dsa
    import dsa_aot.ops.dsa_topk_utils as tk

    tk.COMPACTIFY.cache.clear()
    env = sm100_env
    env.launches.clear()
    q, kv, idx, sink, tl = _sparse_inputs(d=576, length=True, k=128)
    with pytest.raises(KernelNotFoundError, match="dsa_sparse_attention_forward/fwd") as e:
        dsa_aot.dsa.sparse_attention(q, kv, idx, sink, topk_length=tl)
    assert "\n  dim = 576\n" in str(e.value)
    q, kv, idx, sink, tl = _sparse_inputs(length=True, k=100)
    with pytest.raises(KernelNotFoundError, match="dsa_topk_utils/compactify .*'cols': 100"):
        dsa_aot.dsa.sparse_attention(q, kv, idx, sink, topk_length=tl)
    assert not env.launches and not env.memsets


@pytest.fixture
def sparse_forward(sm100_env, on_stand_in, monkeypatch):
    """The op's implementation on the SM100 stand-in (called directly: inside a dispatched torch op a
    tensor subclass does not reach the implementation's own torch calls), with the forward op it calls
    and compactify calls recorded."""
    import dsa_aot.ops.dsa_sparse_attention_forward as fwd
    import dsa_aot.ops.dsa_topk_utils as tk

    tk.COMPACTIFY.cache.clear()
    calls = []
    real = fwd.sparse_attention_forward

    def spy(*args, **kw):
        calls.append((args, kw))
        return real(*args, **kw)

    monkeypatch.setattr(fwd, "sparse_attention_forward", spy)
    real_compactify = tk.compactify

    def compactify(indices, *args, **kw):
        calls.append((("compactify", indices.as_subclass(torch.Tensor).clone()), kw))
        return real_compactify(indices, *args, **kw)

    monkeypatch.setattr(tk, "compactify", compactify)
    return sm100_env, fwd._t_sparse_attention, calls


def test_sparse_attention_forward_normalises_pads_and_launches_the_forward(sparse_forward):
    """H64, 100 slots, no lengths: ids outside [0, S_kv) become -1, the rows are padded with -1 to 128
    slots, and the one launch is the forward's on exactly those rows (sparse_attention_forward_into on
    the op's own tensors launches the same bytes)."""
    import dsa_aot.dsa

    env, impl, calls = sparse_forward
    q, kv, idx, sink, _ = _sparse_inputs(k=100)
    env.launches.clear()
    out, ml, lse, safe, lengths = impl(q, kv, idx, sink, 0.05)
    assert torch.equal(safe.as_subclass(torch.Tensor), _safe(idx, None, 300, 128)[0]) and lengths.numel() == 0
    assert [(t.shape, t.dtype) for t in (out, ml, lse)] == [((8, 64, 512), BF16), ((8, 64), F32), ((8, 64), F32)]
    ((args, kw),) = calls
    assert args[0] is q and args[1] is kv and args[2] is safe and kw == dict(attn_sink=sink, topk_length=None, softmax_scale=0.05)
    got = [(L.kernel, L.dims, L.params) for L in env.launches]
    env.launches.clear()
    dsa_aot.dsa.sparse_attention_forward_into(out, ml, lse, None, q, kv, safe, attn_sink=sink, softmax_scale=0.05)
    assert len(got) == 1 and got == [(L.kernel, L.dims, L.params) for L in env.launches] and not env.memsets


def test_sparse_attention_forward_pads_h16_and_compacts_lengths(sparse_forward):
    """H16 with lengths and no sink: compactify (its launch first), then the forward on q padded to 64
    zero heads and a -inf sink of 64; the outputs sliced back to 16 heads; the rows and lengths the
    forward read are what the op returns for the backward."""
    env, impl, calls = sparse_forward
    q, kv, idx, _, tl = _sparse_inputs(h=16, k=128, sink=False, length=True)
    env.launches.clear()
    out, ml, lse, safe, lengths = impl(q, kv, idx, None, None, tl)
    assert ["Compactify" in L.kernel for L in env.launches] == [True, False], [L.kernel for L in env.launches]
    assert [t.shape for t in (out, ml, lse)] == [(8, 16, 512), (8, 16), (8, 16)]
    ((compacted, _), (args, kw)) = calls
    masked = _safe(idx, tl, 300, 128)[0]  # upstream's rows compacted: the ones compactify got hold the same ids per row, -1 elsewhere
    assert compacted[0] == "compactify" and [sorted(r[r >= 0].tolist()) for r in compacted[1]] == [sorted(r[r >= 0].tolist()) for r in masked]
    assert torch.equal(compacted[1] >= 0, (idx.as_subclass(torch.Tensor) >= 0) & (compacted[1] == idx.as_subclass(torch.Tensor)))
    lq = args[0].as_subclass(torch.Tensor)
    assert lq.shape == (8, 64, 512) and torch.equal(lq[:, :16], q.as_subclass(torch.Tensor)) and not lq[:, 16:].any()
    assert args[2] is safe and kw["topk_length"] is lengths and kw["softmax_scale"] is None
    assert torch.equal(kw["attn_sink"].as_subclass(torch.Tensor), torch.full((64,), -math.inf))
    assert env.launches[0].dims[7] == env.launches[1].dims[7] == STREAM


def test_trusted_metadata_is_read_as_given(sparse_forward):
    """trusted_compact_metadata: no normalisation and no compactify launch; the rows the forward reads
    (and the op returns) are copies of the caller's (an op's outputs never alias its inputs)."""
    env, impl, calls = sparse_forward
    q, kv, idx, sink, tl = _sparse_inputs(k=128, length=True)
    env.launches.clear()
    _, _, _, safe, lengths = impl(q, kv, idx, sink, None, tl, True)
    assert len(env.launches) == 1 and "Compactify" not in env.launches[0].kernel
    for got, given in ((safe, idx), (lengths, tl)):
        assert torch.equal(got.as_subclass(torch.Tensor), given.as_subclass(torch.Tensor)) and got.data_ptr() != given.data_ptr()


def test_sparse_attention_backward_launches_what_the_backward_op_launches(env, on_stand_in):
    """The autograd formula on what the forward saved (SM90 stand-in: the backward has SM90 kernels,
    H64 D512 128 slots in the small build): the launches of sparse_attention_backward on the same
    tensors, the sink -inf when there was none; gradients only where asked, none without dout."""
    import types

    import dsa_aot.dsa
    from dsa_aot.ops.dsa_sparse_attention_forward import _sparse_attention_grad

    made = on_stand_in
    q, kv, _, sink, _ = _sparse_inputs(s_q=16, k=128)
    out, dout, lse = _t((16, 64, 512), BF16), _t((16, 64, 512), BF16), _t((16, 64), F32)
    safe = stand_in.cuda_tensor(_safe(_sparse_inputs(s_q=16, k=128)[2], None, 300, 128)[0])
    for given_sink in (sink, None):
        ctx = types.SimpleNamespace(saved_tensors=(q, kv, out, lse, given_sink, safe, safe.new_empty(0)), softmax_scale=0.05, has_lengths=False,
                                    needs_input_grad=(True, True, False, given_sink is not None, False, False, False))
        grads, got, got_sets = _record(env, made, lambda: _sparse_attention_grad(ctx, dout, None, None, None, None))

        def direct():
            s = given_sink if given_sink is not None else torch.full((64,), -math.inf, dtype=F32, device=q.device)
            return dsa_aot.dsa.sparse_attention_backward(q, kv, out, dout, lse, s, safe, 0.05)

        want, want_launches, want_sets = _record(env, made, direct)
        assert got == want_launches and got_sets == want_sets and len(got) == 3  # preprocess, main, postprocess
        assert [g is None for g in grads] == [False, False, True, given_sink is None, True, True, True]
        assert [g.shape for g in grads if g is not None] == [t.shape for t in (q, kv, sink)][: 2 + (given_sink is not None)]
    assert _sparse_attention_grad(ctx, None, None, None, None, None) == (None,) * 7
