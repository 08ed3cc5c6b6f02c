"""dsa_aot.toolchain.zygote: the compile stage's cubins do not depend on the process that runs the build.

The DSL's in-process PTX compiler gives the two-CTA sparse attention backward kernels a cubin that
depends on the compiling process's memory layout (docs/fidelity.md). The compile stage therefore
compiles in processes forked from one canonical zygote; these tests hold it to that on the cheapest
affected entry (H128 D512 top-k 512, ~5 s per compile)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cutlass")  # the build toolchain: installed by ci/setup.sh
pytest.importorskip("cudnn")

ROOT = Path(__file__).resolve().parents[3]
TARGET = '[[target]]\nname = "b200"\narch = "sm_100a"\nsm_count = 148\n'
TWO_CTA = ('[[bucket]]\nfamily = "dsa_sparse_attention_backward"\nop = "bwd"\ndtype = "bf16"\nheads = 128\ndim = 512\ntopk = 512\n'
           'topk_length = false\ndeterministic = false\nplanes = 1\nrelay = 1\nwide = false\n')
BEFORE = '[[bucket]]\nfamily = "csa_compressor"\nop = "fwd"\nratio = 4\ncoff = 2\nd = [64, 128]\n'
D576 = ('[[bucket]]\nfamily = "dsa_sparse_attention_backward"\nop = "bwd_d576"\nheads = 128\ntopk = 512\ntopk_length = false\n'
        'deterministic = true\nsingle_query = false\nsplit = false\nwide = true\n')
NAME = "dsa_sparse_attention_backward.bwd.nodeterministic.dim512.bf16.heads128.planes1.relay1.topk512.notopk_length.nowide.sm_100a"
NAME576 = "dsa_sparse_attention_backward.bwd_d576.deterministic.heads128.nosingle_query.nosplit.topk512.notopk_length.wide.sm_100a"

BUILD = """
import hashlib, json, sys
{preamble}
sys.path.insert(0, {root!r})
from dsa_aot.toolchain import compile as c, manifest
m = manifest.loads(open(sys.argv[1]).read())
res = c.compile_entries(m.entries, sys.argv[2], jobs=int(sys.argv[3]), progress=False)
print(json.dumps({{r.entry.id: hashlib.sha256((r.dir / "kernel.cubin").read_bytes()).hexdigest() for r in res}}))
"""


def _build(tmp_path, name, manifest_text, jobs, preamble="", root=ROOT):
    """compile_entries in a fresh process of its own (its own working directory and imports); {id: sha256}."""
    d = tmp_path / name
    d.mkdir()
    (d / "m.toml").write_text(manifest_text)
    code = BUILD.format(preamble=preamble, root=str(root))
    p = subprocess.run([sys.executable, "-c", code, "m.toml", "work", str(jobs)], cwd=d, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _other_checkout(tmp_path):
    """A copy of the checkout with untracked entries at its root and in the package, and one more
    family registered (its spec preloads a large cudnn module)."""
    import shutil

    root = tmp_path / "checkout"
    for top in ("dsa_aot", "kernels"):
        shutil.copytree(ROOT / top, root / top, ignore=shutil.ignore_patterns("_generated", "__pycache__"))
    for junk in (".venv", ".cache/aot", "_build", "dist", "dsa_aot/_generated/entries"):
        (root / junk).mkdir(parents=True)
    reg = root / "dsa_aot/policy/families.py"
    reg.write_text(reg.read_text().replace("FAMILIES = {\n", 'FAMILIES = {\n    "zz_extra": Family("dsa", CUDNN),\n'))
    (root / "dsa_aot/policy/zz_extra.py").write_text("OPS = {}\n")
    (root / "kernels/zz_extra.py").write_text('from dsa_aot.policy.zz_extra import OPS  # noqa: F401\n'
                                              'PRELOAD = ("cudnn.deepseek_sparse_attention.sparse_attention_backward._interface_sm100",)\n')
    return root


def test_an_affected_entry_compiles_to_one_cubin_whatever_process_builds_it(tmp_path):
    """Two builds in fresh processes: different PIDs, working directories, imports before the build
    (torch and cudnn's kernel modules first in one), manifests (another family's entries before it in
    one), worker counts and checkouts (untracked entries and one more registered family in one). The
    two-CTA entries' cubins are the same (the D576 one changed with each of the last two, before)."""
    a = _build(tmp_path, "a", TARGET + TWO_CTA + D576, jobs=1)
    b = _build(tmp_path, "b", TARGET + BEFORE + TWO_CTA + D576, jobs=2, root=_other_checkout(tmp_path),
               preamble="import torch\nimport cudnn.deepseek_sparse_attention.sparse_attention_backward._interface_sm100")
    assert a[NAME] == b[NAME] and a[NAME576] == b[NAME576], (a, b)
    assert len(b) == 4


def test_a_failing_compile_is_reported_with_its_entry(tmp_path):
    from dsa_aot.toolchain.zygote import Zygote

    with Zygote("sm_100a", "csa_compressor") as z:
        z.submit({"family": "csa_compressor", "op": "no_such_op", "key": (("d", 64),), "arch": "sm_100a", "sm_count": 148})
        z.submit({"family": "csa_compressor", "op": "dape_reduce", "key": (("split", False),), "arch": "sm_100a", "sm_count": 148})
        got = dict(z.wait_one() for _ in range(2))
    assert "KeyError" in got[1]["error"]
    assert "error" not in got[2] and got[2]["cubin"][:4] == b"\x7fELF"


def test_the_zygote_runs_without_address_space_randomisation_and_with_a_fixed_hash_seed(tmp_path):
    """The two settings the canonical state rests on, read inside a compile process."""
    from dsa_aot.toolchain import zygote

    probe = tmp_path / "probe.json"
    with zygote.Zygote("sm_100a", "csa_compressor") as z:
        boot = z.proc.args[-1]
    assert "site.addsitedir" in boot and zygote.canonical_dir().name in boot
    code = ("import json, os, sys; p = open('/proc/self/personality').read().strip(); "
            f"json.dump({{'personality': p, 'seed': os.environ.get('PYTHONHASHSEED'), 'path': sys.path[0]}}, open({str(probe)!r}, 'w'))")
    env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"}
    subprocess.run([sys.executable, "-S", "-c", code], env=env, preexec_fn=zygote._no_aslr, check=True)
    got = json.loads(probe.read_text())
    assert int(got["personality"], 16) & 0x0040000 and got["seed"] == "0"


def test_a_compile_process_holds_its_own_family_and_not_the_registry():
    """Registering a family must not change the heap another family's compiles start from (it did, when
    one zygote served every family: 37 two-CTA cubins changed). So a compile process, ready to compile
    or to run cudnn's route, has imported its family's policy and nothing of the registry or the others."""
    from dsa_aot.policy.families import FAMILIES
    from dsa_aot.toolchain.zygote import Zygote

    for family in ("csa_compressor", "dsa_indexer_backward"):
        with Zygote("sm_90a", family) as z:
            z.submit({"family": family, "op": "", "key": (), "arch": "sm_90a", "sm_count": 132, "task": "modules"})
            _, mods = z.wait_one()
            with pytest.raises(Exception, match="request sent to"):
                z.submit({"family": "csa_compressor" if family != "csa_compressor" else "dsa_indexer_backward", "arch": "sm_90a"})
        assert f"dsa_aot.policy.{family}" in mods and "dsa_aot.toolchain.compile" in mods and "dsa_aot.toolchain.fidelity" in mods
        assert "dsa_aot.policy.families" not in mods
        others = {f for f in FAMILIES if f != family}
        assert not [m for m in mods if any(m == f"dsa_aot.policy.{o}" for o in others)], family


def test_an_unregistered_family_gets_no_zygote():
    from dsa_aot.errors import CompileError
    from dsa_aot.toolchain.zygote import Zygote

    with pytest.raises(CompileError, match="unknown kernel family 'nope'"):
        Zygote("sm_90a", "nope")


def test_a_compile_process_not_yet_handed_to_the_build_is_waited_for_not_an_error(tmp_path):
    """The compile process becomes the build's child only when the zygote's child that forked it has
    exited. A build once stopped with ECHILD from waitpid in that gap; here the forking child lingers
    1.5 s: the compile process is 'running' (not an error) before and after it finishes, and then
    reaped once it is handed over."""
    code = f"""
import os, sys, time
sys.path.insert(0, {str(ROOT)!r})
from dsa_aot.toolchain import zygote
zygote._become_subreaper()
r, w = os.pipe()
out_r, out_w = os.pipe()
if os.fork() == 0:
    c = os.fork()
    if c == 0:
        os.read(r, 1)
        os._exit(0)
    os.write(out_w, f"{{c}}\\n".encode())
    time.sleep(1.5)
    os._exit(0)
c = int(os.read(out_r, 64).decode())
try:
    os.waitpid(c, os.WNOHANG)
    raise SystemExit("expected ECHILD: the compile process is not ours yet")
except ChildProcessError:
    pass
assert zygote._reaped(c, block=False) is False  # running, not ours yet
os.write(w, b"x")
time.sleep(0.2)
assert zygote._reaped(c, block=False) is False  # exited, but still its forking parent's zombie
t = time.monotonic()
assert zygote._reaped(c, block=True) is True
assert time.monotonic() - t > 0.5  # it waited for the hand-over
try:
    os.kill(c, 0)
    raise SystemExit("the compile process was not reaped")
except ProcessLookupError:
    pass
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr
