"""``cudnn.DSA``'s ops, ahead of time: the op modules of the families registered under "dsa"
(:data:`aot.policy.families.FAMILIES`)."""

from .ops import export as _export

__all__ = _export("dsa", globals())
