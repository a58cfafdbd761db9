"""``kadapt validate`` and ``kadapt schema`` through the real click group."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures.spec_files import write_qwen3_three_to_one

from kimi_adapter_core.builtins import registry
from kimi_adapter_core.cli import cli
from kimi_adapter_core.resources import schema_path

REPO = Path(__file__).resolve().parents[1]
VALID = REPO / "tests" / "specs" / "valid"
INVALID = REPO / "tests" / "specs" / "invalid"


@pytest.fixture(autouse=True)
def fake_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ("mla_expand_kv_functional", "moe_zeros_like", "is_torch_fx_available", "meta_passthrough")
    monkeypatch.setattr(registry, "BUILTINS", {name: ("m:f", "s") for name in names})


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_valid_folder_exits_zero_with_summary() -> None:
    result = run("validate", str(VALID))
    assert result.exit_code == 0, result.output
    count = len(list(VALID.glob("*.yaml")))
    assert result.output.strip().splitlines()[-1] == f"{count} specs checked, 0 invalid, 0 errors, 0 warnings"


def test_invalid_file_exits_one_with_located_lines() -> None:
    spec = INVALID / "remote_without_trust.yaml"
    result = run("validate", str(spec), str(VALID / "minimal.yaml"))
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines[0].startswith(f"{spec}:13:5: patches[0].target: remote: targets")
    assert lines[-1] == "2 specs checked, 1 invalid, 1 error, 0 warnings"


def test_json_format(tmp_path: Path) -> None:
    result = run(
        "validate", "--format", "json", str(INVALID / "wrong_type.yaml"), str(VALID / "minimal.yaml")
    )
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["valid"] is False
    bad, good = report["files"]
    assert (bad["valid"], good["valid"], good["diagnostics"]) == (False, True, [])
    [diag] = bad["diagnostics"]
    assert diag == {
        "file": str(INVALID / "wrong_type.yaml"),
        "line": 11,
        "col": 3,
        "breadcrumb": "abi.batch",
        "message": "expected integer, got string 'one'",
        "severity": "error",
        "code": "schema-type",
    }


def test_strict_turns_warnings_into_failures(tmp_path: Path) -> None:
    spec = tmp_path / "s.yaml"
    text = (VALID / "hub_only.yaml").read_text(encoding="utf-8")
    spec.write_text(text.replace("fedcba9876543210fedcba9876543210fedcba98", "main"), encoding="utf-8")
    assert run("validate", str(spec)).exit_code == 0
    strict = run("validate", "--strict", str(spec))
    assert strict.exit_code == 1
    assert strict.output.strip().endswith("1 spec checked, 1 invalid, 0 errors, 1 warning")


def test_folder_search_is_recursive_and_skips_hidden_dirs(tmp_path: Path) -> None:
    (tmp_path / "nested").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "nested" / "a.yml").write_text("", encoding="utf-8")
    (tmp_path / ".hidden" / "b.yaml").write_text("", encoding="utf-8")
    result = run("validate", str(tmp_path))
    assert result.exit_code == 1
    assert "nested/a.yml:1:1: spec file is empty" in result.output
    assert ".hidden" not in result.output


def test_folder_without_specs_is_a_usage_error(tmp_path: Path) -> None:
    result = run("validate", str(tmp_path))
    assert result.exit_code == 2
    assert "no *.yaml or *.yml specs found" in result.output


def test_missing_path_is_a_usage_error(tmp_path: Path) -> None:
    assert run("validate", str(tmp_path / "absent.yaml")).exit_code == 2


def test_schema_command_prints_and_writes(tmp_path: Path) -> None:
    shipped = json.loads(schema_path().read_text(encoding="utf-8"))
    printed = run("schema")
    assert printed.exit_code == 0 and json.loads(printed.output) == shipped
    target = tmp_path / "out" / "schema.json"
    assert run("schema", "--output", str(target)).exit_code == 0
    assert json.loads(target.read_text(encoding="utf-8")) == shipped


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["validate", "specs/"], "specs checked"),
        (["--help"], "Commands:"),
        (["schema"], "adapter-spec.v1.json"),
    ],
)
def test_linting_paths_import_neither_torch_nor_transformers(argv: list[str], expect: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kimi_adapter_core", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert expect in proc.stdout, proc.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "kimi_adapter_core.cli" in imported  # the check below sees real import lines
    heavy = sorted(m for m in imported if m.split(".")[0] in {"torch", "transformers"})
    assert heavy == []


def test_resolve_shortens_a_config_that_lists_layer_types(tmp_path: Path) -> None:
    """The shortened model keeps one entry of layer_types per layer (transformers validates that);
    the full config is resolved without a traceback."""
    spec = write_qwen3_three_to_one(tmp_path)
    result = CliRunner().invoke(cli, ["validate", "--resolve", str(spec)])
    assert result.exit_code == 0, result.output
    assert "1 spec checked, 0 invalid, 0 errors" in result.output


def test_a_config_its_class_rejects_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    spec = write_qwen3_three_to_one(tmp_path, num_hidden_layers=6)  # 8 layer_types for 6 layers
    result = CliRunner().invoke(cli, ["apply", str(spec), "--backend", "none"])
    assert result.exit_code == 1
    assert "error: Qwen3Config rejects the bridged config:" in result.output
    assert "must be equal to the number of `layer_types`" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda config, spec: config["quantization_config"].update(quant_method="awq"), "quant_method 'awq'"),
        (
            lambda config, spec: config.update(chunkwise_kernel="chunkwise--native_autograd"),  # xLSTM
            r"refused \(hybrid\): config sets chunkwise_kernel",
        ),
        (
            lambda config, spec: config.update(layer_types=["compressed_attention"] * 36),
            r"refused \(layer-types\)",
        ),
        (
            lambda config, spec: spec.replace(
                "  dtype: bfloat16\n", "  dtype: bfloat16\n  kv_layout: expanded\n"
            ),
            "kv_layout 'expanded' does not fit this model's GQA attention",
        ),
    ],
    ids=["quant-method", "hybrid", "layer-types", "kv-layout"],
)
def test_plain_validate_reads_what_the_shipped_config_says(tmp_path: Path, change, expected: str) -> None:
    """Without torch, plain validate finds what apply would refuse: a storage the weight map cannot
    describe, what kadapt does not model, an ABI layout the attention cannot hold - located in the spec."""
    spec_text = (REPO / "specs" / "gpt_oss.yaml").read_text()
    config = json.loads((REPO / "specs" / "gpt_oss" / "config.json").read_text())
    spec_text = change(config, spec_text) or spec_text
    (tmp_path / "gpt_oss").mkdir()
    (tmp_path / "gpt_oss" / "config.json").write_text(json.dumps(config))
    path = tmp_path / "gpt_oss.yaml"
    path.write_text(spec_text)
    result = run("validate", str(path))
    assert result.exit_code == 1, result.output
    assert re.search(re.escape(str(path)) + r":\d+:\d+: .*" + expected, result.output), result.output
