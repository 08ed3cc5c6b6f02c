"""The wheel: built from a manifest with no GPU, pure (py3-none-any), installs into a clean venv
without cutlass, and `import aot` there never imports the toolchain."""

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("cutlass")
pytest.importorskip("scikit_build_core")

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_builds_installs_and_imports_without_the_toolchain(tmp_path):
    manifest = tmp_path / "m.toml"
    manifest.write_text(
        '[[target]]\nname = "h200"\narch = "sm_90a"\nsm_count = 132\n'
        '[[target]]\nname = "b200"\narch = "sm_100a"\nsm_count = 148\n'
        '[[bucket]]\nfamily = "csa_compressor"\nop = "fwd"\nratio = 4\ncoff = 2\nd = 128\n'
    )
    env = dict(os.environ, AOT_MANIFEST=str(manifest))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)],
                       env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (whl,) = (tmp_path / "dist").glob("*.whl")
    assert whl.name.endswith("-py3-none-any.whl"), whl.name
    names = zipfile.ZipFile(whl).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("dsa_aot-")}
    assert tops == {"aot"}, tops
    assert "aot/_generated/index.json" in names
    assert sum(n.startswith("aot/_generated/cubins/") for n in names) == 2
    assert not any(n.endswith((".so", ".pyd", ".dylib")) for n in names)
    assert not any(n.startswith("aot/_generated/") and n.endswith("kernel.cubin") for n in names)

    vdir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(vdir)
    py = vdir / "bin" / "python"
    p = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(whl)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    code = (
        "import importlib.util, sys, json, os\n"
        "assert importlib.util.find_spec('cutlass') is None\n"
        "import aot, aot.runtime, aot.csa\n"
        "assert not any(m.split('.')[0] in ('cutlass', 'cudnn', 'tvm_ffi') for m in sys.modules)\n"
        "ix = json.load(open(os.path.join(os.path.dirname(aot.__file__), '_generated', 'index.json')))\n"
        "print(sorted(e['arch'] for e in ix['entries']))\n"
    )
    p = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "['sm_100a', 'sm_90a']"
