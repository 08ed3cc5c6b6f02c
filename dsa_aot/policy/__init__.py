"""Policy: the upstream rules dsa-aot mirrors, shared by the build and the run-time ops.

Pure: standard library only (no torch, no device, no toolchain), so both sides import it and the
build can check it against cudnn on every run. One module per kernel family, ``dsa_aot.policy.<family>``:
its ops and key fields (what a manifest may list), the dispatch (which shipped entries serve a call),
workspace sizes and the constants upstream bakes into its launch code. ``arch`` is the one arch table.

``families`` is the one place a family is registered (docs/adding-a-family.md).
"""
