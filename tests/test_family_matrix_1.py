"""Half 2 of the family matrix (see ``family_matrix.py``)."""

from __future__ import annotations

import pytest
from family_matrix import SKIP, check_row, half


@SKIP
@pytest.mark.parametrize("model_type", half(1))
def test_row(model_type: str) -> None:
    check_row(model_type)
