"""Quick GPU smoke check of the runtime path: load, launch, compare forward r128 and ratio-4 with fp64 math."""
import sys, time
import torch
import dsa_aot.csa
from dsa_aot.runtime import preload

dev = torch.device("cuda", 0)
t = time.perf_counter()
ms = preload(0)
print(f"preload: {len(ms)} entries, {sum(ms.values()):.1f} ms total, {time.perf_counter()-t:.2f}s wall")


def ref_fwd(kv, score, ape, cu, cuc, ratio, coff, d, total_comp):
    kv, score, ape = kv.double(), score.double(), ape.double()
    out = torch.zeros(total_comp, d, dtype=torch.float64, device=kv.device)
    cu, cuc = cu.tolist(), cuc.tolist()
    for b in range(len(cu) - 1):
        for j in range(cuc[b + 1] - cuc[b]):
            row = cuc[b] + j
            t0 = cu[b] + j * ratio
            if coff == 1:
                s = score[t0:t0 + ratio, :d] + ape[:, :d]
                out[row] = (torch.softmax(s, 0) * kv[t0:t0 + ratio, :d]).sum(0)
            else:
                cur_s = score[t0:t0 + ratio, d:] + ape[:, d:]
                cur_k = kv[t0:t0 + ratio, d:]
                if j > 0:
                    prv_s = score[t0 - ratio:t0, :d] + ape[:, :d]
                    prv_k = kv[t0 - ratio:t0, :d]
                    s = torch.cat([prv_s, cur_s]); k = torch.cat([prv_k, cur_k])
                else:
                    s, k = cur_s, cur_k
                out[row] = (torch.softmax(s, 0) * k).sum(0)
    return out


ok = True
for ratio, coff, d, seqs in [(128, 2, 128, [1024, 640]), (128, 1, 512, [2048]), (4, 2, 128, [64, 36]), (4, 1, 512, [40])]:
    cu = torch.tensor([0] + list(torch.tensor(seqs).cumsum(0)), dtype=torch.int32, device=dev)
    cuc = torch.tensor([0] + list(torch.tensor([s // ratio for s in seqs]).cumsum(0)), dtype=torch.int32, device=dev)
    n = sum(seqs); tc = int(cuc[-1])
    kv = torch.randn(n, coff * d, device=dev, dtype=torch.bfloat16)
    score = torch.randn_like(kv)
    ape = torch.randn(ratio, coff * d, device=dev)
    out = torch.full((tc, d), float("nan"), device=dev, dtype=torch.bfloat16)
    dsa_aot.csa.compressor_forward_into(out, kv, score, ape, cu, cuc, ratio=ratio, coff=coff)
    torch.cuda.synchronize()
    ref = ref_fwd(kv, score, ape, cu, cuc, ratio, coff, d, tc)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    nan = out.isnan().any().item()
    print(f"fwd ratio={ratio} coff={coff} d={d}: rel err {err:.2e} nan={nan}")
    ok &= err < 1e-2 and not nan
    g = dsa_aot.csa.compressor_backward(kv, score, ape, cu, cuc, torch.randn_like(out), ratio=ratio, coff=coff, deterministic=True)
    g2 = dsa_aot.csa.compressor_backward(kv, score, ape, cu, cuc, torch.randn_like(out), ratio=ratio, coff=coff, deterministic=False)
    torch.cuda.synchronize()
    print("  bwd ran; nan:", [v.isnan().any().item() for v in g.values()])
print("SMOKE", "OK" if ok else "FAILED")
sys.exit(0 if ok else 1)
