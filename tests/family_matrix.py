"""The family matrix as tests: each decoder-only model type of the installed transformers gets the row
``docs/families.md`` records (outcome, refusal code, whether plan's inventory is exact), and none fails.

Split over two test files (``test_family_matrix_*.py``) so the two xdist workers share the ~2 minutes.
The page is written against one transformers release; on another (the compatibility runs) the rows
may rightly differ, so the comparison is skipped there.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import transformers

from kimi_adapter_core.families.catalog import decoder_only
from kimi_adapter_core.families.page import read_rows
from kimi_adapter_core.families.trial import FAILED, PLAN_EXACT, run_trial

__all__ = ["FAILED", "RECORDED", "SKIP", "TYPES", "check_row", "half"]

PAGE = Path(__file__).resolve().parents[1] / "docs" / "families.md"
RECORDED = read_rows(PAGE)
PAGE_VERSION = re.search(r"against transformers (\S+);", PAGE.read_text()).group(1)
TYPES = [m.name for m in decoder_only()] if transformers.__version__ == PAGE_VERSION else []
SKIP = pytest.mark.skipif(
    transformers.__version__ != PAGE_VERSION,
    reason=f"docs/families.md records transformers {PAGE_VERSION}, not {transformers.__version__}",
)


def half(index: int) -> list[str]:
    return TYPES[index::2]


def check_row(model_type: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = run_trial(model_type)
    assert row.outcome != FAILED, f"{model_type} failed ({row.code}): {row.detail}"
    recorded = RECORDED.get(model_type)
    assert recorded is not None, f"{model_type} has no row in docs/families.md: regenerate the page"
    assert (row.outcome, row.code) == (recorded.outcome, recorded.code), (
        f"{model_type}: {row.outcome} {row.code} ({row.detail}), the page says {recorded.outcome} "
        f"{recorded.code} ({recorded.detail})"
    )
    # plan's inventory: exact where the page says so, and departing where it says it departs
    assert (row.plan == PLAN_EXACT) == (recorded.plan == PLAN_EXACT), (
        f"{model_type}: plan {row.plan!r}, the page says {recorded.plan!r}"
    )
