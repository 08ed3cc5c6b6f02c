"""Writing a build's files by hand, as the pack stage does (for tests that tamper with a build)."""

import hashlib
import json
import shutil
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"


def lifted_entries(root, names):
    """Copies of tests/data/<name> under root/entries, lifted and verified by the build's own stage: their dirs."""
    from dsa_aot.toolchain import build

    dirs = []
    for name in names:
        d = root / "entries" / name
        shutil.copytree(DATA / name, d)
        build.lift_and_verify(d)
        dirs.append(d)
    return dirs


def write_index(root, doc):
    """index.json and the index.sha256 that covers it, as the pack stage writes them."""
    text = json.dumps(doc, indent=1, sort_keys=True).encode()
    (root / "index.json").write_bytes(text)
    (root / "index.sha256").write_text(hashlib.sha256(text).hexdigest() + "\n")


# A manifest of three cheap entries (~0.3-0.5 s per compile) for the tests that run the real build stages:
# the deterministic dK reduction, the SM90 sparse-backward postprocess (through flash_attn_bwd_sm90), and
# the CSA dAPE reduction (through a deterministic run_bwd)
SMALL_MANIFEST = """
[[target]]
name = "b200"
arch = "sm_100a"
sm_count = 148
[[target]]
name = "h200"
arch = "sm_90a"
sm_count = 132
[[bucket]]
family = "dsa_indexer_backward"
op = "reduce_dk"
out = "f32"
planes = 96
targets = ["b200"]
[[bucket]]
family = "dsa_sparse_attention_backward"
op = "post_sm90"
dtype = "bf16"
dim = 576
targets = ["h200"]
[[bucket]]
family = "csa_compressor"
op = "dape_reduce"
split = false
targets = ["b200"]
"""
