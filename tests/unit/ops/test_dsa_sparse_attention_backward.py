"""dsa_aot.ops.dsa_sparse_attention_backward without a GPU: input refusal, and the SM100 call convention
against the real lifted host functions (no SM100 GPU runs it here)."""

import json
from pathlib import Path

import pytest

from dsa_aot.errors import InputError

DATA = Path(__file__).resolve().parents[2] / "data"
SM100_SPARSE = (
    "dsa_sparse_attention_backward.bwd.nodeterministic.dim512.bf16.heads64.planes1.relay1.topk512.notopk_length.nowide.sm_100a",
    "dsa_sparse_attention_backward.bwd.deterministic.dim512.bf16.heads128.planes128.relay1.topk512.notopk_length.nowide.sm_100a",
)


def test_sparse_attention_reports_every_bad_input_before_anything_runs():
    torch = pytest.importorskip("torch")
    import dsa_aot.dsa

    q = torch.zeros(8, 64, 256, dtype=torch.bfloat16)
    kv = torch.zeros(16, 256, dtype=torch.bfloat16)
    out = torch.zeros(8, 64, 512, dtype=torch.float16)
    with pytest.raises(InputError) as ei:
        dsa_aot.dsa.sparse_attention_backward_into(q.clone(), kv.clone(), torch.zeros(64), q, kv, out, out, torch.zeros(8, 64), torch.zeros(64),
                                               torch.zeros(8, 100, dtype=torch.int64), block_tile=32, q_cluster_mode="x")
    msg = str(ei.value)
    for want in ("head dim D=256", "out: dtype torch.float16", "topk_idxs: dtype torch.int64", "block_tile=32", "q_cluster_mode='x'", "(expected cuda"):
        assert want in msg, (want, msg)


def test_the_wheel_builds_check_runs_on_a_packed_build(packed, tmp_path, sm100_calls):
    """ci/check_sm100_calls.py's main, the last step of ci/build-wheel.sh, on a build packed by the real stages from
    both SM100 entries: until stop 28 it asked the index for one SM count per arch (a signature gone since several
    targets per arch) and crashed on every real build; each entry now brings its own target's SM count."""
    packed(*SM100_SPARSE)
    counts, bad = sm100_calls.check_build(tmp_path / "gen")
    assert counts["SM100 sparse-backward"] == 2 and bad == [], (counts, bad)
    # main fails closed on a build without the other kinds: nothing checked is not a pass
    assert sm100_calls.main(["--gen", str(tmp_path / "gen")]) == 1


@pytest.mark.parametrize("name", SM100_SPARSE)
def test_sparse_attention_sm100_call_feeds_the_lifted_host_function(name, sm100_calls):
    """No SM100 GPU here: the op's SM100 call runs the real lifted launcher (with the JIT host code's
    own checks) in place of the driver (ci/check_sm100_calls.py, which the wheel build runs over every
    shipped SM100 entry). A call convention that drops an argument or a tensor is caught."""
    import dsa_aot.ops.dsa_sparse_attention_backward as sparse
    from dsa_aot.toolchain import lift, verify

    chk = sm100_calls
    d = DATA / name
    meta = json.loads((d / "meta.json").read_text())
    ns = verify.load_launcher(lift.lift((d / "host.mlir").read_text(), meta["host_function"], name, lift.cubin_param_layout((d / "kernel.cubin").read_bytes())))
    key = {k: meta["key"][k] for k in ("dtype", "heads", "dim", "topk", "topk_length", "deterministic", "planes", "relay", "wide")}
    for s_q, s_kv in ((300, 1000), (5000, 3000)):
        assert chk.check_call(ns, meta["op"], key, "sm_100a", 148, s_q, s_kv) == []
    # a call that passes q where kv belongs is caught
    real = sparse._sm100_call
    try:
        def q_for_kv(rec, *rest):
            rec.p = (*rec.p[:4], rec.p[3], *rec.p[5:])  # kv's pointer replaced by q's
            return real(rec, *rest)

        sparse._sm100_call = q_for_kv
        problems = chk.check_call(ns, meta["op"], key, "sm_100a", 148, 300, 1000)
    finally:
        sparse._sm100_call = real
    assert any("kv" in p.split(" never reach")[0].split(", ") for p in problems), problems
