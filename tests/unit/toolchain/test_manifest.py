"""dsa_aot.toolchain.manifest: expansion of the default manifest and the errors of bad ones."""

import pytest

from dsa_aot.toolchain import manifest
from dsa_aot.errors import ManifestError

GOOD_TARGET = """
[[target]]
name = "h200"
arch = "sm_90a"
sm_count = 132
"""


def bucket(body):
    return GOOD_TARGET + "\n[[bucket]]\nfamily = \"csa_compressor\"\n" + body


def test_default_manifest_expands_every_csa_entry_for_both_arches():
    m = manifest.load("manifests/default.toml")
    arches = {e.target.arch for e in m.entries}
    assert arches == {"sm_90a", "sm_100a", "sm_103a"}
    per_arch = [e for e in m.entries if e.target.arch == "sm_90a" and e.family == "csa_compressor"]
    ops = {}
    for e in per_arch:
        ops[e.op] = ops.get(e.op, 0) + 1
    # fwd_r128: coff 2 x d 2 x 3 buckets; bwd_r128: x 2 buckets x 2 det; fwd: ratio 2 x coff 2 x d 2; bwd x det 2; reduce 2
    assert ops == {"fwd_r128": 12, "bwd_r128": 16, "fwd": 8, "bwd": 16, "dape_reduce": 2}
    assert len({e.id for e in m.entries}) == len(m.entries)


def test_default_manifest_has_an_sm103a_entry_for_every_sm100a_entry():
    """Blackwell Ultra (issue 15): every SM100 key again for sm_103a on B300 (148 SMs), and on GB300 (152 SMs)
    exactly the ops that bake the SM count in (each policy's SM_COUNT_OPS; the rest serve any SM count), with
    the keys upstream derives from the count (the non-deterministic v2 GEMM's rows_per_cta, ceil(B*S_q / SMs))
    that the op's own policy finds for S_q 4096 and 8192 on each target."""
    from dsa_aot.policy.dsa_indexer_backward import kernels
    from dsa_aot.policy.families import family_policy

    m = manifest.load("manifests/default.toml")
    by = {t: {(e.family, e.op, e.key) for e in m.entries if e.target.name == t} for t in ("b200", "b300", "gb300")}
    assert {t.name: (t.arch, t.sm_count) for t in m.targets if t.arch == "sm_103a"} == {"b300": ("sm_103a", 148), "gb300": ("sm_103a", 152)}
    assert by["b300"] == by["b200"] and len(by["b200"]) > 1000
    assert {(f, op) for f, op, _ in by["gb300"]} == {(f, op) for f, op, _ in by["b200"] if op in family_policy(f).SM_COUNT_OPS}
    for target, sms in (("b200", 148), ("b300", 148), ("gb300", 152)):
        arch = "sm_100a" if target == "b200" else "sm_103a"
        for s_q in (4096, 8192):
            for topk in (512, 1024, 1536, 2048):
                op, key = kernels(arch, 1, s_q, 64, topk, backend="sm100_v2", d_weights_f32=True, target_sm_count=sms)["gemm"]
                assert ("dsa_indexer_backward", op, tuple(sorted(key.items()))) in by[target], (target, s_q, key)


def test_an_op_needed_beside_another_may_come_from_another_sm_count_of_the_arch_unless_it_bakes_the_count_in():
    """The companion check answers as the run time looks entries up (Index.find): a GEMM on GB300 finds its
    score-grad (SM-count free) on B300, the same arch; on another arch, or for no target of the arch, it does not."""
    head = ('format = 1\n[[target]]\nname = "b300"\narch = "sm_103a"\nsm_count = 148\n'
            '[[target]]\nname = "gb300"\narch = "sm_103a"\nsm_count = 152\n'
            '[[target]]\nname = "b200"\narch = "sm_100a"\nsm_count = 148\n')
    gemm = ('[[bucket]]\nfamily = "dsa_indexer_backward"\nop = "gemm"\nheads = 64\ntopk = 1024\ntopk_global = false\n'
            'persistent = false\npdl = true\ndeterministic = false\nplanes = 96\ntargets = {}\n')
    grad = '[[bucket]]\nfamily = "dsa_indexer_backward"\nop = "score_grad"\ntopk = 1024\nzero_dk = true\ntargets = {}\n'
    m = manifest.loads(head + gemm.format('["b300", "gb300"]') + grad.format('["b300"]'))
    assert sorted(e.id for e in m.entries if e.op == "gemm")[1].endswith(".sm_103a.sm152")
    with pytest.raises(ManifestError, match=r"sm_100a: needs dsa_indexer_backward/score_grad .* for target b200"):
        manifest.loads(head + gemm.format('["gb300", "b200"]') + grad.format('["b300"]'))
    with pytest.raises(ManifestError, match=r"sm152: needs dsa_indexer_backward/score_grad .* for target gb300"):
        manifest.loads(head + gemm.format('["gb300"]') + grad.format('["b200"]'))


def test_bucket_expands_cartesian_product():
    m = manifest.loads(bucket('op = "fwd"\nratio = [2, 4]\ncoff = 1\nd = [64, 96, 128]\n'))
    assert sorted((e.key_dict["ratio"], e.key_dict["d"]) for e in m.entries) == [(2, 64), (2, 96), (2, 128), (4, 64), (4, 96), (4, 128)]


def test_every_problem_is_reported_at_once_with_allowed_values():
    text = """
[[target]]
name = "x"
arch = "sm_80"
sm_count = 148
[[target]]
name = "h200"
arch = "sm_90a"
sm_count = 132
[[bucket]]
family = "csa_compressor"
op = "fwd_r128"
ratio = 128
coff = [1, 3]
d = 256
bucket = "tiny"
[[bucket]]
family = "flash"
op = "x"
[[bucket]]
family = "csa_compressor"
op = "nope"
"""
    with pytest.raises(ManifestError) as ei:
        manifest.loads(text, "bad.toml")
    msg = str(ei.value)
    assert "bad.toml" in msg
    assert "unknown arch 'sm_80'" in msg and "sm_90a" in msg
    assert "coff = 3 is outside the kernel's envelope (allowed: 1, 2)" in msg
    assert "d = 256 is outside the kernel's envelope (allowed: 128, 512)" in msg
    assert "bucket = 'tiny'" in msg and "'small', 'default', 'large'" in msg
    assert "unknown family 'flash'" in msg and "csa_compressor" in msg
    assert "unknown op 'nope'" in msg and "fwd_r128" in msg
    assert len(ei.value.problems) == 6


def test_duplicate_bucket_is_rejected():
    text = bucket('op = "dape_reduce"\nsplit = true\n') + '\n[[bucket]]\nfamily = "csa_compressor"\nop = "dape_reduce"\nsplit = [false, true]\n'
    with pytest.raises(ManifestError, match="duplicate bucket"):
        manifest.loads(text)


def test_deterministic_backward_requires_its_reduction_kernel():
    with pytest.raises(ManifestError, match=r"needs csa_compressor/dape_reduce \{'split': True\}.*split = true"):
        manifest.loads(bucket('op = "bwd"\nratio = 4\ncoff = 2\nd = 128\ndeterministic = true\n'))
    m = manifest.loads(bucket('op = "bwd"\nratio = 4\ncoff = 2\nd = 128\ndeterministic = true\n')
                       + '[[bucket]]\nfamily = "csa_compressor"\nop = "dape_reduce"\nsplit = true\n')
    assert len(m.entries) == 2


def test_missing_and_unknown_fields_and_bad_types():
    with pytest.raises(ManifestError) as ei:
        manifest.loads(bucket('op = "fwd"\nratio = 4\nd = 128\nheads = 2\n'))
    msg = str(ei.value)
    assert "missing field 'coff'" in msg and "unknown field 'heads'" in msg
    with pytest.raises(ManifestError, match=r"d = True is outside"):
        manifest.loads(bucket('op = "fwd"\nratio = 4\ncoff = 1\nd = true\n'))


def test_manifest_is_data_not_code(tmp_path):
    # a family name is looked up in a fixed table, never imported from the file
    with pytest.raises(ManifestError, match="unknown family 'os.system'"):
        manifest.loads(bucket('op = "fwd"\n').replace('"csa_compressor"', '"os.system"'))
    with pytest.raises(ManifestError, match="not valid TOML"):
        manifest.loads("[[target]\n")
    with pytest.raises(ManifestError, match="cannot read"):
        manifest.load(tmp_path / "missing.toml")


def test_targets_select_entries():
    text = GOOD_TARGET + '[[target]]\nname = "b200"\narch = "sm_100a"\nsm_count = 148\n' + \
        '[[bucket]]\nfamily = "csa_compressor"\nop = "dape_reduce"\nsplit = false\ntargets = ["b200"]\n'
    m = manifest.loads(text)
    assert [e.target.arch for e in m.entries] == ["sm_100a"]


def test_default_manifest_indexer_backward_entries():
    m = manifest.load("manifests/default.toml")
    ib = [e for e in m.entries if e.family == "dsa_indexer_backward"]
    by = {}
    for e in ib:
        by.setdefault((e.target.arch, e.op), []).append(e.key_dict)
    # SM90 twins: score-grad per topk, GEMM per topk x index convention
    assert len(by[("sm_90a", "score_grad_sm90")]) == 4 and len(by[("sm_90a", "gemm_sm90")]) == 8
    # SM100: every anchor topk, H32 and H64, both conventions, deterministic planes, v2 at S_q 4096/8192
    gemm = by[("sm_100a", "gemm")]
    assert {(k["heads"], k["topk"]) for k in gemm if not k["deterministic"]} == {(h, t) for h in (32, 64) for t in (512, 1024, 1536, 2048)}
    assert {k["planes"] for k in gemm if k["deterministic"]} == {96, 128, 148}
    assert all(k["persistent"] == (k["topk"] == 512 or k["deterministic"]) for k in gemm)
    assert {k["rows_per_cta"] for k in by[("sm_100a", "gemm_v2")]} == {28, 56, 43, 86}
    assert {k["rows_per_cta"] for k in by[("sm_103a", "gemm_v2")]} == {28, 56, 27, 54, 43, 86}  # B300 148 SMs, GB300 152
    assert len(by[("sm_100a", "reduce_dk")]) == 6 and len(by[("sm_100a", "score_grad")]) == 8
    assert not any(e.target.arch == "sm_90a" and e.op in ("gemm", "gemm_v2", "score_grad", "reduce_dk") for e in ib)


def test_op_of_another_arch_is_refused():
    text = GOOD_TARGET + '\n[[bucket]]\nfamily = "dsa_indexer_backward"\nop = "reduce_dk"\nout = "bf16"\nplanes = 96\n'
    with pytest.raises(ManifestError, match=r"exists for \['sm_100a', 'sm_103a'\] only, not target h200"):
        manifest.loads(text)


def test_gemm_key_must_follow_upstream_persistence_policy():
    text = """
[[target]]
name = "b200"
arch = "sm_100a"
sm_count = 148

[[bucket]]
family = "dsa_indexer_backward"
op = "gemm"
heads = 64
topk = [512, 1024]
topk_global = false
persistent = false
pdl = true
deterministic = false
planes = 96
"""
    with pytest.raises(ManifestError) as ei:
        manifest.loads(text)
    assert "upstream always runs topk 512 persistent" in str(ei.value)
    assert "needs dsa_indexer_backward/score_grad" in str(ei.value)


def test_targets_of_one_arch_differ_in_sm_count():
    """A second SM count of an arch is another target (ids name the SM count: tests/unit/runtime/test_targets.py);
    the same arch and SM count twice is refused."""
    text = GOOD_TARGET + '\n[[target]]\nname = "h100"\narch = "sm_90a"\nsm_count = 114\n\n[[bucket]]\nfamily = "csa_compressor"\nop = "dape_reduce"\nsplit = true\n'
    assert sorted(e.id.rsplit(".", 1)[1] for e in manifest.loads(text).entries) == ["sm114", "sm132"]
    with pytest.raises(ManifestError, match="sm_90a with 132 SMs is target"):
        manifest.loads(text.replace("sm_count = 114", "sm_count = 132"))


def test_a_float32_key_field_takes_float32_values_only():
    """The SM90 dense indexer bakes its scale into the cubin as a float32: the manifest lists float32 values
    (two doubles with one float32 are one cubin); the double 1/sqrt(128) is refused with the value to write."""
    body = GOOD_TARGET + '\n[[bucket]]\nfamily = "dsa_score_recompute"\nop = "dense_indexer_sm90"\nheads = 64\nratio = 4\noffsets = false\n'
    m = manifest.loads(body + "scale = [1.0, 0.0883883461356163]\n")
    assert sorted(e.key_dict["scale"] for e in m.entries) == [0.0883883461356163, 1.0]
    for bad in ("0.08838834764831845", "1e39", "nan", "1"):
        with pytest.raises(ManifestError, match="float32"):
            manifest.loads(body + f"scale = {bad}\n")
