"""Plans on the GPU: ``execute`` computes what the functional op computes (outputs NaN-poisoned first;
bitwise, or within 1e-2 where upstream accumulates with fp32 atomics), on new data as well, captured in
a CUDA graph and replayed on new inputs, from several threads at once, and on its tensors' GPU
whatever the current device. The calls are those of test_runtime_safety.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from op_calls import plan_class  # noqa: E402 - tests/unit is on sys.path (tests/conftest.py)
from test_runtime_safety import _OVERWRITTEN, OPS, in_threads, needs_two, same  # noqa: E402


def _plan(fn, args, kw):
    cls = plan_class(fn)
    plan = cls(*args, **kw)
    xkw = {k: v for k, v in kw.items() if k in cls._tensors}
    return plan, xkw


def _poison(outs):
    for o in outs:
        o.fill_(float("nan") if o.is_floating_point() else -1)


def _fresh(fn, args):
    """The indexer backwards overwrite their scores input: each run gets its own copy of it (the same table
    test_runtime_safety's calls use)."""
    i = _OVERWRITTEN.get(fn.__name__)
    if i is not None:
        args = list(args)
        args[i] = args[i].clone()
    return args


def _perturbed(args, n_out):
    """The same inputs scaled (same shapes, other values, other pointers); index tensors kept, except
    where they are all the op takes (local_to_global, compactify: ids reversed along each row)."""
    if all(not a.is_floating_point() for a in args[n_out:]):
        return list(args[:n_out]) + [a.flip(-1).contiguous() for a in args[n_out:]]
    return list(args[:n_out]) + [a * 0.5 if a.is_floating_point() else a.clone() for a in args[n_out:]]


@pytest.mark.parametrize("op", sorted(OPS))
def test_a_plan_computes_what_the_functional_op_computes(op):
    fn, args, kw, outs, exact = OPS[op](0, seed=11)
    fn(*_fresh(fn, args), **kw)
    torch.cuda.synchronize()
    want = [o.clone() for o in outs]
    plan, xkw = _plan(fn, args, kw)
    for _ in range(3):  # the first execute and the warm ones
        _poison(outs)
        plan.execute(*_fresh(fn, args), **xkw)
        torch.cuda.synchronize()
        for o, w, e in zip(outs, want, exact):
            assert same(o, w, e)
    # other values at other addresses, same shapes
    new = _perturbed(args, len(outs))
    fn(*_fresh(fn, new), **kw)
    torch.cuda.synchronize()
    want2 = [o.clone() for o in outs]
    assert any(not torch.equal(a, b) for a, b in zip(want, want2))
    _poison(outs)
    plan.execute(*_fresh(fn, new), **xkw)
    torch.cuda.synchronize()
    for o, w, e in zip(outs, want2, exact):
        assert same(o, w, e)


@pytest.mark.parametrize("op", sorted(OPS))
def test_a_plan_captured_in_a_cuda_graph_replays_on_new_inputs(op):
    fn, args, kw, outs, exact = OPS[op](0, seed=12)
    static = [a.clone() for a in args]
    s_outs = static[: len(outs)]
    plan, xkw = _plan(fn, static, {k: v for k, v in kw.items()})
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan.execute(*static, **xkw)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.execute(*static, **xkw)
    for scale in (0.5, 2.0):
        new = [a * scale if a.is_floating_point() else a for a in args[len(outs):]]
        ref_outs = [o.clone() for o in outs]
        fn(*ref_outs, *[n.clone() for n in new], **kw)
        for s, n in zip(static[len(outs):], new):
            s.copy_(n)
        _poison(s_outs)
        g.replay()
        torch.cuda.synchronize()
        for o, w, e in zip(s_outs, ref_outs, exact):
            assert same(o, w, e), f"scale {scale}"


def test_one_plan_from_8_threads_each_with_its_tensors_and_stream():
    import dsa_aot.csa

    setups = [OPS["csa_backward"](0, seed=13) for _ in range(8)]
    new = []
    for i, (fn, args, kw, outs, exact) in enumerate(setups):  # same shapes (same seed), other values per thread
        args = _perturbed(args, len(outs)) if i % 2 else args
        args = list(args[:3]) + [a * (1 + i / 8) if a.is_floating_point() else a for a in args[3:]]
        new.append((fn, args, kw, outs, exact))
    want = []
    for fn, args, kw, outs, _ in new:
        fn(*args, **kw)
        torch.cuda.synchronize()
        want.append([o.clone() for o in outs])
        _poison(outs)
    plan, _ = _plan(*new[0][:3])
    assert isinstance(plan, dsa_aot.csa.CompressorBackward)
    streams = [torch.cuda.Stream() for _ in new]

    def work(i):
        _, args, kw, _, _ = new[i]
        for _ in range(100):
            plan.execute(*args, workspace=kw["workspace"], stream=streams[i])

    errors = in_threads(work, len(new))
    assert not errors, errors[:3]
    for i, (_, _, _, outs, exact) in enumerate(new):
        for o, w, e in zip(outs, want[i], exact):
            assert same(o, w, e), f"thread {i}"


@needs_two
@pytest.mark.parametrize("op", sorted(OPS))
def test_a_plan_runs_on_its_tensors_gpu_whatever_the_current_device(op):
    fn, args, kw, outs, exact = OPS[op](1, seed=14)
    with torch.cuda.device(1):
        fn(*_fresh(fn, args), **kw)
    torch.cuda.synchronize(1)
    want = [o.clone() for o in outs]
    with torch.cuda.device(0):
        plan, xkw = _plan(fn, args, kw)
        _poison(outs)
        plan.execute(*_fresh(fn, args), **xkw)
        assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    for o, w, e in zip(outs, want, exact):
        assert same(o, w, e)
