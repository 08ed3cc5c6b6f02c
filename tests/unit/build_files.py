"""Writing a build's files by hand, as the pack stage does (for tests that tamper with a build)."""

import hashlib
import json


def write_index(root, doc):
    """index.json and the index.sha256 that covers it, as the pack stage writes them."""
    text = json.dumps(doc, indent=1, sort_keys=True).encode()
    (root / "index.json").write_bytes(text)
    (root / "index.sha256").write_text(hashlib.sha256(text).hexdigest() + "\n")
