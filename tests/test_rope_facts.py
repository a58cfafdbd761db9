"""Rope facts in plan's and simulate's label and JSON (audit finding 9): what changes the positions.

A user auditing ``kadapt plan`` on the newest specs found the label read as if every head rotated whole
(Qwen3-Next and Qwen3.5 rotate a quarter: ``partial_rotary_factor``), a single yarn rope without its
factor (Kimi-K2.5, DeepSeek-V3.2) and Llama-4's NoPE layers (every 4th) said nothing of. The structure
now states the scaling factor and the context it stretches, the rotated share of each head (per layer
type where the config keeps one rope per type: Gemma-4's full layers) and the layers without rope, in
the label and the JSON, read alike from the raw config.json and the config object transformers builds.
A plain rope (Mistral) and a model without rope (Kimi-Linear) read as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from transformers import DeepseekV3Config

from kimi_adapter_core.cli import cli
from kimi_adapter_core.loading import load_config
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.derive import derive_structure
from kimi_adapter_core.structure.of_spec import structure_of_config, structure_of_raw

REPO = Path(__file__).resolve().parents[1]
SCOUT_NOPE = [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47]
# spec -> (what the label says of its rope, what plan's JSON states)
STATED: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_next": (
        "rope default partial 0.25",
        {"type": "default", "theta": 1e7, "partial_rotary_factor": 0.25},
    ),
    "qwen3_5_moe": (
        "rope default partial 0.25",
        {"type": "default", "theta": 1e7, "partial_rotary_factor": 0.25},
    ),
    "kimi_k25": (
        "rope yarn x64 from 4096 positions",
        {"type": "yarn", "theta": 50000.0, "factor": 64.0, "original_max_position_embeddings": 4096},
    ),
    "deepseek_v32": (
        "rope yarn x40 from 4096 positions",
        {"type": "yarn", "theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096},
    ),
    "llama4_scout": (
        f"rope llama3 x16 from 8192 positions, 12/48 layers without rope {SCOUT_NOPE}",
        {
            "type": "llama3",
            "theta": 500000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 8192,
            "nope_layers": SCOUT_NOPE,
        },
    ),
    "gemma4_31b": (
        "rope proportional partial 0.25 theta 1e6 (full_attention), default theta 1e4 (sliding_attention)",
        {
            "type": "per_layer_type",
            "theta": None,
            "by_layer_type": {
                "full_attention": {"type": "proportional", "theta": 1e6, "partial_rotary_factor": 0.25},
                "sliding_attention": {"type": "default", "theta": 1e4},
            },
        },
    ),
    # unchanged: a plain rope and no rope at all; Nemotron-H's config states a rope_theta (and a whole-head
    # partial_rotary_factor 1.0), but transformers' NemotronHAttention applies no rope (config_keys ``fixed``)
    "mistral": ("rope default", {"type": "default", "theta": 10000.0}),
    "nemotron_h": ("rope none", {"type": "none", "theta": None}),
    "kimi_linear": ("rope none", {"type": "none", "theta": None}),
}


def _plan(spec: str, *options: str) -> str:
    result = CliRunner().invoke(cli, ["plan", str(REPO / "specs" / f"{spec}.yaml"), *options])
    assert result.exit_code == 0, result.output
    return result.stdout


def _shipped(name: str) -> Any:
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    return spec, json.loads(spec.source.config.read_text())


@pytest.mark.parametrize("spec", sorted(STATED))
def test_plan_text_states_the_rope(spec: str) -> None:
    label, _ = STATED[spec]
    architecture = _plan(spec).split("\n\n")[1]
    assert f", {label}" in architecture.replace("\n  ", " ")


@pytest.mark.parametrize("spec", sorted(STATED))
def test_plan_json_states_the_rope(spec: str) -> None:
    label, data = STATED[spec]
    architecture = json.loads(_plan(spec, "--format", "json"))["architecture"]
    assert architecture["structure"]["rope"] == data
    assert f", {label}" in architecture["description"]


def test_plain_rope_label_ends_as_before() -> None:
    """Mistral's label still ends at its rope type: no theta, no scaling of a rope that has none."""
    spec, raw = _shipped("mistral")
    assert structure_of_raw(spec, raw).describe().endswith(", 32/32 sliding-window layers, rope default")


@pytest.mark.compat
@pytest.mark.parametrize("spec", ["qwen3_next", "qwen3_5_moe", "kimi_k25", "llama4_scout", "gemma4_31b"])
def test_config_object_states_the_rope_of_its_json(spec: str) -> None:
    """transformers moves a top-level partial_rotary_factor into rope_parameters and fills a stretching
    rope's original context: the built config reads as its config.json."""
    loaded, raw = _shipped(spec)
    assert structure_of_config(loaded, load_config(loaded)).rope == structure_of_raw(loaded, raw).rope


@pytest.mark.compat
def test_yarn_without_original_context_stretches_max_positions() -> None:
    """A yarn mapping without original_max_position_embeddings scales from max_position_embeddings, as
    ``standardize_rope_params`` fills it; the config object and its JSON agree."""
    config = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "vocab_size": 32,
        "num_attention_heads": 4,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 8.0},
    }
    raw = derive_structure(config)
    built = derive_structure(DeepseekV3Config(**{k: v for k, v in config.items() if k != "model_type"}))
    assert raw.rope.describe() == "rope yarn x8 from 2048 positions" and built.rope == raw.rope


def test_no_rope_layers_list_names_the_nope_layers() -> None:
    """A ``no_rope_layers`` list (1: the layer rotates) wins over the interval, and its NoPE layers are
    the full-attention ones of Llama-4's chunk rule."""
    _, raw = _shipped("llama4_scout")
    flags = [1] * 48
    flags[0] = flags[47] = 0
    found = derive_structure({**raw, "no_rope_layers": flags})
    assert found.rope.nope_layers == (0, 47)
    assert [layer.index for layer in found.layers if layer.attention == "full"] == [0, 47]
    assert found.describe().endswith("rope llama3 x16 from 8192 positions, 2/48 layers without rope [0, 47]")


def test_simulate_label_states_the_rope() -> None:
    """``kadapt simulate``'s JSON carries the same label (its ``model``)."""
    args = ["simulate", str(REPO / "specs" / "qwen3_next.yaml"), "--device", "h200", "--format", "json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model"].endswith(", rope default partial 0.25")
