"""Malformed calls of every public op: each raises an dsa_aot.errors exception and changes nothing.

More than 10,000 calls, each a valid call (tests/unit/op_calls.py, on the small build and the stand-in
driver) with one or two arguments made wrong: a tensor's dtype, rank, shape, layout, contiguity,
alignment or device; an output or the workspace aliasing an input; a scalar of the wrong type or out
of range (fp32 overflow, NaN, bools, floats for ints, unhashable lists); a bad stream (a number out of
range, a string, a stream of another device, a handle the driver does not know). Every call must
raise an dsa_aot.errors class, launch and memset nothing, and leave every tensor it was given byte for
byte as it was. The count per exception class is printed.
"""

import collections
import inspect
import random

import pytest
import torch

import op_calls
import stand_in
from dsa_aot.errors import AotError

# values no parameter of that name accepts
BAD = {
    "ratio": [3, 4.0, "4", None, [4], True, -4, 2**70],
    "coff": [0, 3, 2.0, None, "2", [2]],
    "head_dim": [0, -1, "128", 128.0, [128], 2**40, True],
    "total_comp": [-1, 2**40, "1", 1.5, [1], True],
    "deterministic": [2, "yes", None, [True], 0.5],
    "sm_scale": [1e39, -1e39, float("nan"), float("inf"), "0.1", None, [0.1], True, 1j],
    "loss_coeff": [1e39, float("nan"), float("-inf"), "1", None, [1.0], False],
    "softmax_scale": [1e39, float("nan"), float("inf"), "0.1", [0.1], True],
    "block_I": [64, 128.0, "128", None, [128], True],
    "block_tile": [32, 64.0, "64", None, [64]],
    "backend": ["v3", None, ["default"], 3, {"a": 1}],
    "deterministic_dk_planes": [100, 96.0, None, "96", [96], True],
    "topk_indices_global": [2, "no", None, [False], 0.5],
    "q_cluster_mode": ["x", None, ["off"], 0, "adaptive_pair"],
    "topk_length": ["x", [1], 3],
    "device": ["cuda:9", -1, "cpu", 1.5, [0], "gpu"],
    "top_k": [0, 2049, 512.0, "512", None, [512], True],
    "microbatch_rows": [-2, 1.5, "64", None, [0], True, 2**40],
    "max_seqlen_q": [-1, 2**40, 300.0, "300", [300], True, 10**6],
    "max_seqlen_k": [-1, 2**40, 180.0, "180", [180], True],
}
BAD_STREAMS = [-1, 2**64, "s0", 3.5, [0], True, 2**64 - 1]  # 2**64-1: the real driver answers INVALID_HANDLE
NO_MISALIGN = ("cu_seqlens", "cu_seqlens_comp", "lse", "logits", "softmax")  # their required alignment is their element size


def _other_dtype(t, name):
    if name == "local_indices":  # int32 and int64 ids are both valid there
        return torch.float32
    return {torch.bfloat16: torch.float32, torch.float32: torch.bfloat16, torch.int32: torch.int64, torch.int64: torch.int32, torch.uint8: torch.int32}[t.dtype]


def _tensor_mutations(name, t, inputs, env):
    """(what, replacement) for tensor argument ``name`` = ``t`` (on cuda:0)."""
    out = [("dtype", stand_in.cuda_tensor(torch.zeros(t.shape, dtype=_other_dtype(t, name)))), ("cpu", torch.zeros(t.shape, dtype=t.dtype)), ("cuda:1", stand_in.cuda_tensor(torch.zeros(t.shape, dtype=t.dtype), 1)),
           ("not a tensor", t.tolist() if t.numel() < 8 else "tensor"), ("sparse", torch.zeros(2, 2).to_sparse())]
    if name != "grad_loss":  # any single-element fp32 tensor is a valid grad_loss, as upstream's reshape(1)
        out.append(("rank", t.unsqueeze(0)))
    if t.shape[-1] > 1:
        out.append(("shape", t[..., :-1].contiguous()))
        flat = torch.zeros(t.numel() * 2, dtype=t.dtype)[::2].view(t.shape) if t.ndim == 1 else t.transpose(-1, -2)
        if t.ndim == 1 or t.shape[-2] > 1:
            out.append(("strides", stand_in.cuda_tensor(flat) if t.ndim == 1 else flat))
    if name not in NO_MISALIGN:
        off = torch.zeros(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
        out.append(("misaligned", stand_in.cuda_tensor(off)))
    for other, u in inputs:
        if other != name and u is not None and u.numel():
            out.append((f"aliases {other}", u))  # an output or the workspace given an input
    return out


def _malformed(fn, bound, outputs, env, rng):
    """One malformed variant of the valid call ``bound`` (name -> value): (kwargs, what was changed)."""
    names = [n for n in bound if n in BAD or n == "stream" or isinstance(bound[n], torch.Tensor)]
    inputs = [(n, v) for n, v in bound.items() if isinstance(v, torch.Tensor) and n not in outputs]
    kw, what = dict(bound), []
    for name in rng.sample(names, k=min(len(names), rng.choice((1, 1, 2)))):
        v = bound[name]
        if name == "stream":
            choice = rng.choice(BAD_STREAMS + ["other device"])
            kw[name] = env.new_stream(1) if choice == "other device" else choice
            what.append(f"stream={choice!r}")
        elif isinstance(v, torch.Tensor):
            pool = _tensor_mutations(name, v, inputs if name in outputs else [], env)
            if any(w.endswith(": shape") for w in what):  # two tensors cut alike can be a valid call of a shape-free op (local_to_global)
                pool = [m for m in pool if m[0] != "shape"]
            if fn.__name__ == "local_to_global":  # its one tensor may have any (B, S_q, K)
                pool = [m for m in pool if m[0] != "shape"]
            if fn.__name__ in ("local_to_global", "compactify"):  # one tensor: on another GPU (its stream too) is a valid call
                pool = [m for m in pool if m[0] != "cuda:1"]
            if fn.__name__ == "compactify":  # (1, rows, cols) is a valid (B, S, cols)
                pool = [m for m in pool if m[0] != "rank"]
            if name == "cand_buffer" and bound.get("cu_seqlens_q") is not None:  # THD: its size follows device values, trusted as upstream does
                pool = [m for m in pool if m[0] != "shape"]
            if fn.__name__.startswith("indexer_top_k"):
                if name == "input_values":  # one column fewer is the same bucket
                    pool = [m for m in pool if m[0] != "shape"]
                if fn.__name__ == "indexer_top_k" and name in ("input_values", "seq_lens"):  # the allocating form stages these, as upstream
                    pool = [m for m in pool if m[0] not in ("strides", "misaligned")]
                if name in ("indices", "values", "seq_lens"):  # their alignment is their element size, as upstream's
                    pool = [m for m in pool if m[0] != "misaligned"]
            if fn.__name__.startswith("dense_indexer_backward") and name == "grad_loss":  # 4-byte aligned, as upstream binds it
                pool = [m for m in pool if m[0] != "misaligned"]
            label, kw[name] = rng.choice(pool)
            what.append(f"{name}: {label}")
        else:
            bad = BAD[name]
            if name == "max_seqlen_q" and fn.__name__.startswith(("dense_indexer", "dense_attn")):  # a larger THD grid whose extra CTAs exit: valid
                bad = [v for v in bad if v != 10**6]
            kw[name] = rng.choice(bad)
            what.append(f"{name}={kw[name]!r}")
    return kw, what


def _cases(env):
    """(public function, valid bound arguments, names of the arguments it writes) for every public op."""
    import dsa_aot.csa
    import dsa_aot.dsa

    out = []
    for family, make in op_calls.FAMILIES.items():
        fn, args, kw, writes = make(0, env.new_stream(0))
        fn(*args, **kw)  # the base call is valid
        bound = dict(inspect.signature(fn).bind(*args, **kw).arguments)
        names = {n for n, v in bound.items() if any(v is w for w in writes)}
        out.append((fn, bound, names))
        # the allocating form of the same call: the outputs (and workspace) left to the op
        alloc = getattr(dsa_aot.csa if family.startswith("csa") else dsa_aot.dsa, fn.__name__[: -len("_into")])
        params = inspect.signature(alloc).parameters
        abound = {n: v for n, v in bound.items() if n in params and not (n in names and params[n].default is None)}
        if family == "csa_forward":
            abound["total_comp"] = bound["out"].shape[0]
        out.append((alloc, abound, names & set(abound)))
    out.append((dsa_aot.csa.backward_workspace_bytes, {"total_comp": 16, "ratio": 4, "head_dim": 128, "coff": 2}, set()))
    out.append((dsa_aot.dsa.indexer_backward_workspace_bytes, {"batch": 1, "seqlen_k": 64, "head_dim": 128}, set()))
    out.append((dsa_aot.dsa.sparse_attention_backward_workspace_bytes, {"total_s_q": 8, "total_s_kv": 64, "head_dim": 512, "num_heads": 64}, set()))
    return out


def test_ten_thousand_malformed_calls_raise_aot_errors_and_change_nothing(env, torch_steps, capsys):
    rng = random.Random(20261130)
    counts, by_op = collections.Counter(), collections.Counter()
    cases = _cases(env)
    env.launches.clear()
    env.memsets.clear()
    per_case = 10_000 // len(cases) + 1
    for fn, bound, writes in cases:
        tensors = [v for v in bound.values() if isinstance(v, torch.Tensor)]
        before = [stand_in.contents(t) for t in tensors]
        for _ in range(per_case):
            kw, what = _malformed(fn, bound, writes, env, rng)
            try:
                fn(**kw)
            except AotError as e:
                counts[type(e).__name__] += 1
                by_op[fn.__name__] += 1
            except Exception as e:  # noqa: BLE001
                pytest.fail(f"{fn.__name__} with {what}: {type(e).__name__}: {e}")
            else:
                pytest.fail(f"{fn.__name__} with {what}: accepted")
            assert not env.launches and not env.memsets, (fn.__name__, what)
        assert [stand_in.contents(t) for t in tensors] == before, fn.__name__
    with capsys.disabled():
        print(f"\nmalformed calls: {sum(counts.values())} ({', '.join(f'{k} {v}' for k, v in counts.most_common())}); per op: {dict(by_op)}")
    assert sum(counts.values()) >= 10_000
    assert set(by_op) == {c[0].__name__ for c in cases}


class _Opaque:
    """An argument of no type any op takes (and not hashable)."""

    __hash__ = None


def _unhashable_and_foreign(v) -> list:
    """Values of wrong type for a parameter whose valid value is ``v``: unhashable ones (a list, a dict, a
    set) and an object of no known type; a tensor parameter's too (it must not reach a key lookup)."""
    return [[v], {"v": v}, {1, 2}, _Opaque()]


def _declared_bad(fn, name) -> list:
    """A declared op's own malformed values for option ``name`` (out of range, wrong type: dsa_aot.ops.declare)."""
    from dsa_aot.ops import declare

    for op in declare.OPS:
        if fn.__name__ in (op.name, op.name + "_into"):
            opt = op._by_name.get(name)
            return opt.bad_values() if isinstance(opt, declare._Option) else []
    return []


def test_every_option_of_every_op_refuses_wrong_types_and_unhashable_values(env, torch_steps):
    """Each non-tensor parameter of each public op (defaults included: an option a valid call leaves at its
    default too), given a list, a dict, a set or a foreign object: an dsa_aot.errors class, nothing launched
    or written (a cache key built from it raised a bare TypeError: unhashable type, issue 30)."""
    cases = _cases(env)
    env.launches.clear()
    env.memsets.clear()
    tried, escapes = 0, []
    for fn, bound, writes in cases:
        full = inspect.signature(fn).bind(**bound)
        full.apply_defaults()
        tensors = [v for v in full.arguments.values() if isinstance(v, torch.Tensor)]
        before = [stand_in.contents(t) for t in tensors]
        for name, v in full.arguments.items():
            if isinstance(v, torch.Tensor) or name == "stream" or inspect.signature(fn).parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                continue
            for bad in _unhashable_and_foreign(v) + _declared_bad(fn, name):
                tried += 1
                try:
                    fn(**dict(full.arguments, **{name: bad}))
                except AotError:
                    pass
                except Exception as e:  # noqa: BLE001
                    escapes.append(f"{fn.__name__}({name}={bad!r}): {type(e).__name__}: {e}")
                else:
                    escapes.append(f"{fn.__name__}({name}={bad!r}): accepted")
                if env.launches or env.memsets:
                    escapes.append(f"{fn.__name__}({name}={bad!r}): launched or memset before refusing")
                    env.launches.clear()
                    env.memsets.clear()
        assert [stand_in.contents(t) for t in tensors] == before, fn.__name__
    assert not escapes, f"{len(escapes)} of {tried} calls escaped:\n" + "\n".join(escapes)
    assert tried > 400, tried


def test_preload_refuses_a_bad_device(env):
    import dsa_aot.runtime

    for bad in BAD["device"]:
        with pytest.raises(AotError):
            dsa_aot.runtime.preload(bad)


def test_malformed_sm100_calls_raise_aot_errors_and_change_nothing(sm100_env, capsys):
    """The same for the SM100 paths the SM90 build has no twin of here (the fused indexer top-k, BSHD and
    THD; the sparse indexer score recompute's SM100 call), on a capability-10.0 stand-in over the sm100
    build: 1,000 malformed calls each."""
    rng = random.Random(20261201)
    env = sm100_env
    counts = collections.Counter()
    cases = []
    for make in op_calls.SM100_FAMILIES.values():
        fn, args, kw, writes = make(0, env.new_stream(0))
        fn(*args, **kw)  # the base call is valid
        bound = dict(inspect.signature(fn).bind(*args, **kw).arguments)
        cases.append((fn, bound, {n for n, v in bound.items() if any(v is w for w in writes)}))
    env.launches.clear()
    env.memsets.clear()
    for fn, bound, writes in cases:
        tensors = [v for v in bound.values() if isinstance(v, torch.Tensor)]
        before = [stand_in.contents(t) for t in tensors]
        for _ in range(1000):
            kw, what = _malformed(fn, bound, writes, env, rng)
            try:
                fn(**kw)
            except AotError as e:
                counts[type(e).__name__] += 1
            except Exception as e:  # noqa: BLE001
                pytest.fail(f"{fn.__name__} with {what}: {type(e).__name__}: {e}")
            else:
                pytest.fail(f"{fn.__name__} with {what}: accepted")
            assert not env.launches and not env.memsets, (fn.__name__, what)
        assert [stand_in.contents(t) for t in tensors] == before, fn.__name__
    with capsys.disabled():
        print(f"\nmalformed SM100 calls: {sum(counts.values())} ({', '.join(f'{k} {v}' for k, v in counts.most_common())})")
    assert sum(counts.values()) == 1000 * len(cases)
