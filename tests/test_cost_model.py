"""The cost model: measured kernel-efficiency tables, routing imbalance, layouts, DeepEP all-to-all,
and the optional measured cost model checked against NVIDIA AIConfigurator itself (when installed)."""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.simulation.estimate import aiconfigurator, reference
from kimi_adapter_core.backends.simulation.estimate.cost import _all_to_all, comm_time, kernel_table, price
from kimi_adapter_core.backends.simulation.estimate.measured import MeasuredPricer
from kimi_adapter_core.backends.simulation.estimate.simulator import Simulation, simulate
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import ModelInputs, model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.model.tracer import Op, fuse, merge_projections
from kimi_adapter_core.backends.simulation.tables.curves import Curve
from kimi_adapter_core.backends.simulation.tables.device import Device, get_device
from kimi_adapter_core.backends.simulation.tables.kernels import KERNELS_DIR, load_kernels, parse_kernels
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import Spec, load_spec

DEEPSEEK = REPO / "specs" / "deepseek_v3.yaml"
needs_aic = pytest.mark.skipif(not aiconfigurator.available(), reason="aiconfigurator-core not installed")


@functools.cache
def spec_and_inputs(spec_path: Path) -> tuple[Spec, ModelInputs]:
    """A shipped spec and its inputs, built once: a fresh build re-checks the storage of every expert
    of every routed-experts tensor (its policy's memo is per build)."""
    spec = load_spec(spec_path)
    return spec, model_inputs(spec, None)


def run(
    spec_path: Path, *, tp: int = 8, dp: int = 1, ep: int = 8, batch: int = 1, decode: bool = False, **kw
):  # noqa: ANN003, ANN201
    spec, inputs = spec_and_inputs(spec_path)
    dep = Deployment(
        Parallel(tp, dp, ep),
        batch,
        1 if decode else 4096,
        4096 if decode else 0,
        decode,
        kv_dtype="fp8",
        routing=kw.pop("routing", "power_law"),
    )
    return simulate(inputs, spec, dep, get_device(kw.pop("device", "h200")), **kw)


def row(sim: Simulation, name: str, scope: str = "moe"):  # noqa: ANN201
    return next(r for r in sim.rows() if r.name == name and r.scope == scope)


# --- the kernel table -------------------------------------------------------------------------------
def test_shipped_table_is_valid_and_cited() -> None:
    table = load_kernels("h200_sxm_trtllm")
    assert "AIConfigurator" in table.source and "Apache-2.0" in table.source
    assert {"bf16", "fp8", "fp8_block"} <= set(table.gemm) and "w4a16" in table.grouped
    for name, tables in (("h100", "h100_sxm"), ("h200", "h200_sxm"), ("h800", "h200_sxm")):
        assert get_device(name).kernels == tables
    # measured facts the issue states, read back from the data: a 4,096-token fp8-block GEMM reaches
    # ~40% of its bound, an int4 (Marlin) grouped GEMM at prefill under 25%, and power-law routing
    # slows a prefill-sized grouped GEMM by more than 1.3x
    assert 0.3 < table.gemm_eff("fp8_block", 4096, 1e9)[0] < 0.5
    assert table.grouped_eff("w4a16", 64)[0] < 0.25
    assert table.imbalance_factor("fp8_block", 128) > 1.3


def test_curve_interpolates_in_log_space_and_holds_its_ends() -> None:
    curve = Curve((1.0, 100.0), (0.2, 0.6))
    assert curve(0.5) == 0.2 and curve(1e6) == 0.6
    assert curve(10.0) == pytest.approx(0.4)  # halfway in log(x)


def test_bad_table_is_a_located_error(tmp_path: Path) -> None:
    data = {"name": "x", "source": "s", "gemm": {"bf16": {"m": [1, 2], "efficiency": [0.5, 1.5]}}}
    with pytest.raises(KadaptError, match="gemm/bf16/efficiency/1"):
        parse_kernels(data, tmp_path / "x.yaml")
    data["gemm"]["bf16"] = {"m": [4, 2], "efficiency": [0.5, 0.6]}
    with pytest.raises(KadaptError, match="must increase"):
        parse_kernels(data, tmp_path / "x.yaml")
    with pytest.raises(KadaptError, match="unknown kernel table 'nope'"):
        load_kernels("nope", KERNELS_DIR)
    for name, base in (("a", "b"), ("b", "a")):  # bases naming each other would load forever
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({"name": name, "source": "s", "base": base}))
    with pytest.raises(KadaptError, match="names a base of its own"):
        load_kernels("a", tmp_path)


# --- pricing --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prefill() -> Simulation:
    return run(DEEPSEEK)


def test_table_prices_each_op_kind(prefill: Simulation) -> None:
    sources = {k.op.kind: k.source for k in prefill.kernels}
    assert sources["matmul"] == sources["experts"] == sources["attention"] == "table:h200_sxm_trtllm"
    assert sources["vector"] == "roofline"
    # the fp8-block expert GEMMs run far below the flat 0.70 the profile used to assume
    experts = row(prefill, "grouped_gemm(routed_experts)")
    device = get_device("h200")
    flat = experts.flops / (device.peak("fp8") * device.compute_efficiency)
    assert experts.time > 2 * flat


def test_a_borrowed_curve_carries_its_time_over_the_bound_as_a_time() -> None:
    """A table measured on the same die with other HBM (H200's on H100 / H800: same peaks, 4.8 against
    3.35 TB/s) prices an op as the measuring device ran it, with the op's ideal there replaced by its
    ideal here: the time the bound does not account for (launches, latency, dequantization) is not
    rescaled by the bandwidth. Carried over as an efficiency, a kernel at a fraction of its memory
    bound took the whole bandwidth ratio (1.43x), where H100 and H200's measured grouped GEMMs take
    1.02-1.10x as long on H100 below 0.2 of the bound. Another die (the A3) keeps the efficiency."""
    table = load_kernels("h200_sxm_trtllm")
    h200, h100, a3 = get_device("h200"), get_device("h100"), get_device("atlas_800_a3")

    def ideal(op: Op, device: Device) -> float:
        return max(op.flops / device.peak(op.compute), op.bytes / device.hbm_bandwidth)

    decode = run(DEEPSEEK, decode=True, batch=32)
    ops = [k.op for k in decode.kernels if k.source.startswith("table:") and k.op.kind != "comm"]
    assert {op.kind for op in ops} >= {"experts", "matmul", "attention"}
    slower = 0
    for op in ops:
        own, moved = price(op, h200, table), price(op, h100, table)
        assert moved.source == "table:h200_sxm_trtllm (borrowed: h200 curves)"
        # (decode attention: within the interpolation between its curve's points, linear in log time)
        gained = ideal(op, h100) - ideal(op, h200)
        assert moved.time - own.time == pytest.approx(gained, rel=1e-3, abs=1e-5 * own.time)
        slower += moved.time > own.time
        # the bound's share of the time scales with the bandwidth, the rest does not
        assert moved.time <= own.time * h200.hbm_bandwidth / h100.hbm_bandwidth * (1 + 1e-9)
    assert slower > len(ops) / 2
    # another die: the measured efficiency against this device's bound, as before
    gemm = next(op for op in ops if op.kind == "matmul" and op.attrs.get("kernel") == "fp8_block")
    fixed = table.gemm_fixed("fp8_block", float(gemm.attrs["m"]))
    own, there = price(gemm, h200, table), price(gemm, a3, table)
    assert there.time - fixed == pytest.approx(
        (own.time - fixed) * ideal(gemm, a3) / ideal(gemm, h200), rel=1e-6
    )


def test_power_law_routing_costs_more_than_uniform(prefill: Simulation) -> None:
    uniform = run(DEEPSEEK, routing="uniform")
    table = load_kernels("h200_sxm_trtllm")
    shape = next(k.op.attrs for k in prefill.kernels if k.op.kind == "experts")  # DeepSeek-V3's, measured
    fixed = table.grouped_eff("fp8_block", 128, shape)[1]  # the pipeline's fixed cost is not skewed
    skewed, even = (row(s, "grouped_gemm(routed_experts)") for s in (prefill, uniform))
    factor = (skewed.time / skewed.count - fixed) / (even.time / even.count - fixed)
    assert factor == pytest.approx(table.imbalance_factor("fp8_block", 4096 * 8 / 8 / 32, shape), rel=1e-6)
    assert factor > 1.3
    assert row(prefill, "tp_all_reduce").time == row(uniform, "tp_all_reduce").time


def test_an_unmeasured_ep_prices_experts_from_the_ep_sizes_around_it() -> None:
    """At the same pairs per expert the grouped GEMMs' efficiency falls steeply with EP (vLLM on
    H100, Qwen3's shape, bf16); an EP size the table did not measure takes its model shape's curves
    at the two measured EP sizes around it, linear in log(EP) (efficiency, fixed cost and power-law
    factor alike), the nearest one's past the measured range, and the median over every shape only
    where no EP of that model shape was measured."""
    from dataclasses import replace

    table = load_kernels("h100_sxm_vllm")
    qwen3 = {"hidden": 4096, "width": 1536, "experts": 128, "top_k": 8, "attention_dp": 1}
    own = {ep: table.grouped_eff("bf16", 256, qwen3 | {"ep": ep}) for ep in (1, 2, 4, 8, 16)}
    factor = {ep: table.imbalance_factor("bf16", 256, qwen3 | {"ep": ep}) for ep in (2, 8)}
    assert own[1][0] > own[2][0] > own[4][0] > own[8][0] > own[16][0]  # falls with EP

    def held_out(curve: Curve) -> Curve:  # the table without Qwen3's rows at EP 4
        return replace(curve, shapes=tuple((m, c) for m, c in curve.shapes if dict(m) != qwen3 | {"ep": 4}))

    held = replace(
        table,
        grouped={k: held_out(c) for k, c in table.grouped.items()},
        imbalance={k: held_out(c) for k, c in table.imbalance.items()},
    )
    assert held.grouped_eff("bf16", 256, qwen3 | {"ep": 2}) == own[2]  # a measured EP: its own curve
    for pairs in (1, 16, 256, 300):
        two, eight = (table.grouped_eff("bf16", pairs, qwen3 | {"ep": ep}) for ep in (2, 8))
        got = held.grouped_eff("bf16", pairs, qwen3 | {"ep": 4})  # log2: halfway from 2 to 8
        assert got[0] == pytest.approx((two[0] + eight[0]) / 2, rel=1e-9)
        assert got[1] == pytest.approx((two[1] + eight[1]) / 2, rel=1e-9)
    got = held.grouped_eff("bf16", 256, qwen3 | {"ep": 4})
    assert own[8][0] < got[0] < own[2][0]
    assert abs(got[0] / own[4][0] - 1) < 0.15  # near the held-out measurement; the median is not
    assert abs(table.grouped["bf16"](256) / own[4][0] - 1) > 0.3
    assert held.imbalance_factor("bf16", 256, qwen3 | {"ep": 4}) == pytest.approx(
        (factor[2] + factor[8]) / 2, rel=1e-9
    )
    # past the measured EP sizes the nearest one's; no EP of that model shape: the median
    eps = sorted(
        dict(m)["ep"] for m, _ in table.grouped["bf16"].shapes if dict(m) | {"ep": 0} == qwen3 | {"ep": 0}
    )
    for ep, nearest in ((eps[-1] * 4, eps[-1]), (eps[0] / 2, eps[0])):
        assert table.grouped_eff("bf16", 256, qwen3 | {"ep": ep}) == table.grouped_eff(
            "bf16", 256, qwen3 | {"ep": nearest}
        )
    other = qwen3 | {"ep": 3, "hidden": 4000}  # nor any model width at that EP size
    assert table.grouped_eff("bf16", 256, other) == (
        table.grouped["bf16"](256),
        table.grouped["bf16"].overhead,
    )


def test_a_model_width_not_measured_prices_experts_from_the_widths_around_it() -> None:
    """Held out by width (no curve of the model's hidden size at any EP, as the benchmark's shapes
    refit), an expert op takes the curves of the model widths measured at its EP size, linear in
    log(one expert's weights, 3 x hidden x width) between the two around it (efficiency, fixed cost,
    power-law factor and floor alike), the nearest one's past the measured range, and the median only
    where no width was measured at that EP size. At a fixed EP size and pairs per expert the
    efficiency moves smoothly with the width: Qwen3-235B's shape at EP8 on H100 / vLLM, one pair per
    expert, prices its time above the floor (efficiency / power-law factor) within 6% of its own
    curve from the nearest width (6144 x 2048), where the median over every shape is 12% off."""
    from dataclasses import replace

    from kimi_adapter_core.backends.simulation.tables.kernels import EXPERT_ACROSS, KernelTable

    def without(table: KernelTable, hidden: int) -> KernelTable:
        def drop(curve: Curve) -> Curve:
            return replace(
                curve, shapes=tuple((m, c) for m, c in curve.shapes if dict(m)["hidden"] != hidden)
            )

        grouped = {k: drop(c) for k, c in table.grouped.items()}
        return replace(table, grouped=grouped, imbalance={k: drop(c) for k, c in table.imbalance.items()})

    assert EXPERT_ACROSS[0] == "ep"  # a model shape measured at other EP sizes prices from those first
    table = load_kernels("h100_sxm_vllm")
    layout = {"ep": 8, "attention_dp": 1}
    deepseek = {"hidden": 7168, "width": 2048, "experts": 256, "top_k": 8} | layout
    lo = {"hidden": 6144, "width": 2048, "experts": 256, "top_k": 8} | layout  # 37.7 M weights
    hi = {"hidden": 6144, "width": 2560, "experts": 160, "top_k": 8} | layout  # 47.2 M weights
    held = without(table, 7168)
    t = math.log(7168 / 6144) / math.log(2560 / 2048)  # DeepSeek-V3's 44.0 M weights between them
    for pairs in (0.0625, 1, 16, 256):
        a, b = (table.grouped_eff("fp8_block", pairs, s) for s in (lo, hi))
        got = held.grouped_eff("fp8_block", pairs, deepseek)
        assert got is not None and a is not None and b is not None
        assert got[0] == pytest.approx(a[0] + t * (b[0] - a[0]), rel=1e-9)
        assert got[1] == pytest.approx(a[1] + t * (b[1] - a[1]), rel=1e-9)
        fa, fb = (table.imbalance_factor("fp8_block", pairs, s) for s in (lo, hi))
        expected = fa + t * (fb - fa)
        assert held.imbalance_factor("fp8_block", pairs, deepseek) == pytest.approx(expected, rel=1e-9)
    # below every width left (hidden 4096 held out): the nearest one's, 6144 x 2048
    qwen3 = {"hidden": 4096, "width": 1536, "experts": 128, "top_k": 8} | layout
    held = without(table, 4096)
    for pairs in (0.0625, 1, 16, 256):
        assert held.grouped_eff("bf16", pairs, qwen3) == table.grouped_eff("bf16", pairs, lo)
        assert held.imbalance_factor("bf16", pairs, qwen3) == table.imbalance_factor("bf16", pairs, lo)

    def above_floor(eff: tuple[float, float] | None, factor: float) -> float:
        assert eff is not None
        return eff[0] / factor

    own = above_floor(table.grouped_eff("bf16", 1, qwen3), table.imbalance_factor("bf16", 1, qwen3))
    got = above_floor(held.grouped_eff("bf16", 1, qwen3), held.imbalance_factor("bf16", 1, qwen3))
    median = table.grouped["bf16"](1) / table.imbalance["bf16"](1)
    assert abs(got / own - 1) < 0.06 < 0.1 < abs(median / own - 1)
    # an EP size no width was measured at: the median
    assert held.grouped_eff("bf16", 1, qwen3 | {"ep": 3}) == (
        held.grouped["bf16"](1),
        held.grouped["bf16"].overhead,
    )


def test_tp_layout_has_no_all_to_all_and_dp_layout_has(prefill: Simulation) -> None:
    assert not any(r.name.startswith("ep_") for r in prefill.rows())
    dp = run(DEEPSEEK, tp=1, dp=8, ep=8, batch=8, decode=True)
    assert {"ep_dispatch(all_to_all)", "ep_combine(all_to_all)"} <= {r.name for r in dp.rows()}
    assert not any(r.name == "tp_all_reduce" for r in dp.rows())


def test_deepep_all_to_all_deduplicates_per_rank_and_node() -> None:
    device = get_device("h100")
    base = {"collective": "all_to_all", "tokens": 1000.0, "top_k": 8, "token_bytes": 7168.0}
    one_node = _all_to_all(device, base | {"group": 8})[0]
    naive = 1000 * 8 * 7168 * 7 / 8 / (device.links[0].bandwidth * device.links[0].efficiency)
    assert one_node == pytest.approx(naive * (1 - (7 / 8) ** 8))  # one copy per distinct rank, not per pair
    # 4 nodes: every token crosses InfiniBand once per other node it has experts on (< 3), not per pair
    four = _all_to_all(device, base | {"group": 32})[0]
    outer = device.links[1]
    remote_nodes = 3 * (1 - (1 - 8 / 32) ** 8)
    assert four == pytest.approx(1000 * 7168 * remote_nodes / (outer.bandwidth * outer.efficiency))
    pairwise = 1000 * 8 * 7168 * 24 / 32 / (outer.bandwidth * outer.efficiency)
    assert four < 0.5 * pairwise


def test_all_reduce_uses_the_measured_curve_inside_a_node() -> None:
    device = get_device("h200")
    table = kernel_table(device)
    assert table is not None and table.all_reduce is not None
    latency, curve = table.all_reduce
    small = comm_time(device, {"collective": "all_reduce", "bytes": 65536, "group": 8}, table)[0]
    assert small == pytest.approx(latency + 2 * 7 / 8 * 65536 / (device.links[0].bandwidth * curve(65536)))
    flat = comm_time(device, {"collective": "all_reduce", "bytes": 65536, "group": 8}, None)[0]
    assert small != flat


def test_router_and_norms_read_bf16_and_projections_merge() -> None:
    """DeepSeek's router upcasts its input to fp32 in eager code; serving runs it on the bf16 tensor."""
    sim = run(DEEPSEEK)
    router = next(k for k in sim.kernels if k.op.module == "moe_layer.mlp.gate" and k.op.kind == "matmul")
    assert router.op.compute == "bf16"
    assert router.op.bytes == pytest.approx(4096 * 7168 * 2 + 256 * 7168 * 2 + 4096 * 256 * 4)
    assert not any(k.op.name == "_to_copy" for k in sim.kernels)
    names = {k.op.name for k in sim.kernels}
    assert "mm(q_a_proj+kv_a_proj_with_mqa)" in names and "mm(gate_proj+up_proj)" in names


def test_merging_keeps_work_and_reads_the_activation_once() -> None:
    from kimi_adapter_core.backends.simulation.model.rank_model import trace_rank

    spec = load_spec(REPO / "specs" / "llama.yaml")
    dep = Deployment(Parallel(1, 1, 1), 4, 1, 128, True)
    rec, _ = trace_rank(spec, model_inputs(spec, None), dep)
    merged = merge_projections(rec.ops)
    assert sum(o.flops for o in merged) == sum(o.flops for o in rec.ops)
    qkv = next(o for o in merged if o.name == "mm(q_proj+k_proj+v_proj)")
    parts = [o for o in rec.ops if o.module.endswith(("q_proj", "k_proj", "v_proj")) and o.kind == "matmul"]
    activation = 4 * 4096 * 2
    assert qkv.bytes == pytest.approx(sum(o.bytes for o in parts) - 2 * activation)
    assert fuse(rec.ops) == fuse(rec.ops)  # fusing does not modify the recorded ops


# --- the measured cost model --------------------------------------------------------------------------
def test_measured_without_the_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "aiconfigurator_core", None)
    monkeypatch.setitem(sys.modules, "aiconfigurator_core.sdk", None)
    result = CliRunner().invoke(
        cli,
        ["simulate", str(DEEPSEEK), "--device", "h200", "--tp", "8", "--ep", "8", "--cost-model", "measured"],
    )
    assert result.exit_code == 1 and "kadapt[measured]" in result.output
    assert "Traceback" not in result.output


@needs_aic
def test_measured_unknown_system_is_an_error() -> None:
    result = CliRunner().invoke(
        cli,
        ["simulate", str(DEEPSEEK), "--device", "h800", "--tp", "8", "--ep", "8", "--cost-model", "measured"],
    )
    assert result.exit_code == 1 and "no AIConfigurator tables for device 'h800'" in result.output


@needs_aic
def test_measured_cli_reports_sources() -> None:
    args = [
        "simulate",
        str(DEEPSEEK),
        "--device",
        "h200",
        "--tp",
        "8",
        "--ep",
        "8",
        "--decode",
        "--batch",
        "32",
    ]
    result = CliRunner().invoke(
        cli, [*args, "--context-len", "4096", "--cost-model", "measured", "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    sources = data["cost_model"]["sources"]
    assert data["cost_model"]["name"] == "measured"
    assert set(sources) == {"aiconfigurator:h200_sxm/trtllm", "roofline"}
    assert sources["aiconfigurator:h200_sxm/trtllm"]["percent"] > 90
    by_op = {op["op"]: op["source"] for op in data["ops"]}
    assert by_op["grouped_gemm(routed_experts)"] == "aiconfigurator:h200_sxm/trtllm"
    assert by_op["mla_decode_attention"] == "aiconfigurator:h200_sxm/trtllm"
    assert by_op["embedding"] == "roofline"
    text = CliRunner().invoke(cli, [*args, "--cost-model", "measured"]).output
    assert "cost model           measured: " in text and "aiconfigurator:h200_sxm/trtllm" in text


AIC_DEEPSEEK = ("deepseek-ai/DeepSeek-V3", "h200_sxm", "trtllm")


@needs_aic
@pytest.mark.parametrize(("batch", "decode"), [(1, True), (32, True), (128, True), (1, False)])
def test_deepseek_v3_against_aiconfigurator(batch: int, decode: bool) -> None:
    """Within 20% of AIConfigurator in total and 30% per component (roofline), 10% in total (measured)."""
    ref = reference.reference_step(
        *AIC_DEEPSEEK, tp=8, ep=8, decode=decode, batch=batch, seq=4096, fmha_quant_mode="bfloat16"
    )
    roofline = run(DEEPSEEK, batch=batch, decode=decode)
    assert roofline.step_time * 1e3 == pytest.approx(ref.total_ms, rel=0.20)
    parts = dict.fromkeys(reference.COMPONENTS, 0.0)
    for k in roofline.kernels:
        parts[reference.kadapt_component(k.op)] += k.total * 1e3
    for name in ("attention", "experts", "communication"):
        assert parts[name] == pytest.approx(ref.components[name], rel=0.30), name
    measured = run(DEEPSEEK, batch=batch, decode=decode, cost_model="measured")
    assert measured.step_time * 1e3 == pytest.approx(ref.total_ms, rel=0.10)


@needs_aic
def test_measured_all_to_all_comes_from_the_deepep_tables() -> None:
    """Attention DP8 x EP8 on one H200 node: AIConfigurator's exact estimate keeps that layout on its
    fused graph, so dispatch and combine are its ``MoeDispatch`` (TensorRT-LLM's own all-to-all at the
    rank's 32 tokens); its DeepEP low-latency tables (TensorRT-LLM's build) hold the same op, which
    the pricer takes across nodes. Across two nodes TensorRT-LLM has no DeepEP measurement (its answer
    there is the one-node row, tier 'estimated'), so the roofline prices them."""
    sim = run(DEEPSEEK, tp=1, dp=8, ep=8, batch=256, decode=True, cost_model="measured")
    engine = aiconfigurator._database_handle("h200_sxm", "trtllm")
    pricer = MeasuredPricer("h200_sxm", "trtllm")
    for name, phase, dtype in (
        ("ep_dispatch(all_to_all)", "dispatch", "fp8"),
        ("ep_combine(all_to_all)", "combine", "fp8"),
    ):
        got = row(sim, name)
        assert got.source == "aiconfigurator:h200_sxm/trtllm"
        fused = {
            "MoeDispatch": {
                "name": name,
                "scale_factor": 1.0,
                "hidden_size": 7168,
                "topk": 8,
                "num_experts": 256,
                "moe_tp_size": 1,
                "moe_ep_size": 8,
                "attention_dp_size": 8,
                "pre_dispatch": phase == "dispatch",
                "attn_ar_modeled": False,
                "backend": "trtllm",
                "flavor": "TrtllmAlltoall",
                "comm_quant": "half",
                "moe_quant": "fp8_block",
                "attn_cp_size": 1,
                "is_context": False,
                "sms": 12,
                "scale_num_tokens": 1,
            }
        }
        spec = {
            "MoeAllToAll": {
                "name": name,
                "scale_factor": 1.0,
                "phase": phase,
                "comm_backend": "trtllm_deepep_ll",
                "comm_dtype": dtype if phase == "dispatch" else "bfloat16",
                "hidden_size": 7168,
                "topk": 8,
                "num_experts": 256,
                "moe_ep_size": 8,
                "node_num": 1,
                "sms": 0,
                "attention_tp_size": 1,
            }
        }
        shape = {"is_context": False, "batch_size": 1, "s": 32, "x": 32}
        ((_, ms, _, tier),) = engine.evaluate_ops_json(json.dumps([fused]), **shape)
        assert tier == "silicon" and got.time / got.count == pytest.approx(ms * 1e-3, rel=1e-9)
        ((_, ms, _, tier),) = engine.evaluate_ops_json(json.dumps([spec]), **shape)
        op = next(k.op for k in sim.kernels if k.op.name == name)
        deepep = pricer.deepep_all_to_all(op, decode=True)
        assert tier == "silicon" and deepep == pytest.approx(ms * 1e-3, rel=1e-9)
    wide = run(DEEPSEEK, tp=1, dp=16, ep=16, batch=256, decode=True, cost_model="measured")
    # no TensorRT-LLM DeepEP row at EP16: kadapt's own DeepEP low-latency model prices it
    assert row(wide, "ep_dispatch(all_to_all)").source == "deepep_ll:h200"
    sglang = run(
        DEEPSEEK, tp=1, dp=16, ep=16, batch=256, decode=True, cost_model="measured", framework="sglang"
    )
    assert (
        row(sglang, "ep_combine(all_to_all)").source == "aiconfigurator:h200_sxm/sglang"
    )  # measured on 2 nodes


# --- the Atlas A3 table --------------------------------------------------------------------------------
def a3_all_to_all(phase: str, tokens: float, group: int = 16) -> float:
    device = get_device("atlas_800_a3")
    row_bytes = 7168 * (1 if phase == "dispatch" else 2)  # int8 rows out, bf16 rows back
    comm = {
        "collective": "all_to_all",
        "group": group,
        "tokens": tokens,
        "top_k": 8,
        "token_bytes": row_bytes,
    }
    time, _, measured = comm_time(
        device, comm | {"bytes": tokens * 8 * row_bytes}, kernel_table(device), phase
    )
    assert measured == (group <= 32)
    return time * 1e6


def test_atlas_a3_table_reproduces_the_published_kernel_times() -> None:
    """DeepEP-Ascend's A3 figures, read back through kadapt's pricing of the same shapes (hidden 7168,
    top-8, int8 dispatch, bf16 combine)."""
    for group, (dispatch, combine) in {8: (132, 126), 16: (139, 135), 32: (153, 151)}.items():
        assert a3_all_to_all("dispatch", 128, group) == pytest.approx(dispatch, abs=0.5)
        assert a3_all_to_all("combine", 128, group) == pytest.approx(combine, abs=0.5)
    assert a3_all_to_all("dispatch", 32) == pytest.approx(80, abs=0.5)
    assert a3_all_to_all("combine", 32) == pytest.approx(75, abs=0.5)
    rows = 4096 * 8 * 7168  # high-throughput kernels: GB/s of rows received per rank
    assert rows / a3_all_to_all("dispatch", 4096) / 1e3 == pytest.approx(107, rel=0.01)
    assert 2 * rows / a3_all_to_all("combine", 4096) / 1e3 == pytest.approx(103, rel=0.01)
    # a few tokens cost the measured latency floor, not the link's 0.5 us
    assert a3_all_to_all("dispatch", 5) > 60 and a3_all_to_all("dispatch", 5, group=64) < 20


def test_atlas_a3_table_is_generated_and_borrows_only_what_it_says() -> None:
    from kimi_adapter_core.backends.simulation.tables import ascend_calibrate

    shipped = yaml.safe_load((KERNELS_DIR / "atlas_a3.yaml").read_text(encoding="utf-8"))
    assert shipped == json.loads(json.dumps(ascend_calibrate.calibrate()))  # regenerating changes nothing
    table, hopper = load_kernels("atlas_a3"), load_kernels("h200_sxm_trtllm")
    assert get_device("atlas_800_a3").kernels == "atlas_a3"
    assert table.gemm == hopper.gemm and table.decode == hopper.decode and table.grouped == hopper.grouped
    assert table.all_to_all is not None and hopper.all_to_all is None
    assert (
        "Git LFS" in table.source and "Hopper" in table.source and "DeepEP-Ascend" in table.all_to_all.source
    )


def test_kimi_on_atlas_a3_prices_dispatch_and_combine_from_the_table() -> None:
    """TensorCast's 16k decode case: 20 queries over DP4 x TP4, MTP3 - 5 tokens per rank per call."""
    spec = load_spec(REPO / "specs" / "kimi_k25.yaml")
    dep = Deployment(Parallel(4, 4, 16), 20, 1, 8500, True, mtp=3)
    sim = simulate(model_inputs(spec, "W4A8"), spec, dep, get_device("atlas_800_a3"))
    for name, phase in (("ep_dispatch(all_to_all)", "dispatch"), ("ep_combine(all_to_all)", "combine")):
        got = row(sim, name)
        assert got.source == "table:atlas_a3_measured" and got.count == 60
        sent = 5 * 4 / 4  # per rank: 5 queries x 4 tokens, split over TP4
        assert got.time / got.count * 1e6 == pytest.approx(a3_all_to_all(phase, sent), rel=1e-9)
    # a borrowed curve names the table that measured it
    borrowed = "table:h200_sxm_trtllm (borrowed: h200 curves)"
    assert row(sim, "grouped_gemm(routed_experts)").source == borrowed
    assert row(sim, "mla_decode_attention").source == borrowed
