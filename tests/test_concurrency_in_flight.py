"""``--concurrency N``: which requests are in flight and at whose pace (``search/concurrency``).

Where N requests' KV cache does not fit, the engine holds as many as it can and queues the rest
(``admitted``).

What must hold: the requests in flight are the most whose cache fits beside the weights and activations
(one more per DP group would not), the same in every DP group; the price is that of the requests in
flight, priced directly; TTFT adds the queue's wait at the service rate; a concurrency that fits queues
none; where not even one request per group fits, the price is of all N and says it does not fit; the
text and JSON reports say how many are in flight and how many wait.

Where N does not split evenly over the DP groups, the groups step in lockstep at the busiest group's
pace: the price is that of ceil(N / dp) requests per group, at the rate of N requests.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.search.concurrency import price_concurrency
from kimi_adapter_core.backends.simulation.search.grid import quant_modes, sweep_inputs
from kimi_adapter_core.backends.simulation.search.request_pricing import Candidate, Workload
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.cli import cli
from kimi_adapter_core.spec import load_spec

LLAMA = load_spec(REPO / "specs" / "llama.yaml")
LONG = Workload(8000, 8000)  # 2.1 GB of bf16 KV cache per Llama-3.1-8B request
TWO_GROUPS = Deployment(Parallel(tp=1, dp=2), 1, 1, 0, False)


def priced(concurrency: int) -> Candidate:
    inputs = sweep_inputs(LLAMA, quant_modes(LLAMA, None))
    return price_concurrency(LLAMA, inputs, get_device("a100"), TWO_GROUPS, LONG, "vllm", concurrency)


@pytest.fixture(scope="module")
def queued() -> Candidate:
    return priced(128)


def test_the_requests_in_flight_are_the_most_whose_cache_fits(queued: Candidate) -> None:
    in_flight = 128 - queued.queued
    assert 0 < queued.queued < 128 and in_flight % 2 == 0  # the same in both DP groups
    assert queued.fits and queued.decode.config.batch == in_flight
    assert priced(in_flight + 2).queued == 2  # one more request per group would not fit


def test_the_price_is_that_of_the_requests_in_flight_plus_the_queues_wait(queued: Candidate) -> None:
    direct = priced(128 - queued.queued)
    assert direct.queued == 0
    assert queued.tpot == direct.tpot and queued.requests_per_s == direct.requests_per_s
    wait = queued.queued / direct.requests_per_s  # the queue drains at the service rate
    assert queued.ttft == pytest.approx(direct.ttft + wait, rel=1e-12)
    assert queued.tokens_per_s_per_device == direct.tokens_per_s_per_device


def test_a_concurrency_that_fits_queues_none() -> None:
    c = priced(4)
    assert c.fits and c.queued == 0 and c.decode.config.batch == 4


def test_not_one_request_per_group_fits_prices_all_and_says_so() -> None:
    """A device profile of 17.5 GB: Llama-3.1-8B's 16 GB of weights fit, one 2.1 GB request does not."""
    small = replace(get_device("a100"), memory_bytes=17.5e9)
    inputs = sweep_inputs(LLAMA, quant_modes(LLAMA, None))
    base = Deployment(Parallel(), 1, 1, 0, False)
    c = price_concurrency(LLAMA, inputs, small, base, LONG, "vllm", 8)
    assert not c.fits and c.queued == 0 and c.decode.config.batch == 8


def test_the_reports_say_how_many_are_in_flight_and_how_many_wait(queued: Candidate) -> None:
    args = ["simulate", "llama", "--device", "a100", "--dp", "2", "--framework", "vllm", "--isl", "8000"]
    args += ["--osl", "8000", "--concurrency", "128"]
    text = CliRunner().invoke(cli, args)
    assert text.exit_code == 0, text.output
    assert f"in flight: {128 - queued.queued} requests" in text.output
    assert f"the other {queued.queued} wait in the engine's queue" in text.output
    assert "WARNING: does not fit" not in text.output
    doc = json.loads(CliRunner().invoke(cli, [*args, "--format", "json"]).output)
    assert (doc["in_flight"], doc["queued"], doc["fits"]) == (128 - queued.queued, queued.queued, True)
    assert doc["ttft_s"] == pytest.approx(queued.ttft)


def test_an_uneven_split_runs_at_the_busiest_groups_pace() -> None:
    """3 requests over 2 DP groups: TTFT and TPOT of 2 per group (the busier group sets both groups'
    steps), three quarters of 4 requests' rate; the reports say so."""
    inputs = sweep_inputs(LLAMA, quant_modes(LLAMA, None))
    short = Workload(512, 64)

    def at(concurrency: int) -> Candidate:
        return price_concurrency(LLAMA, inputs, get_device("a100"), TWO_GROUPS, short, "vllm", concurrency)

    three, four = at(3), at(4)
    assert (three.ttft, three.tpot, three.decode.config.batch) == (four.ttft, four.tpot, 4)
    assert three.requests_per_s == pytest.approx(four.requests_per_s * 3 / 4, rel=1e-12)
    assert (three.idle, four.idle, three.queued) == (1, 0, 0)
    args = ["simulate", "llama", "--device", "a100", "--dp", "2", "--framework", "vllm", "--isl", "512"]
    args += ["--osl", "64", "--concurrency", "3"]
    text = CliRunner().invoke(cli, args)
    assert text.exit_code == 0 and "3 requests over 2 DP groups: priced as 2 per group" in text.output
    doc = json.loads(CliRunner().invoke(cli, [*args, "--format", "json"]).output)
    assert (doc["in_flight"], doc["queued"], doc["idle_slots"]) == (3, 0, 1)
