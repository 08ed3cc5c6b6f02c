"""What the fp64 references of the DSA families share: the error measure and the input generators'
building blocks (kept bit-for-bit: the same seed gives the same inputs as before the split)."""

from __future__ import annotations

import math

import torch


def rel_err(out, ref) -> float:
    """``||out - ref|| / ||ref||`` (Frobenius, float64). ``0`` when both are all-zero, ``inf`` when
    only ``ref`` is."""
    o = out.detach().to(torch.float64)
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    num = torch.linalg.vector_norm(o - r).item()
    den = torch.linalg.vector_norm(r).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def generator(seed) -> torch.Generator:
    """A CPU generator: seeded, or from fresh entropy when ``seed`` is None."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


def distinct_ids(rows: int, n: int, topk: int, gen) -> torch.Tensor:
    """(rows, topk) int64: per row ``topk`` distinct ids in [0, n), in random slot order (chunked so
    the (rows, n) draw stays under 16M elements)."""
    ids = torch.empty(rows, topk, dtype=torch.int64)
    step = max(1, (1 << 24) // max(1, n))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        chosen = torch.rand(r1 - r0, n, generator=gen).topk(topk, dim=-1).indices
        order = torch.rand(r1 - r0, topk, generator=gen).argsort(dim=-1)
        ids[r0:r1] = chosen.gather(-1, order)
    return ids


def one_value(x, what) -> float:
    """A Python float from a number or a one-element tensor (``what`` names it in the error)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{what} must have one element, got shape {tuple(x.shape)}")
        return float(x.detach().reshape(-1)[0].item())
    return float(x)


def shipped_keys(family, fields, op=None, arch="sm_90a") -> list:
    """The GPU tests' entry lists: sorted distinct tuples of ``fields`` of the build's ``family`` entries
    (of ``op`` when given) for ``arch``; empty where there is no build (collection must not fail on a
    machine without one: each test file checks its list against the manifest)."""
    from dsa_aot.errors import AotError
    from dsa_aot.runtime.index import index

    try:
        entries = index().entries
    except AotError:
        return []
    keys = {tuple(e["key"][f] for f in fields) for e in entries if e["family"] == family and e["arch"] == arch and (op is None or e["op"] == op)}
    return sorted(keys)


# --- what the GPU op tests share -------------------------------------------------------------------------


def same_bits(a, b) -> bool:
    """Bitwise equal (NaN payloads compare equal to themselves): shape, dtype and every byte."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def refusals_write_nothing(cases, watched) -> None:
    """Each ``(name, exception class(es), match, call)`` raises before any write: every tensor of ``watched``
    keeps its bits."""
    import pytest

    before = [t.clone() for t in watched]
    for name, exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()
        torch.cuda.synchronize()
        for t, b in zip(watched, before):
            assert same_bits(t, b), f"{name}: a tensor was written before the refusal"


def poison(*tensors):
    """NaN in every floating-point tensor, 0xFF in every other: what an op that did not write leaves.
    Returns the first (``out = poison(torch.empty(...))``)."""
    for t in tensors:
        t.fill_(math.nan if t.is_floating_point() else 0xFF)
    return tensors[0] if tensors else None


def captured(call):
    """A CUDA graph of ``call()``, captured on a side stream (as torch requires); run nothing."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            call()
    torch.cuda.synchronize()
    return g


def replay_on(graph, new_values, poisoned) -> None:
    """Copy each ``(captured buffer, new value)`` in, :func:`poison` the ``poisoned`` outputs and workspaces, replay."""
    for dst, src in new_values:
        dst.copy_(src)
    poison(*poisoned)
    graph.replay()
    torch.cuda.synchronize()


def both_forms(into, allocating, outs, wants, inputs, what, check) -> float:
    """The score ops' two forms on one case: ``into()`` (writing the poisoned ``outs``, returning them)
    and ``allocating()`` (a dict with "out" and "denom"); each output against ``wants`` by
    ``check(got, want, what)`` (which returns the error), and no input's bits changed. The worst error."""
    keep = [t.clone() for t in inputs]
    r_into = into()
    r = allocating()
    torch.cuda.synchronize()
    assert all(a is b for a, b in zip(r_into, outs)), f"{what}: the _into form did not return its outputs"
    worst = 0.0
    for form, got in (("_into", outs), ("allocating", (r["out"], r["denom"]))):
        for name, g, w in zip(("out", "denom"), got, wants):
            worst = max(worst, check(g, w, f"{what} {form} {name}"))
    for t, b in zip(inputs, keep):
        assert same_bits(t, b), f"{what}: an input was modified"
    return worst
