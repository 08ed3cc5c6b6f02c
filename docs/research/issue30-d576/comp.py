# compile one entry through the project's compile stage (zygote); print sha256 of cubin (PKG: the package name of an older tree, default dsa_aot)
import sys, hashlib, os
import importlib; PKG = os.environ.get("PKG", "dsa_aot"); manifest = importlib.import_module(PKG + ".toolchain.manifest"); cs = importlib.import_module(PKG + ".toolchain.compile")
ID = sys.argv[1]; out = sys.argv[2]; dd = sys.argv[3] if len(sys.argv) > 3 else None
m = manifest.load("manifests/default.toml")
es = [e for e in m.entries if e.id == ID]
assert len(es) == 1, len(es)
r = cs.compile_entries(es, out, cache_dir=None, jobs=1, progress=True, debug_dump=dd)
cub = (r[0].dir / "kernel.cubin").read_bytes()
print("CUBIN", hashlib.sha256(cub).hexdigest()[:12], r[0].seconds)
