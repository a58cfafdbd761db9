"""Prompt steps apart from decoding: SGLang's default scheduling, priced by ``kadapt simulate --concurrency``
and the request sweep (``request_pricing.prefill_first``, ``serving.ServingSearch``).

What must hold: each framework states how it runs prompt tokens (mixed with the decode rows or in steps
of their own; replayed as a CUDA graph or launched eagerly) with a source; SGLang's step budget follows
the device's memory and is shared by the attention-DP groups, as its server arguments set it; prompts
arriving at the same decode step are prefilled together, in steps of at most the budget; a request's
TPOT holds the other requests' prompt steps but not its own batch's, which are in its TTFT; other DP
groups' prompt steps slow this group's decode steps (lockstep); an eager prompt step takes at least the
host's time per launched kernel.
"""

from __future__ import annotations

import pytest
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.simulation.estimate.eager import HOST_US, launches
from kimi_adapter_core.backends.simulation.estimate.planner import Memory
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.search.concurrency import price_concurrency
from kimi_adapter_core.backends.simulation.search.grid import Config, Point, quant_modes, sweep_inputs
from kimi_adapter_core.backends.simulation.search.launch_rules import framework, frameworks
from kimi_adapter_core.backends.simulation.search.request_pricing import (
    Workload,
    follows_requests,
    prefill_first,
    prompt_batches,
)
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.spec import load_spec

H200, B200 = get_device("h200"), get_device("b200")
LLAMA = load_spec(REPO / "specs" / "llama.yaml")


def test_sglang_budget_follows_device_memory_and_is_shared_by_dp_groups() -> None:
    step = framework("sglang").step_tokens
    assert step.default(B200.memory_bytes, 1) == 16384  # 0.5.6: above 160 GiB
    assert step.default(H200.memory_bytes, 1) == 8192  # below 160 GiB
    assert step.default(40 * 2**30, 1) == 4096  # below 60 GiB
    assert step.default(H200.memory_bytes, 8) == 1024  # --enable-dp-attention divides it by the DP size
    assert step.budgets(H200.memory_bytes, 2) == (256, 512, 1024, 2048, 4096)  # the sweep's, shared
    trtllm = framework("trtllm").step_tokens
    assert trtllm.default(H200.memory_bytes, 8) == 8192  # every attention-DP rank its own budget


def test_every_framework_states_how_it_runs_prompt_steps() -> None:
    for name in frameworks():
        assert framework(name).prompt_steps.source
    sglang = framework("sglang").prompt_steps
    assert (sglang.mixed, sglang.cuda_graphs) == (False, False)
    assert framework("vllm").prompt_steps.mixed and framework("trtllm").prompt_steps.mixed


def test_prompts_arriving_apart_are_prefilled_one_by_one() -> None:
    steps, split, tokens = prompt_batches(4, 10_000, 1000, 8192)
    assert steps == pytest.approx(4, rel=1e-3)  # four arrivals over 10,000 steps: four batches
    assert split == pytest.approx(1) and tokens == 1001  # a batch of one prompt, rarely two


def test_prompts_arriving_together_share_steps_up_to_the_budget() -> None:
    steps, split, tokens = prompt_batches(1000, 10, 1000, 8192)
    # ~100 prompts per decode step (Poisson): ceil(k x 1000 / 8192) steps each, about 12.7 on average
    assert 12 < split < 13.5 and tokens <= 8192
    assert steps == pytest.approx(10 * split, rel=1e-6)  # every decode step has arrivals
    assert tokens * split == pytest.approx(100_000, rel=1e-3)


def test_a_batch_takes_its_expected_steps_not_the_steps_of_its_mean_size() -> None:
    # one 1,024-token prompt in two 512-token steps: the mean batch (1.0005 prompts, 1,024.5 tokens)
    # would take three
    steps, split, tokens = prompt_batches(1, 10_000, 1024, 512)
    assert split == pytest.approx(2, rel=1e-3) and tokens == 512
    steps, split, tokens = prompt_batches(1, 1000, 20_000, 8192)
    assert split == pytest.approx(3, rel=1e-3) and tokens == pytest.approx(20_000 / 3, rel=1e-3)
    assert steps == pytest.approx(3, rel=1e-3)


def test_prompt_batches_hold_at_extreme_arrival_rates() -> None:
    steps, split, tokens = prompt_batches(10**6, 3, 100, 8192)  # e^-rate underflows: summed in logs
    assert split == pytest.approx(10**6 / 3 * 100 / 8192, rel=1e-3) and tokens <= 8192
    steps, split, tokens = prompt_batches(1, 1e9, 100, 8192)
    assert (split, tokens) == (pytest.approx(1), 101)


def _point(par: Parallel, batch: int, step_time: float) -> Point:
    return Point(Config(par, batch, None), step_time, 0.0, 0.0, Memory(1.0, 1.0, 1.0, None))


@pytest.mark.parametrize("dp", [1, 4])
def test_prefill_first_prices_a_cycle_of_prompt_and_decode_steps(dp: int) -> None:
    par = Parallel(tp=1, dp=dp)
    w = Workload(2000, 101)
    decode, t_prompt = _point(par, 8 * dp, 0.010), 0.050
    c = prefill_first(decode, decode, t_prompt, 1024, decode.memory, w, 1.0, dp)
    n = 100  # decode steps per request
    steps, split, tokens = prompt_batches(8, n, 2000, 1024)
    assert split >= 2 and c.chunk == tokens <= 1024 and c.apart  # ~2,000 tokens a batch, 1,024 a step
    slow = min((dp - 1) * steps, n)  # this group decoding in another group's prompt pass
    cycle = (steps + slow) * t_prompt + (n - slow) * 0.010
    assert c.requests_per_s == pytest.approx(8 * dp / cycle)
    # its own batch's prompt steps are in its TTFT, not between its tokens
    assert c.tpot == pytest.approx(((steps - split + slow) * t_prompt + (n - slow) * 0.010) / n)
    assert c.ttft == pytest.approx(split * t_prompt + cycle / (steps + n) / 2)
    assert c.mixed_step_time == t_prompt
    if dp > 1:  # other groups' prompts slow this group's decoding
        alone = prefill_first(_point(Parallel(), 8, 0.010), decode, t_prompt, 1024, decode.memory, w, 1.0, 1)
        assert c.tpot > alone.tpot


@pytest.fixture(scope="module")
def priced() -> dict[str, object]:
    """Llama-3.1-8B on 2 H200 (TP2), 16 requests of 1024 + 64 tokens, under SGLang and TensorRT-LLM."""
    inputs = sweep_inputs(LLAMA, quant_modes(LLAMA, "bf16"))
    base = Deployment(Parallel(tp=2), 1, 1, 0, True)
    w = Workload(1024, 64)
    return {fw: price_concurrency(LLAMA, inputs, H200, base, w, fw, 16) for fw in ("sglang", "trtllm")}


def test_sglang_runs_prompt_steps_apart_and_eagerly(priced: dict[str, object]) -> None:
    c = priced["sglang"]
    assert c.apart and not priced["trtllm"].apart
    # a prompt step is one eager pass: at least the host's time for each kernel it launches, every
    # kernel of the decode step but the logits (a prompt step's one row of logits is not priced)
    layers = [k for k in _decode_kernels(c) if k.op.kind == "attention" or not follows_requests(k.op)]
    assert c.mixed_step_time >= launches(layers) * HOST_US * 1e-6
    assert c.tpot > c.decode.step_time  # other requests' prompt steps stall decoding
    # the request sweep's candidate is the concurrency price: one formula
    assert c.tokens_per_s_per_device == pytest.approx(c.requests_per_s * 64 / 2)


def _decode_kernels(c: object) -> list[object]:
    from kimi_adapter_core.backends.simulation.estimate.simulator import simulate
    from kimi_adapter_core.backends.simulation.model.inputs import model_inputs

    dep = Deployment(c.decode.config.parallel, c.decode.config.batch, 1, 1088, True)
    return simulate(model_inputs(LLAMA, "bf16"), LLAMA, dep, H200).kernels
