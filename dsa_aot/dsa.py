"""``cudnn.DSA``'s ops, ahead of time: the op modules of the families registered under "dsa"
(:data:`dsa_aot.policy.families.FAMILIES`)."""

from .ops import export as _export

__all__ = _export("dsa", globals())
