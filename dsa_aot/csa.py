"""``cudnn.csa``'s compressor ops, ahead of time: the op modules of the families registered under "csa"
(:data:`dsa_aot.policy.families.FAMILIES`)."""

from .ops import export as _export

__all__ = _export("csa", globals())
