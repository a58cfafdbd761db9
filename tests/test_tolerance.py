"""The one comparison ``--verify`` and the long-decode tests use (issue 22, item 5).

bf16/fp16 logits are compared in ulps of the dtype at each row's largest |reference|; float32 relative to
that magnitude. The ulp is checked against the dtype's own next representable number, and the bound is
shown to accept what rounding does (a few ulps at any magnitude, a one-step difference at 8..16 that a
fixed 5e-2 refused) and to refuse what a defect does.
"""

from __future__ import annotations

import pytest
import torch

from kimi_adapter_core.backends.extraction.equivalence.tolerance import Tolerance, compare, ulp
from kimi_adapter_core.backends.extraction.options import ExtractionOptions

ULPS = ExtractionOptions.verify_tolerance_ulps  # the documented default
RELATIVE = ExtractionOptions.verify_tolerance


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_ulp_is_the_distance_to_the_next_representable_number(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    values = (torch.randn(2000, generator=generator) * torch.logspace(-3, 3, 2000)).to(dtype)
    values = values[values != 0]
    magnitude = values.abs()
    following = torch.nextafter(magnitude, torch.full_like(magnitude, float("inf")))
    assert torch.equal(ulp(values, dtype), (following.double() - magnitude.double()))


def test_ulp_below_the_smallest_normal_number_is_the_subnormal_spacing() -> None:
    info = torch.finfo(torch.bfloat16)
    tiny = torch.tensor([0.0, info.smallest_normal / 4])
    assert torch.equal(ulp(tiny, torch.bfloat16), torch.full((2,), info.smallest_normal * info.eps).double())


def _logits(rows: int = 3, vocab: int = 64, scale: float = 8.0) -> torch.Tensor:
    """bf16 reference logits whose rows have different magnitudes."""
    generator = torch.Generator().manual_seed(1)
    spread = torch.tensor([scale, scale / 4, scale * 2][:rows]).view(-1, 1)
    return (torch.randn(rows, vocab, generator=generator) * spread).to(torch.bfloat16)


def _moved(reference: torch.Tensor, row: int, steps: float) -> torch.Tensor:
    """``reference`` (as float32) with one entry of ``row`` moved by ``steps`` ulps of that row's max."""
    out = reference.float().clone()
    largest = reference[row].abs().max()
    out[row, 5] += steps * ulp(largest, torch.bfloat16).item()
    return out


@pytest.mark.parametrize("row", [0, 1, 2])
def test_a_few_ulps_pass_and_a_thousand_fail_at_any_magnitude(row: int) -> None:
    reference = _logits()
    bf16 = Tolerance.of("bfloat16", relative=RELATIVE, ulps=ULPS)
    assert compare([(reference, reference)], bf16).worst_ulps == 0
    two = compare([(_moved(reference, row, 2), reference)], bf16)
    assert two.passed and two.worst_ulps == pytest.approx(2)
    thousand = compare([(_moved(reference, row, 1000), reference)], bf16)
    assert not thousand.passed and thousand.worst_ulps == pytest.approx(1000)
    assert compare([(_moved(reference, row, ULPS), reference)], bf16).passed
    assert not compare([(_moved(reference, row, ULPS * 1.5), reference)], bf16).passed


def test_one_bf16_step_at_magnitude_8_passes_where_5e_2_refused() -> None:
    """The issue's case: logits between 8 and 16, one step (0.0625) apart, identical tokens."""
    reference = torch.tensor([[9.5, -3.0, 12.25, 0.5]], dtype=torch.bfloat16)
    actual = reference.float() + torch.tensor([[0.0625, 0.0, -0.0625, 0.0]])
    result = compare([(actual, reference)], Tolerance("bfloat16", ULPS))
    assert result.max_diff == 0.0625 > 5e-2
    assert result.passed and result.worst_ulps == 1
    assert "1 ulps" in result.detail() and f"bound {ULPS:g} ulps of bfloat16" in result.detail()


def test_each_row_is_bounded_by_its_own_magnitude() -> None:
    """0.25 is 4 ulps for a row reaching 10 but 32 ulps for one reaching 0.5 (bounded at magnitude 1):
    the quiet row fails."""
    reference = torch.tensor([[10.0, 1.0], [0.5, 0.25]], dtype=torch.bfloat16)
    loud = reference.float() + torch.tensor([[0.0, 0.25], [0.0, 0.0]])
    quiet = reference.float() + torch.tensor([[0.0, 0.0], [0.0, 0.25]])
    bf16 = Tolerance("bfloat16", ULPS)
    assert compare([(loud, reference)], bf16).passed
    failed = compare([(quiet, reference)], bf16)
    assert not failed.passed and failed.worst_ulps == 32


def test_pairs_combine_into_one_verdict_and_nan_never_passes() -> None:
    reference = _logits()
    bf16 = Tolerance("bfloat16", ULPS)
    steps = [(reference, reference), (_moved(reference, 1, 1000), reference), (reference, reference)]
    assert not compare(steps, bf16).passed
    poisoned = reference.float().clone()
    poisoned[0, 0] = float("nan")
    assert not compare([(reference, reference), (poisoned, reference)], bf16).passed
    shapes = compare([(reference[:, :-1], reference)], bf16)
    assert not shapes.passed and "expected (3, 64)" in shapes.detail()


def test_float32_stays_relative_to_the_magnitude_at_least_one() -> None:
    fp32 = Tolerance.of("float32", relative=RELATIVE, ulps=ULPS)
    assert (fp32.limit, fp32.in_ulps) == (RELATIVE, False)
    reference = torch.tensor([[8.0, -2.0], [0.01, 0.02]])
    within = reference + torch.tensor([[RELATIVE * 8 * 0.9, 0.0], [RELATIVE * 0.9, 0.0]])
    beyond = reference + torch.tensor([[RELATIVE * 8 * 1.1, 0.0], [0.0, 0.0]])
    assert compare([(within, reference)], fp32).passed
    assert not compare([(beyond, reference)], fp32).passed
    assert compare([(within, reference)], fp32).worst_ulps is None


def test_a_near_zero_row_is_bounded_at_magnitude_one_in_low_precision_too() -> None:
    """A row of near-zero logits (cancellation in the head) gets the ulps of magnitude 1, as float32 gets
    its relative bound at 1: 1e-30 against 0 is far below one bf16 step at 1, 0.1 is far above."""
    from kimi_adapter_core.backends.extraction.equivalence.tolerance import Tolerance, compare

    bf16 = Tolerance.of("bfloat16", relative=1e-4, ulps=8)
    zeros = torch.zeros(1, 4)
    assert compare([(zeros + 1e-30, zeros)], bf16).passed
    assert not compare([(zeros + 0.1, zeros)], bf16).passed
