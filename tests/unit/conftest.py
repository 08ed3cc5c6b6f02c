"""Fixtures the unit tests share: small builds made from the entries in tests/data (no GPU, no toolchain run)."""

import hashlib
import json
import os
from pathlib import Path

import pytest
from build_files import lifted_entries, write_build

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
CSA_ENTRY = "csa_compressor.dape_reduce.split.sm_90a"


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """Each test its own dsa_aot/runtime/cache.py directory: a member kept by one test's build would stand in
    for another test's tampered group (the same sha256), and the tamper tests would not reach the group."""
    d = tmp_path_factory.mktemp("aot-cache")
    monkeypatch.setenv("AOT_CACHE", str(d))
    return d


@pytest.fixture
def one_entry_build(tmp_path):
    """A build directory holding the CSA dAPE-reduce entry of tests/data (its launcher lifted here): (Index, entry)."""
    from dsa_aot.runtime.index import Index
    from dsa_aot.toolchain import lift

    src = DATA / CSA_ENTRY
    meta = json.loads((src / "meta.json").read_text())
    cubin = (src / "kernel.cubin").read_bytes()
    sha = hashlib.sha256(cubin).hexdigest()
    launcher = lift.lift((src / "host.mlir").read_text(), meta["host_function"]).encode()
    from dsa_aot.toolchain.cubin import read_cubin

    kernels = read_cubin(cubin).kernels
    entry = {"id": CSA_ENTRY, "family": "csa_compressor", "op": "dape_reduce", "key": {"split": True}, "arch": "sm_90a",
             "sha256": sha, "launcher_sha256": hashlib.sha256(launcher).hexdigest(),
             "kernels": [k.name for k in kernels], "params": {k.name: [p.size for p in k.params] for k in kernels}}
    write_build(tmp_path, [entry], {sha: cubin, entry["launcher_sha256"]: launcher})
    entry = Index(tmp_path).entries[0]  # with the groups that hold its cubin and launcher
    return Index(tmp_path), entry


@pytest.fixture
def packed(tmp_path):
    """packed(name, ...) -> Index of a build made by the real stages (lift, verify, pack) from tests/data/<name>, ...
    (the build directory: ``tmp_path / "gen"``)."""
    from dsa_aot.runtime.index import Index
    from dsa_aot.toolchain import pack

    def make(*names):
        pack.pack(lifted_entries(tmp_path, names), tmp_path / "gen")
        return Index(tmp_path / "gen")

    return make


def check_sm100_calls_module():
    """ci/check_sm100_calls.py, loaded by path (the offline check of the SM100 sparse-backward call)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_sm100_calls", ROOT / "ci" / "check_sm100_calls.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def sm100_calls():
    return check_sm100_calls_module()


SMALL_BUILD = """
[[target]]
name = "h200"
arch = "sm_90a"
sm_count = 132
[[bucket]]
family = "csa_compressor"
op = "fwd"
ratio = 4
coff = 2
d = 128
[[bucket]]
family = "csa_compressor"
op = "bwd"
ratio = 4
coff = 2
d = 128
deterministic = [false, true]
[[bucket]]
family = "csa_compressor"
op = "dape_reduce"
split = true
[[bucket]]
family = "dsa_indexer_backward"
op = "score_grad_sm90"
topk = 128
[[bucket]]
family = "dsa_indexer_backward"
op = "gemm_sm90"
heads = 64
topk = 128
topk_global = false
[[bucket]]
family = "dsa_sparse_attention_backward"
op = "pre_sm90"
dtype = "bf16"
[[bucket]]
family = "dsa_sparse_attention_backward"
op = "main_sm90"
dtype = "bf16"
heads = 64
dim = 512
topk = 128
topk_length = false
[[bucket]]
family = "dsa_sparse_attention_backward"
op = "post_sm90"
dtype = "bf16"
dim = 512
[[bucket]]
family = "dsa_topk_utils"
op = "local_to_global"
dtype = ["int32", "int64"]
varlen = [false, true]
preserve_negative = false
[[bucket]]
family = "dsa_topk_utils"
op = "compactify"
cols = 128
[[bucket]]
family = "dsa_indexer_top_k"
op = "top_k"
dtype = "float32"
cols = 4096
top_k = 128
next_n = 1
return_val = true
tie_break = 0
deterministic = false
large = false
[[bucket]]
family = "dsa_indexer_forward"
op = "fwd_sm90"
precision = "bf16"
w_dtype = "bfloat16"
heads = 64
ratio = 4
varlen = false
offsets = false
lse = true
unchecked = false
masked = false
[[bucket]]
family = "dsa_dense_indexer_backward"
op = "score_grad_sm90"
varlen = [false, true]
ratio = 4
offsets = false
[[bucket]]
family = "dsa_dense_indexer_backward"
op = "gemm_sm90"
heads = 64
varlen = [false, true]
ratio = 4
offsets = false
[[bucket]]
family = "dsa_score_recompute"
op = "sparse_indexer_sm90"
heads = 64
topk = 512
length = [false, true]
topk_global = false
[[bucket]]
family = "dsa_score_recompute"
op = "sparse_attention_sm90"
heads = 64
dim = 512
topk = 512
length = [false, true]
topk_global = false
[[bucket]]
family = "dsa_score_recompute"
op = "dense_indexer_sm90"
heads = 64
ratio = 4
offsets = [false, true]
scale = 1.0
[[bucket]]
family = "dsa_score_recompute"
op = "dense_attention_sm90"
heads = 64
dim = 512
ratio = 4
offsets = false
"""


SM100_BUILD = """
[[target]]
name = "b200"
arch = "sm_100a"
sm_count = 148
[[bucket]]
family = "dsa_indexer_forward"
op = "fwd_sm100"
precision = "bf16"
w_dtype = "bfloat16"
heads = 64
ratio = 4
varlen = false
offsets = false
[[bucket]]
family = "dsa_sparse_attention_forward"
op = "fwd"
heads = 64
dim = 512
dtype = "bf16"
indexer_topk = 512
sink = true
topk_length = false
[[bucket]]
family = "dsa_sparse_attention_forward"
op = "fwd"
heads = 64
dim = 512
dtype = "bf16"
indexer_topk = 0
sink = true
topk_length = [false, true]
[[bucket]]
family = "dsa_topk_utils"
op = "compactify"
cols = 128
[[bucket]]
family = "dsa_indexer_forward_top_k"
op = "gemm"
precision = "bf16"
w_dtype = "bfloat16"
heads = 64
ratio = 4
lse = false
cand = "2d"
varlen = false
offsets = false
[[bucket]]
family = "dsa_indexer_forward_top_k"
op = "gemm"
precision = "bf16"
w_dtype = "bfloat16"
heads = 64
ratio = 4
lse = false
cand = "1d_cbo"
varlen = [false, true]
offsets = true
[[bucket]]
family = "dsa_indexer_forward_top_k"
op = "gemm"
precision = "bf16"
w_dtype = "bfloat16"
heads = 64
ratio = 4
lse = false
cand = "1d_cbo"
varlen = true
offsets = false
[[bucket]]
family = "dsa_indexer_forward_top_k"
op = "stage2"
top_k = 512
ratio = 4
threads = 256
offsets = [false, true]
softmax = true
deterministic = false
varlen = [false, true]
[[bucket]]
family = "dsa_topk_utils"
op = "local_to_global"
dtype = "int32"
varlen = [false, true]
preserve_negative = true
[[bucket]]
family = "dsa_dense_indexer_backward"
op = "score_grad"
varlen = [false, true]
ratio = 4
offsets = false
[[bucket]]
family = "dsa_dense_indexer_backward"
op = "gemm"
heads = 64
varlen = [false, true]
ratio = 4
offsets = false
[[bucket]]
family = "dsa_score_recompute"
op = "sparse_indexer"
heads = 64
topk = 512
length = [false, true]
topk_global = false
[[bucket]]
family = "dsa_score_recompute"
op = "sparse_attention"
heads = [64, 128]
dim = 512
topk = 512
length = false
topk_global = false
[[bucket]]
family = "dsa_score_recompute"
op = "sparse_attention"
heads = 64
dim = 512
topk = 512
length = true
topk_global = false
[[bucket]]
family = "dsa_score_recompute"
op = "dense_indexer"
precision = ["bf16", "mxfp8", "mxfp4"]
heads = 64
ratio = 4
varlen = [false, true]
offsets = false
[[bucket]]
family = "dsa_score_recompute"
op = "dense_attention"
precision = "bf16"
heads = 64
dim = 512
k_block = 128
ratio = 4
varlen = [false, true]
offsets = false
[[bucket]]
family = "dsa_score_recompute"
op = "dense_attention"
precision = "mxfp8"
heads = 64
dim = 512
k_block = [128, 256]
ratio = 4
varlen = [false, true]
offsets = false
[[bucket]]
family = "dsa_score_recompute"
op = "dense_attention"
precision = "mxfp8"
heads = 64
dim = 128
k_block = 64
ratio = 4
varlen = false
offsets = false
"""


def _real_build(tmp_path_factory, name, manifest, samples):
    """A real build (compile, lift, verify, pack; no fidelity) of ``manifest``: its directory."""
    pytest.importorskip("cutlass")
    from dsa_aot.toolchain import build

    root = tmp_path_factory.mktemp(name)
    (root / "m.toml").write_text(manifest)
    # AOT_TEST_CACHE: a compile cache shared by test sessions (a developer's reruns); unset, every session compiles cold
    cache = os.environ.get("AOT_TEST_CACHE") or None
    build.build(root / "m.toml", root / "gen", root / "work", cache_dir=cache, jobs=2, samples=samples, progress=False, fidelity=False)
    return root / "gen"


@pytest.fixture(scope="session")
def sm100_build(tmp_path_factory):
    """The sm_100a entries of SM100_BUILD: the SM100 indexer forward (bf16 H64 ratio 4), the sparse
    attention forward (H64 D512, a sink: indexer_topk 512; 0 with and without topk_length), compactify (128 columns), the fused
    indexer top-k and local_to_global, the sparse indexer and sparse attention score recompute (H64 top-k 512 with and
    without topk_length; H128 D512, where upstream drops topk_length), the dense indexer score recompute (H64 ratio 4, BSHD and
    THD, bf16 and the block-scaled mxfp8 / mxfp4), the dense attention's (H64 ratio 4: bf16 D512, BSHD and THD; mxfp8 D512 in both
    S_k buckets, BSHD and THD, and D128 BSHD). No SM100 GPU here: the ops' SM100 paths run on it with a
    stand-in capability-10.0 driver, their launches through the real lifted host functions."""
    return _real_build(tmp_path_factory, "sm100_build", SM100_BUILD, 20)


@pytest.fixture(scope="session")
def small_build(tmp_path_factory):
    """The SMALL_BUILD entries (a real build, as _real_build makes it), one sm_90a entry set per op family:
    CSA forward and backward (ratio 4, d 128), the SM90 indexer backward (H64, top-k 128), the SM90
    sparse attention backward (H64, D512, top-k 128), local_to_global (both dtypes, both layouts),
    compactify (128 columns), the indexer top-k (fp32, 4096-column bucket, top-k 128) and the SM90 indexer
    forward (bf16 H64 ratio 4 with LSE), the SM90 dense indexer backward (H64 ratio 4, BSHD and THD), the SM90 sparse indexer and attention score
    recompute (H64, top-k 512, D512 for the attention, with and without topk_length). Its directory."""
    return _real_build(tmp_path_factory, "small_build", SMALL_BUILD, 50)
