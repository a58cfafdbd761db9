"""A routed-expert shape's EP size whose balanced rows run slower than a smaller EP size's at the same
tokens is a broken measurement (``calibrate_rows.broken_ep_sizes``): the calibration fits without it
and says so in the curve's source, the measured cost model does not price from it, and a
well-behaved table loses nothing."""

from __future__ import annotations

import pytest
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.simulation.estimate import aiconfigurator
from kimi_adapter_core.backends.simulation.estimate.measured import MeasuredPricer
from kimi_adapter_core.backends.simulation.estimate.simulator import simulate
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.tables import calibrate_experts, calibrate_rows
from kimi_adapter_core.backends.simulation.tables.calibrate_rows import BrokenEp, broken_ep_sizes
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.backends.simulation.tables.kernels import KERNELS_DIR, _read, load_kernels
from kimi_adapter_core.spec import load_spec

needs_aic = pytest.mark.skipif(not aiconfigurator.available(), reason="aiconfigurator-core not installed")
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
# TensorRT-LLM 1.3.0rc20 on H100: bf16 hidden 4096 x 1,024, 512 experts top-10 (5.08 ms at EP4 and 64
# tokens, 2.14 at EP2); the curves' match of that model shape
AUDITED = {"hidden": 4096, "width": 1024, "experts": 512, "top_k": 10}
LEFT_OUT = "balanced rows left out"


def well_behaved() -> dict[int, dict[int, float]]:
    """A memory-bound shape: a 40 us floor plus work shrinking as 1/EP, one row of floor noise."""
    rows = {ep: {t: 0.04 + 0.002 * t / ep for t in TOKENS} for ep in (1, 2, 4, 8, 16)}
    rows[16][1] = 0.09  # one token at EP16: the pipeline's run-to-run spread, 50 us over EP8's
    return rows


def test_a_well_behaved_shape_loses_no_ep_size() -> None:
    assert broken_ep_sizes(well_behaved()) == ()


def test_an_ep_size_slower_than_a_smaller_one_is_left_out_and_sets_no_reference() -> None:
    rows = well_behaved()
    rows[4] = {t: 2.5 * ms for t, ms in rows[2].items()}  # EP4 slower than EP2 at every token count
    rows[8] = {t: 0.9 * ms for t, ms in rows[2].items()}  # faster than EP2, slower than EP4 should be
    assert broken_ep_sizes(rows) == (BrokenEp(4, len(TOKENS), len(TOKENS)),)


def test_a_few_slow_rows_of_an_ep_size_are_noise_and_stay() -> None:
    rows = well_behaved()
    for t in TOKENS[:3]:  # three of seven token counts: under half
        rows[8][t] = 3 * rows[4][t] + 0.1
    assert broken_ep_sizes(rows) == ()


def frame(rows: dict[int, dict[int, float]]):
    """Balanced rows of one model shape (AIConfigurator's columns) from EP size -> tokens -> ms."""
    import pandas as pd

    shape = {"hidden_size": 4096, "inter_size": 1024, "num_experts": 512, "topk": 10}
    by_row = [(ep, t, ms) for ep, by in rows.items() for t, ms in by.items()]
    return pd.DataFrame([shape | {"moe_ep_size": ep, "num_tokens": t, "latency": ms} for ep, t, ms in by_row])


def test_the_fit_drops_a_broken_ep_sizes_rows_and_says_so() -> None:
    rows = well_behaved()
    rows[4] = {t: 2.5 * ms for t, ms in rows[2].items()}
    kept, labels = calibrate_experts._without_broken_ep(frame(rows), calibrate_experts.EXPERT_SHAPE)
    assert sorted(set(kept.moe_ep_size)) == [1, 2, 8, 16]
    assert len(kept) == 4 * len(TOKENS)
    assert labels == ["hidden 4096, width 1024, experts 512, top_k 10, EP 4 (7 of 7 rows)"]
    assert LEFT_OUT in calibrate_experts._left_out_note(labels)


def test_the_fit_keeps_a_well_behaved_table_whole() -> None:
    rows = frame(well_behaved())
    kept, labels = calibrate_experts._without_broken_ep(rows, calibrate_experts.EXPERT_SHAPE)
    assert labels == [] and kept is rows and calibrate_experts._left_out_note(labels) == ""


@needs_aic
def test_a_fit_on_measured_rows_with_a_broken_ep_size_loses_it_and_its_source_says_so() -> None:
    """B200 / TensorRT-LLM loses no row; made slower at EP8 than at EP4, its fit drops EP8's rows."""
    root = calibrate_rows._tables("b200_sxm")
    peak = dict(get_device("b200").peak_flops)

    def one_shape(slower: float):
        def keep(_op: str, rows):
            rows = rows[
                (rows.moe_dtype == "bfloat16") & (rows.hidden_size == 4096) & (rows.num_experts == 512)
            ]
            return rows.assign(latency=rows.latency.where(rows.moe_ep_size != 8, rows.latency * slower))

        return keep

    def fitted(slower: float):
        grouped, _ = calibrate_experts.moe_curves(root, "trtllm", peak, 8e12, one_shape(slower))
        curve = grouped["bf16"]
        eps = {
            s["match"]["ep"]
            for s in curve["shapes"]
            if "moe_tp" not in s["match"] and "graph" not in s["match"]
        }
        return curve["source"], eps

    source, eps = fitted(1.0)
    assert LEFT_OUT not in source and 8 in eps
    source, eps = fitted(20.0)
    assert "experts 512, top_k 10, EP 8 (" in source and 8 not in eps and {4, 16} <= eps


@pytest.mark.parametrize("path", sorted(KERNELS_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_only_tensorrt_llm_rc20s_hopper_rows_are_left_out(path) -> None:
    """The survey: every shipped table but H100 / H200 TensorRT-LLM 1.3.0rc20's bf16 and fp8 rows
    (SGLang borrows the fp8 ones) keeps every balanced row."""
    grouped = _read(path.stem, KERNELS_DIR).get("grouped_gemm", {})  # Ascend's table has none
    left_out = {
        dtype
        for dtype, curve in grouped.items()
        if LEFT_OUT in curve["source"] or any(LEFT_OUT in s.get("source", "") for s in curve["shapes"])
    }
    expected = {"trtllm": {"bf16", "fp8"}, "sglang": {"fp8"}}.get(path.stem.split("_")[-1], set())
    assert left_out == (expected if path.stem.startswith(("h100", "h200")) else set())


def test_the_audited_ep_size_has_no_curve_and_prices_from_its_neighbours() -> None:
    source = _read("h100_sxm_trtllm", KERNELS_DIR)["grouped_gemm"]["bf16"]["source"]
    assert "hidden 4096, width 1024, experts 512, top_k 10, EP 4 (" in source
    table = load_kernels("h100_sxm_trtllm")
    whole = [dict(match) for match, _ in table.grouped["bf16"].shapes if "moe_tp" not in dict(match)]
    eps = {match["ep"] for match in whole if all(match.get(k) == v for k, v in AUDITED.items())}
    assert 4 not in eps and {2, 8} <= eps


def qwen3_next_experts(device: str) -> float:
    spec = load_spec(REPO / "specs" / "qwen3_next.yaml")
    dep = Deployment(Parallel(4, 1, 4), 1, 2048, 0, False, routing="uniform")
    sim = simulate(model_inputs(spec, None), spec, dep, get_device(device))
    return sum(k.total for k in sim.kernels if k.op.kind == "experts")


def test_qwen3_next_experts_on_h100_are_within_the_bandwidth_ratio_of_b200() -> None:
    """The issue's case: Qwen3-Next, 2,048-token prefill, TP4 EP4, TensorRT-LLM tables, uniform
    routing: memory-bound experts, H100 over B200 within 1.5x of their bandwidths' ratio (it was
    8x, 64 ms against 8, from the EP4 rows left out)."""
    ratio = get_device("b200").hbm_bandwidth / get_device("h100").hbm_bandwidth
    assert qwen3_next_experts("h100") / qwen3_next_experts("b200") < 1.5 * ratio


@needs_aic
def test_the_measured_cost_model_does_not_price_from_a_broken_ep_size() -> None:
    pricer = MeasuredPricer("h100_sxm", "trtllm")
    attrs = {"kernel": "bf16", "hidden": 4096, "width": 1024, "top_k": 10, "experts": 512, "tokens": 64}
    assert pricer._experts(attrs | {"ep": 4}, decode=False) is None  # the roofline prices it
    two, eight = (pricer._experts(attrs | {"ep": ep}, decode=False) for ep in (2, 8))
    assert two is not None and eight is not None and eight < two
    blackwell = MeasuredPricer("b200_sxm", "trtllm")
    assert all(blackwell._experts(attrs | {"ep": ep}, decode=False) for ep in (2, 4, 8))
