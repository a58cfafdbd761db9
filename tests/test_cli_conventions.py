"""CLI conventions for every command the group lists (docs/cli.md): examples in ``--help``,
``-q``/``-v`` before or after the command, ``--format json`` documents with the documented keys
(errors too), exit 2 for usage errors, and the installed ``kadapt`` entry point behaving the same.

Commands are taken from the group, not from a list here, so a new command that skips a convention
fails these tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from kimi_adapter_core.cli import cli

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "cli.md"
INVALID_SPEC = REPO / "tests" / "specs" / "invalid" / "wrong_type.yaml"
NO_FORMAT = {"schema"}  # its output is the JSON Schema itself
COMMANDS = cli.list_commands(click.Context(cli))


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def documented_keys(command: str) -> tuple[set[str], set[str]]:
    """(always present, allowed) top-level keys from the command's section of docs/cli.md."""
    section = DOCS.read_text(encoding="utf-8").split(f"\n## kadapt {command}\n")[1].split("\n## ")[0]
    line = section.split("Top-level keys:")[1].split("\n\n")[0]
    required = set(re.findall(r"`(\w+)`", line.split(";")[0]))
    return required, set(re.findall(r"`(\w+)`", line))


def deepseek_copy(tmp_path: Path) -> Path:
    """specs/deepseek_v3.yaml (one pinned patch) and its config, copied so a test may edit it."""
    shutil.copytree(REPO / "specs" / "deepseek_v3", tmp_path / "deepseek_v3")
    spec = tmp_path / "deepseek_v3.yaml"
    shutil.copy(REPO / "specs" / "deepseek_v3.yaml", spec)
    return spec


# -- every command: examples, -q/-v, --format json, exit 2 ------------------------------------------


def test_the_group_lists_every_command() -> None:
    assert set(COMMANDS) >= {"apply", "generate", "pin", "plan", "schema", "simulate", "validate"}


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_has_examples_and_verbosity_options(command: str) -> None:
    result = run(*([command] if command else []), "--help")
    assert result.exit_code == 0, result.output
    examples = result.output.split("Examples:\n")[1].split("\n\n")[0].splitlines()
    prefix = f"kadapt {command}".strip()
    assert examples and all(line.strip().startswith("kadapt ") for line in examples), result.output
    assert any(prefix in line for line in examples)
    assert "-q, --quiet" in result.output and "-v, --verbose" in result.output


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in NO_FORMAT])
def test_reporting_commands_take_format_json_with_documented_keys(command: str) -> None:
    assert "--format [text|json]" in run(command, "--help").output
    required, _ = documented_keys(command)
    assert required, f"docs/cli.md lists no keys for {command}"


@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_option_and_both_verbosities_are_usage_errors(command: str) -> None:
    unknown = run(command, "--no-such-option")
    assert unknown.exit_code == 2 and "No such option" in unknown.output
    both = run("-q", command, "-v")
    assert both.exit_code == 2 and "cannot be combined" in both.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["validate"], "Missing argument"),
        (["validate", "no_such_spec"], "no spec file"),
        (["plan", "llama", "--batch", "0"], "--batch must be >= 1"),
        (["plan", "llama", "--device", "bogus"], "unknown device"),
        (["generate", "llama", "--target", "bogus"], "'bogus' is not one of"),
        (["pin", "no_such_spec"], "no shipped spec of that name"),
        (["apply", "llama", "--prefill-len", "0"], "0 is not in the range"),
        (["apply", "llama", "--backend", "none", "--batch", "2"], "need --backend extraction"),
        (["simulate", "llama", "--device", "h200", "--tp", "0"], "0 is not in the range"),
        (["schema", "--output"], "requires an argument"),
        (["no-such-command"], "No such command"),
    ],
)
def test_usage_errors_exit_2_with_text_and_no_json(args: list[str], message: str) -> None:
    takes_format = args[0] in COMMANDS and args[0] not in NO_FORMAT
    result = run(*args, *(["--format", "json"] if takes_format else []))
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert result.stdout == ""  # JSON mode too: usage errors are never a half document on stdout


# -- JSON documents ---------------------------------------------------------------------------------


def keys_of(command: str, *args: str) -> set[str]:
    result = run(command, *args, "--format", "json", "-v")  # -v details go to stderr, never stdout
    assert result.exit_code == 0, result.output
    return set(json.loads(result.stdout))


def test_validate_plan_and_simulate_documents_have_the_documented_keys() -> None:
    for command, args in (
        ("validate", ["llama"]),
        ("plan", ["llama", "--device", "h200"]),
        ("simulate", ["llama", "--device", "h200", "--decode"]),
    ):
        required, allowed = documented_keys(command)
        assert required <= keys_of(command, *args) <= allowed, command


def test_apply_document_has_the_documented_keys(tmp_path: Path) -> None:
    required, allowed = documented_keys("apply")
    assert keys_of("apply", "llama", "--backend", "none") == required
    assert keys_of("apply", "llama", "--output-dir", str(tmp_path)) == required | {"extraction"}


def test_pin_document_lists_fresh_pins(tmp_path: Path) -> None:
    spec = deepseek_copy(tmp_path)
    required, allowed = documented_keys("pin")
    result = run("pin", str(spec), "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert required <= set(data) <= allowed
    assert (data["up_to_date"], data["written"], data["diff"]) == (True, False, "")
    [(patch_id, pin)] = data["pins"].items()
    assert pin["target"].endswith(":DeepseekV3Attention.expand_kv")
    assert pin["source_sha256"] in spec.read_text(encoding="utf-8")


def test_stale_pins_are_one_document_then_exit_1(tmp_path: Path) -> None:
    spec = deepseek_copy(tmp_path)
    text = spec.read_text(encoding="utf-8")
    sha = re.search(r'source_sha256: "(\w+)"', text)[1]
    spec.write_text(text.replace(sha, "0" * 64), encoding="utf-8")
    result = run("pin", str(spec), "--format", "json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)  # exactly one document: no error document appended
    assert (data["up_to_date"], data["written"]) == (False, False)
    assert f'+      source_sha256: "{sha}"' in data["diff"]
    assert "pins are stale" in result.stderr


def test_generate_document_then_check_finds_the_stale_file(tmp_path: Path) -> None:
    required, allowed = documented_keys("generate")
    args = ["generate", "llama", "--target", "docs", "--out", str(tmp_path), "--format", "json"]
    first = run(*args)
    assert first.exit_code == 0, first.output
    data = json.loads(first.stdout)
    assert required <= set(data) <= allowed and (data["check"], data["up_to_date"]) == (False, True)
    [entry] = data["specs"]
    assert [(f["path"], f["status"]) for f in entry["files"]] == [("docs/specs/llama.md", "written")]
    assert json.loads(run(*args).stdout)["specs"][0]["files"][0]["status"] == "unchanged"

    doc = tmp_path / "docs" / "specs" / "llama.md"
    doc.write_text(doc.read_text(encoding="utf-8") + "edited\n", encoding="utf-8")
    check = run(*args, "--check")
    assert check.exit_code == 1
    data = json.loads(check.stdout)
    assert (data["check"], data["up_to_date"]) == (True, False)
    [row] = data["specs"][0]["files"]
    assert row["status"] == "stale" and "-edited" in row["diff"]


def test_errors_in_json_mode_are_a_json_document_on_stdout() -> None:
    # a value the spec does not declare is a bad option value: a usage error, text on stderr only
    bad_quant = run("plan", "llama", "--quant", "bogus", "--format", "json")
    assert (bad_quant.exit_code, bad_quant.stdout) == (2, "")
    assert "error: quantization 'bogus' is not declared by this spec" in bad_quant.stderr
    declared = run("plan", "llama", "--quant", "bf16", "--format", "json")  # case-insensitive
    assert declared.exit_code == 0 and json.loads(declared.stdout)["model_type"] == "llama"

    invalid = run("plan", str(INVALID_SPEC), "--format", "json")
    assert invalid.exit_code == 1
    [diagnostic] = json.loads(invalid.stdout)["error"]["diagnostics"]
    expected = json.loads(run("validate", str(INVALID_SPEC), "--format", "json").stdout)
    assert diagnostic == expected["files"][0]["diagnostics"][0]  # validate's shape, same finding


def test_text_mode_errors_stay_on_stderr() -> None:
    result = run("plan", str(INVALID_SPEC))
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith("error: invalid spec (1 error):")


# -- quiet and verbose ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_prints_nothing_when_checks_pass(tmp_path: Path, where: str) -> None:
    def quiet(*args: str) -> Result:
        return run("-q", *args) if where == "before" else run(*args, "-q")

    spec = deepseek_copy(tmp_path)
    runs = {
        "validate": quiet("validate", str(REPO / "specs")),
        "generate": quiet("generate", "llama", "--target", "docs", "--out", str(tmp_path / "g")),
        "generate --check": quiet(
            "generate", "llama", "--target", "docs", "--out", str(tmp_path / "g"), "--check"
        ),
        "pin": quiet("pin", str(spec)),
        "apply": quiet("apply", "llama", "--backend", "none"),
    }
    for name, result in runs.items():
        assert (name, result.exit_code, result.output) == (name, 0, "")
    assert run("validate", str(REPO / "specs")).output.strip()  # not quiet: a summary line


def test_quiet_keeps_findings_errors_reports_and_json(tmp_path: Path) -> None:
    invalid = run("-q", "validate", str(INVALID_SPEC))
    assert invalid.exit_code == 1
    assert invalid.output.splitlines() == [
        f"{INVALID_SPEC}:11:3: abi.batch: expected integer, got string 'one'"
    ]
    assert "error: quantization" in run("-q", "plan", "llama", "--quant", "bogus").stderr
    assert run("-q", "plan", "llama").stdout == run("plan", "llama").stdout != ""
    quiet_json = run("validate", "llama", "--format", "json", "-q")
    assert json.loads(quiet_json.stdout)["valid"] is True

    doc = tmp_path / "docs" / "specs" / "llama.md"
    doc.parent.mkdir(parents=True)
    doc.write_text("hand-edited\n", encoding="utf-8")
    stale = run("-q", "generate", "llama", "--target", "docs", "--out", str(tmp_path), "--check")
    assert stale.exit_code == 1
    assert "stale: docs/specs/llama.md" in stale.stdout and "-hand-edited" in stale.stdout
    assert "up to date" not in stale.output


def test_verbose_details_go_to_stderr(tmp_path: Path) -> None:
    validate = run("validate", "llama", "-v")
    assert f"checked {REPO / 'specs' / 'llama.yaml'}: ok, 0 errors, 0 warnings" in validate.stderr
    assert "checked /" not in validate.stdout

    out = tmp_path / "g"
    run("generate", "llama", "--out", str(out))
    check = run("-v", "generate", "llama", "--out", str(out), "--check")
    assert check.exit_code == 0, check.output
    listed = [line.split(": ", 1)[1] for line in check.stderr.splitlines() if line.startswith("  ok: ")]
    assert sorted(listed) == sorted(str(p) for p in out.rglob("*") if p.is_file()) and len(listed) >= 3

    applied = run("apply", "llama", "--backend", "none", "-v", "--format", "json")
    stages = re.findall(r"^stage ([a-z ]+): \d+\.\d\d s$", applied.stderr, re.MULTILINE)
    assert stages == ["import torch", "load spec", "apply patches", "structure", "build model"]
    assert f"spec: {REPO / 'specs' / 'llama.yaml'}" in applied.stderr
    json.loads(applied.stdout)

    assert f"spec: {REPO / 'specs' / 'llama.yaml'}" in run("plan", "llama", "-v").stderr
    assert "checked" not in run("validate", "llama").stderr  # no details without -v


# -- the installed entry point ---------------------------------------------------------------------


def test_installed_kadapt_entry_point_follows_the_conventions() -> None:
    kadapt = Path(sysconfig.get_path("scripts")) / "kadapt"
    assert kadapt.is_file(), "kadapt is not installed (pip install -e '.[test]')"
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the checkout's code behind the installed script

    def call(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(kadapt), *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=300
        )

    quiet = call("-q", "validate", "specs/")
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    plan = call("plan", "llama", "--format", "json", "-v")
    assert plan.returncode == 0 and json.loads(plan.stdout)["model_type"] == "llama"
    assert "spec: " in plan.stderr
    usage = call("validate", "no_such_spec", "--format", "json")
    assert (usage.returncode, usage.stdout) == (2, "") and "no spec file" in usage.stderr
    failed = call("plan", str(INVALID_SPEC), "--format", "json")
    assert failed.returncode == 1 and json.loads(failed.stdout)["error"]["diagnostics"]
    help_text = call("generate", "--help")
    assert help_text.returncode == 0 and "Examples:" in help_text.stdout


def test_quiet_silences_transformers_warnings_for_the_command_only() -> None:
    """Llama-4-Scout's published rope factors (high = low = 1.0) make transformers warn when its config
    is built (``validate --resolve``): a check that passes under ``-q`` prints nothing, in a fresh
    process whichever side of the command ``-q`` stands; without ``-q`` the warning is still shown."""
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"}
    spec = str(REPO / "specs" / "llama4_scout.yaml")

    def kadapt(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "kimi_adapter_core", *args]
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    loud = kadapt("validate", "--resolve", spec)
    assert loud.returncode == 0 and "high_freq_factor" in loud.stderr, loud.stderr
    for args in (("-q", "validate", "--resolve", spec), ("validate", "--resolve", spec, "-q")):
        quiet = kadapt(*args)
        assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", ""), args
