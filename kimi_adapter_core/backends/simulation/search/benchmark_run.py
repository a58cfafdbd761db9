"""A finite benchmark run: N requests through a closed-loop client that keeps C of them in flight.

``kadapt simulate --concurrency C`` prices the steady state: C requests always in flight, each replaced
the moment it finishes. A published point is a run of N requests (``bench_serving --num-prompts N
--max-concurrency C``): the client issues them in order as slots free, and the run ends when the last
one finishes. Its measured throughput is the output tokens over the whole run, tail included. Where the
requests' lengths vary (``--dataset-name random`` below ``--random-range-ratio 1``), the slots empty one
by one at the end while the longest requests finish, so fewer than C are in flight on average. The
SGLang cookbook's runs of 5 x C requests averaged 0.87-0.93 x C in flight (their published
``concurrency``). Fixed-length requests stay in waves, and a run of N not a multiple of C ends on a
partial wave.

This module reproduces the run from the point's own inputs:

- **The lengths.** ``bench_serving`` draws each request's lengths with numpy's legacy generator seeded
  by ``--seed`` (default 1): ``randint(max(int(ISL x r), 1), ISL + 1, N)`` prompt tokens, then
  ``randint(int(OSL x r), OSL + 1, N)`` output tokens (``r`` the range ratio, default 0.0). This is
  SGLang 0.5.6's ``sample_random_requests``, and the draws give the published token totals to the
  token (``tests/test_benchmark_run.py``).
- **The schedule** (``closed_loop``). Each request spends the priced TTFT before its first token, then
  decodes its other tokens at the TPOT of the requests in flight at the time. That TPOT is affine in
  the requests in flight between the price at one request and the price at C. A decode step's weight
  reads are shared and its per-request work (attention, KV reads, the expert rows) grows with the
  batch, so the tail's smaller batches step faster. Priced at C's TPOT throughout, the tail would be
  too long: in-flight counts 8-11% below the cookbook's published ones, against 1-2% with the affine
  TPOT.

Not modelled: the first wave's prompts arriving together (their TTFT is the steady state's), and a
request's TTFT following its own prompt length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from ....errors import UsageError


@dataclass(frozen=True)
class RandomPrompts:
    """``bench_serving --dataset-name random``: ``requests`` prompts, each up to ``isl`` prompt and
    ``osl`` output tokens, drawn down to ``range_ratio`` of them with numpy's legacy generator seeded
    with ``seed``."""

    isl: int
    osl: int
    requests: int
    range_ratio: float = 0.0
    seed: int = 1

    def check(self) -> None:
        if self.requests < 1:
            raise UsageError(f"--requests must be >= 1 (got {self.requests})")
        if not 0.0 <= self.range_ratio <= 1.0:
            raise UsageError(f"--random-range-ratio must be in [0, 1] (got {self.range_ratio:g})")
        if not 0 <= self.seed < 2**32:
            raise UsageError(f"--seed must be in [0, 2**32) (got {self.seed}): numpy's legacy generator")

    def lengths(self) -> tuple[list[int], list[int]]:
        """Per request, its prompt and output tokens, as ``bench_serving`` draws them (drawn once: the
        run, its mean lengths and its report read the same draws)."""
        return self._drawn

    @cached_property
    def _drawn(self) -> tuple[list[int], list[int]]:
        import numpy as np  # only a benchmark run needs it (the CLI's help and validate do not)

        self.check()
        draw = np.random.RandomState(self.seed)
        prompts = draw.randint(max(int(self.isl * self.range_ratio), 1), self.isl + 1, size=self.requests)
        outputs = draw.randint(int(self.osl * self.range_ratio), self.osl + 1, size=self.requests)
        return [int(n) for n in prompts], [int(n) for n in outputs]

    def means(self) -> tuple[int, int]:
        """The run's mean prompt and output tokens per request (at least 1 and 2: a request's TPOT
        needs a second token), the lengths its steady state is priced at."""
        prompts, outputs = self.lengths()
        return max(round(sum(prompts) / len(prompts)), 1), max(round(sum(outputs) / len(outputs)), 2)


@dataclass(frozen=True)
class Run:
    """A finished run: its length in seconds, the output tokens its requests produced, and the mean
    requests in flight (their summed latencies over the run: ``bench_serving``'s ``concurrency``)."""

    duration: float
    output_tokens: int
    mean_in_flight: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration


def closed_loop(
    outputs: Sequence[int], concurrency: int, ttft: float, tpot_one: float, tpot_full: float
) -> Run:
    """The run of requests producing ``outputs`` tokens each, issued in order with at most
    ``concurrency`` in flight: each spends ``ttft`` seconds before its first token and decodes its
    other tokens at the TPOT of the requests in flight then, ``tpot_one`` at one and ``tpot_full`` at
    ``concurrency``, affine between (see the module docstring)."""
    if concurrency < 1 or not outputs:
        raise UsageError(f"a run needs requests and a concurrency >= 1 (got {len(outputs)}, {concurrency})")
    waiting = list(reversed(outputs))
    # per request in flight: seconds of TTFT left, tokens left to decode, when it started
    flight: list[list[float]] = []
    now = latencies = 0.0
    while waiting or flight:
        while waiting and len(flight) < concurrency:
            flight.append([ttft, max(waiting.pop() - 1, 0), now])
        b = len(flight)
        tpot = (
            tpot_full if concurrency == 1 else tpot_one + (tpot_full - tpot_one) * (b - 1) / (concurrency - 1)
        )
        step = min(f[0] if f[0] > 0 else f[1] * tpot for f in flight)
        now += step
        for f in flight:
            if f[0] > 0:
                f[0] = max(f[0] - step, 0.0)
            else:
                f[1] = max(f[1] - step / tpot, 0.0)
        left = []
        for f in flight:  # a request with neither TTFT nor tokens left has finished: its latency counts
            if f[0] > 1e-12 or f[1] > 1e-9:
                left.append(f)
            else:
                latencies += now - f[2]
        flight = left
    return Run(now, sum(outputs), latencies / now if now > 0 else float(concurrency))
