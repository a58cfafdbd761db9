"""Rope per layer type (issue 36): the description, the IR metadata and ``kadapt plan`` state it alike.

transformers 5 keeps Gemma-3's ``rope_parameters`` per layer type (full layers linear x8 with theta 1e6,
sliding ones default with theta 1e4). kadapt used to read that mapping as one flat rope and said
``rope default`` with no theta. A tiny Gemma-3 (2 layers: one sliding, one full) is described from its
config object and its raw JSON, exported and planned; a plain uniform rope keeps its old metadata.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from transformers import Gemma3TextConfig

from kimi_adapter_core.cli import cli
from kimi_adapter_core.structure.derive import derive_structure

REPO = Path(__file__).resolve().parents[1]
FULL = "rope linear x8 theta 1e6 (full_attention)"
SLIDING = "default theta 1e4 (sliding_attention)"
FULL_DATA = {"type": "linear", "theta": 1000000.0, "factor": 8.0}
SLIDING_DATA = {"type": "default", "theta": 10000.0}

TINY_GEMMA3: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "query_pre_attn_scalar": 16,
    "sliding_window": 8,
    "sliding_window_pattern": 2,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    },
    "tie_word_embeddings": True,
}

SPEC = """\
apiVersion: kadapt/v1
kind: AdapterSpec
metadata: {name: tiny_gemma3}
gate: {model_type: gemma3_text}
source: {config: tiny_gemma3/config.json}
config_bridges:
  - {id: X1, why: export needs it, op: set, path: _attn_implementation, value: eager, backends: [extraction]}
module_paths: {language_model: model, language_layers: model.layers, lm_head: lm_head}
abi:
  batch: 1
  prefill_len: 16
  max_cache_len: 64
  dtype: float32
  prefill:
    inputs: [input_ids, attention_mask, position_ids]
    outputs: [logits, "present.{layer}.key", "present.{layer}.value"]
  decode:
    inputs:
      [input_ids, attention_mask, position_ids, cache_position, "past.{layer}.key", "past.{layer}.value"]
    outputs: [logits, "present.{layer}.key", "present.{layer}.value"]
backends:
  simulation: {model_type: gemma3_text, quant_modes: [BF16], mtp_module_name: null}
"""


def _config_object() -> Gemma3TextConfig:
    fields = {k: v for k, v in TINY_GEMMA3.items() if k not in ("architectures", "model_type")}
    return Gemma3TextConfig(**fields)


def _run(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rope")
    (root / "tiny_gemma3").mkdir()
    (root / "tiny_gemma3" / "config.json").write_text(json.dumps(TINY_GEMMA3))
    (root / "tiny_gemma3.yaml").write_text(SPEC)
    return root / "tiny_gemma3.yaml"


@pytest.fixture(scope="module")
def ir_rope(spec_path: Path) -> dict[str, Any]:
    """The rope the prefill IR's metadata states."""
    out = spec_path.parent / "out"
    _run("apply", str(spec_path), "--output-dir", str(out), "--no-cache")
    document = json.loads((out / "tiny_gemma3_prefill_ir.json").read_text())
    return document["metadata"]["structure"]["rope"]


@pytest.mark.parametrize("source", ["object", "json"])
def test_description_states_full_layers_rope(source: str) -> None:
    config = _config_object() if source == "object" else TINY_GEMMA3
    assert FULL in derive_structure(config).describe()


@pytest.mark.parametrize("source", ["object", "json"])
def test_description_states_sliding_layers_rope(source: str) -> None:
    config = _config_object() if source == "object" else TINY_GEMMA3
    assert SLIDING in derive_structure(config).describe()


def test_config_object_and_raw_json_describe_the_same_rope() -> None:
    assert derive_structure(_config_object()).rope == derive_structure(TINY_GEMMA3).rope


def test_ir_metadata_states_full_layers_rope(ir_rope: dict[str, Any]) -> None:
    assert ir_rope["by_layer_type"]["full_attention"] == FULL_DATA


def test_ir_metadata_states_sliding_layers_rope(ir_rope: dict[str, Any]) -> None:
    assert ir_rope["by_layer_type"]["sliding_attention"] == SLIDING_DATA


def test_ir_metadata_says_the_rope_is_per_layer_type(ir_rope: dict[str, Any]) -> None:
    assert (ir_rope["type"], ir_rope["theta"]) == ("per_layer_type", None)


def test_plan_text_states_full_layers_rope(spec_path: Path) -> None:
    assert FULL in _run("plan", str(spec_path))


def test_plan_text_states_sliding_layers_rope(spec_path: Path) -> None:
    assert SLIDING in _run("plan", str(spec_path))


def test_plan_json_states_the_rope_the_ir_metadata_states(spec_path: Path, ir_rope: dict[str, Any]) -> None:
    architecture = json.loads(_run("plan", str(spec_path), "--format", "json"))["architecture"]
    assert architecture["structure"]["rope"] == ir_rope


def test_plan_json_description_is_the_structure_line(spec_path: Path) -> None:
    architecture = json.loads(_run("plan", str(spec_path), "--format", "json"))["architecture"]
    assert architecture["description"] == derive_structure(TINY_GEMMA3).describe()


def test_a_null_layer_type_entry_has_no_rope() -> None:
    """A layer type whose entry is null (transformers skips it: no rope there) is stated as ``none``."""
    config = {**TINY_GEMMA3, "layer_types": ["sliding_attention", "full_attention"]}
    config["rope_parameters"] = {**TINY_GEMMA3["rope_parameters"], "full_attention": None}
    assert derive_structure(config).describe().endswith(f"rope none (full_attention), {SLIDING}")


def test_uniform_rope_description_states_its_scaling() -> None:
    """One rope for every layer: its type and scaling (test_rope_facts.py), no theta (the JSON has it)."""
    llama = derive_structure(json.loads((REPO / "specs" / "llama" / "config.json").read_text()))
    expected = (
        "32 layers, hidden 4096, GQA 32 heads / 8 KV heads x 128, dense MLP 14336, "
        "rope llama3 x8 from 8192 positions"
    )
    assert llama.describe() == expected


def test_plain_uniform_rope_metadata_is_unchanged() -> None:
    mistral = derive_structure(json.loads((REPO / "specs" / "mistral" / "config.json").read_text()))
    assert list(mistral.to_dict()["rope"].items()) == [("type", "default"), ("theta", 10000.0)]
