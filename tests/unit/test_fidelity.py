"""aot.fidelity on the CPU: a spec-built cubin equals the one cudnn's own JIT path builds, and a tampered one is caught."""

import json
import shutil

import pytest

pytest.importorskip("cutlass")  # the build toolchain: installed by ci/setup.sh
pytest.importorskip("cudnn")

from aot import compile as compile_stage  # noqa: E402
from aot import fidelity, manifest  # noqa: E402

# one cheap entry (~0.3 s per compile): the deterministic dK reduction, and one entry without an upstream route
SMALL = """
[[target]]
name = "b200"
arch = "sm_100a"
sm_count = 148
[[bucket]]
family = "dsa_indexer_backward"
op = "reduce_dk"
out = "f32"
planes = 96
[[bucket]]
family = "csa_compressor"
op = "dape_reduce"
split = false
"""


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    work = tmp_path_factory.mktemp("fidelity")
    res = compile_stage.compile_entries(manifest.loads(SMALL).entries, work / "w", jobs=2, progress=False)
    dsa = next(r.dir for r in res if r.entry.family == "dsa_indexer_backward")
    csa = next(r.dir for r in res if r.entry.family == "csa_compressor")
    # a copy of the DSA entry whose shipped cubin has one byte flipped (inside the ELF, past the header)
    bad = work / "w" / "entries" / "tampered"
    shutil.copytree(dsa, bad)
    meta = json.loads((bad / "meta.json").read_text())
    meta["id"] += ".tampered"
    (bad / "meta.json").write_text(json.dumps(meta))
    cubin = bytearray((bad / "kernel.cubin").read_bytes())
    cubin[len(cubin) // 2] ^= 0xFF
    (bad / "kernel.cubin").write_bytes(bytes(cubin))
    # both DSA checks in one worker: one DSL + cudnn import
    return dsa, bad, csa, fidelity.check([dsa, bad, csa], jobs=1)


def test_spec_cubin_is_identical_to_cudnns_jit_path(entries):
    dsa, _, _, res = entries
    r = res[json.loads((dsa / "meta.json").read_text())["id"]]
    assert r["verdict"] == "identical", r
    assert r["upstream_sha256"] == r["shipped_sha256"]
    # upstream's own options and cache key were used (not our spec's)
    assert r["options"] == "--enable-tvm-ffi --gpu-arch sm_100a --opt-level 2"
    assert "96" in r["upstream_key"] and "float32" in r["upstream_key"]
    assert not (dsa / fidelity.UPSTREAM_CUBIN).exists()


def test_tampered_cubin_differs_and_fails_closed(entries):
    dsa, bad, _, res = entries
    r = res[json.loads((bad / "meta.json").read_text())["id"]]
    assert r["verdict"] == "differs", r
    assert r["upstream_sha256"] == res[json.loads((dsa / "meta.json").read_text())["id"]]["upstream_sha256"]
    assert (bad / fidelity.UPSTREAM_CUBIN).read_bytes() == (dsa / "kernel.cubin").read_bytes()
    with pytest.raises(fidelity.FidelityError, match="tampered: differs"):
        fidelity.require_identical(res)
    fidelity.require_identical({k: v for k, v in res.items() if not k.endswith(".tampered")})


def test_family_without_upstream_route_is_not_applicable(entries):
    _, _, csa, res = entries
    r = res[json.loads((csa / "meta.json").read_text())["id"]]
    assert r["verdict"] == "not applicable" and "cute.jit" in r["note"]


def test_verdicts_round_trip_through_entry_dirs(entries):
    dsa, bad, csa, res = entries
    fidelity.write_verdicts(res, [dsa, bad, csa])
    assert fidelity.load_verdicts([dsa, bad, csa]) == res
