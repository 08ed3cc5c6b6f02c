"""Which source files a build artifact depends on, found by reading imports (``ast``), and their digest.

Cache keys of the build stages hash these files, so editing a spec, a policy module or a stage's code
invalidates exactly the artifacts that depend on it. Only ``dsa_aot.*`` modules are followed (third-party
code is pinned by the tool versions that go into the same keys).
"""

from __future__ import annotations

import ast
import hashlib
import os
from pathlib import Path

__all__ = ["REPO", "closure", "digest", "stage_digest"]

# the source checkout (dsa_aot/, kernels/, manifests/), as imported: not resolved, so that a compile process
# that reaches it through a canonical symlink (dsa_aot.toolchain.zygote) keeps the canonical path
REPO = Path(os.path.abspath(__file__)).parents[2]


def _module_path(name: str, root: Path) -> Path | None:
    parts = name.split(".")
    base = root.joinpath(*parts)
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _module_name(path: Path, root: Path) -> str | None:
    try:
        rel = path.resolve().relative_to(root.resolve())
    except ValueError:
        return None  # a spec file outside the package tree: only its absolute imports are followed
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path) -> set:
    """Names of the aot modules ``path`` imports (absolute or relative), with their parent packages."""
    me = _module_name(path, root)
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if me is None:
                    continue
                pkg = me.split(".") if is_pkg else me.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for n in names:
            if n == "dsa_aot" or n.startswith("dsa_aot."):
                parts = n.split(".")
                out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


def closure(path: Path, root: Path = REPO) -> list:
    """``path`` and every aot source file it imports, directly or not; sorted."""
    seen, todo = {Path(path)}, [Path(path)]
    while todo:
        for name in _imports(todo.pop(), root):
            p = _module_path(name, root)
            if p is not None and p not in seen:
                seen.add(p)
                todo.append(p)
    return sorted(seen)


def digest(paths, root: Path = REPO) -> str:
    """sha256 over the files' contents and their names relative to ``root``."""
    h = hashlib.sha256()
    for p in sorted(Path(x) for x in paths):
        try:
            name = str(p.resolve().relative_to(Path(root).resolve()))
        except ValueError:
            name = p.name
        h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


# The family registry: a build stage's per-entry key carries the entry's family (its spec and what the
# spec imports, specs.spec_digest), and no compile process imports the registry (dsa_aot.toolchain.zygote),
# so registering a family must not re-key the other families' artifacts.
REGISTRY = "dsa_aot/policy/families.py"


def stage_digest(*files: str, root: Path = REPO) -> str:
    """Digest of a stage's sources ``files`` (relative to ``root``) and the aot modules they import,
    the family registry excepted."""
    paths = {p for f in files for p in closure(Path(root) / f, root)}
    return digest(sorted(p for p in paths if p != Path(root) / REGISTRY), root)
