"""dsa_aot.ops.declare's features, on stand-in declarations (pure Python: no driver, no build)."""

import pytest

from dsa_aot.errors import InputError
from dsa_aot.ops import declare
from dsa_aot.ops._support import input_error


def _op(**kw):
    """A declared op (taken out of declare.OPS again: the fuzz and the cache resets walk that list)."""
    op = declare.Op("fam", "thing", plan_class="Thing", into="out, x, flag=False, stream=None", alloc="x, flag=False, stream=None",
                    tensors=(declare.Out("out", "float32", ("n",)), declare.In("x", "float32", ("n",))),
                    options=(declare.Flag("flag", False),), plan=lambda rec, c: None, **kw)
    declare.OPS.remove(op)
    return op


# --- Op(check=fn): the family's own validation in place of the generic one ---------------------------------


def test_check_replaces_the_generic_validation_and_reports_options_and_tensors_together():
    seen = []

    def check(c, problems):
        seen.append((c.out, c.x, c.flag, c.allocating))
        problems.append(f"flag={c.flag!r} (expected True or False)")
        problems.append("x: dtype torch.int8 (expected torch.float32)")

    _, into, _ = _op(check=check).forms({})
    with pytest.raises(InputError) as e:
        into("o", "not a tensor", flag=2)  # the generic checks would stop at the option alone
    assert "flag=2" in str(e.value) and "x: dtype torch.int8" in str(e.value)
    assert seen == [("o", "not a tensor", 2, False)], "the check sees every argument by name, the generic checks none of them"


def test_check_passing_returns_the_context_the_check_filled():
    def check(c, problems):
        c.dev, c.sym["n"], c.ws_need = 0, 3, 0

    op = _op(check=check)
    c = op.validate(dict(out=None, x=None, flag=True), allocating=True)
    assert (c.dev, c.sym["n"], c.allocating, c.flag) == (0, 3, True, True)


# --- Op(plan_args=...): the plan constructor's own signature -----------------------------------------------


def test_plan_args_give_the_plan_constructor_its_own_signature():
    got = []

    def check(c, problems):
        got.append(c.flag)
        raise input_error(["stop here"])

    _, _, plan = _op(check=check, plan_args="out, x, *, flag=False").forms({})
    with pytest.raises(InputError, match="stop here"):
        plan("o", "x", flag=True)
    with pytest.raises(TypeError):
        plan("o", "x", True)  # flag is keyword-only in the plan's signature, positional in _into's
    with pytest.raises(InputError):
        plan("o", "x")
    assert got == [True, False]
    assert "Thing(out, x, *, flag=False)" in plan.__doc__
