# the entry's compile in this (uncontrolled) process, with the backend moved to a canonical process; argv: N (bytes leaked first)
import os, sys, hashlib, ctypes
os.environ["CUTE_DSL_ARCH"] = "sm_100a"; os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"
sys.path.insert(0, "/tmp/d576/proto")
import backend_proto
SITES = ["/work/main/.venv/lib/python3.11/site-packages"]
if os.environ.get("HOOK", "1") == "1":
    backend_proto.install(SITES)
ctypes.CDLL(None).malloc(int(sys.argv[1]))
from dsa_aot.toolchain import manifest
from dsa_aot.toolchain.compile import _compile_one
m = manifest.load("manifests/default.toml")
e = [e for e in m.entries if e.id == "dsa_sparse_attention_backward.bwd_d576.nodeterministic.heads128.nosingle_query.nosplit.topk512.notopk_length.nowide.sm_100a"][0]
art = _compile_one(e.family, e.op, e.key, e.target.arch, e.target.sm_count)
tag = sys.argv[2] if len(sys.argv) > 2 else "x"
open(f"/tmp/d576/proto/host_{tag}.mlir", "w").write(art["host"])
open(f"/tmp/d576/proto/cubin_{tag}", "wb").write(art["cubin"])
print("PROTO", sys.argv[1:], "hook" if os.environ.get("HOOK", "1") == "1" else "nohook", hashlib.sha256(art["cubin"]).hexdigest()[:12], art["symbols"], art["host_function"][:40], flush=True)
