"""The ops as PyTorch custom ops. ``import dsa_aot.library`` registers ``torch.ops.dsa_aot.<name>`` for
every op (see :mod:`dsa_aot.ops.library`): each op of ``dsa_aot.csa`` and ``dsa_aot.dsa`` as an allocating op and
an ``_into`` op that writes its arguments, and the two differentiable ops (``csa_compressor``,
``dsa_sparse_attention``) with their backward registered as their autograd formula.

They run on torch's current stream, trace under ``torch.compile(fullgraph=True)`` (fake kernels give
the output shapes) and capture in CUDA graphs. The direct calls (``dsa_aot.csa.*``, ``dsa_aot.dsa.*``) skip
the dispatcher and stay the fastest path.
"""

from .ops.library import NAMESPACE, register

__all__ = ["NAMESPACE", "OPS"]

OPS = register()
