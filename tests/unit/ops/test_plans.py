"""Plans (dsa_aot.ops.plan): built once from sample tensors, ``execute`` launches exactly what the functional
op launches for the same tensors, on other tensors of the same shapes too, and refuses anything unlike
its samples before a launch (stand-in driver, real lifted launchers of the small build)."""

import threading

import pytest
import torch

import op_calls
import stand_in
from dsa_aot.errors import InputError


def _build(fn, args, kw):
    cls = op_calls.plan_class(fn)
    return cls(*args, **{k: v for k, v in kw.items() if k != "stream"})


def _execute_kw(plan, kw):
    """execute's keywords: the stream and the optional tensors (the workspace) the functional call got by name."""
    return {k: v for k, v in kw.items() if k == "stream" or k in type(plan)._tensors}


def _record(env, f):
    env.launches.clear()
    env.memsets.clear()
    f()
    return [(L.kernel, L.dims, L.params) for L in env.launches], list(env.memsets)


@pytest.mark.parametrize("family", sorted(op_calls.FAMILIES))
def test_a_plan_launches_what_the_functional_op_launches(env, torch_steps, family):
    make = op_calls.FAMILIES[family]
    fn, args, kw, _ = make(0, env.new_stream(0))
    want = _record(env, lambda: fn(*args, **kw))
    plan = _build(fn, args, kw)
    assert plan.check_support() is True
    assert want[0] and _record(env, lambda: plan.execute(*args, **_execute_kw(plan, kw))) == want
    # other tensors of the same shapes (other pointers, other values), another stream
    fn, args2, kw2, _ = make(0, env.new_stream(0))
    want2 = _record(env, lambda: fn(*args2, **kw2))
    assert want2 != want
    assert _record(env, lambda: plan.execute(*args2, **_execute_kw(plan, kw2))) == want2
    # and back: nothing of the second call is left behind
    assert _record(env, lambda: plan.execute(*args, **_execute_kw(plan, kw))) == want
    assert "E0" in plan.source  # what execute runs, readable


@pytest.mark.parametrize("family", sorted(op_calls.FAMILIES))
def test_a_plan_refuses_tensors_unlike_its_samples_before_any_launch(env, torch_steps, family):
    make = op_calls.FAMILIES[family]
    fn, args, kw, writes = make(0, env.new_stream(0))
    plan = _build(fn, args, kw)
    xkw = _execute_kw(plan, kw)
    shape_arg = {"csa_forward": {"nb": 9}, "csa_backward": {"nb": 9}, "indexer_backward": {"s_q": 3}, "sparse_backward": {"s_q": 5}, "local_to_global": {"s_q": 3},
                 "compactify": {"rows": 5}, "indexer_top_k": {"rows": 5}, "indexer_forward": {"s_q": 3},
                 "dense_indexer_backward": {"s_q": 5}, "dense_indexer_backward_thd": {"s_q": 5}, "sparse_indexer_score_recompute": {"s_q": 5},
                 "sparse_attn_score_recompute": {"s_q": 5}, "dense_indexer_score_recompute": {"s_q": 5}, "dense_attn_score_recompute": {"s_q": 5}}[family]
    other = make(0, env.new_stream(0), **shape_arg)[1]
    before = [stand_in.contents(t) for t in writes]

    def refused(*a, **k):
        env.launches.clear()
        env.memsets.clear()
        with pytest.raises(InputError) as e:
            plan.execute(*a, **k)
        assert not env.launches and not env.memsets
        assert [stand_in.contents(t) for t in writes] == before
        return str(e.value)

    assert "build another plan" in refused(other[0], *args[1:], **xkw)  # an output of another shape
    i = {"csa_forward": 1, "local_to_global": 1, "compactify": 2, "indexer_top_k": 2, "indexer_forward": 2, "dense_indexer_score_recompute": 2,
         "dense_attn_score_recompute": 2}.get(family, 3)  # an input whose shape follows the one changed
    assert "build another plan" in refused(*args[:i], other[i], *args[i + 1 :], **xkw)  # an input of another shape
    assert "build another plan" in refused(args[0].to(torch.float16) if args[0].dtype != torch.float16 else args[0].float(), *args[1:], **xkw)
    assert "build another plan" in refused(*args[:i], stand_in.cuda_tensor(args[i].clone(), 1), *args[i + 1 :], **xkw)  # on another device
    t = args[i]
    transposed = stand_in.cuda_tensor(torch.empty(list(reversed(t.shape)), dtype=t.dtype).permute(*reversed(range(t.ndim))))
    assert transposed.shape == t.shape and not transposed.is_contiguous()
    assert "not contiguous" in refused(*args[:i], transposed, *args[i + 1 :], **xkw)
    assert "torch.Tensor" in refused(None, *args[1:], **xkw)
    t = args[i]
    shifted = stand_in.cuda_tensor(torch.empty(t.numel() + 8, dtype=t.dtype)[1 : t.numel() + 1].view(t.shape))
    assert "aligned" in refused(*args[:i], shifted, *args[i + 1 :], **xkw)
    # an output over an input: the recheck of the pointers refuses it
    j = max(range(i, len(args)), key=lambda j: -1 if args[j] is None else args[j].numel() * args[j].element_size())  # the largest input
    over = stand_in.cuda_tensor(args[j].view(torch.uint8).view(-1)[: args[0].numel() * args[0].element_size()].view(args[0].dtype).view(args[0].shape))
    assert "overlap" in refused(over, *args[1:], **xkw)
    assert "unexpected argument" in refused(*args, **xkw, bogus=1)
    assert "takes" in refused(*args, *args, *args, **xkw)  # more tensors than the plan has slots (optional ones included)
    # a refused execute leaves nothing behind: the valid call after it launches what it always did
    want = _record(env, lambda: fn(*args, **kw))
    assert _record(env, lambda: plan.execute(*args, **xkw)) == want


def test_per_call_scalars_of_a_plan_are_checked_and_used(env):
    fn, args, kw, writes = op_calls.indexer_backward(0, env.new_stream(0))
    plan = _build(fn, args, kw)
    xkw = _execute_kw(plan, kw)
    want = _record(env, lambda: fn(*args, **dict(kw, loss_coeff=2.0)))
    assert _record(env, lambda: plan.execute(*args, **xkw, loss_coeff=2.0)) == want
    for bad in (1e39, float("nan"), "x", None):
        env.launches.clear()
        with pytest.raises(InputError, match="sm_scale"):
            plan.execute(*args, **xkw, sm_scale=bad)
        assert not env.launches
    fn, args, kw, _ = op_calls.sparse_backward(0, env.new_stream(0))
    plan = _build(fn, args, kw)
    xkw = _execute_kw(plan, kw)
    want = _record(env, lambda: fn(*args, **dict(kw, softmax_scale=0.125)))
    assert _record(env, lambda: plan.execute(*args, **xkw, softmax_scale=0.125)) == want


def test_a_plan_serves_many_threads_each_with_its_own_tensors_and_stream(env):
    """One plan, 16 threads x 200 executes, each thread its own tensors and stream: every launch
    carries its own call's bytes and stream (the entries' locks, as the functional ops)."""
    calls = [op_calls.csa_backward(0, env.new_stream(0)) for _ in range(16)]
    fn, args, kw, _ = calls[0]
    plan = _build(fn, args, kw)
    want = {}
    for fn, a, k, _ in calls:
        want[k["stream"]] = sorted(_record(env, lambda: fn(*a, **k))[0])
    env.launches.clear()
    errors = []

    def worker(a, k):
        try:
            for _ in range(200):
                plan.execute(*a, **_execute_kw(plan, k))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(a, k)) for _, a, k, _ in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    got = {}
    for L in env.launches:
        got.setdefault(L.dims[7], []).append((L.kernel, L.dims, L.params))
    assert set(got) == set(want)
    for s, launches in got.items():
        assert len(launches) == 200 * len(want[s]) and set(launches) == set(want[s])


def test_the_allocating_forms_skip_validation_only_for_calls_like_the_last_valid_one(env, monkeypatch):
    """A repeated allocating call with the same options and inputs like the last validated one skips the full
    validation (what a training loop pays per layer), and its per-call checks still refuse before any launch.
    (The outputs are given and the workspace is not needed: nothing is allocated on the CPU stand-in.)"""
    import contextlib

    import dsa_aot.dsa
    import dsa_aot.ops.dsa_indexer_backward as ib

    fn, args, kw, _ = op_calls.indexer_backward(0, env.new_stream(0))
    validated = []
    real = ib.BACKWARD.validate
    monkeypatch.setattr(ib.BACKWARD, "validate", lambda *a, **k: (validated.append(k.get("allocating", False)), real(*a, **k))[1])
    monkeypatch.setitem(dsa_aot.dsa.indexer_backward.__globals__, "alloc_on", lambda *a: contextlib.nullcontext())  # the generated form's
    outs = dict(zip(("d_index_q", "d_weights", "d_index_k"), args[:3]))
    ins = args[3:]

    def call(*i, **k):
        return dsa_aot.dsa.indexer_backward(*i, **dict(dict(sm_scale=0.1, loss_coeff=1.0, stream=kw["stream"], **outs), **k))

    first = _record(env, lambda: call(*ins))
    assert first[0] and validated == [True, False]  # the allocating form's checks, then its _into call's
    assert _record(env, lambda: call(*ins)) == first
    assert validated == [True, False]  # nothing validated again
    t = ins[0]
    shifted = stand_in.cuda_tensor(torch.empty(t.numel() + 8, dtype=t.dtype)[1 : t.numel() + 1].view(t.shape))
    for bad_ins, bad_kw in (((shifted, *ins[1:]), {}), (ins, dict(sm_scale=1e39)), (ins, dict(loss_coeff=float("inf")))):
        env.launches.clear()
        with pytest.raises(InputError):
            call(*bad_ins, **bad_kw)
        assert not env.launches
