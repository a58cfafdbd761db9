"""How far the saved graphs' outputs may be from transformers' and still count as equal: one definition.

``--verify`` (logits, vision features) and the long-decode tests compare with ``compare``. The bound is
per row (one position's vocabulary, one image token's features), scaled to the largest |reference| of
that row, because the rounding error of a row comes from the arithmetic that made its largest entries
(the head's dot products), not from each entry's own size:

- float32 (and float64): ``relative x max(1, largest |reference|)`` (``verify.tolerance``, default 1e-4):
  the graphs run upstream's math in another order, so the error is a small fraction of the magnitude.
- bfloat16 / float16: ``ulps x ulp(max(1, largest |reference|))`` in the run's dtype. A relative bound
  cannot be right for every magnitude there: one bf16 step is 2**-8..2**-7 of the value, 0.0625
  between 8 and 16, so a fixed 5e-2 refused a one-step difference. Counting steps holds at every
  magnitude.

Why per row and not per element: measured on tiny DeepSeek-V3 in bf16 (115 greedy steps with identical
tokens), a logit near zero differed by 29,894 of its own ulps, while no row differed by more than 3 ulps
of its largest logit. The default, ``LOW_PRECISION_ULPS``, is justified in ``options.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

LOW_PRECISION = ("bfloat16", "float16")


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each ``|value|``: the spacing of representable numbers
    at that magnitude (``2**floor(log2|x|) * eps``; below the smallest normal number, the subnormal
    spacing). bf16 at 8..16: 0.0625; at 1..2: 0.0078125. Computed in float64, returned as float64."""
    info = torch.finfo(dtype)
    magnitude = values.detach().to(torch.float64).abs().clamp(min=info.smallest_normal)
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2**exponent with 0.5 <= m < 1
    return torch.ldexp(torch.full_like(magnitude, info.eps), exponent - 1)


@dataclass(frozen=True)
class Tolerance:
    """The accepted difference in one dtype: ``limit`` ulps of that dtype for bf16/fp16, else ``limit``
    times the magnitude."""

    dtype: str  # the dtype the graphs and the reference ran in ("float32", "bfloat16")
    limit: float  # bfloat16/float16: ulps of the dtype; float32/float64: a fraction of the magnitude

    @classmethod
    def of(cls, dtype: str, *, relative: float, ulps: float) -> Tolerance:
        """The tolerance of a run in ``dtype``: ``ulps`` for a low-precision dtype, else ``relative``."""
        return cls(dtype, ulps if dtype in LOW_PRECISION else relative)

    @property
    def in_ulps(self) -> bool:
        return self.dtype in LOW_PRECISION

    def bound(self, row_magnitude: torch.Tensor) -> torch.Tensor:
        """The largest accepted |difference| of each row, given its largest |reference| (float64)."""
        if self.in_ulps:  # at least 1, as for float32: a row of near-zero values is a cancellation
            return self.limit * ulp(
                row_magnitude.to(torch.float64).clamp(min=1.0), getattr(torch, self.dtype)
            )
        return self.limit * row_magnitude.to(torch.float64).clamp(min=1.0)

    def describe(self) -> str:
        if self.in_ulps:
            return f"{self.limit:g} ulps of {self.dtype} at each row's largest |reference| (at least 1)"
        return f"{self.limit:g} x each row's largest |reference| (at least 1)"


@dataclass(frozen=True)
class Comparison:
    """The outcome of ``compare``: the largest difference, and how close the worst row came to its bound."""

    tolerance: Tolerance
    max_diff: float
    worst: float  # max over rows of |difference| / bound: the check passes at <= 1
    worst_ulps: float | None  # bf16/fp16: the largest difference in ulps of its row's largest |reference|
    shape_error: str | None = None

    @property
    def passed(self) -> bool:
        return self.shape_error is None and self.worst <= 1.0  # NaN compares False: never passes

    def size(self) -> str:
        """The difference alone: ``max |diff| 3.4e-05 (0.099 of the bound)`` / ``... = 2 ulps``."""
        if self.shape_error is not None:
            return self.shape_error
        if self.worst_ulps is not None:
            return f"max |diff| {self.max_diff:.3g} = {self.worst_ulps:g} ulps"
        return f"max |diff| {self.max_diff:.2e} ({self.worst:.2g} of the bound)"

    def detail(self) -> str:
        if self.shape_error is not None:
            return self.shape_error
        return f"{self.size()}; bound {self.tolerance.describe()}"


def compare(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], tolerance: Tolerance) -> Comparison:
    """Compare each ``(actual, reference)`` pair row by row (the last dimension is the row) against the
    bound of ``tolerance``; all pairs together make one ``Comparison``."""
    max_diff = worst = 0.0
    worst_ulps: float | None = 0.0 if tolerance.in_ulps else None
    for actual, reference in pairs:
        if actual.shape != reference.shape:
            shapes = f"shape {tuple(actual.shape)}, expected {tuple(reference.shape)}"
            return Comparison(tolerance, float("inf"), float("inf"), None, shape_error=shapes)
        diff = (actual.detach().to(torch.float64) - reference.detach().to(torch.float64)).abs()
        rows = reference.detach().to(torch.float64).abs().amax(dim=-1, keepdim=True)
        max_diff = _worse(max_diff, diff.max().item())
        worst = _worse(worst, (diff / tolerance.bound(rows)).max().item())
        if worst_ulps is not None:
            step = ulp(rows.clamp(min=1.0), getattr(torch, tolerance.dtype))  # the bound's own unit
            worst_ulps = _worse(worst_ulps, (diff / step).max().item())
    return Comparison(tolerance, max_diff, worst, worst_ulps)


def _worse(current: float, new: float) -> float:
    """The larger of two differences, NaN winning (``max`` would drop a NaN that comes second)."""
    return new if new != new or new > current else current
