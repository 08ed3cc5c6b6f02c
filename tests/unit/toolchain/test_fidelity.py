"""dsa_aot.toolchain.fidelity on the CPU: a spec-built cubin equals the one cudnn's own JIT path builds, and a tampered one is caught."""

import contextlib
import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("cutlass")  # the build toolchain: installed by ci/setup.sh
pytest.importorskip("cudnn")

from dsa_aot.toolchain import compile as compile_stage  # noqa: E402
from dsa_aot.toolchain import fidelity, manifest  # noqa: E402
from build_files import SMALL_MANIFEST as SMALL  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
PROGRESS = io.StringIO()  # what the fixture's check printed to stderr



def _id(d):
    return json.loads((d / "meta.json").read_text())["id"]


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    work = tmp_path_factory.mktemp("fidelity")
    res = compile_stage.compile_entries(manifest.loads(SMALL).entries, work / "w", jobs=2, progress=False)
    dsa = next(r.dir for r in res if r.entry.family == "dsa_indexer_backward")
    sab = next(r.dir for r in res if r.entry.family == "dsa_sparse_attention_backward")
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
    # both DSA checks in one worker: one DSL + cudnn import (the SM90 entry gets a worker of its own arch)
    with contextlib.redirect_stderr(PROGRESS):
        res = fidelity.check([dsa, bad, csa, sab], jobs=1, progress=True)
    return dsa, bad, csa, sab, res


def test_spec_cubin_is_identical_to_cudnns_jit_path(entries):
    dsa, _, _, _, res = entries
    r = res[_id(dsa)]
    assert r["verdict"] == "identical", r
    assert r["upstream_sha256"] == r["shipped_sha256"]
    # upstream's own options and cache key were used (not our spec's)
    assert r["options"] == "--enable-tvm-ffi --gpu-arch sm_100a --opt-level 2"
    assert "96" in r["upstream_key"] and "float32" in r["upstream_key"]
    assert not (dsa / fidelity.UPSTREAM_CUBIN).exists()


def test_sm90_sparse_backward_postprocess_is_identical(entries):
    _, _, _, sab, res = entries
    r = res[_id(sab)]
    assert r["verdict"] == "identical", r
    assert r["upstream_sha256"] == r["shipped_sha256"]
    # flash_attn_bwd_sm90's own options and compile_cache_post key: (dtype, hdim_chunk, tile_n, D, threads, chunks)
    assert r["options"] == "--enable-tvm-ffi"
    assert r["upstream_key"].endswith("BFloat16'>, 64, 64, 576, 64, 9)"), r["upstream_key"]


def test_tampered_cubin_differs_and_fails_closed(entries):
    dsa, bad, _, _, res = entries
    r = res[_id(bad)]
    assert r["verdict"] == "differs", r
    assert r["upstream_sha256"] == res[_id(dsa)]["upstream_sha256"]
    assert (bad / fidelity.UPSTREAM_CUBIN).read_bytes() == (dsa / "kernel.cubin").read_bytes()
    # it took the second look (both routes again in a worker, the spec's compile again): its stage cost counts them
    assert r["check_seconds"] > r["seconds"] > 0 and "check_seconds" not in res[_id(dsa)], r
    with pytest.raises(fidelity.FidelityError, match="tampered: differs"):
        fidelity.require_identical(res)
    fidelity.require_identical({k: v for k, v in res.items() if not k.endswith(".tampered")})


def test_the_second_look_prints_each_entry_as_its_parts_finish(entries):
    """The second look's verdicts come only when all its parts are done (about 100 s an entry): until stop 28 a
    build printed nothing meanwhile, an hour for the default manifest's sm_103a entries. Now a line per part."""
    _, bad, _, _, res = entries
    lines = PROGRESS.getvalue().splitlines()
    tampered = _id(bad)
    assert any(l.startswith("fidelity: second look at 1 entries") for l in lines), lines
    for part in ("PTX of both routes", "spec's cubin again"):
        assert any(l.startswith(f"fidelity second look 1/1 {tampered} {part} (") for l in lines), (part, lines)
    # its PTX differs from cudnn's (a flipped code byte is not another register assignment): no third look
    assert not any("cudnn's route again" in l for l in lines), lines
    # and its verdict's line comes after them, once
    assert [l for l in lines if l.startswith("fidelity ") and tampered in l][-1].endswith("differs (second look)"), lines
    assert sum(f" {tampered} " in l for l in lines) == 3, lines  # two parts, the verdict (the first look: no line)


def test_csa_entry_is_identical_through_cudnns_launch_functions(entries):
    """The CSA route runs cudnn's run_bwd (deterministic, so it reaches the reduction): only the
    reduction's own compile is recorded, under cudnn's key ("dape_reduce", split, device)."""
    _, _, csa, _, res = entries
    r = res[_id(csa)]
    assert r["verdict"] == "identical", r
    assert r["upstream_key"] == "('dape_reduce', False, 0)" and r["options"] is None


def test_the_cli_checks_without_writing(entries, tmp_path, capsys):
    """`python -m dsa_aot fidelity --no-write` (check with adopt=False: it crashed on the keyword until stop 26):
    the verdict printed, exit status 0, and no fidelity.json next to the entry."""
    from dsa_aot.toolchain import cli

    _, _, csa, _, _ = entries
    d = tmp_path / "csa"
    shutil.copytree(csa, d)
    (d / "fidelity.json").unlink(missing_ok=True)
    assert cli.main(["fidelity", "--no-write", "-j", "1", str(d)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("identical") and _id(d) in out, out
    assert not (d / "fidelity.json").exists()

def test_arch_cudnn_never_targets_is_not_applicable_and_a_missing_route_fails_closed(entries, tmp_path):
    _, _, csa, _, _ = entries
    d = tmp_path / "sm100f"
    shutil.copytree(csa, d)
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps(meta | {"id": "x.sm_100f", "arch": "sm_100f"}))
    e = tmp_path / "noroute"
    shutil.copytree(csa, e)
    (e / "meta.json").write_text(json.dumps(meta | {"id": "y", "op": "no_such_op"}))
    res = fidelity.check([d, e], jobs=1)
    assert res["x.sm_100f"]["verdict"] == "not applicable" and "never targets sm_100f" in res["x.sm_100f"]["note"]
    assert res["y"]["verdict"] == "error" and "no fidelity route for op 'no_such_op'" in res["y"]["note"]
    with pytest.raises(fidelity.FidelityError, match="no fidelity route"):
        fidelity.require_identical(res)


def test_verdicts_round_trip_through_entry_dirs(entries):
    dsa, bad, csa, sab, res = entries
    fidelity.write_verdicts(res, [dsa, bad, csa, sab])
    assert fidelity.load_verdicts([dsa, bad, csa, sab]) == res


def _code_and_data_offsets(cubin):
    from dsa_aot.toolchain.cubin import _parse_elf

    secs = _parse_elf(cubin)[2]
    code = next(s for s in secs if s.name.startswith(".text.") and s.size)
    data = next(s for s in secs if s.name.startswith(".nv.info.") and s.size)
    return code.offset + code.size // 2, data.offset + data.size // 2


class _Done:
    def __init__(self, art=None, exc=None):
        self.art, self.exc = art, exc

    def result(self):
        if self.exc:
            raise self.exc
        return self.art


def test_second_look_without_compiling(entries, tmp_path):
    """The verdict of the second look on synthetic results: equal PTX and options, the shipped cubin made
    again byte for byte, and the same program (code bytes aside) is "ptx identical"; a difference outside
    the code, in the PTX or the options, or a shipped cubin the compile stage does not make, is "differs"."""
    _, _, _, sab, _ = entries
    shipped = (sab / "kernel.cubin").read_bytes()
    in_code, in_data = _code_and_data_offsets(shipped)

    def verdict(upstream_cubin, spec_ptx="// PTX\n.version 9.4\n.target sm_100a\n", again=shipped, spec_options=None):
        d = tmp_path / "e"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        (d / "kernel.cubin").write_bytes(shipped)
        (d / "meta.json").write_text(json.dumps({"id": "fam.op.k.sm_100a", "arch": "sm_100a"}))
        art = {"cubin": upstream_cubin, "ptx": "// PTX\n.version 9.4\n.target sm_100a\n", "spec_ptx": spec_ptx, "spec_cubin": upstream_cubin,
               "options": "--enable-tvm-ffi --gpu-arch sm_100a", "spec_options": spec_options}
        first = {"verdict": "differs", "note": "first look", "second_look": True, "shipped_sha256": hashlib.sha256(shipped).hexdigest(),
                 "upstream_sha256": hashlib.sha256(upstream_cubin).hexdigest()}
        return fidelity._ptx_verdict(_Done(art), d, first, {"cubin": again}), d

    def flip(at):
        c = bytearray(shipped)
        c[at] ^= 0x02
        return bytes(c)

    r, _ = verdict(flip(in_code))  # another register assignment: a register number changed in a kernel's code
    assert r["verdict"] == "ptx identical" and "1 bytes differ, all in the code of" in r["note"] and "second_look" not in r, r
    r, d = verdict(flip(in_data))  # not explained by the PTX compiler's register assignment
    assert r["verdict"] == "differs" and "not the same program" in r["note"], r
    r, d = verdict(flip(in_code), spec_ptx="// PTX\n.version 9.4\n.target sm_90a\n")
    assert r["verdict"] == "differs" and "line 3" in r["note"], r
    assert (d / fidelity.SPEC_PTX).is_file() and (d / fidelity.UPSTREAM_PTX).is_file()
    r, _ = verdict(flip(in_code), again=flip(in_code))  # a shipped cubin the compile stage does not make (a damaged file)
    assert r["verdict"] == "differs" and "does not give the shipped cubin" in r["note"], r
    r, _ = verdict(flip(in_code), spec_options="--opt-level 3")
    assert r["verdict"] == "differs" and "'--opt-level 3'" in r["note"], r
    fidelity.require_identical({"a": {"verdict": "ptx identical", "note": ""}})


def test_an_entry_ships_cudnns_cubin_only_when_cudnns_route_makes_it_again(entries, tmp_path):
    """The third look: after a passing second look ("ptx identical"), an entry ships upstream's cubin (kernel.cubin
    and the host module's fatbin; lift+verify passes on it again) only when cudnn's route, run once more, makes
    the same bytes; a route that makes other bytes or fails is "differs" and changes nothing. The adopted verdict
    is remembered with its cubin and a cache hit ships it again."""
    from dsa_aot.toolchain.build import lift_and_verify
    from dsa_aot.toolchain.compile import _embedded_cubin

    _, _, _, sab, _ = entries
    spec = (sab / "kernel.cubin").read_bytes()
    up = bytearray(spec)
    up[_code_and_data_offsets(spec)[0]] ^= 0x02  # another register assignment
    up = bytes(up)
    ssha, usha = hashlib.sha256(spec).hexdigest(), hashlib.sha256(up).hexdigest()
    second = {"verdict": "ptx identical", "note": "second look", "shipped_sha256": ssha, "upstream_sha256": usha, "ptx_sha256": "p" * 64}

    def entry(name):
        d = tmp_path / name
        shutil.copytree(sab, d)
        (d / fidelity.UPSTREAM_CUBIN).write_bytes(up)
        (d / "verify.json").write_text('{"verdict": "ok"}')  # the spec cubin's lifter checks (the fixture compiled only)
        return d

    for name, fut, why in (("other", _Done({"cubin": spec}), "made two cubins"), ("fails", _Done(exc=RuntimeError("boom")), "boom")):
        d = entry(name)
        r = fidelity._adopt(fut, d, second)
        assert r["verdict"] == "differs" and why in r["note"] and not r.get("adopted"), r
        assert (d / "kernel.cubin").read_bytes() == spec and (d / "host.mlir").read_text() == (sab / "host.mlir").read_text()
        assert (d / "verify.json").is_file() and not (d / fidelity.SPEC_CUBIN).exists()
    d = entry("adopted")
    r = fidelity._adopt(_Done({"cubin": up}), d, second)
    assert r["verdict"] == "identical" and r["adopted"] and r["shipped_sha256"] == usha and r["spec_sha256"] == ssha, r
    assert (d / "kernel.cubin").read_bytes() == up and _embedded_cubin((d / "host.mlir").read_text()) == up
    assert (d / fidelity.SPEC_CUBIN).read_bytes() == spec and not (d / fidelity.UPSTREAM_CUBIN).exists()
    assert not (d / "verify.json").exists()  # nothing packs it before lift+verify has run on the new cubin
    assert lift_and_verify(d)["verdict"] == "ok"
    # remembered with its cubin; a hit on a fresh copy of the spec's entry ships it again
    hit = tmp_path / "cache" / "k.json"
    fidelity._finish({}, (d, {"id": "x"}, ssha, hit), r)
    again = tmp_path / "again"
    shutil.copytree(sab, again)
    assert fidelity._from_cache(hit, again) == r | {"cached": True}
    assert (again / "kernel.cubin").read_bytes() == up and _embedded_cubin((again / "host.mlir").read_text()) == up
    hit.with_suffix(".cubin").write_bytes(spec)  # not the cubin the verdict names: checked again, not shipped
    fresh = tmp_path / "fresh"
    shutil.copytree(sab, fresh)
    assert fidelity._from_cache(hit, fresh) is None and (fresh / "kernel.cubin").read_bytes() == spec
    with pytest.raises(fidelity.FidelityError, match="same size"):
        fidelity._splice_cubin((sab / "host.mlir").read_text(), spec, up + b"\0")


def test_every_sm100_sparse_entry_has_a_shape_that_makes_upstream_select_it():
    """The fidelity route prepares upstream's plan at one (S_q, S_kv) per key: one must exist for every
    shipped SM100 sparse-backward key (else its verdict would be an error after a long build)."""
    from dsa_aot.policy.dsa_sparse_attention_backward import sm100_shape

    m = manifest.load(ROOT / "manifests" / "default.toml")
    n = 0
    for e in m.entries:
        if e.family == "dsa_sparse_attention_backward" and e.op in ("bwd", "bwd_d576"):
            sm100_shape(e.op, dict(e.key), e.target.sm_count)
            n += 1
    assert n > 200


def test_a_verdict_is_cached_per_canonical_directory(monkeypatch):
    """cudnn's route can make another cubin of a layout-sensitive kernel under another canonical directory:
    a verdict (and an adopted cubin) cached under AOT_CANONICAL_DIR must not serve a build at the default."""
    from dsa_aot.toolchain import fidelity

    meta = {"family": "dsa_sparse_attention_backward", "op": "bwd", "arch": "sm_100a", "target": {"sm_count": 148}}
    args = (meta, {"heads": 128}, "ab" * 32, {"nvidia-cutlass-dsl": "4.8.1"}, "stage", "spec")
    monkeypatch.delenv("AOT_CANONICAL_DIR", raising=False)
    base = fidelity._verdict_key(*args)
    assert fidelity._verdict_key(*args) == base
    monkeypatch.setenv("AOT_CANONICAL_DIR", "/tmp/dsa-aot-canonical-elsewhere")
    assert fidelity._verdict_key(*args) != base
