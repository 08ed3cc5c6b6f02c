"""Build time: manifest -> policy check -> compile -> lift -> verify -> fidelity -> pack.

Runs from a source checkout with the pinned toolchain (nvidia-cutlass-dsl, nvidia-cudnn-frontend)
installed; the wheel does not ship this package. It imports ``dsa_aot.policy`` (and ``dsa_aot.errors``), never
the run-time ``dsa_aot.ops`` / ``dsa_aot.runtime``. One module per stage, each with one public function and an
artifact a person can open:

  manifest.load(path)          -> Manifest (entries per target)                 manifests/*.toml
  build.check_policies(m)      each family's policy against cudnn's own functions
  compile.compile_entries(...) -> kernel.cubin, host.mlir, meta.json per entry  _build/entries/<id>/
  lift.lift(host, fn, ...)     -> launcher.py source                            _build/entries/<id>/launcher.py
  verify.verify(...)           -> verify.json (launcher vs an independent interpreter, params vs cubin)
  fidelity.check(dirs)         -> fidelity.json (the cubin vs what cudnn's own JIT path builds)
  pack.pack(dirs, out)         -> index.json, cubins/, launchers/, report.md     dsa_aot/_generated/
  build.build(manifest, out)   all of the above; ``python -m dsa_aot build``
"""
