"""``kadapt apply`` and ``kadapt pin`` end to end (backend none: no extraction needed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures.remote_kimi import write_remote_model

from kimi_adapter_core.builtins.registry import BUILTINS
from kimi_adapter_core.cli import cli

REPO = Path(__file__).resolve().parents[1]
needs_mla = pytest.mark.skipif(
    "mla_expand_kv_functional" not in BUILTINS,
    reason="specs/kimi_k25.yaml's K1 needs builtin:mla_expand_kv_functional "
    "(kimi_adapter_core/builtins/mla.py, "
    "written by the extraction work) and it is not registered yet",
)


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@needs_mla
def test_apply_full_kimi_on_meta_backend_none():
    result = run("apply", str(REPO / "specs" / "kimi_k25.yaml"), "--backend", "none", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["model"]["layers"] == 61 and data["model"]["experts"] == 384
    assert data["model"]["class"] == "Kimi_K25ForConditionalGeneration"
    assert data["ledger"]["counts"]["failed"] == 0
    statuses = {e["id"]: e["status"] for e in data["ledger"]["entries"]}
    assert statuses["K1"] == "not for this backend" and statuses["B1"] == "applied"


@pytest.fixture
def remote_spec(tmp_path):
    """A copy of specs/kimi_k25_remote.yaml (+ its config) that tests may rewrite, and a model dir."""
    shutil.copytree(REPO / "specs" / "kimi_k25_remote", tmp_path / "kimi_k25_remote")
    spec = tmp_path / "kimi_k25_remote.yaml"
    spec.write_text((REPO / "specs" / "kimi_k25_remote.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    return spec, write_remote_model(tmp_path / "model")


def test_apply_remote_needs_the_flag(remote_spec):
    spec, model = remote_spec
    refused = CliRunner().invoke(cli, ["apply", str(spec), "--backend", "none", "--source-dir", str(model)])
    assert refused.exit_code == 1 and "--trust-remote-code" in refused.output
    result = run("apply", str(spec), "--backend", "none", "--source-dir", str(model), "--trust-remote-code")
    assert result.exit_code == 0, result.output
    assert "P4    patch" in result.output and "failed" not in result.output.splitlines()[0]
    assert "KimiK25ForConditionalGeneration" in result.output and "2 layers, 4 experts" in result.output


def test_pin_diff_write_and_drift(remote_spec):
    spec, model = remote_spec
    original = spec.read_text(encoding="utf-8")
    args = ["pin", str(spec), "--trust-remote-code", "--source-dir", str(model)]
    shown = run(*args)
    assert shown.exit_code == 0 and "+    pin:" in shown.output and "source_sha256" in shown.output
    assert spec.read_text(encoding="utf-8") == original  # no --write: untouched
    assert run(*args, "--write").exit_code == 0
    pinned = spec.read_text(encoding="utf-8")
    assert pinned.count("    pin:\n") == 8  # every callable patch; set_attribute has nothing to pin
    assert [line for line in pinned.splitlines() if line.lstrip().startswith("#")] == [
        line for line in original.splitlines() if line.lstrip().startswith("#")
    ]
    assert "up to date" in run(*args).output
    ok = run("apply", str(spec), "--backend", "none", "--source-dir", str(model), "--trust-remote-code")
    assert ok.exit_code == 0, ok.output

    code = model / "modeling_deepseek.py"  # upstream changes the attention
    code.write_text(code.read_text().replace("return out, None, past_key_value", "return out, None"))
    drift = CliRunner().invoke(
        cli, ["apply", str(spec), "--backend", "none", "--source-dir", str(model), "--trust-remote-code"]
    )
    assert drift.exit_code == 1 and "upstream drift" in drift.output and "P10" in drift.output
    assert f"{spec}:" in drift.output  # points at the spec line
