"""The runtime's checks that need no GPU: import hygiene, index lookups, corrupted cubins, bad inputs."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aot.errors import ArchMismatchError, InputError, KernelNotFoundError, LaunchError
from aot.runtime import registry

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
ENTRY = "csa_compressor.dape_reduce.split.sm_90a"

BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('cutlass', 'cudnn', 'tvm_ffi', 'torch'):
            raise ImportError('blocked ' + name)
sys.meta_path.insert(0, Block())
"""


def test_runtime_imports_no_toolchain_and_does_nothing_at_import():
    code = BLOCK + """
import aot, aot.runtime, aot.runtime.registry, aot.runtime.driver, aot.csa, aot.dsa
assert not any(m.split('.')[0] in ('cutlass', 'cudnn', 'tvm_ffi', 'torch', 'cuda') for m in sys.modules), sorted(sys.modules)
assert aot.runtime.registry._INDEX is None
print('ok')
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def make_build(tmp_path, arch="sm_90a"):
    from aot import lift

    src = DATA / ENTRY
    meta = json.loads((src / "meta.json").read_text())
    (tmp_path / "cubins").mkdir()
    (tmp_path / "launchers").mkdir()
    cubin = (src / "kernel.cubin").read_bytes()
    import hashlib

    sha = hashlib.sha256(cubin).hexdigest()
    (tmp_path / "cubins" / f"{sha}.cubin").write_bytes(cubin)
    (tmp_path / "launchers" / "l.py").write_text(lift.lift((src / "host.mlir").read_text(), meta["host_function"]))
    entry = {"id": ENTRY, "family": "csa_compressor", "op": "dape_reduce", "key": {"split": True}, "arch": arch,
             "cubin": f"cubins/{sha}.cubin", "sha256": sha, "launcher": "launchers/l.py"}
    (tmp_path / "index.json").write_text(json.dumps({"format": 1, "entries": [entry]}))
    return registry.Index(tmp_path), entry


def test_find_names_the_manifest_bucket_that_would_cover_a_missing_key(tmp_path):
    ix, entry = make_build(tmp_path)
    assert ix.find("csa_compressor", "dape_reduce", {"split": True}, "sm_90a") == entry
    with pytest.raises(KernelNotFoundError) as ei:
        ix.find("csa_compressor", "fwd", {"ratio": 4, "d": 64, "coff": 2}, "sm_90a")
    msg = str(ei.value)
    assert "[[bucket]]" in msg and "op = 'fwd'" in msg and "d = 64" in msg and "rebuild" in msg
    with pytest.raises(ArchMismatchError, match=r"no cubins for sm_100a \(it has: sm_90a\)"):
        ix.find("csa_compressor", "dape_reduce", {"split": True}, "sm_100a")


def test_missing_build_says_how_to_make_one(tmp_path):
    with pytest.raises(KernelNotFoundError, match="python -m aot build"):
        registry.Index(tmp_path / "nothing")


def test_corrupted_cubin_is_refused_before_the_driver_is_touched(tmp_path):
    ix, entry = make_build(tmp_path)
    p = tmp_path / entry["cubin"]
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(LaunchError, match="corrupted: sha256"):
        registry.LoadedEntry(tmp_path, entry, 0)


def test_cubin_of_another_arch_is_refused(tmp_path):
    ix, entry = make_build(tmp_path, arch="sm_100a")  # index claims sm_100a, the cubin is sm_90a
    with pytest.raises(LaunchError, match="sm_90a"):
        registry.LoadedEntry(tmp_path, entry, 0)


def test_bad_inputs_are_all_reported_before_anything_runs():
    torch = pytest.importorskip("torch")
    import aot.csa

    kv = torch.zeros(256, 256, dtype=torch.float16)[:, ::2]  # wrong dtype, wrong strides, on CPU
    score = torch.zeros(256, 128, dtype=torch.bfloat16)
    ape = torch.zeros(4, 128, dtype=torch.float32)
    cu = torch.tensor([0, 256], dtype=torch.int64)
    cuc = torch.tensor([0, 64], dtype=torch.int32)
    with pytest.raises(InputError) as ei:
        aot.csa.compressor_forward(kv, score, ape, cu, cuc, ratio=4, coff=2, total_comp=64)
    msg = str(ei.value)
    assert "nothing was launched" in msg
    assert "kv: dtype torch.float16 (expected torch.bfloat16)" in msg
    assert "kv: strides" in msg and "contiguous" in msg
    assert "(expected cuda" in msg
    assert "cu_seqlens: dtype torch.int64" in msg
    with pytest.raises(InputError, match="ratio=3"):
        aot.csa.compressor_forward(score, score, ape, cuc, cuc, ratio=3, coff=2, total_comp=0)
    with pytest.raises(InputError, match="head_dim=64 at ratio 128"):
        aot.csa.compressor_forward(score, score, torch.zeros(128, 128), cuc, cuc, ratio=128, coff=2, total_comp=0)


def _indexer_inputs(torch, B=1, S_q=4, S_k=256, H=64, D=128, topk=128, dev="cpu"):
    return dict(
        index_q=torch.zeros(B, S_q, H, D, dtype=torch.bfloat16, device=dev), weights=torch.zeros(B, S_q, H, dtype=torch.bfloat16, device=dev),
        index_k=torch.zeros(B, S_k, D, dtype=torch.bfloat16, device=dev), attn_score=torch.zeros(B, S_q, topk, device=dev),
        index_score=torch.zeros(B, S_q, topk, device=dev), topk_indices=torch.zeros(B, S_q, topk, dtype=torch.int32, device=dev),
        grad_loss=torch.ones(1, device=dev),
    )


def test_indexer_backward_reports_every_bad_input_before_anything_runs():
    torch = pytest.importorskip("torch")
    import aot.dsa

    x = _indexer_inputs(torch, topk=200)
    x["weights"] = x["weights"].float()
    dq, dw, dk = torch.empty_like(x["index_q"]), torch.empty_like(x["weights"]), torch.empty_like(x["index_k"])
    with pytest.raises(InputError) as ei:
        aot.dsa.indexer_backward_into(dq, dw, dk, *x.values(), block_I=64, backend="v3", deterministic_dk_planes=100)
    msg = str(ei.value)
    for want in ("nothing was launched", "backend='v3'", "deterministic_dk_planes=100", "weights: dtype torch.float32", "block_I=64",
                 "topk=200", "(expected cuda"):
        assert want in msg, (want, msg)
    with pytest.raises(InputError, match="4-D"):
        aot.dsa.indexer_backward(x["index_q"][0], *list(x.values())[1:])


def test_indexer_workspace_bytes_equal_upstream_plan():
    """Against cudnn's own IndexerBackward.scratch_workspace_bytes (its plan object needs no GPU)."""
    torch = pytest.importorskip("torch")
    api = pytest.importorskip("cudnn.deepseek_sparse_attention.indexer_backward.api")
    import aot.dsa

    x = _indexer_inputs(torch, B=2, S_q=3, S_k=1000)
    for dk_dtype in (torch.bfloat16, torch.float32):
        for backend in aot.dsa.BACKENDS:
            for det, planes in ((False, 96), (True, 96), (True, 148)):
                dk = torch.empty(2, 1000, 128, dtype=dk_dtype)
                plan = api.IndexerBackward(x["index_q"], x["weights"], x["index_k"], x["index_q"], x["weights"], dk, x["attn_score"],
                                           x["index_score"], x["topk_indices"], backend=backend, deterministic=det, deterministic_dk_planes=planes)
                mine = aot.dsa.indexer_backward_workspace_bytes(2, 1000, 128, d_index_k_dtype=dk_dtype, backend=backend, deterministic=det,
                                                                deterministic_dk_planes=planes)
                assert mine == plan.scratch_workspace_bytes(), (dk_dtype, backend, det, planes)


def test_indexer_dispatch_hits_the_default_manifest_for_every_anchor_shape():
    """The runtime's choice of (op, key) per stage, for the anchor shapes, is an entry the default
    manifest ships (same key fields the spec declares), on both arches."""
    import aot.dsa
    from aot import manifest

    m = manifest.load(ROOT / "manifests" / "default.toml")
    have = {(e.target.arch, e.op, e.key) for e in m.entries if e.family == "dsa_indexer_backward"}
    sms = {t.arch: t.sm_count for t in m.targets}
    calls = []
    for s_q in (4096, 8192):
        for topk in (512, 1024, 1536, 2048):
            for glob in (False, True):
                for dkf32 in (False, True):
                    calls.append(("sm_90a", 64, s_q, topk, dict(topk_indices_global=glob, d_index_k_f32=dkf32)))
                    for h in (32, 64):
                        calls.append(("sm_100a", h, s_q, topk, dict(topk_indices_global=glob, d_index_k_f32=dkf32)))
                for h in (32, 64):
                    calls.append(("sm_100a", h, s_q, topk, dict(deterministic=True, d_index_k_f32=glob)))
                calls.append(("sm_100a", 64, s_q, topk, dict(backend="sm100_v2", d_weights_f32=glob, d_index_k_f32=glob)))
                calls.append(("sm_100a", 64, s_q, topk, dict(backend="sm100_v2", deterministic=True, d_weights_f32=True)))
        for planes in (128, 148):
            calls.append(("sm_100a", 64, s_q, 512, dict(deterministic=True, deterministic_dk_planes=planes)))
    for arch, h, s_q, topk, kw in calls:
        ks = aot.dsa.indexer_backward_kernels(arch, 1, s_q, h, topk, target_sm_count=sms[arch], **kw)
        for role, (op, key) in ks.items():
            assert (arch, op, tuple(sorted(key.items()))) in have, (arch, h, s_q, topk, kw, role, op, key)


def test_lookup_ignores_what_the_spec_derived(tmp_path):
    """index.json keeps the spec's derived fields (grid, persistence, ...) next to the key; the runtime
    looks entries up by the op's own fields."""
    import shutil

    from aot import build, pack

    name = "dsa_indexer_backward.gemm.nodeterministic.heads64.pdl.persistent.planes96.topk512.notopk_global.sm_100a"
    d = tmp_path / "entries" / name
    shutil.copytree(DATA / name, d)
    build.lift_and_verify(d)
    pack.pack([d], tmp_path / "gen")
    ix = registry.Index(tmp_path / "gen")
    e = ix.find("dsa_indexer_backward", "gemm", {"heads": 64, "topk": 512, "topk_global": False, "persistent": True, "pdl": True,
                                                 "deterministic": False, "planes": 96}, "sm_100a")
    assert e["id"] == name and e["key"]["grid"] == 148 and "grid" in e["derived"]
    assert ix.target_sm_count("sm_100a") == 148


def test_sparse_attention_workspace_and_dispatch_match_upstream_and_manifest():
    iface = pytest.importorskip("cudnn.deepseek_sparse_attention.sparse_attention_backward._interface_sm90")
    import aot.dsa
    from aot import manifest

    for s_q, s_kv, d, h in ((1, 1, 512, 64), (77, 1500, 576, 64), (2048, 2048, 512, 128), (4097, 65, 576, 128)):
        assert aot.dsa.sparse_attention_backward_workspace_bytes(s_q, s_kv, d, h) == iface.flash_attn_bwd_sm90_workspace_size(s_q, s_kv, d, h)
    m = manifest.load(ROOT / "manifests" / "default.toml")
    have = {(e.op, e.key) for e in m.entries if e.family == "dsa_sparse_attention_backward" and e.target.arch == "sm_90a"}
    for h in (64, 128):
        for d in (512, 576):
            for topk in (512, 1024, 2048):
                for tl in (False, True):
                    for role, (op, key) in aot.dsa.sparse_attention_backward_kernels("sm_90a", h, d, topk, has_topk_length=tl).items():
                        assert (op, tuple(sorted(key.items()))) in have, (h, d, topk, tl, role)


def test_sparse_attention_reports_every_bad_input_before_anything_runs():
    torch = pytest.importorskip("torch")
    import aot.dsa

    q = torch.zeros(8, 64, 256, dtype=torch.bfloat16)
    kv = torch.zeros(16, 256, dtype=torch.bfloat16)
    out = torch.zeros(8, 64, 512, dtype=torch.float16)
    with pytest.raises(InputError) as ei:
        aot.dsa.sparse_attention_backward_into(q.clone(), kv.clone(), torch.zeros(64), q, kv, out, out, torch.zeros(8, 64), torch.zeros(64),
                                               torch.zeros(8, 100, dtype=torch.int64), block_tile=32, q_cluster_mode="x")
    msg = str(ei.value)
    for want in ("head dim D=256", "out: dtype torch.float16", "topk_idxs: dtype torch.int64", "block_tile=32", "q_cluster_mode='x'", "(expected cuda"):
        assert want in msg, (want, msg)


SHAPES_SM100 = ((1, 4096), (20, 4096), (100, 2048), (100, 1 << 17), (2048, 2048), (2048, 1 << 18), (4096, 8192), (8192, 65536), (4096, 1 << 20),
                (65536, 131072), (131072, 131072))


def test_sparse_attention_sm100_workspace_matches_upstream():
    torch = pytest.importorskip("torch")
    iface = pytest.importorskip("cudnn.deepseek_sparse_attention.sparse_attention_backward._interface_sm100")
    common = pytest.importorskip("cudnn.deepseek_sparse_attention.sparse_attention_backward._interface_sm100_common")
    import aot.dsa

    for s_q, s_kv in SHAPES_SM100:
        for h, d, topk in ((64, 512, 512), (64, 576, 2048), (128, 512, 1024), (128, 576, 512), (128, 576, 640), (16, 576, 512)):
            for det in (False, True):
                backend, _ = iface._select_sm100_backend(h, d, head_dim_v=512, dtype=torch.bfloat16, max_topk=topk, device_capability=(10, 0),
                                                         deterministic=det)
                want = common.flash_attn_bwd_sm100_workspace_size(s_q, s_kv, d, h, det, backend=backend)
                assert aot.dsa.sparse_attention_backward_workspace_bytes(s_q, s_kv, d, h, arch="sm_100a", topk=topk, deterministic=det) == want


def test_sparse_attention_sm100_dispatch_is_in_the_default_manifest():
    """Every production shape, either mode, short and long sequences: the SM100 key the op asks for ships."""
    import aot.dsa
    from aot import manifest

    m = manifest.load(ROOT / "manifests" / "default.toml")
    have = {(e.op, e.key) for e in m.entries if e.family == "dsa_sparse_attention_backward" and e.target.arch == "sm_100a"}
    seen = set()
    for h in (64, 128):
        for d in (512, 576):
            for topk in (512, 1024, 2048):
                for tl in (False, True):
                    for det in (False, True):
                        for s_q, s_kv in SHAPES_SM100:
                            ks = aot.dsa.sparse_attention_backward_kernels("sm_100a", h, d, topk, has_topk_length=tl, deterministic=det, s_q=s_q,
                                                                           s_kv=s_kv, sm_count=148)
                            op, key = ks["bwd"]
                            assert (op, tuple(sorted(key.items()))) in have, (h, d, topk, tl, det, s_q, s_kv, op, key)
                            seen.add((op, key.get("planes"), key.get("relay"), key["wide"], key.get("split"), key.get("single_query")))
    # the grid reaches the layouts the manifest ships for them: wide addressing, every relay, the split regime
    assert {(1, 1, True), (32, 1, True), (32, 4, True), (16, 8, True), (8, 16, True), (128, 1, True), (128, 1, False)} <= {(p, r, w) for op, p, r, w, _, _ in seen if op == "bwd"}
    assert {(True, False), (False, True), (False, False)} <= {(sp, sq) for op, _, _, _, sp, sq in seen if op == "bwd_d576"}


SM100_SPARSE = (
    "dsa_sparse_attention_backward.bwd.nodeterministic.dim512.bf16.heads64.planes1.relay1.topk512.notopk_length.nowide.sm_100a",
    "dsa_sparse_attention_backward.bwd.deterministic.dim512.bf16.heads128.planes128.relay1.topk512.notopk_length.nowide.sm_100a",
)


def _check_sm100_calls():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_sm100_calls", ROOT / "ci" / "check_sm100_calls.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", SM100_SPARSE)
def test_sparse_attention_sm100_call_feeds_the_lifted_host_function(name):
    """No SM100 GPU here: the op's SM100 call runs the real lifted launcher (with the JIT host code's
    own checks) in place of the driver (ci/check_sm100_calls.py, which the wheel build runs over every
    shipped SM100 entry). A call convention that drops an argument or a tensor is caught."""
    import aot.dsa as dsa
    from aot import lift, verify

    chk = _check_sm100_calls()
    d = DATA / name
    meta = json.loads((d / "meta.json").read_text())
    ns = verify.load_launcher(lift.lift((d / "host.mlir").read_text(), meta["host_function"], name, lift.cubin_param_layout((d / "kernel.cubin").read_bytes())))
    key = {k: meta["key"][k] for k in ("dtype", "heads", "dim", "topk", "topk_length", "deterministic", "planes", "relay", "wide")}
    for s_q, s_kv in ((300, 1000), (5000, 3000)):
        assert chk.check_call(ns, meta["op"], key, "sm_100a", 148, s_q, s_kv) == []
    # a call that passes q where kv belongs is caught
    real = dsa._sm100_call
    try:
        dsa._sm100_call = lambda op_key, dev, s_q, s_kv, h, d, topk, q, kv, *rest: real(op_key, dev, s_q, s_kv, h, d, topk, q, q, *rest)
        problems = chk.check_call(ns, meta["op"], key, "sm_100a", 148, 300, 1000)
    finally:
        dsa._sm100_call = real
    assert any("kv" in p.split(" never reach")[0].split(", ") for p in problems), problems


def test_a_site_firing_in_a_loop_launches_each_time_with_its_own_bytes(tmp_path, monkeypatch):
    """The runtime path of loop entries (SM100 only, so no GPU here runs it): LoadedEntry with a
    recording stand-in for the driver's calls (the driver's own types). The H128 deterministic entry
    launches its backward once per wave of S_q; each launch must carry that wave's bytes, in the
    order and with the bytes the lifted launcher emits."""
    pytest.importorskip("cuda.bindings")
    import ctypes
    import types

    from cuda.bindings import driver as real

    import aot.dsa as dsa
    from aot import build, pack, verify

    name = SM100_SPARSE[1]
    d = tmp_path / "entries" / name
    shutil.copytree(DATA / name, d)
    build.lift_and_verify(d)
    pack.pack([d], tmp_path / "gen")
    ix = registry.Index(tmp_path / "gen")
    entry = ix.find("dsa_sparse_attention_backward", "bwd", {"dtype": "bf16", "heads": 128, "dim": 512, "topk": 512, "topk_length": False, "deterministic": True,
                                                 "planes": 128, "relay": 1, "wide": False}, "sm_100a")
    ns = verify.load_launcher((tmp_path / "gen" / entry["launcher"]).read_text())
    sites = {i: L for i, L in enumerate(ns["LAUNCHES"])}
    handles = {}
    launched = []

    def get_kernel(lib, sym):
        handles[sym.decode()] = 0x1000 + len(handles)
        return (0, handles[sym.decode()])

    def launch(cfg, f, addr, extra):
        site = next(i for i, L in sites.items() if handles[L["kernel"]] == int(f))
        ptrs = (ctypes.c_void_p * len(sites[site]["params"])).from_address(addr)
        launched.append((site, b"".join(ctypes.string_at(p, size) for p, (_, size) in zip(ptrs, sites[site]["params"]))))
        return (0,)

    fake = types.SimpleNamespace(
        cuLibraryLoadData=lambda *a: (0, "lib"), cuLibraryGetKernel=get_kernel, cuDeviceGet=lambda dev: (0, 0),
        cuDeviceGetAttribute=lambda attr, dev: (0, 1), cuKernelGetAttribute=lambda attr, k, dev: (0, 0), cuKernelSetAttribute=lambda *a: (0,),
        cuLaunchKernelEx=launch, CUlaunchConfig=real.CUlaunchConfig, CUlaunchAttribute=real.CUlaunchAttribute,
        CUlaunchAttributeID=real.CUlaunchAttributeID, CUfunction=real.CUfunction, CUdevice_attribute=real.CUdevice_attribute,
        CUfunction_attribute=real.CUfunction_attribute,
    )  # fmt: skip
    monkeypatch.setattr(registry, "drv", lambda: fake)
    le = ix.loaded(entry, 0)
    calls = []
    monkeypatch.setattr(dsa, "_launcher_family", lambda family, op, key, dev, hint="": lambda *args: (calls.append(args), le(*args)))
    monkeypatch.setattr(dsa, "_memset0", lambda *a: None)
    monkeypatch.setattr(dsa, "_state", lambda dev: types.SimpleNamespace(arch="sm_100a", sm_count=148))
    chk = _check_sm100_calls()
    t = [chk.Buf(i) for i in range(12)]
    s_q, s_kv = 5000, 3000
    op_key = dsa.sparse_attention_backward_kernels("sm_100a", 128, 512, 512, deterministic=True, s_q=s_q, s_kv=s_kv)["bwd"]
    dsa._sm100_call(op_key, 0, s_q, s_kv, 128, 512, 512, *t[:7], None, *t[8:], 0.5, 7)
    bufs = [bytearray.fromhex(L["template"]) for L in ns["LAUNCHES"]]
    want = []
    ns["launch"](lambda k, dims: want.append((k, b"".join(bytes(bufs[k][o : o + n]) for o, n in sites[k]["params"]))), *bufs, *calls[0])
    assert launched == want
    repeated = {k for k, _ in want if sum(1 for j, _ in want if j == k) > 1}
    assert repeated and any(len({b for j, b in want if j == k}) > 1 for k in repeated)  # one site, several waves, different bytes
