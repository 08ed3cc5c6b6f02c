"""The parity harness (ci/parity/harness.py) without a GPU: its ``compare`` step on results a jit and an
aot step would write (made up here, small) passes when the sides agree and fails on each thing it checks;
its recording dict sees every way cudnn looks up a compile cache; every family's declaration names cudnn
compile caches that exist. (The jit and aot steps need the H200: docs/gpu-results.md.)"""

import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci" / "parity"))
import harness as H  # noqa: E402

KEYS = [["op_a", {"n": 1}], ["op_b", {"n": 2}]]


def _close(spec, jit, aot):
    ok = bool(torch.allclose(jit["c"], aot["c"], atol=1e-3))
    return ok, "close" if ok else "far"


PAR = H.Parity(family="fam", doc="A made-up family.", cases=lambda quick: [("c1", {"op": "x"})], inputs=lambda spec: {},
               outputs=lambda spec: {"a": H.BITWISE, "b": H.JITTER, "c": _close},
               reference=lambda spec, x, outs: [] if bool((outs["a"] >= 0).all()) else ["a is negative"],
               jit=H.Jit(setup=None, caches={}, index_key=None, call=None), aot=H.Aot(call=None))


def _outputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randint(0, 9, (4, 3), generator=g, dtype=torch.int32), "b": torch.rand(4, 3, generator=g).bfloat16(),
            "c": torch.rand(5, generator=g)}


def _run(d, mutate=lambda jit, aot, jo, ao: None):
    """Write both sides' results for one case (AOT = JIT: first, two reruns, into), apply ``mutate``, compare."""
    o = _outputs()
    jo = {f"first.{n}": t for n, t in o.items()} | {f"first.{n}.run{r}": t.clone() for n, t in o.items() for r in (2, 3)}
    ao = {f"first.{n}": t.clone() for n, t in o.items()} | {f"first.{n}.run2": t.clone() for n, t in o.items()} | {f"into.{n}": t.clone() for n, t in o.items()}
    row = dict(case="c1", label="x", spec={"op": "x"}, touched=[], buffers={"ws": [[64], "torch.uint8"]}, keys=KEYS, new=True, first_s=0.5,
               warm_us=10.0, device_us=20.0)
    meta = dict(arch="sm_90a", device="test", sm_count=132, torch=torch.__version__, import_s=1.0, torch_add_us=5.0)
    jit = {"meta": meta, "rows": {"c1": dict(row)}, "cubins": [{"op": op, "key": k, "jit_key": "k", "sha256": f"s{i}"} for i, (op, k) in enumerate(KEYS)]}
    aot = {"meta": dict(meta, loads_ms=[1.0]), "rows": {"c1": dict(row, warm_into_us=8.0)},
           "index": {"entries": [{"family": "fam", "arch": "sm_90a", "op": op, "key": k, "sha256": f"s{i}"} for i, (op, k) in enumerate(KEYS)]}}
    mutate(jit, aot, jo, ao)
    for side, saved in (("jit", jo), ("aot", ao)):
        (d / side).mkdir(parents=True)
        torch.save(saved, d / side / "c1.pt")
        (d / f"{side}.json").write_text(json.dumps({"jit": jit, "aot": aot}[side]))
    (d / "inputs").mkdir()
    torch.save({}, d / "inputs" / "c1.pt")
    return H.compare_step(PAR, type("Args", (), {"dir": str(d)}))


def _set(side, k, v):
    def f(jit, aot, jo, ao):
        {"jit": jo, "aot": ao}[side][k] = v(({"jit": jo, "aot": ao}[side])[k])

    return f


MUTATIONS = {
    "bitwise output differs (first call)": (_set("aot", "first.a", lambda t: t + 1), "a (first): NO"),
    "bitwise output differs (rerun)": (_set("aot", "first.a.run2", lambda t: t.flip(0)), "a (run2): NO"),
    "the JIT does not reproduce a bitwise output": (_set("jit", "first.a.run3", lambda t: t + 1), "a bitwise rule cannot hold"),
    "jitter output beyond a reproducible JIT": (_set("aot", "into.b", lambda t: t * 1.5), "b (into): NO"),
    "NaN left in a jitter output": (_set("aot", "first.b", lambda t: t.index_fill(0, torch.tensor([1]), math.nan)), "NaN"),
    "custom rule fails": (_set("aot", "into.c", lambda t: t + 1), "c (into): far"),
    "reference fails on one side": (_set("jit", "first.a", lambda t: t - 100), "reference: jit first: a is negative"),
    "an output the AOT side never saved": (lambda j, a, jo, ao: ao.pop("first.b"), "b (first): not saved on the aot side"),
    "kernels differ": (lambda j, a, jo, ao: a["rows"]["c1"].update(keys=KEYS[:1]), "kernels differ"),
    "workspace sizes differ": (lambda j, a, jo, ao: a["rows"]["c1"].update(buffers={"ws": [[128], "torch.uint8"]}), "caller buffers differ"),
    "an input written": (lambda j, a, jo, ao: a["rows"]["c1"].update(touched=["q (first call)"]), "input q (first call) modified on the aot side"),
    "a JIT cubin is not the shipped one": (lambda j, a, jo, ao: j["cubins"][1].update(sha256="zz"), "sha256 zz vs shipped"),
    "a kernel without a shipped entry": (lambda j, a, jo, ao: a["index"]["entries"].pop(0), "has no shipped entry"),
    "a case raised on one side": (lambda j, a, jo, ao: a["rows"]["c1"].update(error="RuntimeError: boom"), "aot raised RuntimeError: boom"),
    "a case only the AOT side ran": (lambda j, a, jo, ao: a["rows"].update(c2=dict(a["rows"]["c1"])), "c2: run on the aot side only"),
}


def test_compare_passes_when_the_sides_agree(tmp_path, capsys):
    assert _run(tmp_path) == 0
    out = capsys.readouterr().out
    assert "OK: 1 cases of fam" in out and "a bitwise; b bitwise; c close" in out
    assert json.loads((tmp_path / "parity.json").read_text())["ok"] is True


@pytest.mark.parametrize("what", MUTATIONS)
def test_compare_fails_on(what, tmp_path, capsys):
    mutate, text = MUTATIONS[what]
    assert _run(tmp_path, mutate) == 1
    assert text in capsys.readouterr().out
    assert json.loads((tmp_path / "parity.json").read_text())["ok"] is False


def test_jitter_rule_holds_a_jittery_jit_to_its_own_jitter():
    j = torch.tensor([[-math.inf, 1.0, 2.0]])
    jo = {"out": j, "out.run2": torch.tensor([[-math.inf, 1.0, 2.0 + 1e-6]])}  # equal infinities are equal, not NaN differences
    assert H.jitter_verdict(jo, {"out": torch.tensor([[-math.inf, 1.0 + 1e-7, 2.0]])}, "out")[0] is True
    assert H.jitter_verdict(jo, {"out": torch.tensor([[-math.inf, 1.0 + 1e-4, 2.0]])}, "out")[0] is False
    assert H.jitter_verdict(jo, {"out": torch.tensor([[0.0, 1.0, 2.0]])}, "out")[0] is False


def test_recording_sees_every_lookup_and_store():
    rec = H.Recording({"k1": 1})
    assert "k0" not in rec and rec["k1"] == 1 and rec.get("k2") is None
    rec["k3"] = 3
    rec.setdefault("k4", 4)
    assert rec.used == ["k0", "k1", "k2", "k3", "k4"] and dict(rec) == {"k1": 1, "k3": 3, "k4": 4}


def test_the_aot_spy_wraps_the_one_entry_lookup_of_the_op_modules():
    from dsa_aot.ops import gpu as _support

    assert list(inspect.signature(_support._find).parameters)[:4] == ["ix", "family", "op", "key"]


def test_every_family_declares_a_parity_whose_cudnn_caches_exist():
    """In a subprocess (importing cudnn's kernel modules imports cutlass): every family's Parity, its
    compile caches module dicts, its jit setup importable."""
    code = f"""
import importlib, sys
sys.path.insert(0, {str(ROOT / 'ci' / 'parity')!r})
from dsa_aot.policy.families import FAMILIES
import harness
for fam in FAMILIES:
    par = importlib.import_module(fam).PARITY
    assert isinstance(par, harness.Parity) and par.family == fam, fam
    assert par.cases(True) and par.cases(False), fam
    keys = harness.JitKeys(par.jit.caches)
    for kind in par.jit.caches:
        assert isinstance(keys.table(kind), dict), (fam, kind)
    print(fam, len(par.cases(False)), sorted(par.jit.caches))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(r.stdout.splitlines()) == 10


def test_jitter_counts_the_aot_reruns_of_the_same_cubin_but_not_an_infinity():
    """A rare race a few JIT reruns did not show: the AOT's own reruns measure it too (the same cubins); an
    infinity between two AOT runs is no jitter."""
    j = torch.tensor([1.0, 2.0, 3.0])
    jo = {"out": j, "out.run2": j.clone()}
    near = torch.tensor([1.0, 2.0 + 2e-7, 3.0])
    assert H.jitter_verdict(jo, {"out": near}, "out")[0] is False  # neither side varied: bitwise
    assert H.jitter_verdict(jo, {"out": near}, "out", own=2e-7)[0] is True
    assert H.jitter_verdict(jo, {"out": torch.tensor([1.0, 2.1, 3.0])}, "out", own=2e-7)[0] is False
    ao = {"first.out": j, "first.out.run2": torch.tensor([1.0, math.inf, 3.0])}
    assert math.isnan(H._own_jitter(ao, "out"))
    assert H.jitter_verdict(jo, {"out": j}, "out", own=H._own_jitter(ao, "out"))[0] is False


def test_every_family_is_declared_so_the_aot_side_empties_every_memo_with_clear_caches():
    """The AOT side forgets validated calls with declare.clear_caches() alone (else it would resolve no entry on a
    repeated shape): every family has declared ops, and no op module keeps a memo dict of its own that it would miss."""
    import importlib

    from dsa_aot.ops import declare
    from dsa_aot.policy.families import FAMILIES

    for fam in FAMILIES:
        mod = importlib.import_module(f"dsa_aot.ops.{fam}")
        assert any(op.family == fam for op in declare.OPS), f"{fam}: no declared op"
        memos = [n for n, v in vars(mod).items() if type(v) is dict and n.endswith(("CALLS", "_FWD", "_BWD", "_TAILS", "_CACHE"))]
        assert not memos, (fam, memos)


def test_the_jit_side_compiles_as_cudnn_does_in_production(monkeypatch):
    """No keep mode (it disables the DSL's caches and changes some cubins: refused), and a fresh empty DSL
    file cache, so that a first call compiles instead of loading an earlier process's module."""
    import os

    for v in ("CUTE_DSL_KEEP", "CUTE_DSL_DUMP_DIR", "CUTE_DSL_KEEP_CUBIN", "CUTE_DSL_KEEP_PTX"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("CUTE_DSL_KEEP", "cubin")
    with pytest.raises(SystemExit, match="CUTE_DSL_KEEP"):
        H.production_jit()
    monkeypatch.delenv("CUTE_DSL_KEEP")
    monkeypatch.setenv("CUTE_DSL_CACHE_DIR", "/tmp/somewhere-used")
    H.production_jit()
    d = os.environ["CUTE_DSL_CACHE_DIR"]
    assert d != "/tmp/somewhere-used" and os.path.isdir(d) and not os.listdir(d)
    os.rmdir(d)


def test_poison_keeps_the_dtype_of_narrow_integers():
    t = H.poison(torch.empty(3, dtype=torch.int16))
    assert t.dtype == torch.int16 and bool((t.view(torch.uint8) == 0xA5).all())
    assert bool(H.poison(torch.empty(2, dtype=torch.int32)).eq(H.INT_POISON).all()) and H.poison(torch.empty(2)).isnan().all()


def test_a_gpu_the_declaration_does_not_cover_fails_and_one_without_kernels_is_not_applicable():
    class _Torch:
        class cuda:
            @staticmethod
            def get_device_capability():
                return (10, 0)

    import dataclasses

    assert H._applicable(dataclasses.replace(PAR, arches=("sm_90a",)), _Torch) is False  # no kernel there: exit 2
    with pytest.raises(SystemExit, match="covers sm_90a only"):
        H._applicable(dataclasses.replace(PAR, covers=("sm_90a",)), _Torch)
    assert H._applicable(PAR, _Torch) is True
