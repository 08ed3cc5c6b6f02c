"""CSA compressor ops: cudnn's csa_compressor_{forward,backward}_wrapper, launched from shipped cubins.

Which compiled entry serves a call is :mod:`dsa_aot.policy.csa_compressor`, checked against upstream's
schedule functions on every build.
"""

from __future__ import annotations

from ..policy.families import FAMILIES
from ..policy import csa_compressor as policy
from .checks import check, input_error, integer, one_of
from .gpu import launcher, sm_count_of
from .declare import Flag, In, Int, OneOf, Op, Out, Workspace
from .library import call

FAMILY = policy.FAMILY
__all__ = list(FAMILIES[FAMILY].exports)  # the registry lists them: dsa_aot.<namespace> imports this module for them
_I32 = 2**31
_W, _B, _BC = "coff * head_dim", "B + 1", "B + 1, as cu_seqlens"  # shape symbols, named as the messages say them
_R128_HINT = " (the ratio-128 bucket policy is in dsa_aot/policy/csa_compressor.py)"


def _rows_r128(total_comp, head_dim, coff, dev) -> int:
    """rows_per_cta of a ratio-128 backward on GPU ``dev`` (upstream reads the device's SM count)."""
    _, key = policy.backward_kernels(128, head_dim, coff, total_comp, True)["main"]
    entry = launcher(FAMILY, "bwd_r128", key, dev, _R128_HINT).entry
    return policy.rows_r128(total_comp, head_dim, coff, entry["key"]["schedule"], sm_count_of(dev))


def backward_workspace_bytes(total_comp, ratio, head_dim, coff, device=None) -> int:
    """Bytes of uint8 workspace the deterministic backward needs (0 when total_comp == 0)."""
    problems = []
    integer(problems, "total_comp", total_comp, 0, _I32 - 1)
    one_of(problems, "ratio", ratio, (2, 4, 128))
    one_of(problems, "coff", coff, (1, 2))
    integer(problems, "head_dim", head_dim, 1, policy.MAX_HEAD_DIM)
    if not (device is None or (isinstance(device, (int, str)) and not isinstance(device, bool)) or type(device).__name__ == "device"):
        problems.append(f"device={device!r} (expected None, an int, 'cuda:N' or a torch.device)")  # checked where unused too (ratio != 128)
    if problems:
        raise input_error(problems)
    if total_comp == 0:
        return 0
    rows = None
    if ratio == 128:
        from ..runtime.device import device_index

        rows = _rows_r128(total_comp, head_dim, coff, device_index(device))
    return policy.backward_workspace(total_comp, ratio, head_dim, coff, rows)[2]


# --- the declarations: what both ops check, then each op ----------------------------------------------


def _symbols(c, problems):
    """head_dim (given, or kv's width / coff) and the checks the inputs' shapes alone make."""
    width, n = c.sym[_W], c.sym[_B]
    hd = c.head_dim if c.head_dim is not None else width // c.coff
    if c.sym.get("head_dim", hd) != hd:  # grad_out's, when head_dim is kv's
        problems.append(f"grad_out: shape ({c.sym['total_comp']}, {c.sym['head_dim']}) (expected ({c.sym['total_comp']}, {hd}))")
    c.sym["head_dim"] = hd
    if width != c.coff * hd:
        problems.append(f"kv: width {width} (expected coff * head_dim = {c.coff} * {hd})")
    if not 1 <= hd <= policy.MAX_HEAD_DIM:
        problems.append(f"head_dim={hd} (expected 1..{policy.MAX_HEAD_DIM})")
    if c.ratio == 128 and hd not in policy.R128_HEAD_DIMS:
        problems.append(f"head_dim={hd} at ratio 128 (expected 128 or 512, upstream's validated envelope)")
    if n < 2:
        problems.append(f"cu_seqlens: shape ({n},) (expected (B + 1,) with B >= 1)")
    elif c.sym[_BC] != n:
        problems.append(f"cu_seqlens_comp: shape ({c.sym[_BC]},) (expected ({n},))")
    if n >= _I32:
        problems.append(f"cu_seqlens: {n - 1} sequences (expected < 2**31)")
    if c.sym["total_tokens"] * width >= _I32:
        problems.append(f"total_tokens * coff * head_dim = {c.sym['total_tokens'] * width} (expected < 2**31: the kernels use int32 offsets)")


def _rules(c, problems):
    """The checks of total_comp (the output rows: out's, grad_out's, or the allocating forward's argument)."""
    tc = c.sym.get("total_comp")
    if tc is not None and tc * c.sym["head_dim"] >= _I32:
        problems.append(f"total_comp * head_dim = {tc * c.sym['head_dim']} (expected < 2**31)")
    if tc is not None and tc > 0 and c.sym["total_tokens"] < c.ratio:
        problems.append(f"total_comp={tc} > 0 needs at least ratio={c.ratio} tokens, got total_tokens={c.sym['total_tokens']}")


def _hint(c, key) -> str:
    return _R128_HINT if key.get("ratio") == 128 else ""


def _total_comp(c):
    """The allocating forward's total_comp=None: ``cu_seqlens_comp[-1]``, a device sync (what cudnn's wrapper does too)."""
    if c.total_comp is not None:
        return True
    tc = c.sym["total_comp"] = int(c.cu_seqlens_comp[-1].item())
    problems = []
    _rules(c, problems)
    if tc < 0 or problems:
        raise input_error(problems or [f"cu_seqlens_comp[-1] = {tc} (expected >= 0)"])
    return False  # the next call reads it again


_INPUTS = (In("kv", "bfloat16", ("total_tokens", _W)), In("score", "bfloat16", ("total_tokens", _W)), In("ape", "float32", ("ratio", _W)),
           In("cu_seqlens", "int32", (_B,), align=4), In("cu_seqlens_comp", "int32", (_BC,), align=4))
_OPTIONS = (OneOf("ratio", (2, 4, 128), 4), Int("head_dim", 1, policy.MAX_HEAD_DIM, None), OneOf("coff", (1, 2), 2))
_T_IN = "kv, score, ape, cu_seqlens, cu_seqlens_comp"
_T_OPTS = "int ratio, int coff"


def _fwd_plan(rec, c):
    if "main" in c.entry:
        p = c.p
        rec.launch(c.entry["main"], p.kv, p.score, p.ape, p.cu_seqlens, p.cu_seqlens_comp, p.out, c.sym["total_comp"], c.sym[_B] - 1, rec.s)


FORWARD = Op(
    FAMILY, "compressor_forward", plan_class="CompressorForward",
    into="out, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, head_dim=None, coff=2, stream=None",
    alloc="kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, head_dim=None, coff=2, total_comp=None, stream=None",
    tensors=(Out("out", "bfloat16", ("total_comp", "head_dim")), *_INPUTS),
    options=(*_OPTIONS, Int("total_comp", 0, _I32 - 1, None, alloc_only=True)),
    entries=lambda c: {"main": policy.forward_kernel(c.ratio, c.sym["head_dim"], c.coff, c.sym["total_comp"])} if c.sym["total_comp"] else {},
    symbols=_symbols, rules=_rules, plan=_fwd_plan, hint=_hint, alloc_sizes=_total_comp,
    torch_order=(f"{_T_IN}, {_T_OPTS}, SymInt total_comp, SymInt? head_dim=None", f"out, {_T_IN}, {_T_OPTS}, SymInt? head_dim=None"),
    note="``out``: (total_comp, head_dim) bf16. The allocating form's ``total_comp`` defaults to ``cu_seqlens_comp[-1]`` (a device "
         "sync); pass it to stay capture-safe. Capture-safe ``_into`` from the first call (``dsa_aot.runtime.preload()`` first keeps "
         "the file reads out of a capture).",
)  # fmt: skip


def _need(c) -> int:
    tc = c.sym["total_comp"]
    return backward_workspace_bytes(tc, c.ratio, c.sym["head_dim"], c.coff, c.dev) if c.deterministic and tc else 0


def _bwd_rules(c, problems):
    _rules(c, problems)
    if not c.deterministic and c.workspace is not None:
        problems.append("workspace: given, but deterministic=False uses the atomic dAPE path (pass workspace=None)")
    elif not c.sym["total_comp"] and c.workspace is not None:  # none needed: still a 1-D uint8 tensor of the device
        import torch

        ws = c.workspace
        check(problems, ws, "workspace", (ws.numel() if isinstance(ws, torch.Tensor) and ws.layout == torch.strided else 0,), torch.uint8, c.dev, 16)


def _atomic_guard(c):
    """Per call of the atomic (non-deterministic) backward: torch's deterministic mode refuses it (or warns)."""
    import torch

    if c.deterministic:
        return None
    launches = bool(c.sym["total_comp"])

    def guard():
        if torch.are_deterministic_algorithms_enabled():
            if not torch.is_deterministic_algorithms_warn_only_enabled():
                raise input_error(["deterministic=False: the CSA compressor backward accumulates dAPE with fp32 atomics, and "
                                   "torch.use_deterministic_algorithms(True) is set; call it with deterministic=True"])
            if launches:
                import warnings

                warnings.warn("CSA compressor backward accumulates dAPE with fp32 atomics and is not deterministic; "
                              "torch.use_deterministic_algorithms(True, warn_only=True) is set. Call it with deterministic=True", RuntimeWarning,
                              stacklevel=3)

    return guard


def _bwd_plan(rec, c):
    tc, hd, ratio, p, s = c.sym["total_comp"], c.sym["head_dim"], c.ratio, c.p, rec.s
    if not tc:
        return
    main = c.entry["main"]
    rows = policy.rows_r128(tc, hd, c.coff, main.entry["key"]["schedule"], sm_count_of(c.dev)) if ratio == 128 else None
    npartials, split, _ = policy.backward_workspace(tc, ratio, hd, c.coff, rows)
    partial = p.workspace if c.deterministic else p.grad_ape
    rec.launch(main, p.kv, p.score, p.ape, p.cu_seqlens, p.cu_seqlens_comp, p.grad_out, p.grad_kv, p.grad_score, partial, tc, c.sym[_B] - 1,
               c.sym["total_tokens"], *((rows,) if ratio == 128 else ()), s)
    if c.deterministic:
        nelems = ratio * c.sym[_W]
        rec.launch(c.entry["reduce"], partial, partial + (npartials * nelems * 4 if split else 0), p.grad_ape, npartials, nelems, s)


BACKWARD = Op(
    FAMILY, "compressor_backward", plan_class="CompressorBackward",
    into="grad_kv, grad_score, grad_ape, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio=4, head_dim=None, coff=2, stream=None, "
         "deterministic=False, workspace=None",
    alloc="kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio=4, head_dim=None, coff=2, stream=None, deterministic=False",
    tensors=(
        Out("grad_kv", "bfloat16", "like kv", alloc_like=True, zeroed=lambda c: not c.sym["total_comp"]),
        Out("grad_score", "bfloat16", "like score", alloc_like=True, zeroed=lambda c: not c.sym["total_comp"]),
        Out("grad_ape", "float32", "like ape", alloc_like=True, zeroed=lambda c: not (c.deterministic and c.sym["total_comp"])),
        *_INPUTS, In("grad_out", "bfloat16", ("total_comp", "head_dim")),
        Workspace("workspace", _need, "dsa_aot.csa.backward_workspace_bytes"),
    ),
    options=(*_OPTIONS, Flag("deterministic", False)),
    entries=lambda c: policy.backward_kernels(c.ratio, c.sym["head_dim"], c.coff, c.sym["total_comp"], c.deterministic) if c.sym["total_comp"] else {},
    symbols=_symbols, rules=_bwd_rules, plan=_bwd_plan, hint=_hint, guard=_atomic_guard,
    torch_order=(f"{_T_IN}, grad_out, {_T_OPTS}, deterministic, SymInt? head_dim=None",
                 f"grad_kv, grad_score, grad_ape, {_T_IN}, grad_out, {_T_OPTS}, deterministic, workspace, SymInt? head_dim=None"),
    note="grad_kv / grad_score are fully written; grad_ape must be zeroed by the caller on the atomic path (deterministic=False) and is "
         "fully overwritten on the deterministic path, which needs ``workspace`` of ``backward_workspace_bytes(...)`` uint8 bytes.",
)  # fmt: skip

compressor_forward, compressor_forward_into, CompressorForward = FORWARD.forms(globals())
compressor_backward, compressor_backward_into, CompressorBackward = BACKWARD.forms(globals())


def compressor(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, head_dim=None, coff=2, total_comp=None, deterministic=False):
    """The CSA compressor as one differentiable op (``torch.ops.dsa_aot.csa_compressor``): returns
    ``out`` (total_comp, head_dim) bf16, computed by :func:`compressor_forward`, with
    :func:`compressor_backward` as its autograd formula: gradients flow to ``kv``, ``score`` and
    ``ape`` (the backward's three outputs; the int32 ``cu_seqlens*`` have none). ``deterministic``
    is the backward's (fixed-order dAPE instead of fp32 atomics). Runs on torch's current stream,
    traces under ``torch.compile(fullgraph=True)`` and captures in CUDA graphs (forward and backward)
    when ``total_comp`` is given; None reads ``cu_seqlens_comp[-1]`` (a device sync), as the forward.
    Every argument is checked by the forward's own checks before anything runs."""
    return call("csa_compressor", kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp, deterministic)


# --- torch.library (dsa_aot.library registers these as torch.ops.dsa_aot.<name>: schema, CUDA impl, fake) ---
# The ops run on torch's current stream. Sizes the fake needs and a tensor cannot give (total_comp,
# whose value lives on the device) are arguments.


def _t_compressor(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, head_dim=None, coff=2, total_comp=None, deterministic=False):
    return compressor_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, total_comp)["out"]


def _f_compressor(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, head_dim=None, coff=2, total_comp=None, deterministic=False):
    if total_comp is None:  # cu_seqlens_comp[-1]: a value on the device, a data-dependent size for the tracer
        import torch

        total_comp = torch.library.get_ctx().new_dynamic_size()
    return kv.new_empty((total_comp, head_dim if head_dim is not None else kv.shape[1] // coff))


def _compressor_setup(ctx, inputs, output):
    kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, head_dim, coff, _, deterministic = inputs
    ctx.save_for_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp)
    ctx.options = ratio, coff, deterministic, head_dim


def _compressor_grad(ctx, grad_out):
    """The backward op on the saved inputs: (grad_kv, grad_score, grad_ape), the rest None."""
    import torch

    ratio, coff, deterministic, head_dim = ctx.options
    grads = torch.ops.dsa_aot.csa_compressor_backward(*ctx.saved_tensors, grad_out.contiguous(), ratio, coff, deterministic, head_dim)
    return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), *(None,) * 7)


TORCH_OPS = {  # the composite (the declared ops register themselves: dsa_aot.ops.library)
    "csa_compressor": ("(Tensor kv, Tensor score, Tensor ape, Tensor cu_seqlens, Tensor cu_seqlens_comp, int ratio=4, SymInt? head_dim=None, int coff=2, "
                       "SymInt? total_comp=None, bool deterministic=False) -> Tensor", _t_compressor, _f_compressor, (_compressor_setup, _compressor_grad)),
}  # fmt: skip
