"""Every op under concurrency and on several devices, end to end through the real runtime and the real
lifted launchers, with the stand-in driver (tests/unit/stand_in.py) in place of the GPU.

* 32 threads x 500 calls per op family, each thread with its own tensors, shapes and stream: every
  launch carries exactly its own call's bytes, dims and stream (the driver reads the parameter bytes
  at the launch, with the GIL released in the middle of it).
* Tensors on cuda:1 while the thread's current context is cuda:0 (and with no current context at
  all): every launch and memset goes to cuda:1; a stream of cuda:1 with tensors on cuda:0 is refused.
"""

import threading
from collections import defaultdict

import pytest

import op_calls
import stand_in
from dsa_aot.errors import InputError

THREADS, CALLS = 32, 500


def _shape(family, i):
    """Each thread its own shape, so dims differ between threads as well as bytes."""
    return {"csa_forward": {"nb": 8 + i}, "csa_backward": {"nb": 8 + i}, "indexer_backward": {"s_q": 1 + i},
            "sparse_backward": {"s_q": 1 + i}, "local_to_global": {"s_q": 1 + i}, "compactify": {"rows": 1 + i},
            "indexer_top_k": {"rows": 1 + i}, "indexer_forward": {"s_q": 1 + i},
            "dense_indexer_backward": {"s_q": 1 + i}, "dense_indexer_backward_thd": {"s_q": 4 + i}, "sparse_indexer_score_recompute": {"s_q": 1 + i},
            "sparse_attn_score_recompute": {"s_q": 1 + i}, "dense_indexer_score_recompute": {"s_q": 1 + i}, "dense_attn_score_recompute": {"s_q": 1 + i}}[family]


@pytest.mark.parametrize("family", sorted(op_calls.FAMILIES))
def test_concurrent_calls_launch_with_their_own_bytes_dims_and_stream(env, torch_steps, family):
    make = op_calls.FAMILIES[family]
    calls = [make(0, env.new_stream(0), **_shape(family, i)) for i in range(THREADS)]
    # what each call launches on its own
    want = {}
    for fn, args, kw, _ in calls:
        before = len(env.launches)
        fn(*args, **kw)
        want[kw["stream"]] = [(L.kernel, L.dims, L.params) for L in env.launches[before:]]
        assert want[kw["stream"]] and all(L.dims[7] == kw["stream"] for L in env.launches[before:])
    assert len({tuple(v) for v in want.values()}) == THREADS  # the calls really differ
    env.launches.clear()
    errors = []

    def worker(fn, args, kw):
        try:
            for _ in range(CALLS):
                fn(*args, **kw)
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=c[:3]) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    got = defaultdict(list)
    for L in env.launches:
        got[L.dims[7]].append((L.kernel, L.dims, L.params))
    for stream, seq in want.items():
        assert got[stream] == seq * CALLS, f"stream {stream:#x}: {len(got[stream])} launches, {sum(a != b for a, b in zip(got[stream], seq * CALLS))} differ"
    assert all(L.device == 0 for L in env.launches)


@pytest.mark.parametrize("family", sorted(op_calls.FAMILIES))
@pytest.mark.parametrize("current", [0, None])
def test_tensors_on_another_device_run_there(env, torch_steps, family, current):
    fn, args, kw, _ = op_calls.FAMILIES[family](1, env.new_stream(1))
    env.set_current(current)
    fn(*args, **kw)
    assert env.launches and all(L.device == 1 and L.dims[7] == kw["stream"] for L in env.launches)
    assert all(m[3] == 1 for m in env.memsets)
    assert env._stack() == ([] if current is None else [env.ctx_of(0)])  # the caller's context is back


@pytest.mark.parametrize("family", sorted(op_calls.FAMILIES))
def test_a_stream_of_another_device_is_refused_before_anything_runs(env, torch_steps, family):
    fn, args, kw, outs = op_calls.FAMILIES[family](0, env.new_stream(1))
    before = [stand_in.contents(o) for o in outs]
    with pytest.raises(InputError, match="not a stream of cuda:0"):
        fn(*args, **kw)
    kw["stream"] = 2**64 - 1  # a handle the driver answers CUDA_ERROR_INVALID_HANDLE for
    with pytest.raises(InputError, match="not a stream of cuda:0"):
        fn(*args, **kw)
    assert not env.launches and not env.memsets
    assert [stand_in.contents(o) for o in outs] == before


def test_a_refused_call_leaves_no_launch_state_behind(env):
    """A call refused after a valid one, then a valid call of another shape: its launch has its own dims."""
    fn, args, kw, _ = op_calls.csa_forward(0, env.new_stream(0), nb=100)
    fn(*args, **kw)
    with pytest.raises(InputError):
        fn(*args, **dict(kw, stream=2**64))
    with pytest.raises(InputError):
        fn(*args, **dict(kw, stream="s0"))
    fn2, args2, kw2, _ = op_calls.csa_forward(0, kw["stream"], nb=7)
    env.launches.clear()
    fn2(*args2, **kw2)
    (L,) = env.launches
    assert L.dims[0] == 7 and L.dims[7] == kw["stream"]
