"""The package is split by when code runs, and the split is enforced here.

  dsa_aot.policy     pure rules: standard library only
  dsa_aot.runtime    run time: standard library, cuda-python and the policy; never the toolchain or the ops
  dsa_aot.ops        run time: torch, the runtime and the policy
  dsa_aot.toolchain  build time: the policy (and itself); never the run-time ops or runtime
  kernels/*.py   build time: the policy and the shared fake tensors (dsa_aot.toolchain.fakes)

``dsa_aot.errors`` (the root exception, stdlib only) may be imported by every layer.
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ALLOWED = {
    "dsa_aot.policy": {"dsa_aot.policy"},
    "dsa_aot.runtime": {"dsa_aot.runtime", "dsa_aot.policy"},
    "dsa_aot.ops": {"dsa_aot.ops", "dsa_aot.runtime", "dsa_aot.policy"},
    "dsa_aot.toolchain": {"dsa_aot.toolchain", "dsa_aot.policy"},
    "kernels": {"dsa_aot.policy", "dsa_aot.toolchain.fakes"},
}
THIRD_PARTY = {  # what a layer may import outside aot (the standard library aside)
    "dsa_aot.policy": set(),
    "dsa_aot.runtime": {"cuda"},
    "dsa_aot.ops": {"torch", "cuda"},
}
EVERYWHERE = {"dsa_aot", "dsa_aot.errors"}


def _layer(rel: str) -> str:
    parts = Path(rel).with_suffix("").parts
    if parts[0] == "kernels":
        return "kernels"
    return ".".join(parts[:2]) if len(parts) > 2 else ".".join(parts)


def _imports(path: Path, root: Path = ROOT):
    """(line, absolute module name) for every import in ``path``, relative ones resolved."""
    rel = path.relative_to(root)
    pkg = list(rel.with_suffix("").parts)
    pkg = pkg[:-1] if pkg[-1] != "__init__" else pkg[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            for a in node.names:
                yield node.lineno, f"{base}.{a.name}" if node.level and not node.module else base


def _files(root):
    for p in sorted((root / "dsa_aot").rglob("*.py")):
        if "_generated" not in p.parts:
            yield p
    yield from sorted((root / "kernels").glob("*.py"))


def _violations(root: Path) -> list:
    bad = []
    for path in _files(root):
        rel = str(path.relative_to(root))
        layer = _layer(rel)
        if layer not in ALLOWED:
            continue  # dsa_aot/__init__.py, dsa_aot/__main__.py, the namespaces dsa_aot/csa.py, dsa_aot/dsa.py, dsa_aot/errors.py: checked below
        for line, mod in _imports(path, root):
            top = mod.split(".")[0]
            if top == "dsa_aot":
                if mod in EVERYWHERE or any(mod == a or mod.startswith(a + ".") for a in ALLOWED[layer]):
                    continue
                bad.append(f"{rel}:{line} imports {mod} ({layer} may import {sorted(ALLOWED[layer])})")
            elif layer in THIRD_PARTY and top not in THIRD_PARTY[layer] and top not in sys.stdlib_module_names and top != "__future__":
                bad.append(f"{rel}:{line} imports {mod} ({layer} may import the standard library and {sorted(THIRD_PARTY[layer])})")
    return bad


def test_imports_point_from_run_time_to_policy_and_never_into_the_toolchain():
    bad = _violations(ROOT)
    assert not bad, "\n".join(bad)


def test_public_namespaces_import_only_the_ops_and_the_policy():
    for name in ("csa.py", "dsa.py", "errors.py", "library.py", "__init__.py"):
        for line, mod in _imports(ROOT / "dsa_aot" / name):
            assert not mod.startswith(("dsa_aot.toolchain", "dsa_aot.runtime")), f"dsa_aot/{name}:{line} imports {mod}"


def test_the_check_catches_wrong_imports(tmp_path):
    """The walk can fail: a policy module importing the runtime, a spec importing an op module and the
    runtime importing torch are each reported."""
    _copy_tree(tmp_path)
    assert _violations(tmp_path) == []
    (tmp_path / "dsa_aot" / "policy" / "probe.py").write_text("from ..runtime import index\n")
    (tmp_path / "kernels" / "probe.py").write_text("import dsa_aot.ops.csa_compressor\nimport dsa_aot.toolchain.build\n")
    (tmp_path / "dsa_aot" / "runtime" / "probe.py").write_text("import torch\n")
    assert sorted(_violations(tmp_path)) == [
        "dsa_aot/policy/probe.py:1 imports dsa_aot.runtime (dsa_aot.policy may import ['dsa_aot.policy'])",
        "dsa_aot/runtime/probe.py:1 imports torch (dsa_aot.runtime may import the standard library and ['cuda'])",
        "kernels/probe.py:1 imports dsa_aot.ops.csa_compressor (kernels may import ['dsa_aot.policy', 'dsa_aot.toolchain.fakes'])",
        "kernels/probe.py:2 imports dsa_aot.toolchain.build (kernels may import ['dsa_aot.policy', 'dsa_aot.toolchain.fakes'])",
    ]


BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('cutlass', 'cudnn', 'tvm_ffi', 'torch'):
            raise ImportError('blocked ' + name)
sys.meta_path.insert(0, Block())
"""


def test_run_time_imports_no_toolchain_and_does_nothing_at_import():
    code = BLOCK + """
import dsa_aot, dsa_aot.runtime, dsa_aot.runtime.index, dsa_aot.runtime.loaded, dsa_aot.runtime.driver, dsa_aot.csa, dsa_aot.dsa, dsa_aot.policy.families
assert not any(m.split('.')[0] in ('cutlass', 'cudnn', 'tvm_ffi', 'torch', 'cuda') for m in sys.modules), sorted(sys.modules)
assert not any(m.startswith('dsa_aot.toolchain') for m in sys.modules), sorted(m for m in sys.modules if m.startswith('dsa_aot'))
assert dsa_aot.runtime.index._INDEX is None
print('ok')
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_a_namespace_imports_an_op_module_when_one_of_its_names_is_used():
    """dsa_aot.dsa / dsa_aot.csa serve the registry's exports: importing the namespace imports no op module, a
    name imports its own family's only, and every exported name is the op module's."""
    code = BLOCK + """
import dsa_aot.dsa, dsa_aot.csa
from dsa_aot.policy.families import FAMILIES
ops = lambda: sorted(m for m in sys.modules if m.startswith('dsa_aot.ops.') and m.split('.')[2] in FAMILIES)
assert ops() == [], ops()
f = dsa_aot.dsa.indexer_top_k
assert ops() == ['dsa_aot.ops.dsa_indexer_top_k'], ops()
import dsa_aot.ops.dsa_indexer_top_k as m
assert f is m.indexer_top_k and dsa_aot.dsa.IndexerTopK is m.IndexerTopK
assert 'compactify' in dir(dsa_aot.dsa) and 'compactify' in dsa_aot.dsa.__all__ and ops() == ['dsa_aot.ops.dsa_indexer_top_k']
try:
    dsa_aot.dsa.no_such_op
    raise SystemExit('no AttributeError')
except AttributeError as e:
    assert "dsa_aot.dsa' has no attribute 'no_such_op'" in str(e)
import importlib
for fam, reg in FAMILIES.items():
    mod = importlib.import_module('dsa_aot.ops.' + fam)
    ns = getattr(dsa_aot, reg.namespace)
    assert reg.exports and mod.__all__ == list(reg.exports), fam
    assert all(getattr(ns, n) is getattr(mod, n) for n in reg.exports), fam
print('ok')
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_every_registered_family_has_each_piece_of_the_recipe():
    """docs/adding-a-family.md: a family is its spec, policy and op modules, a parity declaration (which
    bench/run.py times too), and buckets in the default manifest. The GPU run (ci/gpu-run.sh) loops over the
    registry. No family has a benchmark script of its own: bench/run.py serves them all."""
    from dsa_aot.policy.families import FAMILIES

    manifest = (ROOT / "manifests" / "default.toml").read_text()
    missing = []
    for family in FAMILIES:
        for path in (f"kernels/{family}.py", f"dsa_aot/policy/{family}.py", f"dsa_aot/ops/{family}.py", f"ci/parity/{family}.py"):
            if not (ROOT / path).is_file():
                missing.append(path)
        if (ROOT / "bench" / f"{family}.py").exists():
            missing.append(f"bench/{family}.py should not exist (bench/run.py {family} times the parity declaration's cases)")
        if f'family = "{family}"' not in manifest:
            missing.append(f"manifests/default.toml: buckets of {family}")
    assert not missing, missing


def _graph(root: Path) -> dict:
    """{module: {imported package modules}}: every import of the package and the specs, function-level ones
    included (a cycle through a function's import is still a cycle of the code's structure)."""
    mods = {}
    for path in _files(root):
        rel = path.relative_to(root).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts)
        mods[name] = path
    graph = {}
    for name, path in mods.items():
        deps = set()
        for _, mod in _imports(path, root):
            while mod and mod not in mods:  # `from .x import name` names x.name: the module is x
                mod = mod.rpartition(".")[0]
            if mod and mod != name and not name.startswith(mod + "."):  # a package's own __init__ is no dependency cycle
                deps.add(mod)
        graph[name] = deps
    return graph


def _cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


# None left (issue 30, item 4): the zygote imports the stage whose work a request asks for by name in the compile
# process (zygote._TASKS), the stages import the zygote; two-CTA cubins compared byte for byte before and after.
def test_no_import_cycle():
    assert _cycles(_graph(ROOT)) == []


def test_the_cycle_check_finds_a_new_cycle(tmp_path):
    _copy_tree(tmp_path)
    (tmp_path / "dsa_aot" / "policy" / "keys.py").write_text((ROOT / "dsa_aot/policy/keys.py").read_text() + "\nfrom . import arch  # probe\n")
    (tmp_path / "dsa_aot" / "policy" / "arch.py").write_text((ROOT / "dsa_aot/policy/arch.py").read_text() + "\nfrom . import keys  # probe\n")
    assert ["dsa_aot.policy.arch", "dsa_aot.policy.keys"] in _cycles(_graph(tmp_path))


def _copy_tree(tmp_path):
    import shutil

    shutil.copytree(ROOT / "dsa_aot", tmp_path / "dsa_aot", ignore=shutil.ignore_patterns("_generated", "__pycache__"))
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))


def _private_imports(root: Path) -> list:
    """Imports of another family's private names (``_x`` from dsa_aot.{ops,policy}.<family> or kernels.<family>)."""
    from dsa_aot.policy.families import FAMILIES

    def family_of(mod):
        parts = mod.split(".")
        for i, p in enumerate(parts):
            if p in FAMILIES and (parts[:i] in (["dsa_aot", "ops"], ["dsa_aot", "policy"], ["kernels"])):
                return p
        return None

    bad = []
    for path in _files(root):
        rel = path.relative_to(root)
        me = family_of(".".join(rel.with_suffix("").parts))
        pkg = list(rel.with_suffix("").parts)[:-1]
        tree = ast.parse(path.read_text(), str(path))
        aliases = {}  # a name bound to another family's module (``from . import dsa_indexer_forward as fwd``) -> that family
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else [])) if node.level else node.module
                for a in node.names:
                    owner = family_of(f"{base}.{a.name}")
                    if owner and owner != me and not family_of(base):
                        aliases[a.asname or a.name] = owner
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases and node.attr.startswith("_"):
                bad.append(f"{rel}:{node.lineno} uses {node.value.id}.{node.attr} ({aliases[node.value.id]}'s private name)")
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else [])) if node.level else node.module
            owner = family_of(base)  # names taken from a family's module (a module imported by name is an alias, above)
            for a in node.names:
                if owner and owner != me and a.name.startswith("_"):
                    bad.append(f"{rel}:{node.lineno} imports {a.name} from {base} ({owner}'s private name)")
    return bad


def test_no_module_imports_another_familys_private_names():
    assert _private_imports(ROOT) == []


def test_the_private_name_check_can_fail(tmp_path):
    _copy_tree(tmp_path)
    (tmp_path / "dsa_aot" / "ops" / "dsa_topk_utils.py").write_text(
        (ROOT / "dsa_aot/ops/dsa_topk_utils.py").read_text() + "\nfrom .dsa_indexer_top_k import _rules  # probe\n")
    assert _private_imports(tmp_path) == ["dsa_aot/ops/dsa_topk_utils.py:1 imports _rules from dsa_aot.ops.dsa_indexer_top_k (dsa_indexer_top_k's private name)".replace(
        ":1 ", f":{len((tmp_path / 'dsa_aot/ops/dsa_topk_utils.py').read_text().splitlines())} ")]
