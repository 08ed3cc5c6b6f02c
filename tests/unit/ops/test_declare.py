"""dsa_aot.ops.declare's features, on stand-in declarations (pure Python, or a toy op on the stand-in driver whose
one step is a memset of its output)."""

import contextlib

import pytest
import torch

import stand_in
from dsa_aot.errors import InputError
from dsa_aot.ops import declare
from dsa_aot.ops import declare as D
from dsa_aot.ops.checks import input_error


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


# --- In(written=), Out(alloc_like=), given outputs, Op(early_rules=), Op(scalar_fn=): the indexer backward's ---

def _toy(monkeypatch, need=0, early_rules=None, scalar_fn=None):
    """(op, allocating form, _into form, plan class, torch.empty_like calls) of a toy op: ``out`` (given, allocated
    empty_like ``x``) = f(x, y), ``y`` also written, ``workspace`` of ``need`` bytes (given)."""

    def plan(rec, c):
        rec.memset(c.p.out, 4)

    op = D.Op("toy", "toy", plan_class="Toy", into="out, x, y, scale=1.0, mode='a', stream=None, *, workspace=None",
              alloc="x, y, scale=1.0, mode='a', out=None, stream=None, *, workspace=None",
              tensors=(D.Out("out", "float32", "like x", given=True, alloc_like=True), D.In("x", "float32", ("n",)),
                       D.In("y", "float32", ("n",), written=True), D.Workspace("workspace", lambda c: need, "toy_bytes", given=True)),
              options=(D.Float("scale", 1.0, per_call=True), D.OneOf("mode", ("a", "b"), "a")), plan=plan, early_rules=early_rules, scalar_fn=scalar_fn)
    D.OPS.remove(op)  # not one of the package's ops
    alloc, into, cls = op.forms({"__name__": __name__})
    made = []

    def empty_like(t, **kw):
        made.append(t)
        return stand_in.cuda_tensor(torch.zeros(t.shape, dtype=t.dtype), t.get_device())

    monkeypatch.setattr(torch, "empty_like", empty_like)
    monkeypatch.setitem(alloc.__globals__, "alloc_on", lambda *a: contextlib.nullcontext())
    return op, alloc, into, cls, made


def _f(n=8, off=0):
    return stand_in.cuda_tensor(torch.zeros(n + off)[off:])


def test_a_written_input_is_marked_in_the_schema_and_checked_for_overlap(env, monkeypatch):
    op, alloc, into, _, _ = _toy(monkeypatch)
    ops = op.torch_ops("dsa", alloc, into)
    assert ops["dsa_toy"][0] == '(Tensor x, Tensor(a!) y, float scale=1.0, str mode="a") -> Tensor'  # str defaults double-quoted
    assert ops["dsa_toy_into"][0].startswith("(Tensor(a!) out, Tensor x, Tensor(b!) y,")
    x = _f()
    with pytest.raises(InputError, match="y: overlaps x"):
        into(_f(), x, x, stream=env.new_stream(0))
    assert not env.memsets


def test_the_allocating_form_allocates_like_the_input_and_checks_given_outputs_first(env, monkeypatch):
    op, alloc, into, _, made = _toy(monkeypatch)
    s = env.new_stream(0)
    x, y = _f(), _f()
    r = alloc(x, y, stream=s)
    assert made == [x] and r["out"].shape == x.shape and len(env.memsets) == 1
    with pytest.raises(InputError, match="out: overlaps x"):  # a given output over an input: refused before allocating
        alloc(x, y, out=x, stream=s)
    out = _f()
    alloc(x, y, out=out, stream=s)  # remembered with the given output
    made.clear()
    env.memsets.clear()
    with pytest.raises(InputError, match="overlaps out"):  # the same shapes, now overlapping: the memo's recheck refuses it
        alloc(x, y, out=y, stream=s)
    with pytest.raises(InputError, match="scale"):  # a per-call scalar of a remembered call: refused before allocating
        alloc(x, y, scale=float("nan"), stream=s)
    assert not made and not env.memsets


def test_early_rules_report_options_and_tensors_together_and_cpu_tensors_keep_their_checks(env, monkeypatch):
    def early_rules(c, problems):
        problems.append(f"toy: mode is {c.mode!r}")

    _, _, into, _, _ = _toy(monkeypatch, early_rules=early_rules)
    with pytest.raises(InputError) as e:
        into(_f(), torch.zeros(8, dtype=torch.float16), _f(7), mode="c", stream=env.new_stream(0))
    msg = str(e.value)
    for want in ("mode='c'", "x: on cpu", "x: dtype torch.float16", "y: shape (7,) (expected (8,))", "toy: mode is 'c'"):
        assert want in msg, (want, msg)


def test_scalar_fn_checks_and_derives_the_per_call_scalars(env, monkeypatch):
    def scalar_fn(c):
        n = c.sym["n"]

        def scalars(scale):
            if not scale > 0:
                raise InputError(f"scale={scale} (expected > 0 for this call)")
            return (scale / n,)

        return scalars

    _, _, into, cls, _ = _toy(monkeypatch, scalar_fn=scalar_fn)
    plan = cls(_f(), _f(), _f(), scale=2.0)
    assert plan._call.x == (0.25,) and plan._call.scalars(scale=4.0) == (0.5,)
    with pytest.raises(InputError, match="expected > 0 for this call"):
        into(_f(), _f(), _f(), scale=-1.0, stream=env.new_stream(0))


def test_a_given_workspace_the_call_does_not_need_is_not_rechecked(env, monkeypatch):
    _, _, into, _, _ = _toy(monkeypatch, need=0)
    ws = stand_in.cuda_tensor(torch.zeros(33, dtype=torch.uint8)[1:])  # misaligned, unused
    for _ in range(2):
        into(_f(), _f(), _f(), stream=env.new_stream(0), workspace=ws)
    assert len(env.memsets) == 2


# --- check_options / check_written (a family check's generic first and last steps), a callable workspace alignment,
# --- torch_into= (a positional workspace in the _into schema): a toy op whose plan is one torch step, no driver ---


def _ws_toy(monkeypatch, **kw):
    runs = []
    op = Op("toy_family", "toy_ws", plan_class="ToyWs", plan=lambda rec, c: rec.then(lambda ts, stream: runs.append(ts)),
            into="out, ws, x, scale=1.0, mode='a', stream=None", alloc="x, scale=1.0, out=None, ws=None, mode='a', stream=None",
            tensors=(Out("out", "float32", ("n",), given=True), D.Workspace("ws", lambda c: 64, "toy_bytes", align=lambda c: 32, given=True),
                     In("x", "float32", ("n",))),
            options=(D.Float("scale", 1.0, per_call=True), OneOf("mode", ("a",), "a")), **kw)
    OPS.remove(op)
    alloc, into, _ = op.forms({})
    for g in (alloc.__globals__, into.__globals__):
        monkeypatch.setitem(g, "stream_handle", lambda stream, dev: 0)
    return op, alloc, into, runs


def _ws_t(n=8, dtype=torch.float32):
    return stand_in.cuda_tensor(torch.zeros(n, dtype=dtype))


def _ws_ws(offset=0):
    base = torch.zeros(128, dtype=torch.uint8)
    shift = (-base.data_ptr() + offset) % 64
    return stand_in.cuda_tensor(base[shift : shift + 64])


def test_a_check_may_start_and_end_with_the_generic_option_and_written_checks(monkeypatch):
    def check(c, problems):  # the family's own tensor checks between the generic first and last steps
        op.check_options(vars(c), problems)
        c.dev, c.sym["n"] = 0, c.x.shape[0]
        if c.x.dtype != torch.float32:
            problems.append("x: not fp32 (custom)")
        op.check_written(c, vars(c), problems)

    op, alloc, into, runs = _ws_toy(monkeypatch, check=check)
    with pytest.raises(InputError) as e:
        into(_ws_t(), _ws_ws(), _ws_t(8, torch.float16), mode="b")
    assert "mode='b'" in str(e.value) and "x: not fp32 (custom)" in str(e.value) and not runs
    for ws, want in ((_ws_ws()[:32], "ws: 32 bytes"), (_ws_ws(16), "not 32-byte aligned")):  # align(c): 32
        with pytest.raises(InputError, match=want):
            into(_ws_t(), ws, _ws_t())
    x = _ws_t()
    with pytest.raises(InputError, match="out: overlaps x"):
        into(x, _ws_ws(), x)
    into(_ws_t(), _ws_ws(), _ws_t())
    assert len(runs) == 1


def test_torch_into_takes_the_workspace_positionally_and_requires_it(monkeypatch):
    op, alloc, into, runs = _ws_toy(monkeypatch, torch_into="out, ws, x, scale=1.0, mode='a'")
    ops = op.torch_ops("toy", alloc, into)
    assert ops["toy_toy_ws"][0] == '(Tensor x, float scale=1.0, str mode="a") -> Tensor'
    assert ops["toy_toy_ws_into"][0] == '(Tensor(a!) out, Tensor(b!) ws, Tensor x, float scale=1.0, str mode="a") -> ()'
    ops["toy_toy_ws_into"][1](_ws_t(), _ws_ws(), _ws_t(), 2.0, "a")
    assert len(runs) == 1
    from dsa_aot.ops.library import declarations

    assert "Tensor(c!)? workspace=None" in declarations()["dsa_indexer_top_k_into"][0]  # a workspace with a default stays optional


# --- the indexer forward's: alloc_only options in the generated allocating form, given names, padded and omitted outputs ---


def _padded_toy(monkeypatch, **kw):
    """y (given as ``out``, rows padded by 3 in the allocating form), aux (optional; allocated with want_aux, an
    allocating-form-only flag; omitted from the result otherwise; given as ``aux_out``), x."""
    monkeypatch.setattr(declare, "OPS", [])  # not one of the package's ops
    return Op(
        "toy_family", "toy", plan_class="Toy",
        into="y, aux, x, n=None, mode='a', stream=None",
        alloc="x, n=None, mode='a', big=1, out=None, stream=None, want_aux=False, aux_out=None",
        tensors=(Out("y", "float32", lambda c: tuple(c.x.shape), given="out", pad=lambda c: tuple(c.x.shape[:-1]) + (c.x.shape[-1] + 3,)),
                 Out("aux", "float32", ("rows",), optional=True, given="aux_out", when="want_aux", omitted=True),
                 In("x", "float32", ("rows", "cols"))),
        options=(Int("n", 0, 10, None), OneOf("mode", ("a", "b"), "a"), OneOf("big", (1,), 1, alloc_only=True, torch=False),
                 Flag("want_aux", False, alloc_only=True)),
        plan=lambda rec, c: None, **kw)


def test_allocating_form_only_options_given_names_and_quoted_string_defaults(monkeypatch):
    op = _padded_toy(monkeypatch, plan_args="y, aux, x, n=None, mode='a'")
    alloc, into, cls = op.forms({"__name__": "toy"})
    assert op.alloc_key == ("n", "mode", "big", "want_aux") and op.key == ("n", "mode")
    assert op._values((None, None, None), (3, "b"))["big"] == 1  # the _into form's: the default
    ops = op.torch_ops("t", alloc, into)
    assert ops["t_toy"][0] == '(Tensor x, int? n=None, str mode="a", bool want_aux=False) -> Tensor[]'
    assert ops["t_toy_into"][0] == '(Tensor(a!) y, Tensor(b!)? aux, Tensor x, int? n=None, str mode="a") -> ()'
    assert "``Toy(y, aux, x, n=None, mode='a')``" in cls.__doc__  # plan_args: the plan constructor's own signature


def test_an_optional_output_without_when_may_be_none(monkeypatch):
    monkeypatch.setattr(declare, "OPS", [])
    op = Op("toy_family", "toy2", plan_class="Toy2", into="y, aux, x, stream=None", alloc="x, stream=None",
            tensors=(Out("y", "float32", ("rows",)), Out("aux", "float32", ("rows",), optional=True), In("x", "float32", ("rows",))),
            plan=lambda rec, c: None)
    y, aux, x = (stand_in.cuda_tensor(torch.zeros(4)) for _ in range(3))
    op.validate(dict(y=y, aux=None, x=x))
    op.validate(dict(y=y, aux=aux, x=x))
    with pytest.raises(InputError, match="y: expected"):
        op.validate(dict(y=None, aux=aux, x=x))


def test_padded_given_and_omitted_outputs_of_the_allocating_form(monkeypatch):
    op = _padded_toy(monkeypatch)
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda shape, dtype, device: real(shape, dtype=dtype).fill_(7))  # CPU stand-ins of the outputs
    monkeypatch.setattr(declare, "alloc_on", lambda *a: contextlib.nullcontext())
    x = torch.ones(2, 5)
    values = dict(y=None, aux=None, x=x, n=None, mode="a", big=1, want_aux=False)

    def run(values, given):
        c = op._context(values, True)
        c.sym.update(rows=2, cols=5)  # what validating x binds
        make = op._maker(op._shapes(c, values), 0, c, values)
        ts = make(given)
        return ts, make.done(ts, given, None)

    ts, r = run(values, (None, None, x))
    assert ts[0].shape == (2, 8) and ts[1] is None  # the kernel's padded buffer; no aux
    assert list(r) == [r["y"]] and r["y"].shape == (2, 5) and r["y"].is_contiguous() and "aux" not in r  # the declared part; aux omitted
    out = torch.zeros(2, 9)[:, 2:7]  # given, strided: filled through the padded buffer, copied back
    ts, r = run(values, (out, None, x))
    assert ts[0] is not out and r["y"] is out and bool((out == 7).all())
    aux = torch.zeros(2)
    ts, r = run(dict(values, want_aux=True), (None, aux, x))
    assert r["aux"] is aux and ts[1] is aux  # given: used as it is, returned
    ts, r = run(values, (None, aux, x))
    assert ts[1] is aux and "aux" not in r  # given without want_aux: written, not returned


# --- the generic validation's messages (dsa_sparse_attention_forward) --------------------------------------


@pytest.fixture
def op():
    """A made-up op: y (n, 4) like x, an optional z written only when k != 0."""
    made = declare.Op("test_family", "made_up", plan_class="MadeUp", into="y, z, x, *, k=0, stream=None", alloc="x, *, k=0, stream=None",
                      tensors=(declare.Out("y", "like x", ("n", 4), align=4), declare.Out("z", "float32", ("n",), align=4, when="k"),
                               declare.In("x", ("float32", "float16"), ("n", 4), align=4)),
                      options=(declare.OneOf("k", (0, 2), 0),), plan=lambda rec, c: None)
    declare.OPS.remove(made)
    return made


def _t(shape, dtype=torch.float32):
    return stand_in.cuda_tensor(torch.zeros(shape, dtype=dtype))


def _problems(op, **values):
    with pytest.raises(InputError) as e:
        op.validate(dict.fromkeys(op.names) | {"k": 0} | values)
    return e.value.problems  # input_error keeps the list (a composite op adds its own to a part's)


def test_an_output_not_wanted_names_the_option_value(op):
    assert _problems(op, y=_t((3, 4)), z=_t((3,)), x=_t((3, 4))) == ["z: must be None when k=0"]


def test_cpu_tensors_still_get_dtype_and_shape_checks(op):
    got = _problems(op, y=_t((3, 4)), x=torch.zeros(3, 5, dtype=torch.int32))
    assert got[:3] == ["x: on cpu (expected a CUDA tensor)", "x: dtype torch.int32 (expected torch.float32 or torch.float16)",
                       "x: shape (3, 5) (expected (3, 4))"]


def test_a_tensor_like_one_of_the_wrong_dtype_is_not_checked_against_it(op):
    assert _problems(op, y=_t((3, 4)), x=_t((3, 4), torch.int32)) == ["x: dtype torch.int32 (expected torch.float32 or torch.float16)"]


# --- Op(alloc_first=fn), Op(alias_order=...): the dense indexer backward's ---------------------------------------

def _firsts(seen):
    def first(n, *, x):  # the allocating form's THD maxima: a value worked out from the inputs before the memo looks
        seen.append(n)
        return (x.shape[0] if n is None else n,)

    def rules(c, problems):
        seen.append(("rules", c.n))

    op = D.Op("toy", "first", plan_class="First", into="out, x, y, n=None, stream=None", alloc="x, y, n=None, out=None, stream=None",
              tensors=(D.Out("out", "float32", "like x", given=True, alloc_like=True), D.In("x", "float32", ("k",)),
                       D.In("y", "float32", ("k",), written=True)),
              options=(D.Int("n", 0, 99, None),), plan=lambda rec, c: rec.memset(c.p.out, 4), rules=rules, alloc_first=first, alias_order=("y",))
    D.OPS.remove(op)
    return op


def test_alias_order_gives_the_named_tensors_the_first_letters_in_both_schemas():
    op = _firsts([])
    alloc, into, _ = op.forms({"__name__": __name__})
    ops = op.torch_ops("dsa", alloc, into)
    assert ops["dsa_first"][0] == "(Tensor x, Tensor(a!) y, int? n=None) -> Tensor"
    assert ops["dsa_first_into"][0] == "(Tensor(b!) out, Tensor x, Tensor(a!) y, int? n=None) -> ()"


def test_alloc_first_replaces_arguments_before_the_memo(env, monkeypatch):
    seen = []
    op = _firsts(seen)
    alloc, _, _ = op.forms({"__name__": __name__})
    monkeypatch.setitem(alloc.__globals__, "alloc_on", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: stand_in.cuda_tensor(torch.zeros(t.shape, dtype=t.dtype), t.get_device()))
    s = env.new_stream(0)
    alloc(_f(), _f(), stream=s)
    alloc(_f(), _f(), stream=s)  # the memo: validated once, alloc_first called every time
    alloc(_f(), _f(), n=5, stream=s)
    assert seen == [None, ("rules", 8), ("rules", 8), None, 5, ("rules", 5), ("rules", 5)]


# --- what the CSA compressor needs: int OneOf symbols, CPU tensors still checked, an allocating form's own option in its
# memo, alloc_sizes (a size read from the device), zeroed outputs, guard, torch_order ----------------------------------

import torch  # noqa: E402

import stand_in  # noqa: E402
from dsa_aot.ops import gpu as _support  # noqa: E402
from dsa_aot.ops.declare import In, Int, OneOf, Op, Out  # noqa: E402


@pytest.fixture
def current_stream(monkeypatch):
    """Torch's current device is 0, its current stream 0x5A00 (a CPU-only torch has none)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_support, "_raw_stream", lambda dev: 0x5A00)


@pytest.fixture
def on_device(monkeypatch, current_stream):
    """torch's factories given a CUDA device make stand-in CUDA tensors."""
    made = []
    for name in ("empty", "zeros"):
        fn = getattr(torch, name)

        def make(*a, device=None, _fn=fn, _name=name, **kw):
            made.append((_name, stand_in.cuda_tensor(_fn(*a, **kw))))
            return made[-1][1]

        monkeypatch.setattr(torch, name, make)
    return made


def _csa_toy(name, **kw):
    """out (total, cols) from x (rows, cols): n (optional Int), width (OneOf bound as a symbol), total (the allocating form's own)."""
    ran = []

    def plan(rec, c):
        rec.then(lambda ts, stream: ran.append((c.sym["total"], c.sym["cols"])))

    op = Op("toy", name, plan_class="Toy", into="out, x, n=None, width=4, stream=None", alloc="x, n=None, width=4, total=None, stream=None",
            tensors=(Out("out", "float32", ("total", "cols"), zeroed=kw.pop("zeroed", False)), In("x", "float32", ("rows", "width"))),
            options=(Int("n", 1, 8, None), OneOf("width", (4, 8), 4), Int("total", 0, 100, None, alloc_only=True)),
            symbols=lambda c, problems: c.sym.setdefault("cols", c.sym["width"]), plan=plan, **kw)
    declare.OPS.remove(op)  # (the fuzz and the cache resets walk that list)
    alloc, into, plan_cls = op.forms({"__name__": __name__})
    return op, alloc, into, plan_cls, ran


def _csa_x(rows=3, width=4):
    return stand_in.cuda_tensor(torch.ones(rows, width))


def test_int_oneof_options_are_shape_symbols(current_stream):
    op, alloc, into, _, ran = _csa_toy("toy_symbols")
    out = stand_in.cuda_tensor(torch.empty(5, 4))
    assert into(out, _csa_x()) is out and ran == [(5, 4)]
    assert into(out, _csa_x(), n=3) is out
    with pytest.raises(InputError, match=r"n=None|n=0 \(expected an integer in \[1, 8\]\)"):
        into(out, _csa_x(), n=0)
    with pytest.raises(InputError, match=r"x: shape \(3, 8\) \(expected \(3, 4\)\)"):  # width=4 is the symbol x's shape names
        into(out, _csa_x(width=8))


def test_cpu_tensors_still_get_dtype_shape_and_layout_checks(current_stream):
    op, alloc, into, _, _ = _csa_toy("toy_cpu")
    x = torch.ones(3, 8, dtype=torch.float16)[:, ::2]  # CPU, fp16, strided
    with pytest.raises(InputError) as e:
        into(stand_in.cuda_tensor(torch.empty(5, 4)), x)
    msg = str(e.value)
    assert "x: on cpu (expected a CUDA tensor)" in msg and "x: dtype torch.float16" in msg and "x: strides" in msg


def test_alloc_only_option_in_the_memo_alloc_sizes_and_zeroed_outputs(on_device):
    calls = []

    def prelude(c):  # total=None: a size "read from the device"; not memoized then
        calls.append(c.total)
        if c.total is None:
            c.sym["total"] = 2
            return False
        return True

    op, alloc, into, _, ran = _csa_toy("toy_alloc", alloc_sizes=prelude, zeroed=lambda c: c.sym["total"] == 0)
    assert op.key == ("n", "width") and op.alloc_key == ("n", "width", "total")  # total: the allocating form's own
    r = alloc(_csa_x(), total=0)
    assert r["out"].shape == (0, 4) and on_device[-1][0] == "zeros"
    alloc(_csa_x(), total=6)
    assert on_device[-1][0] == "empty" and ran[-1] == (6, 4)
    alloc(_csa_x(), total=6)  # memoized: no prelude
    assert calls == [0, 6]
    assert alloc(_csa_x())["out"].shape == (2, 4) and alloc(_csa_x())["out"].shape == (2, 4) and calls == [0, 6, None, None]
    with pytest.raises(InputError, match="total=101"):
        alloc(_csa_x(), total=101)


def test_guard_runs_at_build_and_on_every_call(current_stream):
    state = {"refuse": False, "runs": 0}

    def guard(c):
        def check():
            state["runs"] += 1
            if state["refuse"]:
                raise InputError("refused by the guard")

        return check

    op, alloc, into, plan_cls, ran = _csa_toy("toy_guard", guard=guard)
    out = stand_in.cuda_tensor(torch.empty(5, 4))
    into(out, _csa_x())
    assert state["runs"] == 2 and len(ran) == 1  # once at build, once for the call
    into(out, _csa_x())
    p = plan_cls(out, _csa_x())
    p.execute(out, _csa_x())
    state["refuse"] = True
    with pytest.raises(InputError, match="refused"):
        into(out, _csa_x())
    with pytest.raises(InputError, match="refused"):
        p.execute(out, _csa_x())
    assert len(ran) == 3


def test_torch_order():
    op, alloc, into, _, _ = _csa_toy("toy_order", torch_order=("x, SymInt total, int width, n", "out, x, int width, n"))
    ops = op.torch_ops("toy", alloc, into)
    assert ops["toy_toy_order"][0] == "(Tensor x, SymInt total, int width, int? n=None) -> Tensor"
    assert ops["toy_toy_order_into"][0] == "(Tensor(a!) out, Tensor x, int width, int? n=None) -> ()"
    op, alloc, into, _, _ = _csa_toy("toy_plain")  # without: the Python signatures' order and defaults
    assert op.torch_ops("toy", alloc, into)["toy_toy_plain"][0] == "(Tensor x, int? n=None, int width=4, int? total=None) -> Tensor"




# --- what the dense score recompute and the fused top-k's tail need: into_first with a Hidden option, fake=, an
# _into-only op, no stream switch when every output is given ----------------------------------------------------


def _hidden(seen):
    def first(n, host=None, *, x):  # the _into form's first step: works out a value neither signature takes
        seen.append(("first", n))
        return (n or 0) + 1, ("bounds", x.shape[0])

    def rules(c, problems):
        seen.append(("rules", c.n, c.host))

    op = D.Op("toy", "hidden", plan_class="Hidden", into="out, x, n=None, stream=None", alloc="x, n=None, out=None, stream=None",
              tensors=(D.Out("out", "float32", "like x", given=True, alloc_like=True), D.In("x", "float32", ("k",))),
              options=(D.Int("n", 0, 99, None), D.Hidden("host")), plan=lambda rec, c: rec.memset(c.p.out, 4), rules=rules, into_first=first,
              fake=lambda x, n=None: x.new_empty((7,)))
    D.OPS.remove(op)
    return op


def test_into_first_sets_a_hidden_option_the_cache_keys_on_and_a_plan_takes_its_default(env):
    seen = []
    op = _hidden(seen)
    _, into, plan = op.forms({"__name__": __name__})
    s, out = env.new_stream(0), _f()
    into(out, _f(), stream=s)
    into(out, _f(), stream=s)  # the same key (n 1, host ("bounds", 8)): validated once, first called every time
    into(out, _f(), n=3, stream=s)
    assert seen == [("first", None), ("rules", 1, ("bounds", 8)), ("first", None), ("first", 3), ("rules", 4, ("bounds", 8))]
    assert len(env.memsets) == 3
    seen.clear()
    plan(out, _f(), n=2)  # a plan does not run the _into form's first step: the Hidden option's default
    assert seen == [("rules", 2, None)]
    schemas = op.torch_ops("dsa", *op.forms({"__name__": __name__})[:2])
    assert "host" not in schemas["dsa_hidden_into"][0] and schemas["dsa_hidden"][2](torch.zeros(3)).shape == (7,)  # fake= in place


def test_an_op_without_an_allocating_signature_makes_its_into_form_only(env):
    op = D.Op("toy", "_step", plan_class=None, alloc=None, into="out, x, stream=None", plan=lambda rec, c: rec.memset(c.p.out, 4),
              tensors=(D.Out("out", "float32", ("k",)), D.In("x", "float32", ("k",))))
    D.OPS.remove(op)
    alloc, into, cls = op.forms({"__name__": __name__})
    assert alloc is None and cls is None and into.__name__ == "_step_into"
    into(_f(), _f(), stream=env.new_stream(0))
    assert len(env.memsets) == 1
    with pytest.raises(InputError, match="out: overlaps x"):
        x = _f()
        into(x, x)


def test_the_allocating_form_switches_torch_s_stream_only_when_it_allocates(env, monkeypatch):
    op, alloc, into, _, made = _toy(monkeypatch)
    switched = []
    monkeypatch.setitem(alloc.__globals__, "alloc_on", lambda *a: switched.append(a) or contextlib.nullcontext())
    s, x, y = env.new_stream(0), _f(), _f()
    alloc(x, y, out=_f(), stream=s)
    alloc(x, y, out=_f(), stream=s)  # the memo's call too
    assert not switched and not made and len(env.memsets) == 2
    alloc(x, y, stream=s)
    assert len(switched) == 1 and made == [x]
