"""``kadapt simulate --concurrency``'s finite run: ``--requests --random-range-ratio --seed`` and how the
run is reported (text and JSON).

Apart from ``serving_options`` because a run is its own question (N requests through a closed-loop
client, ``search/benchmark_run.py``), asked only beside ``--concurrency``. Nothing here imports torch:
the options build the help.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from ..backends.simulation.search.benchmark_run import RandomPrompts, Run

RUN_OPTIONS = (
    click.option(
        "--requests",
        "run_requests",
        type=click.IntRange(1, 1 << 20),
        default=None,
        help="With --concurrency: also price the finite run of this many requests through a client "
        "keeping --concurrency of them in flight (bench_serving --num-prompts N --max-concurrency C): its "
        "length, output tokens/s and mean requests in flight, the last requests finishing while slots "
        "stand empty.",
    ),
    click.option(
        "--random-range-ratio",
        type=click.FloatRange(0.0, 1.0),
        default=None,
        help="With --requests: draw each request's prompt and output tokens as bench_serving's random "
        "dataset does, uniformly from this fraction of --isl/--osl up to them (bench_serving's default is "
        "0.0; without this option every request is --isl/--osl tokens). The steady state is then priced "
        "at the drawn means.",
    ),
    click.option(
        "--seed",
        type=click.IntRange(0, 2**32 - 1),
        default=None,
        help="With --random-range-ratio: bench_serving's --seed for the draws (default 1, its own).",
    ),
)


def run_json(run: Run, prompts: RandomPrompts, devices: int) -> dict[str, object]:
    """A finite run's figures as JSON: its requests and their draws, length, output tokens/s and mean
    requests in flight."""
    return {
        "requests": prompts.requests,
        "range_ratio": prompts.range_ratio,
        "seed": prompts.seed,
        "duration_s": run.duration,
        "output_tokens": run.output_tokens,
        "output_tokens_per_s_per_device": run.output_tok_s / devices,
        "mean_in_flight": run.mean_in_flight,
    }


def run_text(run: Run, prompts: RandomPrompts, concurrency: int, devices: int) -> str:
    """A finite run's figures as one line of text."""
    drawn = (
        f"lengths drawn as bench_serving's random dataset, range ratio {prompts.range_ratio:g}, seed "
        f"{prompts.seed}"
        if prompts.range_ratio < 1
        else "every request the same lengths"
    )
    return (
        f"a run of {prompts.requests} requests, {concurrency} in flight at most ({drawn}): "
        f"{run.duration:.1f} s, output tokens/s {run.output_tok_s / devices:.1f} per device, "
        f"{run.mean_in_flight:.2f} requests in flight on average"
    )
