"""Writing a build's files by hand, as the pack stage does (for tests that tamper with a build)."""

import hashlib
import json
import shutil
from pathlib import Path

from dsa_aot.policy.artifact import series

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


def write_build(root, entries, blobs=None, **header):
    """The shipped tree of ``entries`` as the pack stage writes it (``pack.write_tree``): ``blobs`` {sha256:
    bytes} their cubins and launchers (a sha256 without one gets empty bytes: for index-only tests)."""
    from dsa_aot.toolchain import pack

    blobs = dict(blobs or {})
    for e in entries:
        for k in ("sha256", "launcher_sha256"):
            blobs.setdefault(e[k], b"")
    pack.write_tree(Path(root), {"tools": {}, "for_shipping": True} | header, entries, blobs)


def reseal(root):
    """After a test edited ``index/<family>.json``: the sha256s above it, as a build that wrote it would."""
    root = Path(root)
    doc = json.loads((root / "index.json").read_text())
    for ref in doc["indexes"].values():
        ref["sha256"] = hashlib.sha256((root / ref["index"]).read_bytes()).hexdigest()
    write_index(root, doc)


def write_index(root, doc):
    """index.json and the index.sha256 that covers it, as the pack stage writes them."""
    text = json.dumps(doc, indent=1, sort_keys=True).encode()
    (root / "index.json").write_bytes(text)
    (root / "index.sha256").write_text(hashlib.sha256(text).hexdigest() + "\n")


def family_index(root, family, arch="sm_90a"):
    """The index of ``family``'s entries for ``arch``'s series."""
    return json.loads((Path(root) / "index" / f"{family}.{series(arch)}.json").read_text())


def edit_family(root, family, edit, arch="sm_90a"):
    """``edit(doc)`` on the index of ``family`` for ``arch``'s series, then resealed."""
    doc = family_index(root, family, arch)
    edit(doc)
    (Path(root) / "index" / f"{family}.{series(arch)}.json").write_text(json.dumps(doc, indent=1, sort_keys=True))
    reseal(root)


def group_file(root, entry, what="cubin"):
    """The file of the group holding ``entry``'s cubin (or launcher)."""
    grp = family_index(root, entry["family"], entry["arch"])["groups"][entry[what]]
    return Path(root) / grp["file"]


def rewrite_group(root, entry, what, change):
    """Replace the group holding ``entry``'s ``what`` with ``change(its decompressed bytes)``, every sha256 above
    the group made to match (a build that wrote it wrong): only the member's own sha256 is left to catch it."""
    import lzma

    def edit(doc):
        grp = doc["groups"][entry[what]]
        data = change(lzma.decompress((Path(root) / grp["file"]).read_bytes()))
        blob = lzma.compress(data, format=lzma.FORMAT_XZ)
        (Path(root) / grp["file"]).write_bytes(blob)
        grp.update(sha256=hashlib.sha256(blob).hexdigest(), bytes=len(data))

    edit_family(root, entry["family"], edit, entry["arch"])


def entries_of(root) -> list:
    """The entries of the build in ``root``, as the runtime reads them."""
    from dsa_aot.runtime.index import Index

    return Index(root).entries


def launcher_source(root, entry) -> str:
    from dsa_aot.runtime.index import Index

    return Index(root).member(entry, "launcher").decode()


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
