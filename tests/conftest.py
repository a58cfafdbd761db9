"""Every test gets its own empty extraction cache; full garbage collections are rarer; each xdist
worker runs torch on its share of the CPUs; ``shipped_apply`` is one ``kadapt apply --verify`` per
shipped spec for the whole run (``fixtures/shared_apply.py``).

``kadapt apply`` restores a run whose inputs it extracted before (``backends/extraction/job/cache.py``).
A test that monkey-patches kadapt or transformers in memory changes nothing the cache key sees, so a
cache shared between tests could hand it another test's artifacts: each test starts cold instead,
and subprocesses inherit the variable.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
from fixtures.shared_apply import SharedApplies

from kimi_adapter_core.cli.collector import FULL_COLLECTION_EVERY


def _threads_per_worker() -> int | None:
    """The CPUs this process may use divided among the xdist workers (None outside xdist)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1:
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // workers)


# Two xdist workers on two CPUs, each with torch's default of one intra-op thread per CPU, put four
# spinning OpenMP threads on two cores: a tiny model's forward then waits on a descheduled thread
# (``whole_model.one_thread`` says the same for the library). Measured on 2 CPUs, two concurrent
# copies of test_kv_contract.py[kimi_k25]: 142 s each with 2 threads, 9 s each with 1. Set before
# torch is imported (the OpenMP runtime reads it once) and inherited by the tests' subprocesses; a
# value the caller set wins.
# The same goes for kadapt's export processes (``backends/extraction/job/forked.py``): under xdist the
# CPUs are already divided among the workers, so forking two children from a 1-2 GB worker buys no
# parallelism, only the fork (measured over the suite: ~40 CPU-s). The shared runs of the shipped
# specs (``shipped_apply``) and ``test_forked_exports.py`` still take the forked path a user gets.
if (_THREADS := _threads_per_worker()) is not None:
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "KADAPT_EXPORT_PROCESSES"):
        os.environ.setdefault(_name, str(_THREADS))


def pytest_configure(config: pytest.Config) -> None:
    """Each test process collects its oldest generation as ``kadapt apply`` does (``cli/collector.py``):
    the suite keeps torch, transformers and its models alive throughout, and rescanning them took
    ~10% of a test file's time (measured on test_serving_contract.py, one process: 41.8 -> 37.6 s)."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)
    if "torch" in sys.modules and _THREADS is not None:  # a plugin imported it before this file
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _private_extraction_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    root = tmp_path_factory.mktemp("extraction-cache")
    monkeypatch.setenv("KADAPT_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="session")
def shipped_apply(tmp_path_factory: pytest.TempPathFactory) -> SharedApplies:
    """``shipped_apply("llama")``: ``kadapt apply specs/llama.yaml --verify --format json``, run once for
    all xdist workers (their session's common temporary root) and only read by the tests."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-apply"
    root.mkdir(exist_ok=True)
    return SharedApplies(root)
