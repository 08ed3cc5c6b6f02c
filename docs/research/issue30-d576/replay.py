# replay: parse the captured module, run the captured pipeline, print the embedded cubin's sha256
# argv: capdir modfile [prealloc spec...]
import os, sys, hashlib, ctypes, time
os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
import cutlass, cutlass.cute
from cutlass._mlir import ir, passmanager
from dsa_aot.toolchain.compile import _embedded_cubin
cap, modf = sys.argv[1], sys.argv[2]
text = open(f"{cap}/{modf}").read(); pipe = open(f"{cap}/p1.txt").read()
if os.environ.get("PTXDUMP"): pipe = pipe.replace("cubin-format=bin", "cubin-format=bin dump-ptx-path='%s'" % os.environ["PTXDUMP"])
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
keep = []
for spec in sys.argv[3:]:
    kind, val = spec.split("=")
    if kind == "malloc":      # n bytes leaked from the C heap
        keep.append(libc.malloc(int(val)))
    elif kind == "pyobj":     # n python small objects
        keep.append([object() for _ in range(int(val))])
    elif kind == "str":
        keep.append("x" * int(val))
for i in range(int(os.environ.get("REPEAT", "1"))):
    with ir.Context() as ctx, ir.Location.unknown():
        ctx.enable_multithreading(os.environ.get("MT") == "1")
        m = ir.Module.parse(text)
        t0 = time.time()
        passmanager.PassManager.parse(pipe).run(m.operation)
        host = m.operation.get_asm(print_generic_op_form=True)
    cub = _embedded_cubin(host)
    print("REPLAY", modf, sys.argv[3:], i, hashlib.sha256(cub).hexdigest()[:12], f"{time.time()-t0:.1f}s", flush=True)
