"""Half 1 of the family matrix (see ``family_matrix.py``)."""

from __future__ import annotations

import pytest
from family_matrix import FAILED, RECORDED, SKIP, TYPES, check_row, half


@SKIP
@pytest.mark.parametrize("model_type", half(0))
def test_row(model_type: str) -> None:
    check_row(model_type)


@SKIP
def test_the_page_has_a_row_for_every_decoder_model_and_no_other() -> None:
    assert sorted(RECORDED) == sorted(TYPES)
    assert not [row for row in RECORDED.values() if row.outcome == FAILED]
