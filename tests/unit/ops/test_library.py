"""torch.ops.dsa_aot: every public op registered, with a schema that says what it writes and a fake
that gives the outputs' shapes, so it traces without a GPU (fake tensors, make_fx). The real runs
(opcheck, torch.compile, graph capture) are tests/gpu/test_library.py."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import dsa_aot.library  # noqa: F401 - registers torch.ops.dsa_aot
from dsa_aot.errors import InputError
from dsa_aot.ops.library import NAMESPACE, declarations
from dsa_aot.policy.families import FAMILIES

OPS = torch.ops.dsa_aot
BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32


def _e(shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="cuda")


def _csa(nb=32, ratio=4, d=128, coff=2):
    t = ratio * nb
    return dict(kv=_e((t, coff * d)), score=_e((t, coff * d)), ape=_e((ratio, coff * d), F32), cu_seqlens=_e((2,), I32),
                cu_seqlens_comp=_e((2,), I32)), dict(ratio=ratio, coff=coff)


def _indexer(b=1, s_q=8, s_k=256, h=64, d=128, topk=128):
    return dict(index_q=_e((b, s_q, h, d)), weights=_e((b, s_q, h)), index_k=_e((b, s_k, d)), attn_score=_e((b, s_q, topk), F32),
                index_score=_e((b, s_q, topk), F32), topk_indices=_e((b, s_q, topk), I32), grad_loss=_e((1,), F32))


def _sparse(s_q=16, s_kv=256, h=64, d=512, topk=128):
    return dict(q=_e((s_q, h, d)), kv=_e((s_kv, d)), out=_e((s_q, h, 512)), dout=_e((s_q, h, 512)), lse=_e((s_q, h), F32), attn_sink=_e((h,), F32),
                topk_idxs=_e((s_q, topk), I32))


def test_every_public_op_is_a_torch_op():
    import importlib

    want = set()
    for family, (ns, *_) in FAMILIES.items():
        mod = importlib.import_module(f"dsa_aot.ops.{family}")
        # every op function; not the size helpers (``*_bytes``, or named in the module's HELPERS), not the plan classes (objects,
        # the direct API's fastest form)
        helpers = getattr(mod, "HELPERS", ())
        want |= {f"{ns}_{n}" for n in mod.__all__ if not n.endswith("_bytes") and n not in helpers and not isinstance(getattr(mod, n), type)}
    assert set(declarations()) == want
    for name in want:
        assert hasattr(OPS, name), f"{NAMESPACE}::{name} is not registered"


def test_schemas_mark_what_each_op_writes():
    def written(name):
        return {a.name for a in getattr(OPS, name).default._schema.arguments if a.alias_info is not None and a.alias_info.is_write}

    assert written("csa_compressor_forward_into") == {"out"}
    assert written("csa_compressor_backward_into") == {"grad_kv", "grad_score", "grad_ape", "workspace"}
    assert written("csa_compressor_forward") == written("csa_compressor_backward") == set()
    assert written("dsa_indexer_backward") == {"attn_score"}  # overwritten with the score-grad signal
    assert written("dsa_indexer_backward_into") == {"d_index_q", "d_weights", "d_index_k", "attn_score", "workspace"}
    assert written("dsa_sparse_attention_backward_into") == {"dq", "dkv", "d_sink", "workspace"}
    assert written("dsa_sparse_attention_backward") == set()
    assert written("dsa_local_to_global_into") == {"global_indices"} and written("dsa_local_to_global") == set()
    assert written("dsa_compactify_into") == {"indices_out", "topk_length"} and written("dsa_compactify") == set()


def test_fake_tensors_give_every_op_its_output_shapes():
    with FakeTensorMode():
        x, kw = _csa(nb=32)
        (out,) = [OPS.csa_compressor_forward(*x.values(), **kw, total_comp=32)]
        assert out.shape == (32, 128) and out.dtype == BF16 and out.device.type == "cuda"
        go = _e((32, 128))
        gkv, gs, gape = OPS.csa_compressor_backward(*x.values(), go, **kw, deterministic=True)
        assert (gkv.shape, gs.shape, gape.shape, gape.dtype) == (x["kv"].shape, x["score"].shape, x["ape"].shape, F32)
        assert OPS.csa_compressor_forward_into(out, *x.values(), **kw) is None
        assert OPS.csa_compressor_backward_into(gkv, gs, gape, *x.values(), go, **kw) is None

        y = _indexer(s_q=8, s_k=256)
        dq, dw, dk = OPS.dsa_indexer_backward(*y.values(), sm_scale=0.1)
        assert (dq.shape, dw.shape, dk.shape) == (y["index_q"].shape, y["weights"].shape, y["index_k"].shape)
        assert OPS.dsa_indexer_backward_into(dq, dw, dk, *y.values(), sm_scale=0.1, workspace=_e((256 * 128 * 4,), torch.uint8)) is None

        z = _sparse(s_q=16, s_kv=256)
        dq, dkv, d_sink = OPS.dsa_sparse_attention_backward(*z.values(), softmax_scale=0.05)
        assert (dq.shape, dkv.shape, d_sink.shape, d_sink.dtype) == (z["q"].shape, z["kv"].shape, (64,), F32)
        assert OPS.dsa_sparse_attention_backward_into(dq, dkv, d_sink, *z.values(), _e((1 << 20,), torch.uint8), softmax_scale=0.05) is None

        for local, cu in ((_e((2, 8, 128), torch.int64), {}), (_e((16, 128), I32), dict(cu_seqlens_q=_e((3,), I32), cu_seqlens_k=_e((3,), I32)))):
            g = OPS.dsa_local_to_global(local, 4096, **cu)
            assert g.shape == local.shape and g.dtype == I32 and g.device.type == "cuda"
            assert OPS.dsa_local_to_global_into(g, local, 4096, **cu) is None
        for shape in ((16, 512), (2, 8, 512)):
            c, n = OPS.dsa_compactify(_e(shape, I32))
            assert (c.shape, c.dtype, n.shape, n.dtype) == ((16, 512), I32, (16,), I32)  # 3-D input comes back flattened, as upstream's
            assert OPS.dsa_compactify_into(c, n, _e((16, 512), I32)) is None


def test_the_dense_score_recomputes_fakes_give_bshd_and_thd_shapes():
    """Both dense ops share one fake: BSHD (B, S_q, S_k) / (B, S_q), THD (T_q, max_seqlen_k) / (T_q,), passed
    positionally or by keyword; THD without max_seqlen_k is refused (the output's width)."""
    with FakeTensorMode():
        for op, aux, d in ((OPS.dsa_dense_indexer_score_recompute, _e((2, 8, 64)), 128),
                           (OPS.dsa_dense_attn_score_recompute, _e((2, 8, 64), F32), 512)):
            q, k = _e((2, 8, 64, d)), _e((2, 32, 1, d))
            out, denom = op(q, k, aux, 0.1, 4)
            assert (out.shape, denom.shape, out.dtype, denom.dtype) == ((2, 8, 32), (2, 8), F32, F32)
            tq, tk, cu = _e((20, 64, d)), _e((40, 1, d)), _e((3,), I32)
            out, denom = op(tq, tk, aux.new_empty((20, 64)), 0.1, 4, cu, cu, 12, 25)
            assert (out.shape, denom.shape) == ((20, 25), (20,))
            out, _ = op(tq, tk, aux.new_empty((20, 64)), 0.1, 4, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_k=17)
            assert out.shape == (20, 17)
            with pytest.raises(InputError, match="max_seqlen_k"):
                op(tq, tk, aux.new_empty((20, 64)), 0.1, 4, cu, cu)


def test_ops_trace_into_one_graph():
    """make_fx over fake tensors: each op is one node of the graph (what torch.compile traces), not a break."""

    def step(kv, score, ape, cu, cuc, index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss):
        out = OPS.csa_compressor_forward(kv, score, ape, cu, cuc, ratio=4, coff=2, total_comp=kv.shape[0] // 4)
        dq, dw, dk = OPS.dsa_indexer_backward(index_q, weights, index_k, attn_score, index_score, topk_indices, grad_loss, sm_scale=0.1)
        return out, dq, dw, dk

    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        x, _ = _csa(nb=32)
        args = (*x.values(), *_indexer().values())
    g = make_fx(step, tracing_mode="symbolic")(*args)
    targets = [str(n.target) for n in g.graph.nodes if n.op == "call_function" and str(n.target).startswith(NAMESPACE)]
    assert targets == ["dsa_aot.csa_compressor_forward.default", "dsa_aot.dsa_indexer_backward.default"], targets


def test_cpu_tensors_reach_the_ops_own_validation():
    x = dict(kv=torch.zeros(128, 256, dtype=BF16), score=torch.zeros(128, 256, dtype=BF16), ape=torch.zeros(4, 256), cu_seqlens=torch.tensor([0, 128], dtype=I32),
             cu_seqlens_comp=torch.tensor([0, 32], dtype=I32))
    with pytest.raises(InputError, match=r"on cpu \(expected a CUDA tensor\)"):
        OPS.csa_compressor_forward(*x.values(), ratio=4, coff=2, total_comp=32)
