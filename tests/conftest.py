"""Every test gets its own empty extraction cache.

``kadapt apply`` restores a run whose inputs it extracted before (``backends/extraction/cache.py``).
A test that monkey-patches kadapt or transformers in memory changes nothing the cache key sees, so a
cache shared between tests could hand it another test's artifacts: each test starts cold instead,
and subprocesses inherit the variable.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _private_extraction_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    root = tmp_path_factory.mktemp("extraction-cache")
    monkeypatch.setenv("KADAPT_CACHE_DIR", str(root))
    return root
