"""gpt-oss's MXFP4 routed experts price on AIConfigurator's ``w4a16_mxfp4`` rows and Kimi-K2.5's int4
experts on its ``int4_wo`` rows, each under its own kernel key (issue 38: gpt-oss's experts had been
priced on Kimi's int4 curve, whose 38 us pipeline floor made them 1.32 ms of a B200 decode step where
AIConfigurator's step has 0.65)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.simulation.estimate import aiconfigurator
from kimi_adapter_core.backends.simulation.estimate.cost import Priced
from kimi_adapter_core.backends.simulation.estimate.measured import MeasuredPricer
from kimi_adapter_core.backends.simulation.estimate.simulator import simulate
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.tables import kernels
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.backends.simulation.tables.kernels import KERNELS_DIR, KernelTable, load_kernels
from kimi_adapter_core.spec import load_spec

needs_aic = pytest.mark.skipif(not aiconfigurator.available(), reason="aiconfigurator-core not installed")


class Case(NamedTuple):
    """A checkpoint's routed experts at a shape AIConfigurator measured, and the rows measured there."""

    spec: str
    parallel: Parallel
    batch: int  # decode tokens of the step
    device: str
    system: str
    kernel: str  # kadapt's kernel key
    moe_dtype: str  # AIConfigurator's quant mode of the rows
    shape: tuple[int, int, int, int]  # hidden, width (whole experts), experts, top-k
    ep: int


# gpt-oss-120b on 8 B200 at MoE-TP8 (the SGLang cookbook's launch), one decode token: FlashInfer's
# TensorRT-LLM MXFP4 MoE; Kimi-K2.5 on 8 H200 at EP8, 128 decode tokens: SGLang's int4 Marlin MoE
GPT_OSS = Case(
    "gpt_oss",
    Parallel(8, 1, 1, 8),
    1,
    "b200",
    "b200_sxm",
    "w4a16_mxfp4",
    "w4a16_mxfp4",
    (2880, 2880, 128, 4),
    1,
)
KIMI = Case(
    "kimi_k25", Parallel(8, 1, 8), 128, "h200", "h200_sxm", "w4a16", "int4_wo", (7168, 2048, 384, 8), 8
)


def _experts(case: Case) -> Priced:
    """The routed-expert kernel of the case's decode step (power-law routing), priced by the roofline
    with the B200 / H200 SGLang table."""
    loaded = load_spec(REPO / "specs" / f"{case.spec}.yaml")
    dep = Deployment(case.parallel, case.batch, 1, 1024, True, kv_dtype="bf16")
    sim = simulate(model_inputs(loaded, None), loaded, dep, get_device(case.device), framework="sglang")
    return next(k for k in sim.kernels if k.op.kind == "experts")


def _row(case: Case) -> float:
    """AIConfigurator's measured latency (ms) of the case's experts under power-law(1.01) routing, from
    SGLang 0.5.14's table (the version the shipped curves take)."""
    import pandas as pd

    from kimi_adapter_core.backends.simulation.tables import calibrate_rows

    rows = pd.read_parquet(calibrate_rows._tables(case.system) / "moe/sglang/0.5.14/moe_perf.parquet")
    hidden, width, experts, top_k = case.shape
    keep = (rows.moe_dtype == case.moe_dtype) & (rows.hidden_size == hidden) & (rows.inter_size == width)
    keep &= (rows.num_experts == experts) & (rows.topk == top_k) & (rows.moe_ep_size == case.ep)
    keep &= (rows.moe_tp_size == case.parallel.moe_tp) & (rows.num_tokens == case.batch)
    (latency,) = rows[keep & (rows.distribution == "power_law_1.01")].latency
    return float(latency)


@pytest.mark.parametrize("case", [GPT_OSS, KIMI], ids=["gpt-oss mxfp4", "kimi int4"])
def test_each_4_bit_checkpoint_traces_its_own_expert_kernel(case: Case) -> None:
    """The traced experts name the kernel they run, and every shipped table that prices it fits that
    kernel on rows of its own quant mode: gpt-oss's MXFP4 ``w4a16_mxfp4``, Kimi-K2.5's int4 groups
    ``w4a16`` (vLLM measured them with different kernels: the source names which)."""
    assert _experts(case).op.attrs["kernel"] == case.kernel
    sources = {
        name: kernels._read(name, KERNELS_DIR)["grouped_gemm"][case.kernel]["source"]
        for name in ("h100_sxm_vllm", "b200_sxm_vllm")
    }
    marker = "gptossmxfp4" if case.kernel == "w4a16_mxfp4" else "wna16marlin"
    assert all(marker in source for source in sources.values()), sources


@needs_aic
@pytest.mark.parametrize("case", [GPT_OSS, KIMI], ids=["gpt-oss mxfp4", "kimi int4"])
def test_4_bit_experts_reproduce_their_own_measured_rows(case: Case) -> None:
    """Both checkpoints' experts at a measured shape reproduce the row of their own quant mode, under
    the roofline (its per-shape curve) and under the measured cost model (AIConfigurator's table).
    gpt-oss's row is 0.019 ms; Kimi's int4 curve, which priced it before, has a 0.036 ms floor there."""
    experts, row = _experts(case), _row(case)
    assert experts.time * 1e3 == pytest.approx(row, rel=0.05)
    measured = MeasuredPricer(case.system, "sglang").time(experts.op, decode=True)
    assert measured is not None and measured * 1e3 == pytest.approx(row, rel=0.05)


def test_a_table_without_mxfp4_rows_prices_them_as_int4_then_bf16() -> None:
    """A kernel table that measured no MXFP4 experts (a user's, or one fitted before this key) prices
    them on the int4 weight-only curve, as before, else on bf16's."""
    table = load_kernels("b200_sxm_sglang")
    int4, bf16 = table.grouped["w4a16"], table.grouped["bf16"]
    assert KernelTable._pick({"w4a16": int4, "bf16": bf16}, "w4a16_mxfp4") is int4
    assert KernelTable._pick({"bf16": bf16}, "w4a16_mxfp4") is bf16
