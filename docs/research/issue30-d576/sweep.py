# one parent prepares; per perturbation a fork child leaks malloc(N) then parses+compiles; prints sha256 prefix
# argv: capdir modfile N1 N2 ...   env THREAD=1: run parse+pipeline in a new pthread (fresh malloc arena)
import os, sys, hashlib, ctypes, threading
os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
import cutlass, cutlass.cute
from cutlass._mlir import ir, passmanager
from dsa_aot.toolchain.compile import _embedded_cubin
cap, modf = sys.argv[1], sys.argv[2]
text = open(f"{cap}/{modf}").read(); pipe = open(f"{cap}/p1.txt").read()
libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p
def work(res):
    with ir.Context() as ctx, ir.Location.unknown():
        ctx.enable_multithreading(False)
        m = ir.Module.parse(text)
        passmanager.PassManager.parse(pipe).run(m.operation)
        res.append(m.operation.get_asm(print_generic_op_form=True))
for n in sys.argv[3:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        if int(n): libc.malloc(int(n))
        res = []
        if os.environ.get("THREAD") == "1":
            t = threading.Thread(target=work, args=(res,)); t.start(); t.join()
        else:
            work(res)
        h = hashlib.sha256(_embedded_cubin(res[0])).hexdigest()[:12]
        os.write(w, h.encode()); os._exit(0)
    os.close(w); h = os.read(r, 100).decode(); os.waitpid(pid, 0); os.close(r)
    print("SWEEP", modf, "thread" if os.environ.get("THREAD") == "1" else "main", n, h, flush=True)
