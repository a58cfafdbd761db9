"""``kadapt apply`` and ``kadapt pin`` end to end, through the CLI as a user runs them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures.remote_kimi import write_remote_model
from fixtures.shared_apply import SharedApplies

from kimi_adapter_core.cli import cli

REPO = Path(__file__).resolve().parents[1]


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_main_job_extracts_full_kimi(shipped_apply: SharedApplies):
    """The README's main job: the full Kimi-K2.5 on meta, offline, extraction backend (the default);
    the run every test shares (``apply specs/kimi_k25.yaml --output-dir OUT --verify --format json``)."""
    result = shipped_apply("kimi_k25")
    out = result.out
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model"]["layers"] == 61 and data["model"]["experts"] == 384
    assert data["model"]["class"] == "Kimi_K25ForConditionalGeneration"
    assert data["ledger"]["counts"]["failed"] == 0
    statuses = {e["id"]: e["status"] for e in data["ledger"]["entries"]}
    assert statuses["K1"] == "applied" and statuses["X2"] == "applied" and statuses["B1"] == "applied"
    assert statuses["P2"] == "gated off"  # no flash_attention_2 in the shipped config
    written = sorted(p.name for p in out.iterdir())
    kinds = ("decode_ir", "kv_mapping", "prefill_ir", "prefill_mm_ir", "vision_ir", "weight_map")
    assert written == [f"kimi_k25_text_{kind}.json" for kind in kinds]
    weight_map = json.loads((out / "kimi_k25_text_weight_map.json").read_text())
    experts = weight_map["weights"]["language_model.model.layers.1.mlp.experts.gate_up_proj"]
    assert [len(group["tensors"]) for group in experts["sources"]] == [384, 384]
    assert experts["sources"][0]["storage"]["format"] == "compressed-tensors/pack-quantized"
    # text: 3 tensors per routed expert; vision: 443 weights, q/k/v weight+bias of 27 layers from 2 wqkv
    vision = 443 - 27 * 4
    assert weight_map["checkpoint_tensors"] == 60 * 3 * 384 + (975 - 60 * 2) + vision
    vision = data["extraction"]["graphs"]["vision"]
    assert vision["layers"] == 27 and vision["path"] == str(out / "kimi_k25_text_vision_ir.json")
    for kind in ("prefill", "decode"):
        graph = data["extraction"]["graphs"][kind]
        assert (graph["layers"], graph["path"]) == (61, str(out / f"kimi_k25_text_{kind}_ir.json"))


def test_apply_backend_none_builds_without_extracting(tmp_path):
    result = run("apply", str(REPO / "specs" / "kimi_k25.yaml"), "--backend", "none", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert "extraction" not in data
    assert {e["id"]: e["status"] for e in data["ledger"]["entries"]}["K1"] == "not for this backend"


def test_apply_rejects_bad_sizes_before_building(tmp_path):
    result = run(
        "apply", str(REPO / "specs" / "kimi_k25.yaml"), "--prefill-len", "4096", "--output-dir", str(tmp_path)
    )
    assert result.exit_code == 1
    assert "prefill_len" in result.output and "max_cache_len" in result.output
    assert list(tmp_path.iterdir()) == []


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
    assert (
        shown.exit_code == 1
        and "pins are stale" in shown.output
        and "+    pin:" in shown.output
        and "source_sha256" in shown.output
    )
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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["apply", "llama", "--device", "bogus"], "is not a torch device"),
        (["simulate", "llama"], "one of: a100, atlas_800_a3, b200, gb200, h100, h200, h800"),
        (["simulate", "llama", "--device", "h200", "--query-len", "0"], "0 is not in the range"),
        (["simulate", "llama", "--device", "h200", "--batch", "1000000000000"], "is not in the range"),
        (["simulate", "llama", "--device", "h200", "--tp", "0"], "0 is not in the range"),
    ],
)
def test_bad_command_line_values_are_usage_errors(args, message):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_simulate_help_names_devices_that_exist():
    from kimi_adapter_core.backends.simulation.tables.device import known_devices

    text = CliRunner().invoke(cli, ["simulate", "--help"]).output
    listed = text.split("Device profile name:")[1].split("(see")[0]
    names = [name.strip(" ,\n") for name in listed.replace("\n", " ").split(",")]
    assert names and all(name in known_devices() for name in names)


def test_the_ledger_says_which_patches_the_export_never_reached(tmp_path):
    """A patch is only "applied" when a call of the run reached it: a wrap on kadapt's own cache class
    (tried as a workaround) is installed but never runs for a module of the model, so the ledger says
    "not reached" and a note says it had no effect; a wrap on the model's own norm is reached."""
    shutil.copytree(REPO / "specs" / "llama", tmp_path / "llama")
    spec = tmp_path / "llama.yaml"
    spec.write_text(
        (REPO / "specs" / "llama.yaml").read_text()
        + """
patches:
  - id: W1
    why: Tried as a workaround for a cache that rejects new arguments.
    target: kimi_adapter_core.backends.extraction.runtime.abi:StaticStateCache.update
    kind: wrap
    backends: [extraction]
  - id: W2
    why: Runs for every norm of the model (a wrap without an implementation passes through).
    target: transformers.models.llama.modeling_llama:LlamaRMSNorm.forward
    kind: wrap
    backends: [extraction]
"""
    )
    result = CliRunner().invoke(
        cli, ["apply", str(spec), "--output-dir", str(tmp_path / "out"), "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    entries = {e["id"]: e for e in json.loads(result.stdout)["ledger"]["entries"]}
    assert (entries["W1"]["status"], entries["W1"]["reached"]) == ("not reached", 0)
    assert "no call during the export reached it" in entries["W1"]["reason"]
    assert entries["W2"]["status"] == "applied" and entries["W2"]["reached"] > 0
    target = "kimi_adapter_core.backends.extraction.runtime.abi:StaticStateCache.update"
    assert f"note: patch W1 (wrap {target}) had no effect" in result.stderr
    text = CliRunner().invoke(cli, ["apply", str(spec), "--output-dir", str(tmp_path / "out")])
    row = next(line for line in text.stdout.splitlines() if line.startswith("W1 "))
    assert "not reached" in row and " applied " not in row
