"""The measured cost model in attention-DP / wide-EP layouts, and the B200 / GB200 DeepEP
low-latency profiles.

- ``--cost-model measured`` must query AIConfigurator as its own graph for the layout does: inside a
  node its fused graph (the ``Moe`` table at every attention-DP rank's tokens, ``MoeDispatch``, the
  standalone MLA tables), across nodes its large-EP graph (per-rank tokens, attention-DP size, its
  wide-EP MLA module and DeepEP expert tables). Single-node and cross-node layouts, the LMSYS-EP decode
  and prefill shapes among them, are compared with AIConfigurator's own estimate of the same layout,
  computed here.
- ``devices/b200.yaml`` / ``gb200.yaml``'s ``ep_low_latency`` sections are read back against the
  AIConfigurator SGLang DeepEP low-latency tables they were derived from."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kimi_adapter_core.backends.simulation.estimate import aiconfigurator, ep_dispatch, reference
from kimi_adapter_core.backends.simulation.estimate.cost import comm_time, table_shape
from kimi_adapter_core.backends.simulation.estimate.measured import MeasuredPricer
from kimi_adapter_core.backends.simulation.estimate.simulator import Simulation, simulate
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.model.tracer import Op
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
needs_aic = pytest.mark.skipif(not aiconfigurator.available(), reason="needs aiconfigurator-core")

# the kadapt profile, AIConfigurator's system, and what its table measured (hidden, experts, top-k)
LL_TABLES = {"b200": "b200_sxm", "gb200": "gb200"}
SHAPE = {"hidden_size": 7168, "num_experts": 256, "num_topk": 8, "node_num": 1}
LL_TOLERANCE = 0.20  # every measured point, 1-1024 tokens per rank (as for DeepEP's H800 table)


def measured_ll(system: str) -> Any:
    """AIConfigurator's SGLang DeepEP low-latency rows for ``system`` at DeepSeek-V3's shape."""
    import pandas as pd
    from aiconfigurator_core.sdk import perf_database

    root = Path(perf_database.__file__).resolve().parents[1] / "systems" / "data" / system / "comm" / "sglang"
    (table,) = sorted(root.glob("*/wideep_deepep_ll_perf.parquet"))
    rows = pd.read_parquet(table)
    for column, value in SHAPE.items():
        rows = rows[rows[column] == value]
    return rows.sort_values("num_token")


def ll_comm(phase: str, tokens: float) -> dict[str, Any]:
    """The comm description ``RoutedExperts`` records for an EP8 decode step, FP8 dispatch rows."""
    hidden = SHAPE["hidden_size"]
    return {
        "collective": "all_to_all",
        "group": 8,
        "tokens": tokens,
        "top_k": SHAPE["num_topk"],
        "hidden": hidden,
        "experts": SHAPE["num_experts"],
        "token_bytes": hidden * (1 if phase == "dispatch" else 2),
        "bytes": 0.0,
        "low_latency": True,
    }


@pytest.mark.parametrize("device_name", sorted(LL_TABLES))
def test_blackwell_profiles_have_a_low_latency_section(device_name: str) -> None:
    device = get_device(device_name)
    ll = device.ep_low_latency
    assert ll is not None, f"{device_name} decode all-to-alls would fall back to the roofline"
    assert "AIConfigurator" in ll.source and "H200" in ll.source  # says what is measured, what carried over
    for phase in ("dispatch", "combine"):
        assert set(ll.efficiency[phase]) == {link.name for link in device.links}
        assert ll.latency[phase](8) > device.links[0].latency  # the kernel's floor, not the link's
        seconds, _, measured = comm_time(device, ll_comm(phase, 1), None, phase)
        assert not measured and seconds == pytest.approx(ll.latency[phase](8), rel=0.05)


@needs_aic
@pytest.mark.parametrize("device_name", sorted(LL_TABLES))
@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_blackwell_low_latency_model_matches_aiconfigurator_table(device_name: str, phase: str) -> None:
    device = get_device(device_name)
    rows = measured_ll(LL_TABLES[device_name])
    assert len(rows) >= 8
    for tokens, latency_us in zip(rows["num_token"], rows[f"{phase}_avg_t_us"], strict=True):
        seconds, _, _ = comm_time(device, ll_comm(phase, float(tokens)), None, phase)
        assert seconds * 1e6 == pytest.approx(latency_us, rel=LL_TOLERANCE), f"{phase} at {tokens} tokens"


@needs_aic
@pytest.mark.parametrize("device_name", sorted(LL_TABLES))
def test_measured_cost_model_accepts_blackwell(device_name: str) -> None:
    system = aiconfigurator.system_for(device_name)
    assert system == LL_TABLES[device_name]
    pricer = MeasuredPricer(system, "sglang")
    assert pricer.gpus_per_node() == (4 if device_name == "gb200" else 8)  # AIConfigurator's node width


# LMSYS-EP's layouts (benchmarks/bench_simulation.py): H100, SGLang, DeepEP, FP8 block, FP8 KV
LMSYS = [
    (Deployment(Parallel(1, 64, 64), 64 * 256, 1, 2000, True, kv_dtype="fp8"), 256, 2000),
    (Deployment(Parallel(1, 32, 32), 32 * 8, 2000, 0, False, kv_dtype="fp8"), 8, 2000),
]
DEEPEP = {"context": "deepep_ht", "generation": "deepep_ll"}
# attention-DP layouts of DeepSeek-V3 on SGLang (device, deployment, queries per rank, context or prompt):
# inside one node (AIConfigurator's fused graph) and across nodes (its large-EP graph)
LAYOUTS = {
    "H200 prefill DP8 EP8": (
        "h200",
        Deployment(Parallel(1, 8, 8), 8, 4096, 0, False, kv_dtype="fp8"),
        1,
        4096,
    ),
    "H200 decode DP8 EP8 b256": (
        "h200",
        Deployment(Parallel(1, 8, 8), 256, 1, 4096, True, kv_dtype="fp8"),
        32,
        4096,
    ),
    "H100 prefill DP16 EP16": (
        "h100",
        Deployment(Parallel(1, 16, 16), 16, 4096, 0, False, kv_dtype="fp8"),
        1,
        4096,
    ),
    "H100 decode DP64 EP64 (LMSYS)": ("h100", LMSYS[0][0], 256, 2000),
    "H100 prefill DP32 EP32 (LMSYS)": ("h100", LMSYS[1][0], 8, 2000),
}


def measured_step(dep: Deployment, device: str = "h100", cost_model: str = "measured") -> Simulation:
    """DeepSeek-V3 as shipped (FP8 block) under ``--cost-model measured --framework sglang``."""
    spec = load_spec(REPO / "specs" / "deepseek_v3.yaml")
    return simulate(
        model_inputs(spec, None), spec, dep, get_device(device), cost_model=cost_model, framework="sglang"
    )


LAYOUT_TOLERANCE = 0.10
ROOFLINE_TOLERANCE = 0.15  # the roofline's bar against AIConfigurator's estimate of a layout (issue 38)


@needs_aic
def test_only_a_cross_node_ep_group_takes_the_large_ep_graph() -> None:
    """AIConfigurator's exact estimate builds its large-EP graph only for an EP group wider than a node
    (GB200: 4 GPUs), and only where tokens reach the experts by all-to-all under attention DP."""
    h200, gb200 = MeasuredPricer("h200_sxm", "sglang"), MeasuredPricer("gb200", "sglang")
    assert not h200.large_ep(8, 8, all_to_all=True)
    assert h200.large_ep(16, 16, all_to_all=True)
    assert not h200.large_ep(16, 16, all_to_all=False) and not h200.large_ep(1, 16, all_to_all=True)
    assert gb200.large_ep(8, 8, all_to_all=True)


@needs_aic
def test_both_cost_models_apply_one_wide_ep_rule_with_their_own_node_size() -> None:
    """The roofline's kernel table and the measured cost model decide "wide EP" by the same rule
    (``ep_dispatch.wide_ep``), the roofline over the device's NVLink domain, the measured one over
    AIConfigurator's system node: GB200's DP8 EP8 stays inside its 72-GPU NVLink domain for the
    roofline but spans two of AIConfigurator's 4-GPU nodes; H100 DP16 EP16 is wide for both."""
    experts = {"attention_dp": 8, "ep": 8, "all_to_all": True, "decode": False}
    gb200 = get_device("gb200")
    op = Op("experts", "mlp.experts", "moe_layer", 1, "experts", attrs=experts)
    assert "graph" not in table_shape(op, gb200)
    assert MeasuredPricer("gb200", "sglang").large_ep(8, 8, all_to_all=True)
    wide = Op(
        "experts", "mlp.experts", "moe_layer", 1, "experts", attrs=experts | {"attention_dp": 16, "ep": 16}
    )
    assert table_shape(wide, get_device("h100"))["graph"] == "wide_ep_context"
    assert MeasuredPricer("h100_sxm", "sglang").large_ep(16, 16, all_to_all=True)
    for node_size in (4, 72):
        assert ep_dispatch.wide_ep(8, 8, all_to_all=True, node_size=node_size) == (node_size < 8)
    # an attention kernel's layout: all-to-all where EP exceeds TP; off the wide-EP path, the fused
    # path's kernels are the TP path's (matched at attention DP 1)
    attention = {"kernel": "mla", "decode": True, "attention_dp": 16, "ep": 16, "tp": 1}
    mla = Op("mla_decode_attention", "self_attn", "moe_layer", 1, "attention", attrs=attention)
    assert table_shape(mla, get_device("h100"))["graph"] == "wide_ep_generation"
    assert table_shape(mla, gb200) == attention | {"attention_dp": 1}
    assert table_shape(replace(mla, attrs=attention | {"tp": 16}), get_device("h100"))["attention_dp"] == 1


@needs_aic
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_measured_attention_dp_layout_follows_aiconfigurators_own_graph(name: str) -> None:
    """Before: the LMSYS shapes at the global token count on the plain tables, 3.8x / 3.1x
    AIConfigurator's own estimate; then every attention-DP layout on the large-EP graph, 0.41x its
    estimate of a single-node DP8 EP8 prefill (its fused graph there). Per component too, so a right
    total from wrong parts fails."""
    device, dep, per_rank, seq = LAYOUTS[name]
    par = dep.parallel
    system = aiconfigurator.system_for(device)
    cross_node = par.ep > MeasuredPricer(system, "sglang").gpus_per_node()
    ref = reference.reference_step(
        "deepseek-ai/DeepSeek-V3",
        system,
        "sglang",
        tp=par.tp,
        ep=par.ep,
        dp=par.dp,
        decode=dep.decode,
        batch=per_rank,
        seq=seq,
        comm_backends=DEEPEP if cross_node else None,
        fmha_quant_mode="fp8_block" if cross_node else "bfloat16",
        kvcache_quant_mode="fp8",
    )
    sim = measured_step(dep, device)
    assert sim.step_time * 1e3 == pytest.approx(ref.total_ms, rel=LAYOUT_TOLERANCE)
    parts = dict.fromkeys(reference.COMPONENTS, 0.0)
    for k in sim.kernels:
        parts[reference.kadapt_component(k.op)] += k.total * 1e3
    for component in ("attention", "experts", "communication"):
        assert parts[component] == pytest.approx(ref.components[component], rel=LAYOUT_TOLERANCE), component
    priced = [k for k in sim.kernels if k.op.kind == "experts" or k.op.name.startswith("ep_")]
    assert len(priced) == 3 and all(k.source.startswith("aiconfigurator:") for k in priced)
    # the roofline, fitted on the same tables, within the bar: before the fused layouts priced their
    # experts off every per-shape curve (H200 DP8 EP8 prefill 0.83x) and SGLang's wide-EP MLA as its
    # standalone kernel (H100 DP16 EP16 prefill 1.17x)
    roofline = measured_step(dep, device, cost_model="roofline")
    assert roofline.step_time * 1e3 == pytest.approx(ref.total_ms, rel=ROOFLINE_TOLERANCE)


@needs_aic
@pytest.mark.parametrize("case", range(len(LMSYS)), ids=["decode DP64 EP64", "prefill DP32 EP32"])
def test_attention_dp_mla_module_sums_to_its_measured_row(case: int) -> None:
    """The MLA kernel takes the module row less the module's GEMMs, so the module costs the row."""
    sim = measured_step(LMSYS[case][0])
    attention = max((k for k in sim.kernels if k.op.kind == "attention"), key=lambda k: k.op.repeat)
    module = [
        k
        for k in sim.kernels
        if k.op.repeat == attention.op.repeat
        and k.op.kind in ("matmul", "attention")
        and k.op.module.startswith(attention.op.module)
        and "q_a_proj" not in k.op.name
    ]
    pricer = MeasuredPricer("h100_sxm", "sglang")
    row = pricer.wide_ep_module_row(attention.op.attrs)
    assert row is not None
    assert sum(k.total for k in module) / attention.op.repeat == pytest.approx(row, rel=1e-6)


@needs_aic
@pytest.mark.parametrize(
    ("name", "tolerance"),
    [
        ("H100 prefill DP16 EP16", 0.01),
        ("H100 decode DP64 EP64 (LMSYS)", 0.05),
        ("H100 prefill DP32 EP32 (LMSYS)", 0.05),
    ],
)
def test_roofline_prices_sglangs_wide_ep_mla_as_its_measured_module(name: str, tolerance: float) -> None:
    """On SGLang's wide-EP path the roofline prices MLA as the module its table measured whole (q_b,
    kv_b / the absorbed bmms, the attention, o_proj), folded like vLLM's: the module's kernels sum to
    the measured row (exactly at a measured shape: one 4,096-token sequence, 128 heads; the others
    interpolate between rows), while the q_a + kv_a downscale the module runs without keeps its own
    price. Before, 2.1x the row at the DP16 prefill (its standalone bf16 kernel and projections)."""
    device, dep, _, _ = LAYOUTS[name]
    sim = measured_step(dep, device, cost_model="roofline")
    core = max((k for k in sim.kernels if k.op.kind == "attention"), key=lambda k: k.op.repeat)
    assert core.bound == "module" and core.source.endswith("(module)")
    inside = [
        k
        for k in sim.kernels
        if k.op.scope == core.op.scope and k.op.module.startswith(core.op.module) and k is not core
    ]
    downscale = [k for k in inside if "q_a_proj" in k.op.name]
    assert len(downscale) == 1 and downscale[0].time > 0 and downscale[0].bound != "in_module"
    assert {k.bound for k in inside if k not in downscale} == {"in_module"}
    row = MeasuredPricer(aiconfigurator.system_for(device), "sglang").wide_ep_module_row(core.op.attrs)
    assert row is not None
    assert core.time == pytest.approx(row, rel=tolerance)


def test_a_fused_attention_dp_layout_prices_its_experts_as_the_tp_layout() -> None:
    """Inside the NVLink domain an attention-DP layout runs the TP path's routed-expert kernels at its
    DP groups' tokens (AIConfigurator's fused graph: its ``Moe`` row at attention-DP size 8 and s
    tokens is its row at 8 x s), so H200 DP8 EP8 prices each MoE layer's experts as TP8 EP8 does at the
    same token-expert pairs. They used to miss every per-shape curve (measured at attention DP 1) and
    price at the median over all shapes: 579 ms of experts against AIConfigurator's 762 (0.76x)."""
    spec = load_spec(REPO / "specs" / "deepseek_v3.yaml")
    inputs, h200 = model_inputs(spec, None), get_device("h200")

    def experts(par: Parallel) -> Any:
        dep = Deployment(par, 8, 4096, 0, False, kv_dtype="fp8")
        sim = simulate(inputs, spec, dep, h200, framework="sglang")
        return next(k for k in sim.kernels if k.op.kind == "experts")

    fused, tp = experts(Parallel(1, 8, 8)), experts(Parallel(8, 1, 8))
    assert fused.op.attrs["attention_dp"] == 8 and fused.op.attrs["all_to_all"]
    assert fused.op.flops == tp.op.flops and fused.time == pytest.approx(tp.time, rel=1e-9)
