"""``kadapt simulate --sweep``: the Pareto front, the grid it searches, and prices equal to ``simulate``.

The sweep reprices thousands of configurations from a few traces per TP size; these tests hold it to
the direct path: every sampled configuration's kernels, step time and memory must be those
``simulate`` computes for it (MLA and GQA, dense and MoE, checkpoint and --quant modes, b = 1 and
larger, EP with and without all-to-all).
"""

from __future__ import annotations

import json
import random
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from fixtures.spec_files import REPO
from hypothesis import given
from hypothesis import strategies as st

from kimi_adapter_core.backends.simulation.estimate import aiconfigurator
from kimi_adapter_core.backends.simulation.estimate.cost import price
from kimi_adapter_core.backends.simulation.estimate.simulator import finish_step, simulate, trace_kernels
from kimi_adapter_core.backends.simulation.estimate.topology import topology_notes
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.search.grid import Config, layouts, quant_modes, sweep_inputs
from kimi_adapter_core.backends.simulation.search.pareto import dominates, pareto_front
from kimi_adapter_core.backends.simulation.search.pareto_plot import PlotPoint, write_plot
from kimi_adapter_core.backends.simulation.search.sweep import Sweep
from kimi_adapter_core.backends.simulation.search.weight_labels import shipped_label
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.cli.sweep_options import run_sweep, sweep_options
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import Spec, load_spec

H200 = get_device("h200")
SVG = "{http://www.w3.org/2000/svg}"
DECODE = Deployment(Parallel(), 1, 1, 4096, True)
PREFILL = Deployment(Parallel(), 1, 512, 0, False)


def spec_named(name: str) -> Spec:
    return load_spec(REPO / "specs" / f"{name}.yaml")


def sweep_of(name: str, devices: int, base: Deployment, batches: tuple[int, ...], **kw: Any) -> Sweep:
    spec = spec_named(name)
    modes = quant_modes(spec, "all")
    return Sweep(spec, sweep_inputs(spec, modes), H200, base, devices, batches=batches, **kw)


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


def test_modes_are_the_checkpoint_unless_quant_asks_for_others() -> None:
    kimi = spec_named("kimi_k25")
    assert quant_modes(kimi) == (None,)  # the checkpoint as shipped: no mode chosen for the user
    assert quant_modes(kimi, "all") == (None, "BF16", "W8A8", "W4A8", "W4A16")
    assert quant_modes(kimi, "w4a8") == ("W4A8",)
    assert quant_modes(kimi, "W8A8, checkpoint") == (None, "W8A8")  # the checkpoint first, named or not
    with pytest.raises(KadaptError, match="names no weight mode"):
        quant_modes(kimi, " , ")


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
    text = run_sweep(spec, H200, DECODE, devices=4, batches=(4,))
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


def test_a_png_plot_without_matplotlib_is_refused_before_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was refused by ``write_plot``, after every configuration had been priced."""
    import importlib.util

    from kimi_adapter_core.backends.simulation.search import sweep as sweep_module

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else found(n, *a)
    )

    def never(self: object) -> None:
        raise AssertionError("the sweep ran before the plot was refused")

    monkeypatch.setattr(sweep_module.Sweep, "run", never)
    result = CliRunner().invoke(
        tiny, ["llama", "--sweep", "--devices", "2", "--plot", str(tmp_path / "f.png")]
    )
    assert result.exit_code == 1 and "needs matplotlib" in str(result.exception or result.output), result


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
    # 4 layouts x the checkpoint alone (the default) x 2 batches
    assert doc["configurations"] == 4 * 1 * 2 and doc["priced"] + sum(doc["skipped"].values()) == 8
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
        and "configurations: 6 = 3 layouts x 1 weight modes (checkpoint)" in result.output
    )


def test_cli_text_says_when_nothing_was_priced() -> None:
    """Three devices serve Llama only as DP3 and no default batch splits over 3: every configuration
    is skipped, which the report blamed on memory ("no configuration fits in memory")."""
    result = CliRunner().invoke(tiny, ["llama", "--sweep", "--devices", "3"])
    assert result.exit_code == 0, result.output
    assert "batch not divisible by DP" in result.output
    assert "no configuration was priced: no Pareto front" in result.output
    assert "fits in memory" not in result.output


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


# --- no silent choices: each row's weights and KV cache, the topology it assumes ---------------------------
def simulate_cli(*args: str) -> str:
    from kimi_adapter_core.cli import cli

    result = CliRunner().invoke(cli, ["simulate", *args])
    assert result.exit_code == 0, result.output
    return result.output


DEEPSEEK_16 = ["deepseek_v3", "--device", "h200", "--decode", "--context-len", "4096", "--kv-dtype", "fp8"]
DEEPSEEK_16 += ["--sweep", "--devices", "16", "--batches", "256,1024"]


def test_the_sweep_prices_the_checkpoint_as_shipped_unless_quant_asks() -> None:
    shipped = json.loads(simulate_cli(*DEEPSEEK_16, "--format", "json"))
    assert shipped["quantizations"] == ["checkpoint"] and shipped["shipped_weights"] == "fp8/b128x128"
    assert shipped["declared_quantizations"] == ["W8A8", "BF16"]
    for row in shipped["front"]:
        assert row["weights"] == "fp8/b128x128 (shipped)" and row["weights_as_shipped"]
        assert row["kv_dtype"] == "fp8" and row["quantization"] == "checkpoint"
    every = json.loads(simulate_cli(*DEEPSEEK_16, "--quant", "all", "--format", "json"))
    assert every["quantizations"] == ["checkpoint", "W8A8", "BF16"]
    chosen = [row for row in every["front"] if row["quantization"] == "W8A8"]
    assert chosen, "W8A8 is on the front here: the default must not have picked it silently"
    for row in chosen:
        assert row["weights"] == "W8A8" and row["weight_format"] == "int8 (W8A8)"
        assert row["shipped_weights"] == "fp8/b128x128" and not row["weights_as_shipped"]
    best = max(r["tokens_per_s_per_device"] for r in chosen)
    assert best > max(r["tokens_per_s_per_device"] for r in shipped["front"])  # what the default gives up


def test_text_rows_name_weights_shipped_format_and_kv_cache(tmp_path: Path) -> None:
    default = simulate_cli(*DEEPSEEK_16)
    assert "weights: the checkpoint as shipped (fp8/b128x128); --quant all also prices" in default
    header = next(line for line in default.splitlines() if "tok/s/user" in line)
    assert "weights" in header and "KV" in header and "shipped" not in header.replace("(shipped)", "")
    plot = tmp_path / "front.svg"
    text = simulate_cli(*DEEPSEEK_16, "--quant", "W8A8,checkpoint", "--plot", str(plot))
    lines = text.splitlines()
    header = next(line for line in lines if "tok/s/user" in line)
    assert header.split()[6:9] == ["weights", "shipped", "KV"]
    rows = [line.split() for line in lines[lines.index(header) + 1 :] if line[:4] == "    "]
    assert rows and all(re.fullmatch(r"TP\d+ DP\d+ EP\d+", " ".join(row[4:7])) for row in rows)
    assert {tuple(row[7:10]) for row in rows} <= {
        ("W8A8", "fp8/b128x128", "fp8"),
        ("fp8/b128x128", "(shipped)", "fp8/b128x128"),
    }
    assert any(row[7] == "W8A8" for row in rows)
    for row in rows:  # a TP or EP group of 16 spans two 8-GPU NVLink domains of the H200 profile: noted
        assert (row[-1] == "T1") == (max(int(row[4][2:]), int(row[6][2:])) > 8)
    svg = plot.read_text()
    titles = [t.text or "" for t in ET.fromstring(svg[svg.index("<svg") :]).iter(f"{SVG}title")]
    assert any("weights W8A8, KV fp8" in t for t in titles)
    assert any("weights fp8/b128x128 (shipped), KV fp8" in t for t in titles)


def test_a_group_larger_than_the_measured_node_is_noted() -> None:
    gb200 = get_device("gb200")
    notes, marks = topology_notes(gb200, "trtllm", [("a", Parallel(8, 2, 8)), ("b", Parallel(4, 4, 4))])
    assert [(n.id, n.devices, n.layouts) for n in notes] == [("T1", 8, ("a",))] and marks == {
        "a": ("T1",),
        "b": (),
    }
    assert "nvlink5_nvl72 domain (72 devices" in notes[0].text and "4 GPUs per node" in notes[0].text
    assert topology_notes(H200, "trtllm", [("a", Parallel(8, 2, 8))])[0] == []  # node = domain = 8
    spanning, _ = topology_notes(H200, "trtllm", [("c", Parallel(1, 16, 16))])
    assert "spans 2 nvlink4 domains of 8" in spanning[0].text and "infiniband_ndr" in spanning[0].text


def test_gb200_sweep_notes_what_it_assumed() -> None:
    args = ["llama", "--device", "gb200", "--decode", "--context-len", "4096", "--sweep", "--devices", "8"]
    doc = json.loads(simulate_cli(*args, "--batches", "1,64", "--format", "json"))
    (note,) = doc["topology_notes"]
    assert note["id"] == "T1" and note["devices"] == 8 and "4 GPUs per node" in note["note"]
    assert any(row["tp"] == 8 for row in doc["front"])
    for row in doc["front"]:
        assert row["topology_notes"] == (["T1"] if row["tp"] == 8 else [])
    text = simulate_cli(*args, "--batches", "1,64")
    assert "T1 (TP8 DP1 EP1): a TP or EP group of 8 devices is priced inside one nvlink5_nvl72" in text


def test_measured_node_sizes_are_aiconfigurators() -> None:
    if not aiconfigurator.available():
        pytest.skip("needs aiconfigurator-core")
    for system, gpus in aiconfigurator.GPUS_PER_NODE.items():
        assert [aiconfigurator._gpus_per_node(system, fw) for fw in aiconfigurator.FRAMEWORKS] == [gpus] * 3


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("deepseek_v3", "fp8/b128x128"),
        ("kimi_k25", "int4/g32 routed_experts, bf16 other linear"),
        ("gpt_oss", "mxfp4 routed_experts, bf16 other linear"),
        ("llama", "bf16"),
    ],
)
def test_shipped_label_is_what_the_config_stores(name: str, label: str) -> None:
    spec = spec_named(name)
    assert shipped_label(model_inputs(spec, None)) == label
    assert shipped_label(model_inputs(spec, "W8A8")) == "int8 (W8A8)"


def test_a_list_of_modes_applies_to_the_sweep_only() -> None:
    from kimi_adapter_core.cli import cli

    result = CliRunner().invoke(cli, ["simulate", "llama", "--device", "h200", "--quant", "all"])
    assert result.exit_code == 2 and "a list of modes or 'all' applies to --sweep" in result.output
    undeclared = CliRunner().invoke(
        cli, ["simulate", "llama", "--device", "h200", "--sweep", "--quant", "w4a8"]
    )
    assert undeclared.exit_code == 2 and "not declared by this spec" in undeclared.output
    for listed in ("all", "BF16,W8A8"):  # plan sizes one mode: the list is the sweep's, not undeclared
        plan = CliRunner().invoke(cli, ["plan", "qwen3_moe", "--quant", listed])
        assert plan.exit_code == 2 and "a list of modes or 'all' applies to simulate --sweep" in plan.output


def test_simulate_notes_its_layouts_topology_and_names_the_kv_dtype() -> None:
    args = [
        "llama",
        "--tp",
        "8",
        "--decode",
        "--context-len",
        "1024",
        "--kv-dtype",
        "fp8",
        "--format",
        "json",
    ]
    gb200 = json.loads(simulate_cli(*args, "--device", "gb200"))
    (note,) = [w for w in gb200["warnings"] if w.startswith("topology (TP8): ")]
    assert "nvlink5_nvl72" in note and "4 GPUs per node" in note and gb200["kv_dtype"] == "fp8"
    h200 = json.loads(simulate_cli(*args, "--device", "h200"))
    assert not [w for w in h200["warnings"] if w.startswith("topology")]  # an 8-GPU node, measured on 8
