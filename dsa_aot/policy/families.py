"""The one place a kernel family is registered.

:data:`FAMILIES` maps a family name to the public namespace its ops join (``dsa_aot.csa`` or ``dsa_aot.dsa``).
Everything else follows from the name (docs/adding-a-family.md): ``kernels/<family>.py`` (the spec),
``dsa_aot/policy/<family>.py``, ``dsa_aot/ops/<family>.py``, ``ci/parity/<family>.py``, ``bench/<family>.py``
and the manifest's buckets. (A module of its own: the build hashes the sources a family's cubins
depend on, and registering another family must not invalidate them.)
"""

__all__ = ["FAMILIES", "family_policy"]

FAMILIES = {
    "csa_compressor": "csa",
    "dsa_dense_indexer_backward": "dsa",
    "dsa_indexer_backward": "dsa",
    "dsa_indexer_forward": "dsa",
    "dsa_indexer_forward_top_k": "dsa",
    "dsa_indexer_top_k": "dsa",
    "dsa_score_recompute": "dsa",
    "dsa_sparse_attention_backward": "dsa",
    "dsa_sparse_attention_forward": "dsa",
    "dsa_topk_utils": "dsa",
}


def family_policy(family: str):
    """The policy module of a registered family (imported on first use)."""
    import importlib

    if family not in FAMILIES:
        raise KeyError(f"unknown kernel family {family!r} (registered: {sorted(FAMILIES)})")
    return importlib.import_module(f"dsa_aot.policy.{family}")
