"""The serving-gap benchmark decomposes the very step the serving price is built from (issue 38 item 3:
what the anchors miss at one request at a time). Its account of the gap (docs/cost_model.md) holds only
if the decode step it splits is the one ``simulate --concurrency`` priced the TPOT from, and the split
adds up to that step; and it changes no price."""

from __future__ import annotations

import sys

import pytest
from fixtures.modules import REPO, import_path

from kimi_adapter_core.backends.simulation.estimate import reference
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.search.concurrency import price_concurrency
from kimi_adapter_core.backends.simulation.search.grid import quant_modes, sweep_inputs
from kimi_adapter_core.backends.simulation.search.request_pricing import Workload
from kimi_adapter_core.backends.simulation.search.serving_points import ServingPoint
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.spec import load_spec

sys.path.insert(0, str(REPO / "benchmarks"))  # serving_gap imports its sibling serving_anchors
serving_gap = import_path(REPO / "benchmarks" / "serving_gap.py", "serving_gap")
POINT = "sglang-b200-gptoss-sharegpt-c1"  # one request on 8 B200: the fastest anchor to price


def _point(name: str = POINT) -> ServingPoint:
    (point,) = [p for p in serving_gap.serving_points() if p.id == name]
    return point


# DeepSeek-R1 on SGLang: FP8 block-scaled and MLA, so the step holds engine kernels the request
# pricing's sweep must insert as ``simulate`` does
@pytest.mark.parametrize("point_id", [POINT, "sglang-b200-dsr1-1000x1000-c1"])
def test_the_split_step_is_the_decode_step_the_tpot_is_priced_from(point_id: str) -> None:
    point = _point(point_id)
    spec = load_spec(REPO / "specs" / f"{point.spec}.yaml")
    priced = price_concurrency(
        spec,
        sweep_inputs(spec, quant_modes(spec, None)),
        get_device(point.device),
        Deployment(point.parallel, 1, 1, 0, False, kv_dtype=point.kv_dtype),
        Workload(point.isl, point.osl),
        point.framework,
        point.concurrency,
    )
    step = serving_gap.decode_step(point)
    assert step.step_time == priced.decode.step_time
    engine = [k for k in step.kernels if "engine_kernel" in k.op.attrs]
    assert bool(engine) == (point_id != POINT)  # gpt-oss: none (its rope writes the bf16 cache)
    parts = serving_gap.parts(step)
    assert abs(sum(parts[name] for name in reference.COMPONENTS) - parts["total"]) < 1e-9
    assert parts["experts"] > 0 and parts["communication"] > 0  # TP8 with routed experts


def test_the_gap_counts_layers_and_kernels_of_the_step() -> None:
    point = _point()
    step = serving_gap.decode_step(point)
    gap = serving_gap.Gap(point, serving_gap.kadapt_estimate(point), "not asked", step, "not asked")
    assert gap.layers == 36  # gpt-oss-120b's decoder layers, one attention kernel each
    assert gap.launches > gap.layers
    assert gap.gap_ms == point.mean_tpot_ms - gap.kadapt.tpot_ms
