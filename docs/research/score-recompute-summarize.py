"""Summarise every *.jsonl this directory's compile_srec.py runs wrote: upstream-vs-spec verdicts, errors, distinct cubins."""
import collections
import glob
import json

tot = collections.Counter()
rows = []
for f in sorted(glob.glob("*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        arch, tag = r["arch"], r["tag"]
        ups = r.get("upstream", {}).get("compiles", [])
        spec = r.get("spec", {})
        lift = spec.get("lift")
        ver = spec.get("verify", {}).get("verdict") if isinstance(spec.get("verify"), dict) else spec.get("verify")
        rows.append((f.split("/")[-1], arch, tag, r.get("same"), r.get("error"), [u["cubin_sha"][:12] for u in ups], spec.get("cubin_sha", "")[:12],
                     [u["calls"] for u in ups], lift, ver))
        if r.get("same") is not None:
            tot[(arch, "compared")] += 1
            tot[(arch, "identical")] += bool(r["same"])
        if r.get("error"):
            tot[(arch, "error")] += 1
        if lift:
            tot[(arch, "lifted")] += 1
            tot[(arch, "lift ok")] += lift == "ok"
            tot[(arch, "verify ok")] += ver == "ok"
shas = collections.defaultdict(set)
for row in rows:
    if row[6]:
        shas[row[1]].add(row[6])
    for s in row[5]:
        shas[row[1]].add(s)
for row in rows:
    print(*row, sep=" | ")
print()
for k in sorted(tot):
    print(k, tot[k])
for a, s in shas.items():
    print(a, "distinct cubins", len(s))
