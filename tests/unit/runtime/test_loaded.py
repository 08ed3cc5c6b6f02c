"""aot.runtime.loaded: a corrupted cubin is refused before the driver is touched; a launch site that
fires in a loop carries each firing's own bytes (driver calls recorded by a stand-in)."""

import pytest

from aot.errors import LaunchError
from aot.runtime import loaded

SM100_DET = "dsa_sparse_attention_backward.bwd.deterministic.dim512.bf16.heads128.planes128.relay1.topk512.notopk_length.nowide.sm_100a"


def test_corrupted_cubin_is_refused_before_the_driver_is_touched(one_entry_build):
    ix, entry = one_entry_build
    p = ix.root / entry["cubin"]
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(LaunchError, match="corrupted: sha256"):
        loaded.LoadedEntry(ix.root, entry, 0)


def test_a_site_firing_in_a_loop_launches_each_time_with_its_own_bytes(packed, sm100_calls, monkeypatch):
    """The runtime path of loop entries (SM100 only, so no GPU here runs it): LoadedEntry with a
    recording stand-in for the driver's calls (the driver's own types). The H128 deterministic entry
    launches its backward once per wave of S_q; each launch must carry that wave's bytes, in the
    order and with the bytes the lifted launcher emits."""
    pytest.importorskip("cuda.bindings")
    import ctypes
    import types

    from cuda.bindings import driver as real

    import aot.ops.dsa_sparse_attention_backward as sparse
    from aot.policy import dsa_sparse_attention_backward as policy
    from aot.toolchain import verify

    ix = packed(SM100_DET)
    entry = ix.find("dsa_sparse_attention_backward", "bwd", {"dtype": "bf16", "heads": 128, "dim": 512, "topk": 512, "topk_length": False, "deterministic": True,
                                                 "planes": 128, "relay": 1, "wide": False}, "sm_100a")
    ns = verify.load_launcher((ix.root / entry["launcher"]).read_text())
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
    monkeypatch.setattr(loaded, "drv", lambda: fake)
    le = ix.loaded(entry, 0)
    calls = []
    monkeypatch.setattr(sparse, "launcher", lambda family, op, key, dev, hint="": lambda *args: (calls.append(args), le(*args)))
    monkeypatch.setattr(sparse, "memset0", lambda *a: None)
    monkeypatch.setattr(sparse, "sm_count_of", lambda dev: 148)
    t = [sm100_calls.Buf(i) for i in range(12)]
    s_q, s_kv = 5000, 3000
    op_key = policy.kernels("sm_100a", 128, 512, 512, deterministic=True, s_q=s_q, s_kv=s_kv)["bwd"]
    sparse._sm100_call(op_key, 0, s_q, s_kv, 128, 512, 512, *t[:7], None, *t[8:], 0.5, 7)
    bufs = [bytearray.fromhex(L["template"]) for L in ns["LAUNCHES"]]
    want = []
    ns["launch"](lambda k, dims: want.append((k, b"".join(bytes(bufs[k][o : o + n]) for o, n in sites[k]["params"]))), *bufs, *calls[0])
    assert launched == want
    repeated = {k for k, _ in want if sum(1 for j, _ in want if j == k) > 1}
    assert repeated and any(len({b for j, b in want if j == k}) > 1 for k in repeated)  # one site, several waves, different bytes
