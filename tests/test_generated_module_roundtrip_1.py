"""The generated extraction modules vendored into a user's project: the second half of the shipped specs
outside ``CORE`` (``roundtrip.py`` says what is run and checked)."""

from __future__ import annotations

import pytest
from roundtrip import (
    HALVES,
    pytest_generate_tests,
    report,
    test_saved_graphs_carry_the_kv_mappings_names,
    test_saved_graphs_generate_like_transformers,
)

__all__ = [
    "pytest_generate_tests",
    "report",
    "test_saved_graphs_carry_the_kv_mappings_names",
    "test_saved_graphs_generate_like_transformers",
]
pytestmark = pytest.mark.compat  # run by .ci/compat against other transformers releases
NAMES = HALVES[1]
