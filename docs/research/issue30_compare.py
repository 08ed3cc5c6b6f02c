import hashlib, json, pathlib, sys, collections
old, new = pathlib.Path("/work/cmp/old/work/entries"), pathlib.Path("/work/cmp/new/work/entries")
ids = sorted(p.name for p in old.iterdir())
res = collections.Counter(); diffs = []
by = collections.defaultdict(list)
for i in ids:
    a, b = old / i, new / i
    if not b.exists():
        diffs.append((i, "missing in new")); continue
    cub = (a / "kernel.cubin").read_bytes() == (b / "kernel.cubin").read_bytes()
    la, lb = (a / "launcher.py").read_text(), (b / "launcher.py").read_text()
    lau = la == lb
    lau_ren = la.replace("aot.", "dsa_aot.").replace("dsa_dsa_aot.", "dsa_aot.") == lb
    res[("cubin", cub)] += 1; res[("launcher", lau)] += 1; res[("launcher modulo aot->dsa_aot", lau_ren)] += 1
    if not (cub and lau):
        diffs.append((i, f"cubin {'same' if cub else 'DIFFERS'}, launcher {'same' if lau else ('same modulo the package rename' if lau_ren else 'DIFFERS')}"))
    f, op = i.split(".")[:2]; by[(f, op, i.rsplit('.', 1)[-1] if not i.endswith('sm148') else i.split('.')[-2])].append(cub)
print(f"{len(ids)} entries, one per (family, op, arch) of manifests/default.toml:", dict(res))
for d in diffs: print("  ", *d)
