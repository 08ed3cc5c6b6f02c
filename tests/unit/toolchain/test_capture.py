"""dsa_aot.toolchain.capture: a wrapper stopped at its cute.compile gives what it would have compiled.

The real case: cudnn's MoE GLU wrapper, TE's MXFP8 SwiGLU operands (kernel-facing views), E 8, on CPU tensors that
present as CUDA; compiled from the captured arguments, the cubin is the tests/data entry's byte for byte (that
entry came from the same call compiled through upstream's own path, TVM-FFI and all).
"""

import hashlib
import os
from pathlib import Path

import pytest

pytest.importorskip("cutlass")  # the build toolchain: installed by ci/setup.sh
pytest.importorskip("cudnn")

from dsa_aot.toolchain.capture import aligned_on_host, compile_args  # noqa: E402
from dsa_aot.toolchain.fidelity import Upstream  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "data"
GLU = "moe_grouped_gemm.glu.swiglu.nobias.float8_e4m3fn.discrete_col_sfd.dynamic.experts8.float32.mxfp8.sm_100a"
E, M, N, K, SFV, MAC = 8, 4096, 512, 256, 32, 3917  # MAC: the max-active-clusters value the entry compiled in


def _glu_call(up, monkeypatch):
    import cutlass
    import torch
    from cudnn.gemm.cutedsl.grouped.glu import api

    class HW:  # the device's occupancy query (upstream JIT-compiles a probe kernel for it)
        def get_max_active_clusters(self, cluster_size):
            return MAC

    monkeypatch.setenv("CUDNN_FE_GROUPED_GEMM_DYNAMIC_MNKL", "1")
    monkeypatch.setenv("CUDNNFE_CLUSTER_OVERLAP_MARGIN", "0")
    T, rest_k = up.tensor, -(-(-(-K // SFV)) // 4)
    a = T(torch.float8_e4m3fn, M, K).unsqueeze(0).permute(1, 2, 0)
    b = T(torch.float8_e4m3fn, E, N, K).permute(1, 2, 0)
    sfa = T(torch.float8_e8m0fnu, 1, M // 128, rest_k, 32, 4, 4).permute(3, 4, 1, 5, 2, 0)
    sfb = T(torch.float8_e8m0fnu, E, N // 128, rest_k, 32, 4, 4).permute(3, 4, 1, 5, 2, 0)
    up.patch(api, "_glu_wrapper_memo", {})
    up.patch(api, "_cache_of_GroupedGemmGluSm100Objects", {})
    up.patch(cutlass.utils, "HardwareInfo", HW)
    aligned_on_host(up, "empty", "full", "empty_strided")
    return lambda: api.grouped_gemm_glu_wrapper_sm100(
        a, sfa, T(torch.int32, E), T(torch.float32, E), b_tensor=b, sfb_tensor=sfb, norm_const_tensor=T(torch.float32, 1),
        prob_tensor=T(torch.float32, M, 1, 1), acc_dtype=torch.float32, c_dtype=torch.bfloat16, d_dtype=torch.float8_e4m3fn,
        sf_vec_size=SFV, discrete_col_sfd=True, act_func="swiglu", use_dynamic_sched=True, current_stream=up.stream)


def test_the_moe_glu_wrappers_captured_compile_is_the_shipped_cubin(monkeypatch):
    import cutlass.cute as cute

    from dsa_aot.toolchain.compile import _embedded_cubin

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    real = cute.compile
    with Upstream("sm_100a", 148) as up:
        fn, args, kw = compile_args(_glu_call(up, monkeypatch))
        assert cute.compile is not real and cute.compile.__name__ == "compile_"  # Upstream's recorder is back, not the stop
    assert cute.compile is real
    assert type(fn).__name__ == "BlockScaledMoEGroupedGemmGluBiasKernel" and kw.pop("options") == "--enable-tvm-ffi"
    assert kw["max_active_clusters"] == MAC
    cubin = bytes(_embedded_cubin(real(fn, *args, **kw).ir_module.operation.get_asm(print_generic_op_form=True)))
    want = (DATA / GLU / "kernel.cubin").read_bytes()
    assert hashlib.sha256(cubin).hexdigest() == hashlib.sha256(want).hexdigest()


def test_a_route_that_never_compiles_is_refused():
    with Upstream("sm_100a", 148) as up:
        with pytest.raises(RuntimeError, match="without calling cute.compile"):
            compile_args(lambda: None)


def test_aligned_factories_align_and_present_as_cuda():
    import torch

    with Upstream("sm_100a", 148) as up:
        aligned_on_host(up, "empty", "full", "empty_strided")
        for t in (torch.empty(3, 5, dtype=torch.float16, device="cuda"), torch.full((7,), -1.5, dtype=torch.float32, device="cuda"),
                  torch.empty_strided((4, 6), (1, 4), dtype=torch.bfloat16, device="cuda")):
            assert t.is_cuda and t.data_ptr() % 256 == 0
        assert torch.full((7,), -1.5, dtype=torch.float32).tolist() == [-1.5] * 7
        assert torch.empty_strided((4, 6), (1, 4), dtype=torch.bfloat16).stride() == (1, 4)
        with pytest.raises(ValueError, match="no aligned"):
            aligned_on_host(up, "zeros")
    assert not torch.empty(2).is_cuda
