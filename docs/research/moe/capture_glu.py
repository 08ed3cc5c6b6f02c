"""Capture what grouped_gemm_glu_wrapper_sm100 compiles for a TE-style MXFP8 SwiGLU call (E 8, dynamic
scheduling, fp8 D with discrete column SFD, fp32 prob) on the CPU, compile it without TVM-FFI, and compare
with the tests/data entry's cubin.   python docs/research/moe/capture_glu.py"""
import hashlib, os, sys, time
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
os.environ["CUDNN_FE_GROUPED_GEMM_DYNAMIC_MNKL"] = "1"
os.environ["CUDNNFE_CLUSTER_OVERLAP_MARGIN"] = "0"
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402
import cutlass, cutlass.cute as cute  # noqa: E402
from dsa_aot.toolchain.fidelity import Upstream  # noqa: E402
from dsa_aot.toolchain.capture import compile_args, aligned_on_host  # noqa: E402
from dsa_aot.toolchain.compile import _embedded_cubin  # noqa: E402

E, m, n, k, SFV, MAC = 8, 512 * 8, 512, 256, 32, 3917


class HW:
    def get_max_active_clusters(self, cluster_size):
        return MAC


def route(up):
    from cudnn.gemm.cutedsl.grouped.glu import api
    T = up.tensor
    rest_k = -(-(-(-k // SFV)) // 4)
    a = T(torch.float8_e4m3fn, m, k).unsqueeze(0).permute(1, 2, 0)
    b = T(torch.float8_e4m3fn, E, n, k).permute(1, 2, 0)
    sfa = T(torch.float8_e8m0fnu, 1, m // 128, rest_k, 32, 4, 4).permute(3, 4, 1, 5, 2, 0)
    sfb = T(torch.float8_e8m0fnu, E, n // 128, rest_k, 32, 4, 4).permute(3, 4, 1, 5, 2, 0)
    offs, alpha = T(torch.int32, E), T(torch.float32, E)
    prob, norm = T(torch.float32, m, 1, 1), T(torch.float32, 1)
    api._glu_wrapper_memo.clear()
    api._cache_of_GroupedGemmGluSm100Objects.clear()
    up.patch(cutlass.utils, "HardwareInfo", HW)
    aligned_on_host(up, "empty", "full", "empty_strided")
    return lambda: api.grouped_gemm_glu_wrapper_sm100(
        a, sfa, offs, alpha, b_tensor=b, sfb_tensor=sfb, norm_const_tensor=norm, prob_tensor=prob, acc_dtype=torch.float32,
        c_dtype=torch.bfloat16, d_dtype=torch.float8_e4m3fn, sf_vec_size=SFV, discrete_col_sfd=True, act_func="swiglu",
        use_dynamic_sched=True, current_stream=up.stream)


t = time.perf_counter()
with Upstream("sm_100a", 148) as up:
    fn, args, kw = compile_args(up, route(up))
print("captured", type(fn).__name__, len(args), sorted(kw)[:5], kw.get("options"), f"{time.perf_counter() - t:.2f}s")
kw.pop("options", None)
t = time.perf_counter()
out = cute.compile(fn, *args, **kw)
cubin = bytes(_embedded_cubin(out.ir_module.operation.get_asm(print_generic_op_form=True)))
want = (ROOT / "tests/data/moe_grouped_gemm.glu.swiglu.nobias.float8_e4m3fn.discrete_col_sfd.dynamic.experts8.float32.mxfp8.sm_100a/kernel.cubin").read_bytes()
print(f"compiled {len(cubin)} B {hashlib.sha256(cubin).hexdigest()[:12]} in {time.perf_counter() - t:.2f}s; "
      f"tests/data {len(want)} B {hashlib.sha256(want).hexdigest()[:12]}: {'IDENTICAL' if cubin == want else 'DIFFERENT'}")
