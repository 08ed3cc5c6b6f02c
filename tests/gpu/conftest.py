"""GPU test plumbing: registers the ``gpu`` marker and skips ``gpu`` tests without CUDA.

The hooks live here (not in a root conftest or pyproject) so that ``pytest tests/gpu`` and
``pytest tests/`` from the repository root behave the same: pytest loads this conftest before it
collects any module under ``tests/gpu``, and ``pytest_configure`` of a conftest is called when the
conftest is registered. ``pytest_collection_modifyitems`` sees every collected item of the session,
so it acts only on items that carry the ``gpu`` marker.
"""

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped when torch.cuda.is_available() is False)")


def _cuda_available():
    try:
        import torch
    except Exception:  # pragma: no cover - torch is a test dependency
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
