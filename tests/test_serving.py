"""``kadapt simulate --sweep --isl --osl``: the request-level search
(``backends/simulation/search/serving.py``).

What must hold: a framework never gets a layout it cannot launch (TensorRT-LLM's attention DP is
all-or-nothing, vLLM's expert parallelism too); the SLA excludes what misses it, from the picks and
the front; disaggregated pools are the best (x, y) within the devices and meet both targets; the
steps a request is priced from are ``simulate``'s; an aggregated worker's mixed steps (chunked
prefill) behave as the frameworks' do (a larger chunk: a slower TPOT, a faster TTFT; a prompt longer
than the chunk takes ceil(ISL / chunk) steps; never faster than decoding alone); the plot shows the
SLA, the front's layouts and ticks fitted to the data.
"""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.simulation.estimate.planner import Memory, kv_sizing
from kimi_adapter_core.backends.simulation.estimate.simulator import simulate
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.search.grid import (
    Config,
    Point,
    layouts,
    quant_modes,
    sweep_inputs,
)
from kimi_adapter_core.backends.simulation.search.launch_rules import StepTokens, framework, frameworks
from kimi_adapter_core.backends.simulation.search.pareto_plot import PlotPoint, SlaLine, _LogAxis, write_plot
from kimi_adapter_core.backends.simulation.search.request_pricing import (
    Workload,
    aggregated,
    mixed_step,
    moe_group_kernel,
    prompt_attention,
    rows_and_requests,
)
from kimi_adapter_core.backends.simulation.search.serving import ServingResult, ServingSearch
from kimi_adapter_core.backends.simulation.search.sweep import Sweep
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.cli import cli
from kimi_adapter_core.cli.simulate import command as simulate_command
from kimi_adapter_core.errors import UsageError
from kimi_adapter_core.spec import load_spec

H200 = get_device("h200")
BASE = Deployment(Parallel(), 1, 1, 0, True)
LLAMA = load_spec(REPO / "specs" / "llama.yaml")
WORKLOAD = Workload(512, 64)


def search(workload: Workload, framework_name: str = "trtllm", devices: int = 4) -> ServingResult:
    """Llama-3.1-8B on ``devices`` H200: every TP x DP layout fits, so the framework alone prunes."""
    inputs = sweep_inputs(LLAMA, quant_modes(LLAMA, "bf16"))
    return ServingSearch(
        LLAMA, inputs, H200, BASE, devices, workload, framework_name, batches=(1, 2, 4, 8, 16, 64)
    ).run()


@pytest.fixture(scope="module")
def free() -> ServingResult:
    """The search without SLA targets: every deployment that fits is feasible."""
    return search(WORKLOAD)


# --- framework feasibility ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "tp", "dp", "ep", "refused"),
    [
        ("trtllm", 4, 2, 8, "attention-dp-all-or-nothing"),  # attention TP and DP mixed
        ("trtllm", 2, 4, 1, "attention-dp-all-or-nothing"),
        ("trtllm", 8, 1, 8, None),
        ("trtllm", 1, 8, 8, None),
        ("trtllm", 1, 8, 4, None),
        ("vllm", 1, 8, 4, "expert-parallel-all-or-nothing"),  # experts split over part of the devices
        ("vllm", 4, 2, 8, None),
        ("vllm", 8, 1, 1, None),
        ("sglang", 4, 2, 4, None),
    ],
)
def test_framework_rules(name: str, tp: int, dp: int, ep: int, refused: str | None) -> None:
    rule = framework(name).refusal(Parallel(tp, dp, ep))
    assert (rule.id if rule else None) == refused


def test_every_framework_simulate_offers_has_rules_with_sources() -> None:
    choices = next(p for p in simulate_command.params if p.name == "framework").type.choices
    assert set(frameworks()) == set(choices)
    for name in frameworks():
        for rule in framework(name).rules:
            assert rule.source and rule.why and rule.when
    with pytest.raises(UsageError, match="unknown serving framework"):
        framework("tgi")


def test_trtllm_never_gets_partial_attention_dp(free: ServingResult) -> None:
    priced = {c.decode.config.parallel for c in free.candidates} | {
        c.prefill.config.parallel for c in free.candidates
    }
    assert priced and all(p.tp == 1 or p.dp == 1 for p in priced)
    assert free.refused == {"attention-dp-all-or-nothing": 1}  # TP2 DP2 on a 4-device worker
    s = model_inputs(LLAMA, None).arch.structure
    assert any(p.tp > 1 and p.dp > 1 for p in layouts(s, 4))  # the model itself would take it
    sglang = search(WORKLOAD, "sglang")
    assert any(c.decode.config.parallel == Parallel(2, 2, 1) for c in sglang.candidates)


# --- the SLA -----------------------------------------------------------------------------------------
def test_ttft_and_tpot_targets_exclude_what_misses_them(free: ServingResult) -> None:
    agg = [c for c in free.candidates if c.mode == "agg"]
    ttfts = sorted(c.ttft for c in agg)
    tpots = sorted(c.tpot for c in agg)
    ttft, tpot = ttfts[len(ttfts) // 2], tpots[len(tpots) // 2]  # half of them miss each
    bound = search(Workload(WORKLOAD.isl, WORKLOAD.osl, ttft, tpot))
    for c in bound.candidates:
        assert c.meets_sla == (c.ttft <= ttft and c.tpot <= tpot)
    missed = [c for c in bound.candidates if c.mode == "agg" and c.ttft > ttft]
    assert missed and not any(c in bound.feasible for c in missed)
    assert all(c.ttft <= ttft and c.tpot <= tpot for c in bound.front)
    best = bound.best("agg")
    assert best is not None and best.ttft <= ttft and best.tpot <= tpot
    unconstrained = free.best("agg")
    assert unconstrained is not None and unconstrained.tokens_per_s_per_device >= best.tokens_per_s_per_device
    if unconstrained.tpot > tpot or unconstrained.ttft > ttft:
        assert best.layout != unconstrained.layout


def test_disaggregated_pools_are_the_best_split_and_meet_both_targets(free: ServingResult) -> None:
    disagg = [c for c in free.candidates if c.mode == "disagg"]
    ttft = sorted(c.prefill.step_time for c in disagg)[len(disagg) // 2]
    tpot = sorted(c.tpot for c in disagg)[len(disagg) // 2]
    bound = search(Workload(WORKLOAD.isl, WORKLOAD.osl, ttft, tpot))
    pools = [c for c in bound.feasible if c.mode == "disagg"]
    assert pools
    for c in pools:
        assert c.ttft <= ttft and c.tpot <= tpot and c.prefill_workers >= 1 and c.decode_workers >= 1
        assert c.devices <= bound.devices
        nd, np_ = c.decode.config.parallel.devices, c.prefill.config.parallel.devices
        decode_rate = c.decode.config.batch / ((WORKLOAD.osl - 1) * c.decode.step_time)
        prefill_rate = c.prefill.config.batch / c.prefill.step_time
        splits = [
            min(x * prefill_rate, y * decode_rate) * WORKLOAD.osl / (x * np_ + y * nd)
            for x in range(1, bound.devices + 1)
            for y in range(1, bound.devices + 1)
            if x * np_ + y * nd <= bound.devices
        ]
        assert c.tokens_per_s_per_device == pytest.approx(max(splits), rel=1e-12)
    # every prefill option slower than the TTFT target was left out, however fast it starts requests
    assert all(c.prefill.step_time <= ttft for c in bound.candidates if c.mode == "disagg")


def test_no_disaggregation_without_room_for_two_workers() -> None:
    result = search(WORKLOAD, devices=1)
    assert [c.mode for c in result.candidates] and {c.mode for c in result.candidates} == {"agg"}
    assert result.best("disagg") is None


# --- the steps are simulate's --------------------------------------------------------------------------
def test_request_steps_are_simulates_steps(free: ServingResult) -> None:
    c = next(c for c in free.candidates if c.mode == "agg" and c.decode.config.batch == 16)
    par, b = c.decode.config.parallel, c.decode.config.batch
    inputs = model_inputs(LLAMA, "bf16")
    decode = Deployment(par, b, 1, WORKLOAD.isl + WORKLOAD.osl // 2, True)
    prefill = Deployment(par, par.dp, WORKLOAD.isl, 0, False)
    assert c.decode.step_time == pytest.approx(simulate(inputs, LLAMA, decode, H200).step_time, rel=1e-12)
    assert c.prefill.step_time == pytest.approx(simulate(inputs, LLAMA, prefill, H200).step_time, rel=1e-12)
    # the KV cache holds a whole request; decode is priced at its mean context
    kv = kv_sizing(model_inputs(LLAMA, None).arch.structure, par.tp, "bf16")
    per_group = b // par.dp
    assert c.memory.kv_cache == per_group * kv.sequence_bytes(WORKLOAD.isl + WORKLOAD.osl)
    # aggregated: other requests' prompt chunks slow a request's decode steps
    assert c.tpot > c.decode.step_time


# --- aggregated: chunked prefill ------------------------------------------------------------------
def test_step_budgets_leave_room_for_the_decode_rows_when_they_count() -> None:
    counted, apart = StepTokens(2048, True, "s"), StepTokens(2048, False, "s")
    tried = counted.budgets(None, 1)
    assert tried == (512, 1024, 2048)  # the sweep's budgets up to the cap
    assert counted.chunks(16, 10**6, tried) == [496, 1008, 2032]  # less 16 decode rows
    assert apart.chunks(16, 10**6, tried) == [512, 1024, 2048]
    assert counted.chunks(600, 10**6, tried) == [424, 1448]  # 600 rows fill the 512 budget: no prompt fits
    assert counted.chunks(16, 700, tried) == [496, 700]  # never more prompt tokens than a cycle brings
    assert all(framework(name).step_tokens.max >= 512 for name in frameworks())


def _agg_by_worker(result: ServingResult) -> dict[tuple[Any, ...], list[Any]]:
    """Aggregated candidates grouped by layout, batch and weight mode, by chunk."""
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for c in result.candidates:
        if c.mode == "agg":
            groups.setdefault((c.decode.config, c.decode_workers), []).append(c)
    return {k: sorted(v, key=lambda c: c.chunk) for k, v in groups.items()}


def test_a_larger_chunk_slows_the_mixed_step_and_speeds_ttft(free: ServingResult) -> None:
    """A larger chunk makes every mixed step longer (the decode batch waits longer between two tokens)
    and a prompt's first token sooner. The mean TPOT need not grow: larger chunks price their prompt
    tokens in larger, more efficient GEMMs, so it lies between the decode and the mixed step only."""
    groups = [g for g in _agg_by_worker(free).values() if len(g) > 1]
    assert groups
    for group in groups:
        mixed = [c.mixed_step_time for c in group]
        assert mixed == sorted(mixed) and len(set(mixed)) == len(mixed), [
            (c.chunk, c.mixed_step_time) for c in group
        ]
        whole = [c for c in group if c.chunk <= WORKLOAD.isl]  # a prompt's own steps
        ttfts = [c.ttft for c in whole]
        assert ttfts == sorted(ttfts, reverse=True), [(c.chunk, c.ttft) for c in whole]
        assert all(c.decode.step_time <= c.tpot <= c.mixed_step_time for c in group)


def test_aggregated_throughput_never_beats_decoding_alone(free: ServingResult) -> None:
    agg = [c for c in free.candidates if c.mode == "agg"]
    assert agg
    for c in agg:
        steps = WORKLOAD.osl - 1  # no MTP
        bound = c.decode_workers * c.decode.config.batch / (steps * c.decode.step_time)
        assert c.requests_per_s < bound
        # no other request's chunks: one request in all (attention-DP groups step in lockstep, so a
        # request alone in its group still waits for the other groups' chunks)
        alone = c.decode.config.batch == 1
        assert c.tpot == c.decode.step_time if alone else c.tpot > c.decode.step_time


def _point(par: Parallel, batch: int, step: float) -> Point:
    return Point(Config(par, batch, None), step, 0.0, 0.0, Memory(1.0, 0.0, 0.0, None))


def test_a_prompt_longer_than_the_chunk_takes_ceil_isl_over_chunk_steps() -> None:
    """Two DP groups in lockstep: each group's chunks stall both groups, each in a pass of its own
    (``t_one``: one group's chunk on the experts) while the cycle has steps enough; a prefill-bound
    cycle puts both groups' chunks in every step (``t_mix``)."""
    par, w = Parallel(1, 2, 1), Workload(1000, 101)
    decode, prefill = _point(par, 8, 0.01), _point(par, 2, 0.05)
    mem = decode.memory
    for chunk, steps in ((300, 4), (500, 2), (1000, 1)):
        c = aggregated(decode, prefill, 0.03, chunk, mem, w, 1.0, 4, t_one=0.02)
        mixed = 2 * 4 * 1000 / chunk  # both groups' chunks: 4 requests per DP group
        cycle = mixed * 0.02 + (100 - mixed) * 0.01
        assert c.ttft == pytest.approx(steps * 0.02 + cycle / 100 / 2, rel=1e-12)
        seen = mixed - 1000 / chunk  # every chunk but the request's own
        assert c.tpot == pytest.approx((seen * 0.02 + (100 - seen) * 0.01) / 100, rel=1e-12)
        assert c.requests_per_s == pytest.approx(2 * 8 / cycle, rel=1e-12)  # 2 replicas of 2 devices
    # prefill-bound: more chunks than steps, both groups' chunks in every step
    c = aggregated(decode, prefill, 0.03, 10, mem, w, 1.0, 2, t_one=0.02)
    assert c.tpot == pytest.approx(0.03) and c.requests_per_s == pytest.approx(8 / (400 * 0.03))
    # each request lives one cycle of 400 mixed steps, 100 of them decoding: its first token comes
    # after the other 300 (ceil(1000 / 10) = 100 steps alone had TTFT + TPOT x 100 at 6 s, not 12 s)
    assert c.ttft == pytest.approx(300 * 0.03 + 0.03 / 2, rel=1e-12)
    in_flight = 8 / c.requests_per_s  # Little: one cycle, for 8 requests
    assert c.ttft + 100 * c.tpot == pytest.approx(in_flight + 0.03 / 2, rel=1e-12)
    # one group: its own chunks only, and a pass with one group's chunk is the mixed step
    one = Parallel(1, 1, 1)
    alone = aggregated(_point(one, 4, 0.01), _point(one, 1, 0.05), 0.03, 300, mem, w, 1.0, 1, t_one=0.02)
    m = 4 * 1000 / 300
    seen = m - 1000 / 300
    assert alone.tpot == pytest.approx((seen * 0.03 + (100 - seen) * 0.01) / 100, rel=1e-12)


def test_a_mixed_steps_rows_are_the_prefill_steps() -> None:
    """The rows sweep (one-token prefill-path queries) prices a whole prompt's rows as the prefill
    step does: a mixed step's rows are what a prefill of as many tokens runs."""
    inputs = sweep_inputs(LLAMA, quant_modes(LLAMA, "bf16"))
    par, isl = Parallel(2, 1, 1), WORKLOAD.isl
    prefill_base = Deployment(Parallel(), 1, isl, 0, False)
    rows_base = Deployment(Parallel(), 1, 1, 0, False)
    prefill = Sweep(LLAMA, inputs, H200, prefill_base, 2, batches=(1,))
    rows = Sweep(LLAMA, inputs, H200, rows_base, 2, batches=(isl,))
    p, r = Config(par, 1, "BF16"), Config(par, isl, "BF16")
    prefill.run([p])
    rows.run([r])
    whole = prefill.kernels(p)
    assert rows_and_requests(rows.kernels(r))[0] == pytest.approx(rows_and_requests(whole)[0], rel=1e-3)
    assert 0 < prompt_attention(whole) < sum(k.total for k in whole)


def test_a_folded_modules_floor_is_row_work() -> None:
    """vLLM's MLA decode kernel carries its whole measured module, projections included
    (``cost.fold_modules``). A mixed step takes its rows (projections too) from the rows step, so the
    decode step's per-request part must keep only the attention: the floor goes to the rows."""
    loaded = load_spec(REPO / "specs" / "deepseek_v3.yaml")
    dep = Deployment(Parallel(8, 1, 8), 128, 1, 4096, True, kv_dtype="bf16")
    kernels = simulate(model_inputs(loaded, None), loaded, dep, get_device("h200"), framework="vllm").kernels
    folded = [k for k in kernels if k.bound == "module"]
    floor = sum(k.module_time * k.op.repeat for k in folded)
    assert folded and floor > 0
    rows, requests = rows_and_requests(kernels)
    assert rows + requests == pytest.approx(sum(k.total for k in kernels))
    whole_module = sum(k.total for k in kernels if k.op.kind == "attention" or k.op.module == "lm_head")
    assert requests < whole_module - 0.9 * floor  # the module's floor is not per-request work


def test_workload_checks() -> None:
    s = model_inputs(LLAMA, None).arch.structure
    for bad, message in (
        (Workload(0, 10), "--isl"),
        (Workload(10, 1), "--osl"),
        (Workload(10, 10, tpot=0), "--tpot"),
        (Workload(s.max_positions, 10), "max_position_embeddings"),
    ):
        with pytest.raises(UsageError, match=message):
            bad.check(s.max_positions)


# --- plot ----------------------------------------------------------------------------------------
def test_axis_fits_the_data_with_readable_ticks() -> None:
    axis = _LogAxis([30.0, 120.0], 0.0, 100.0)
    ticks = axis.ticks()
    assert len(ticks) >= 4 and 50.0 in ticks and 100.0 in ticks  # not decades only
    assert axis(30.0) >= 0.0 and axis(30.0) < 10.0 and axis(120.0) > 90.0  # the data spans the axis
    assert all(axis(t) >= 0 and axis(t) <= 100 for t in ticks)
    wide = _LogAxis([3.0, 4000.0], 0.0, 100.0).ticks()
    assert {10.0, 20.0, 50.0, 1000.0} <= set(wide)


def test_plot_has_sla_line_front_labels_and_hollow_misses(tmp_path: Path) -> None:
    points = [
        PlotPoint(40.0, 200.0, "agg checkpoint", "a", True, "dp8ep8 b32"),
        PlotPoint(80.0, 90.0, "agg checkpoint", "b", True, "tp8ep8 b4"),
        PlotPoint(20.0, 300.0, "disagg checkpoint", "c", False, "", meets_sla=False),
    ]
    path = tmp_path / "front.html"
    write_plot(path, points, "t", SlaLine(33.3, "TPOT 30 ms"))
    text = path.read_text()
    root = ET.fromstring(text[text.index("<svg") : text.index("</svg>") + 6])
    ns = "{http://www.w3.org/2000/svg}"
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert "dp8ep8 b32" in texts and "tp8ep8 b4" in texts  # visible, not hover-only
    assert "TPOT 30 ms" in texts
    dashed = [ln for ln in root.iter(f"{ns}line") if ln.get("stroke-dasharray")]
    assert len(dashed) == 1
    hollow = [
        c for c in root.iter(f"{ns}circle") if c.get("fill") == "none" and c.find(f"{ns}title") is not None
    ]
    assert [c.find(f"{ns}title").text for c in hollow] == ["c"]
    x_ticks = [t for t in texts if t and re.fullmatch(r"[\d.]+", t)]
    assert any(not math.log10(float(t)).is_integer() for t in x_ticks)


# --- command line ----------------------------------------------------------------------------------
def test_kadapt_simulate_request_sweep(tmp_path: Path) -> None:
    plot = tmp_path / "front.html"
    args = ["simulate", "llama", "--device", "h200", "--sweep", "--devices", "4", "--quant", "bf16"]
    args += ["--isl", "512", "--osl", "64", "--tpot", "12", "--batches", "1,4,16,64"]
    result = CliRunner().invoke(cli, [*args, "--plot", str(plot), "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["workload"] == {
        "isl": 512,
        "osl": 64,
        "ttft_s": None,
        "tpot_s": 0.012,
        "mtp": 0,
        "mtp_acceptance": 0.7,
    }
    assert doc["framework"]["name"] == "trtllm" and doc["refused"] == {"attention-dp-all-or-nothing": 1}
    assert doc["front"] and all(p["tpot_s"] <= 0.012 for p in doc["front"])
    assert set(doc["picks"]) == {"agg", "disagg"}
    assert all(p["decode"]["tp"] == 1 or p["decode"]["dp"] == 1 for p in doc["front"])
    assert "TPOT 12 ms" in plot.read_text()
    # every row names its weights (--quant bf16 stores Llama's weights as its checkpoint does) and KV cache
    assert doc["shipped_weights"] == "bf16" and doc["quantizations"] == ["BF16"]
    for row in [*doc["front"], *(p for p in doc["picks"].values() if p)]:
        assert (row["weights"], row["weight_format"], row["shipped_weights"]) == ("BF16", "bf16", "bf16")
        assert row["weights_as_shipped"] and row["kv_dtype"] == "bf16" and row["topology_notes"] == []
    text = CliRunner().invoke(cli, [*args, "--serving", "agg", "--mtp", "1"])
    assert text.exit_code == 0, text.output
    assert "picks" in text.output and "disagg" not in text.output
    # the drafts change every TPOT and rate: the report says they were priced (it did not)
    assert "MTP: 1 draft token verified per decode step, 0.7 accepted" in text.output
    assert "weights: BF16 priced; the checkpoint ships bf16" in text.output
    assert any("weights BF16 (shipped: bf16), KV bf16" in line for line in text.output.splitlines())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sweep", "--isl", "512"], "both --isl and --osl"),
        (["--sweep", "--devices", "2", "--tpot", "20"], "request sweep"),
        (["--isl", "512", "--osl", "64"], "apply to --sweep"),
        (["--sweep", "--isl", "512", "--osl", "64", "--decode"], "drop --decode"),
        # click's bounds let nan through: every deployment then missed the SLA, silently
        (["--sweep", "--isl", "512", "--osl", "64", "--tpot", "nan"], "nan is not a finite number"),
        (["--sweep", "--isl", "512", "--osl", "64", "--ttft", "inf"], "inf is not a finite number"),
        (["--sweep", "--isl", "512", "--osl", "1"], "--osl"),
    ],
)
def test_request_sweep_usage_errors(extra: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["simulate", "llama", "--device", "h200", *extra])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


def test_a_pass_with_one_groups_chunk_runs_the_experts_on_one_chunk() -> None:
    """Under attention DP a pass in which one group carries a prompt chunk runs that group's own
    kernels at the chunk's rows and the MoE group's kernels (the routed experts and their dispatch and
    combine, nothing else) at every group's decode rows plus the one chunk: cheaper than the pass in
    which every group carries one, and the same pass when there is one group."""
    loaded = load_spec(REPO / "specs" / "mixtral.yaml")
    inputs = sweep_inputs(loaded, quant_modes(loaded, None))
    (mode,) = inputs
    par, chunk, decode_rows = Parallel(1, 2, 2), 512, 4
    rows_base = Deployment(Parallel(), 1, 1, 0, False)
    every, one = (
        Config(par, (decode_rows + chunk) * 2, mode),
        Config(par, (decode_rows + chunk // 2) * 2, mode),
    )
    rows = Sweep(loaded, inputs, H200, rows_base, 2, batches=(every.batch, one.batch))
    rows.run([every, one])
    full, half = rows.kernels(every), rows.kernels(one)
    moe = {(k.op.module, k.op.name) for k in full if moe_group_kernel(k.op)}
    assert {name.split("(")[0] for _, name in moe} == {"grouped_gemm", "ep_dispatch", "ep_combine"}
    t_mix = mixed_step(full, [], 0.0, 0.0)
    t_one = mixed_step(full, [], 0.0, 0.0, half)
    assert rows_and_requests(half)[0] < t_one < t_mix
    assert mixed_step(full, [], 0.0, 0.0, full) == pytest.approx(t_mix, rel=1e-12)


def test_a_mixed_step_launched_eagerly_is_priced_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """A framework that mixes prompt chunks into decode steps but replays only decode-only steps as
    CUDA graphs (vLLM V0, TensorRT-LLM's PyTorch backend) runs every mixed step eagerly: each of its
    kernels at least the host's time per launch. Its decode steps stay graphed."""
    from dataclasses import replace

    from kimi_adapter_core.backends.simulation.estimate.eager import HOST_US
    from kimi_adapter_core.backends.simulation.search import launch_rules
    from kimi_adapter_core.backends.simulation.search.concurrency import price_concurrency

    inputs = sweep_inputs(LLAMA, quant_modes(LLAMA, None))
    base = Deployment(Parallel(), 1, 1, 0, False)

    def priced() -> Any:
        return price_concurrency(LLAMA, inputs, get_device("h100"), base, WORKLOAD, "vllm", 4)

    graphed = priced()
    vllm = framework("vllm")
    assert vllm.prompt_steps.mixed and vllm.prompt_steps.cuda_graphs
    eager_steps = launch_rules.PromptSteps(True, False, "test: mixed steps launched eagerly")
    monkeypatch.setitem(launch_rules._load(), "vllm", replace(vllm, prompt_steps=eager_steps))
    eager = priced()
    assert not eager.apart and eager.chunk == graphed.chunk
    assert eager.decode.step_time == graphed.decode.step_time  # decode-only steps replay their graph
    # the mixed step's short kernels wait for their launches, and the TPOT and TTFT holding it follow
    assert eager.mixed_step_time > graphed.mixed_step_time + HOST_US * 1e-6
    assert eager.tpot > graphed.tpot and eager.ttft > graphed.ttft
