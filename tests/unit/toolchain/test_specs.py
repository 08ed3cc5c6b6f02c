"""The spec contract (dsa_aot.toolchain.specs.Spec): every registered spec keeps it, and one that breaks it
is refused when it loads, naming each broken part, before anything compiles."""

import pytest

from dsa_aot.errors import CompileError
from dsa_aot.policy.families import FAMILIES, family_policy
from dsa_aot.toolchain import specs


def test_every_registered_spec_keeps_the_contract():
    for f in FAMILIES:
        s = specs.SPECS[f]
        assert isinstance(s, specs.Spec) and s.family == f
        assert s.ops is family_policy(f).OPS  # the policy's own table, not a copy that can drift
        assert set(s.routes) == set(s.ops) and set(s.literals) <= set(s.ops)


_GOOD = '''
from dsa_aot.policy import dsa_topk_utils as policy
FAMILY = "dsa_topk_utils"
OPS = policy.OPS
def build(op, key, target): pass
def check_policy(targets): pass
def fidelity(op, key, target, up): pass
FIDELITY_ROUTES = {op: "route" for op in OPS}
'''


@pytest.mark.parametrize("edit, says", [
    (lambda s: s, None),
    (lambda s: s.replace('FIDELITY_ROUTES = {op: "route" for op in OPS}', 'FIDELITY_ROUTES = {op: "route" for op in list(OPS)[1:]}'),
     "FIDELITY_ROUTES: one route text per op of OPS (missing ['"),
    (lambda s: s.replace('for op in OPS}', 'for op in [*OPS, "ghost"]}'), "unknown ['ghost']"),
    (lambda s: s.replace('FAMILY = "dsa_topk_utils"', 'FAMILY = "other"'), "FAMILY is 'other'"),
    (lambda s: s.replace("def fidelity(op, key, target, up): pass", "fidelity = None"), "fidelity: missing or not a function"),
    (lambda s: s + 'LITERALS = {"nope": {"x": 1.0}}\n', "LITERALS"),
    (lambda s: s + 'PRELOAD = "cudnn.one_module"\n', "PRELOAD: a tuple of module names"),
])
def test_a_spec_that_breaks_the_contract_is_refused_when_it_loads(tmp_path, monkeypatch, edit, says):
    (tmp_path / "dsa_topk_utils.py").write_text(edit(_GOOD))
    monkeypatch.setenv("AOT_KERNELS_DIR", str(tmp_path))
    loader = specs._Specs()
    if says is None:
        assert set(loader["dsa_topk_utils"].routes) == set(family_policy("dsa_topk_utils").OPS)
        return
    with pytest.raises(CompileError, match="breaks the spec contract") as e:
        loader["dsa_topk_utils"]
    assert says in str(e.value)
