"""The wheel: a standard PEP 517 build (pip's build isolation) of a one-entry manifest, with no GPU;
pure (py3-none-any); it ships the run-time layers and the build, no toolchain module; installed into
a clean venv without cutlass, cudnn or torch, `import dsa_aot` there loads no toolchain and every op imports."""

import ast
import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("cutlass")  # the test machine has the toolchain; the isolated build installs its own

ROOT = Path(__file__).resolve().parents[3]


def test_isolated_wheel_build_ships_run_time_code_only_and_imports_without_the_toolchain(tmp_path):
    manifest = tmp_path / "m.toml"
    manifest.write_text(
        '[[target]]\nname = "h200"\narch = "sm_90a"\nsm_count = 132\n'
        '[[target]]\nname = "b200"\narch = "sm_100a"\nsm_count = 148\n'
        '[[bucket]]\nfamily = "csa_compressor"\nop = "fwd"\nratio = 4\ncoff = 2\nd = 128\n'
    )
    env = dict(os.environ, AOT_MANIFEST=str(manifest))
    env.pop("PYTHONPATH", None)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    (whl,) = (tmp_path / "dist").glob("*.whl")
    assert whl.name.endswith("-py3-none-any.whl"), whl.name
    zf = zipfile.ZipFile(whl)
    names = zf.namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("dsa_aot-")}
    assert tops == {"dsa_aot"}, tops
    assert "dsa_aot/_generated/index.json" in names
    gen = sorted(n.removeprefix("dsa_aot/_generated/") for n in names if n.startswith("dsa_aot/_generated/"))
    assert gen == ["index.json", "index.sha256", "index/csa_compressor.sm_10x.json", "index/csa_compressor.sm_9x.json", "packs/sm_10x.csa_compressor.fwd.0.xz",
                   "packs/sm_10x.csa_compressor.launchers.0.xz", "packs/sm_9x.csa_compressor.fwd.0.xz",
                   "packs/sm_9x.csa_compressor.launchers.0.xz"], gen  # what the runtime reads, nothing else
    assert not any(n.endswith((".so", ".pyd", ".dylib")) for n in names)
    assert not any(n.startswith("dsa_aot/toolchain/") or n == "dsa_aot/__main__.py" for n in names), [n for n in names if "toolchain" in n]
    for layer in ("dsa_aot/policy/", "dsa_aot/ops/", "dsa_aot/runtime/"):
        assert any(n.startswith(layer) for n in names), layer
    # no shipped file imports the toolchain, cutlass or cudnn (the generated launchers: in the venv below)
    for n in names:
        if n.endswith(".py"):
            for node in ast.walk(ast.parse(zf.read(n).decode(), n)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                for m in mods:
                    assert not m.startswith(("cutlass", "cudnn", "tvm_ffi", "dsa_aot.toolchain", "toolchain")), (n, m)

    vdir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(vdir)
    py = vdir / "bin" / "python"
    p = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(whl)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    code = (
        "import importlib.util, sys, json, os\n"
        "assert all(importlib.util.find_spec(m) is None for m in ('cutlass', 'cudnn', 'torch'))\n"
        "import dsa_aot, dsa_aot.runtime, dsa_aot.csa, dsa_aot.dsa, dsa_aot.errors, dsa_aot.policy.families\n"
        "ops = {ns: getattr(dsa_aot, ns).__all__ for ns in ('csa', 'dsa')}\n"
        "assert all(callable(getattr(getattr(dsa_aot, ns), n)) for ns, names in ops.items() for n in names)\n"
        "assert importlib.util.find_spec('dsa_aot.toolchain') is None\n"
        "assert not any(m.split('.')[0] in ('cutlass', 'cudnn', 'tvm_ffi', 'torch') or m.startswith('dsa_aot.toolchain') for m in sys.modules)\n"
        "from dsa_aot.runtime.index import index\n"
        "es = index().entries\n"
        "import ast\n"
        "for e in es:\n"
        "    for node in ast.walk(ast.parse(index().member(e, 'launcher').decode())):\n"
        "        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ''] if isinstance(node, ast.ImportFrom) else []\n"
        "        assert not any(m.startswith(('cutlass', 'cudnn', 'tvm_ffi', 'dsa_aot.toolchain', 'toolchain')) for m in mods), (e['id'], mods)\n"
        "print(json.dumps([sorted(e['arch'] for e in es), {ns: sorted(v) for ns, v in ops.items()}]))\n"
    )
    p = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    import dsa_aot.csa
    import dsa_aot.dsa

    archs, ops = json.loads(p.stdout.strip().splitlines()[-1])
    assert archs == ["sm_100a", "sm_90a"]
    assert ops == {"csa": sorted(dsa_aot.csa.__all__), "dsa": sorted(dsa_aot.dsa.__all__)}  # every op and plan class of the tree, from the wheel
    assert len(ops["csa"]) + len(ops["dsa"]) == 59  # 8 CSA (the differentiable compressor among them), 51 DSA (indexer and sparse backward, local_to_global, compactify, indexer top-k, indexer and sparse forward, fused indexer top-k: 2 ops, 3 sizing helpers; the differentiable sparse_attention; dense indexer backward, sparse indexer, sparse attention, dense indexer and dense attention score recompute: 2 ops, a sizing helper and a plan each; sparse_attention_score_recompute)
