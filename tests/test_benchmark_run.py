"""A finite benchmark run (``search/benchmark_run.py``, ``kadapt simulate --concurrency --requests``).

What must hold: the lengths drawn again for a published point of bench_serving's random dataset give
the token totals the point published, to the token (the draws are the client's); the closed loop
keeps the client's order and slot count (hand-worked runs: waves of fixed lengths, a tail that steps
faster as slots empty); a run of varying lengths averages fewer requests in flight than its slots and
produces the tokens at a lower rate than the steady state; and ``--requests`` reports the run in text
and JSON, refusing its options where they do not apply.
"""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from kimi_adapter_core.backends.simulation.search.benchmark_run import RandomPrompts, closed_loop
from kimi_adapter_core.backends.simulation.search.serving_points import POINTS_FILE, serving_points
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import UsageError


def test_the_drawn_lengths_give_every_random_points_published_totals() -> None:
    published = {
        e["id"]: e["workload"] for e in yaml.safe_load(POINTS_FILE.read_text(encoding="utf-8"))["points"]
    }
    random = [p for p in serving_points() if p.prompts is not None]
    assert len(random) >= 40  # the SGLang cookbook's draws (range ratio 0) and dstack's fixed lengths
    assert sum(1 for p in random if p.prompts and p.prompts.range_ratio == 0.0) >= 18
    for p in random:
        assert p.prompts is not None
        prompts, outputs = p.prompts.lengths()
        totals = published[p.id]
        assert len(prompts) == len(outputs) == totals["requests"], p.id
        assert (sum(prompts), sum(outputs)) == (
            totals["total_input_tokens"],
            totals["total_output_tokens"],
        ), p.id
        assert p.prompts.means() == (p.isl, p.osl), p.id  # the steady state's lengths


def test_the_draws_are_the_clients_to_the_token() -> None:
    """bench_serving's seed-1 draws of 80 requests of up to 1000 + 1000 tokens: the cookbook's c16
    run published 39,668 prompt and 40,725 output tokens."""
    prompts, outputs = RandomPrompts(1000, 1000, 80, 0.0, 1).lengths()
    assert (sum(prompts), sum(outputs)) == (39668, 40725)
    assert min(prompts) >= 1 and max(prompts) <= 1000 and min(outputs) >= 0
    other = RandomPrompts(1000, 1000, 80, 0.0, 2).lengths()
    assert other != (prompts, outputs)  # the seed is used
    fixed = RandomPrompts(3200, 800, 5, 1.0).lengths()
    assert fixed == ([3200] * 5, [800] * 5)


def test_fixed_lengths_run_in_waves() -> None:
    # 6 requests of 11 tokens on 4 slots, TTFT 1 s, 0.5 s per token: two waves of 6 s
    run = closed_loop([11] * 6, 4, 1.0, 0.5, 0.5)
    assert run.duration == pytest.approx(12.0)
    assert run.output_tokens == 66
    assert run.mean_in_flight == pytest.approx(6 * 6.0 / 12.0)  # 3 of the 4 slots on average
    # a whole number of waves keeps every slot busy
    assert closed_loop([11] * 8, 4, 1.0, 0.5, 0.5).mean_in_flight == pytest.approx(4.0)


def test_the_tail_steps_at_the_pace_of_the_requests_left() -> None:
    # two slots, no TTFT; 2 s per token with both in flight, 1 s with one: the 2-token request
    # finishes at 2 s (1 token after its first), the 5-token one has 3 tokens left, decoded alone
    run = closed_loop([5, 2], 2, 0.0, 1.0, 2.0)
    assert run.duration == pytest.approx(2.0 + 3.0)
    assert run.mean_in_flight == pytest.approx((2.0 + 5.0) / 5.0)
    # at a constant TPOT the tail would be longer
    assert closed_loop([5, 2], 2, 0.0, 2.0, 2.0).duration == pytest.approx(8.0)
    # a request of one output token (or none) is done at its first token
    assert closed_loop([1, 0], 2, 0.5, 1.0, 1.0).duration == pytest.approx(0.5)


def test_varying_lengths_leave_slots_empty_at_the_end() -> None:
    _, outputs = RandomPrompts(1000, 1000, 80, 0.0, 1).lengths()
    run = closed_loop(outputs, 16, 0.2, 0.01, 0.02)
    assert 12 < run.mean_in_flight < 16
    steady = 16 / (0.2 + (sum(outputs) / len(outputs) - 1) * 0.02) * sum(outputs) / len(outputs)
    assert run.output_tok_s < steady


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (RandomPrompts(10, 10, 0), "--requests must be >= 1"),
        (RandomPrompts(10, 10, 5, 1.5), "--random-range-ratio must be in"),
        (RandomPrompts(10, 10, 5, 0.0, -1), "--seed must be in"),
    ],
)
def test_bad_draws_are_usage_errors(prompts: RandomPrompts, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        prompts.lengths()


RUN = ["simulate", "llama", "--device", "h100", "--isl", "256", "--osl", "32", "--concurrency", "4"]


def test_requests_report_the_run_in_text_and_json() -> None:
    runner = CliRunner()
    text = runner.invoke(cli, [*RUN, "--requests", "10", "--random-range-ratio", "0.5"])
    assert text.exit_code == 0, text.output
    assert "a run of 10 requests, 4 in flight at most" in text.output
    assert "range ratio 0.5, seed 1" in text.output
    doc = json.loads(
        runner.invoke(
            cli, [*RUN, "--requests", "10", "--random-range-ratio", "0.5", "--format", "json"]
        ).output
    )
    run = doc["run"]
    assert run["requests"] == 10 and run["seed"] == 1 and run["range_ratio"] == 0.5
    assert 0 < run["mean_in_flight"] <= 4
    _, outputs = RandomPrompts(256, 32, 10, 0.5, 1).lengths()
    assert run["output_tokens"] == sum(outputs)
    # the steady state is priced at the drawn mean lengths
    assert (doc["workload"]["isl"], doc["workload"]["osl"]) == RandomPrompts(256, 32, 10, 0.5, 1).means()
    # ten fixed-length requests on 4 slots: three waves, the last of two
    fixed = json.loads(runner.invoke(cli, [*RUN, "--requests", "10", "--format", "json"]).output)["run"]
    assert fixed["mean_in_flight"] < 4 and fixed["output_tokens"] == 320


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--random-range-ratio", "0"], "add --requests"),
        (["--requests", "8", "--seed", "2"], "add --random-range-ratio"),
        (["--requests", "8", "--random-range-ratio", "2"], "not in the range"),
    ],
)
def test_run_options_are_refused_where_they_do_not_apply(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, [*RUN, *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output
    alone = CliRunner().invoke(cli, ["simulate", "llama", "--device", "h100", "--requests", "8"])
    assert alone.exit_code == 2 and "price a --concurrency run" in alone.output
