"""Retired spec forms (``spec.deprecations``) and the quantization each backend reads.

A gpt-oss spec kadapt 0.1.0 accepted - a ``quantization`` scheme beside the config's ``mxfp4``
``quantization_config`` - validates with a located deprecation warning and plans as its new form
(tests/specs/deprecated/gpt_oss_mxfp4.yaml, new form tests/specs/valid/gpt_oss_mxfp4.yaml; the folder test
holds the two as one spec). Plain ``validate`` holds the schemes against the ``quantization_config`` each
backend reads after its config bridges, not against the raw JSON.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures.spec_files import kimi_spec_with

from kimi_adapter_core.cli import cli
from kimi_adapter_core.spec.deprecations import DEPRECATED, _without
from kimi_adapter_core.spec.loader import check_spec

REPO = Path(__file__).resolve().parents[1]
SPECS = REPO / "tests" / "specs"
OLD = SPECS / "deprecated" / "gpt_oss_mxfp4.yaml"
NEW = SPECS / "valid" / "gpt_oss_mxfp4.yaml"
INT4 = json.loads((REPO / "specs" / "kimi_k25" / "config.json").read_text())["text_config"][
    "quantization_config"
]


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(text))


def test_validate_prints_the_deprecation_and_exits_zero() -> None:
    result = run("validate", str(OLD))
    assert result.exit_code == 0, result.output
    first, summary = result.output.strip().splitlines()
    line = line_of(OLD, "  - id: Q1")
    assert first == (
        f"{OLD}:{line}:5: quantization[0]: warning: deprecated form, an error from kadapt 0.3.0: Q1 is int4 "
        "storage, but config quantization_config has quant_method 'mxfp4' (int schemes describe "
        "compressed-tensors pack-quantized only). kadapt 0.1.0 ignored a `quantization` scheme beside a "
        "`quantization_config` that no scheme describes (one that is not compressed-tensors pack-quantized: "
        "gpt-oss's `mxfp4`, DeepSeek's `fp8`), and so does this release, with this warning. New form of "
        "quantization[0]: delete the entry; the config's `quantization_config` decides the storage"
    )
    assert summary == "1 spec checked, 0 invalid, 0 errors, 1 warning"
    assert run("validate", "--strict", str(OLD)).exit_code == 1  # a warning like any other


def test_validate_json_carries_the_deprecation() -> None:
    result = run("validate", "--format", "json", str(OLD))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["valid"] is True
    [diag] = doc["files"][0]["diagnostics"]
    assert (diag["severity"], diag["code"], diag["breadcrumb"]) == (
        "warning",
        "deprecated",
        "quantization[0]",
    )
    assert diag["line"] == line_of(OLD, "  - id: Q1")
    assert (
        "an error from kadapt 0.3.0" in diag["message"] and "New form of quantization[0]" in diag["message"]
    )


@pytest.mark.parametrize("command", [["plan"], ["simulate", "--device", "h200"]], ids=["plan", "simulate"])
def test_the_old_form_plans_and_simulates_as_the_new_form_and_says_so(command: list[str]) -> None:
    old, new = (run(*command, str(path), "--format", "json") for path in (OLD, NEW))
    assert old.exit_code == 0 and new.exit_code == 0, old.output + new.output
    assert "deprecated form" in old.stderr and "deprecated form" not in new.stderr
    documents = [json.loads(result.stdout) for result in (old, new)]
    shown = re.compile(re.escape(str(OLD)) + "|" + re.escape(str(NEW)))
    assert shown.sub("SPEC", json.dumps(documents[0])) == shown.sub("SPEC", json.dumps(documents[1]))


def test_writing_a_spec_lists_every_retired_form() -> None:
    text = (REPO / "docs" / "writing-a-spec.md").read_text()
    section = text[text.index("### Deprecations") :]
    for form in DEPRECATED:
        row = next(line for line in section.splitlines() if line.startswith("|") and form.old in line)
        assert form.new in row and form.accepted_until in row and form.removed_in in row, row


def test_retiring_an_entry_renumbers_the_positions_of_the_rest() -> None:
    raw = {"metadata": {"name": "x"}, "quantization": ["a", "b", "c"], "abi": {}}
    positions = {"quantization": (9, 1), "quantization[0]": (10, 5), "quantization[1].bits": (14, 5)}
    positions |= {"quantization[2]": (18, 5), "abi": (30, 1)}
    data, moved = _without(raw, positions, "quantization", {0})
    assert list(data) == ["metadata", "quantization", "abi"] and data["quantization"] == ["b", "c"]
    assert moved == {
        "quantization": (9, 1),
        "quantization[0].bits": (14, 5),
        "quantization[1]": (18, 5),
        "abi": (30, 1),
    }
    data, moved = _without(raw, positions, "quantization", {0, 1, 2})
    assert "quantization" not in data and moved == {"abi": (30, 1)}


def gpt_oss_with(tmp_path: Path, quantization_config: dict | None, bridge: str, scheme: bool) -> Path:
    """The new-form gpt-oss test spec in ``tmp_path`` with another ``quantization_config`` (None: none),
    ``bridge`` appended to its config bridges and, with ``scheme``, the old form's scheme Q1."""
    config = json.loads((SPECS / "valid" / "gpt_oss_mxfp4.config.json").read_text())
    config.pop("quantization_config")
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (tmp_path / "gpt_oss_mxfp4.config.json").write_text(json.dumps(config))
    text = NEW.read_text().replace("\nmodule_paths:", bridge + "\nmodule_paths:")
    if scheme:
        old = OLD.read_text()
        text = text.replace("\nabi:", old[old.index("\nquantization:") : old.index("\nabi:")] + "\nabi:")
    path = tmp_path / "gpt_oss_mxfp4.yaml"
    path.write_text(text)
    return path


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
DROP = """  - id: D1
    why: The checkpoint given is a dequantized bf16 copy; the published quantization is kept on record.
    op: rename
    from: quantization_config
    to: published_quantization_config
"""


def test_a_bridge_dropping_an_undescribed_quantization_config_for_every_backend_validates(
    tmp_path: Path,
) -> None:
    """The raw config's ``awq`` is one the weight map cannot describe: an error unless the bridges drop it
    for every backend; dropped for extraction alone, simulation still reads it (plan would size it)."""
    unbridged = check_spec(gpt_oss_with(tmp_path, AWQ, "", scheme=False))
    [error] = unbridged.errors
    assert error.breadcrumb == "source.config" and "quant_method 'awq' is not described" in error.message

    path = gpt_oss_with(tmp_path, AWQ, DROP, scheme=False)
    assert [d.render() for d in check_spec(path).diagnostics] == []
    plan = run("plan", str(path), "--format", "json")
    assert plan.exit_code == 0, plan.output

    extraction_only = DROP + "    backends: [extraction]\n"
    [error] = check_spec(gpt_oss_with(tmp_path, AWQ, extraction_only, scheme=False)).errors
    assert "config quantization_config (as simulation reads it): quant_method 'awq'" in error.message


def test_a_scheme_is_held_against_each_backends_quantization_config(tmp_path: Path) -> None:
    """gpt-oss's scheme with an extraction bridge dropping the mxfp4 quantization_config: no error (the
    raw JSON gave one); extraction reads dense and holds no scheme, simulation still reads mxfp4, which
    makes the scheme the retired form, named with the backend that reads it."""
    mxfp4 = json.loads((SPECS / "valid" / "gpt_oss_mxfp4.config.json").read_text())["quantization_config"]
    bridge = DROP + "    backends: [extraction]\n"
    result = check_spec(gpt_oss_with(tmp_path, mxfp4, bridge, scheme=True))
    assert result.errors == []
    [warning] = result.warnings
    assert warning.code == "deprecated" and warning.breadcrumb == "quantization[0]"
    assert (
        "but config quantization_config (as simulation reads it) has quant_method 'mxfp4'" in warning.message
    )


def test_a_bridge_giving_a_silent_config_its_quantization_config_is_what_the_scheme_is_held_against(
    tmp_path: Path,
) -> None:
    """Kimi-K2.5's config without its quantization_config, which an extraction bridge sets back: the
    int4 scheme Q1 agrees with what extraction reads, so no warning that the config is silent (the raw
    JSON gave one); set to int8 it contradicts it, named with the backend."""

    def spec_setting(qc: dict) -> Path:
        path = kimi_spec_with(tmp_path, lambda text: text.pop("quantization_config"))
        bridge = (
            "  - id: Q9\n    why: The checkpoint given is the published int4 one.\n    op: set\n"
            f"    path: text_config.quantization_config\n    value: {json.dumps(qc)}\n"
            "    backends: [extraction]\n"
        )
        path.write_text(path.read_text().replace("config_bridges:\n", "config_bridges:\n" + bridge, 1))
        return path

    assert [d.render() for d in check_spec(spec_setting(INT4)).diagnostics if d.code == "quantization"] == []
    shutil.rmtree(tmp_path / "kimi_k25")
    int8 = json.loads(json.dumps(INT4))
    int8["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    [error] = check_spec(spec_setting(int8)).errors
    assert error.breadcrumb == "quantization[0]"
    assert (
        "text config quantization_config (as extraction reads it after the config bridges) has no such"
        in (error.message)
    )
