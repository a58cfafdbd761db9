"""The generated extraction modules vendored into a user's project: ``CORE`` and the first half of the
other shipped specs (``roundtrip.py`` says what is run and checked)."""

from __future__ import annotations

import pytest
from roundtrip import (
    HALVES,
    pytest_generate_tests,
    report,
    test_saved_graphs_carry_the_kv_mappings_names,
    test_saved_graphs_generate_like_transformers,
    test_the_script_ran_outside_the_checkout_without_kadapt,
)

__all__ = [
    "pytest_generate_tests",
    "report",
    "test_saved_graphs_carry_the_kv_mappings_names",
    "test_saved_graphs_generate_like_transformers",
    "test_the_script_ran_outside_the_checkout_without_kadapt",
]
pytestmark = pytest.mark.compat  # run by .ci/compat against other transformers releases
NAMES = HALVES[0]
