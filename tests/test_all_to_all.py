"""DeepEP low-latency all-to-all pricing and the monotone decode-attention price.

The published DeepEP H800 figures are data (``published/deepep_h800.yaml``); these tests read them
back through kadapt's pricing, so a change to the model or to the device profiles that moves a row
outside the band fails here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kimi_adapter_core.backends.simulation.estimate.cost import comm_time, price
from kimi_adapter_core.backends.simulation.estimate.simulator import simulate
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.tables.device import Device, get_device, load_device_file
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = (
    REPO / "kimi_adapter_core" / "backends" / "simulation" / "tables" / "published" / "deepep_h800.yaml"
)
MLA_SPECS = ("deepseek_v3", "kimi_k25")


def published() -> dict[str, Any]:
    return yaml.safe_load(PUBLISHED.read_text(encoding="utf-8"))


def ll_comm(group: int, phase: str, setting: dict[str, Any], tokens: float | None = None) -> dict[str, Any]:
    """The comm description ``RoutedExperts`` records for a decode step at DeepEP's test setting."""
    hidden = setting["hidden"]
    return {
        "collective": "all_to_all",
        "group": group,
        "tokens": setting["tokens_per_rank"] if tokens is None else tokens,
        "top_k": setting["top_k"],
        "hidden": hidden,
        "experts": setting["experts"],
        "token_bytes": hidden * setting[f"{phase}_bytes"],
        "bytes": 0.0,
        "low_latency": True,
    }


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_model_reproduces_deepep_h800_low_latency_table(phase: str) -> None:
    data = published()
    device = get_device(data["device"])
    rows = data[phase]
    for group, latency_us, bandwidth in zip(
        rows["ep"], rows["latency_us"], rows["bandwidth_gbps"], strict=True
    ):
        seconds, bound, measured = comm_time(device, ll_comm(group, phase, data["setting"]), None, phase)
        assert not measured and bound == "network"
        assert seconds * 1e6 == pytest.approx(latency_us, rel=0.20), f"{phase} EP{group}"
        # DeepEP's bandwidth counts every selected expert's row (FP8 rows with their scales)
        setting = data["setting"]
        row = setting["hidden"] * setting[f"{phase}_bytes"] + (
            setting["hidden"] / 32 if phase == "dispatch" else 0
        )
        logical = setting["tokens_per_rank"] * setting["top_k"] * row / seconds / 1e9
        assert logical == pytest.approx(bandwidth, rel=0.20), f"{phase} EP{group}"


def test_low_latency_has_a_floor_the_roofline_lacks() -> None:
    """One token still pays the kernel's round trips (the AIConfigurator-measured 12-26 us), where
    the deduplicating roofline charges the link latency plus bytes."""
    data, device = published(), get_device("h200")
    for phase in ("dispatch", "combine"):
        one = ll_comm(8, phase, data["setting"], tokens=1)
        low = comm_time(device, one, None, phase)
        roof = comm_time(device, one | {"low_latency": False}, None, phase)
        assert low[1] == "latency" and low[0] > 1.4 * roof[0]
        assert low[0] == pytest.approx(device.ep_low_latency.latency[phase](8), rel=0.05)  # type: ignore[union-attr]
        # more tokens and more nodes never make a call cheaper
        times = [
            comm_time(device, ll_comm(g, phase, data["setting"], t), None, phase)[0]
            for g in (8, 16, 64)
            for t in (1, 32, 128)
        ]
        assert times[:3] == sorted(times[:3]) and times[2] < times[5] < times[8]


@pytest.fixture(scope="module")
def dsv3_h200() -> tuple[Any, Any, Device]:
    spec = load_spec(REPO / "specs" / "deepseek_v3.yaml")
    return spec, model_inputs(spec, None), get_device("h200")


def test_decode_uses_low_latency_kernels_and_prefill_the_normal_ones(
    dsv3_h200: tuple[Any, Any, Device],
) -> None:
    spec, inputs, device = dsv3_h200
    par = Parallel(tp=1, dp=8, ep=8)
    decode = simulate(inputs, spec, Deployment(par, 256, 1, 4096, True, kv_dtype="fp8"), device)
    prefill = simulate(inputs, spec, Deployment(par, 8, 1024, 0, False, kv_dtype="fp8"), device)
    for sim, source in ((decode, "deepep_ll:h200"), (prefill, "roofline")):
        rows = [k for k in sim.kernels if k.op.name.startswith("ep_")]
        assert rows and {k.source for k in rows} == {source}
        assert all(k.op.comm is not None and k.op.comm["low_latency"] is sim.deployment.decode for k in rows)
    # the same decode op priced without the device's low-latency section falls back to the roofline
    op = next(k.op for k in decode.kernels if k.op.name.startswith("ep_dispatch"))
    bare = Device(**{**device.__dict__, "ep_low_latency": None})
    assert price(op, bare).source == "roofline" and price(op, bare).time < price(op, device).time


def test_low_latency_efficiency_must_name_every_interconnect_level(tmp_path: Path) -> None:
    data = yaml.safe_load(
        (REPO / "kimi_adapter_core/backends/simulation/tables/devices/h200.yaml").read_text()
    )
    data["ep_low_latency"]["efficiency"]["combine"] = {"nvlink4": 0.5}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(KadaptError, match="must name each interconnect level"):
        load_device_file(path)


@pytest.mark.parametrize("name", MLA_SPECS)
def test_mla_decode_attention_is_non_decreasing_in_context(name: str) -> None:
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    inputs, device = model_inputs(spec, None), get_device("h200")
    contexts = (0, 1, 8, 16, 32, 64, 100, 128, 256, 512, 1000, 2048, 4096, 8192)
    for batch in (1, 8, 64):
        times: dict[str, list[float]] = {}  # one decode attention per traced layer kind
        for context in contexts:
            sim = simulate(inputs, spec, Deployment(Parallel(tp=8), batch, 1, context, True), device)
            for row in (k for k in sim.kernels if k.op.name == "mla_decode_attention"):
                times.setdefault(row.op.scope, []).append(row.time)
        assert times
        for scope, series in times.items():
            assert series == sorted(series), (
                f"{name} {scope} batch {batch}: {dict(zip(contexts, series, strict=True))}"
            )
