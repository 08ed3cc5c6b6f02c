"""The parity scripts' ``compare`` step without a GPU: on the results a jit and an aot step would write
(made up here, small), the dense indexer backward and score recompute compares pass when the sides
agree, and fail on an output that differs, a kernel the AOT side did not share, a cubin whose sha256
is not the shipped one, or an input one side modified. (The jit and aot steps need the H200.)"""

import importlib
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _script(name):
    import sys

    sys.path.insert(0, str(ROOT / "ci" / "parity"))
    spec = importlib.util.spec_from_file_location(f"parity_{name}", ROOT / "ci" / "parity" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(name, spec, keys, **kw):
    row = dict(case=name, label=name, spec=spec, keys=keys, new=True, first_s=0.5, warm_us=10.0, warm_into_us=9.0, device_us=20.0,
               inputs_untouched=True)
    return {**row, **kw}


def _write(d, family, rows, saved, keys):
    """jit.json / aot.json and the saved outputs of each side; the index ships every key with sha 'aa'."""
    for side in ("jit", "aot"):
        (d / side).mkdir(parents=True, exist_ok=True)
        for name, outs in saved[side].items():
            torch.save(outs, d / side / f"{name}.pt")
    meta = {"arch": "sm_90a", "device": "test", "sm_count": 132, "torch": torch.__version__, "import_s": 1.0, "torch_add_us": 5.0}
    cubins = [{"op": op, "key": key, "jit_key": "k", "sha256": "aa", "bytes": 1} for op, key in keys]
    entries = [{"family": family, "arch": "sm_90a", "op": op, "key": key, "sha256": "aa", "id": f"{op}{i}"} for i, (op, key) in enumerate(keys)]
    (d / "jit.json").write_text(json.dumps({"meta": meta, "rows": rows["jit"], "cubins": cubins}))
    (d / "aot.json").write_text(json.dumps({"meta": meta, "rows": rows["aot"], "index": {"entries": entries}}))


class _Args:
    def __init__(self, d):
        self.dir = str(d)


def test_score_recompute_compare(tmp_path, capsys):
    mod = _script("dsa_score_recompute")
    key = ["sparse_indexer_sm90", {"heads": 64, "topk": 512, "length": False, "topk_global": False}]
    spec = dict(b=1, s_q=2, s_k=8, topk=512, length=False, glob=False, seed=1, op="indexer", h=64, d=128)
    p = torch.rand(1, 2, 512)
    good = {"out": p, "out.run2": p.clone(), "into.out": p.clone()}

    def run(d, aot_saved=None, aot_row=None, sha="aa"):
        rows = {"jit": {"c": _row("c", spec, [key])}, "aot": {"c": aot_row or _row("c", spec, [key])}}
        _write(d, mod.FAMILY, rows, {"jit": {"c": good}, "aot": {"c": aot_saved or good}}, [tuple(key)])
        if sha != "aa":
            j = json.loads((d / "jit.json").read_text())
            j["cubins"][0]["sha256"] = sha
            (d / "jit.json").write_text(json.dumps(j))
        return mod.cmd_compare(_Args(d))

    assert run(tmp_path / "ok") == 0
    off = dict(good, out=p + 1e-3)
    assert run(tmp_path / "off", aot_saved=off) == 1
    assert run(tmp_path / "into", aot_saved=dict(good, **{"into.out": p * 0})) == 1
    assert run(tmp_path / "kernel", aot_row=_row("c", spec, [["sparse_indexer_sm90", dict(key[1], topk=1024)]])) == 1
    assert run(tmp_path / "sha", sha="bb") == 1
    assert run(tmp_path / "input", aot_row=_row("c", spec, [key], inputs_untouched=False)) == 1
    out = capsys.readouterr().out
    assert "OK: 1 cases" in out and "modified on the aot side" in out and "kernels differ" in out


def test_dense_indexer_backward_compare_with_a_race_row(tmp_path, capsys):
    mod = _script("dsa_dense_indexer_backward")
    keys = [["score_grad_sm90", {"varlen": False, "ratio": 1, "offsets": False}],
            ["gemm_sm90", {"heads": 64, "varlen": False, "ratio": 1, "offsets": False}]]
    spec = dict(b=1, s_q=4, s_k=128, ratio=1, offsets=False, varlen=False, dk="bf16", seed=1)
    race_spec = dict(spec, dk="f32", race=10)
    t = {n: torch.rand(3, 5).bfloat16() for n in mod.JITTERY}
    sig = torch.rand(4, 128)
    jit_saved = {**t, **{f"{n}.run2": v.clone() for n, v in t.items()}, "index_score": sig}
    aot_saved = {**t, **{f"into.{n}": v.clone() for n, v in t.items()}, "index_score": sig.clone(), "into.index_score": sig.clone()}

    def run(d, aot_out=None, race_inputs=True):
        rows = {"jit": {"c": _row("c", spec, keys), "r": _row("r", race_spec, keys, race_off=3)},
                "aot": {"c": _row("c", spec, keys), "r": _row("r", race_spec, keys, race_off=4, inputs_untouched=race_inputs)}}
        _write(d, mod.FAMILY, rows, {"jit": {"c": jit_saved}, "aot": {"c": aot_out or aot_saved}}, [tuple(k) for k in keys])
        return mod.cmd_compare(_Args(d))

    assert run(tmp_path / "ok") == 0
    assert "JIT 3/10, AOT 4/10" in capsys.readouterr().out
    bad_sig = dict(aot_saved, index_score=sig + 1)
    assert run(tmp_path / "sig", aot_out=bad_sig) == 1
    assert run(tmp_path / "race-input", race_inputs=False) == 1
    assert "score-grad signal" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["dsa_indexer_backward", "dsa_indexer_forward", "dsa_indexer_forward_top_k", "dsa_indexer_top_k",
                                  "dsa_sparse_attention_forward", "dsa_topk_utils", "dsa_dense_indexer_backward", "dsa_score_recompute"])
def test_aot_sides_spy_on_their_op_modules_caches(name):
    """Each script's AotApi names an op module and caches that exist (the spy empties them before a first call)."""
    mod = _script(name)
    ops = importlib.import_module(mod.AotApi.OP_MODULE)
    import parity_common

    assert all(isinstance(parity_common.cache_of(ops, c), dict) for c in mod.AotApi.CACHES)


def test_jitter_verdict_compares_equal_infinities_as_equal():
    """The dense score recompute's masked logits are -inf on both sides: equal, not NaN differences; a NaN
    or a finite value where the JIT has -inf still fails."""
    import parity_common as pc

    j = torch.tensor([[-math.inf, 1.0, 2.0]])
    jo = {"out": j, "out.run2": j.clone()}
    assert pc.jitter_verdict(jo, {"out": j.clone()}, "out")[:2] == (True, "bitwise")
    assert pc.jitter_verdict(jo, {"out": torch.tensor([[0.0, 1.0, 2.0]])}, "out")[0] is False
    assert pc.jitter_verdict(jo, {"out": torch.tensor([[math.nan, 1.0, 2.0]])}, "out")[0] is False
    jn = {"out": j, "out.run2": torch.tensor([[-math.inf, 1.0, 2.0 + 1e-6]])}  # the JIT jitters: a tolerance, the -inf still equal
    assert pc.jitter_verdict(jn, {"out": torch.tensor([[-math.inf, 1.0 + 1e-7, 2.0]])}, "out")[0] is True
