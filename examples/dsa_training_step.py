"""One DSA layer's training step without JIT: every kernel from dsa-aot's cubins, in a process where
importing ``cutlass`` and ``cudnn`` raises.

    python examples/dsa_training_step.py                 # dsa-aot: first step (cold) and a warm step, timed
    python examples/dsa_training_step.py --side cudnn    # the same step through cudnn's wrappers (JIT), timed
    python examples/dsa_training_step.py --save F.pt     # also save inputs, intermediates and gradients

The step (one sequence of S tokens, causal; MQA attention H x D over a latent kv, the lightning
indexer Hi x 128 with per-head weights):

1. indexer forward: ``scores[s, t] = sum_h w[s, h] relu(qi[s, h] . ki[t])`` for t <= s, else -inf
   (``indexer_forward``, ratio 1);
2. top-k: each row's ``K`` highest-scoring keys, -1 where a row has fewer (``indexer_top_k``);
3. sparse attention forward over those slots: ``out``, ``lse`` (``sparse_attention_forward``; no sink);
4. the loss: ``sum(out * dout)`` (the layer's upstream gradient ``dout``) plus the indexer's KL loss
   ``loss_coeff * mean_s KL(target_s || predict_s)``, where ``target`` is the attention's distribution
   over the slots (``sparse_attn_score_recompute``, no gradient) and ``predict`` the indexer's softmax
   over them (``sparse_indexer_score_recompute``);
5. the backward: ``dq``, ``dkv`` (``sparse_attention_backward``) and ``d_qi``, ``d_w``, ``d_ki``
   (``indexer_backward``, which turns target and predict into the KL gradient).

An op the GPU has no kernel for (upstream has none either: the sparse attention forward on SM90) is
not faked: the step says so by name and uses the plain-torch stand-in :func:`torch_attention_forward`
for that op only, so the rest of the step still runs on the device's kernels.
tests/gpu/test_training_step.py runs this in such a process and checks the gradients against an fp64
autograd reference of the same step.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

BLOCK_PREFIXES = ("cutlass", "cudnn", "tvm_ffi")


class _Block:
    """A meta-path finder that makes importing the toolchain raise (the AOT side must not need it)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCK_PREFIXES:
            raise ImportError(f"blocked: {name} (this process runs dsa-aot without the JIT toolchain)")


def block_toolchain() -> None:
    if not any(isinstance(f, _Block) for f in sys.meta_path):
        sys.meta_path.insert(0, _Block())
    for m in list(sys.modules):
        if m.split(".")[0] in BLOCK_PREFIXES:
            raise RuntimeError(f"{m} was imported before the blocker")


def make_inputs(S=4096, H=64, D=512, Hi=64, K=512, seed=0, device="cuda"):
    """bf16 inputs of the step: q (S, H, D) and kv (S, D) with N(0, 1) entries (scale 1/sqrt(D)),
    qi (S, Hi, 128) and ki (S, 128) scaled so qi . ki ~ N(0, 1), w (S, Hi) ~ N(0, 1/Hi), dout (S, H, D)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=torch.bfloat16)

    return dict(q=randn(S, H, D), kv=randn(S, D), qi=randn(S, Hi, 128, scale=128**-0.25), ki=randn(S, 128, scale=128**-0.25),
                w=randn(S, Hi, scale=Hi**-0.5), dout=randn(S, H, D, scale=0.1), K=K, softmax_scale=D**-0.5, loss_coeff=0.5)


def torch_attention_forward(q, kv, indices, softmax_scale):
    """Sparse attention forward in plain torch (fp32 math, bf16 ``out``, fp32 natural-log ``lse``) for a
    GPU without the kernel: the same contract as ``sparse_attention_forward`` without a sink."""
    import torch

    valid = indices >= 0
    keys = kv.float()[indices.clamp(min=0).long()]  # (S, K, D)
    s = torch.einsum("shd,skd->shk", q.float(), keys) * softmax_scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("shk,skd->shd", p, keys[..., :512])
    return out.to(torch.bfloat16), lse.contiguous()


def step(dsa, x, *, forward_kernel=True, log=None):
    """One training step with op namespace ``dsa`` (``dsa_aot.dsa``, or :func:`cudnn_namespace`): returns the
    gradients, the intermediates, and which ops ran on kernels and which did not."""
    import torch

    log = log if log is not None else []
    q, kv, qi, ki, w, dout, K = x["q"], x["kv"], x["qi"], x["ki"], x["w"], x["dout"], x["K"]
    S, H, D = q.shape
    scale, coeff = x["softmax_scale"], x["loss_coeff"]
    seq_lens = torch.arange(1, S + 1, dtype=torch.int32, device=q.device)  # causal: row s sees keys 0..s
    # 1-2: the indexer's scores and its top-k slots
    scores = dsa.indexer_forward(qi[None], ki[None, :, None], w[None], ratio=1, sm_scale=1.0)["scores"][0]
    log.append("indexer_forward")
    indices = dsa.indexer_top_k(scores, seq_lens, K)["indices"]
    log.append("indexer_top_k")
    # 3: sparse attention forward
    if forward_kernel:
        f = dsa.sparse_attention_forward(q, kv, indices, softmax_scale=scale)
        out, lse = f["out"], f["lse"]
        log.append("sparse_attention_forward")
    else:
        out, lse = torch_attention_forward(q, kv, indices, scale)
        log.append("sparse_attention_forward: SKIPPED (no kernel on this GPU; torch stand-in)")
    # 4: the indexer loss's two distributions over the slots
    target = dsa.sparse_attn_score_recompute(q[None], kv[None], lse[None], indices[None], scale)["target"]
    log.append("sparse_attn_score_recompute")
    predict = dsa.sparse_indexer_score_recompute(qi[None], ki[None], w[None], indices[None])["predict"]
    log.append("sparse_indexer_score_recompute")
    lt = target.clamp_min(math.exp(-100)).log()
    lp = predict.clamp_min(math.exp(-100)).log()
    kl = torch.where(target > 0, target * (lt - lp), 0.0).sum(-1)
    loss = (out.float() * dout.float()).sum() + coeff * kl.mean()
    # 5: backward
    sink = torch.full((H,), -math.inf, dtype=torch.float32, device=q.device)
    b = dsa.sparse_attention_backward(q, kv, out, dout, lse, sink, indices, softmax_scale=scale)
    log.append("sparse_attention_backward")
    grad_loss = torch.ones(1, dtype=torch.float32, device=q.device)
    signal = target.clone()  # the backward overwrites it with the KL gradient per slot
    ib = dsa.indexer_backward(qi[None], w[None], ki[None], signal, predict, indices[None], grad_loss, sm_scale=1.0, loss_coeff=coeff)
    log.append("indexer_backward")
    return dict(loss=loss, scores=scores, indices=indices, out=out, lse=lse, target=target[0], predict=predict[0], dq=b["dq"], dkv=b["dkv"],
                d_qi=ib["d_index_q"][0], d_w=ib["d_weights"][0], d_ki=ib["d_index_k"][0], ran=log)


def cudnn_namespace():
    """cudnn's wrappers under dsa-aot's names (they share cudnn's signatures)."""
    import types

    import cudnn

    names = ("indexer_forward", "indexer_top_k", "sparse_attention_forward", "sparse_attention_backward", "sparse_attn_score_recompute",
             "sparse_indexer_score_recompute", "indexer_backward")
    return types.SimpleNamespace(**{n: getattr(cudnn.DSA, f"{n}_wrapper") for n in names})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", choices=("dsa_aot", "cudnn"), default="dsa_aot")
    ap.add_argument("--save", help="torch.save inputs, intermediates and gradients here")
    ap.add_argument("--S", type=int, default=4096)
    ap.add_argument("--json", action="store_true", help="print one JSON line of timings instead of the table")
    a = ap.parse_args(argv)
    if a.side == "dsa_aot":
        block_toolchain()
    import torch

    x = make_inputs(S=a.S)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if a.side == "dsa_aot":
        import dsa_aot.dsa as dsa
    else:
        dsa = cudnn_namespace()
    forward_kernel = torch.cuda.get_device_capability()[0] == 10
    log = []
    r = step(dsa, x, forward_kernel=forward_kernel, log=log)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    warm = []
    for _ in range(3):
        t1 = time.perf_counter()
        step(dsa, x, forward_kernel=forward_kernel, log=[])
        torch.cuda.synchronize()
        warm.append(time.perf_counter() - t1)
    res = {"side": a.side, "device": torch.cuda.get_device_name(), "S": a.S, "first_step_s": first, "warm_step_ms": min(warm) * 1e3, "ran": log,
           "cutlass_imported": "cutlass" in sys.modules, "cudnn_imported": "cudnn" in sys.modules}
    if a.save:
        torch.save({"inputs": {k: v for k, v in x.items()}, "result": {k: v for k, v in r.items() if k != "ran"}, "meta": res}, a.save)
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"DSA training step, {a.side}, {res['device']}, S {a.S}:")
    for line in log:
        print(f"  {line}")
    print(f"first step (import + load / JIT + run + sync): {first:.3f} s; warm step: {res['warm_step_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
