"""``kadapt simulate --sweep``: the Pareto front, the grid it searches, and prices equal to ``simulate``.

The sweep reprices thousands of configurations from a few traces per TP size; these tests hold it to
the direct path: every sampled configuration's kernels, step time and memory must be those
``simulate`` computes for it (MLA and GQA, dense and MoE, checkpoint and --quant modes, b = 1 and
larger, EP with and without all-to-all).
"""

from __future__ import annotations

import json
import random
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from fixtures.spec_files import REPO
from hypothesis import given
from hypothesis import strategies as st

from kimi_adapter_core.backends.simulation.estimate.cost import price
from kimi_adapter_core.backends.simulation.estimate.simulator import finish_step, simulate, trace_kernels
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.search.grid import Config, layouts, quant_modes, sweep_inputs
from kimi_adapter_core.backends.simulation.search.pareto import dominates, pareto_front
from kimi_adapter_core.backends.simulation.search.pareto_plot import PlotPoint, write_plot
from kimi_adapter_core.backends.simulation.search.sweep import Sweep
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.cli.sweep_options import run_sweep, sweep_options
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import Spec, load_spec

H200 = get_device("h200")
DECODE = Deployment(Parallel(), 1, 1, 4096, True)
PREFILL = Deployment(Parallel(), 1, 512, 0, False)


def spec_named(name: str) -> Spec:
    return load_spec(REPO / "specs" / f"{name}.yaml")


def sweep_of(name: str, devices: int, base: Deployment, batches: tuple[int, ...], **kw: Any) -> Sweep:
    spec = spec_named(name)
    return Sweep(spec, sweep_inputs(spec, quant_modes(spec)), H200, base, devices, batches=batches, **kw)


# --- the Pareto front -----------------------------------------------------------------------------------
def test_front_of_hand_made_points() -> None:
    points = [(1, 9), (2, 8), (2, 7), (3, 3), (1, 1), (4, 2), (4, 2), (0.5, 9)]
    assert pareto_front(points, lambda p: p) == [(4, 2), (4, 2), (3, 3), (2, 8), (1, 9)]


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=60))
def test_front_is_exactly_the_undominated_points(points: list[tuple[int, int]]) -> None:
    front = pareto_front(points, lambda p: p)
    rest = list(points)
    for p in front:
        rest.remove(p)
        assert not any(dominates(q, p) for q in points)  # no front point is dominated
    for p in rest:
        assert any(dominates(q, p) for q in front)  # every dropped point is dominated by the front


# --- the grid ---------------------------------------------------------------------------------------
def test_dense_model_never_gets_expert_parallelism() -> None:
    s = model_inputs(spec_named("llama"), None).arch.structure
    found = layouts(s, 8)
    assert {(p.tp, p.dp) for p in found} == {(1, 8), (2, 4), (4, 2), (8, 1)}
    assert all(p.ep == 1 for p in found)


def test_moe_layouts_are_exactly_the_valid_ones() -> None:
    s = model_inputs(spec_named("qwen3_moe"), None).arch.structure
    found = layouts(s, 16)
    assert any(p.ep > 1 for p in found)
    for p in found:
        assert p.tp * p.dp == 16 and 16 % p.ep == 0 and s.moe.num_experts % p.ep == 0
        p.check(s)  # every produced layout passes the checks simulate applies
    expected = {(tp, ep) for tp in (1, 2, 4, 8, 16) for ep in (1, 2, 4, 8, 16)}
    valid = set()
    for tp, ep in expected:
        try:
            Parallel(tp, 16 // tp, ep).check(s)
        except KadaptError:
            continue
        valid.add((tp, ep))
    assert {(p.tp, p.ep) for p in found} == valid


def test_layouts_skip_tp_that_does_not_divide_the_heads() -> None:
    s = model_inputs(spec_named("llama"), None).arch.structure  # 32 heads, 8 KV heads
    assert [(p.tp, p.dp) for p in layouts(s, 6)] == [(1, 6), (2, 3)]


def test_modes_are_the_checkpoint_plus_declared_ones() -> None:
    assert quant_modes(spec_named("kimi_k25")) == (None, "BF16", "W8A8", "W4A8", "W4A16")
    assert quant_modes(spec_named("kimi_k25"), "w4a8") == ("W4A8",)


def test_invalid_batches_are_skipped_not_priced() -> None:
    result = sweep_of("llama", 8, DECODE, (1, 4, 8)).run()
    priced = {(p.config.parallel.dp, p.config.batch) for p in result.points}
    assert all(batch % dp == 0 for dp, batch in priced)
    assert result.skipped == {"batch not divisible by DP": 8}  # dp 8: 1, 4; dp 4: 1; dp 2: 1; x 2 modes
    assert result.same_as == {"BF16": None}  # Llama's BF16 mode stores the weights as its checkpoint


# --- prices equal simulate's -----------------------------------------------------------------------------
def kernel_table(sim: Any) -> tuple[list[tuple[Any, ...]], list[float]]:
    """(what each kernel is, exactly; its flops, bytes and time, flat for pytest.approx)."""
    labels = [
        (k.op.name, k.op.module, k.op.scope, k.op.repeat, k.op.kind, k.op.compute)
        + (k.op.comm and tuple(sorted(k.op.comm.items())), k.bound)
        for k in sim.kernels
    ]
    return labels, [float(x) for k in sim.kernels for x in (k.op.flops, k.op.bytes, k.time)]


def assert_same_as_simulate(sweep: Sweep, configs: list[Config]) -> None:
    for config in configs:
        dep = sweep.deployment(config.parallel, config.batch)
        direct = simulate(sweep.inputs[config.quant], sweep.spec, dep, H200)
        mine = sweep.simulation(config)
        (mine_labels, mine_numbers), (labels, numbers) = kernel_table(mine), kernel_table(direct)
        assert mine_labels == labels, config
        assert mine_numbers == pytest.approx(numbers, rel=1e-9), config
        assert mine.step_time == pytest.approx(direct.step_time, rel=1e-12), config
        assert mine.memory == direct.memory, config
        point = sweep.evaluate(config)
        assert point.step_time == pytest.approx(direct.step_time, rel=1e-12)
        assert point.tokens_per_s_per_device == pytest.approx(direct.tokens_per_s_per_device, rel=1e-12)


def sampled(result_points: list[Any], n: int, seed: int) -> list[Config]:
    configs = [p.config for p in result_points]
    ones = [c for c in configs if c.batch == c.parallel.dp]  # one query per rank: its own family
    return random.Random(seed).sample(configs, n) + random.Random(seed).sample(ones, 2)


@pytest.mark.parametrize(
    ("name", "devices", "base", "batches"),
    [
        ("qwen3_moe", 8, DECODE, (1, 8, 16, 48, 256)),  # GQA + MoE, EP above and below TP
        ("qwen3_moe", 4, PREFILL, (1, 4, 12)),
        ("llama", 8, DECODE, (8, 24, 256)),  # dense GQA
        ("deepseek_v3", 16, Deployment(Parallel(), 1, 1, 2048, True, mtp=1), (16, 32, 128)),  # MLA, fp8, MTP
        # an aggregated worker's mixed-step rows: thousands of one-token prefill-path queries per rank
        ("deepseek_v3", 8, Deployment(Parallel(), 1, 1, 0, False), (8, 4096, 8 * 4100)),
    ],
)
def test_sweep_prices_equal_simulate(
    name: str, devices: int, base: Deployment, batches: tuple[int, ...]
) -> None:
    sweep = sweep_of(name, devices, base, batches)
    result = sweep.run()
    assert not result.fallbacks, result.fallbacks  # every family was scaled, none traced per config
    assert_same_as_simulate(sweep, sampled(result.points, 5, seed=len(name) + devices))


def test_kimi_int4_checkpoint_and_modes_equal_simulate() -> None:
    sweep = sweep_of("kimi_k25", 16, DECODE, (16, 64))
    configs = [
        Config(Parallel(8, 2, 16), 64, None),  # int4 experts as shipped
        Config(Parallel(8, 2, 16), 64, "W4A8"),
        Config(Parallel(4, 4, 4), 16, "BF16"),
        Config(Parallel(4, 4, 16), 64, "W8A8"),
    ]
    assert_same_as_simulate(sweep, configs)
    # four weight modes at two TP sizes: one per-rank model per TP size, traced at b = 2, 3 and the
    # largest b (16 / DP4 = 4 per rank at TP4), shared by every mode
    assert sweep.traces <= 3 + 3 and sorted(sweep.rank_models) == [4, 8]


def test_a_pricing_callable_replaces_the_default() -> None:
    def slow_matmuls(op: Any, device: Any) -> Any:
        priced = price(op, device)
        return type(priced)(priced.op, priced.time * (3 if op.kind == "matmul" else 1), priced.bound)

    sweep = sweep_of("llama", 4, DECODE, (4, 32), pricer=slow_matmuls)
    config = Config(Parallel(2, 2, 1), 32, None)
    dep = sweep.deployment(config.parallel, config.batch)
    ops, _ = trace_kernels(sweep.spec, sweep.inputs[None], dep)
    expected = sum(k.total for k in finish_step([slow_matmuls(op, H200) for op in ops], dep))
    default = sweep_of("llama", 4, DECODE, (4, 32)).evaluate(config).step_time
    assert sweep.evaluate(config).step_time == pytest.approx(expected, rel=1e-12)
    assert expected > default


# --- memory ---------------------------------------------------------------------------------------------
def test_configurations_that_do_not_fit_are_dropped() -> None:
    result = sweep_of("qwen3_moe", 4, DECODE, (4, 64, 1024)).run()  # 235B parameters on 4 x 141 GB
    assert result.dropped and result.fitting
    for p in result.points:
        assert p.fits == (p.memory.used <= H200.memory_bytes)
    assert all(p.fits for p in result.front)
    assert {p.config.quant for p in result.dropped} >= {None}  # bf16 (470 GB) never fits on 4 devices


def test_a_model_too_big_for_the_devices_has_no_front() -> None:
    spec = spec_named("deepseek_v3")  # 671B parameters, fp8: ~680 GB on 4 x 141 GB
    text = run_sweep(spec, model_inputs(spec, None), H200, DECODE, devices=4, batches=(4,))
    result = sweep_of("deepseek_v3", 4, DECODE, (4,)).run()
    assert result.points and not result.fitting and result.front == []
    assert "no configuration fits in memory" in text


# --- plot -------------------------------------------------------------------------------------------------
def plot_points() -> list[PlotPoint]:
    raw = [(10.0, 2000.0, "BF16", True), (50.0, 900.0, "W8A8", True), (20.0, 500.0, "BF16", False)]
    return [PlotPoint(x, y, s, f"TP{i} <&>", f) for i, (x, y, s, f) in enumerate(raw)]


@pytest.mark.parametrize("suffix", [".svg", ".html"])
def test_plot_is_self_contained_and_well_formed(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"front{suffix}"
    write_plot(path, plot_points(), "kimi <sweep>")
    text = path.read_text()
    svg = text[text.index("<svg") : text.index("</svg>") + 6]
    root = ET.fromstring(svg)  # parses: escaped labels, closed tags
    ns = "{http://www.w3.org/2000/svg}"
    circles = root.findall(f"{ns}circle")
    data = [c for c in circles if c.find(f"{ns}title") is not None]
    assert len(data) == 3
    assert sorted(c.find(f"{ns}title").text for c in data) == ["TP0 <&>", "TP1 <&>", "TP2 <&>"]
    assert len(root.findall(f"{ns}polyline")) == 1  # the front, through the two front points
    for banned in ("<script", "href=", "src=", "@import", "url("):
        assert banned not in text
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # atomic: no temp file left


def test_png_plot_needs_matplotlib(tmp_path: Path) -> None:
    path = tmp_path / "front.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(KadaptError, match="needs matplotlib"):
            write_plot(path, plot_points(), "t")
        assert not path.exists()
        return
    write_plot(path, plot_points(), "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- command line ----------------------------------------------------------------------------------
@click.command()
@click.argument("name")
@click.option("--format", "fmt", default="text")
@sweep_options
def tiny(name: str, fmt: str, sweep: bool, devices: int | None, batches: Any, plot: Path | None) -> None:
    """What ``kadapt simulate`` does with the options (until it is wired in)."""
    assert sweep
    spec = spec_named(name)
    click.echo(
        run_sweep(
            spec,
            model_inputs(spec, None),
            H200,
            DECODE,
            devices=devices or 1,
            batches=batches,
            plot=plot,
            fmt=fmt,
        )
    )


def test_cli_json_and_plot(tmp_path: Path) -> None:
    plot = tmp_path / "p.html"
    args = [
        "llama",
        "--sweep",
        "--devices",
        "8",
        "--batches",
        "8,64",
        "--format",
        "json",
        "--plot",
        str(plot),
    ]
    result = CliRunner().invoke(tiny, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["devices"] == 8 and doc["batches"] == [8, 64] and doc["plot"] == str(plot)
    assert doc["configurations"] == 4 * 2 * 2 and doc["priced"] + sum(doc["skipped"].values()) == 16
    front = doc["front"]
    assert front and all(p["tp"] * p["dp"] == 8 and p["ep"] == 1 for p in front)
    users = [p["tokens_per_s_per_user"] for p in front]
    devices = [p["tokens_per_s_per_device"] for p in front]
    assert users == sorted(users, reverse=True) and devices == sorted(devices)  # a real trade-off
    assert "<svg" in plot.read_text()


def test_cli_text_lists_the_front_with_layouts() -> None:
    result = CliRunner().invoke(tiny, ["llama", "--sweep", "--devices", "4", "--batches", "4,32"])
    assert result.exit_code == 0, result.output
    assert (
        "Pareto front" in result.output
        and "TP" in result.output
        and "configurations: 12 = 3 layouts" in result.output
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batches", "1,x"], "comma-separated"),
        (["--batches", "0"], ">= 1"),
        (["--plot", "p.jpg"], "suffix"),
    ],
)
def test_cli_usage_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(tiny, ["llama", "--sweep", "--devices", "2", *args])
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output


def test_kadapt_simulate_sweep_is_wired(tmp_path: Path) -> None:
    from kimi_adapter_core.cli import cli

    args = ["simulate", "llama", "--device", "h200", "--decode", "--context-len", "4096"]
    plot = tmp_path / "front.html"
    sweep = ["--sweep", "--devices", "8", "--batches", "8,64", "--plot", str(plot), "--format", "json"]
    result = CliRunner().invoke(cli, [*args, *sweep])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["front"] and plot.read_text().lstrip().startswith("<")
    stray = CliRunner().invoke(cli, [*args, "--plot", str(tmp_path / "x.html")])
    assert stray.exit_code == 2 and "apply to --sweep" in stray.output
