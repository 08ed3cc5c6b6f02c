"""dsa_aot.csa ops (AOT cubins, no JIT) against the float64 reference in ``ref_csa.py``.

Tolerances, per output dtype. Every comparison is against the float64 reference computed from the
same bf16/fp32 inputs (upcasting them is exact), so the only differences are the kernels' own fp32
arithmetic and the final rounding of their outputs.

================  ==========  ===================================================================
output dtype      rel_norm    elementwise bound |got - ref| <= ulps * ulp_bf16(ref)
                                                             + rel_elem * |ref| + floor * rms(ref)
================  ==========  ===================================================================
bf16              5e-3        ulps = 1, rel_elem = 0, floor = 1e-3
 (out, grad_kv,
  grad_score)
fp32 (grad_ape)   1e-4        ulps = 0, rel_elem = 1e-4, floor = 1e-4
================  ==========  ===================================================================

rel_norm is ||got - ref||_2 / ||ref||_2 over the whole tensor.

Why these numbers:

* bf16 outputs are one final rounding of an fp32 value (the kernels' contract: fp32 arithmetic,
  single bf16 rounding). Rounding to bf16 (8 significant bits) moves a value by at most
  u = 2**-8 = 3.9e-3 of itself, so ||bf16(x) - x|| <= 3.9e-3 ||x|| is a hard bound; for random data
  the measured ratio is ~1.7e-3. The fp32 part before rounding is ~1e-5 relative: windows of at
  most 2 * 128 terms give <= 256 * 2**-24 = 1.5e-5, and the ex2.approx "fastexp" buckets of the
  ratio-128 kernels add ~1e-6 per exp. 5e-3 clears the hard bound by 25 %, so a correct kernel
  cannot fail it. Elementwise, a correct result is within half a bf16 ulp of the fp32 value, hence
  within one bf16 ulp of the reference, plus fp32 noise; the floor (1e-3 of the tensor's RMS,
  ~60x the fp32 noise) covers elements where cancellation makes the reference tiny.
  A dropped or duplicated window position moves elements by ~|kv| / window >> 1 ulp and fails the
  elementwise bound even where the norm would hide it.
* grad_ape (fp32) is not rounded to bf16: it is a sum over all real rows of fp32 dScore terms (no
  bf16 rounding inside). Each term carries ~1e-5 relative fp32 error (see above), and the row sum
  (serial per CTA, then atomics or a fixed-order tree) adds ~sqrt(rows) * 2**-24 relative for
  random-sign terms. 1e-4 leaves a >=6x margin over the worst per-term figure and is still 50x
  tighter than the bf16 bound. tests/unit/test_ref_csa.py checks that an fp32-intermediate
  computation passes this table with margin, so the table is not tighter than fp32 allows.

Measured (2026-11-29, H200, this file run against cudnn 1.32.0's own JIT kernels for sm_90a through
a stand-in for dsa_aot.csa, CSA_TEST_VERBOSE=1): bf16 outputs rel_norm 1.53e-3 .. 1.87e-3 over 219
outputs, no elementwise violation; grad_ape 1.3e-7 .. 3.2e-7 over 81 outputs.

NaN never passes: outputs are poisoned with NaN (deterministic workspace with 0xFF bytes) before
each launch, and any NaN left in an output fails the test before the numeric comparison.
Positions no real row consumes must be exact zeros in grad_kv/grad_score.
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

pytestmark = pytest.mark.gpu


import ref_csa  # noqa: E402 - tests/gpu is on sys.path (tests/conftest.py)


# ------------------------------------------------------------------------------------------------
# Tolerance table (see the module docstring for the justification).
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tol:
    rel_norm: float
    ulps: float
    rel_elem: float
    floor: float


TOLERANCES = {
    torch.bfloat16: Tol(rel_norm=5e-3, ulps=1.0, rel_elem=0.0, floor=1e-3),
    torch.float32: Tol(rel_norm=1e-4, ulps=0.0, rel_elem=1e-4, floor=1e-4),
}


def ulp_bf16(ref: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |ref| (0 where ref == 0)."""
    _, e = torch.frexp(ref.abs())  # |ref| = m * 2**e, m in [0.5, 1)
    ulp = torch.pow(2.0, (e - 8).to(ref.dtype))  # bf16 has 8 significant bits: ulp = 2**(e - 8)
    return torch.where(ref == 0, torch.zeros_like(ref), ulp)


def compare(got: torch.Tensor, ref: torch.Tensor, dtype) -> dict:
    """Error report of ``got`` against float64 ``ref`` under TOLERANCES[dtype]."""
    tol = TOLERANCES[dtype]
    g = got.detach().to(torch.float64)
    r = ref.detach().to(device=g.device, dtype=torch.float64)
    report = {"nan": int(torch.isnan(g).sum()), "nonfinite": int((~torch.isfinite(g)).sum()), "ref_nonfinite": int((~torch.isfinite(r)).sum())}
    rnorm = float(r.norm())
    diff = g - r
    report["rel_norm"] = float(diff.norm()) / rnorm if rnorm > 0 else float(diff.norm())
    rms = rnorm / math.sqrt(max(r.numel(), 1))
    bound = tol.ulps * ulp_bf16(r) + tol.rel_elem * r.abs() + tol.floor * rms
    excess = diff.abs() - bound
    report["elem_violations"] = int((excess > 0).sum()) if r.numel() else 0
    report["max_abs"] = float(diff.abs().max()) if r.numel() else 0.0
    report["ok"] = (
        report["nonfinite"] == 0
        and report["ref_nonfinite"] == 0
        and report["rel_norm"] <= tol.rel_norm  # False for NaN
        and report["elem_violations"] == 0
    )
    return report


def assert_close(name, got, ref, dtype, ctx):
    assert got.dtype == dtype, f"{name}: dtype {got.dtype} (expected {dtype}) [{ctx}]"
    assert tuple(got.shape) == tuple(ref.shape), f"{name}: shape {tuple(got.shape)} (expected {tuple(ref.shape)}) [{ctx}]"
    rep = compare(got, ref, dtype)
    if os.environ.get("CSA_TEST_VERBOSE"):  # per-output error figures, e.g. to recalibrate the table
        print(f"\n{name:10s} rel_norm={rep['rel_norm']:.3e} max_abs={rep['max_abs']:.3e} [{ctx}]", end="")
    assert rep["nan"] == 0, f"{name}: {rep['nan']} NaN left (element not written?) [{ctx}] {rep}"
    assert rep["ok"], f"{name}: outside tolerance {TOLERANCES[dtype]} [{ctx}] {rep}"


def assert_bitwise(name, a, b, ctx):
    ia = a.view(torch.int16) if a.element_size() == 2 else a.view(torch.int32)
    ib = b.view(torch.int16) if b.element_size() == 2 else b.view(torch.int32)
    n = int((ia != ib).sum())
    assert n == 0, f"{name}: {n} elements differ bitwise between two identical runs [{ctx}]"


# ------------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    valid: int  # real compressed rows, cu_seqlens_comp[-1]
    pad_rows: int = 0  # static-capacity padding rows (total_comp - cu_seqlens_comp[-1])
    pad_tokens: int = 0  # static token-capacity rows past cu_seqlens[-1]
    short: bool = True  # one segment shorter than ratio
    empty: bool = False  # one zero-length segment
    n_segments: Optional[int] = None  # None: random 1..4

    @property
    def nb_total(self):
        return self.valid + self.pad_rows

    def id(self):
        return f"nb{self.nb_total}({self.valid}+{self.pad_rows}p)"


# Bucket ranges of nb_total (= total_comp), inclusive. Upstream: compressor_sm100_r128
# _SMALL_NB_MAX = 128, _LARGE_NB_MIN = 1024, _BWD_SMALL_NB_MAX = 192.
FWD_R128_BUCKETS = {"small": (1, 128), "default": (129, 1023), "large": (1024, 2**31 - 1)}
BWD_R128_BUCKETS = {"small": (1, 192), "default": (193, 2**31 - 1)}

# Two shapes per bucket; boundaries included. The large forward bucket needs nb_total >= 1024, i.e.
# ~131k tokens at ratio 128 (or padding rows: the second large shape has 1000 real rows + 30).
FWD_R128_SHAPES = {
    "small": (Shape(3, pad_rows=2, pad_tokens=5, empty=True), Shape(128)),
    "default": (Shape(129, short=False), Shape(900, pad_rows=20, pad_tokens=64)),
    "large": (Shape(1024, n_segments=1, short=False), Shape(1000, pad_rows=30)),
}
BWD_R128_SHAPES = {
    "small": (Shape(5, pad_rows=1, empty=True), Shape(180, pad_rows=12, pad_tokens=7)),
    "default": (Shape(193, short=False), Shape(700, pad_rows=5, pad_tokens=3)),
}
# Ratio 2/4: one small shape (padding rows, padding tokens, short and empty segments, a partial
# 8-row backward CTA) and one long pack (ratio 4: 2000 rows = 250 deterministic partial planes, so
# the split dAPE reduction runs 8 stage-1 groups).
R24_SHAPES = {
    2: (Shape(9, pad_rows=3, pad_tokens=2, empty=True), Shape(1500, pad_rows=4)),
    4: (Shape(9, pad_rows=3, pad_tokens=2, empty=True), Shape(2000, pad_rows=4)),
}
COFFS = (1, 2)
HEAD_DIMS = (128, 512)

_SEED_BASE = int(os.environ.get("CSA_TEST_SEED", "20261129"))


def _seed(*parts):
    return (_SEED_BASE + zlib.crc32(repr(parts).encode())) % (2**31)


def make_case(ratio, coff, d, shape: Shape, seed):
    gen_cpu = torch.Generator().manual_seed(seed)
    cu, cuc = ref_csa.random_segments(ratio, shape.valid, gen_cpu, n_segments=shape.n_segments, short=shape.short, empty=shape.empty)
    assert cuc[-1] == shape.valid
    gen_dev = torch.Generator(device="cuda").manual_seed(seed)
    x = ref_csa.random_inputs(cu, cuc, ratio, coff, d, gen_dev, pad_rows=shape.pad_rows, pad_tokens=shape.pad_tokens, device="cuda")
    x["cu"], x["cuc"] = cu, cuc
    x["ctx"] = f"ratio={ratio} coff={coff} d={d} {shape.id()} tokens={x['kv'].shape[0]} segs={len(cu) - 1} seed={seed}"
    return x


@pytest.fixture(scope="module")
def csa():
    import dsa_aot.csa

    return dsa_aot.csa


def _check_bucket(csa, op, table, bucket, nb_total):
    lo, hi = table[bucket]
    assert lo <= nb_total <= hi, f"test design: nb_total={nb_total} is not in the {op} {bucket} bucket {table[bucket]}"
    from dsa_aot.policy.csa_compressor import bucket_of

    assert bucket_of(op, nb_total) == bucket, f"bucket_of({op!r}, {nb_total}) = {bucket_of(op, nb_total)!r} (expected {bucket!r})"


# ------------------------------------------------------------------------------------------------
# Runners
# ------------------------------------------------------------------------------------------------


def run_forward(csa, x, ratio, coff, d):
    out = torch.full((x["total_comp"], d), float("nan"), dtype=torch.bfloat16, device="cuda")
    csa.compressor_forward_into(out, x["kv"], x["score"], x["ape"], x["cu_seqlens"], x["cu_seqlens_comp"], ratio=ratio, coff=coff)
    torch.cuda.synchronize()
    return out


def run_backward(csa, x, ratio, coff, d, deterministic):
    nan = float("nan")
    gkv = torch.full_like(x["kv"], nan)
    gs = torch.full_like(x["score"], nan)
    workspace = None
    if deterministic:
        gape = torch.full_like(x["ape"], nan)  # fully overwritten in deterministic mode
        nbytes = csa.backward_workspace_bytes(x["total_comp"], ratio, d, coff, x["kv"].device)
        workspace = torch.full((max(int(nbytes), 1),), 0xFF, dtype=torch.uint8, device="cuda")  # 0xFFFFFFFF is an fp32 NaN
    else:
        gape = torch.zeros_like(x["ape"])  # caller-zeroed for the atomic dAPE path
    csa.compressor_backward_into(
        gkv,
        gs,
        gape,
        x["kv"],
        x["score"],
        x["ape"],
        x["cu_seqlens"],
        x["cu_seqlens_comp"],
        x["grad_out"],
        ratio=ratio,
        coff=coff,
        deterministic=deterministic,
        workspace=workspace,
    )
    torch.cuda.synchronize()
    return gkv, gs, gape


def check_forward(out, x, ratio, coff, d):
    ref = ref_csa.csa_forward_ref(x["kv"], x["score"], x["ape"], x["cu"], x["cuc"], ratio, coff, d, x["total_comp"])
    assert_close("out", out, ref, torch.bfloat16, x["ctx"])


def check_backward(grads, x, ratio, coff, d):
    gkv, gs, gape = grads
    rkv, rs, rape = ref_csa.csa_backward_ref(x["kv"], x["score"], x["ape"], x["cu"], x["cuc"], x["grad_out"], ratio, coff, d)
    ctx = x["ctx"]
    consumed = ref_csa.csa_consumed_mask(x["cu"], x["cuc"], ratio, coff, d, x["kv"].shape[0], device="cuda")
    for name, got, want in (("grad_kv", gkv, rkv), ("grad_score", gs, rs)):
        assert int(torch.isnan(got).sum()) == 0, f"{name}: {int(torch.isnan(got).sum())} NaN left (element not written?) [{ctx}]"
        assert bool((want[~consumed] == 0).all()), f"reference: {name} nonzero at a never-consumed position [{ctx}]"
        n_bad = int((got[~consumed] != 0).sum())
        assert n_bad == 0, f"{name}: {n_bad} never-consumed positions are not exact zeros [{ctx}]"
        assert_close(name, got, want, torch.bfloat16, ctx)
    assert_close("grad_ape", gape, rape, torch.float32, ctx)


# ------------------------------------------------------------------------------------------------
# Ratio 128
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("coff", COFFS)
@pytest.mark.parametrize("bucket,shape_idx", [(b, i) for b in FWD_R128_SHAPES for i in range(2)])
def test_forward_r128(csa, bucket, shape_idx, coff, d):
    shape = FWD_R128_SHAPES[bucket][shape_idx]
    _check_bucket(csa, "fwd_r128", FWD_R128_BUCKETS, bucket, shape.nb_total)
    x = make_case(128, coff, d, shape, _seed("fwd_r128", bucket, shape_idx, coff, d))
    out = run_forward(csa, x, 128, coff, d)
    check_forward(out, x, 128, coff, d)
    out2 = run_forward(csa, x, 128, coff, d)
    assert_bitwise("out", out, out2, x["ctx"])


@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("coff", COFFS)
@pytest.mark.parametrize("bucket,shape_idx", [(b, i) for b in BWD_R128_SHAPES for i in range(2)])
def test_backward_r128(csa, bucket, shape_idx, coff, d, deterministic):
    shape = BWD_R128_SHAPES[bucket][shape_idx]
    _check_bucket(csa, "bwd_r128", BWD_R128_BUCKETS, bucket, shape.nb_total)
    x = make_case(128, coff, d, shape, _seed("bwd_r128", bucket, shape_idx, coff, d, deterministic))
    g1 = run_backward(csa, x, 128, coff, d, deterministic)
    check_backward(g1, x, 128, coff, d)
    g2 = run_backward(csa, x, 128, coff, d, deterministic)
    # dKV/dScore are run-to-run deterministic in both modes; dAPE only in deterministic mode.
    assert_bitwise("grad_kv", g1[0], g2[0], x["ctx"])
    assert_bitwise("grad_score", g1[1], g2[1], x["ctx"])
    if deterministic:
        assert_bitwise("grad_ape", g1[2], g2[2], x["ctx"])


# ------------------------------------------------------------------------------------------------
# Ratio 2 and 4
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape_idx", (0, 1))
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("coff", COFFS)
@pytest.mark.parametrize("ratio", (2, 4))
def test_forward_r24(csa, ratio, coff, d, shape_idx):
    shape = R24_SHAPES[ratio][shape_idx]
    x = make_case(ratio, coff, d, shape, _seed("fwd", ratio, coff, d, shape_idx))
    out = run_forward(csa, x, ratio, coff, d)
    check_forward(out, x, ratio, coff, d)
    out2 = run_forward(csa, x, ratio, coff, d)
    assert_bitwise("out", out, out2, x["ctx"])


@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
@pytest.mark.parametrize("shape_idx", (0, 1))
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("coff", COFFS)
@pytest.mark.parametrize("ratio", (2, 4))
def test_backward_r24(csa, ratio, coff, d, shape_idx, deterministic):
    shape = R24_SHAPES[ratio][shape_idx]
    x = make_case(ratio, coff, d, shape, _seed("bwd", ratio, coff, d, shape_idx, deterministic))
    g1 = run_backward(csa, x, ratio, coff, d, deterministic)
    check_backward(g1, x, ratio, coff, d)
    g2 = run_backward(csa, x, ratio, coff, d, deterministic)
    assert_bitwise("grad_kv", g1[0], g2[0], x["ctx"])
    assert_bitwise("grad_score", g1[1], g2[1], x["ctx"])
    if deterministic:
        assert_bitwise("grad_ape", g1[2], g2[2], x["ctx"])


# ------------------------------------------------------------------------------------------------
# Allocating wrappers (cudnn's csa_compressor_{forward,backward}_wrapper signatures)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
@pytest.mark.parametrize("ratio,coff,d,explicit_total", [(4, 2, 128, False), (128, 2, 512, True), (2, 1, 512, True), (128, 1, 128, False)])
def test_allocating_wrappers(csa, ratio, coff, d, explicit_total, deterministic):
    shape = Shape(40, pad_rows=3 if explicit_total else 0, pad_tokens=2)
    x = make_case(ratio, coff, d, shape, _seed("wrappers", ratio, coff, d, explicit_total, deterministic))
    args = (x["kv"], x["score"], x["ape"], x["cu_seqlens"], x["cu_seqlens_comp"])
    total = x["total_comp"] if explicit_total else None
    r = csa.compressor_forward(*args, ratio=ratio, head_dim=None, coff=coff, total_comp=total)
    torch.cuda.synchronize()
    check_forward(r["out"], x, ratio, coff, d)
    g = csa.compressor_backward(*args, x["grad_out"], ratio=ratio, head_dim=d, coff=coff, deterministic=deterministic)
    torch.cuda.synchronize()
    check_backward((g["grad_kv"], g["grad_score"], g["grad_ape"]), x, ratio, coff, d)


# ------------------------------------------------------------------------------------------------
# CUDA graphs
# ------------------------------------------------------------------------------------------------


def _three_segments(ratio, total_tokens, gen):
    """Random 3-segment split of exactly ``total_tokens`` tokens (same B and capacity each time)."""
    cuts = sorted(torch.randint(0, total_tokens + 1, (2,), generator=gen).tolist())
    cu = [0, cuts[0], cuts[1], total_tokens]
    cuc = [0]
    for s in range(3):
        cuc.append(cuc[-1] + (cu[s + 1] - cu[s]) // ratio)
    return cu, cuc


@pytest.mark.parametrize("ratio,coff,d,deterministic", [(4, 2, 128, False), (128, 2, 512, True), (128, 1, 128, False)])
def test_cuda_graph_capture_replay(csa, ratio, coff, d, deterministic):
    """Capture forward + backward once, replay with new values (and a new segmentation)."""
    n_blocks = 40
    total_tokens = n_blocks * ratio
    total_comp = n_blocks + 2  # static capacity >= any cu_seqlens_comp[-1] of a 3-way split
    gen = torch.Generator().manual_seed(_seed("graph", ratio, coff, d, deterministic))
    gen_dev = torch.Generator(device="cuda").manual_seed(_seed("graph-dev", ratio, coff, d, deterministic))
    cu, cuc = _three_segments(ratio, total_tokens, gen)
    x = ref_csa.random_inputs(cu, cuc, ratio, coff, d, gen_dev, pad_rows=total_comp - cuc[-1], device="cuda")
    static = {k: x[k].clone() for k in ("kv", "score", "ape", "cu_seqlens", "cu_seqlens_comp", "grad_out")}
    out = torch.empty(total_comp, d, dtype=torch.bfloat16, device="cuda")
    gkv = torch.empty_like(static["kv"])
    gs = torch.empty_like(static["score"])
    gape = torch.empty_like(static["ape"])
    workspace = None
    if deterministic:
        nbytes = csa.backward_workspace_bytes(total_comp, ratio, d, coff, static["kv"].device)
        workspace = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device="cuda")

    def step():
        csa.compressor_forward_into(out, static["kv"], static["score"], static["ape"], static["cu_seqlens"], static["cu_seqlens_comp"], ratio=ratio, coff=coff)
        if not deterministic:
            gape.zero_()  # the atomic path accumulates: re-zero inside the graph on every replay
        csa.compressor_backward_into(
            gkv,
            gs,
            gape,
            static["kv"],
            static["score"],
            static["ape"],
            static["cu_seqlens"],
            static["cu_seqlens_comp"],
            static["grad_out"],
            ratio=ratio,
            coff=coff,
            deterministic=deterministic,
            workspace=workspace,
        )

    # Warm up on a side stream (loads cubins, sets attributes), as the torch CUDA-graph docs do.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captures on torch's own side stream
        step()
    torch.cuda.synchronize()

    for trial in range(3):
        if trial == 2:  # new segment boundaries: same B, same token capacity, same total_comp
            cu, cuc = _three_segments(ratio, total_tokens, gen)
        new = ref_csa.random_inputs(cu, cuc, ratio, coff, d, gen_dev, pad_rows=total_comp - cuc[-1], device="cuda")
        for k in static:
            static[k].copy_(new[k])
        for t in (out, gkv, gs, gape):
            t.fill_(float("nan"))
        if workspace is not None:
            workspace.fill_(0xFF)
        graph.replay()
        torch.cuda.synchronize()
        new["cu"], new["cuc"] = cu, cuc
        new["ctx"] = f"graph replay {trial} ratio={ratio} coff={coff} d={d} det={deterministic} cu={cu}"
        check_forward(out, new, ratio, coff, d)
        check_backward((gkv, gs, gape), new, ratio, coff, d)


# ------------------------------------------------------------------------------------------------
# total_comp == 0
# ------------------------------------------------------------------------------------------------


def _cuda_kernel_events(fn):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]


@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
@pytest.mark.parametrize("ratio,coff,d", [(4, 2, 128), (128, 1, 512)])
def test_total_comp_zero(csa, ratio, coff, d, deterministic):
    """No compressed rows: zero grads from the wrapper, and the *_into ops launch nothing."""
    gen = torch.Generator(device="cuda").manual_seed(_seed("zero", ratio, coff, d, deterministic))
    cu, cuc = [0, ratio - 1, ratio - 1, 2 * ratio - 2], [0, 0, 0, 0]  # every segment shorter than ratio
    x = ref_csa.random_inputs(cu, cuc, ratio, coff, d, gen, device="cuda")
    assert x["total_comp"] == 0 and x["grad_out"].shape == (0, d)
    args = (x["kv"], x["score"], x["ape"], x["cu_seqlens"], x["cu_seqlens_comp"])

    r = csa.compressor_forward(*args, ratio=ratio, coff=coff, total_comp=0)
    g = csa.compressor_backward(*args, x["grad_out"], ratio=ratio, coff=coff, deterministic=deterministic)
    torch.cuda.synchronize()
    assert tuple(r["out"].shape) == (0, d) and r["out"].dtype == torch.bfloat16
    for name, want in (("grad_kv", x["kv"]), ("grad_score", x["score"]), ("grad_ape", x["ape"])):
        got = g[name]
        assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape} {got.dtype}"
        assert bool((got == 0).all()), f"{name}: not all zeros for total_comp == 0"

    # *_into with poisoned buffers: nothing is launched, so the buffers are left untouched
    # (cudnn's execute contract), and the profiler sees no CUDA activity at all.
    out = torch.empty(0, d, dtype=torch.bfloat16, device="cuda")
    gkv, gs, gape = (torch.full_like(t, float("nan")) for t in (x["kv"], x["score"], x["ape"]))

    def into():
        csa.compressor_forward_into(out, *args, ratio=ratio, coff=coff)
        csa.compressor_backward_into(gkv, gs, gape, *args, x["grad_out"], ratio=ratio, coff=coff, deterministic=deterministic, workspace=None)

    events = _cuda_kernel_events(into)
    assert events == [], f"total_comp == 0 launched CUDA work: {events}"
    for name, t in (("grad_kv", gkv), ("grad_score", gs), ("grad_ape", gape)):
        assert bool(torch.isnan(t).all()), f"{name}: written although total_comp == 0"

    # Positive control: the same profiler does see an aot kernel launch (cuLaunchKernelEx).
    y = make_case(ratio, coff, d, Shape(2, short=False, n_segments=1), _seed("zero-control", ratio, coff, d))
    out_y = torch.empty(y["total_comp"], d, dtype=torch.bfloat16, device="cuda")
    events = _cuda_kernel_events(lambda: csa.compressor_forward_into(out_y, y["kv"], y["score"], y["ape"], y["cu_seqlens"], y["cu_seqlens_comp"], ratio=ratio, coff=coff))
    assert events, "profiler saw no CUDA kernel for a real launch; the no-launch check above proves nothing"
