"""The per-shape power-law routing curves a table prices with stay inside the band fitted from the
table's own spread (``tables.plausible``): a shape whose rows give an absurd factor prices from the
curves around it, and the op's source says so."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.simulation.estimate.simulator import simulate
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.backends.simulation.tables.kernels import KERNELS_DIR, load_kernels, parse_kernels
from kimi_adapter_core.backends.simulation.tables.plausible import CHECKED_FROM
from kimi_adapter_core.spec import load_spec

# TensorRT-LLM 1.3.0rc20's power-law rows of this shape (bf16) run 3.7-10x its balanced ones on H200
AUDITED = {"hidden": 4096, "width": 1024, "experts": 512, "top_k": 10, "ep": 4, "attention_dp": 1}


@pytest.mark.parametrize("path", sorted(KERNELS_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shape_curve_priced_with_is_inside_its_band(path: Path) -> None:
    table = load_kernels(path.stem)
    for dtype, curve in table.imbalance.items():
        check = table.routing_checks.get(dtype)
        if check is None:
            continue
        (low, high), (lowest, highest) = check.band, check.outer
        assert 0.1 <= low < 1 < high <= 10, (path.stem, dtype, check.band)  # a band, not the whole axis
        assert 0.05 <= lowest <= low and high <= highest <= 20, (path.stem, dtype, check.outer)
        for match, shaped in curve.shapes:
            points = [y for x, y in zip(shaped.xs, shaped.ys, strict=True) if x >= CHECKED_FROM]
            where = (path.stem, dtype, dict(match))
            assert all(lowest <= y <= highest for y in points), where
            assert sum(not low <= y <= high for y in points) <= len(points) / 4, where
        assert len(check.dropped) < len(check.raw.shapes) / 5  # outliers, not the table


def test_the_audited_shape_is_left_out_and_the_source_says_so() -> None:
    table = load_kernels("h200_sxm_trtllm")
    check = table.routing_checks["bf16"]
    assert tuple(sorted((k, float(v)) for k, v in AUDITED.items())) in check.dropped
    raw = check.raw.at(AUDITED, "ep")(40)
    assert raw > 5  # the file still holds it
    assert table.imbalance_factor("bf16", 40, AUDITED) < 1.5  # EP2 and EP8 of the same model around it
    assert "outside the plausible band" in table.imbalance_note("bf16", 40, AUDITED)
    assert table.imbalance_note("fp8_block", 40, AUDITED | {"hidden": 7168, "width": 2048}) == ""


def test_a_factor_outside_the_band_prices_from_the_ep_sizes_around_it(tmp_path: Path) -> None:
    ones = {"pairs_per_expert": [1.0, 16.0, 256.0]}
    shapes = [
        {"match": {"hidden": 4096, "ep": ep}, **ones, "factor": [1.0 + 0.01 * ep, 1.2, 1.4]}
        for ep in (1, 2, 8, 16)
    ] + [{"match": {"hidden": 4096, "ep": 4}, **ones, "factor": [6.0, 6.0, 6.0]}]
    data = {
        "name": "t",
        "source": "test",
        "grouped_gemm": {"bf16": {"pairs_per_expert": [1.0], "efficiency": [0.5]}},
        "routing": {"power_law": {"bf16": {**ones, "factor": [1.0, 1.2, 1.4], "shapes": shapes}}},
    }
    table = parse_kernels(data, tmp_path / "t.yaml")
    assert table.routing_checks["bf16"].outer[1] < 6.0
    at = {"hidden": 4096, "ep": 4}
    assert table.imbalance_factor("bf16", 16, at) == pytest.approx(1.2)  # EP2 and EP8 around it
    assert table.imbalance_factor("bf16", 16, {"hidden": 4096, "ep": 2}) == pytest.approx(1.2)
    assert "6 from a per-shape curve" in table.imbalance_note("bf16", 16, at)


def test_qwen3_next_experts_on_h200_are_within_the_bandwidth_ratio_of_b200() -> None:
    """The audit's case: Qwen3-Next, 2,048-token prefill, TP4 EP4, TensorRT-LLM tables, power-law
    routing. Its experts are memory-bound (one expert 6.3 MB, 128 per rank): H200 over B200 within
    1.3x of B200's bandwidth over H200's (it was 7.7x against 1.67 with the audited factor)."""
    spec = load_spec(REPO / "specs" / "qwen3_next.yaml")
    inputs = model_inputs(spec, None)
    dep = Deployment(Parallel(4, 1, 4), 1, 2048, 0, False, routing="power_law")
    times = {}
    for name in ("h200", "b200"):
        device = get_device(name)
        sim = simulate(inputs, spec, dep, device)
        experts = [k for k in sim.kernels if k.op.kind == "experts"]
        assert all("outside the plausible band" in k.source for k in experts) == (name == "h200")
        times[name] = (sum(k.total for k in experts), device.hbm_bandwidth)
    (h200, h200_bw), (b200, b200_bw) = times["h200"], times["b200"]
    assert h200 / b200 < 1.3 * b200_bw / h200_bw
