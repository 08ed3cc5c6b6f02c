#!/usr/bin/env python3
"""JIT-vs-AOT parity of the DSA indexer top-k (indexer_top_k_wrapper), in two processes on one GPU machine.

    python ci/parity/dsa_indexer_top_k.py jit --dir D      # cudnn + cutlass importable: JIT path, writes D/jit.json
    python ci/parity/dsa_indexer_top_k.py aot --dir D      # cutlass NOT importable: dsa_aot.dsa, writes D/aot.json
    python ci/parity/dsa_indexer_top_k.py compare --dir D  # markdown table + D/parity.json; exit status 1 on any mismatch

``dsa_aot`` imports the ``dsa_aot`` package from the environment (the installed wheel, or
``PYTHONPATH=<repo root>`` for a source checkout with a build in ``dsa_aot/_generated``).

Both sides make the same public call with the same arguments::

    indexer_top_k(input_values, seq_lens, top_k, next_n, return_val, tie_break=.., deterministic=..)  -> {'indices', 'values'}

JIT: ``cudnn.deepseek_sparse_attention.indexer_top_k.indexer_top_k_wrapper`` and, with caller-owned
outputs and workspace, its class ``IndexerTopK(...).check_support() / compile() / execute(...)``; AOT:
``dsa_aot.dsa.indexer_top_k``, ``indexer_top_k_into`` and the plan ``dsa_aot.dsa.IndexerTopK(...).execute(...)``.

Cases (each a shipped entry of manifests/default.toml, at its own shape): float32 top-k 2048 on 8,
148 (the last small-occupancy count: upstream's ``n_rows > 148`` is a literal), 149 and 200 rows
(the 512-thread large variant), columns at a bucket's edge (4096 exactly, 4097 -> 8192) and inside
(50000 -> 65536, 100000 -> 131072); ``return_val=False``; ``deterministic=True`` on distinct values
and on values of few distinct levels (ties everywhere, +0 and -0 among them), with and without
values; bfloat16 and float16 (randn rounded: ties in every long row), both variants; top_k 512 and
1024, both variants; ``next_n=2`` (n_rows = 2 x batch: the speculative stagger); ``tie_break`` 1 and 2
on tied values, both variants; tie_break 0 non-deterministic on tied values. Every case's
``seq_lens`` hold 0, 1, a length < top_k, exactly top_k, top_k + 1 and num_cols, the rest random in
[0, num_cols]. ``--quick``: one or two cases per bucket group (12 cases). ``jit`` generates the inputs
from fixed seeds and saves them under D/inputs with the case list (D/inputs/cases.json, which ``dsa_aot``
follows; ``--quick`` and ``--only`` need only be given to ``jit``).

Per case and side: a first call of the allocating form (timed, synchronised; JIT: includes the
compile when its compile key is new in the process; AOT: includes the lazy cubin load when its entry
is new), then the allocating form again with its outputs and scratch served from a private torch
memory pool whose blocks were just filled with 0x7FAD7FAD (a NaN in float32, float16 and bfloat16,
an impossible id in int32), then the caller-buffer form on indices filled with 0x7EADBEEF, values
with NaN and the workspace with 0xFF (JIT: cudnn's ``IndexerTopK.execute``; AOT: ``_into``), then
(AOT) the plan on freshly poisoned buffers. Timing: warm median host time per call over ``--calls``
calls (allocating form; the caller-buffer form; AOT also the plan), the device synchronised every 16
calls outside the timed calls; ``torch.add`` on 16 elements as a yardstick; device time per call
(CUDA events, allocating form).

``compare`` checks, per case:

* every output of both sides against an fp64 reference written from the contract: row ``t`` sees
  ``L = clamp(seq_lens[t // next_n] - next_n + t % next_n + 1, 0, num_cols)`` columns; the first
  ``min(L, top_k)`` slots hold distinct ids in [0, L), the rest -1 (values: -inf); each value is the
  input's at its id, bitwise; the chosen ids are the top_k largest (values ordered as reals, +0 above
  -0, as the radix select orders their bits); ties at the cutoff: tie_break 1 (and tie_break 0 with
  ``deterministic``) keeps the smaller ids, 2 the larger ones: the chosen set must equal the
  reference's; with tie_break 0 non-deterministic and a tie at the cutoff any choice among the tied
  ids is valid (checked: the chosen values are the reference's top values, as a multiset);
  ``deterministic``: the valid ids ascending; otherwise the slot order is unspecified;
* AOT against JIT, each form against the same form (the plan against the JIT's ``execute``):
  ``deterministic`` -> bitwise (indices and values). Non-deterministic: upstream claims output slots
  with shared-memory atomics, so the order is not repeatable even from one cubin (its
  ``sort_selected_indices`` says so; the table shows whether the JIT reproduced its own order); the
  outputs are compared as per-row sets (ids sorted, values carried along, bitwise), which must be
  equal in every row whose choice is defined (tie_break 1 / 2, or no tie at the cutoff) and may
  differ only among the tied ids where tie_break 0 leaves the choice open;
* poison left in no output (caught by the reference check; counted to explain it); the inputs
  untouched on both sides; the same workspace size (AOT ``indexer_top_k_workspace_bytes`` = cudnn
  ``scratch_workspace_bytes``);
* both sides chose the same kernel: the AOT (op, key) lookup equals the JIT compile key that
  upstream's ``compile_topk_kernel`` used (dtype, column bucket, top_k, next_n, return_val,
  tie_break, deterministic, large = n_rows > 148), predicted here from the call, independently of
  dsa_aot.policy; the JIT cubin of that key (``indexer_top_k_decode_varlen._compile_cache``, taken from
  the host module's fatbin) has the sha256 of the shipped ``dsa_aot/_generated/index.json`` entry
  (family dsa_indexer_top_k, arch of the JIT device), as every cubin the JIT compiled must, and the
  deterministic ordering upstream resolved (its key's last field) is the entry's.
"""

from __future__ import annotations

import importlib
import os
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from parity_common import (  # noqa: E402
    SpiedAot,
    jit_side,
    aot_side,
    bitwise,
    cli,
    cubin_report,
    device_us,
    family_entries,
    first_call,
    jit_cubins,
    load_json,
    md_table,
    poisoned_workspace,
    print_summary,
    sha_status,
    shipped,
    verdict,
    warm_us,
    write_report,
)
from parity_common import host_copy as _host  # noqa: E402
from parity_common import key_str as _key_str  # noqa: E402
from parity_common import same as _same  # noqa: E402

FAMILY = "dsa_indexer_top_k"
POISON = 0x7EADBEEF  # int32 indices of the caller-buffer forms: not -1 (a legitimate output), not an id
POOL_POISON = 0x7FAD7FAD  # the pool of the allocating calls: NaN as float32 and as each float16 / bfloat16 half, not an id as int32
LARGE_ROWS = 148  # upstream's compile_topk_kernel: large_occupancy = num_rows > 148 (a literal)
COPY_BITS = 256  # upstream's default num_copy_bits, the only one shipped
WS_ALIGN = 128  # cudnn ws_align: the scratch rounded up to 128 bytes
SYNC_EVERY = 16
REF_CHUNK = 32  # rows per fp64 reference sort (memory)
SCRIPT = "ci/parity/dsa_indexer_top_k.py"
ESIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}

# ------------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------------


def build_cases(quick=False):
    """[(name, spec)]; spec: dtype, rows, cols, the call's options, the data kind, seed (stable across
    runs and --only filters)."""
    cases = []

    def add(name, rows, cols, q=False, **kw):
        if quick and not q:
            return
        spec = dict(dtype="float32", rows=rows, cols=cols, top_k=2048, next_n=1, return_val=True, tie_break=0, deterministic=False,
                    data="randn", levels=0, signed_zeros=False)  # fmt: skip
        spec.update(kw)
        assert spec["rows"] % spec["next_n"] == 0, name
        spec["seed"] = 9000 + zlib.crc32(name.encode()) % 100000
        cases.append((name, spec))

    # float32, top-k 2048: both occupancy variants, bucket edges and insides
    add("f32-r8-c4096", 8, 4096, q=True)  # bucket 4096 exactly
    add("f32-r200-c4097", 200, 4097, q=True)  # one past it: bucket 8192, large
    add("f32-r148-c50000", 148, 50000)  # the last small count, inside bucket 65536
    add("f32-r149-c100000", 149, 100000)  # the first large count, inside bucket 131072
    # deterministic: distinct values, and few levels (ties at every cutoff; the top level is +0 / -0 half and half)
    add("f32-det-r8-c4096", 8, 4096, deterministic=True)
    add("f32-det-ties-r200-c65536", 200, 65536, q=True, deterministic=True, data="levels", levels=16, signed_zeros=True)
    add("f32-det-ties-r37-c100000", 37, 100000, deterministic=True, data="levels", levels=24, signed_zeros=True)
    # without values
    add("f32-noval-r37-c16384", 37, 16384, return_val=False)
    add("f32-noval-r160-c32768", 160, 32768, q=True, return_val=False)
    add("f32-noval-det-ties-r8-c8192", 8, 8192, q=True, return_val=False, deterministic=True, data="levels", levels=12)
    add("f32-noval-det-r300-c131072", 300, 131072, return_val=False, deterministic=True)
    # 16-bit values (randn rounded: many equal values in every long row)
    add("bf16-r16-c16384", 16, 16384, q=True, dtype="bfloat16")
    add("bf16-r150-c32768", 150, 32768, dtype="bfloat16")
    add("f16-r8-c8192", 8, 8192, dtype="float16")
    add("f16-r149-c65536", 149, 65536, q=True, dtype="float16")
    # smaller top-k
    add("f32-k512-r4-c4096", 4, 4096, q=True, top_k=512)
    add("f32-k512-r300-c131072", 300, 131072, top_k=512)
    add("f32-k1024-r24-c9000", 24, 9000, top_k=1024)
    add("f32-k1024-r149-c16000", 149, 16000, q=True, top_k=1024)
    # speculative decoding: two rows per sequence
    add("f32-nextn2-r16-c8192", 16, 8192, q=True, next_n=2)
    add("f32-nextn2-r300-c32768", 300, 32768, next_n=2)
    # tie-breaks on tied values
    add("f32-tie1-r8-c4096", 8, 4096, q=True, tie_break=1, data="levels", levels=40)
    add("f32-tie1-r200-c65536", 200, 65536, tie_break=1, data="levels", levels=40)
    add("f32-tie2-r8-c4097", 8, 4097, tie_break=2, data="levels", levels=40)
    add("f32-tie2-r200-c65536", 200, 65536, q=True, tie_break=2, data="levels", levels=40)
    # tie_break 0, non-deterministic, on tied values: any tied choice is valid; compared as sets
    add("f32-tie0-ties-r64-c12000", 64, 12000, data="levels", levels=16)
    return cases


def label(spec):
    flags = [SHORT[spec["dtype"]], f"c{bucket(spec['cols'])}", f"k{spec['top_k']}"]
    flags += [f"n{spec['next_n']}"] if spec["next_n"] != 1 else []
    flags += [] if spec["return_val"] else ["noval"]
    flags += [f"tb{spec['tie_break']}"] if spec["tie_break"] else []
    flags += ["det"] if spec["deterministic"] else []
    flags += ["large" if spec["rows"] > LARGE_ROWS else "small"]
    return " ".join(flags)


def bucket(num_cols):
    """Upstream's column bucket (_bucket_num_cols): the next power of two."""
    return 1 if num_cols <= 0 else 1 << (num_cols - 1).bit_length()


def expected_key(spec):
    """The (op, key) upstream's compile_topk_kernel compiles for a case, in the index's terms
    (written from upstream's code, not from dsa_aot.policy)."""
    return ["top_k", {"dtype": spec["dtype"], "cols": bucket(spec["cols"]), "top_k": int(spec["top_k"]), "next_n": int(spec["next_n"]),
                      "return_val": bool(spec["return_val"]), "tie_break": int(spec["tie_break"]),
                      "deterministic": bool(spec["deterministic"]), "large": spec["rows"] > LARGE_ROWS}]  # fmt: skip


def workspace_bytes(spec):
    """cudnn's scratch_workspace_bytes: rows x (2 for float32, else 1) x cols int32, rounded up to 128."""
    n = spec["rows"] * (2 if spec["dtype"] == "float32" else 1) * spec["cols"] * 4
    return -(-n // WS_ALIGN) * WS_ALIGN


# ------------------------------------------------------------------------------------------------
# Inputs (torch only, CPU)
# ------------------------------------------------------------------------------------------------


def _torch_dtype(name):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def make_inputs(spec):
    """CPU inputs of one case: {x (rows, cols) of the case's dtype, seq_lens (rows // next_n,) int32}."""
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
    batch = rows // spec["next_n"]
    lens = torch.randint(0, cols + 1, (batch,), generator=gen, dtype=torch.int64)
    special = [cols, 0, min(cols, top_k // 3), min(cols, top_k), min(cols, top_k + 1), 1]
    for i, v in enumerate(special[:batch]):
        lens[i] = v
    return dict(x=x.to(_torch_dtype(spec["dtype"])).contiguous(), seq_lens=lens.to(torch.int32).contiguous())


# ------------------------------------------------------------------------------------------------
# Reference (fp64, CPU), written from the contract
# ------------------------------------------------------------------------------------------------

_BIG = 1 << 40  # sorts after every id
_TINY = 5e-324  # the smallest float64 subnormal: -0 maps to -_TINY, just below +0 and above every negative input


def lengths(seq_lens, rows, next_n, cols):
    """Valid columns of every row: clamp(seq_lens[t // next_n] - next_n + t % next_n + 1, 0, cols), int64."""
    import torch

    t = torch.arange(rows)
    s = seq_lens.to(torch.int64)[t // next_n]
    return (s - next_n + t % next_n + 1).clamp(0, cols)


def key64(v):
    """The order the op selects by, as float64 reals: the value, with -0 just below +0 (the radix select
    orders the float's bits: +0 above -0). Inputs are finite."""
    import torch

    k = v.double()
    return torch.where((k == 0) & torch.signbit(k), torch.full_like(k, -_TINY), k)


def reference(spec, x, seq_lens):
    """{L, n (valid slots per row), ids (rows, top_k) int32: the defined choice ascending then -1,
    keys (rows, top_k) float64: the chosen keys descending then -inf, tied (rows,) bool: a tie at the
    cutoff (another valid column equal to the last chosen value, left out)}."""
    import torch

    rows, cols = x.shape
    top_k, tb = spec["top_k"], spec["tie_break"]
    L = lengths(seq_lens, rows, spec["next_n"], cols)
    n = L.clamp(max=top_k)
    ids = torch.full((rows, top_k), -1, dtype=torch.int32)
    keys = torch.full((rows, top_k), float("-inf"), dtype=torch.float64)
    tied = torch.zeros(rows, dtype=torch.bool)
    col = torch.arange(cols)
    m = min(top_k, cols)
    for lo in range(0, rows, REF_CHUNK):
        hi = min(lo + REF_CHUNK, rows)
        k = torch.where(col.view(1, -1) < L[lo:hi].view(-1, 1), key64(x[lo:hi]), torch.tensor(float("-inf"), dtype=torch.float64))
        if tb == 2:  # larger ids first among equals: a stable sort of the reversed row
            k = k.flip(1)
        s, order = torch.sort(k, dim=1, descending=True, stable=True)  # stable: among equal keys the smaller (reversed) position first
        if tb == 2:
            order = cols - 1 - order
        nn = n[lo:hi].view(-1, 1)
        slot = torch.arange(m).view(1, -1) < nn
        chosen = torch.where(slot, order[:, :m], torch.full_like(order[:, :m], _BIG)).sort(dim=1).values
        ids[lo:hi, :m] = torch.where(slot, chosen, torch.full_like(chosen, -1)).to(torch.int32)
        keys[lo:hi, :m] = torch.where(slot, s[:, :m], torch.full_like(s[:, :m], float("-inf")))
        if cols > m:
            last = s.gather(1, (nn - 1).clamp(min=0)).view(-1)
            nxt = s.gather(1, nn.clamp(max=cols - 1)).view(-1)
            tied[lo:hi] = (n[lo:hi] >= 1) & (n[lo:hi] < L[lo:hi]) & (last == nxt)
    return dict(L=L, n=n, ids=ids, keys=keys, tied=tied)


def defined_rows(spec, ref):
    """Rows whose chosen set the contract fixes: every row with tie_break 1 / 2 or deterministic, else
    the rows without a tie at the cutoff."""
    import torch

    if spec["tie_break"] in (1, 2) or spec["deterministic"]:
        return torch.ones_like(ref["tied"])
    return ~ref["tied"]


def _ints(t):
    """A same-size integer view (bitwise comparison, NaN-safe)."""
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def check_output(spec, x, ref, ids, vals):
    """What is wrong with one output (ids (rows, top_k) int32, vals or None) against the reference:
    (problem texts, rows wrong, poison left)."""
    import torch

    rows, cols = x.shape
    top_k = spec["top_k"]
    if tuple(ids.shape) != (rows, top_k) or ids.dtype != torch.int32:
        return [f"indices: {ids.dtype} {tuple(ids.shape)}, expected int32 {(rows, top_k)}"], rows, 0
    if spec["return_val"] and (vals is None or tuple(vals.shape) != (rows, top_k) or vals.dtype != x.dtype):
        return [f"values: {None if vals is None else (vals.dtype, tuple(vals.shape))}, expected {x.dtype} {(rows, top_k)}"], rows, 0
    L, n = ref["L"].view(-1, 1), ref["n"].view(-1, 1)
    i64 = ids.to(torch.int64)
    slot = torch.arange(top_k).view(1, -1) < n
    poison = int(((ids == POISON) | (ids == POOL_POISON)).sum()) + (int(torch.isnan(vals.float()).sum()) if vals is not None else 0)
    problems, bad = [], torch.zeros(rows, dtype=torch.bool)

    def flag(mask, what):
        nonlocal bad
        if bool(mask.any()):
            r = mask.nonzero().view(-1).tolist()
            problems.append(f"{what} in {len(r)} rows (first {r[:4]})")
            bad |= mask

    flag(((ids != -1) & ~slot).any(1), "padding slots not -1")
    out_of_range = (slot & ((i64 < 0) | (i64 >= L))).any(1)
    flag(out_of_range, "ids outside [0, L)")
    srt = torch.where(slot, i64, torch.full_like(i64, _BIG)).sort(dim=1).values
    flag(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] != _BIG)).any(1), "repeated ids")
    if spec["deterministic"]:
        flag((slot[:, 1:] & (i64[:, 1:] <= i64[:, :-1])).any(1), "valid ids not ascending (deterministic)")
    safe = torch.where(slot, i64, torch.zeros_like(i64)).clamp(0, cols - 1)
    picked = x.gather(1, safe)
    want_ids = torch.where(slot, ref["ids"].to(torch.int64), torch.full_like(i64, _BIG))
    set_bad = (srt != want_ids).any(1)
    got_keys = torch.where(slot, key64(picked), torch.full((rows, top_k), float("-inf"), dtype=torch.float64)).sort(dim=1, descending=True).values
    keys_bad = (got_keys != ref["keys"]).any(1)
    defined = defined_rows(spec, ref)
    flag(defined & set_bad & ~out_of_range, "chosen ids differ from the defined choice")
    flag(~defined & keys_bad & ~out_of_range, "chosen values are not the top values (a tied cutoff, any tied ids allowed)")
    if vals is not None:
        want = torch.where(slot, picked, torch.full_like(picked, float("-inf")))
        flag((_ints(vals) != _ints(want)).any(1), "values not the input's at the ids (bitwise), or padding not -inf")
    return problems, int(bad.sum()), poison


def _by_id(ids, vals):
    """Rows sorted by id, the values carried along: the per-row set view of an output."""
    srt, perm = ids.to("cpu").sort(dim=1)
    return srt, (vals.gather(1, perm) if vals is not None else None)


def agreement(spec, ref, j_ids, j_vals, a_ids, a_vals):
    """(ok, text, numbers) of one AOT output against the JIT's: bitwise; else (non-deterministic) the
    same per-row sets in every row whose choice is defined."""
    eq_i, cnt_i = bitwise(j_ids, a_ids)
    eq_v, cnt_v = bitwise(j_vals, a_vals) if j_vals is not None and a_vals is not None else (j_vals is None and a_vals is None, 0)
    nums = {"bitwise": eq_i and eq_v, "differing": cnt_i + max(cnt_v, 0)}
    if eq_i and eq_v:
        return True, "bitwise", nums
    if tuple(j_ids.shape) != tuple(a_ids.shape) or (j_vals is None) != (a_vals is None):
        return False, "NO(shape)", nums
    order_rows = int(((j_ids != a_ids).any(1) | ((_ints(j_vals) != _ints(a_vals)).any(1) if j_vals is not None else False)).sum())
    nums["order_rows"] = order_rows
    if spec["deterministic"]:
        return False, f"NO({order_rows} rows)", nums
    js, jv = _by_id(j_ids, j_vals)
    as_, av = _by_id(a_ids, a_vals)
    diff = (js != as_).any(1)
    if jv is not None:
        diff |= (_ints(jv) != _ints(av)).any(1)
    bad = diff & defined_rows(spec, ref)
    nums.update(set_rows=int(diff.sum()), defined_set_rows=int(bad.sum()))
    if bool(bad.any()):
        return False, f"NO(sets: {int(bad.sum())} rows)", nums
    if bool(diff.any()):
        return True, f"ties({int(diff.sum())})", nums
    return True, f"sets({order_rows})", nums


# ------------------------------------------------------------------------------------------------
# One case, either side
# ------------------------------------------------------------------------------------------------


def _args(spec):
    """(top_k, next_n, return_val), {tie_break, deterministic}: the arguments both sides pass."""
    return (spec["top_k"], spec["next_n"], spec["return_val"]), dict(tie_break=spec["tie_break"], deterministic=spec["deterministic"])


def _alloc_bytes(spec):
    """Bytes of each tensor the allocating forms allocate, in their order: indices, values, scratch."""
    out = spec["rows"] * spec["top_k"]
    return [out * 4] + ([out * ESIZE[spec["dtype"]]] if spec["return_val"] else []) + [workspace_bytes(spec)]


def poisoned_alloc_call(fn, sizes):
    """fn() with its torch allocations served from a fresh private memory pool whose blocks were just
    filled with POOL_POISON (same sizes, same order: the pool hands the same blocks back).
    (result, pool (keep it alive while the result is), how)."""
    import torch

    pool_cls, use = getattr(torch.cuda, "MemPool", None), getattr(torch.cuda, "use_mem_pool", None)
    if pool_cls is None or use is None:
        return fn(), None, "unpoisoned (torch has no MemPool)"
    pool = pool_cls()
    with use(pool):
        bufs = [torch.empty(n, dtype=torch.uint8, device="cuda").view(torch.int32).fill_(POOL_POISON) for n in sizes]
        del bufs  # back to the pool, stream-ordered after the fills
        res = fn()
    return res, pool, "pool"


def poisoned_buffers(spec, ws_bytes, x):
    """Caller-owned outputs and workspace: indices POISON, values NaN, workspace 0xFF."""
    import torch

    rows, k = spec["rows"], spec["top_k"]
    b = {"indices": torch.full((rows, k), POISON, dtype=torch.int32, device="cuda"), "workspace": poisoned_workspace(ws_bytes)}
    b["values"] = torch.full((rows, k), float("nan"), dtype=x.dtype, device="cuda") if spec["return_val"] else None
    return b


def repoison(b):
    b["indices"].fill_(POISON)
    if b["values"] is not None:
        b["values"].fill_(float("nan"))
    b["workspace"].fill_(0xFF)


def _save(saved, form, outs):
    for n in ("indices", "values"):
        if outs.get(n) is not None:
            saved[f"{form}.{n}"] = _host(outs[n])


def run_case(name, spec, x, api, args, out_dir):
    """First call, poisoned allocating call, poisoned caller-buffer call, (AOT) poisoned plan, warm
    timing; saves outputs, returns the row."""
    import torch

    pristine = {k: v.clone() for k, v in x.items() if isinstance(v, torch.Tensor)}
    row = {"case": name, "label": label(spec), "spec": spec}
    saved, res = {}, {}
    api.begin_first(spec)
    row["first_s"] = first_call(lambda: res.update(api.call(spec, x)))
    row.update(api.end_first(spec))  # keys (op, key) used, new (compiled / loaded inside the call), key_error
    _save(saved, "first", res)
    res.clear()

    out, pool, row["alloc_poison"] = poisoned_alloc_call(lambda: api.call(spec, x), _alloc_bytes(spec))
    torch.cuda.synchronize()
    _save(saved, "alloc", out)
    del out, pool

    api.prepare(spec, x)  # JIT: cudnn's IndexerTopK for the case (its compile key is the first call's)
    row["workspace_bytes"] = ws = api.workspace_bytes(spec, x)
    bufs = poisoned_buffers(spec, ws, x["x"])
    into = api.into_fn(spec, x, bufs)
    into()
    torch.cuda.synchronize()
    _save(saved, "into", bufs)
    plan = None
    if hasattr(api, "plan"):
        repoison(bufs)
        plan = api.plan(spec, x, bufs)
        b = (bufs["indices"], bufs["values"], x["x"], x["seq_lens"], bufs["workspace"])
        plan.execute(*b)
        torch.cuda.synchronize()
        _save(saved, "plan", bufs)
    row["inputs_untouched"] = all(_same(x[k], v) for k, v in pristine.items())

    alloc = api.alloc_fn(spec, x)
    row["warm_us"] = warm_us(alloc, args.calls, sync_every=SYNC_EVERY)
    row["warm_into_us"] = warm_us(into, args.calls, sync_every=SYNC_EVERY)
    if plan is not None:
        row["warm_plan_us"] = warm_us(lambda: plan.execute(*b), args.calls, sync_every=SYNC_EVERY)
    row["device_us"] = device_us(alloc)
    torch.save(saved, os.path.join(out_dir, f"{name}.pt"))
    return row


def failed_row(name, spec, exc, side):
    """The row of a case that raised on ``side`` (printed; compare reports it as a failure)."""
    import traceback

    traceback.print_exc()
    print(f"{side} {name}: FAILED: {exc!r}", flush=True)
    return {"case": name, "label": label(spec), "spec": spec, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}


# ------------------------------------------------------------------------------------------------
# JIT side (cudnn + cutlass)
# ------------------------------------------------------------------------------------------------


class JitApi:
    def __init__(self):
        base = "cudnn.deepseek_sparse_attention.indexer_top_k"
        self.api = importlib.import_module(base + ".api")
        self.kmod = importlib.import_module(base + ".indexer_top_k_decode_varlen")  # imports cutlass
        self.wrapper, self.cls = self.api.indexer_top_k_wrapper, self.api.IndexerTopK
        self.dtype_names = {v: str(k).replace("torch.", "") for k, v in self.kmod._TORCH_TO_CUTLASS_DTYPE.items()}
        self._before, self.obj = None, None

    def index_key(self, kind, jit_key):
        """compile_topk_kernel's cache key (device, dtype, bucket, top_k, next_n, return_val,
        num_copy_bits, load_balance, large_occupancy, tie_break, deterministic, ordering) -> (op, key)
        as in dsa_aot/_generated/index.json (the ordering is derived there: checked separately)."""
        _dev, dt, cols, top_k, next_n, rv, _bits, _lb, large, tb, det, _order = jit_key
        return "top_k", {"dtype": self.dtype_names.get(dt, repr(dt)), "cols": int(cols), "top_k": int(top_k), "next_n": int(next_n),
                         "return_val": bool(rv), "tie_break": int(tb), "deterministic": bool(det), "large": bool(large)}  # fmt: skip

    def begin_first(self, spec):
        self._before = set(self.kmod._compile_cache)

    def end_first(self, spec):
        want = expected_key(spec)
        after = list(self.kmod._compile_cache)
        mine = [k for k in after if _key_str(self.index_key("top_k", k)) == _key_str(want)]
        new = [k for k in after if k not in self._before]
        res = {"keys": [want], "new": any(k in mine for k in new), "jit_ordering": [k[-1] for k in mine]}
        problems = []
        if not mine:
            problems.append(f"predicted compile key {want} not in cudnn's cache (it holds {[self.index_key('top_k', k)[1] for k in after]})")
        unexpected = [repr(k) for k in new if k not in mine]
        if unexpected:
            problems.append(f"compiled besides: {unexpected}")
        odd = [repr(k) for k in mine if k[6] != COPY_BITS or k[7]]
        if odd:
            problems.append(f"compiled with num_copy_bits != {COPY_BITS} or load_balance: {odd}")
        if problems:
            res["key_error"] = "; ".join(problems)
        return res

    def call(self, spec, x):
        a, kw = _args(spec)
        r = self.wrapper(x["x"], x["seq_lens"], *a, **kw)
        return {"indices": r["indices"], "values": r["values"]}

    def alloc_fn(self, spec, x):
        """The allocating call, its arguments bound (the warm loop times the op, not this script)."""
        (a, kw), fn, xx, sl = _args(spec), self.wrapper, x["x"], x["seq_lens"]
        return lambda: fn(xx, sl, *a, **kw)

    def prepare(self, spec, x):
        """cudnn's class for the case: built, checked and compiled (a cache hit: the first call compiled its key)."""
        a, kw = _args(spec)
        self.obj = self.cls(x["x"], x["seq_lens"], a[0], next_n=a[1], return_val=a[2], num_copy_bits=COPY_BITS, **kw)
        assert self.obj.check_support()
        self.obj.compile()

    def workspace_bytes(self, spec, x):
        return int(self.obj.scratch_workspace_bytes())

    def into_fn(self, spec, x, b):
        """cudnn's IndexerTopK.execute into the caller's buffers, its arguments bound."""
        ex, xx, sl, i, v, w = self.obj.execute, x["x"], x["seq_lens"], b["indices"], b["values"], b["workspace"]
        return lambda: ex(xx, sl, out_indices=i, out_values=v, workspace=w)

    def cubins(self):
        keys = list(self.kmod._compile_cache)
        found = jit_cubins((("top_k", self.kmod._compile_cache),), self.index_key)
        for c, k in zip(found, keys):
            c["ordering"] = k[-1]
        return found


def cmd_jit(args):
    jit_side(args, JitApi, build_cases, make_inputs, run_case,
             lambda r: f"warm {r['warm_us']:.1f} us (execute {r['warm_into_us']:.1f} us), device {r['device_us']:.1f} us", failed_row)


# ------------------------------------------------------------------------------------------------
# AOT side (no cutlass, no cudnn)
# ------------------------------------------------------------------------------------------------


class AotApi(SpiedAot):
    OP_MODULE = "dsa_aot.ops.dsa_indexer_top_k"
    CACHES = ("TOP_K.cache",)

    def call(self, spec, x):
        a, kw = _args(spec)
        r = self.dsa.indexer_top_k(x["x"], x["seq_lens"], *a, **kw)
        return {"indices": r["indices"], "values": r["values"]}

    def alloc_fn(self, spec, x):
        """The allocating call, its arguments bound (the warm loop times the op, not this script)."""
        (a, kw), fn, xx, sl = _args(spec), self.dsa.indexer_top_k, x["x"], x["seq_lens"]
        return lambda: fn(xx, sl, *a, **kw)

    def prepare(self, spec, x):
        pass

    def workspace_bytes(self, spec, x):
        return int(self.dsa.indexer_top_k_workspace_bytes(x["x"]))

    def into_fn(self, spec, x, b):
        """indexer_top_k_into the caller's buffers, its arguments bound."""
        (a, kw), fn, xx, sl, i, v, w = _args(spec), self.dsa.indexer_top_k_into, x["x"], x["seq_lens"], b["indices"], b["values"], b["workspace"]
        return lambda: fn(i, v, xx, sl, *a, workspace=w, **kw)

    def plan(self, spec, x, b):
        a, kw = _args(spec)
        return self.dsa.IndexerTopK(b["indices"], b["values"], x["x"], x["seq_lens"], a[0], next_n=a[1], return_val=a[2], workspace=b["workspace"],
                                    **kw)  # fmt: skip


def cmd_aot(args):
    aot_side(args, SCRIPT, FAMILY, AotApi, run_case,
             lambda r: (f"warm {r['warm_us']:.1f} us (into {r['warm_into_us']:.1f} us, plan {r['warm_plan_us']:.1f} us), "
                        f"device {r['device_us']:.1f} us"), failed_row)


# ------------------------------------------------------------------------------------------------
# Compare
# ------------------------------------------------------------------------------------------------

# AOT form -> the JIT form it is compared with (the plan and _into against cudnn's class execute)
FORMS = (("first", "first"), ("alloc", "alloc"), ("into", "into"), ("plan", "into"))


def _outputs(saved, form):
    """(indices, values or None) of one saved form, or None when the form was not saved."""
    if f"{form}.indices" not in saved:
        return None
    return saved[f"{form}.indices"], saved.get(f"{form}.values")


def ordering_failures(cubins, entries):
    """The deterministic ordering upstream resolved for each compiled key against the shipped entry's
    (the build records it in the entry's key)."""
    fails = []
    for c in cubins:
        for e in shipped(entries or [], c["op"], c["key"]):
            have = (e.get("key") or {}).get("ordering", e.get("ordering"))
            if have is not None and c.get("ordering") is not None and have != c["ordering"]:
                fails.append(f"JIT cubin {c['op']} {c['key']}: upstream resolved ordering {c['ordering']!r}, the shipped entry {e.get('id')} has {have!r}")
    return fails


def cmd_compare(args):
    import torch

    jit = load_json(os.path.join(args.dir, "jit.json"), SCRIPT, "jit", args.dir)
    aot = load_json(os.path.join(args.dir, "aot.json"), SCRIPT, "aot", args.dir)
    if jit is None or aot is None:
        return 1
    arch = jit["meta"].get("arch", "sm_90a")
    entries = family_entries(aot.get("index"), FAMILY, arch)
    failures, lines, report = [], [], []
    jit_repeat = {"bitwise": 0, "order": 0}
    header = ("case", "kernel", "AOT = JIT (first / alloc / into / plan)", "= reference (JIT / AOT)", "tied rows", "kernels", "sha256",
              "JIT 1st s", "AOT 1st ms", "JIT warm us (execute)", "AOT warm us (into / plan)", "device us JIT/AOT")  # fmt: skip

    for name, jr in jit["rows"].items():
        spec = jr["spec"]
        ar = aot["rows"].get(name)
        rep = {"case": name, "spec": spec, "jit": {k: jr.get(k) for k in ("first_s", "warm_us", "warm_into_us", "device_us", "new", "keys",
                                                                          "jit_ordering", "workspace_bytes", "alloc_poison")}}  # fmt: skip
        report.append(rep)
        if ar is None or "error" in ar or "error" in jr:
            why = [f"{side} raised {r['error']}" for side, r in (("jit", jr), ("aot", ar or {})) if "error" in r]
            why += ["not run on the aot side"] if ar is None else []
            failures += [f"{name}: {w}" for w in why]
            lines.append((name, jr["label"], "; ".join(w.split(":")[0] for w in why)) + ("",) * (len(header) - 3))
            continue
        rep["aot"] = {k: ar.get(k) for k in ("first_s", "warm_us", "warm_into_us", "warm_plan_us", "device_us", "new", "keys", "loaded",
                                             "workspace_bytes", "alloc_poison")}  # fmt: skip
        jo = torch.load(os.path.join(args.dir, "jit", f"{name}.pt"))
        ao = torch.load(os.path.join(args.dir, "aot", f"{name}.pt"))
        inp = torch.load(os.path.join(args.dir, "inputs", f"{name}.pt"))
        x = inp["x"]
        ref = reference(spec, x, inp["seq_lens"])
        n_tied = int(ref["tied"].sum())
        undefined = int((~defined_rows(spec, ref)).sum())
        rep.update(tied_rows=n_tied, undefined_rows=undefined)
        ok_row = True

        # AOT against JIT, form by form
        forms = []
        for af, jf in FORMS:
            a, j = _outputs(ao, af), _outputs(jo, jf)
            if a is None or j is None:
                forms.append("missing")
                ok_row = False
                failures.append(f"{name}: {af if a is None else jf} outputs not saved on the {'aot' if a is None else 'jit'} side")
                continue
            ok, text, nums = agreement(spec, ref, j[0], j[1], a[0], a[1])
            rep[f"aot {af} vs jit {jf}"] = dict(nums, verdict=text)
            forms.append(text)
            if not ok:
                ok_row = False
                failures.append(f"{name}: AOT {af} vs JIT {jf}: {text} ({nums})")

        # the JIT against itself (is the slot order repeatable?): information only
        js = [_outputs(jo, f) for f in ("first", "alloc", "into")]
        same_jit = all(o is not None for o in js) and all(bitwise(js[0][0], o[0])[0] and (o[1] is None or bitwise(js[0][1], o[1])[0])
                                                          for o in js[1:])  # fmt: skip
        rep["jit_self_bitwise"] = same_jit
        jit_repeat["bitwise" if same_jit else "order"] += 1

        # every output of both sides against the fp64 reference
        ref_text = []
        for side, saved in (("jit", jo), ("aot", ao)):
            bad_forms = []
            for form in sorted({k.split(".", 1)[0] for k in saved}):
                ids, vals = _outputs(saved, form)
                probs, bad_rows, poison = check_output(spec, x, ref, ids, vals)
                rep[f"{side} {form} = reference"] = {"problems": probs, "rows": bad_rows, "poison_left": poison}
                if probs:
                    bad_forms.append(form)
                    failures.append(f"{name}: {side.upper()} {form}: " + "; ".join(probs) + (f" ({poison} poisoned elements left)" if poison else ""))
            ref_text.append("yes" if not bad_forms else f"NO({','.join(bad_forms)})")
            ok_row &= not bad_forms

        for side, r in (("jit", jr), ("aot", ar)):
            if not r.get("inputs_untouched", False):
                ok_row = False
                failures.append(f"{name}: inputs modified on the {side} side")
            if r.get("alloc_poison") != "pool":
                rep.setdefault("notes", []).append(f"{side}: allocating call {r.get('alloc_poison')}")
        if jr.get("workspace_bytes") != ar.get("workspace_bytes") or jr.get("workspace_bytes") != workspace_bytes(spec):
            ok_row = False
            failures.append(f"{name}: workspace bytes JIT {jr.get('workspace_bytes')}, AOT {ar.get('workspace_bytes')}, "
                            f"upstream's formula {workspace_bytes(spec)}")
        if jr.get("key_error"):
            ok_row = False
            failures.append(f"{name}: {jr['key_error']}")
        same_kernels = sorted(map(_key_str, jr["keys"])) == sorted(map(_key_str, ar["keys"]))
        if not same_kernels:
            ok_row = False
            failures.append(f"{name}: kernels differ: JIT compile keys {jr['keys']}, AOT looked up {ar['keys']}")
        sha = sha_status(jr["keys"], jit["cubins"], entries)
        if sha != "yes":
            ok_row = False
            failures.append(f"{name}: cubin sha256 {sha} for {jr['keys']}")
        rep.update(kernels_same=same_kernels, sha256=sha, ok=ok_row)
        lines.append((
            name, jr["label"], " / ".join(forms), " / ".join(ref_text), f"{n_tied}" + (f" ({undefined} open)" if undefined else ""),
            "same" if same_kernels else "NO", sha,
            f"{jr['first_s']:.3f}{'' if jr.get('new') else '*'}", f"{1e3 * ar['first_s']:.2f}{'' if ar.get('new') else '*'}",
            f"{jr['warm_us']:.1f} ({jr['warm_into_us']:.1f})", f"{ar['warm_us']:.1f} ({ar['warm_into_us']:.1f} / {ar.get('warm_plan_us', float('nan')):.1f})",
            f"{jr['device_us']:.1f} / {ar['device_us']:.1f}",
        ))  # fmt: skip
    for name in aot["rows"]:
        if name not in jit["rows"]:
            failures.append(f"{name}: run on the aot side only")

    # every cubin the JIT compiled, against the shipped one (and the ordering upstream resolved)
    cubins, cubin_fails = cubin_report(jit.get("cubins", []), entries)
    failures += cubin_fails + ordering_failures(jit.get("cubins", []), entries)

    print(md_table(header, lines))
    print("\n(* = the first call compiled (JIT) / loaded (AOT) nothing new: its key was already used by an earlier case)")
    print("AOT = JIT: bitwise = indices and values bitwise equal; sets(N) = the same ids and values per row, in another slot order in N "
          "rows (non-deterministic: upstream claims output slots with shared-memory atomics); ties(N) = N rows chose other ids among "
          "values tied at the cutoff, which tie_break 0 without deterministic leaves open (both choices pass the reference). "
          "tied rows: rows with a tie at the cutoff (open: rows whose choice the contract leaves open).")
    print(f"the JIT reproduced its own outputs bitwise (first / alloc / execute) in {jit_repeat['bitwise']} of "
          f"{jit_repeat['bitwise'] + jit_repeat['order']} cases")
    jm, am = jit["meta"], aot["meta"]
    print(f"device: {jm.get('device')} ({jm.get('sm_count')} SMs), arch {arch}; torch {jm.get('torch')}; reference fp64 (this script)"
          + ("; --quick" if jm.get("quick") else ""))
    polls = sorted({f"{s}: {r.get('alloc_poison')}" for s, rows in (("jit", jit["rows"]), ("aot", aot["rows"])) for r in rows.values()
                    if r.get("alloc_poison") != "pool"})  # fmt: skip
    if polls:
        print(f"note: allocating calls not poisoned ({', '.join(polls)}): their unwritten elements are caught only by the reference")
    print_summary(jm, am, cubins, jit["rows"], aot["rows"], into_label="_into")
    write_report(args.dir, failures, arch, report, cubins, jm, am)
    return verdict(failures, f"{len(lines)} cases: every output equal to the fp64 reference, AOT = JIT (bitwise where deterministic, "
                             "per-row sets where defined), same kernels, every cubin sha256 equal")


def main(argv=None):
    return cli(__doc__, cmd_jit, cmd_aot, cmd_compare, argv, extra=(
        ("--quick", dict(action="store_true", help="jit: 12 cases (one or two per bucket group)")),
    ))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
