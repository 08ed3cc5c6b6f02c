"""Op declarations: what a public op takes and does, said once; every form of it derived.

A family's op module declares each public op as an :class:`Op`: its tensors (:class:`In`, :class:`Out`,
:class:`Workspace`: dtypes, shape symbols, alignment, may-be-None), its options (:class:`Int`,
:class:`Flag`, :class:`OneOf`: range or choices and default; ``per_call=True`` for a scalar the plan
takes as ``x[j]`` rather than compiling in), cudnn's two signatures (the allocating and the ``_into``
form, keyword names and defaults as upstream's), the entries a call needs (``entries(c)``), the rules
between fields (``rules(c, problems)``) and the plan body (``plan(rec, c)``: what the call launches).
From that, once for every op, :meth:`Op.forms` makes the ``_into`` function, the allocating function
and the plan class; :meth:`Op.torch_ops` the ``torch.library`` schemas, implementations and fakes; the
validation (types, ranks, dtypes, devices, shape symbols, layout, alignment, aliasing) runs before any
write, allocation or launch; the fast paths are :mod:`dsa_aot.ops.plan`'s.

``c``, what the rules, ``entries`` and ``plan`` read: every argument by name (``c.top_k``,
``c.input_values``), the shape symbols (``c.sym["n_rows"]``), the device (``c.dev``), the loaded entries
(``c.entry[role]``, in ``plan`` only) and the symbolic pointers (``c.p.<tensor>``, in ``plan`` only).
"""

from __future__ import annotations

import functools
import hashlib

from .args import footprint, writes_only
from .checks import _FLT_MAX, aliasing, check, flag, input_error, integer, scalar_f32
from .gpu import alloc_failed, alloc_on, allocate, launcher, require, stream_handle
from .outputs import Outputs
from ..runtime.bytecode import code_for
from .plan import ALLOC, Plan, Recorder, cached, compile_call, fresh, probe_for, remember, remembered

__all__ = ["In", "Out", "Workspace", "Int", "Float", "Flag", "OneOf", "Hidden", "Op", "REQUIRED", "OPS", "clear_caches"]

OPS: list = []  # every declared op of the process, in declaration order (the tests' fuzz and cache resets walk it)


def clear_caches() -> None:
    """Forget every declared op's validated calls (in place: the generated forms hold the dicts)."""
    for op in OPS:
        op.cache.clear()

REQUIRED = object()  # an option without a default


class _Tensor:
    role = "in"

    def __init__(self, name, dtype, shape, *, align=16, optional=False, when=None, staged=False, returns=None, given=False, written=False,
                 alloc_like=False, pad=None, omitted=False, zeroed=False):
        # shape: a tuple of ints and symbol names; "like <tensor>": that tensor's; None: any (the op's rules check it);
        # align: bytes, "element", or align(c) -> bytes (an arch that loads wider); given, alloc_like: see Out; written: see In
        self.name, self.dtypes, self.align, self.given = name, (dtype,) if isinstance(dtype, str) else tuple(dtype), align, given
        self.written, self.alloc_like = written or self.role != "in", alloc_like
        self.shape = shape if shape is None or isinstance(shape, str) or callable(shape) else tuple(shape)  # shape(c): a rank that varies
        self.optional, self.when, self.staged = optional or when is not None, when, staged
        self.returns = name if returns is None else returns  # False: written, not in the allocating form's result (a scratch buffer)
        self.pad, self.omitted, self.param = pad, omitted, given if isinstance(given, str) else name  # param: its allocating-form name
        self.zeroed = zeroed

    def dtype_of(self, c):
        """The torch dtypes this tensor may have in call ``c`` ("like <tensor>": that tensor's)."""
        import torch

        if self.dtypes[0].startswith("like "):
            return (getattr(c, self.dtypes[0][5:]).dtype,)
        return tuple(getattr(torch, d) for d in self.dtypes)

    def shape_of(self, c):
        """The shape spec in call ``c``: symbols and ints, another tensor's shape ("like"), or None (any)."""
        if isinstance(self.shape, str):
            other = getattr(c, self.shape[5:])
            return tuple(other.shape) if hasattr(other, "shape") else None
        return self.shape(c) if callable(self.shape) else self.shape

    def size_in(self, c) -> tuple:
        """The shape an allocated output has in call ``c`` (another tensor's as it is: SymInts under fake tensors)."""
        if isinstance(self.shape, str):
            return tuple(getattr(c, self.shape[5:]).shape)
        if callable(self.shape):
            return tuple(self.shape(c))
        return tuple(s if isinstance(s, int) else c.sym[s] for s in self.shape)

    def mask(self, t, c) -> int:
        a = self.align(c) if callable(self.align) else self.align
        return (t.element_size() if a == "element" else a) - 1


class In(_Tensor):
    """An input tensor: read only. ``staged``: the allocating form copies it to the layout the kernels take
    (contiguous, aligned) on the launch stream, as upstream does; the ``_into`` form requires that layout.
    ``staged="contiguous"``: only a strided one is copied (upstream's ``.contiguous()``); a misaligned one is refused.
    ``written``: the kernels also write it (upstream's in-place ``attn_score``): checked like an output for overlap,
    marked mutated in the torch schemas."""


class Out(_Tensor):
    """An output tensor (written). ``when``: the name of a flag option; the output exists (and is written)
    only when it is true, and must be None otherwise. ``returns``: its key in the allocating form's result.
    ``given``: the allocating form takes it too (cudnn's ``out=None``): used as given (the ``_into`` call checks
    it), allocated when None; a string names that parameter (``given="lse_out"``). ``alloc_like``: allocated as
    ``torch.empty_like`` (``zeros_like`` when ``zeroed``) the tensor its shape is "like", of its dtype. ``optional`` without ``when``: the ``_into`` form takes None
    (not written); a ``when`` naming an ``alloc_only`` option is the allocating form's. ``pad(c)``: the shape the
    kernel binds (rows padded); the allocating form allocates that and returns the declared shape's part, contiguous,
    and a given one it cannot bind as it is (any strides) is filled through such a buffer and copied back.
    ``omitted``: the allocating form's result has no key for it when ``when`` is false. ``zeroed``: the allocating
    form allocates it zeroed (True, or ``zeroed(c)`` per call: an output the kernels write only in part, or not at all)."""

    role = "out"


class Workspace(_Tensor):
    """Caller-provided scratch (uint8, 1-D): ``nbytes(c)`` bytes of it are used (0: none needed, may be None);
    ``sizer``: the public function that sizes it, named in the messages."""

    role = "workspace"

    def __init__(self, name, nbytes, sizer, *, align=16, given=False):
        super().__init__(name, "uint8", ("bytes",), align=align, optional=True, given=given)
        self.nbytes, self.sizer = nbytes, sizer


class _Option:
    torch_type = "int"

    def __init__(self, name, default=REQUIRED, *, per_call=False, torch=True, alloc_only=False, torch_default=REQUIRED):
        # alloc_only: an option of the allocating form only (upstream's return_lse: the _into form is told by its outputs);
        # torch_default: the schema's default where Python's cannot be said in it (cudnn's return_softmax=None: True)
        self.name, self.default, self.per_call, self.torch = name, default, per_call, torch
        self.alloc_only, self.torch_default = alloc_only, torch_default

    def bad_values(self) -> list:
        """Values of the wrong type for this option (the fuzz's malformed cases)."""
        return [None, "1", [1], {"a": 1}, {1}, 1j]

    def fast(self, v: str):
        """A Python condition on the variable ``v`` that accepts only good values, inlined in a per-call
        scalar's check (None: :meth:`value` runs every call)."""
        return None

    def value(self, problems, v, c):
        """``v`` as the plan receives it (a per-call scalar's ``x[j]``); its problem appended otherwise."""
        self.check(problems, v)
        return v


class Int(_Option):
    """An integer in [lo, hi] (bools refused); None too when the default is None (upstream's max_seqlen_q=None)."""

    def __init__(self, name, lo, hi, default=REQUIRED, **kw):
        super().__init__(name, default, **kw)
        self.lo, self.hi = lo, hi
        if default is None:
            self.torch_type = "int?"

    def check(self, problems, v):
        if not (v is None and self.default is None):
            integer(problems, self.name, v, self.lo, self.hi)

    def bad_values(self):
        return [v for v in super().bad_values() if v is not None or self.default is not None] + [self.lo - 1, self.hi + 1, float(self.lo), True]

    def fast(self, v):
        return f"type({v}) is int and {self.lo} <= {v} <= {self.hi}"


class Float(_Option):
    """A real number the kernels take as fp32: finite, representable (and > 0 with ``positive``, a bool or
    ``positive(c)``); ints are converted. ``none(c)``: what None means for call ``c`` (upstream's
    ``softmax_scale=None``: 1/sqrt(D)); without it None is refused. ``derive(v, c)``: what the kernel takes
    instead of the value (upstream's ``loss_coeff / rows``), checked representable too."""

    torch_type = "float"

    def __init__(self, name, default=REQUIRED, *, positive=False, none=None, derive=None, **kw):
        super().__init__(name, default, **kw)
        self.positive, self.none, self.derive = positive, none, derive
        if none is not None:
            self.torch_type = "float?"

    def check(self, problems, v):  # the type and range; positive(c) is value()'s
        if not (v is None and self.none is not None):
            scalar_f32(problems, self.name, v, positive=self.positive is True)

    def value(self, problems, v, c):
        if v is None and self.none is not None:
            return float(self.none(c))
        n = len(problems)
        x = scalar_f32(problems, self.name, v, positive=self.positive(c) if callable(self.positive) else self.positive)
        if self.derive is not None and len(problems) == n:
            x = self.derive(x, c)
            if not abs(x) <= _FLT_MAX:
                problems.append(f"{self.name}={v!r}: the kernel's value from it ({x!r}) is not representable in fp32")
        return x

    def fast(self, v):
        if self.derive is not None or callable(self.positive):
            return None
        return f"type({v}) is float and {'0.0 <' if self.positive else f'{-_FLT_MAX!r} <='} {v} <= {_FLT_MAX!r}"

    def bad_values(self):
        return [v for v in super().bad_values() if not (v is None and self.none is not None)] + [float("nan"), float("inf"), 1e39, True] + (
            [0.0, -1.0] if self.positive else [])


class Flag(_Option):
    """True or False (0 and 1 too, as Python's bool())."""

    torch_type = "bool"

    def check(self, problems, v):
        flag(problems, self.name, v)

    def bad_values(self):
        return super().bad_values() + [2, 0.5, "yes"]


class OneOf(_Option):
    """One of ``choices``, compared by type and value (4.0 is not 4, True is not 1); ``fold``: a string's form compared
    (upstream's ``precision.lower()``)."""

    def __init__(self, name, choices, default=REQUIRED, *, fold=None, **kw):
        super().__init__(name, default, **kw)
        self.choices, self.fold = tuple(choices), fold
        self.torch_type = {int: "int", str: "str", float: "float", bool: "bool"}[type(self.choices[0])]

    def check(self, problems, v):
        if not any(type(v) is type(a) and (self.fold(v) if self.fold and isinstance(v, str) else v) == a for a in self.choices):
            problems.append(f"{self.name}={v!r} (expected one of {', '.join(repr(a) for a in self.choices)})")

    def bad_values(self):
        return super().bad_values() + [float(self.choices[0]) if isinstance(self.choices[0], int) else 0]


class Hidden(_Option):
    """A value neither signature takes, keyed as an option: what a form's ``first`` hook works out (an SM90 THD
    call's host segment bounds); its default where a plan is built."""

    def __init__(self, name, default=None):
        super().__init__(name, default, torch=False)

    def check(self, problems, v):
        pass


class _Ctx:
    """What one call of an op is: its arguments by name, its shape symbols, its device."""

    def __init__(self, values: dict):
        self.__dict__.update(values)
        self.sym, self.dev, self.entry, self.p = {}, None, {}, None


class Op:
    """One public op, declared. See the module docstring for what each part is; :meth:`forms` makes its
    functions and plan class, :meth:`torch_ops` its torch.library registrations."""

    def __init__(self, family, name, *, into, alloc, tensors, options=(), entries=None, rules=None, plan, plan_class,
                 into_returns=None, hint=None, note="", alloc_view=None, symbols=None, check=None, plan_args=None, alloc_prelude=None,
                 early_rules=None, scalar_fn=None, torch_into=None, alloc_first=None, alias_order=(),
                 guard=None, alloc_sizes=None, torch_order=None, into_first=None, fake=None):
        self.family, self.name, self.into_sig, self.alloc_sig, self.plan_class = family, name, into, alloc, plan_class
        self.tensors, self.options = tuple(tensors), tuple(options)
        self.entries, self.rules, self.plan, self.hint, self.note = entries, rules, plan, hint, note
        # alloc_view(inputs) -> inputs: the allocating form's inputs (staged: contiguous) as the _into form takes them
        # (compactify's (B, S, cols) as (B * S, cols)); symbols(c, problems): shape symbols the inputs' declared shapes
        # cannot bind (a rank that varies), bound once the inputs passed, before the outputs are checked
        self.alloc_view, self.symbols = alloc_view, symbols
        # check(c, problems): the family's own validation in place of the generic one (options and tensors reported together;
        # it sets c.dev, the shape symbols the outputs are allocated by, c.ws_need); plan_args: the plan constructor's signature
        # when it is not the _into one less the stream
        self.check, self.plan_args = check, plan_args
        # alloc_prelude(c, stream) -> {name: value}: the allocating form's _into call (check's c, c.allocating), the allocating
        # call's arguments of the same names updated by it (outputs made, inputs staged, values worked out); c.back {name: given
        # output} the made one is copied into afterwards
        self.alloc_prelude = alloc_prelude
        # early_rules(c, problems): rules reported with the options' and tensors' problems (a wrong option stops no tensor
        # check), run whatever came before them; scalar_fn(c) -> scalars(**kw): the per-call scalars' own check (a derived
        # kernel value, a sign an option requires), in place of the options' value() per call
        self.early_rules, self.scalar_fn = early_rules, scalar_fn
        # torch_into: the torch _into op's signature where its schema differs from the _into form's (a workspace taken positionally)
        self.torch_into = torch_into
        # alloc_first: called first by the generated allocating form, before its memo, with the arguments its parameters name:
        # it returns new values of its positional ones (upstream's THD maxima read from cu_seqlens), its keyword-only ones are
        # read only. alias_order: the tensors given the first alias letters of the torch schemas, the same in both (the rest
        # follow in signature order): a hand-written schema's letters kept
        self.alloc_first, self.alias_order = alloc_first, tuple(alias_order)
        # into_first: alloc_first's twin for the _into form (a positional name neither form takes, a Hidden option, is
        # only returned); fake: the allocating torch op's fake where the outputs' shapes follow values only check() works out
        self.into_first, self.fake = into_first, fake
        # guard(c) -> None or a per-call check of process state (torch's deterministic mode), run by every call of
        # the compiled call (Call.guard) and once at build, before any entry is resolved; alloc_sizes(c): the memoized
        # allocating form's, once its inputs and stream passed, before entries and outputs: binds what the outputs
        # need (a size read from the device, as upstream's wrapper does); False: do not memoize the call;
        # torch_order: (allocating, into) schema parameters, ", "-separated, when they differ from the Python order:
        # a name (typed and defaulted as the declaration says) or a literal "type name[=default]"
        self.guard, self.alloc_sizes, self.torch_order = guard, alloc_sizes, torch_order
        self.into_returns = into_returns or tuple(t.name for t in self.tensors if t.role == "out")
        self.names = tuple(t.name for t in self.tensors)  # the plan's tensors, in p[i] order
        self.key = tuple(o.name for o in self.options if not o.per_call and not o.alloc_only)  # the cache key's options, one order for every form
        self.alloc_key = self.key + tuple(o.name for o in self.options if not o.per_call and o.alloc_only)  # the generated allocating form's
        self.scalars = tuple(o.name for o in self.options if o.per_call)
        self.ins = tuple(t.name for t in self.tensors if t.role == "in" or t.given)  # the allocating form's tensors
        self.results = tuple((t.returns, i) for i, t in enumerate(self.tensors) if t.role == "out" and t.returns is not False)
        self.cache: dict = {}
        self.made = None  # (allocating, _into) functions, once forms() made them
        self._by_name = {t.name: t for t in self.tensors} | {o.name: o for o in self.options}
        OPS.append(self)

    def _opt(self, name):
        return next(o for o in self.options if o.name == name)

    def tensor(self, name):
        """The declaration of tensor ``name`` (its In / Out / Workspace)."""
        t = self._by_name[name]
        if isinstance(t, _Option):
            raise KeyError(f"{self.name}: {name!r} is an option, not a tensor")
        return t

    # --- validation -------------------------------------------------------------------------------

    def _context(self, values, allocating) -> _Ctx:
        """A call's context: its arguments, and its integer options bound as shape symbols (``top_k``)."""
        c = _Ctx(values)
        c.allocating = allocating
        c.sym.update((o.name, v) for o in self.options  # (alloc_only: not in _into's; an int OneOf too: ratio; not an Int's None)
                     if (v := values.get(o.name)) is not None and (isinstance(o, Int) or isinstance(o, OneOf) and type(v) is int))
        return c

    def _values(self, ts, opts, scal=(), key=None):
        key = self.key if key is None else key  # the allocating form's alloc_key; the _into form's: alloc_only ones at their defaults
        return ({o.name: o.default for o in self.options if o.alloc_only} | dict(zip(self.names, ts)) | dict(zip(key, opts))
                | dict(zip(self.scalars, scal)))

    def validate(self, values: dict, allocating=False) -> _Ctx:
        """Every check of a call (``allocating``: only its inputs, staged ones without layout); the call's
        :class:`_Ctx`, or InputError listing every problem. Nothing has been touched either way."""
        import torch

        if self.check is not None:
            c, problems = self._context(values, allocating), []
            c.ws_need = 0
            self.check(c, problems)
            if problems:
                raise input_error(problems)
            return c
        problems = []
        self.check_options(values, problems)
        if problems and self.early_rules is None:  # options fix shapes and keys below: nothing more is meaningful with a wrong one
            raise input_error(problems)
        c = self._context(values, allocating)
        bad, cpu_only = set(), 0  # cpu_only: problems of tensors on the CPU, whose shapes the symbols still check
        ins = [t for t in self.tensors if t.role == "in"]  # allocating: the outputs given (cudnn's out=), checked before any allocation
        outs = [t for t in self.tensors if t.role != "in" and not (allocating and values[t.name] is None)]
        for t in ins + outs:
            if t is (outs or [None])[0]:  # the inputs fix the symbols the outputs are checked against
                if len(problems) > cpu_only:
                    break
                if self.symbols is not None:
                    self.symbols(c, problems)
                    if len(problems) > cpu_only:
                        break
            v = values[t.name]
            free = t.when is None or self._opt(t.when).alloc_only  # None: not written (a `when` of the allocating form's)
            wanted = free or bool(values[t.when])
            if t.role == "workspace":
                continue  # sized by the call's shapes, checked last
            if v is None and (t.optional and (t.role == "in" or free or not wanted)):
                continue
            if not wanted:
                problems.append(f"{t.name}: must be None when {t.when}={values[t.when]!r}")
                continue
            want = t.shape_of(c)
            if not isinstance(v, torch.Tensor) or v.layout != torch.strided or (want is not None and v.ndim != len(want)):
                bad.add(t.name)
                got = f"{getattr(v, 'dtype', '')} {tuple(getattr(v, 'shape', ()))}" if isinstance(v, torch.Tensor) else type(v).__name__
                what = "" if want is None else f" {len(want)}-D ({', '.join(map(str, want))})"
                problems.append(f"{t.name}: expected a dense{what} {' or '.join(t.dtypes).replace('like ', 'the dtype of ')} CUDA tensor, got {got}")
                continue
            cpu = v.device.type != "cuda"  # still its dtype and shape checked, reported together
            if cpu:
                problems.append(f"{t.name}: on {v.device} (expected a CUDA tensor)")
                cpu_only += 1
            elif c.dev is None:
                c.dev = v.device.index
            like = t.dtypes[0][5:] if t.dtypes[0].startswith("like ") else None
            dts = (v.dtype,) if like in bad else t.dtype_of(c)  # "like" a malformed tensor: that one's problem says it
            if v.dtype not in dts:
                problems.append(f"{t.name}: dtype {v.dtype} (expected {' or '.join(map(str, dts))})")
                bad.add(t.name)  # (a tensor "like" it is not checked against its wrong dtype)
            shape = []
            for s, n in zip(want if want is not None else v.shape, v.shape):
                shape.append(s if isinstance(s, int) else c.sym.setdefault(s, n))
            staged = allocating and t.staged
            align = 1 if cpu and callable(t.align) else t.mask(v, c) + 1  # (an arch's alignment needs a device)
            check(problems, v, t.name, tuple(shape), v.dtype, c.dev, align, layout=not staged, device=not cpu)  # (cpu: its layout too)
            if staged == "contiguous" and v.is_contiguous() and v.data_ptr() & (align - 1):  # only a strided one is copied
                problems.append(f"{t.name}: data pointer 0x{v.data_ptr():x} is not {t.mask(v, c) + 1}-byte aligned (clone() the tensor)")
        if self.early_rules is not None:
            self.early_rules(c, problems)
        if len(problems) == cpu_only and not outs and self.symbols is not None:
            self.symbols(c, problems)
        if not problems and self.rules is not None:
            self.rules(c, problems)
        self.check_written(c, values, problems)
        if problems:
            raise input_error(problems)
        return c

    def check_options(self, values, problems, names=None):
        """Every option's type and range, or those ``names`` (the generic validation's first step; a family's ``check`` may
        start with it, or check the options its own checks do not)."""
        for o in self.options:
            if names is None or o.name in names:
                o.check(problems, values[o.name])

    def check_written(self, c, values, problems):
        """The workspace (size, alignment) and overlap checks, once nothing else is wrong (the generic validation's
        last step; a family's ``check`` may end with it). In an allocating call, on what is given."""
        if not problems:
            self._check_workspace(c, values, problems, c.allocating)
        if not problems:
            outs = [(t.name, values[t.name] if t.role != "workspace" else c.ws_used) for t in self.tensors if t.written]
            problems += aliasing(outs, [(t.name, values[t.name]) for t in self.tensors if not t.written])

    def _check_workspace(self, c, values, problems, allocating=False):
        import torch

        c.ws_used, c.ws_need = None, 0
        for t in self.tensors:
            if t.role != "workspace":
                continue
            w, need = values[t.name], t.nbytes(c)
            c.ws_need = need
            if not need:
                if w is not None and not isinstance(w, torch.Tensor):
                    problems.append(f"{t.name}: got {type(w).__name__} (expected None or a 1-D uint8 CUDA tensor)")
                continue
            if w is None:
                if allocating:  # allocated
                    continue
                problems.append(f"{t.name}: missing ({need} uint8 bytes needed; see {t.sizer})")
            elif not isinstance(w, torch.Tensor) or w.layout != torch.strided or w.ndim != 1:
                problems.append(f"{t.name}: expected a 1-D uint8 CUDA tensor of at least {need} bytes ({t.sizer}), got "
                                f"{tuple(getattr(w, 'shape', ())) or type(w).__name__}")
            else:
                check(problems, w, t.name, w.shape, torch.uint8, c.dev, t.mask(w, c) + 1)
                if not problems and w.numel() < need:
                    problems.append(f"{t.name}: {w.numel()} bytes, the call needs {need} ({t.sizer})")
                c.ws_used = w[:need]

    # --- the compiled call ------------------------------------------------------------------------

    def build(self, ts, opts, scal):
        """Validate a call of the ``_into`` form and compile what it does (:class:`dsa_aot.ops.plan.Call`)."""
        c = self.validate(self._values(ts, opts, scal))
        guard = self.guard(c) if self.guard is not None else None
        if guard is not None:
            guard()  # refused before anything is resolved
        rec = Recorder(len(ts), len(self.scalars))
        c.p = _Ptrs(self.names, rec.p)
        c.x = dict(zip(self.scalars, rec.x))
        for role, (op, key) in (self.entries(c) if self.entries else {}).items():
            c.entry[role] = launcher(self.family, op, key, c.dev, self.hint(c, key) if self.hint else "")
        self.plan(rec, c)
        foot = self._footprint(c, self.tensors, ts)
        given = dict(zip(self.scalars, scal))
        scalars = (lambda **kw: self._scalar_check(c, given | kw)) if self.scalars else None
        if self.scalar_fn is not None:
            scalars = functools.partial(self.scalar_fn(c), **given)
        x = scalars() if self.scalars else ()
        return compile_call(f"{self.family}.{self.name}", rec, c.dev, ts, foot, x, scalars, guard, keep=getattr(c, "keep", ()))  # c.keep: plan's memory

    def _footprint(self, c, specs, ts):
        """What the per-call recheck of tensors ``ts`` (of ``specs``) needs: the written ones, masks, the workspace bytes used."""
        masks = tuple(15 if v is None else 0 if t.role == "workspace" and not c.ws_need else t.mask(v, c) for t, v in zip(specs, ts))
        sizes = {i: c.ws_need for i, t in enumerate(specs) if t.role == "workspace"}
        return footprint(ts, writes=tuple(i for i, t in enumerate(specs) if t.written), masks=masks, sizes=sizes)

    def _scalar_check(self, c, values: dict) -> tuple:
        """The per-call scalars ``x`` of a call like ``c`` from their values by name (InputError otherwise):
        what a call's ``scalars(**kw)`` is (a plan's execute overrides some: the others keep the sample's)."""
        problems = []
        x = tuple(self._by_name[n].value(problems, values[n], c) for n in self.scalars)
        if problems:
            raise input_error(problems)
        return x

    def prepare_alloc(self, ins, opts, scal, stream):
        """The allocating form's first call of a signature: validate the inputs, refuse a bad stream and a
        missing entry before allocating, stage the inputs; (context, call box, output maker, staged inputs).
        Remembered for the inputs (:func:`dsa_aot.ops.plan.remember`) when they need no staging, so a repeated
        call skips all of it (the generated form's memo), with its per-call scalars' check (run before allocating)."""
        values = dict.fromkeys(self.names) | dict(zip(self.ins, ins)) | self._values((), opts, scal, self.alloc_key)
        c = self.validate(values, allocating=True)
        stream_handle(stream, c.dev)  # a bad stream, and a missing entry, refused before anything is allocated
        memo = self.alloc_sizes(c) if self.alloc_sizes is not None else True
        if self.entries:
            ks = self.entries(c)
            require(self.family, ks, c.dev, {r: self.hint(c, k[1]) for r, k in ks.items()} if self.hint else None)
        box = [None]  # the _into call, once known (plan.fresh)
        make = self._maker(self._shapes(c, values), c.dev, c, values)
        specs = [self._by_name[n] for n in self.ins]
        foot = self._footprint(c, specs, ins)  # given outputs and written inputs rechecked for overlap per call
        staged = tuple(t.role == "in" for t in specs)  # given outputs are used as they are
        direct = all(t is None or not st or (t.is_contiguous() and not t.data_ptr() & m) for t, m, st in zip(ins, foot[1], staged))
        x = ins if direct else tuple(allocate(lambda n=n, t=t: self.stage(n, t, stream, c)) if st else t for n, t, st in zip(self.ins, ins, staged))
        sc = (self.scalar_fn(c) if self.scalar_fn is not None else lambda **kw: self._scalar_check(c, kw)) if self.scalars else None
        if direct and memo is not False:
            remember(self.cache, ALLOC, opts, probe_for(ins, c.dev, foot), (c.dev, box, make, sc))
        return c.dev, box, make, x, sc

    def _shapes(self, c, values) -> tuple:
        """Per tensor of the plan, where it comes from in an allocating call: ("in", slot) (an input, or a given
        output that is not needed), ("new", shape, dtype, slot or None: a given output, allocated when None) or
        None (an output not written)."""
        import torch

        out = []
        for t in self.tensors:
            slot = self.ins.index(t.name) if t.name in self.ins else None
            if t.role == "in":
                new = ("in", slot)
            elif t.role == "workspace":
                need = t.nbytes(c)
                new = ("new", (need,), torch.uint8, slot) if need else None
            elif t.when is not None and not values[t.when]:
                new = None
            else:
                zero = t.zeroed(c) if callable(t.zeroed) else t.zeroed
                if t.alloc_like:
                    new = ("like", self.ins.index(t.shape[5:]), zero, slot)
                else:
                    new = ("zero" if zero else "new", t.pad(c) if t.pad else t.size_in(c), t.dtype_of(c)[0], slot)
            out.append(("in", slot) if new is None and slot is not None else new)
        return tuple(out)

    def _maker(self, shapes, dev, c, values):
        """``make(x)``: the plan's tensors of an allocating call on GPU ``dev``, from its (staged) inputs ``x``:
        straight-line code with the shapes, dtypes and device bound as constants, as a hand-written op allocates.
        ``make.done(ts, x, stream)``: the result, where an output is padded or omitted (Out's ``pad``, ``omitted``)."""
        import torch

        env = {"E": torch.empty, "EL": torch.empty_like, "ZL": torch.zeros_like, "Z": torch.zeros, "DEV": torch.device("cuda", dev), "AO": alloc_on, "A": allocate, "R": Outputs, "dev": dev}
        items, done, res = [], [], []
        for i, (t, sh) in enumerate(zip(self.tensors, shapes)):
            if sh is None:
                items.append("None")
            elif sh[0] == "in":
                items.append(f"x[{sh[1]}]")
            else:
                if sh[0] == "like":  # empty_like (zeros_like) the input, as upstream allocates it: about 1 us less than empty(shape)
                    new = f"{'ZL' if sh[2] else 'EL'}(x[{sh[1]}])"
                else:
                    env[f"S{i}"], env[f"D{i}"] = sh[1], sh[2]
                    new = f"{'Z' if sh[0] == 'zero' else 'E'}(S{i}, dtype=D{i}, device=DEV)"
                g = sh[-1]
                if t.pad and g is not None:  # a given one the kernel binds as it is: its padded shape, contiguous, aligned
                    env[f"M{i}"] = t.mask(values[t.name], c) if values[t.name] is not None else 15
                    items.append(f"(x[{g}] if x[{g}] is not None and x[{g}].shape == S{i} and x[{g}].is_contiguous() and not x[{g}].data_ptr() & M{i} "
                                 f"else {new})")
                else:
                    items.append(new if g is None else f"({new} if x[{g}] is None else x[{g}])")
            if t.role != "out" or t.returns is False or (t.omitted and not values[t.when]):
                continue
            res.append(f"{t.returns}=r{i}")
            done.append(f"    r{i} = ts[{i}]")
            if t.pad and sh is not None and sh[0] == "new":
                env[f"V{i}"] = tuple(slice(0, n) for n in t.size_in(c))
                g = sh[-1]
                cut = [] if tuple(sh[1]) == t.size_in(c) else ["with AO(stream, dev):", f"    r{i} = A(lambda: r{i}[V{i}].contiguous())"]
                if g is not None:  # given: filled through our buffer when not bound, copied back on the stream
                    cut = [f"if x[{g}] is not None:", f"    if r{i} is not x[{g}]:", "        with AO(stream, dev):",
                           f"            x[{g}].copy_(r{i}[V{i}])", f"    r{i} = x[{g}]"] + (["else:"] + ["    " + ln for ln in cut] if cut else [])
                done += ["    " + ln for ln in cut]  # else: upstream returns its padded allocation's part, contiguous
        src = f"def make(x):\n    return ({', '.join(items)},)\n"
        if any(t.pad or t.omitted for t in self.tensors):
            src += "def done(ts, x, stream):\n" + "\n".join(done) + f"\n    return R({', '.join(res)})\n"
        exec(compile(src, f"<dsa_aot alloc: {self.family}.{self.name}>", "exec"), env)  # noqa: S102 (our own text: names only)
        env["make"].done = env.get("done")
        # nothing to allocate (every output given, as they are): the form skips switching torch's stream (~1 us)
        env["make"].allocates = any(sh is not None and sh[0] != "in" and (sh[-1] is None or values[t.name] is None or t.pad)
                                    for t, sh in zip(self.tensors, shapes))
        return env["make"]

    def into_args(self, c, stream) -> dict:
        """The ``_into`` call of a validated allocating call ``c`` (alloc_prelude's form): its arguments of the same names, updated."""
        return {n: c.__dict__.get(n) for n in self.into_params} | self.alloc_prelude(c, stream)

    def alloc_result(self, c, a, stream):
        """The allocating form's result from its ``_into`` call's arguments ``a`` (None outputs left out), the outputs in
        ``c.back`` copied into the given ones first, on the launch stream."""
        back = getattr(c, "back", {})
        if back:
            with alloc_on(stream, c.dev):
                for n, t in back.items():
                    t.copy_(a[n])
        return Outputs(**{r: back.get(self.names[i], a[self.names[i]]) for r, i in self.results if a[self.names[i]] is not None})

    def stage(self, name, t, stream, c):
        """Input ``name`` as the kernels take it (contiguous, aligned): ``t`` itself, or a copy made on the launch stream."""
        mask = self._by_name[name].mask(t, c) if t is not None else 0
        if t is None or (t.is_contiguous() and not t.data_ptr() & mask):
            return t
        with alloc_on(stream, c.dev):
            x = t.contiguous()
            return x if not x.data_ptr() & mask or self._by_name[name].staged == "contiguous" else x.clone()

    # --- the public forms ----------------------------------------------------------------------------

    def forms(self, namespace: dict):
        """(the allocating function, the ``_into`` function, the plan class), with cudnn's signatures. The
        bodies are what a hand-written op would be (one cached call, one run), so a call costs no more
        (bench/ab.py measures that against the hand-written ops)."""
        import inspect

        tup = lambda names: "(" + "".join(n + ", " for n in names) + ")"  # noqa: E731
        fast = [self._by_name[n].fast(n) for n in self.scalars]
        x = "_call.x"  # the per-call scalars, checked inline where each option can say how (scalars() builds dicts)
        if self.scalars:
            x = f"_call.scalars({', '.join(f'{n}={n}' for n in self.scalars)})"
            if all(fast) and self.scalar_fn is None:
                x = f"{tup(self.scalars)} if {' and '.join(fast)} else {x}"
        view = "ALLOC_VIEW(_x)" if self.alloc_view is not None else "_x"
        guard = "    if _call.guard is not None:\n        _call.guard()\n" if self.guard is not None else ""
        iopts = "_opts" if self.alloc_key == self.key else "_iopts"  # alloc_only options: in its memo's key, not the _into call's
        ret = "_make.done(_ts, _x, stream)" if any(t.pad or t.omitted for t in self.tensors) else \
            f"Outputs({', '.join(f'{r}=_ts[{i}]' for r, i in self.results)})"

        def first(fn, sig, name):  # "a, b, = FIRST(a=a, b=b, q=q)": its positional names returned, those of the form's signature passed
            if fn is None:
                return ""
            ps = inspect.signature(fn).parameters.values()
            given = [f"{p.name}={p.name}" for p in ps if p.name in sig]
            return f"    {tup(p.name for p in ps if p.kind is not p.KEYWORD_ONLY)[1:-1]}= {name}({', '.join(given)})\n"

        names_of = lambda sig: {n.strip().split("=")[0] for n in sig.split(",")}  # noqa: E731
        # the allocating form, straight-line as a hand-written op is (its host cost is the point): the memo of the
        # last validated inputs, else prepare_alloc's full checks; then allocate on the launch stream, the _into
        # call (fresh: only the new pointers re-checked), the launch
        src = (f"def {self.name}_into({self.into_sig}):\n"
               f"{first(self.into_first, names_of(self.into_sig), 'INTO_FIRST')}"
               f"    _ts = {tup(self.names)}\n"
               f"    _opts = {tup(self.key)}\n"
               f"    _call, _p = cached(CACHE, _ts, _opts, lambda: OP.build(_ts, _opts, {tup(self.scalars)}))\n"
               f"{guard}"
               f"    _call.run(_p, stream_handle(stream, _call.dev), {x}, _ts, stream)\n"
               f"    return {', '.join(self.into_returns)}\n\n")
        if self.alloc_sig is None:  # an _into form only (a step of a public op run alone: the fused top-k's tail)
            pass
        elif self.alloc_prelude is not None:  # the family makes the _into call's arguments; the checks first, nothing touched before
            params = [n.strip().split("=")[0] for n in self.alloc_sig.split(",") if n.strip() not in ("*", "")]
            src += (f"def {self.name}({self.alloc_sig}):\n"
                    f"    _c = OP.validate({{{', '.join(f'{n!r}: {n}' for n in params)}}}, allocating=True)\n"
                    f"    _a = OP.into_args(_c, stream)\n"
                    f"    {self.name}_into(**_a)\n"
                    f"    return OP.alloc_result(_c, _a, stream)\n")
        else:
            src += (f"def {self.name}({self.alloc_sig}):\n"
               f"{first(self.alloc_first, names_of(self.alloc_sig), 'FIRST')}"
               f"    _ins = {tup(self._by_name[n].param for n in self.ins)}\n"
               f"    _opts = {tup(self.alloc_key)}\n"
               f"    _hit = remembered(CACHE, ALLOC, _ins, _opts)\n"
               f"    if _hit is not None:\n"
               f"        _dev, _box, _make, _sc = _hit[0]\n"
               f"        _x = _ins\n"
               f"    else:\n"
               f"        _dev, _box, _make, _x, _sc = OP.prepare_alloc(_ins, _opts, {tup(self.scalars)}, stream)\n"
               f"    _xs = {x.replace('_call.scalars', '_sc') if self.scalars else '()'}  # checked before allocating\n"
               f"    _s = stream_handle(stream, _dev)\n"
               + (f"    _iopts = {tup(self.key)}\n" if iopts == "_iopts" else "")
               + f"    if not _make.allocates:\n"
               f"        _ts = _make({view})\n"
               f"    else:\n"
               f"        with alloc_on(stream, _dev):\n"
               f"            try:\n"
               f"                _ts = _make({view})\n"
               f"            except RuntimeError as _e:  # torch.OutOfMemoryError is one\n"
               f"                raise alloc_failed(_e) from None\n"
               f"    _call, _p = fresh(_box, CACHE, _ts, {iopts}, lambda: OP.build(_ts, {iopts}, {tup(self.scalars)}))\n"
               f"{guard}"
               f"    _call.run(_p, _s, _xs, _ts, stream)\n"
               f"    return {ret}\n")
        env = {"OP": self, "CACHE": self.cache, "cached": cached, "stream_handle": stream_handle, "remembered": remembered, "ALLOC": ALLOC,
               "alloc_on": alloc_on, "alloc_failed": alloc_failed, "fresh": fresh, "Outputs": Outputs,
               "ALLOC_VIEW": self.alloc_view, "FIRST": self.alloc_first, "INTO_FIRST": self.into_first}
        # our own text (names only), its bytecode kept as the launchers' is: compiling it was 3 of the 13 ms that
        # importing the four-op score-recompute module took on the 2-core build machine
        exec(code_for(src.encode(), hashlib.sha256(src.encode()).hexdigest(), f"<dsa_aot op: {self.family}.{self.name}>"), env)  # noqa: S102
        into, alloc = env[f"{self.name}_into"], env.get(self.name)
        self.into_params = tuple(inspect.signature(into).parameters)
        for fn in (into, alloc) if alloc else (into,):
            fn.__module__ = namespace.get("__name__", fn.__module__)
            fn.__qualname__ = fn.__name__
        into.__doc__ = f"``{self.name}`` into caller-provided outputs (capture-safe from the first call; allocates nothing). {self.note}"
        self.made = (alloc, into)  # what dsa_aot.ops.library registers as torch ops (an op with an allocating form)
        if self.plan_class is None:
            return alloc, into, None
        alloc.__doc__ = f"cudnn's {self.name}: returns {{{', '.join(repr(r) for r, _ in self.results)}}}. {self.note}"
        sig = inspect.signature(into)
        plan_sig = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "stream"])  # cudnn's plan takes no stream
        if self.plan_args is not None:
            exec(f"def plan_sig({self.plan_args}): pass", env)  # noqa: S102 (our own text: names only)
            plan_sig = inspect.signature(env["plan_sig"])
        op = self

        def build(*args, **kwargs):
            b = plan_sig.bind(*args, **kwargs)
            b.apply_defaults()
            a = b.arguments
            key = tuple(a[k] if k in a else op._opt(k).default for k in op.key)  # a Hidden option: its default
            return op.build(tuple(a[n] for n in op.names), key, tuple(a[k] for k in op.scalars))

        doc = (f"cudnn's {self.plan_class} shape: ``{self.plan_class}{plan_sig}`` validates and resolves everything once; "
               f"``execute({', '.join(self.names)}, stream=None)`` then launches (see :class:`dsa_aot.ops.plan.Plan`).")
        cls = type(self.plan_class, (Plan,), {"_build": staticmethod(build), "_tensors": self.names, "_scalars": self.scalars, "__doc__": doc,
                                              "__module__": namespace.get("__name__", __name__)})
        return alloc, into, cls

    def torch_ops(self, namespace: str, alloc, into, names=None) -> dict:
        """``{name: (schema, impl, fake)}`` of the allocating and the ``_into`` op (what :mod:`dsa_aot.ops.library` registers)."""
        import inspect

        def params(fn, order=None):
            out, letters, sig = [], iter("abcdefghijklmnop"[len(self.alias_order):]), inspect.signature(fn).parameters
            for p in (sig[n] if " " not in n else n for n in (order.split(", ") if order else sig)):
                if isinstance(p, str):  # a literal "type name[=default]" of torch_order
                    out.append((p.split("=")[0].split()[-1], p))
                    continue
                spec = self._by_name.get(p.name)
                if p.name == "stream" or spec is None or (isinstance(spec, _Option) and not spec.torch) or (fn is alloc and getattr(spec, "given", False)):
                    continue
                if isinstance(spec, _Tensor):
                    first = p.name in self.alias_order
                    alias = f"({'abcdefghijklmnop'[self.alias_order.index(p.name)] if first else next(letters)}!)" if spec.written else ""
                    required = spec.role == "workspace" and p.default is inspect.Parameter.empty  # a signature's positional workspace
                    opt = "?" if (spec.optional and not required) or p.default is None else ""
                    txt = f"Tensor{alias}{opt} {p.name}"
                else:
                    txt = f"{spec.torch_type} {p.name}"
                d = spec.torch_default if isinstance(spec, _Option) and spec.torch_default is not REQUIRED else p.default
                if d is not inspect.Parameter.empty:
                    txt += f'="{d}"' if isinstance(d, str) else f"={d!r}"  # a schema's strings are double-quoted
                out.append((p.name, txt))
            return out

        outs = [t for t in self.tensors if t.role == "out" and t.returns is not False]
        listy = any(t.when for t in outs)
        ret = "Tensor[]" if listy else "Tensor" if len(outs) == 1 else "(" + ", ".join("Tensor" for _ in outs) + ")"
        sig = {}
        if self.torch_into is not None:
            exec(f"def into({self.torch_into}): pass", sig)  # noqa: S102 (our own text: a signature)
        order = self.torch_order or (None, None)
        ap, ip = params(alloc, order[0]), params(sig.get("into", into), order[1])
        op = self

        def t_alloc(*args):
            r = alloc(**dict(zip([n for n, _ in ap], args)))
            got = [r.get(t.returns) for t in outs]
            return [g for g in got if g is not None] if listy else got[0] if len(got) == 1 else tuple(got)

        def f_alloc(*args):  # the outputs' shapes and dtypes as the allocating form makes them, on fake tensors
            values = dict.fromkeys(op.names) | {o.name: o.default for o in op.options} | dict(zip([n for n, _ in ap], args))
            c = op._context(values, allocating=True)
            for t in op.tensors:
                v = values[t.name]
                if t.role == "in" and v is not None and isinstance(t.shape, tuple):
                    c.sym.update((s, n) for s, n in zip(t.shape, v.shape) if not isinstance(s, int) and s not in c.sym)
            if op.symbols is not None:
                op.symbols(c, [])
            like = next(values[n] for n in op.ins if values[n] is not None)
            got = [like.new_empty(t.size_in(c), dtype=t.dtype_of(c)[0]) for t in outs if t.when is None or values[t.when]]
            return got if listy else got[0] if len(got) == 1 else tuple(got)

        def t_into(*args):
            into(**dict(zip([n for n, _ in ip], args)))

        base = names or self.name
        return {f"{namespace}_{base}": ("(" + ", ".join(t for _, t in ap) + f") -> {ret}", t_alloc, self.fake or f_alloc),
                f"{namespace}_{base}_into": ("(" + ", ".join(t for _, t in ip) + ") -> ()", t_into, writes_only)}


class _Ptrs:
    """The symbolic data pointers of a recorded call, by tensor name (``c.p.indices``)."""

    def __init__(self, names, syms):
        self.__dict__.update(zip(names, syms))
