"""Expert TP (``--moe-tp``): each rank holds 1/moe_tp of every local expert's intermediate width.

Whole experts (``moe_tp`` 1) keep the EP-only arithmetic exactly; expert TP narrows the grouped GEMMs
and the per-rank weights, keeps the FLOPs, and (across DP groups) gathers the tokens instead of an
all-to-all. Both cost models are checked against AIConfigurator's own estimate of the same layouts
(its ``moe_tp_size``), the bar of issue 38 item 3: within 15%.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kimi_adapter_core.backends.simulation.estimate import aiconfigurator, reference
from kimi_adapter_core.backends.simulation.estimate.planner import make_plan
from kimi_adapter_core.backends.simulation.estimate.simulator import simulate
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import ModelInputs, model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel, framework_moe_tp
from kimi_adapter_core.backends.simulation.model.quant import NATIVE
from kimi_adapter_core.backends.simulation.model.serving_kernels import RoutedExperts
from kimi_adapter_core.backends.simulation.model.tracer import Op, Recorder
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import Spec, load_spec

REPO = Path(__file__).resolve().parents[1]
SPEC_PATH = REPO / "specs" / "deepseek_v3.yaml"  # 256 experts of width 2048, top-8, hidden 7168
needs_aic = pytest.mark.skipif(not aiconfigurator.available(), reason="needs aiconfigurator-core")


@pytest.fixture(scope="module")
def spec() -> Spec:
    return load_spec(SPEC_PATH)


@pytest.fixture(scope="module")
def inputs(spec: Spec) -> ModelInputs:
    return model_inputs(spec, None)


def experts(inputs: ModelInputs, par: Parallel, tokens: int = 64, decode: bool = True) -> list[Op]:
    """The ops the routed-experts stand-in records for ``tokens`` attention-side rows on one rank."""
    s, rec = inputs.arch.structure, Recorder()
    dep = Deployment(par, par.dp, 1, 0, decode)
    RoutedExperts(s, rec, dep, NATIVE["bf16"]).forward(torch.empty(tokens, s.hidden_size, device="meta"))
    return rec.ops


def grouped(ops: list[Op]) -> Op:
    (op,) = [o for o in ops if o.kind == "experts"]
    return op


def test_whole_experts_keep_the_ep_only_arithmetic(inputs: ModelInputs) -> None:
    """moe_tp 1 is today's layout: ``tokens * top_k / tp`` pairs per rank at the full width, the
    weights of the experts hit read whole, and no key of the layout added to what the pricers read."""
    s = inputs.arch.structure
    assert s.moe is not None
    hidden, width, top_k, experts_n = s.hidden_size, s.moe.expert_intermediate_size, s.moe.top_k, 256
    for par in (Parallel(8, 1, 8), Parallel(8, 1, 1), Parallel(1, 8, 8), Parallel(2, 4, 4)):
        op = grouped(experts(inputs, par))
        pairs = 64 * top_k / par.tp
        local = experts_n // par.ep
        touched = local * (1 - (1 - 1 / local) ** pairs)
        assert op.attrs["pairs"] == pytest.approx(pairs) and op.attrs["width"] == width
        assert op.flops == pytest.approx(2 * pairs * 3 * hidden * width)
        assert op.bytes == pytest.approx(
            touched * 3 * hidden * width * 2 + pairs * (2 * hidden + 3 * width) * 2
        )
        assert "moe_tp" not in op.attrs
    assert Parallel(8, 1, 8) == Parallel(8, 1, 8, 1)


def test_expert_tp_narrows_the_gemms_and_keeps_the_flops(inputs: ModelInputs) -> None:
    """TP8 x MoE-TP8 against TP8 x EP8 on the same 8 devices: the same FLOPs per rank, 8x the pairs
    on a rank at 1/8 of the width, over all 256 experts; no all-to-all either way."""
    ep_op = grouped(experts(inputs, Parallel(8, 1, 8)))
    tp_ops = experts(inputs, Parallel(8, 1, 1, moe_tp=8))
    tp_op = grouped(tp_ops)
    assert tp_op.attrs["width"] == 2048 // 8 and tp_op.attrs["moe_tp"] == 8
    assert tp_op.attrs["pairs"] == pytest.approx(8 * ep_op.attrs["pairs"])
    assert tp_op.attrs["pairs_per_expert"] == pytest.approx(ep_op.attrs["pairs_per_expert"])
    assert tp_op.flops == pytest.approx(ep_op.flops)
    assert tp_op.attrs["tokens"] == pytest.approx(ep_op.attrs["tokens"])  # AIConfigurator's num_tokens
    assert [o.kind for o in tp_ops] == ["experts"]


def test_expert_tp_across_dp_groups_gathers_instead_of_an_all_to_all(inputs: ModelInputs) -> None:
    """DP8 attention over MoE-TP8 experts (SGLang's --enable-dp-attention without EP): every DP group's
    tokens are all-gathered to every rank and the partial outputs reduce-scattered back."""
    ops = experts(inputs, Parallel(1, 8, 1, moe_tp=8), tokens=32)
    assert [o.name for o in ops] == [
        "ep_dispatch(all_gather)",
        "grouped_gemm(routed_experts)",
        "ep_combine(reduce_scatter)",
    ]
    hidden = inputs.arch.structure.hidden_size
    for op, collective in ((ops[0], "all_gather"), (ops[2], "reduce_scatter")):
        assert op.comm is not None
        assert op.comm["collective"] == collective and op.comm["group"] == 8
        assert op.comm["bytes"] == 8 * 32 * hidden * 2 and op.comm["moe_tp"] == 8 and op.comm["ep"] == 1
    assert ops[1].attrs["all_to_all"] is False and ops[1].attrs["pairs"] == pytest.approx(8 * 32 * 8)


def test_per_rank_weights_follow_the_moe_group(inputs: ModelInputs) -> None:
    """The routed experts' weights per device: 1 / (EP x MoE-TP). TP8 with whole experts on every rank
    (EP 1) holds all of them; MoE-TP8 an eighth, as EP8 does; the rest of the model is unchanged."""

    def per_device(par: Parallel) -> dict[str, int]:
        plan = make_plan(inputs, par, batch=1, seq_len=4096)
        return {line.name: line.params_per_device for line in plan.weights}

    whole, ep8, moe_tp8 = (
        per_device(Parallel(8, 1, 1)),
        per_device(Parallel(8, 1, 8)),
        per_device(Parallel(8, 1, 1, moe_tp=8)),
    )
    routed = [name for name in whole if name.startswith("routed_experts")]
    assert routed
    for name in routed:
        assert moe_tp8[name] == ep8[name] == whole[name] // 8
    assert {k: v for k, v in moe_tp8.items() if k not in routed} == {
        k: v for k, v in whole.items() if k not in routed
    }
    mixed = per_device(Parallel(8, 1, 4, moe_tp=2))
    assert all(mixed[name] == whole[name] // 8 for name in routed)


@pytest.mark.parametrize(
    "par, message",
    [
        (Parallel(8, 1, 2, moe_tp=8), r"--moe-tp 8 x --ep 2 must equal the 8 devices \(tp 8 x dp 1\)"),
        (Parallel(8, 1, 1, moe_tp=3), r"--moe-tp 3 does not divide the expert width 2048"),
        (Parallel(1, 8, 4, moe_tp=4), r"must equal the 8 devices"),
    ],
)
def test_bad_expert_tp_is_refused_with_the_valid_layouts(
    inputs: ModelInputs, par: Parallel, message: str
) -> None:
    with pytest.raises(KadaptError, match=message) as raised:
        par.check(inputs.arch.structure)
    assert "valid at 8 devices: --moe-tp 2 --ep 4, --moe-tp 4 --ep 2, --moe-tp 8 --ep 1" in str(raised.value)


def test_expert_tp_needs_routed_experts() -> None:
    dense = load_spec(REPO / "specs" / "llama.yaml")
    with pytest.raises(KadaptError, match="--moe-tp 2 given but the model has no routed experts"):
        Parallel(2, 1, 1, moe_tp=2).check(model_inputs(dense, None).arch.structure)


def test_cli_prices_and_reports_the_expert_tp_layout() -> None:
    runner = CliRunner()
    args = ["simulate", str(SPEC_PATH), "--device", "h200", "--tp", "8", "--decode", "--batch", "8"]
    result = runner.invoke(cli, [*args, "--moe-tp", "8"])
    assert result.exit_code == 0, result.output
    assert "tp=8 dp=1 ep=1 moe_tp=8 (8 devices)" in result.output
    refused = runner.invoke(cli, [*args, "--moe-tp", "8", "--sweep"])
    assert refused.exit_code != 0 and "--sweep searches whole-expert (EP) layouts" in refused.output
    bad = runner.invoke(cli, [*args, "--moe-tp", "4"])
    assert bad.exit_code != 0 and "--moe-tp 4 x --ep 1 must equal the 8 devices" in bad.output


# AIConfigurator's estimate of the same expert-TP layouts (H200, TensorRT-LLM; SGLang for DP
# attention), DeepSeek-V3 FP8 block: (tp, dp, ep, moe_tp, framework, decode, queries per DP rank)
AIC_CASES = {
    "TP8 MoE-TP8 decode b32": (8, 1, 1, 8, "trtllm", True, 32),
    "TP8 MoE-TP8 decode b128": (8, 1, 1, 8, "trtllm", True, 128),
    "TP8 MoE-TP8 prefill 4k": (8, 1, 1, 8, "trtllm", False, 1),
    "TP8 EP4 x MoE-TP2 decode b128": (8, 1, 4, 2, "trtllm", True, 128),
    "TP8 EP4 x MoE-TP2 prefill 4k": (8, 1, 4, 2, "trtllm", False, 1),
    "SGLang DP8 MoE-TP8 decode b32": (1, 8, 1, 8, "sglang", True, 32),
}
AIC_BAR = 0.15


@needs_aic
@pytest.mark.parametrize("cost_model", ["measured", "roofline"])
@pytest.mark.parametrize("name", sorted(AIC_CASES))
def test_expert_tp_layouts_against_aiconfigurator(
    spec: Spec, inputs: ModelInputs, name: str, cost_model: str
) -> None:
    tp, dp, ep, moe_tp, framework, decode, per_rank = AIC_CASES[name]
    par = Parallel(tp, dp, ep, moe_tp)
    ref = reference.reference_step(
        "deepseek-ai/DeepSeek-V3",
        "h200_sxm",
        framework,
        tp=tp,
        ep=ep,
        dp=dp,
        moe_tp=moe_tp,
        decode=decode,
        batch=per_rank,
        seq=4096,
        fmha_quant_mode="bfloat16",
    )
    dep = Deployment(par, per_rank * dp, 1 if decode else 4096, 4096 if decode else 0, decode, kv_dtype="fp8")
    sim = simulate(inputs, spec, dep, get_device("h200"), cost_model=cost_model, framework=framework)
    ratio = sim.step_time * 1e3 / ref.total_ms
    assert abs(ratio - 1) <= AIC_BAR, (
        f"{name} {cost_model}: {ratio:.2f} of AIConfigurator's {ref.total_ms:.1f} ms"
    )


@pytest.mark.parametrize(
    ("layout", "replicated", "moe_tp"),
    [((), False, 8), (("--moe-tp", "1"), True, 1), (("--ep", "8"), False, 1), (("--ep", "4"), False, 2)],
)
def test_without_moe_tp_the_experts_are_sharded_as_every_framework_does(
    layout: tuple[str, ...], replicated: bool, moe_tp: int
) -> None:
    """``--tp 8`` alone shards each expert's width over the devices EP leaves, as vLLM's and SGLang's
    --tp and TensorRT-LLM's default moe_tp_size do; whole experts on every rank, which no serving engine
    runs, only when asked for (``--moe-tp 1``), and the report says so and how to ask for either."""
    args = ["simulate", str(SPEC_PATH), "--device", "h200", "--tp", "8", "--decode", "--batch", "8", *layout]
    result = CliRunner().invoke(cli, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["parallel"]["moe_tp"] == moe_tp, doc["parallel"]
    note = "routed experts replicated on each of the 8 devices (--ep 1 --moe-tp 1)"
    assert any(note in w for w in doc["warnings"]) is replicated, doc["warnings"]
    if replicated:
        assert any("--moe-tp 8" in w and "--ep 8" in w for w in doc["warnings"])


def test_the_default_expert_tp_follows_the_model() -> None:
    """1 for a dense model, where EP spans the devices, and where the devices EP leaves do not divide
    the expert width (DeepSeek-V3's 2,048: 3 devices); else the devices over EP."""
    dense = model_inputs(load_spec(REPO / "specs" / "llama.yaml"), None).arch.structure
    moe = model_inputs(load_spec(SPEC_PATH), None).arch.structure
    assert framework_moe_tp(dense, 8, 1) == 1
    assert [framework_moe_tp(moe, 8, ep) for ep in (1, 2, 8)] == [8, 4, 1]
    assert framework_moe_tp(moe, 3, 1) == 1 and framework_moe_tp(moe, 8, 3) == 1
