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


# --- Op(alloc_prelude=fn), alloc_only / torch_default options, Int(default=None), callable shapes, returns=False, c.keep ---

import torch  # noqa: E402

import stand_in  # noqa: E402
from dsa_aot.ops.declare import OPS, Flag, In, Int, OneOf, Op, Out  # noqa: E402


def _fused_like(**kw):
    def check(c, problems):  # the family's own validation, option and tensor problems together
        if not isinstance(c.x, torch.Tensor):
            problems.append("x: not a tensor")
        if not (type(c.n) is int and c.n >= 1):
            problems.append(f"n={c.n!r}")
        c.dev = 0

    def plan(rec, c):
        c.keep = (torch.zeros(4),)  # memory the plan owns

    def prelude(c, stream):  # the allocating form's _into call: the output made, from the allocating-only option
        return {"out": stand_in.cuda_tensor(torch.zeros(c.x.shape[0] * c.scale_by, dtype=torch.float32)), "scratch": c.x.new_zeros(4)}

    op = Op("test_family", "twice", plan_class="Twice", into="out, scratch, x, n=1, mode='fast', limit=None, stream=None",
            alloc="x, n=1, mode='fast', limit=None, scale_by=1, flag=None, stream=None",
            tensors=(Out("out", "float32", lambda c: (c.x.shape[0] * c.scale_by,)), Out("scratch", "float32", ("k",), returns=False),
                     In("x", "float32", None)),
            options=(Int("n", 1, 8, 1), OneOf("mode", ("fast", "slow"), "fast"), Int("limit", 0, 9, None),
                     Int("scale_by", 1, 4, 1, alloc_only=True), Flag("flag", None, alloc_only=True, torch_default=True)),
            check=check, plan=plan, alloc_prelude=prelude, into_returns=("out",), **kw)
    OPS.remove(op)
    return op


def test_a_check_sees_the_allocating_call_too(env):
    op = _fused_like()
    alloc, into, _ = op.forms({})
    with pytest.raises(InputError, match=r"2 invalid input\(s\)[\s\S]*x: not a tensor[\s\S]*n=0"):
        into(None, None, None, n=0, stream=env.new_stream(0))
    with pytest.raises(InputError, match="x: not a tensor"):
        alloc(None)


def test_the_prelude_makes_the_into_call_and_the_result_leaves_out_unreturned_outputs(env):
    op = _fused_like()
    alloc, into, plan_cls = op.forms({})
    x = stand_in.cuda_tensor(torch.zeros(3))
    r = alloc(x, scale_by=2, stream=env.new_stream(0))
    assert list(r) and set(r.keys()) == {"out"} and r["out"].shape == (6,)
    call = next(iter(op.cache.values()))
    assert call.keep and call.keep[0].shape == (4,)  # c.keep reached the compiled call
    assert "scale_by" not in op.key and "flag" not in op.key  # allocating-only options: not the _into form's


def test_schemas_say_none_defaults_strings_and_torch_defaults():
    op = _fused_like()
    alloc, into, _ = op.forms({})
    ops = op.torch_ops("t", alloc, into)
    schema = ops["t_twice"][0]
    assert 'str mode="fast"' in schema and "int? limit=None" in schema and "bool flag=True" in schema and "int scale_by=1" in schema
    assert "scratch" not in schema and schema.endswith("-> Tensor")
    assert "Tensor(b!) scratch" in ops["t_twice_into"][0]


def test_an_int_defaulting_to_none_takes_none():
    opt = Int("limit", 0, 9, None)
    problems = []
    opt.check(problems, None)
    opt.check(problems, 10)
    assert len(problems) == 1 and None not in opt.bad_values() and None in Int("n", 0, 9).bad_values()


def test_a_callable_shape_sizes_the_fake_output():
    op = _fused_like()
    alloc, into, _ = op.forms({})
    _, _, fake = op.torch_ops("t", alloc, into)["t_twice"]
    x = torch.zeros(5)
    assert fake(x, 1, "fast", None, 3, True).shape == (15,)
