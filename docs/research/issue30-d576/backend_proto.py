"""Prototype: run the DSL's lowering pipeline (cute-to-nvvm: NVVM -> PTX -> the embedded ptxas) in a fresh,
canonical process whose heap history is a function of the module text only, not of the calling process."""
import os, sys, ctypes, subprocess, hashlib

DRIVER = r'''import sys
for p in sys.argv[2:]:
    __import__("site").addsitedir(p)
import cutlass
from cutlass._mlir import ir, passmanager
d = sys.argv[1]
with open(d + "/in.mlir") as f:
    text = f.read()
with open(d + "/pipe.txt") as f:
    pipe = f.read()
with ir.Context() as ctx:
    ctx.enable_multithreading(False)
    m = ir.Module.parse(text)
    del text
    passmanager.PassManager.parse(pipe).run(m.operation)
    out = m.operation.get_asm(print_generic_op_form=True, enable_debug_info=True)
with open(d + "/out.mlir", "w") as f:
    f.write(out)
'''

WORK = os.environ.get("AOT_BACKEND_DIR", "/tmp/dsa-aot-backend")
LOCS = os.environ.get("AOT_BACKEND_LOCS", "0") == "1"


def _no_aslr():
    ctypes.CDLL(None).personality(0x0040000)


def run_backend(module, pipeline, sites):
    os.makedirs(WORK, exist_ok=True)
    with open(WORK + "/in.mlir", "w") as f:
        f.write(module.operation.get_asm(print_generic_op_form=True, enable_debug_info=LOCS))
    with open(WORK + "/pipe.txt", "w") as f:
        f.write(pipeline)
    env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "CUTE_DSL_ARCH": os.environ["CUTE_DSL_ARCH"], "CUTE_DSL_DISABLE_FILE_CACHING": "1"}
    subprocess.run([sys.executable, "-S", "-B", "-c", DRIVER, WORK, *sites], env=env, cwd="/", check=True, preexec_fn=_no_aslr)
    with open(WORK + "/out.mlir") as f:
        return f.read()


def _replace_in_place(module, text):
    from cutlass._mlir import ir
    new = ir.Module.parse(text, context=module.context)
    body = module.body
    for o in list(body.operations):
        o.erase()
    for o in list(new.body.operations):
        o.detach_from_parent()
        ir.InsertionPoint(body).insert(o)
    attrs = module.operation.attributes
    names = lambda d: [a if isinstance(a, str) else a.name for a in d]
    for n in names(list(attrs)):
        del attrs[n]
    for n in names(list(new.operation.attributes)):
        attrs[n] = new.operation.attributes[n]


def install(sites):
    from cutlass.base_dsl import compiler as C
    orig = C.Compiler.compile

    def compile(self, module, pipeline, *a, **k):
        if "cute-to-nvvm" not in pipeline:
            return orig(self, module, pipeline, *a, **k)
        _replace_in_place(module, run_backend(module, pipeline, sites))
        if self._post_compile_hook:
            self._post_compile_hook(module)
        return module

    C.Compiler.compile = compile
