"""CUDA launch attributes: the ids the lifter accepts in host code and the runtime knows how to set.

Each value is laid out as i32 fields at byte offsets 0, 4, 8 of the attribute's 64-byte value.
"""

__all__ = ["LAUNCH_ATTRS", "COOPERATIVE", "CLUSTER_DIM", "PDL", "PREFERRED_CLUSTER_DIM"]

COOPERATIVE, CLUSTER_DIM, PDL, PREFERRED_CLUSTER_DIM = 2, 4, 6, 11
LAUNCH_ATTRS = {
    COOPERATIVE: "cooperative",
    CLUSTER_DIM: "cluster_dim",
    PDL: "programmatic_stream_serialization",
    PREFERRED_CLUSTER_DIM: "preferred_cluster_dim",
}
