"""The small kernels a serving engine launches around the traced ones (``estimate/engine_kernels.py``,
issue 38 item 3). Each is created by a feature of the model and the framework's source, never by a
fit: an FP8-block GEMM's input gets a quantization kernel and a bf16 one does not; MLA gets its rope,
cache write and query concatenation; per-head q/k norms get a rope kernel apart from them (SGLang); a
GQA cache write rides on SGLang's rope kernel with a bf16 cache and is vLLM's own kernel with any;
vLLM's MXFP4 experts on a device without FP8 tensor cores (Marlin) get their routing, alignment,
activation and sum kernels. Each is priced as its memory roofline plus the device's floor, the one
free parameter (chosen on the development source of ``benchmarks/serving_gap.py``)."""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.simulation.estimate import engine_kernels
from kimi_adapter_core.backends.simulation.estimate.simulator import (
    Simulation,
    inside_whole_modules,
    simulate,
)
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.spec import load_spec

B200 = get_device("b200")


def step(
    name: str,
    quant: str | None = None,
    *,
    framework: str = "sglang",
    decode: bool = True,
    kv_dtype: str = "bf16",
    device: str = "b200",
) -> Simulation:
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    dep = Deployment(Parallel(8, 1, 1), 1, 1 if decode else 256, 1024, decode, kv_dtype=kv_dtype)
    return simulate(model_inputs(spec, quant), spec, dep, get_device(device), framework=framework)


def engine(sim: Simulation) -> Counter[str]:
    """Engine kernels of the step by rule, counted over the layers each traced layer stands for."""
    out: Counter[str] = Counter()
    for k in sim.kernels:
        if "engine_kernel" in k.op.attrs:
            out[k.op.attrs["engine_kernel"]] += k.op.repeat
    return out


@pytest.fixture(scope="module")
def deepseek() -> Simulation:
    return step("deepseek_v3")  # the FP8 block-scaled checkpoint as shipped


def test_an_fp8_block_gemm_input_is_quantized_once(deepseek: Simulation) -> None:
    gemms = [
        k.op for k in deepseek.kernels if k.op.kind == "matmul" and k.op.attrs.get("kernel") == "fp8_block"
    ]
    inputs = {(op.scope, op.attrs["activation"]): op.repeat for op in gemms}
    assert len(inputs) == len(gemms)  # DeepSeek-V3: every FP8 GEMM reads its own activation
    assert engine(deepseek)["act_quant"] == sum(inputs.values())
    for i, k in enumerate(deepseek.kernels):  # each right before the GEMM it feeds, in its module
        if k.op.attrs.get("engine_kernel") == "act_quant":
            gemm = deepseek.kernels[i + 1].op
            assert gemm.attrs["kernel"] == "fp8_block" and gemm.module == k.op.module


def test_a_bf16_model_gets_no_quantization() -> None:
    bf16 = engine(step("deepseek_v3", "BF16"))
    assert "act_quant" not in bf16
    layers = sum(k.op.repeat for k in step("deepseek_v3", "BF16").kernels if k.op.kind == "attention")
    assert bf16 == {"mla_rope": layers, "kv_write": layers, "mla_q_concat": layers}  # MLA's, still there


def test_mla_kernels_follow_the_cache_dtype(deepseek: Simulation) -> None:
    layers = sum(k.op.repeat for k in deepseek.kernels if k.op.kind == "attention")
    assert engine(deepseek)["mla_rope"] == engine(deepseek)["kv_write"] == layers == 61
    assert engine(deepseek)["mla_q_concat"] == layers  # bf16 cache: the query is concatenated
    fp8 = engine(step("deepseek_v3", kv_dtype="fp8"))  # rope, quantization and layout in one kernel
    assert fp8["mla_rope"] == fp8["kv_write"] == layers and "mla_q_concat" not in fp8


def test_gqa_kernels_follow_qk_norms_and_the_cache_dtype() -> None:
    qwen3 = step("qwen3_moe")  # per-head q/k norms, bf16 cache: the rope (with the cache write) apart
    assert engine(qwen3) == {"rope": 94}
    assert engine(step("llama")) == {}  # no q/k norms, bf16 cache written by the rope kernel
    fp8 = step("llama", kv_dtype="fp8")
    layers = sum(k.op.repeat for k in fp8.kernels if k.op.kind == "attention")
    assert engine(fp8) == {"kv_write": layers}


def test_trtllm_and_prefill_steps_get_none() -> None:
    assert engine(step("deepseek_v3", framework="trtllm")) == {}  # no rules read for it
    assert engine(step("deepseek_v3", decode=False)) == {}  # a prefill's kernels are not at floors
    assert engine(step("deepseek_v3", framework="vllm", decode=False)) == {}


def test_vllm_quantizes_fp8_linears_but_not_mla_bmms(deepseek: Simulation) -> None:
    """vLLM dequantizes W_UK / W_UV to bf16 at load: its bmms read no quantized input, so it runs
    SGLang's quantizations less the two before the absorbed bmms, a bf16 checkpoint none, and a
    device without FP8 tensor cores none."""
    vllm = step("deepseek_v3", framework="vllm")
    bmms = sum(
        k.op.repeat
        for k in deepseek.kernels
        if k.op.kind == "matmul" and k.op.attrs.get("kernel") == "fp8_block" and "tag" in k.op.attrs
    )
    assert bmms == 2 * 61
    assert engine(vllm)["act_quant"] == engine(deepseek)["act_quant"] - bmms
    assert "act_quant" not in engine(step("deepseek_v3", "BF16", framework="vllm"))
    # without FP8 tensor cores (A100) vLLM runs FP8 linears as weight-only Marlin GEMMs
    assert "act_quant" not in engine(step("deepseek_v3", framework="vllm", device="a100"))


def test_vllm_mla_concatenates_the_query_with_any_cache_dtype() -> None:
    """FlashMLA's decode concatenates q_nope and q_pe whatever the cache holds; SGLang's TRT-LLM MLA
    backend folds it into its FP8 rope kernel."""
    fp8 = engine(step("deepseek_v3", framework="vllm", kv_dtype="fp8"))
    assert fp8["mla_rope"] == fp8["kv_write"] == fp8["mla_q_concat"] == 61


def test_vllm_writes_a_gqa_cache_in_a_kernel_of_its_own() -> None:
    """reshape_and_cache_flash runs whatever the cache dtype; no rope apart from q/k norms (Inductor
    decides that fusion in vLLM, so no rule)."""
    llama = step("llama", framework="vllm")
    layers = sum(k.op.repeat for k in llama.kernels if k.op.kind == "attention")
    assert engine(llama) == {"kv_write": layers}
    assert engine(step("qwen3_moe", framework="vllm")) == {"kv_write": 94}


def test_vllm_marlin_moe_kernels_follow_the_device() -> None:
    """gpt-oss's MXFP4 experts run on Marlin below compute capability 9 (A100: no FP8 tensor cores),
    with its routing, alignment, workspace, activation and sum kernels around the experts op; on
    Hopper its Triton kernels, whose routing the measured MXFP4 rows hold, get none; SGLang none."""
    marlin = ("moe_logits_fp32", "moe_renorm_sum", "moe_renorm_div", "moe_align", "moe_workspace")
    marlin += ("moe_act", "moe_sum")
    a100 = step("gpt_oss", framework="vllm", device="a100")
    assert engine(a100) == {"kv_write": 36, **dict.fromkeys(marlin, 36)}
    for i, k in enumerate(a100.kernels):  # in the experts' module, right before them
        if k.op.attrs.get("engine_kernel") == "moe_sum":
            assert a100.kernels[i + 1].op.kind == "experts" and a100.kernels[i + 1].op.module == k.op.module
    assert engine(step("gpt_oss", framework="vllm", device="h100")) == {"kv_write": 36}
    assert engine(step("gpt_oss", device="a100")) == {}  # SGLang: a bf16 cache written by the rope


def test_each_is_its_roofline_plus_the_device_floor(deepseek: Simulation) -> None:
    priced = [k for k in deepseek.kernels if "engine_kernel" in k.op.attrs and k.bound != "overlapped"]
    assert priced
    for k in priced:
        body = k.op.bytes / (B200.hbm_bandwidth * B200.memory_efficiency)
        assert k.time == pytest.approx(body + engine_kernels.FLOOR_US["b200"] * 1e-6)
        assert k.source == "engine: roofline + floor"
    h200 = step("deepseek_v3", device="h200")  # no floor chosen there: the profile's op overhead
    for k in h200.kernels:
        if "engine_kernel" in k.op.attrs and k.bound != "overlapped":
            assert k.time == pytest.approx(
                k.op.bytes / (h200.device.hbm_bandwidth * h200.device.memory_efficiency)
                + h200.device.op_overhead
            )


def test_the_floor_moves_the_step_by_one_floor_per_kernel_on_the_critical_path(deepseek: Simulation) -> None:
    on_path = sum(k.op.repeat for k in deepseek.kernels if "engine_kernel" in k.op.attrs and k.time > 0)
    with mock.patch.dict(engine_kernels.FLOOR_US, {"b200": engine_kernels.FLOOR_US["b200"] + 1.0}):
        higher = step("deepseek_v3")
    assert higher.step_time - deepseek.step_time == pytest.approx(on_path * 1e-6, rel=1e-6)
    shared = [
        k for k in deepseek.kernels if "engine_kernel" in k.op.attrs and ".shared_expert" in k.op.module
    ]
    assert shared and all(k.time == 0 for k in shared)  # on the shared experts' stream, hidden


def test_a_module_measured_whole_holds_its_engine_kernels(deepseek: Simulation) -> None:
    """The measured cost model's SGLang wide-EP MLA row holds the module's quantizations, rope and
    cache write: inside such a module they cost nothing more, outside it they keep their price."""
    kernels = list(deepseek.kernels)
    folded = inside_whole_modules(kernels, lambda op: op.kind == "attention" and op.scope == "moe")
    for before, after in zip(kernels, folded, strict=True):
        inside = before.op.scope == "moe" and before.op.module.startswith("moe_layer.self_attn")
        if "engine_kernel" in before.op.attrs and inside:
            assert (after.time, after.bound) == (0.0, "in_module")
        else:
            assert after == before
    assert any("engine_kernel" in k.op.attrs and k.op.scope == "dense" and k.time > 0 for k in folded)
