"""One DSA layer's training step (examples/dsa_training_step.py) in a process where importing ``cutlass``
and ``cudnn`` raises, against the fp64 autograd reference of the same step (tests/gpu/ref_training_step.py).

The example runs in a subprocess (its own import blocker; it reports whether either package got
imported, and the step's op log) and saves its inputs, intermediates and gradients; this process
computes the reference on the GPU in fp64 and compares: the indexer's scores, the top-k choice
(ref_indexer_top_k.check against the op's own scores), out / lse, target / predict and the five
gradients, each within its op's bound. On an SM90 GPU the sparse attention forward has no kernel
(upstream has none): the example says so by name and uses its torch stand-in for that op only; the
test asserts exactly that op, and no other, was skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

import ref_indexer_top_k  # noqa: E402
import ref_training_step as ref  # noqa: E402
from refutil import rel_err  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "dsa_training_step.py")
OPS = ("indexer_forward", "indexer_top_k", "sparse_attention_forward", "sparse_attn_score_recompute", "sparse_indexer_score_recompute",
       "sparse_attention_backward", "indexer_backward")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("step") / "step.pt"
    p = subprocess.run([sys.executable, EXAMPLE, "--json", "--save", str(out)], capture_output=True, text=True, env=_env(), timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    meta = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"\ntraining step (dsa-aot): {meta}")
    return meta, torch.load(out, map_location="cuda")


def test_the_step_runs_without_the_toolchain(run):
    meta, _ = run
    assert meta["cutlass_imported"] is False and meta["cudnn_imported"] is False
    sm100 = torch.cuda.get_device_capability()[0] == 10
    ran = meta["ran"]
    assert [r.split(":")[0] for r in ran] == ["indexer_forward", "indexer_top_k", "sparse_attention_forward", "sparse_attn_score_recompute",
                                                 "sparse_indexer_score_recompute", "sparse_attention_backward", "indexer_backward"]
    skipped = [r.split(":")[0] for r in ran if "SKIPPED" in r]
    assert skipped == ([] if sm100 else ["sparse_attention_forward"]), ran


def test_the_blocker_makes_the_toolchain_unimportable():
    code = f"import sys; sys.path.insert(0, {os.path.dirname(EXAMPLE)!r}); import dsa_training_step as s; s.block_toolchain()\n" \
           "for m in ('cutlass', 'cudnn', 'cutlass.cute'):\n    try:\n        __import__(m)\n    except ImportError:\n        continue\n" \
           "    raise SystemExit(f'{m} imported')\nprint('blocked')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "blocked", p.stdout + p.stderr


def test_the_steps_results_match_the_fp64_reference(run):
    _, saved = run
    x, r = saved["inputs"], saved["result"]
    S = x["q"].shape[0]
    seq_lens = torch.arange(1, S + 1, dtype=torch.int32)
    problems = ref_indexer_top_k.check(r["scores"].cpu(), seq_lens, r["indices"].cpu(), None, x["K"])
    assert problems == [], problems[:5]
    want = ref.step_reference(x, r["indices"])
    finite = torch.isfinite(want["scores"])
    assert torch.equal(torch.isfinite(r["scores"]), finite), "the causal mask differs"
    errs = {"scores": rel_err(r["scores"][finite], want["scores"][finite])}
    for name in ("out", "lse", "target", "predict", "dq", "dkv", "d_qi", "d_w", "d_ki"):
        errs[name] = rel_err(r[name], want[name])
    print(f"\nrel err vs the fp64 step: {', '.join(f'{k} {v:.2e}' for k, v in errs.items())}")
    bad = {k: v for k, v in errs.items() if not v <= ref.BOUNDS[k]}
    assert not bad, f"over the bounds {ref.BOUNDS}: {bad}"
    for name in ("dq", "dkv", "d_qi", "d_w", "d_ki"):
        assert not torch.isnan(r[name]).any() and r[name].abs().sum() > 0, name
