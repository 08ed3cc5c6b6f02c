"""dsa_aot.toolchain.lift against dsa_aot.toolchain.verify's independent concrete interpreter, on real host modules and cubins.

tests/data/<entry>/ holds what the compile stage wrote for two real entries: a two-kernel dAPE split
reduction (sm_90a) and a ratio-128 deterministic backward (sm_100a).
"""

import json
import re
from pathlib import Path

import pytest

from dsa_aot.toolchain import lift, verify
from dsa_aot.errors import LiftError, VerifyError

DATA = Path(__file__).resolve().parents[2] / "data"
ENTRIES = sorted(p.name for p in DATA.iterdir() if (p / "host.mlir").is_file())


def load(name):
    d = DATA / name
    meta = json.loads((d / "meta.json").read_text())
    return (d / "host.mlir").read_text(), meta["host_function"], (d / "kernel.cubin").read_bytes()


@pytest.mark.parametrize("name", ENTRIES)
def test_lifted_launcher_matches_concrete_host_code_and_cubin(name):
    host, fn, cubin = load(name)
    src = lift.lift(host, fn, name, lift.cubin_param_layout(cubin))
    rep = verify.verify(host, fn, src, cubin, samples=60, seed=1)
    assert rep["verdict"] == "ok" and rep["samples"] == 60


def test_two_kernel_entry_lifts_residual_grid_arithmetic():
    host, fn, cubin = load("csa_compressor.dape_reduce.split.sm_90a")
    ns = verify.load_launcher(lift.lift(host, fn))
    assert len(ns["LAUNCHES"]) == 2
    bufs = [bytearray.fromhex(L["template"]) for L in ns["LAUNCHES"]]
    # stage 1 grid = ceil(nelems/32) * ceil(npartials/32); stage 2 grid = ceil(nelems/32) (cudnn's launch code)
    seq = []
    ns["launch"](lambda k, d: seq.append((k, d)), *bufs, 0x1000, 0x2000, 0x3000, 100, 1000, 7)
    assert [k for k, _ in seq] == [0, 1]
    dims = [d for _, d in seq]
    assert dims[0][:3] == (32 * 4, 1, 1) and dims[1][:3] == (32, 1, 1)
    assert dims[0][7] == 7 and dims[0][3:6] == (32, 8, 1)


def _mutated(src, pattern, repl):
    out, n = re.subn(pattern, repl, src, count=1)
    assert n == 1, pattern
    return out


@pytest.mark.parametrize("pattern,repl", [
    (r"pack_into\(p0, 0, a0, a1", "pack_into(p0, 0, a1, a0"),           # swapped parameters
    (r"\(\(v1 - 1\) & 0xffffffff\)", "((v1 - 2) & 0xffffffff)"),         # wrong grid arithmetic
    (r"set_attr\('([^']+)', 8, ", r"set_attr('\1', 9, "),                # wrong kernel attribute
])
def test_verifier_catches_a_wrong_launcher(pattern, repl):
    name = "csa_compressor.bwd_r128.default.coff2.d512.deterministic.ratio128.sm_100a"
    host, fn, cubin = load(name)
    src = _mutated(lift.lift(host, fn), pattern, repl)
    with pytest.raises(VerifyError):
        verify.verify(host, fn, src, cubin, samples=50)


def test_verifier_checks_param_layout_against_the_cubin():
    host, fn, cubin = load("csa_compressor.dape_reduce.split.sm_90a")
    src = lift.lift(host, fn)
    bad = src.replace("(16, 4), (20, 4)", "(16, 4), (24, 4)", 1)
    assert bad != src
    with pytest.raises(VerifyError, match="EIATTR_KPARAM_INFO"):
        verify.verify(host, fn, bad, cubin)


def test_verifier_checks_the_embedded_fatbin_holds_the_shipped_cubin():
    host, fn, _ = load("csa_compressor.dape_reduce.split.sm_90a")
    _, _, other = load("csa_compressor.bwd_r128.default.coff2.d512.deterministic.ratio128.sm_100a")
    with pytest.raises(VerifyError, match="kernels_binary"):
        verify.verify(host, fn, lift.lift(host, fn), other)


def _inject_before_launch(host, line):
    i = host.index('callee = @_cudaLaunchKernelEx')
    j = host.rindex("\n", 0, i)
    return host[: j + 1] + line + "\n" + host[j + 1 :]


def test_lifter_refuses_unknown_op_and_names_it():
    host, fn, _ = load("csa_compressor.dape_reduce.split.sm_90a")
    bad = _inject_before_launch(host, '    %zz = "llvm.fdiv"(%arg9, %arg9) : (i32, i32) -> i32')
    with pytest.raises(LiftError, match=r"line \d+ \(llvm\.fdiv\).*not understood"):
        lift.lift(bad, fn)


def test_lifter_refuses_unknown_call():
    host, fn, _ = load("csa_compressor.dape_reduce.split.sm_90a")
    bad = _inject_before_launch(host, '    %zz = "llvm.call"(%arg9) <{CConv = #llvm.cconv<ccc>, TailCallKind = #llvm.tailcallkind<none>, callee = @mystery, fastmathFlags = #llvm.fastmath<none>, op_bundle_sizes = array<i32>, operandSegmentSizes = array<i32: 1, 0>}> : (i32) -> i32')
    with pytest.raises(LiftError, match="@mystery"):
        lift.lift(bad, fn)


def test_lifter_refuses_a_runtime_branch_that_is_not_an_error_path():
    host, fn, _ = load("csa_compressor.dape_reduce.split.sm_90a")
    # make the attribute-array loop's exit test depend on a run-time argument
    bad = host.replace('"llvm.icmp"(%71, %54)', '"llvm.icmp"(%arg9, %54)', 1)
    assert bad != host
    with pytest.raises(LiftError, match="branch on a run-time value"):
        lift.lift(bad, fn)


def test_runtime_branch_to_an_error_path_becomes_a_check():
    host, fn, cubin = load("csa_compressor.dape_reduce.split.sm_90a")
    # "too many launch attributes -> trap" now depends on npartials (%arg9)
    bad = host.replace('"llvm.icmp"(%54, %2)', '"llvm.icmp"(%arg9, %2)', 1)
    assert bad != host
    ns = verify.load_launcher(lift.lift(bad, fn))
    bufs = [bytearray.fromhex(L["template"]) for L in ns["LAUNCHES"]]
    ns["launch"](lambda k, d: None, *bufs, 16, 32, 48, 16, 64, 0)  # 16 < 17: fine
    with pytest.raises(verify.LaunchError, match="error path"):
        ns["launch"](lambda k, d: None, *bufs, 16, 32, 48, 17, 64, 0)
    verify.verify(bad, fn, lift.lift(bad, fn), cubin, samples=80)  # and it agrees with the host code


def test_tma_descriptor_params_take_the_cubins_offsets():
    """SM90 puts kernel params at c[0x0][0x210]: a 64-byte-aligned CUtensorMap lands at param offset
    368, not at its natural 320. Lifted without the cubin's layout, the verifier refuses it."""
    name = "dsa_indexer_backward.gemm_sm90.heads64.topk512.notopk_global.sm_90a"
    host, fn, cubin = load(name)
    ns = verify.load_launcher(lift.lift(host, fn, name, lift.cubin_param_layout(cubin)))
    offs = [o for o, s in ns["LAUNCHES"][0]["params"] if s == 128]
    assert offs == [368, 496]
    # the JIT leaves the upper 64 bytes of each descriptor unwritten
    assert ns["LAUNCHES"][0]["never_written"][13] == list(range(64, 128))
    with pytest.raises(VerifyError, match="EIATTR_KPARAM_INFO"):
        verify.verify(host, fn, lift.lift(host, fn, name), cubin, samples=5)


def test_pdl_consumer_and_float_scale():
    name = "dsa_indexer_backward.gemm.nodeterministic.heads64.pdl.persistent.planes96.topk512.notopk_global.sm_100a"
    host, fn, cubin = load(name)
    ns = verify.load_launcher(lift.lift(host, fn, name, lift.cubin_param_layout(cubin)))
    attrs = dict((aid, v) for aid, v in ns["LAUNCHES"][0]["attrs"])
    assert attrs[6] == [[0, 4, 1]]  # programmatic stream serialization: the GEMM may start under score-grad
    assert ("a8", "f32") in ns["ARGS"]  # sm_scale, passed as a Python float


def test_runtime_arithmetic_region_becomes_a_function():
    """SM90 sparse-attention main: the fast-divmod set-up branches and loops on a run-time divisor and
    rejoins with only arithmetic done; it is emitted as a helper the verifier checks on 60 samples."""
    name = "dsa_sparse_attention_backward.main_sm90.dim512.bf16.heads64.topk512.notopk_length.sm_90a"
    host, fn, cubin = load(name)
    src = lift.lift(host, fn, name, lift.cubin_param_layout(cubin))
    assert "def _region1(c, x0):" in src
    ns = verify.load_launcher(src)
    # divisor 1 takes the early exit, 2**31 or more the shift-32 arm, others the doubling loop
    assert ns["_region1"](1, 1) == (0,) and ns["_region1"](0, 2**31) == (32,) and ns["_region1"](0, 5) == (3,)


def test_fp32_multiply_matches_c_float_arithmetic():
    import random

    from dsa_aot.runtime.lifted import f32mul

    rng = random.Random(3)
    specials = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x00000001, 0x3F800000, 0x3FB8AA3B]
    pairs = [(a, b) for a in specials for b in specials] + [(rng.getrandbits(32), rng.getrandbits(32)) for _ in range(3000)]
    def nan(bits):
        return (bits & 0x7F800000) == 0x7F800000 and bits & 0x007FFFFF

    nans = 0
    for a, b in pairs:
        x, y = f32mul(a, b), verify._fmul32(a, b, 32)
        if x != y:  # only NaN payloads may differ: both sides must be NaN
            assert nan(x) and nan(y), (hex(a), hex(b), hex(x), hex(y))
        nans += bool(nan(x))
    assert nans, "the specials (inf * 0) make NaNs: the payload rule above was exercised"


def _control_flow_case(name, seed, launches, *markers):
    """Lift one SM100 sparse-backward entry whose launches depend on run-time control flow, check it,
    and return (its source, a verify of a mutated source)."""
    host, fn, cubin = load(name)
    src = lift.lift(host, fn, name, lift.cubin_param_layout(cubin))
    assert all(m in src for m in markers)
    rep = verify.verify(host, fn, src, cubin, samples=50, seed=seed)
    assert rep["verdict"] == "ok" and rep["launches"] == launches
    return src, lambda mutated: verify.verify(host, fn, mutated, cubin, samples=50, seed=seed)


def test_launches_inside_a_run_time_branch():
    """SM100 H128 two-CTA deterministic sparse-attention backward: which reduction kernels run is an
    if/else on run-time extents (nested, inside and after a wave loop). The launcher branches in
    Python; each arm's sites fire only when the JIT's would."""
    name = "dsa_sparse_attention_backward.bwd.deterministic.dim512.bf16.heads128.planes128.relay1.topk512.notopk_length.nowide.sm_100a"
    src, check = _control_flow_case(name, 3, 14, "else:", "while True:")
    # a launcher that always takes the first arm is caught
    lines = src.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.strip().startswith("if v") and lines[k + 1].strip() and "raise" not in lines[k + 1])
    lines[i] = lines[i][: len(lines[i]) - len(lines[i].lstrip())] + "if True:"
    with pytest.raises(VerifyError):
        check("\n".join(lines) + "\n")


def test_launch_inside_a_run_time_loop():
    """SM100 generic sparse-attention backward: the main kernel is launched inside
    `for q_offset in range(0, S_q, S_q)`, a loop over a run-time trip count. The launcher loops in
    Python and emits the site once per trip; the verifier compares the whole launch sequence."""
    name = "dsa_sparse_attention_backward.bwd.nodeterministic.dim512.bf16.heads64.planes1.relay1.topk512.notopk_length.nowide.sm_100a"
    src, check = _control_flow_case(name, 2, 5, "while True:", "LOOPS = True")
    # a launcher that skips the loop's launch is caught
    with pytest.raises(VerifyError):
        check(src.replace("while True:", "while False:", 1))


# --- literal arguments: a value the host code bakes in per compile, taken per call by the launcher -----

SATTN90 = "dsa_score_recompute.sparse_attention_sm90.dim512.heads64.nolength.topk512.notopk_global.sm_90a"


def _scale_literal():
    from dsa_aot.toolchain.build import literals_of

    lit = literals_of("dsa_score_recompute", "sparse_attention_sm90")
    assert list(lit) == ["softmax_scale_log2"]
    return lit


def test_literal_becomes_the_launchers_trailing_argument_and_verifies_on_random_values():
    host, fn, cubin = load(SATTN90)
    lit = _scale_literal()
    src = lift.lift(host, fn, SATTN90, lift.cubin_param_layout(cubin), literals=lit)
    ns = verify.load_launcher(src)
    assert ns["ARGS"][-1] == ("softmax_scale_log2", "f32")
    rep = verify.verify(host, fn, src, cubin, samples=40, seed=3, literals=lit)
    assert rep["verdict"] == "ok" and rep["literal_arguments"] == ["softmax_scale_log2"]
    # the value lands in the parameter bytes as the fp32 the kernel reads, whatever the call passes
    L = ns["LAUNCHES"][0]
    runs = []
    for scale in (0.05, 0.125):
        buf = bytearray.fromhex(L["template"])
        ns["launch"](lambda k, d: None, buf, *([16] * (len(ns["ARGS"]) - 1)), scale)
        runs.append(buf)
    diff = [i for i, (a, b) in enumerate(zip(*runs)) if a != b]
    assert len(diff) == 4 and runs[1][diff[0]:diff[0] + 4] == verify.struct.pack("<f", 0.125)


def test_without_the_literal_the_compiled_scale_is_a_template_constant():
    host, fn, cubin = load(SATTN90)
    value = _scale_literal()["softmax_scale_log2"]
    ns = verify.load_launcher(lift.lift(host, fn, SATTN90, lift.cubin_param_layout(cubin)))
    assert ns["ARGS"][-1][1] != "f32"
    assert verify.struct.pack("<f", value).hex() in ns["LAUNCHES"][0]["template"]


def test_verifier_catches_a_launcher_that_ignores_the_literal():
    host, fn, cubin = load(SATTN90)
    lit = _scale_literal()
    src = lift.lift(host, fn, SATTN90, lift.cubin_param_layout(cubin), literals=lit)
    bad = _mutated(src, r"softmax_scale_log2 = f32bits\(softmax_scale_log2\)", f"softmax_scale_log2 = {verify.f32bits(lit['softmax_scale_log2'])}")
    with pytest.raises(VerifyError, match="JIT host code writes"):
        verify.verify(host, fn, bad, cubin, samples=40, seed=3, literals=lit)


@pytest.mark.parametrize("literals,match", [
    ({"softmax_scale_log2": 0.3}, "does not occur"),             # the spec compiled another value
    ({"a0_0": 0.1 * 1.4426950408889634}, "not a fresh identifier"),  # clashes with an entry argument
    ({"x": 1.0, "y": 1.0}, "same fp32 bits"),
])
def test_lifter_refuses_a_literal_it_cannot_place(literals, match):
    host, fn, cubin = load(SATTN90)
    with pytest.raises(LiftError, match=match):
        lift.lift(host, fn, SATTN90, lift.cubin_param_layout(cubin), literals=literals)


GLU = "moe_grouped_gemm.glu.swiglu.nobias.float8_e4m3fn.discrete_col_sfd.dynamic.experts8.float32.mxfp8.sm_100a"


def test_an_int_literal_becomes_the_grid_extent_the_launcher_takes():
    # the MoE GLU: upstream compiles the device's max active clusters into grid z; the cubin does not
    # depend on it, so the spec compiles a value no other constant has and the launcher takes it per call.
    # (Also: its kernels' symbols start "cudnn_kernel_", the launch reads their handles from kernels_<symbol>.)
    host, fn, cubin = load(GLU)
    lit = {"max_active_clusters": 3917}  # what the entry was compiled with
    src = lift.lift(host, fn, GLU, lift.cubin_param_layout(cubin), literals=lit)
    ns = verify.load_launcher(src)
    assert ns["ARGS"][-1] == ("max_active_clusters", "i32") and len(ns["LAUNCHES"]) == 2
    rep = verify.verify(host, fn, src, cubin, samples=40, seed=5, literals=lit)
    assert rep["verdict"] == "ok" and rep["literal_arguments"] == ["max_active_clusters"]
    for z in (74, 80):
        dims = []
        bufs = [bytearray.fromhex(L["template"]) for L in ns["LAUNCHES"]]
        ns["launch"](lambda k, d: dims.append(tuple(d)), *bufs, *([1 << 12] * (len(ns["ARGS"]) - 1)), z)
        assert [d[:3] for d in dims] == [(1, 1, 1), (2, 1, z)]
    without = verify.load_launcher(lift.lift(host, fn, GLU, lift.cubin_param_layout(cubin)))
    assert without["ARGS"][-1][0] != "max_active_clusters"
    with pytest.raises(LiftError, match="i32 value 3918\\) does not occur"):
        lift.lift(host, fn, GLU, lift.cubin_param_layout(cubin), literals={"max_active_clusters": 3918})


def test_verifier_catches_a_launcher_that_ignores_the_int_literal():
    host, fn, cubin = load(GLU)
    lit = {"max_active_clusters": 3917}
    src = lift.lift(host, fn, GLU, lift.cubin_param_layout(cubin), literals=lit)
    bad = _mutated(src, r"\(2, 1, max_active_clusters,", "(2, 1, 3917,")
    with pytest.raises(VerifyError, match="launch config"):
        verify.verify(host, fn, bad, cubin, samples=40, seed=5, literals=lit)


_ASSUME = ('    %za = "llvm.mlir.constant"() <{value = true}> : () -> i1\n'
           '    %zn = "llvm.mlir.constant"() <{value = 64 : i64}> : () -> i64\n'
           '    "llvm.intr.assume"(%za, %arg6, %zn) <{op_bundle_sizes = array<i32: 2>, op_bundle_tags = [TAG]}> : (i1, !llvm.ptr<1>, i64) -> ()')


def test_an_alignment_assumption_on_an_argument_becomes_a_check_the_verifier_agrees_with():
    host, fn, cubin = load("csa_compressor.dape_reduce.split.sm_90a")
    bad = _inject_before_launch(host, _ASSUME.replace("TAG", '"align"'))
    src = lift.lift(bad, fn, "t", lift.cubin_param_layout(cubin))
    ns = verify.load_launcher(src)
    bufs = [bytearray.fromhex(L["template"]) for L in ns["LAUNCHES"]]
    ns["launch"](lambda k, d: None, *bufs, 1 << 20, 32, 48, 16, 64, 0)
    with pytest.raises(verify.LaunchError, match="aligned to 64 bytes"):
        ns["launch"](lambda k, d: None, *bufs, (1 << 20) + 16, 32, 48, 16, 64, 0)
    rep = verify.verify(bad, fn, src, cubin, samples=80)  # random 16-byte aligned pointers: both sides refuse the same ones
    assert rep["verdict"] == "ok" and rep["error_path_samples"] > 0


def test_lifter_refuses_an_assumption_other_than_an_alignment():
    host, fn, _ = load("csa_compressor.dape_reduce.split.sm_90a")
    with pytest.raises(LiftError, match="other than a pointer's alignment"):
        lift.lift(_inject_before_launch(host, _ASSUME.replace("TAG", '"nonnull"')), fn)
