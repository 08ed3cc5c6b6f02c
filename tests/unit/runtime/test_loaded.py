"""dsa_aot.runtime.loaded: a corrupted cubin is refused before the driver is touched; a launch site that
fires in a loop carries each firing's own bytes (driver calls recorded by a stand-in)."""

import pytest

from build_files import edit_family, rewrite_group

from dsa_aot.errors import LaunchError
from dsa_aot.runtime import loaded
from dsa_aot.runtime.index import Index

SM100_DET = "dsa_sparse_attention_backward.bwd.deterministic.dim512.bf16.heads128.planes128.relay1.topk512.notopk_length.nowide.sm_100a"


def test_corrupted_cubin_is_refused_before_the_driver_is_touched(one_entry_build):
    ix, entry = one_entry_build
    rewrite_group(ix.root, entry, "cubin", lambda b: b[: len(b) // 2] + bytes([b[len(b) // 2] ^ 0xFF]) + b[len(b) // 2 + 1 :])
    with pytest.raises(LaunchError, match="cubin of .* is corrupted: sha256"):
        loaded.LoadedEntry(Index(ix.root), entry, 0)


def test_a_site_firing_in_a_loop_launches_each_time_with_its_own_bytes(packed, sm100_calls, monkeypatch):
    """The runtime path of loop entries (SM100 only, so no GPU here runs it): LoadedEntry with a
    recording stand-in for the driver's calls (the driver's own types). The H128 deterministic entry
    launches its backward once per wave of S_q; each launch must carry that wave's bytes, in the
    order and with the bytes the lifted launcher emits."""
    pytest.importorskip("cuda.bindings")
    import stand_in

    import dsa_aot.ops.dsa_sparse_attention_backward as sparse
    from dsa_aot.ops.plan import Recorder, Sym
    from dsa_aot.policy import dsa_sparse_attention_backward as policy
    from dsa_aot.toolchain import verify

    ix = packed(SM100_DET)
    entry = ix.find("dsa_sparse_attention_backward", "bwd", {"dtype": "bf16", "heads": 128, "dim": 512, "topk": 512, "topk_length": False, "deterministic": True,
                                                 "planes": 128, "relay": 1, "wide": False}, "sm_100a")
    ns = verify.load_launcher(ix.member(entry, "launcher").decode())
    sites = dict(enumerate(ns["LAUNCHES"]))
    d = stand_in.install(monkeypatch, ix, devices=1)
    le = ix.loaded(entry, 0)
    calls = []
    real_prepare = le.prepare
    monkeypatch.setattr(le, "prepare", lambda *args: (calls.append(args), real_prepare(*args))[1])
    monkeypatch.setattr(sparse, "launcher", lambda family, op, key, dev, hint="": le)
    monkeypatch.setattr(sparse, "sm_count_of", lambda dev: 148)
    t = [sm100_calls.Buf(i) for i in range(12)]
    s_q, s_kv = 5000, 3000
    op_key = policy.kernels("sm_100a", 128, 512, 512, deterministic=True, s_q=s_q, s_kv=s_kv)["bwd"]
    rec = Recorder(12, 1)
    sparse._sm100_call(rec, op_key, 0, s_q, s_kv, 128, 512, 512, False)
    values = {f"p[{i}]": b.p for i, b in enumerate(t)} | {"s": 7, "x[0]": 0.5}
    ((entry_, args),) = rec.launches
    le.prepare(*(a.value(values) if isinstance(a, Sym) else a for a in args)).fire()
    bufs = [bytearray.fromhex(L["template"]) for L in ns["LAUNCHES"]]
    want = []
    ns["launch"](lambda k, dims: want.append((sites[k]["kernel"], b"".join(bytes(bufs[k][o : o + n]) for o, n in sites[k]["params"]))), *bufs, *calls[0])
    assert [(L.kernel, L.params) for L in d.launches] == want
    repeated = {k for k, _ in want if sum(1 for j, _ in want if j == k) > 1}
    assert repeated and any(len({b for j, b in want if j == k}) > 1 for k in repeated)  # one site, several waves, different bytes


def _entry_with(one_entry_build, **changes):
    """The one-entry build with ``changes`` to its entry (the index rewritten with its hash)."""
    ix, entry = one_entry_build
    names, params = changes.pop("kernels", entry["kernels"]), changes.pop("params", entry["params"])

    def edit(doc):  # kernels by name as the runtime sees them, written as the index's table and references
        doc["kernels"] = [[k, params[k]] for k in names]
        doc["entries"][0].update(changes, kernels=list(range(len(names))))

    edit_family(ix.root, entry["family"], edit)
    ix = Index(ix.root)
    return ix, ix.entries[0]


def test_a_launcher_that_does_not_match_the_cubin_is_refused(one_entry_build):
    ix, entry = one_entry_build
    params = dict(entry["params"])
    k, sizes = next(iter(params.items()))
    ix, e = _entry_with(one_entry_build, params=params | {k: sizes[:-1]})
    with pytest.raises(LaunchError, match="does not match the build's index: launch"):
        loaded.LoadedEntry(ix, e, 0)
    ix, e = _entry_with(one_entry_build, kernels=["another_kernel"], params={"another_kernel": sizes})
    assert len(entry["kernels"]) >= 1
    with pytest.raises(LaunchError, match="kernels .* that the cubin does not have"):
        loaded.LoadedEntry(ix, e, 0)
