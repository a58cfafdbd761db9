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
from kimi_adapter_core.backends.simulation.search.serving import ServingSearch
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.spec import load_spec

H200, B200 = get_device("h200"), get_device("b200")
LLAMA = load_spec(REPO / "specs" / "llama.yaml")
BASE = Deployment(Parallel(), 1, 1, 0, True)


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
    steps, own, tokens = prompt_batches(4, 10_000, 1000, 8192)
    assert steps == pytest.approx(4, rel=1e-3)  # four arrivals over 10,000 steps: four prompt steps
    assert own == pytest.approx(1) and 1000 <= tokens <= 1001  # its own batch: itself, rarely two


def test_a_single_request_sees_no_other_prompt() -> None:
    for osl_steps in (1, 2, 7, 1e4):  # whatever the cycle's length
        steps, own, tokens = prompt_batches(1, osl_steps, 4000, 8192)
        assert (steps, own, tokens) == (1, 1, 4000)  # its own prompt step only: none in its TPOT


def test_prompts_arriving_together_share_steps_up_to_the_budget() -> None:
    steps, own, tokens = prompt_batches(1000, 10, 1000, 8192)
    # ~100 prompts per decode step: ceil(k x 1000 / 8192) steps each, about 12.8 for a request's batch
    assert 12 < own < 13.5 and tokens <= 8192
    assert steps == pytest.approx(10 * own, rel=0.02)  # every decode step brings a batch
    assert tokens * steps == pytest.approx(1000 * 1000, rel=1e-3)  # a cycle prefills every prompt


def test_a_batch_takes_its_expected_steps_not_the_steps_of_its_mean_size() -> None:
    # one 1,024-token prompt in two 512-token steps (rarely a second prompt with it: four)
    steps, own, tokens = prompt_batches(2, 10_000, 1024, 512)
    assert own == pytest.approx(2, rel=1e-3) and steps == pytest.approx(4, rel=1e-3) and tokens == 512
    steps, own, tokens = prompt_batches(1, 1000, 20_000, 8192)
    assert (steps, own, tokens) == (3, 3, 6667)


def test_prompt_batches_hold_at_extreme_arrival_rates() -> None:
    steps, own, tokens = prompt_batches(10**6, 3, 100, 8192)  # summed in logs: exp(-rate) underflows
    assert own == pytest.approx(10**6 / 3 * 100 / 8192, rel=1e-3) and tokens <= 8192
    steps, own, tokens = prompt_batches(5, 0.5, 100, 8192)  # under one decode step a request: one batch
    assert (steps, own, tokens) == (1, 1, 500)


def _point(par: Parallel, batch: int, step_time: float) -> Point:
    return Point(Config(par, batch, None), step_time, 0.0, 0.0, Memory(1.0, 1.0, 1.0, None))


@pytest.mark.parametrize("dp", [1, 4])
def test_prefill_first_prices_a_cycle_of_prompt_and_decode_steps(dp: int) -> None:
    par = Parallel(tp=1, dp=dp)
    w = Workload(2000, 101)
    decode, t_one, t_all = _point(par, 8 * dp, 0.010), 0.050, 0.080
    c = prefill_first(decode, decode, t_one, t_all, 1024, decode.memory, w, 1.0, dp)
    n = 100  # decode steps per request
    steps, own, tokens = prompt_batches(8, n, 2000, 1024)
    assert own >= 2 and c.chunk == tokens <= 1024 and c.apart  # ~2,000 tokens a batch, 1,024 a step
    # dp x steps group prompt steps fit in distinct passes (4 x ~16 < ~16 + 100): one group each
    t_prompt = t_one if dp > 1 else t_all
    slow = (dp - 1) * steps  # this group decoding in another group's prompt pass
    cycle = (steps + slow) * t_prompt + (n - slow) * 0.010
    assert c.requests_per_s == pytest.approx(8 * dp / cycle)
    # its own batch's prompt steps are in its TTFT, not between its tokens
    assert c.tpot == pytest.approx(((steps - own + slow) * t_prompt + (n - slow) * 0.010) / n)
    assert c.ttft == pytest.approx(own * t_prompt + cycle / (steps + n) / 2)
    assert c.ttft + (w.osl - 1) * c.tpot == pytest.approx(cycle, rel=1e-2)  # a request lives one cycle
    assert c.mixed_step_time == t_prompt
    if dp > 1:  # other groups' prompts slow this group's decoding
        alone = prefill_first(
            _point(Parallel(), 8, 0.010), decode, t_one, t_all, 1024, decode.memory, w, 1.0, 1
        )
        assert c.tpot > alone.tpot


def test_a_lone_request_decodes_at_the_decode_step() -> None:
    """Its own prompt is in its TTFT and no other request's prompt interrupts it, however short."""
    for osl in (2, 3, 64):
        c = prefill_first(
            _point(Parallel(), 1, 0.010),
            None,
            0.2,
            0.2,
            8192,
            Memory(1, 1, 1, None),
            Workload(4000, osl),
            1.0,
            1,
        )
        assert c.tpot == pytest.approx(0.010) and c.ttft >= 0.2


def test_coinciding_group_prompt_steps_are_priced_toward_all_groups_prefilling() -> None:
    """8 DP groups of 64 requests and 20 decode steps each: 8 x ~64 group prompt steps cannot take
    a pass each within a group's ~84 passes, so passes carry several groups' prompt steps, each priced
    between one group prefilling and all of them."""
    par, w = Parallel(tp=1, dp=8), Workload(2000, 21)
    decode = _point(par, 8 * 64, 0.010)
    c = prefill_first(decode, decode, 0.050, 0.200, 2048, decode.memory, w, 1.0, 8)
    steps, _, _ = prompt_batches(64, 20, 2000, 2048)
    groups = 8 * steps / (steps + 20)
    assert 1 < groups < 8 and c.mixed_step_time == pytest.approx(0.050 + 0.150 * (groups - 1) / 7)
    assert c.tpot > 0.010


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


def test_the_sweep_lists_each_distinct_prompt_step_once() -> None:
    """Budgets above what a prompt batch brings give the same prompt steps: one candidate, not one per
    budget (the front had listed the same SGLang deployment four times)."""
    inputs = sweep_inputs(LLAMA, quant_modes(LLAMA, "bf16"))
    w = Workload(1024, 256)
    result = ServingSearch(LLAMA, inputs, H200, BASE, 2, w, "sglang", modes=("agg",), batches=(1, 4)).run()
    seen: dict[object, list[int]] = {}
    for c in result.candidates:
        assert c.apart
        seen.setdefault(c.decode.config, []).append(c.chunk)
    assert seen and all(len(chunks) == len(set(chunks)) for chunks in seen.values()), seen
    assert any(len(chunks) > 1 for chunks in seen.values())  # budgets below a prompt still split it
