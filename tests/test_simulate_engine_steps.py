"""``kadapt simulate --steps``: an engine's recorded steps priced one by one (issue 39, "simulate prices the
same trace's steps"). A step of one shape prices exactly as the uniform step ``simulate`` already prices
(a decode batch at one context; one prompt chunk after a cached context), a mixed step costs more than
its parts' rows alone, and a bad trace is refused naming the file and every key that is wrong, before
anything is priced."""

from __future__ import annotations

import json
import os
from dataclasses import astuple
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kimi_adapter_core.backends.simulation.estimate import aiconfigurator
from kimi_adapter_core.backends.simulation.search.engine_steps import read_trace
from kimi_adapter_core.cli import cli

SPEC = "specs/deepseek_v3.yaml"  # MLA: prefill expands the cached latents (a row kernel that grows)
LAYOUT = ["--device", "h200", "--tp", "8", "--ep", "8"]


def _run(*args: str) -> Any:
    result = CliRunner().invoke(cli, ["simulate", SPEC, *LAYOUT, *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _trace(tmp_path: Path, steps: list[list[dict[str, object]]]) -> str:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"source": "test", "steps": [{"rows": rows} for rows in steps]}))
    return str(path)


@pytest.mark.parametrize("cost_model", ["roofline", "measured"])
def test_a_uniform_step_prices_as_the_step_simulate_prices(tmp_path: Path, cost_model: str) -> None:
    if cost_model == "measured" and not aiconfigurator.available():
        pytest.skip("aiconfigurator-core not installed")
    decode = [{"query": 1, "context": 900}] * 8
    chunk = [{"query": 300, "context": 1200}]
    priced = _run("--steps", _trace(tmp_path, [decode, chunk]), "--cost-model", cost_model)
    batch = _run("--decode", "--batch", "8", "--context-len", "900", "--cost-model", cost_model)
    prompt = _run("--query-len", "300", "--context-len", "1200", "--cost-model", cost_model)
    first, second = priced["steps"]
    assert (first["path"], second["path"]) == ("decode", "prefill")
    assert first["time_s"] == pytest.approx(batch["step_time_s"], rel=1e-9)
    assert second["time_s"] == pytest.approx(prompt["step_time_s"], rel=1e-9)
    assert priced["total_s"] == pytest.approx(first["time_s"] + second["time_s"])


def test_a_mixed_step_carries_its_rows_once_and_every_row_s_attention(tmp_path: Path) -> None:
    chunk = {"query": 300, "context": 1200}
    singles = [{"query": 1, "context": 900}] * 8
    alone, decodes, mixed, longer = _run(
        "--steps", _trace(tmp_path, [[chunk], singles, [chunk, *singles], [{**chunk, "context": 6000}]])
    )["steps"]
    assert mixed["tokens"] == 308 and mixed["logits"] == 9 and mixed["path"] == "prefill"
    # one pass: cheaper than the chunk and the decode batch run apart, dearer than the chunk alone
    assert alone["time_s"] < mixed["time_s"] < alone["time_s"] + decodes["time_s"]
    assert mixed["attention_s"] == pytest.approx(alone["attention_s"] + decodes["attention_s"], rel=1e-9)
    # a longer cached context costs the chunk more attention and more latent expansion
    assert longer["attention_s"] > alone["attention_s"] and longer["rows_s"] > alone["rows_s"]


def test_a_bad_trace_is_refused_with_every_located_problem_before_any_pricing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps({"steps": [{"rows": [{"query": 0, "context": -1, "tokens": 3}]}, {"rows": []}], "x": 1})
    )
    result = CliRunner().invoke(cli, ["simulate", SPEC, *LAYOUT, "--steps", str(bad)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    for where in (
        "steps[0].rows[0].query",
        "steps[0].rows[0].context",
        "steps[0].rows[0]: Additional",
        "steps[1].rows",
    ):
        assert f"{bad}: " in result.output and where in result.output, where
    assert "'x' was unexpected" in result.output

    too_many = _trace(tmp_path, [[{"query": 2, "context": 0, "logits": 3}]])
    result = CliRunner().invoke(cli, ["simulate", SPEC, *LAYOUT, "--steps", too_many])
    assert (
        result.exit_code == 1 and "steps[0].rows[0].logits: 3 logits rows of a 2-token query" in result.output
    )
    # a row asking too many logits is named beside the schema's findings, not after they are fixed
    both = _trace(tmp_path, [[{"query": 2, "context": -1, "logits": 3}], [{"query": "1", "context": 0}]])
    result = CliRunner().invoke(cli, ["simulate", SPEC, *LAYOUT, "--steps", both])
    assert result.exit_code == 1 and "Traceback" not in result.output
    for where in (
        "steps[0].rows[0].context",
        "steps[0].rows[0].logits: 3 logits rows",
        "steps[1].rows[0].query",
    ):
        assert where in result.output, (where, result.output)

    broken = tmp_path / "broken.json"
    broken.write_text('{"steps": [\n  {"rows": [}\n]}')
    result = CliRunner().invoke(cli, ["simulate", SPEC, *LAYOUT, "--steps", str(broken)])
    assert result.exit_code == 1 and f"{broken}:2:" in result.output and "not valid JSON" in result.output

    result = CliRunner().invoke(cli, ["simulate", SPEC, *LAYOUT, "--steps", str(tmp_path / "missing.json")])
    assert result.exit_code == 1 and "missing.json: cannot read" in result.output


def test_steps_refuse_the_options_of_other_modes_and_a_second_attention_group(tmp_path: Path) -> None:
    trace = _trace(tmp_path, [[{"query": 1, "context": 10}]])
    result = CliRunner().invoke(
        cli, ["simulate", SPEC, *LAYOUT, "--steps", trace, "--decode", "--batch", "4"]
    )
    assert result.exit_code == 2 and "drop --decode, --batch" in result.output
    result = CliRunner().invoke(
        cli, ["simulate", SPEC, "--device", "h200", "--dp", "8", "--ep", "8", "--steps", trace]
    )
    assert result.exit_code == 2 and "--dp must be 1 (got 8)" in result.output
    # a layout that does not divide the model is the engine's fault, not the first step's
    result = CliRunner().invoke(cli, ["simulate", SPEC, "--device", "h200", "--tp", "3", "--steps", trace])
    assert result.exit_code == 2 and "--tp 3 does not divide the 128 attention heads" in result.output
    assert "steps[0]" not in result.output, result.output


def test_a_context_past_the_model_names_the_step(tmp_path: Path) -> None:
    trace = _trace(tmp_path, [[{"query": 1, "context": 10}], [{"query": 4, "context": 10**7}]])
    result = CliRunner().invoke(cli, ["simulate", SPEC, *LAYOUT, "--steps", trace])
    assert (
        result.exit_code == 2 and "steps[1]: " in result.output and "max_position_embeddings" in result.output
    )


def test_a_trace_past_the_json_parser_is_a_located_refusal(tmp_path: Path) -> None:
    """Nesting past the parser's stack and an int past str()'s 4300 digits raised a bare RecursionError
    and ValueError (a traceback); a FIFO's refusal read "a engine trace"."""
    deep, digits = tmp_path / "deep.json", tmp_path / "digits.json"
    deep.write_text('{"steps": ' + "[" * 100_000 + "]" * 100_000 + "}")
    digits.write_text('{"steps": [{"rows": [{"query": 1, "context": ' + "9" * 5000 + "}]}]}")
    for path, problem in ((deep, "nested too deeply"), (digits, "Exceeds the limit (4300 digits)")):
        result = CliRunner().invoke(cli, ["simulate", SPEC, *LAYOUT, "--steps", str(path)])
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert f"{path}: not valid JSON: {problem}" in result.output and "sys." not in result.output
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    result = CliRunner().invoke(cli, ["simulate", SPEC, *LAYOUT, "--steps", str(fifo)])
    assert result.exit_code == 1 and "a trace file must be a regular file" in result.output, result.output


def test_integers_written_as_floats_price_as_the_ints_they_are(tmp_path: Path) -> None:
    """JSON Schema's ``integer`` admits 1000.0 and 1e3, so such a trace passed the schema and its float
    query reached torch (``zeros(): ... got float``, a traceback) or printed ``tokens 2.0``."""
    ints = _trace(tmp_path, [[{"query": 300, "context": 1200}], [{"query": 1, "context": 900}] * 2])
    floats = tmp_path / "floats.json"
    floats.write_text(
        '{"steps": [{"rows": [{"query": 3e2, "context": 1200.0, "logits": 1.0}]},'
        ' {"rows": [{"query": 1.0, "context": 900.0}, {"query": 1.0, "context": 9e2}]}]}'
    )
    assert read_trace(floats) == read_trace(ints)
    assert all(type(v) is int for step in read_trace(floats) for row in step for v in astuple(row))
    assert _run("--steps", str(floats))["steps"] == _run("--steps", ints)["steps"]
