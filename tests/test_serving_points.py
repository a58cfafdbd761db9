"""The published serving points (``tables/published/serving_points.yaml``) and ``kadapt simulate
--concurrency``, which prices them.

What must hold: every point loads with its source, layout, workload, measurements and a certainty
note, for a shipped spec, device profile and framework, and there are at least 40 of them across 3
devices and 3 frameworks (issue 38 item 3); a point missing a key or with a layout that does not
match its device count is refused, naming the point; ``--concurrency`` prices a real spec in text and
JSON, saying the weight and KV modes, with ``--framework``'s kernel table (its decode step is
``simulate --decode``'s), and refuses what it cannot price with a located usage error; and a point's
``--concurrency`` price is the request sweep's price of that same layout and batch (the two modes
share one formula and cannot drift apart).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.simulation.estimate.cost import framework_pricer
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.search.concurrency import price_concurrency
from kimi_adapter_core.backends.simulation.search.grid import quant_modes, sweep_inputs
from kimi_adapter_core.backends.simulation.search.launch_rules import framework, frameworks
from kimi_adapter_core.backends.simulation.search.request_pricing import Workload
from kimi_adapter_core.backends.simulation.search.serving import ServingSearch
from kimi_adapter_core.backends.simulation.search.serving_points import (
    POINTS_FILE,
    load_points,
    serving_points,
)
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import load_spec


# --- the published points ------------------------------------------------------------------------
def test_every_point_loads_with_its_source_and_assumptions() -> None:
    points = serving_points()
    assert len(points) >= 40
    assert len({p.device for p in points}) >= 3 and len({p.framework for p in points}) >= 3
    for p in points:
        assert p.url.startswith("https://") and p.title and p.certainty, p.id
        assert (REPO / "specs" / f"{p.spec}.yaml").is_file(), p.id
        assert get_device(p.device).name == p.device, p.id
        assert p.framework in frameworks() and p.version, p.id
        assert p.parallel.devices == p.devices == p.moe_tp * p.moe_ep, p.id
        assert p.concurrency >= 1 and p.isl >= 1 and p.osl >= 2, p.id
        assert p.output_tok_s > 0 and p.mean_tpot_ms > 0 and p.median_ttft_ms > 0, p.id
        # a layout kadapt prices differently from the stated one says so
        assert p.layout_assumed or (p.parallel.ep, p.parallel.moe_tp) == (p.moe_ep, p.moe_tp), p.id


def test_engine_facts_say_which_points_ran_without_cuda_graphs() -> None:
    """dstack's TensorRT-LLM 0.17 points ran the PyTorch backend's default ``use_cuda_graph=False``
    (priced eager), its SGLang 0.4.3 points graphed; each fact cites the source it was read in, and a
    point that states none is priced as graphed."""
    points = serving_points()
    eager = {p.id for p in points if not p.cuda_graphs}
    assert eager == {p.id for p in points if p.id.startswith("dstack-h200-dsr1-trtllm-")} and len(eager) == 9
    for p in points:
        if p.id.startswith("dstack-h200-dsr1-trtllm-"):
            assert "9b931c0f" in p.engine_source and "use_cuda_graph" in p.engine_source, p.id
        elif p.id.startswith("dstack-h200-dsr1-sglang-"):
            assert p.cuda_graphs and "0.4.3.post2" in p.engine_source, p.id
        else:
            assert p.cuda_graphs and p.engine_source == "", p.id


def _tampered(tmp_path: Path, change: dict[str, object], drop: str | None = None) -> Path:
    data = yaml.safe_load(POINTS_FILE.read_text(encoding="utf-8"))
    first = data["points"][0]
    first.update(change)
    if drop:
        del first[drop]
    path = tmp_path / POINTS_FILE.name
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("change", "drop", "message"),
    [
        ({}, "certainty", "certainty missing"),
        ({"source": {"title": "t", "url": "http://example.com"}}, None, "https address"),
        ({"devices": 4}, None, "devices = 4"),
        ({"framework": "tgi"}, None, "framework 'tgi'"),
        ({"measured_throughput": 1.0}, None, "unknown keys"),
        ({"engine": {"cuda_graphs": "no", "source": "s"}}, None, "engine.cuda_graphs must be true or false"),
        ({"engine": {"cuda_graphs": False}}, None, "engine must be a mapping of cuda_graphs and source"),
        ({"engine": {"cuda_graphs": False, "source": ""}}, None, "source missing"),
        ({"step_tokens": {"per_dp_group": 4096}}, None, "step_tokens must be a mapping"),
        ({"step_tokens": {"per_dp_group": 0, "source": "s"}}, None, "per_dp_group must be >= 1"),
        ({"step_tokens": {"per_dp_group": "4k", "source": "s"}}, None, "per_dp_group missing or not"),
        ({"framework_version": "nightly 0.5"}, None, "framework_version must start with a release version"),
        ({"measured_concurrency": -1}, None, "measured_concurrency must be a number > 0 or null"),
    ],
)
def test_a_bad_point_is_refused_by_name(
    tmp_path: Path, change: dict[str, object], drop: str | None, message: str
) -> None:
    with pytest.raises(KadaptError, match=message) as err:
        load_points(_tampered(tmp_path, change, drop))
    assert "point 0 (sglang-b200-dsr1-1000x1000-c1)" in str(err.value)


# --- kadapt simulate --concurrency -------------------------------------------------------------------
CONCURRENCY = ["simulate", "llama", "--device", "h100", "--isl", "512", "--osl", "64"]


def test_concurrency_text_and_json() -> None:
    text = CliRunner().invoke(cli, [*CONCURRENCY, "--concurrency", "8", "--framework", "vllm"])
    assert text.exit_code == 0, text.output
    assert "TP1 DP1 EP1, 8 concurrent requests of ISL 512, OSL 64, vLLM (vllm), aggregated" in text.output
    assert "weights bf16 (shipped), KV cache bf16" in text.output
    assert "TTFT" in text.output and "TPOT" in text.output and "per device" in text.output
    args = [*CONCURRENCY, "--concurrency", "8", "--framework", "vllm", "--kv-dtype", "fp8"]
    args += ["--format", "json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["workload"] == {"isl": 512, "osl": 64, "concurrency": 8, "mtp": 0, "mtp_acceptance": 0.7}
    assert (doc["mode"], doc["decode"]["batch"], doc["devices"]) == ("agg", 8, 1)
    assert (doc["weights"], doc["kv_dtype"], doc["shipped_weights"]) == ("bf16 (shipped)", "fp8", "bf16")
    assert doc["framework"] == {
        "name": "vllm",
        "title": "vLLM",
        "facts_read_in": framework("vllm").read,  # the newest release read, no --framework-version
        "step_tokens": 8192,
        "prompt_steps": "mixed",
        "prompt_cuda_graphs": True,
    }
    # 8 requests in flight, each at 1 / TPOT tokens/s (no prompt waits longer than the cycle it joins)
    assert doc["tokens_per_s_per_user"] == pytest.approx(1 / doc["tpot_s"])
    assert 0 < doc["tokens_per_s_per_device"] <= 8 * doc["tokens_per_s_per_user"]
    assert doc["ttft_s"] > doc["decode"]["step_time_s"] and doc["fits"]


def test_concurrency_prices_the_stated_step_budget() -> None:
    """``--step-tokens`` is the server's budget flag: a smaller one carries fewer prompt tokens per
    mixed step, so a prompt takes more, shorter steps; SGLang's is divided over the DP groups, as its
    server arguments do under DP attention."""
    args = [*CONCURRENCY, "--concurrency", "8", "--framework", "vllm", "--format", "json"]
    default = json.loads(CliRunner().invoke(cli, args).output)
    small = CliRunner().invoke(cli, [*args, "--step-tokens", "256"])
    assert small.exit_code == 0, small.output
    s = json.loads(small.output)
    assert (default["framework"]["step_tokens"], s["framework"]["step_tokens"]) == (8192, 256)
    assert s["chunk"] == 256 - 8 and default["chunk"] > s["chunk"]  # vLLM counts the 8 decode rows
    assert s["mixed_step_time_s"] < default["mixed_step_time_s"]
    # a 512-token prompt in ceil(512 / 248) = 3 such steps, then half a mean step's wait
    assert s["ttft_s"] >= 3 * s["mixed_step_time_s"] and s["ttft_s"] < 4 * s["mixed_step_time_s"]
    dp = ["simulate", "qwen3_moe", "--device", "h200", "--tp", "1", "--dp", "8", "--ep", "8"]
    dp += ["--isl", "512", "--osl", "64", "--concurrency", "16", "--framework", "sglang", "--format", "json"]
    shared = CliRunner().invoke(cli, [*dp, "--step-tokens", "16384"])
    assert shared.exit_code == 0, shared.output
    doc = json.loads(shared.output)
    assert doc["framework"]["step_tokens"] == 2048 and doc["chunk"] <= 2048  # priced at it


def test_concurrency_prices_mtp_drafts() -> None:
    """``--mtp`` applies to ``--concurrency`` as to the request sweep (its decode steps verify the
    drafts): it was refused with "add --decode", which ``--concurrency`` refuses in turn. The drafts
    make the decode step dearer and each request's TPOT shorter."""
    base = [*CONCURRENCY, "--concurrency", "8", "--format", "json"]
    plain = CliRunner().invoke(cli, base)
    drafted = CliRunner().invoke(cli, [*base, "--mtp", "1", "--mtp-acceptance", "0.5"])
    assert plain.exit_code == 0 and drafted.exit_code == 0, drafted.output
    p, d = json.loads(plain.output), json.loads(drafted.output)
    assert (d["workload"]["mtp"], d["workload"]["mtp_acceptance"]) == (1, 0.5)
    assert d["decode"]["step_time_s"] > p["decode"]["step_time_s"]
    assert d["tpot_s"] < p["tpot_s"]
    # 1.5 output tokens per request per decode step: a TPOT no shorter than the step / 1.5
    assert d["tpot_s"] >= d["decode"]["step_time_s"] / 1.5
    text = CliRunner().invoke(cli, [*CONCURRENCY, "--concurrency", "8", "--mtp", "1"])
    assert "MTP: 1 draft token verified per decode step, 0.7 accepted" in text.output, text.output
    bad = CliRunner().invoke(cli, [*CONCURRENCY, "--concurrency", "8", "--mtp", "1", "--mtp-acceptance", "2"])
    assert bad.exit_code == 2 and "--mtp-acceptance must be in [0, 1] (got 2" in bad.output, bad.output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--concurrency", "8"], "needs both --isl and --osl"),
        (["--concurrency", "8", "--isl", "512"], "needs both --isl and --osl"),
        (["--concurrency", "8", *CONCURRENCY[4:], "--sweep"], "drop --sweep"),
        (["--concurrency", "8", *CONCURRENCY[4:], "--decode"], "drop --decode"),
        (["--concurrency", "8", *CONCURRENCY[4:], "--tpot", "10"], "apply to --sweep"),
        (["--concurrency", "8", *CONCURRENCY[4:], "--cost-model", "measured"], "drop --cost-model measured"),
        (["--concurrency", "8", *CONCURRENCY[4:], "--devices", "8"], "--devices, --batches and --plot apply"),
        (["--concurrency", "8", *CONCURRENCY[4:], "--tp", "3"], "--tp 3 does not divide"),
        (["--step-tokens", "4096"], "--step-tokens sets the budget of a --concurrency price"),
        (
            ["--concurrency", "8", *CONCURRENCY[4:], "--framework", "vllm", "--step-tokens", "8"],
            "no room for a prompt",
        ),
        (
            [
                "--concurrency",
                "8",
                *CONCURRENCY[4:],
                "--framework",
                "sglang",
                "--dp",
                "2",
                "--step-tokens",
                "1",
            ],
            "no token per group",
        ),
    ],
)
def test_concurrency_usage_errors(extra: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["simulate", "llama", "--device", "h100", *extra])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


def test_a_points_concurrency_price_is_the_sweeps_price() -> None:
    """GPUStack's gpt-oss-120b on one H100 (vLLM, 4 requests in flight) priced by ``--concurrency`` and
    by the request sweep over batches around it: the sweep's candidate for that layout, batch and the
    framework's default step budget is the same deployment at the same price."""
    (point,) = [p for p in serving_points() if p.id == "gpustack-h100-gptoss-vllm-tp1-c4"]
    spec = load_spec(REPO / "specs" / f"{point.spec}.yaml")
    inputs = sweep_inputs(spec, quant_modes(spec, None))
    device, workload = get_device(point.device), Workload(point.isl, point.osl)
    base = Deployment(point.parallel, 1, 1, 0, False, kv_dtype=point.kv_dtype)
    priced = price_concurrency(spec, inputs, device, base, workload, point.framework, point.concurrency)
    sweep = ServingSearch(
        spec,
        inputs,
        device,
        base,
        point.devices,
        workload,
        point.framework,
        modes=("agg",),
        batches=(2, point.concurrency, 8),
        pricer=framework_pricer(point.framework),
    ).run()
    same = [
        c
        for c in sweep.candidates
        if c.decode.config.parallel == point.parallel
        and c.decode.config.batch == point.concurrency
        and c.chunk == priced.chunk
    ]
    assert len(same) == 1 and len({c.chunk for c in sweep.candidates}) > 1  # the sweep tried other budgets
    (c,) = same
    assert (c.ttft, c.tpot, c.tokens_per_s_per_device) == (
        priced.ttft,
        priced.tpot,
        priced.tokens_per_s_per_device,
    )


def test_concurrency_prices_with_the_frameworks_kernel_table() -> None:
    """The decode step ``--concurrency`` prices is ``kadapt simulate --decode``'s for the same
    framework (its kernel table), and another framework's table prices it differently."""
    steps = {}
    for name in ("vllm", "trtllm"):
        args = [*CONCURRENCY, "--concurrency", "8", "--framework", name, "--format", "json"]
        doc = json.loads(CliRunner().invoke(cli, args).output)
        step = ["simulate", "llama", "--device", "h100", "--decode", "--batch", "8", "--framework", name]
        step += ["--context-len", str(512 + 64 // 2), "--format", "json"]
        sim = json.loads(CliRunner().invoke(cli, step).output)
        assert doc["decode"]["step_time_s"] == pytest.approx(sim["step_time_s"], rel=1e-9)
        steps[name] = sim["step_time_s"]
    assert steps["vllm"] != pytest.approx(steps["trtllm"], rel=1e-3)
