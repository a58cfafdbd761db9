"""Prompt steps apart from decoding: SGLang's default scheduling, priced by ``kadapt simulate --concurrency``
and the request sweep (``request_pricing.prefill_first``, ``serving.ServingSearch``).

What must hold: each framework states how it runs prompt tokens (mixed with the decode rows or in steps
of their own; replayed as a CUDA graph or launched eagerly) with a source; SGLang's step budget follows
the device's memory and is shared by the attention-DP groups, as its server arguments set it; prompts
arriving at the same decode step are prefilled together, in steps of at most the budget; a request's
TPOT holds the other requests' prompt steps but not its own batch's, which are in its TTFT; other DP
groups' prompt steps slow this group's decode steps (lockstep); an eager prompt step takes at least the
host's time per launched kernel. A release's facts are the ones its source sets (``--framework-version``):
SGLang 0.4.3 halves the budget under DP attention, vLLM before 0.8 ran V0 (chunked prefill at 2048 tokens,
a step carrying a prompt chunk launched eagerly); a release no entry covers is priced as the newest read,
saying so.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.simulation.estimate.eager import HOST_US, launches
from kimi_adapter_core.backends.simulation.estimate.planner import Memory
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.search.concurrency import price_concurrency
from kimi_adapter_core.backends.simulation.search.grid import Config, Point, quant_modes, sweep_inputs
from kimi_adapter_core.backends.simulation.search.launch_rules import framework, frameworks
from kimi_adapter_core.backends.simulation.search.request_pricing import (
    EAGER,
    GRAPHED,
    Workload,
    follows_requests,
    prefill_first,
    prompt_batches,
)
from kimi_adapter_core.backends.simulation.search.serving import ServingSearch
from kimi_adapter_core.backends.simulation.search.serving_points import serving_points
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError, UsageError
from kimi_adapter_core.spec import load_spec

H200, B200 = get_device("h200"), get_device("b200")
LLAMA = load_spec(REPO / "specs" / "llama.yaml")
BASE = Deployment(Parallel(), 1, 1, 0, True)


def test_sglang_budget_follows_device_memory_and_is_shared_by_dp_groups() -> None:
    step = framework("sglang").step_tokens
    assert step.default(B200.memory_bytes, 1) == 16384  # 0.5.23: above 160 GiB
    assert step.default(H200.memory_bytes, 1) == 8192  # below 160 GiB
    assert step.default(40 * 2**30, 1) == 4096  # below 60 GiB
    assert step.default(30 * 2**30, 1) == 4096  # 0.5.23 only: 2048 below 20 GiB (0.5.6: below 35)
    assert framework("sglang", "0.5.6").step_tokens.default(30 * 2**30, 1) == 2048
    assert step.default(H200.memory_bytes, 8) == 1024  # --enable-dp-attention divides it by the DP size
    assert step.budgets(H200.memory_bytes, 2) == (256, 512, 1024, 2048, 4096)  # the sweep's, shared
    trtllm = framework("trtllm").step_tokens
    assert trtllm.default(H200.memory_bytes, 8) == 8192  # every attention-DP rank its own budget


def test_every_framework_states_how_it_runs_prompt_steps() -> None:
    for name in frameworks():
        assert framework(name).prompt_steps.source
    sglang = framework("sglang").prompt_steps
    assert (sglang.mixed, sglang.cuda_graphs) == (False, True)  # 0.5.23: breakable prefill graphs
    old = framework("sglang", "0.5.6").prompt_steps
    assert (old.mixed, old.cuda_graphs) == (False, False)
    for version in ("0.4.3.post2", "0.4.6", "0.4.7", "0.5.1"):  # every older entry: eager too
        assert not framework("sglang", version).prompt_steps.cuda_graphs
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
    """Llama-3.1-8B on 2 H200 (TP2), 16 requests of 1024 + 64 tokens, under SGLang 0.5.6 (eager prompt
    steps), SGLang 0.5.23 (replayed) and TensorRT-LLM."""
    inputs = sweep_inputs(LLAMA, quant_modes(LLAMA, "bf16"))
    base = Deployment(Parallel(tp=2), 1, 1, 0, True)
    w = Workload(1024, 64)
    found = {fw: price_concurrency(LLAMA, inputs, H200, base, w, fw, 16) for fw in ("sglang", "trtllm")}
    found["sglang 0.5.6"] = price_concurrency(
        LLAMA, inputs, H200, base, w, "sglang", 16, framework_version="0.5.6"
    )
    return found


def test_sglang_runs_prompt_steps_apart_and_eagerly(priced: dict[str, object]) -> None:
    c = priced["sglang 0.5.6"]
    assert c.prompt_launch == EAGER
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


def test_sglang_0_5_23_replays_its_prompt_steps(priced: dict[str, object]) -> None:
    """The same requests on 0.5.23: the prompt step replayed as a graph is faster than 0.5.6's eager one,
    and so are TTFT and TPOT (other requests' prompt steps stall less); decoding is the same."""
    new, old = priced["sglang"], priced["sglang 0.5.6"]
    assert new.apart and new.prompt_launch == GRAPHED
    assert new.decode.step_time == old.decode.step_time
    assert new.mixed_step_time < old.mixed_step_time and new.ttft < old.ttft and new.tpot < old.tpot


def test_which_prompt_steps_sglang_0_5_23_replays() -> None:
    """Up to the step budget per DP group, at most 8192 tokens for MLA, under attention DP only in a pass
    every group prefills in, and never for the models it turns the prefill graph off for."""
    steps = framework("sglang").prompt_steps
    dense = {"mla": False, "every_group": True, "architectures": ("LlamaForCausalLM",), "device": "h200"}
    assert steps.replayed(8192, 8192, **dense) and not steps.replayed(8193, 8192, **dense)
    mla = {**dense, "mla": True, "architectures": ("DeepseekV3ForCausalLM",)}
    assert steps.replayed(8192, 16384, **mla) and not steps.replayed(8193, 16384, **mla)
    assert not steps.replayed(1024, 1024, **{**dense, "every_group": False})
    assert not steps.replayed(1024, 16384, **{**mla, "device": "b200"})  # trtllm_mla on SM100
    assert "trtllm_mla" in steps.eager_reason(("DeepseekV3ForCausalLM",), "gb200")
    assert steps.eager_reason(("DeepseekV3ForCausalLM",), "h200") is None
    for arch in ("KimiLinearForCausalLM", "DeepseekV4ForCausalLM", "Qwen3VLMoeForConditionalGeneration"):
        assert not steps.replayed(1024, 8192, **{**dense, "architectures": (arch,)}), arch
    for arch in ("KimiK25ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):  # allowlisted
        assert steps.replayed(1024, 8192, **{**dense, "architectures": (arch,)}), arch
    assert not framework("sglang", "0.5.6").prompt_steps.replayed(16, 8192, **dense)


@pytest.mark.parametrize(
    ("version", "case", "replayed"),
    [
        ("0.5.9", "dense", False),  # piecewise prefill graph still opt-in
        ("0.5.12", "dense", True),  # piecewise by default from 0.5.10
        ("0.5.12", "dense dp2", False),  # off under attention DP until 0.5.16
        ("0.5.12", "dense disaggregated", False),  # off in PD disaggregation until 0.5.14
        ("0.5.12", "mla 2048", True),
        ("0.5.12", "mla 2049", False),  # MLA captured up to 2048 tokens until 0.5.22
        ("0.5.12", "DeepseekV32ForCausalLM", False),  # on the disabled-arch list until 0.5.12
        ("0.5.13", "DeepseekV32ForCausalLM", True),
        ("0.5.13", "Qwen3NextForCausalLM", False),
        ("0.5.14", "Qwen3_5MoeForConditionalGeneration", False),  # every multimodal model until 0.5.15
        ("0.5.16", "Qwen3_5MoeForConditionalGeneration", True),  # allowlisted from 0.5.16
        ("0.5.16", "dense dp2", False),
        ("0.5.17", "dense dp2", True),  # every DP group prefilling, from 0.5.17
        ("0.5.17", "mla 1024", False),  # no MLA model until 0.5.18
        ("0.5.17", "KimiK25ForConditionalGeneration", False),  # off the allowlist until 0.5.18
        ("0.5.18", "KimiK25ForConditionalGeneration", True),
        ("0.5.18", "mla 2048", True),
        ("0.5.19", "KimiLinearForCausalLM", True),  # KDA turned off from 0.5.20
        ("0.5.20", "KimiLinearForCausalLM", False),
        ("0.5.22", "mla 4096", False),
        ("0.5.23", "mla 4096", True),  # 8192 for MLA in 0.5.23
    ],
)
def test_which_prompt_steps_each_sglang_release_replays(version: str, case: str, replayed: bool) -> None:
    """SGLang 0.5.7 to 0.5.22, each read in its wheel: the prefill graph's default, cap and exclusions."""
    fw = framework("sglang", version)
    assert "was not read" not in fw.note
    args = {"mla": False, "every_group": True, "architectures": ("LlamaForCausalLM",), "device": "h200"}
    tokens = 1024
    if case.startswith("mla"):
        args |= {"mla": True, "architectures": ("DeepseekV3ForCausalLM",)}
        tokens = int(case.split()[1])
    elif case == "dense dp2":
        args["dp"] = 2
    elif case == "dense disaggregated":
        args["disaggregated"] = True
    elif case != "dense":
        args["architectures"] = (case,)
        args["mla"] = case in ("DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration")
    assert fw.prompt_steps.replayed(tokens, 8192, **args) is replayed


def test_sglang_releases_budget_tiers_and_their_notes() -> None:
    """0.5.20 raised the 20-35 GiB tier to 4096 tokens; an entry whose facts kadapt cannot all state says
    which with every price, and the reasons a release never replays a model's prompt steps are reported."""
    gib24 = 24 * 2**30
    assert framework("sglang", "0.5.19").step_tokens.default(gib24, 1) == 2048
    assert framework("sglang", "0.5.20").step_tokens.default(gib24, 1) == 4096
    assert "DeepSeek sparse attention" in framework("sglang", "0.5.17").note
    steps = framework("sglang", "0.5.16").prompt_steps
    assert "latent-attention (MLA)" in steps.eager_reason(("DeepseekV3ForCausalLM",), "h200", mla=True)
    assert "under attention DP" in steps.eager_reason(("LlamaForCausalLM",), "h200", dp=8)
    assert steps.eager_reason(("LlamaForCausalLM",), "h200") is None


def test_the_report_says_a_release_never_replays_an_mla_models_prompt_steps() -> None:
    args = ["simulate", "deepseek_v3", "--framework", "sglang", "--isl", "1024", "--osl", "64", "--tp", "8"]
    args += ["--device", "h200", "--concurrency", "8"]
    old = CliRunner().invoke(cli, [*args, "--framework-version", "0.5.16", "--format", "json"])
    doc = json.loads(old.output)
    assert doc["framework"]["prompt_cuda_graphs"] is False
    assert "latent-attention (MLA)" in doc["framework"]["prompt_eager_why"]
    new = json.loads(
        CliRunner().invoke(cli, [*args, "--framework-version", "0.5.18", "--format", "json"]).output
    )
    assert new["framework"]["prompt_cuda_graphs"] is True and "prompt_eager_why" not in new["framework"]


def test_the_report_says_why_a_models_prompt_steps_run_eagerly() -> None:
    args = ["simulate", "deepseek_v3", "--framework", "sglang", "--isl", "1024", "--osl", "64", "--tp", "8"]
    runner = CliRunner()
    b200 = json.loads(
        runner.invoke(cli, [*args, "--device", "b200", "--concurrency", "8", "--format", "json"]).output
    )
    assert (
        b200["framework"]["prompt_cuda_graphs"] is False
        and "trtllm_mla" in b200["framework"]["prompt_eager_why"]
    )
    h200 = runner.invoke(cli, [*args, "--device", "h200", "--concurrency", "8"])
    assert h200.exit_code == 0 and "(launched eagerly)" not in h200.output and "NOTE:" not in h200.output


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


# --- the release a point ran (``frameworks.yaml`` ``releases``, ``--framework-version``) ---------------
A100, H100 = get_device("a100"), get_device("h100")


def _budgets(name: str, version: str | None) -> list[int]:
    """The default budget per DP group on H200 (DP 1 and 8), B200, A100 and H100 at one DP group."""
    step = framework(name, version).step_tokens
    return [
        step.default(H200.memory_bytes, 1, "h200"),
        step.default(H200.memory_bytes, 8, "h200"),
        step.default(B200.memory_bytes, 1, "b200"),
        step.default(A100.memory_bytes, 1, "a100"),
        step.default(H100.memory_bytes, 1, "h100"),
    ]


@pytest.mark.parametrize(
    ("name", "version", "budgets"),
    [
        ("sglang", None, [8192, 1024, 16384, 8192, 8192]),  # 0.5.23: divided by the DP size
        ("sglang", "0.5.6.post1", [8192, 1024, 16384, 8192, 8192]),
        ("sglang", "0.5.1", [8192, 1024, 16384, 8192, 8192]),
        ("sglang", "0.4.6", [8192, 1024, 8192, 8192, 8192]),  # no 16384 tier yet
        ("sglang", "0.4.3.post2", [8192, 4096, 8192, 8192, 8192]),  # halved under DP attention
        ("vllm", None, [8192, 8192, 16384, 2048, 8192]),  # 0.33: 16384 above 160 GiB, A100 2048
        ("vllm", "0.28.0", [8192, 8192, 16384, 2048, 8192]),  # 0.28 added the 160 GiB tier
        ("vllm", "0.27.1", [8192, 8192, 8192, 2048, 8192]),
        ("vllm", "0.10.2", [8192, 8192, 8192, 2048, 8192]),
        ("vllm", "0.8.5.post1", [8192, 8192, 8192, 8192, 8192]),  # from 70 GiB, the A100 80GB too
        ("vllm", "0.8.4", [8192, 8192, 2048, 2048, 8192]),  # by device name: H100 and H200 only
        ("vllm", "0.8.0", [8192, 8192, 2048, 2048, 8192]),
        ("vllm", "0.7.4.dev181+gf35f8e22", [2048, 2048, 2048, 2048, 2048]),  # V0 chunked prefill
    ],
)
def test_a_releases_step_budget_is_the_one_its_source_sets(
    name: str, version: str | None, budgets: list[int]
) -> None:
    assert _budgets(name, version) == budgets
    fw = framework(name, version)
    assert fw.read and "was not read" not in fw.note  # every one of these was read
    assert bool(fw.note) == (version is not None and version.startswith("0.7"))  # V0's chunked-prefill caveat


def test_v0_launches_a_step_carrying_prompt_tokens_eagerly() -> None:
    v0, v1 = framework("vllm", "0.7.3"), framework("vllm", "0.8.0")
    assert (v0.prompt_steps.mixed, v0.prompt_steps.cuda_graphs) == (True, False)
    assert (v1.prompt_steps.mixed, v1.prompt_steps.cuda_graphs) == (True, True)
    assert "_use_captured_graph" in v0.prompt_steps.source


def test_a_release_no_entry_covers_is_priced_as_the_newest_read_and_says_so() -> None:
    newest = framework("sglang")
    unread = framework("sglang", "0.5.24")
    assert unread.step_tokens == newest.step_tokens and unread.prompt_steps == newest.prompt_steps
    assert unread.note == f"SGLang 0.5.24 was not read: priced with the facts read in {newest.read}"
    with pytest.raises(UsageError, match="'0.5.x' is not a release version"):
        framework("sglang", "0.5.x")


def test_the_published_points_are_priced_at_their_releases_defaults() -> None:
    """dstack's SGLang 0.4.3.post2 DP8 points ran 4096 tokens per DP group (8192 halved), its vLLM
    0.7.4 nightly V0 with chunked prefill at 2048, eager when a step carries a prompt chunk."""
    points = serving_points()
    sglang = [p for p in points if p.framework == "sglang" and p.version == "0.4.3.post2"]
    vllm = [p for p in points if p.framework == "vllm" and p.version.startswith("0.7.4")]
    assert len(sglang) == 9 and len(vllm) == 9
    for p in sglang:
        assert p.step_tokens is None  # not stated at launch: the release's default
        device = get_device(p.device)
        assert framework("sglang", p.release).step_tokens.default(device.memory_bytes, p.parallel.dp) == 4096
    for p in vllm:
        fw = framework("vllm", p.release)
        assert (
            fw.step_tokens.default(H200.memory_bytes, 1, "h200") == 2048 and not fw.prompt_steps.cuda_graphs
        )
        assert "--enable-chunked-prefill" in p.layout_stated


def test_framework_version_in_the_reports_and_its_usage_errors() -> None:
    args = ["simulate", "llama", "--device", "h100", "--framework", "vllm", "--isl", "512", "--osl", "64"]
    runner = CliRunner()
    old = runner.invoke(cli, [*args, "--concurrency", "8", "--framework-version", "0.7.3"])
    assert old.exit_code == 0, old.output
    assert "vLLM step budget and prompt steps as read in 0.7.3" in old.output
    assert "step budget 2048 tokens" in old.output and "(launched eagerly)" in old.output
    assert "NOTE: vLLM V0 is priced with chunked prefill" in old.output
    doc = json.loads(
        runner.invoke(
            cli, [*args, "--concurrency", "8", "--framework-version", "0.34.0", "--format", "json"]
        ).output
    )
    assert doc["framework"]["release_note"].startswith("vLLM 0.34.0 was not read")
    sweep = runner.invoke(cli, [*args, "--sweep", "--devices", "1", "--framework-version", "0.7.3"])
    assert sweep.exit_code == 0 and "as read in 0.7.3" in sweep.output, sweep.output
    step = runner.invoke(cli, ["simulate", "llama", "--device", "h100", "--framework-version", "0.7.3"])
    assert step.exit_code == 2 and "--framework-version prices requests" in step.output
    bad = runner.invoke(cli, [*args, "--concurrency", "2", "--framework-version", "x.y"])
    assert (
        bad.exit_code != 0
        and "'x.y' is not a release version" in bad.output
        and "Traceback" not in bad.output
    )


def test_a_bad_release_entry_is_refused_naming_it() -> None:
    from kimi_adapter_core.backends.simulation.search import launch_rules

    with pytest.raises(KadaptError, match=r"vllm.releases\[0\].versions: '>>0.8' is not a version specifier"):
        steps = {"mixed": True, "cuda_graphs": False, "source": "s"}
        launch_rules._release({"versions": ">>0.8", "read": "x", "prompt_steps": steps}, "vllm.releases[0]")
    with pytest.raises(KadaptError, match="needs versions, read and step_tokens or prompt_steps"):
        launch_rules._release({"versions": "<1", "read": "x"}, "vllm.releases[0]")


def test_a_device_no_profile_has_is_refused_naming_where(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device name in frameworks.yaml is matched against the profile's name: a typo would never match,
    and the rule it belongs to would silently never apply."""
    from dataclasses import replace

    from kimi_adapter_core.backends.simulation.search import launch_rules

    table = dict(launch_rules._load())
    launch_rules._check_device_names(table)  # the shipped facts name shipped profiles only
    sglang = table["sglang"]
    limits = sglang.prompt_steps.limits
    typo = replace(limits.eager_for[0], devices=frozenset({"b200", "gb-200"}))
    steps = replace(sglang.prompt_steps, limits=replace(limits, eager_for=(typo, *limits.eager_for[1:])))
    table["sglang"] = replace(sglang, prompt_steps=steps)
    with pytest.raises(
        KadaptError,
        match=r"sglang.prompt_steps.limits.eager_for\[0\].devices: no device profile is named 'gb-200' "
        r"\(shipped: a100, ",
    ):
        launch_rules._check_device_names(table)
    vllm = table["vllm"]
    tokens = replace(vllm.releases[2].step_tokens, by_device=(("h100", 8192), ("H200", 8192)))
    releases = (*vllm.releases[:2], replace(vllm.releases[2], step_tokens=tokens), *vllm.releases[3:])
    table = {"vllm": replace(vllm, releases=releases)}
    with pytest.raises(
        KadaptError, match=r"vllm.releases\[2\].step_tokens.by_device: no device profile is named 'H200'"
    ):
        launch_rules._check_device_names(table)
