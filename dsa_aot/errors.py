"""One root exception for dsa-aot, one subclass per pipeline stage.

Messages follow one form: *what failed: value (expected X). How to fix.*
"""

__all__ = [
    "AotError",
    "ManifestError",
    "CompileError",
    "PolicyError",
    "CubinError",
    "LiftError",
    "VerifyError",
    "FidelityError",
    "PackError",
    "KernelNotFoundError",
    "ArchMismatchError",
    "InputError",
    "LaunchError",
    "OutOfMemoryError",
]


class AotError(Exception):
    """Root of every dsa-aot error."""


class ManifestError(AotError):
    """A manifest is invalid; ``problems`` lists every mistake found (file, entry, allowed values)."""

    def __init__(self, path, problems):
        self.path = str(path)
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{self.path}: {len(self.problems)} problem(s) in the manifest:\n{lines}")


class CompileError(AotError):
    """cute.compile failed for a manifest entry."""


class PolicyError(CompileError):
    """A family's policy (dsa_aot/policy/<family>.py) disagrees with cudnn's own functions: the build stops."""


class CubinError(AotError):
    """A cubin or fatbin could not be read."""


class LiftError(AotError):
    """The host launcher uses something the lifter does not understand (it fails closed)."""


class VerifyError(AotError):
    """A lifted launcher disagrees with the concrete interpreter or with the cubin."""


class FidelityError(VerifyError):
    """A shipped cubin is not what cudnn's own JIT path builds for its key (or that could not be shown)."""


class PackError(AotError):
    """The build output could not be packed into the wheel's data directory."""


class KernelNotFoundError(AotError):
    """No shipped entry covers the requested kernel/shape/arch."""


class ArchMismatchError(AotError):
    """The GPU's architecture has no cubin in this build."""


class InputError(AotError, ValueError):
    """An op input is invalid (dtype, shape, strides, device, alignment); nothing was launched."""


class LaunchError(AotError):
    """A CUDA driver call failed while loading or launching a kernel."""


class OutOfMemoryError(AotError, MemoryError):
    """Allocating an op's outputs or workspace failed; nothing was launched. Pass preallocated outputs
    (the ``*_into`` forms) or free memory."""
