#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA indexer top-k (indexer_top_k_wrapper): ci/parity/harness.py runs it.

Both sides make the same public call, ``indexer_top_k(input_values, seq_lens, top_k, next_n, return_val,
tie_break=.., deterministic=..)`` -> {'indices', 'values'}: cudnn's ``indexer_top_k_wrapper`` and
``dsa_aot.dsa.indexer_top_k`` (and ``indexer_top_k_into`` on the caller's 0xFF workspace, whose size, cudnn's
``IndexerTopK.scratch_workspace_bytes`` vs ``indexer_top_k_workspace_bytes``, the harness compares).

Cases (each a shipped entry of manifests/default.toml, at its own shape): float32 top-k 2048 on 8, 148 (the last
small-occupancy count: upstream's ``n_rows > 148`` is a literal), 149 and 200 rows (the 512-thread large variant),
columns at a bucket's edge (4096, 4097 -> 8192) and inside (50000, 100000); ``return_val=False``;
``deterministic`` on distinct values and on few levels (ties everywhere, +0 and -0 among them), with and without
values; bfloat16 and float16 (randn rounded: ties in every long row); top_k 512 and 1024; ``next_n=2``;
``tie_break`` 1 and 2 on tied values; tie_break 0 on tied values. Every case's ``seq_lens`` hold 0, 1, a length
< top_k, top_k, top_k + 1 and num_cols, the rest random in [0, num_cols]. ``--quick``: 12 cases.

Rules: ``deterministic``: indices and values bitwise. Otherwise upstream claims output slots with shared-memory
atomics, so the slot order is not repeatable even on one cubin: the outputs are compared as per-row sets (ids
sorted, values carried along, bitwise), equal in every row, except that with tie_break 0 a row may choose other
ids among values tied at the cutoff when the AOT's choice passes the reference. Reference: both sides' outputs
against tests/gpu/ref_indexer_top_k.check (distinct ids of the valid columns then -1 / -inf, the top values by
the radix order (+0 above -0), the defined choice under tie_break 1 / 2 or ``deterministic``, ascending ids
with ``deterministic``, each value the input's at its id, bitwise).
"""

import functools
import importlib
import json
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Aot, Jit, Parity, bitwise, load_ref, poisoned_workspace  # noqa: E402

BASE = "cudnn.deepseek_sparse_attention.indexer_top_k"


def cases(quick):
    out = []

    def add(name, rows, cols, q=False, **kw):
        if quick and not q:
            return
        spec = {**dict(dtype="float32", rows=rows, cols=cols, top_k=2048, next_n=1, return_val=True, tie_break=0, deterministic=False,
                       data="randn", levels=0, signed_zeros=False), **kw}
        assert spec["rows"] % spec["next_n"] == 0, name
        out.append((name, dict(spec, seed=9000 + zlib.crc32(name.encode()) % 100000)))

    add("f32-r8-c4096", 8, 4096, q=True)  # bucket 4096 exactly
    add("f32-r200-c4097", 200, 4097, q=True)  # one past it: bucket 8192, large
    add("f32-r148-c50000", 148, 50000)  # the last small count, inside bucket 65536
    add("f32-r149-c100000", 149, 100000)  # the first large count, inside bucket 131072
    add("f32-det-r8-c4096", 8, 4096, deterministic=True)
    add("f32-det-ties-r200-c65536", 200, 65536, q=True, deterministic=True, data="levels", levels=16, signed_zeros=True)
    add("f32-det-ties-r37-c100000", 37, 100000, deterministic=True, data="levels", levels=24, signed_zeros=True)
    add("f32-noval-r37-c16384", 37, 16384, return_val=False)
    add("f32-noval-r160-c32768", 160, 32768, q=True, return_val=False)
    add("f32-noval-det-ties-r8-c8192", 8, 8192, q=True, return_val=False, deterministic=True, data="levels", levels=12)
    add("f32-noval-det-r300-c131072", 300, 131072, return_val=False, deterministic=True)
    add("bf16-r16-c16384", 16, 16384, q=True, dtype="bfloat16")
    add("bf16-r150-c32768", 150, 32768, dtype="bfloat16")
    add("f16-r8-c8192", 8, 8192, dtype="float16")
    add("f16-r149-c65536", 149, 65536, q=True, dtype="float16")
    add("f32-k512-r4-c4096", 4, 4096, q=True, top_k=512)
    add("f32-k512-r300-c131072", 300, 131072, top_k=512)
    add("f32-k1024-r24-c9000", 24, 9000, top_k=1024)
    add("f32-k1024-r149-c16000", 149, 16000, q=True, top_k=1024)
    add("f32-nextn2-r16-c8192", 16, 8192, q=True, next_n=2)  # speculative decoding: two rows per sequence
    add("f32-nextn2-r300-c32768", 300, 32768, next_n=2)
    add("f32-tie1-r8-c4096", 8, 4096, q=True, tie_break=1, data="levels", levels=40)
    add("f32-tie1-r200-c65536", 200, 65536, tie_break=1, data="levels", levels=40)
    add("f32-tie2-r8-c4097", 8, 4097, tie_break=2, data="levels", levels=40)
    add("f32-tie2-r200-c65536", 200, 65536, q=True, tie_break=2, data="levels", levels=40)
    add("f32-tie0-ties-r64-c12000", 64, 12000, data="levels", levels=16)
    return out


def label(s):
    flags = [{"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[s["dtype"]], f"c{1 << (s['cols'] - 1).bit_length()}", f"k{s['top_k']}"]
    flags += ([f"n{s['next_n']}"] if s["next_n"] != 1 else []) + ([] if s["return_val"] else ["noval"])
    flags += ([f"tb{s['tie_break']}"] if s["tie_break"] else []) + (["det"] if s["deterministic"] else [])
    return " ".join(flags + ["large" if s["rows"] > 148 else "small"])


def inputs(spec):
    """{x (rows, cols) of the case's dtype, seq_lens (rows // next_n,) int32}."""
    import torch

    gen = torch.Generator().manual_seed(int(spec["seed"]))
    rows, cols, top_k = spec["rows"], spec["cols"], spec["top_k"]
    if spec["data"] == "levels":  # levels, 1/4 apart: a cutoff inside a long run of equal values
        lv = spec["levels"]
        if spec["signed_zeros"]:  # 0 the top level, half +0 and half -0: long rows cut near the +0 / -0 boundary
            v = torch.randint(0, lv, (rows, cols), generator=gen).float() * 0.25
            zero = torch.where(torch.rand(rows, cols, generator=gen) < 0.5, torch.tensor(0.0), torch.tensor(-0.0))
            x = torch.where(v == 0, zero, -v)
        else:
            x = (torch.randint(0, lv, (rows, cols), generator=gen) - lv // 2).float() * 0.25
    else:
        x = torch.randn((rows, cols), generator=gen)
    lens = torch.randint(0, cols + 1, (rows // spec["next_n"],), generator=gen, dtype=torch.int64)
    for i, v in enumerate([cols, 0, min(cols, top_k // 3), min(cols, top_k), min(cols, top_k + 1), 1][: len(lens)]):
        lens[i] = v
    return dict(x=x.to(getattr(torch, spec["dtype"])).contiguous(), seq_lens=lens.to(torch.int32).contiguous())


def outputs(spec):
    return {"indices": agree, **({"values": agree} if spec["return_val"] else {})}


def reference(spec, x, outs):
    import torch

    shape = (spec["rows"], spec["top_k"])
    bad = [f"{n}: {outs[n].dtype} {tuple(outs[n].shape)}, expected {dt} {shape}" for n, dt in (("indices", torch.int32), ("values", x["x"].dtype))
           if n in outs and (tuple(outs[n].shape) != shape or outs[n].dtype != dt)]
    if not bad:  # the check gathers the values at the ids: not past the row (those rows fail on their ids)
        ids = outs["indices"]
        fits = bool(((ids >= -1) & (ids < spec["cols"])).all())
        bad = load_ref("ref_indexer_top_k.py").check(x["x"], x["seq_lens"], ids, outs.get("values") if fits else None, spec["top_k"], spec["next_n"],
                                                     spec["tie_break"], spec["deterministic"])
    return bad[:8] + [f"... {len(bad) - 8} more"] * (len(bad) > 8)


@functools.lru_cache(maxsize=1)
def _inputs_of(key):
    """A rule gets no inputs: the case's, made again from its seed (as the jit step made them)."""
    return inputs(json.loads(key))


def _rows_differ(a, b):
    """Per row: does any output differ (bitwise)?"""
    import torch

    bits = lambda t: t.view(torch.int32 if t.element_size() == 4 else torch.int16)  # noqa: E731
    return torch.stack([(bits(a[n]) != bits(b[n])).any(1) for n in a]).any(0)


def _by_id(o):
    """Every row's slots sorted by id, the values carried along: the per-row set view of an output."""
    ids, perm = o["indices"].sort(dim=1)
    return {"indices": ids, **({"values": o["values"].gather(1, perm)} if "values" in o else {})}


def agree(spec, j, a):
    """AOT vs JIT, one call's outputs: bitwise, or (not deterministic) per-row sets; see the module docstring."""
    eq = [bitwise(j[n], a[n]) for n in j]
    if all(e for e, _ in eq):
        return True, "bitwise"
    if any(c < 0 for _, c in eq):
        return False, "NO (shape or dtype)"
    if spec["deterministic"]:
        return False, f"NO ({sum(c for _, c in eq)} differ, deterministic)"
    moved, sets = int(_rows_differ(j, a).sum()), int(_rows_differ(_by_id(j), _by_id(a)).sum())
    if not sets:
        return True, f"sets ({moved} rows in another slot order)"
    bad = [] if spec["tie_break"] else reference(spec, _inputs_of(json.dumps(spec, sort_keys=True)), a)
    if spec["tie_break"] or bad:
        return False, f"NO (the sets differ in {sets} rows{'; ' + bad[0] if bad else ''})"
    return True, f"ties ({sets} rows chose other ids among values tied at the cutoff)"


def _args(spec):
    """(top_k, next_n, return_val), {tie_break, deterministic}: the arguments both sides pass."""
    return (spec["top_k"], spec["next_n"], spec["return_val"]), dict(tie_break=spec["tie_break"], deterministic=spec["deterministic"])


def buffers(side, api, spec, x):
    a, kw = _args(spec)
    n = api.IndexerTopK(x["x"], x["seq_lens"], *a, **kw).scratch_workspace_bytes() if side == "jit" else api.indexer_top_k_workspace_bytes(x["x"])
    return {"workspace": poisoned_workspace(n)}


def _setup():
    importlib.import_module(BASE + ".indexer_top_k_decode_varlen")  # cutlass: cudnn's import time, not its first call's
    return importlib.import_module(BASE)


def _index_key(kind, k):
    """compile_topk_kernel's key -> the index's. Its last field, the deterministic ordering upstream resolves,
    is derived for the entry (its cubin's sha256 shows a difference); num_copy_bits 256 is the only one shipped."""
    _dev, dt, cols, top_k, next_n, rv, bits, load_balance, large, tb, det, _ordering = k
    assert bits == 256 and not load_balance, f"cudnn compiled num_copy_bits {bits}, load_balance {load_balance}: not shipped"
    return "top_k", {"dtype": str(dt).lower(), "cols": int(cols), "top_k": int(top_k), "next_n": int(next_n), "return_val": bool(rv),
                     "tie_break": int(tb), "deterministic": bool(det), "large": bool(large)}


def _call(fn, spec, x):
    a, kw = _args(spec)
    return fn(x["x"], x["seq_lens"], *a, **kw)


def _into(dsa, spec, x, b):
    a, kw = _args(spec)
    dsa.indexer_top_k_into(b["indices"], b.get("values"), x["x"], x["seq_lens"], *a, workspace=b["workspace"], **kw)
    return b


PARITY = Parity(
    family="dsa_indexer_top_k", doc=__doc__, cases=cases, inputs=inputs, outputs=outputs, buffers=buffers, reference=reference, label=label,
    jit=Jit(setup=_setup, caches={"top_k": (BASE + ".indexer_top_k_decode_varlen", "_compile_cache")}, index_key=_index_key,
            call=lambda api, spec, x, b: _call(api.indexer_top_k_wrapper, spec, x)),
    aot=Aot(call=lambda dsa, spec, x, b: _call(dsa.indexer_top_k, spec, x), into=_into),
    quick="12 cases (one or two per bucket group)", bench=("f32-r148-c50000", "f32-r149-c100000"),
)

if __name__ == "__main__":
    sys.exit(PARITY.main())
