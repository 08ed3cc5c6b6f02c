"""The kernel families' specs (``kernels/<family>.py``), loaded by file path for the registered families.

A spec is build-time only: the wheel does not ship it, and loading one imports neither cutlass nor
cudnn (its functions do). It imports ``dsa_aot.policy`` and the shared fake tensors
(:mod:`dsa_aot.toolchain.fakes`) only. Its contract, checked when it loads (:class:`Spec`; a spec that
breaks it is a CompileError naming what is wrong, before anything compiles):

  FAMILY, OPS                        the family's name and op table (``dsa_aot.policy.<family>``'s)
  build(op, key, target)             -> (jit function or kernel object, args, options, derived key):
                                     what ``cute.compile`` gets for one entry
  check_policy(targets)              raise ValueError where the family's policy disagrees with cudnn's
                                     own functions (run on every build, over a grid of shapes)
  fidelity(op, key, target, up)      run cudnn's own JIT path for the entry on ``up`` (an
                                     :class:`dsa_aot.toolchain.fidelity.Upstream`); return what upstream
                                     compiled (see there)
  FIDELITY_ROUTES                    {op: text}: the route fidelity takes per op, named in the report;
                                     one for every op of OPS
  LITERALS (optional)                {op: {name: value}}: an fp32 (float) or i32 (int) value ``build``
                                     compiles into the host code that the launcher takes per call
                                     instead, as its trailing argument ``name`` (dsa_aot.toolchain.lift.lift)
  PRELOAD (optional)                 modules the compile process imports before its first request

Families come from the fixed registry :data:`dsa_aot.policy.families.FAMILIES`, never from a name found
in a manifest. A compile process loads its one family's spec with :meth:`_Specs.pin` and never imports
the registry (dsa_aot.toolchain.zygote: what else is registered must not change its state).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .sources import REPO, closure, digest

__all__ = ["SPECS", "Spec", "kernels_dir", "spec_path", "spec_digest"]


def kernels_dir(root: Path = REPO) -> Path:
    """Where spec files are read from: $AOT_KERNELS_DIR, else ``root``/kernels (the source checkout's)."""
    env = os.environ.get("AOT_KERNELS_DIR")
    return Path(env) if env else Path(root) / "kernels"


def _registered(family: str) -> bool:
    from ..policy.families import FAMILIES

    return family in FAMILIES


def spec_path(family: str, root: Path = REPO) -> Path:
    if not _registered(family):
        raise KeyError(family)
    return kernels_dir(root) / f"{family}.py"


def spec_digest(family: str, root: Path = REPO) -> str:
    """sha256 of the family's spec and every aot module it imports (its policy, the arch table, ...)."""
    return digest(closure(spec_path(family, root), root), root)


@dataclass(frozen=True)
class Spec:
    """A loaded spec whose contract holds (the module docstring says what each part is)."""

    family: str
    ops: Mapping
    _build: Callable
    check_policy: Callable
    _fidelity: Callable
    routes: Mapping  # FIDELITY_ROUTES
    literals: Mapping = field(default_factory=dict)
    preload: tuple = ()

    def build(self, op, key, target):
        """The spec's ``build`` for an op of OPS (KeyError for another: the spec never sees it)."""
        return self._build(self._op(op), key, target)

    def fidelity(self, op, key, target, up):
        return self._fidelity(self._op(op), key, target, up)

    def _op(self, op):
        if op not in self.ops:
            raise KeyError(f"kernels/{self.family}.py has no op {op!r} (its ops: {', '.join(self.ops)})")
        return op

    @classmethod
    def of(cls, family: str, mod, path) -> "Spec":
        """The spec of module ``mod`` (loaded from ``path``), or CompileError listing every part of the contract it breaks."""
        from ..errors import CompileError

        bad, get = [], lambda n, default=None: getattr(mod, n, default)
        if get("FAMILY") != family:
            bad.append(f"FAMILY is {get('FAMILY')!r}, not {family!r}")
        ops = get("OPS")
        if not isinstance(ops, Mapping) or not ops:
            bad.append("OPS: missing or empty (the policy's op table)")
            ops = {}
        for name in ("build", "check_policy", "fidelity"):
            if not callable(get(name)):
                bad.append(f"{name}: missing or not a function")
        routes, literals, preload = get("FIDELITY_ROUTES", {}), get("LITERALS", {}), get("PRELOAD", ())
        if not isinstance(routes, Mapping) or set(routes) != set(ops) or not all(isinstance(v, str) and v for v in routes.values()):
            have = set(routes) if isinstance(routes, Mapping) else set()
            bad.append(f"FIDELITY_ROUTES: one route text per op of OPS (missing {sorted(set(ops) - have)}, unknown {sorted(have - set(ops))})")
        if not isinstance(literals, Mapping) or not set(literals) <= set(ops) or not all(
                isinstance(v, Mapping) and all(isinstance(n, str) and isinstance(x, (float, int)) and not isinstance(x, bool) for n, x in v.items())
                for v in literals.values()):
            bad.append("LITERALS: {op of OPS: {argument name: float or int}}")
        if not isinstance(preload, tuple) or not all(isinstance(m, str) for m in preload):
            bad.append("PRELOAD: a tuple of module names")
        if bad:
            raise CompileError(f"{path} breaks the spec contract (dsa_aot/toolchain/specs.py): " + "; ".join(bad))
        return cls(family, ops, mod.build, mod.check_policy, mod.fidelity, dict(routes), dict(literals), preload)


class _Specs(Mapping):
    """family -> its :class:`Spec`, loaded on first use (no work at import)."""

    def __init__(self):
        self._mods = {}

    def __getitem__(self, name):
        if name not in self._mods:
            if not _registered(name):
                raise KeyError(name)
            self.pin(name)
        return self._mods[name]

    def pin(self, name):
        """Load ``name``'s spec without reading the registry (the caller checked it is registered)."""
        if name not in self._mods:
            path = kernels_dir() / f"{name}.py"
            if not path.is_file():
                from ..errors import CompileError

                raise CompileError(f"the spec of family {name!r} is missing: {path} (a source checkout has kernels/; set AOT_KERNELS_DIR to another)")
            spec = importlib.util.spec_from_file_location(f"aot_kernels_{name}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            self._mods[name] = Spec.of(name, mod, path)
        return self._mods[name]

    def __iter__(self):
        from ..policy.families import FAMILIES

        return iter(FAMILIES)

    def __len__(self):
        from ..policy.families import FAMILIES

        return len(FAMILIES)


SPECS = _Specs()
