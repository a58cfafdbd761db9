"""DeepSeek-V4's FP4 routed experts (e2m1, one ue8m0 scale per 32, FP8 activations) price on
AIConfigurator's ``w4a8_mxfp4_mxfp8`` rows under their own kernel key, ``w4a8_mxfp4`` (they were the
generic ``w4a8``, priced on the FP8 curve), and Hopper, which has no such rows (no FP4 tensor cores),
prices them from the group-scaled 4-bit x bf16 curve at the bf16 peak (SGLang runs them there with a
CUTLASS mixed-input MoE). Its hash-routed layers (the first three:
``tid2eid[input_ids]`` picks the experts) are traced as such, apart from the top-k layers."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.simulation.estimate import aiconfigurator
from kimi_adapter_core.backends.simulation.estimate.cost import price
from kimi_adapter_core.backends.simulation.estimate.measured import MeasuredPricer
from kimi_adapter_core.backends.simulation.estimate.simulator import Simulation, simulate
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.model.rank_config import layer_kinds
from kimi_adapter_core.backends.simulation.tables import kernels
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.backends.simulation.tables.kernels import KERNELS_DIR, load_kernels
from kimi_adapter_core.spec import load_spec

needs_aic = pytest.mark.skipif(not aiconfigurator.available(), reason="aiconfigurator-core not installed")

SPEC = REPO / "specs" / "deepseek_v4_flash.yaml"
TOKENS = 64  # decode tokens of the step, on 8 GPUs at EP8 (a shape AIConfigurator measured)


@pytest.fixture(scope="module")
def decode() -> Simulation:
    """DeepSeek-V4-Flash's decode step on 8 B200 (TP8, EP8), roofline with the SGLang table."""
    loaded = load_spec(SPEC)
    dep = Deployment(Parallel(8, 1, 8), TOKENS, 1, 1024, True, kv_dtype="bf16")
    return simulate(model_inputs(loaded, None), loaded, dep, get_device("b200"), framework="sglang")


def _row() -> float:
    """AIConfigurator's measured latency (ms) of V4-Flash's experts at EP8, 64 tokens, power-law(1.01)
    routing: SGLang 0.5.14's FlashInfer TensorRT-LLM MXFP4 x MXFP8 kernel on B200."""
    import pandas as pd

    from kimi_adapter_core.backends.simulation.tables import calibrate_rows

    rows = pd.read_parquet(calibrate_rows._tables("b200_sxm") / "moe/sglang/0.5.14/moe_perf.parquet")
    keep = (rows.moe_dtype == "w4a8_mxfp4_mxfp8") & (rows.hidden_size == 4096) & (rows.inter_size == 2048)
    keep &= (rows.num_experts == 256) & (rows.topk == 6) & (rows.moe_ep_size == 8) & (rows.moe_tp_size == 1)
    keep &= (rows.num_tokens == TOKENS) & (rows.distribution == "power_law_1.01")
    (latency,) = rows[keep].latency
    return float(latency)


def test_fp4_experts_trace_their_own_kernel_fitted_on_its_rows(decode: Simulation) -> None:
    """The traced experts name ``w4a8_mxfp4``; every Blackwell table fits it on AIConfigurator's
    FP4 x FP8 rows (SGLang's on the kernel AIConfigurator prices V4 with), no Hopper table has it."""
    experts = [k for k in decode.kernels if k.op.kind == "experts"]
    assert {k.op.attrs["kernel"] for k in experts} == {"w4a8_mxfp4"}
    assert (
        "sglang_mxfp4_flashinfer_trtllm_moe"
        in kernels._read("b200_sxm_sglang", KERNELS_DIR)["grouped_gemm"]["w4a8_mxfp4"]["source"]
    )
    for system in ("b200_sxm", "gb200"):
        for framework in ("sglang", "trtllm", "vllm"):
            assert "w4a8_mxfp4" in load_kernels(f"{system}_{framework}").grouped
    for system in ("h100_sxm", "h200_sxm"):
        for framework in ("sglang", "trtllm", "vllm"):
            assert "w4a8_mxfp4" not in load_kernels(f"{system}_{framework}").grouped


@needs_aic
def test_fp4_experts_reproduce_the_measured_row(decode: Simulation) -> None:
    """At a measured shape the roofline (its per-shape curve) and the measured cost model (SGLang's
    own mode, ``w4a8_mxfp4_mxfp8_trtllm``) both give the row; the FP8-block curve that priced them
    before (as ``w4a8``) put them 12% above it."""
    (experts, *_) = [k for k in decode.kernels if k.op.kind == "experts"]
    row = _row()
    assert experts.time * 1e3 == pytest.approx(row, rel=0.05)
    measured = MeasuredPricer("b200_sxm", "sglang").time(experts.op, decode=True)
    assert measured is not None and measured * 1e3 == pytest.approx(row, rel=0.05)
    assert MeasuredPricer("h200_sxm", "sglang").time(experts.op, decode=True) is None  # no Hopper rows
    before = replace(experts.op, attrs={**experts.op.attrs, "kernel": "w4a8"})
    assert price(before, get_device("b200"), load_kernels("b200_sxm_sglang")).time * 1e3 > 1.1 * row


def test_hopper_prices_fp4_experts_on_the_mxfp4_curve_at_the_bf16_peak() -> None:
    """Without FP4 x FP8 rows the experts take the group-scaled 4-bit x bf16 curve (SGLang runs them
    on Hopper with a mixed-input 4-bit x bf16 MoE), whose efficiencies are against the bf16 peak; a
    table that has the rows keeps FP8's."""
    hopper, blackwell = load_kernels("h200_sxm_sglang"), load_kernels("b200_sxm_sglang")
    assert hopper._pick(hopper.grouped, "w4a8_mxfp4") is hopper.grouped["w4a16"]
    assert hopper.grouped_compute("w4a8_mxfp4", "fp8") == "bf16"
    assert blackwell.grouped_compute("w4a8_mxfp4", "fp8") == "fp8"
    assert hopper.grouped_compute("fp8_block", "fp8") == "fp8"  # other kernels keep their own unit


def test_hash_routed_layers_are_priced_as_they_run(decode: Simulation) -> None:
    """Layers 0-2 pick their experts by token id: traced as kinds of their own (layer 2 began the csa
    kind and priced all 21 csa layers as hash-routed), their router a GEMM, the scores and a lookup of
    ``tid2eid`` reading only the step's rows - no top-k; the other 40 run the top-k router."""
    loaded = load_spec(SPEC)
    kinds = layer_kinds(model_inputs(loaded, None).arch.structure)
    assert sorted(i for kind in kinds if kind.hash_routed for i in kind.layers) == [0, 1, 2]
    assert not any(kind.hash_routed and len(set(kind.layers) - {0, 1, 2}) for kind in kinds)
    routers = [k.op for k in decode.kernels if k.op.module.endswith("mlp.gate.score_fn")]
    hashed = [op for op in routers if "index" in op.name]
    assert sum(op.repeat for op in hashed) == 3
    assert all("topk" not in op.name for op in hashed)
    assert sum(op.repeat for op in routers if "topk" in op.name) == 40
    table_read = max(op.bytes for op in hashed)  # the step's rows of [vocab, top-k] int64, not the table
    assert table_read < 129280 * 6 * 8 / 8
    assert (
        sum(k.op.repeat for k in decode.kernels if k.op.module.endswith("mlp.gate") and k.op.kind == "matmul")
        == 43
    )
