"""The one arch table: which cubin arches exist, which GPU runs which, and what cudnn's JIT targets."""

__all__ = ["KNOWN", "SM90", "SM100", "CAPABILITY", "runs_on", "is_sm100", "best_arch"]

# Arches CuTe DSL compiles for without a GPU (CUTE_DSL_ARCH); a build may hold any of them.
KNOWN = frozenset({"sm_90a", "sm_100a", "sm_100f", "sm_103a"})
SM90 = frozenset({"sm_90a"})
SM100 = frozenset({"sm_100a", "sm_103a"})  # the SM100 family's arch-specific ("a") targets

# The device capability for which cudnn's JIT compiles each arch (utils/compiler.py _ARCH_MAP); the
# build answers upstream's device queries with it. sm_100f is a family target cudnn never picks.
CAPABILITY = {"sm_90a": (9, 0), "sm_100a": (10, 0), "sm_103a": (10, 3)}

# compute capability -> cubin arches that run on it, best first (an "a" cubin runs on its own arch only)
_RUNS_ON = {(9, 0): ("sm_90a",), (10, 0): ("sm_100a", "sm_100f"), (10, 3): ("sm_103a", "sm_100f")}


def runs_on(capability) -> tuple:
    """Cubin arches a GPU of this compute capability runs, best first (empty: none this project builds)."""
    return _RUNS_ON.get(tuple(capability), ())


def is_sm100(arch: str) -> bool:
    """Whether ``arch`` is an SM100-family target (tcgen05 kernels and their host-side policy)."""
    return arch in ("sm_100a", "sm_103a", "sm_100f")


def best_arch(capability, available) -> str | None:
    """The best arch in ``available`` for a GPU of ``capability``, or None."""
    return next((a for a in runs_on(capability) if a in available), None)
