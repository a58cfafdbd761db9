"""Every test gets its own empty extraction cache; full garbage collections are rarer.

``kadapt apply`` restores a run whose inputs it extracted before (``backends/extraction/cache.py``).
A test that monkey-patches kadapt or transformers in memory changes nothing the cache key sees, so a
cache shared between tests could hand it another test's artifacts: each test starts cold instead,
and subprocesses inherit the variable.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from kimi_adapter_core.cli.collector import FULL_COLLECTION_EVERY


def pytest_configure(config: pytest.Config) -> None:
    """Each test process collects its oldest generation as ``kadapt apply`` does (``cli/collector.py``):
    the suite keeps torch, transformers and its models alive throughout, and rescanning them took
    ~10% of a test file's time (measured on test_serving_contract.py, one process: 41.8 -> 37.6 s)."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)


@pytest.fixture(autouse=True)
def _private_extraction_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    root = tmp_path_factory.mktemp("extraction-cache")
    monkeypatch.setenv("KADAPT_CACHE_DIR", str(root))
    return root
