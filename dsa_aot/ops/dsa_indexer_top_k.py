"""DSA indexer top-k: cudnn's indexer_top_k_wrapper (and its IndexerTopK plan), from shipped cubins.

Per row ``t`` of ``input_values`` (n_rows, num_cols) the ``top_k`` largest values among the row's
first ``seq_lens[t // next_n] - next_n + t % next_n + 1`` columns: their column ids (int32) and, with
``return_val``, their values; a row with fewer valid columns is padded with -1 / -inf. ``tie_break``
picks among equal values at the cutoff (0 any, 1 smaller id, 2 larger id); ``deterministic`` makes
the choice repeatable and returns the valid ids in ascending order. ``n_rows`` must be
``seq_lens.numel() * next_n``; ``0 <= seq_lens[b] <= num_cols`` is the caller's to keep (upstream
does not read the lengths back either).

Which entry serves a call is :mod:`dsa_aot.policy.dsa_indexer_top_k` (upstream's compile key: the dtype,
the column bucket, top_k, next_n, the flags, ``n_rows > 148``). Upstream launches on torch's current
stream through TVM-FFI; here the stream is an argument like every op's (None: torch's current stream
of the input's device). Rows whose int32 radix scratch would overflow are launched in chunks, as
upstream does.
"""

from __future__ import annotations

from ..policy import dsa_indexer_top_k as policy
from ._support import (aliasing, alloc_on, allocate, check, flag, footprint, input_error, integer, launcher, one_of, require, stream_handle,
                       writes_only)
from .outputs import Outputs
from .plan import ALLOC, Plan, Recorder, cached, compile_call, fresh, probe_for, remember, remembered

__all__ = ["indexer_top_k", "indexer_top_k_into", "indexer_top_k_workspace_bytes", "IndexerTopK"]

FAMILY = policy.FAMILY
_I32 = 2**31 - 1
_CACHE: dict = {}
_TENSORS = ("indices", "values", "input_values", "seq_lens", "workspace")
_DTYPE_NAMES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}


def _is_tensor(t) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and t.layout == torch.strided


def _dtype_name(t) -> str | None:
    return _DTYPE_NAMES.get(str(getattr(t, "dtype", None)))


def _options(problems, top_k, next_n, return_val, num_copy_bits, tie_break, deterministic):
    integer(problems, "top_k", top_k, 1, policy.MAX_TOP_K)
    integer(problems, "next_n", next_n, 1, 1024)
    flag(problems, "return_val", return_val)
    one_of(problems, "tie_break", tie_break, (0, 1, 2))
    flag(problems, "deterministic", deterministic)
    if not (type(num_copy_bits) is int and num_copy_bits == policy.COPY_BITS):
        problems.append(f"num_copy_bits={num_copy_bits!r}: the build ships upstream's default {policy.COPY_BITS} only")


def _inputs(problems, input_values, seq_lens, next_n, staged=False):
    """dev, (n_rows, num_cols) of valid inputs (problems appended otherwise). ``staged``: the layout
    and alignment of both are not checked (the allocating form copies them as upstream does)."""
    import torch

    dev = None
    if not _is_tensor(input_values) or input_values.ndim != 2 or _dtype_name(input_values) is None:
        problems.append(f"input_values: expected a 2-D (n_rows, num_cols) float32, float16 or bfloat16 CUDA tensor, got "
                        f"{getattr(input_values, 'dtype', type(input_values).__name__)} {tuple(getattr(input_values, 'shape', ()))}")
        return None, None
    dev = input_values.device.index if input_values.device.type == "cuda" else None
    if staged:
        if dev is None:
            problems.append(f"input_values: on {input_values.device} (expected a CUDA tensor)")
    else:
        check(problems, input_values, "input_values", input_values.shape, input_values.dtype, dev, policy.ALIGN)
    n_rows, num_cols = input_values.shape
    if n_rows > _I32 or num_cols > policy.MAX_COLS:
        problems.append(f"input_values: {n_rows} x {num_cols} (at most {_I32} rows of {policy.MAX_COLS} columns)")
    if not _is_tensor(seq_lens) or seq_lens.ndim != 1:
        problems.append(f"seq_lens: expected a 1-D int32 CUDA tensor (one length per batch), got {getattr(seq_lens, 'shape', type(seq_lens).__name__)}")
    elif staged:
        if seq_lens.dtype != torch.int32 or seq_lens.device != input_values.device:
            problems.append(f"seq_lens: {seq_lens.dtype} on {seq_lens.device} (expected int32 on {input_values.device}, the input's device)")
    else:
        check(problems, seq_lens, "seq_lens", seq_lens.shape, torch.int32, dev, 4)
    if _is_tensor(seq_lens) and seq_lens.ndim == 1:
        if type(next_n) is int and next_n >= 1 and n_rows != seq_lens.shape[0] * next_n:
            problems.append(f"input_values: {n_rows} rows, expected seq_lens.numel() * next_n = {seq_lens.shape[0]} * {next_n} "
                            f"(for independent rows use next_n=1 and one length per row)")
    return dev, (n_rows, num_cols)


def indexer_top_k_workspace_bytes(input_values) -> int:
    """Bytes of the int32 radix scratch a call on ``input_values`` (n_rows, num_cols) needs (upstream's
    ``IndexerTopK.scratch_workspace_bytes``): a 1-D uint8 tensor, 32-byte aligned."""
    n_rows, num_cols = input_values.shape
    return policy.workspace_bytes(n_rows, num_cols, _dtype_name(input_values) or "float32")


def _plan_top_k(indices, values, input_values, seq_lens, top_k, next_n=1, return_val=True, num_copy_bits=256, tie_break=0,
                deterministic=False, workspace=None):
    """Validate an indexer_top_k call into caller-provided outputs and compile what it does."""
    import torch

    problems = []
    _options(problems, top_k, next_n, return_val, num_copy_bits, tie_break, deterministic)
    dev, shape = _inputs(problems, input_values, seq_lens, next_n)
    need = 0
    if shape is not None and not problems:
        n_rows, num_cols = shape
        dtype = _dtype_name(input_values)
        check(problems, indices, "indices", (n_rows, top_k), torch.int32, dev, 4)
        if return_val:
            check(problems, values, "values", (n_rows, top_k), input_values.dtype, dev, input_values.element_size())
        elif values is not None:
            problems.append("values: must be None when return_val=False")
        need = policy.workspace_bytes(n_rows, num_cols, dtype) if n_rows and num_cols else 0
        if need:
            if workspace is None:
                problems.append(f"workspace: missing ({need} uint8 bytes needed; see dsa_aot.dsa.indexer_top_k_workspace_bytes)")
            elif not _is_tensor(workspace) or workspace.ndim != 1:
                problems.append(f"workspace: expected a 1-D uint8 CUDA tensor of at least {need} bytes (indexer_top_k_workspace_bytes), got "
                                f"{tuple(getattr(workspace, 'shape', ())) or type(workspace).__name__}")
            else:
                check(problems, workspace, "workspace", workspace.shape, torch.uint8, dev, policy.ALIGN)
                if workspace.numel() < need:
                    problems.append(f"workspace: {workspace.numel()} bytes, the call needs {need} (indexer_top_k_workspace_bytes)")
        if not problems:
            ws = workspace[:need] if need else None
            problems += aliasing((("indices", indices), ("values", values), ("workspace", ws)),
                                 (("input_values", input_values), ("seq_lens", seq_lens)))
        chunks = policy.row_chunks(n_rows, num_cols, dtype, next_n, input_values.element_size()) if not problems else []
        if isinstance(chunks, str):
            problems.append(f"input_values: {chunks}")
    if problems:
        raise input_error(problems)
    ts = (indices, values, input_values, seq_lens, workspace)
    rec = Recorder(len(ts))
    p = rec.p
    if n_rows and num_cols:
        op, key = policy.top_k_kernel(dtype, num_cols, top_k, next_n, return_val, tie_break, deterministic, n_rows)
        le = launcher(FAMILY, op, key, dev, _hint(key))
        es, bn = input_values.element_size(), policy.buffer_numbers(dtype)
        for lo, hi in chunks:
            rows = hi - lo
            out_v = (p[1] + lo * top_k * es, rows) if return_val else ()
            rec.launch(le, p[2] + lo * num_cols * es, rows, num_cols, num_cols,
                       p[4] + lo * bn * num_cols * 4, rows, bn, num_cols, bn * num_cols, num_cols,
                       p[3] + lo // next_n * 4, rows // next_n, p[0] + lo * top_k * 4, rows, *out_v, rec.s)
    elif n_rows:  # rows of no columns: every row is padded

        def pad(ts, stream):
            with alloc_on(stream, dev):
                ts[0].fill_(-1)
                if ts[1] is not None:
                    ts[1].fill_(float("-inf"))

        rec.then(pad)
    masks = (3, (input_values.element_size() - 1) if return_val else 0, policy.ALIGN - 1, 3, policy.ALIGN - 1)
    foot = footprint(ts, writes=(0, 1, 4), masks=masks, sizes={4: need})
    return compile_call("dsa_indexer_top_k.top_k", rec, dev, ts, foot)


def _hint(key) -> str:
    return (f" (top-k compiles one cubin per column bucket {key['cols']} (the next power of two of num_cols), top_k, next_n, "
            f"flags and n_rows > {policy.LARGE_ROWS} ({key['large']}))")


def indexer_top_k_into(indices, values, input_values, seq_lens, top_k, next_n=1, return_val=True, num_copy_bits=256, stream=None,
                       tie_break=0, deterministic=False, *, workspace=None):
    """``indexer_top_k`` into caller-provided ``indices`` (n_rows, top_k) int32, ``values`` (n_rows,
    top_k) of the input's dtype (None when ``return_val`` is False) and ``workspace`` (at least
    :func:`indexer_top_k_workspace_bytes` uint8 bytes, 32-byte aligned; cudnn's ``IndexerTopK.execute``
    takes the same). ``input_values`` must be contiguous and 32-byte aligned. Capture-safe from the
    first call; allocates nothing. Returns (indices, values)."""
    ts = (indices, values, input_values, seq_lens, workspace)
    extra = (top_k, next_n, return_val, num_copy_bits, tie_break, deterministic)  # in _plan_top_k's (cudnn's IndexerTopK's) order
    call, p = cached(_CACHE, ts, extra, lambda: _plan_top_k(*ts[:4], *extra, workspace=workspace))
    call.run(p, stream_handle(stream, call.dev), call.x, ts, stream)
    return indices, values


def indexer_top_k(input_values, seq_lens, top_k, next_n=1, return_val=True, num_copy_bits=256, stream=None, tie_break=0, deterministic=False):
    """cudnn's indexer_top_k_wrapper: returns ``{'indices', 'values'}`` (``values`` None when
    ``return_val`` is False). A strided or misaligned input is copied first, on the launch stream, and
    the outputs and the scratch are allocated there, as upstream does."""
    import torch

    extra = (top_k, next_n, return_val, num_copy_bits, tie_break, deterministic)  # in _plan_top_k's order
    hit = remembered(_CACHE, ALLOC, (input_values, seq_lens), extra)  # inputs like the last validated call's, aligned
    if hit is not None:
        dev, shape, box = hit[0]
        x = input_values
    else:
        problems = []
        _options(problems, top_k, next_n, return_val, num_copy_bits, tie_break, deterministic)
        dev, shape = _inputs(problems, input_values, seq_lens, next_n, staged=True)
        if problems:
            raise input_error(problems)
        n_rows, num_cols = shape
        stream_handle(stream, dev)  # refuse a bad stream, and a missing entry, before allocating
        if n_rows and num_cols:
            key = policy.top_k_kernel(_dtype_name(input_values), num_cols, top_k, next_n, return_val, tie_break, deterministic, n_rows)
            require(FAMILY, {"main": key}, dev, {"main": _hint(key[1])})

        def staged():  # what upstream launches on: contiguous, 32-byte aligned (copies on the launch stream)
            with alloc_on(stream, dev):
                x = input_values.contiguous()
                return x if x.data_ptr() % policy.ALIGN == 0 else x.clone()

        direct = input_values.is_contiguous() and input_values.data_ptr() % policy.ALIGN == 0
        x = input_values if direct else allocate(staged)
        box = [None]  # the _into call, once known (plan.fresh)
        if direct and seq_lens.is_contiguous():
            ins = (input_values, seq_lens)
            remember(_CACHE, ALLOC, extra, probe_for(ins, dev, footprint(ins, writes=(), masks=(policy.ALIGN - 1, 3))), (dev, shape, box))
        if not seq_lens.is_contiguous():
            seq_lens = allocate(lambda: _on(stream, dev, seq_lens.contiguous))
    n_rows, num_cols = shape
    s = stream_handle(stream, dev)

    def outputs():
        with alloc_on(stream, dev):
            idx = torch.empty(n_rows, top_k, dtype=torch.int32, device=x.device)
            val = torch.empty(n_rows, top_k, dtype=x.dtype, device=x.device) if return_val else None
            need = policy.workspace_bytes(n_rows, num_cols, _dtype_name(x)) if n_rows and num_cols else 0
            ws = torch.empty(need, dtype=torch.uint8, device=x.device) if need else None
            return idx, val, ws

    idx, val, ws = allocate(outputs)
    ts = (idx, val, x, seq_lens, ws)
    call, p = fresh(box, _CACHE, ts, extra, lambda: _plan_top_k(*ts[:4], *extra, workspace=ws))
    call.run(p, s, call.x, ts, stream)
    return Outputs(indices=idx, values=val)


def _on(stream, dev, fn):
    with alloc_on(stream, dev):
        return fn()


class IndexerTopK(Plan):
    """``IndexerTopK(indices, values, input_values, seq_lens, top_k, next_n=1, return_val=True,
    num_copy_bits=256, tie_break=0, deterministic=False, workspace=...)`` (cudnn's IndexerTopK options,
    in its order); ``execute(indices, values, input_values, seq_lens,
    workspace, stream=None)`` (``values`` None without ``return_val``; see :class:`dsa_aot.ops.plan.Plan`)."""

    _build = staticmethod(_plan_top_k)
    _tensors = _TENSORS


# --- torch.library (dsa_aot.library registers these as torch.ops.dsa_aot.<name>: schema, CUDA impl, fake) ---


def _t_top_k(input_values, seq_lens, top_k, next_n=1, return_val=True, tie_break=0, deterministic=False):
    out = indexer_top_k(input_values, seq_lens, top_k, next_n, return_val, tie_break=tie_break, deterministic=deterministic)
    return [out["indices"]] + ([out["values"]] if return_val else [])


def _f_top_k(input_values, seq_lens, top_k, next_n=1, return_val=True, tie_break=0, deterministic=False):
    import torch

    n_rows = input_values.shape[0]
    idx = input_values.new_empty((n_rows, top_k), dtype=torch.int32)
    return [idx] + ([input_values.new_empty((n_rows, top_k))] if return_val else [])


def _t_top_k_into(indices, values, input_values, seq_lens, top_k, next_n=1, return_val=True, tie_break=0, deterministic=False, workspace=None):
    indexer_top_k_into(indices, values, input_values, seq_lens, top_k, next_n, return_val, tie_break=tie_break, deterministic=deterministic,
                       workspace=workspace)


TORCH_OPS = {
    "dsa_indexer_top_k": ("(Tensor input_values, Tensor seq_lens, int top_k, int next_n=1, bool return_val=True, int tie_break=0, "
                          "bool deterministic=False) -> Tensor[]", _t_top_k, _f_top_k),
    "dsa_indexer_top_k_into": ("(Tensor(a!) indices, Tensor(b!)? values, Tensor input_values, Tensor seq_lens, int top_k, int next_n=1, "
                               "bool return_val=True, int tie_break=0, bool deterministic=False, Tensor(c!)? workspace=None) -> ()",
                               _t_top_k_into, writes_only),
}  # fmt: skip
