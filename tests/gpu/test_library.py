"""torch.ops.dsa_aot on the GPU: torch.library.opcheck of every op, torch.compile(fullgraph=True)
equal to eager, and the compiled module captured in a CUDA graph (mode="reduce-overhead") and
replayed on new inputs. Inputs and comparisons are those of test_runtime_safety.py (bitwise, or within
1e-2 where upstream accumulates with fp32 atomics)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

import dsa_aot.library  # noqa: E402,F401 - registers torch.ops.dsa_aot
from test_runtime_safety import OPS as CALLS, same  # noqa: E402

NS = {"csa_forward": "csa_", "csa_backward": "csa_", "indexer_backward": "dsa_", "sparse_backward": "dsa_", "local_to_global": "dsa_", "compactify": "dsa_",
      "indexer_top_k": "dsa_", "indexer_forward": "dsa_", "dense_indexer_backward": "dsa_",
      "sparse_indexer_score_recompute": "dsa_", "sparse_attn_score_recompute": "dsa_",
      "dense_indexer_score_recompute": "dsa_", "dense_attn_score_recompute": "dsa_"}


def torch_calls(which, seed):
    """(allocating op, args, kwargs), (_into op, args, kwargs), the _into outputs, which are exact."""
    fn, args, kw, outs, exact = CALLS[which](0, seed=seed)
    name = NS[which] + fn.__name__
    into = getattr(torch.ops.dsa_aot, name)
    alloc = getattr(torch.ops.dsa_aot, name[: -len("_into")])
    a_kw = {k: v for k, v in kw.items() if k != "workspace"}
    if which == "csa_forward":
        a_kw["total_comp"] = outs[0].shape[0]
    return (alloc, args[len(outs):], a_kw), (into, args, kw), outs, exact


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("which", sorted(CALLS))
@pytest.mark.parametrize("form", ["allocating", "into"])
def test_opcheck(which, form):
    (alloc, a_args, a_kw), (into, i_args, i_kw), _, _ = torch_calls(which, seed=1)
    op, args, kw = (alloc, a_args, a_kw) if form == "allocating" else (into, i_args, i_kw)
    torch.library.opcheck(op, tuple(_clone(a) for a in args), {k: _clone(v) for k, v in kw.items()})


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own program: Step.forward is one code object for every op, and dynamo
    stops recompiling one code object after torch._dynamo.config.recompile_limit (8) variants."""
    torch._dynamo.reset()
    yield


_MUTATED = {"indexer_backward": 3, "dense_indexer_backward": 5}  # the allocating op's argument it overwrites (attn_score / index_score)


class Step(torch.nn.Module):
    def __init__(self, which, op, kw):
        super().__init__()
        self.which, self.op, self.kw = which, op, kw

    def forward(self, *args):
        i = _MUTATED.get(self.which)
        if i is not None:  # the op overwrites these scores: keep the inputs unmutated, so the graph is capturable
            args = (*args[:i], args[i].clone(), *args[i + 1 :])
        r = self.op(*args, **self.kw)
        return (r,) if isinstance(r, torch.Tensor) else tuple(r)


@pytest.mark.parametrize("which", sorted(CALLS))
def test_compiled_fullgraph_equals_eager(which):
    (alloc, args, kw), _, _, exact = torch_calls(which, seed=2)
    step = Step(which, alloc, kw)
    want = step(*[_clone(a) for a in args])
    got = torch.compile(step, fullgraph=True)(*[_clone(a) for a in args])
    torch.cuda.synchronize()
    for g, w, e in zip(got, want, exact):
        assert same(g, w, e)


@pytest.mark.parametrize("which", sorted(CALLS))
def test_reduce_overhead_captures_and_replays_on_new_inputs(which):
    (alloc, args, kw), _, _, exact = torch_calls(which, seed=3)
    from torch._dynamo.utils import counters

    step = Step(which, alloc, kw)
    counters.clear()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for seed in (3, 4, 5):  # warm-up, recording, then replays on new inputs
        (_, args, _), _, _, _ = torch_calls(which, seed=seed)
        want = step(*[_clone(a) for a in args])
        got = [g.clone() for g in compiled(*[_clone(a) for a in args])]
        torch.cuda.synchronize()
        for g, w, e in zip(got, want, exact):
            assert same(g, w, e), f"seed {seed}"
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])  # it really ran as a CUDA graph
