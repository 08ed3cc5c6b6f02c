"""The kernel families' specs (``kernels/<family>.py``), loaded by file path for the registered families.

A spec is build-time only: the wheel does not ship it, and loading one imports neither cutlass nor
cudnn (its functions do). It imports ``dsa_aot.policy`` only. What the toolchain reads from it:

  OPS                                the family's op table (``dsa_aot.policy.<family>.OPS``)
  build(op, key, target)             -> (jit function or kernel object, args, options, derived key):
                                     what ``cute.compile`` gets for one entry
  check_policy(targets)              raise ValueError where the family's policy disagrees with cudnn's
                                     own functions (run on every build, over a grid of shapes)
  fidelity(op, key, target, up)      run cudnn's own JIT path for the entry on ``up`` (an
                                     :class:`dsa_aot.toolchain.fidelity.Upstream`); return what upstream
                                     compiled (see there). ``FIDELITY_ROUTES`` {op: text} names the
                                     route per op for the report.
  LITERALS (optional)                {op: {name: value}}: an fp32 value ``build`` compiles into the
                                     host code that the launcher takes per call instead, as its
                                     trailing argument ``name`` (dsa_aot.toolchain.lift.lift)

Families come from the fixed registry :data:`dsa_aot.policy.families.FAMILIES`, never from a name found
in a manifest. A compile process loads its one family's spec with :meth:`_Specs.pin` and never imports
the registry (dsa_aot.toolchain.zygote: what else is registered must not change its state).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path

from .sources import REPO, closure, digest

__all__ = ["SPECS", "kernels_dir", "spec_path", "spec_digest"]


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


class _Specs(Mapping):
    """family -> loaded spec module, loaded on first use (no work at import)."""

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
            self._mods[name] = mod
        return self._mods[name]

    def __iter__(self):
        from ..policy.families import FAMILIES

        return iter(FAMILIES)

    def __len__(self):
        from ..policy.families import FAMILIES

        return len(FAMILIES)


SPECS = _Specs()
