"""The one place a kernel family is registered.

:data:`FAMILIES` maps a family name to a :class:`Family`: the public namespace its ops join (``dsa_aot.csa`` or
``dsa_aot.dsa``) and the pinned distribution its kernels are imported from at build time (cuDNN's frontend for
these; quack or flash-attn for a family that is not cuDNN's). The build installs and checks that pin.
Everything else follows from the name (docs/adding-a-family.md): ``kernels/<family>.py`` (the spec),
``dsa_aot/policy/<family>.py``, ``dsa_aot/ops/<family>.py``, ``ci/parity/<family>.py``, ``bench/<family>.py``
and the manifest's buckets. (A module of its own: the build hashes the sources a family's cubins
depend on, and registering another family must not invalidate them.)
"""

from typing import NamedTuple

__all__ = ["FAMILIES", "Family", "family_policy", "upstreams"]


class Family(NamedTuple):
    namespace: str  # the public module its ops join: dsa_aot.<namespace>
    upstream: str  # "dist==version": the distribution the spec imports its kernels from (the build pins it)
    # the public names of dsa_aot.ops.<family> (its __all__): dsa_aot.<namespace> imports the op module the
    # first time one of them is used, not every family's at its own import
    exports: tuple = ()


CUDNN = "nvidia-cudnn-frontend==1.32.0"

FAMILIES = {
    "csa_compressor": Family("csa", CUDNN, (
        "compressor", "compressor_forward", "compressor_backward", "compressor_forward_into", "compressor_backward_into",
        "backward_workspace_bytes", "CompressorForward", "CompressorBackward",
    )),
    "dsa_dense_indexer_backward": Family("dsa", CUDNN, (
        "dense_indexer_backward", "dense_indexer_backward_into", "dense_indexer_backward_workspace_bytes", "DenseIndexerBackward",
    )),
    "dsa_indexer_backward": Family("dsa", CUDNN, (
        "indexer_backward", "indexer_backward_into", "indexer_backward_workspace_bytes", "IndexerBackward",
    )),
    "dsa_indexer_forward": Family("dsa", CUDNN, ("indexer_forward", "indexer_forward_into", "IndexerForward")),
    "dsa_indexer_forward_top_k": Family("dsa", CUDNN, (
        "compress_topk_cand_buffer_size", "compress_topk_cand_buffer_size_thd", "cand_batch_offsets", "indexer_forward_top_k",
        "indexer_forward_top_k_into",
    )),
    "dsa_indexer_top_k": Family("dsa", CUDNN, ("indexer_top_k", "indexer_top_k_into", "indexer_top_k_workspace_bytes", "IndexerTopK")),
    "dsa_score_recompute": Family("dsa", CUDNN, (
        "sparse_indexer_score_recompute", "sparse_indexer_score_recompute_into", "sparse_indexer_score_recompute_workspace_bytes",
        "SparseIndexerScoreRecompute", "sparse_attn_score_recompute", "sparse_attn_score_recompute_into",
        "sparse_attn_score_recompute_workspace_bytes", "SparseAttnScoreRecompute", "sparse_attention_score_recompute",
        "dense_indexer_score_recompute", "dense_indexer_score_recompute_into", "dense_indexer_score_recompute_workspace_bytes",
        "DenseIndexerScoreRecompute", "dense_attn_score_recompute", "dense_attn_score_recompute_into",
        "dense_attn_score_recompute_workspace_bytes", "DenseAttnScoreRecompute",
    )),
    "dsa_sparse_attention_backward": Family("dsa", CUDNN, (
        "sparse_attention_backward", "sparse_attention_backward_into", "sparse_attention_backward_workspace_bytes",
        "SparseAttentionBackward",
    )),
    "dsa_sparse_attention_forward": Family("dsa", CUDNN, (
        "sparse_attention", "sparse_attention_forward", "sparse_attention_forward_into", "SparseAttentionForward",
    )),
    "dsa_topk_utils": Family("dsa", CUDNN, (
        "local_to_global", "local_to_global_into", "compactify", "compactify_into", "LocalToGlobal", "Compactify",
    )),
}


def family_policy(family: str):
    """The policy module of a registered family (imported on first use)."""
    import importlib

    if family not in FAMILIES:
        raise KeyError(f"unknown kernel family {family!r} (registered: {sorted(FAMILIES)})")
    return importlib.import_module(f"dsa_aot.policy.{family}")


def upstreams() -> dict:
    """{distribution: version} of every registered family's upstream (what a build must have installed)."""
    out = {}
    for f in FAMILIES.values():
        dist, _, version = f.upstream.partition("==")
        if out.setdefault(dist, version) != version:
            raise ValueError(f"families pin {dist} at {out[dist]} and {version}: one version per distribution")
    return out
