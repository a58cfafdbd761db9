"""Latent (MLA) attention layers whose shapes differ per layer (issue 36: dots3).

rednote's dots3 (``dots3_note_text``, ``dots3_note``) is a DeepSeek-style MLA stack whose sliding layers
have a ``per_layer_config`` of their own query heads, latent rank and nope width (64 heads, rank 1024,
192 against the DSA layers' 128, 512, 128). Each layer still caches one latent and one rope key per
token, of its own widths: the structure gives each layer its own ``Attention``, the KV mapping and
``--verify`` carry each layer's latent width, ``plan`` sizes each layer's bytes and projections,
``simulate`` traces and shards each shape as a kind of its own (a TP not dividing a layer's own heads
refused by name) and the generated module reads each layer's latent width from a config. A per-head KV
stack overriding those facts stays refused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from transformers import Dots3NoteTextConfig

from kimi_adapter_core.backends.extraction import options_from_spec, verify
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.backends.simulation.estimate.planner import kv_sizing
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.params import Naming, text_groups
from kimi_adapter_core.backends.simulation.search.grid import layouts
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError, Refusal
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import buildable_config, module_paths, write_spec
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.structure.derive import derive_structure

# families.tiny's dots3: layers 0-1 DSA (4 heads, latent 16, nope 16), layer 2 sliding with its own
# 2 heads, latent 32 and nope 32; rope 8, values 16
STACK, SLIDING = ((1, 16), (1, 8)), ((1, 32), (1, 8))


def dots3() -> dict[str, Any]:
    return tiny_config("dots3_note_text")


def dots3_spec(directory: Path, simulate: bool = False) -> Spec:
    config, built = buildable_config("dots3_note_text")
    path = write_spec(directory, "dots3_note_text", config, module_paths(built))
    if simulate:  # simulate swaps the MLA module for its serving kernel, found by the spec's class name
        path.write_text(path.read_text() + "mla:\n  attention_class: Dots3NoteTextAttention\n")
    return load_spec(path)


@pytest.mark.compat
def test_each_layer_takes_its_own_latent_shape_as_transformers_builds_it() -> None:
    raw = dots3()
    assert raw["per_layer_config"] == {
        "2": {
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 32,
            "head_dim": 40,  # nope + rope, as Dots3NoteTextConfig checks its sliding layers'
        }
    }
    structure = derive_structure(raw)
    assert structure.layer_kv_dims("latent") == (STACK, STACK, SLIDING)
    assert structure.layer_kv_dims("expanded") == (((4, 24), (4, 16)),) * 2 + (((2, 40), (2, 16)),)
    own = structure.layer_attention(2)
    assert (own.num_heads, own.kv_lora_rank, own.qk_nope_head_dim, own.head_dim) == (2, 32, 32, 40)
    assert own.q_lora_rank == structure.attention.q_lora_rank == 32
    assert "1/3 layers MLA 2 heads, kv_lora_rank 32" in structure.describe()
    # the config object (heterogeneous: its global heads refuse a read) describes the same structure
    config = Dots3NoteTextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert config.is_heterogeneous and derive_structure(config) == structure
    # transformers' own defaults: the 33 sliding layers' 64 heads, latent 1024, nope 192
    published = derive_structure(Dots3NoteTextConfig())
    assert published.kv_dims(2, "latent") == ((1, 1024), (1, 64))
    assert published.kv_dims(0, "latent") == ((1, 512), (1, 64))


def test_bad_latent_overrides_and_per_head_kv_ones_are_refused_with_their_reason() -> None:
    raw = dots3()
    layer = raw["per_layer_config"]["2"]
    with pytest.raises(KadaptError, match="layer 2's 4 KV heads differ from its 2 attention heads"):
        derive_structure({**raw, "per_layer_config": {"2": {**layer, "num_key_value_heads": 4}}})
    with pytest.raises(KadaptError, match="layer 2's kv_lora_rank is 0; expected a positive integer"):
        derive_structure({**raw, "per_layer_config": {"2": {**layer, "kv_lora_rank": 0}}})
    # a per-head KV stack carries a layer's KV heads and width only
    mimo = tiny_config("mimo_v2_flash")
    with pytest.raises(Refusal) as heads:
        derive_structure({**mimo, "per_layer_config": {"1": {"num_attention_heads": 2}}})
    assert heads.value.code == "per-layer-config"
    assert "override ['num_heads'] of a per-head KV attention" in heads.value.message


def test_the_plan_sizes_each_layers_latent_cache_and_projections() -> None:
    """Published dots3 defaults, bf16: the 13 DSA layers cache (512 + 64) x 2 B per token, the 33
    sliding ones (1024 + 64) x 2 B; the sliding layers' kv_b_proj expands their rank 1024 to 64 heads of
    nope 192 + values 128, the others' 512 to 128 heads of 128 + 128."""
    structure = derive_structure(Dots3NoteTextConfig())
    kv = kv_sizing(structure, tp=8, kv_dtype="bf16")
    assert sorted(set(kv.layer_bytes_per_token())) == [1152, 2176]
    assert kv.bytes_per_token == 13 * 1152 + 33 * 2176
    groups = {g.name: g for g in text_groups(structure, Naming("model", "model.layers", "lm_head", ()))}
    sliding, dsa = groups["attn.kv_b_proj.64x256"], groups["attn.kv_b_proj"]
    assert sliding.tensor_shapes == ((64 * (192 + 128), 1024),) and len(sliding.checkpoint_names) == 33
    assert dsa.tensor_shapes == ((128 * (128 + 128), 512),) and len(dsa.checkpoint_names) == 13
    assert groups["attn.kv_a_proj_with_mqa.64x256"].tensor_shapes == ((1024 + 64, 5120),)
    assert groups["attn.o_proj.64x256"].tensor_shapes == ((5120, 64 * 128),)


def test_kadapt_plan_states_each_layers_bytes_and_refuses_a_tp_splitting_no_layers_heads(
    tmp_path: Path,
) -> None:
    spec = dots3_spec(tmp_path)
    document = CliRunner().invoke(cli, ["plan", str(spec.path), "--tp", "2", "--format", "json"])
    assert document.exit_code == 0, document.output
    kv = json.loads(document.stdout)["kv_cache"]
    assert kv["layer_bytes_per_token"] == [(16 + 8) * 2, (16 + 8) * 2, (32 + 8) * 2]
    refused = CliRunner().invoke(cli, ["plan", str(spec.path), "--tp", "4"])
    assert refused.exit_code != 0
    assert "--tp 4 does not divide the 2 attention heads of layer 2" in refused.output


def test_simulate_traces_each_latent_shape_as_a_kind_of_its_own(tmp_path: Path) -> None:
    """At TP 2 a rank builds the sliding layer's 1 head of nope 32 + rope 8 (its per_layer_config's heads
    per rank, which its config class checks against its KV heads: was a rejected config) and the DSA
    layers' 2 of 16 + 8; an 8-token prefill attends 36 causal pairs per head (within the window of 8)."""
    spec = dots3_spec(tmp_path, simulate=True)
    command = ["simulate", str(spec.path), "--device", "h200", "--tp", "2", "--format", "json"]
    result = CliRunner().invoke(cli, [*command, "--query-len", "8"])
    assert result.exit_code == 0, result.output
    ops = {f"{op['scope']}/{op['op']}": op for op in json.loads(result.stdout)["ops"]}
    pairs = 8 * 9 // 2
    assert ops["moe.2x40/flash_attention_prefill"]["flops"] == 2 * pairs * (40 + 16) * 1
    assert ops["moe/flash_attention_prefill"]["flops"] == 2 * pairs * (24 + 16) * 2
    decode = CliRunner().invoke(cli, [*command, "--decode", "--context-len", "4"])
    assert decode.exit_code == 0, decode.output
    kernels = {f"{op['scope']}/{op['op']}" for op in json.loads(decode.stdout)["ops"]}
    assert {"moe.2x40/mla_decode_attention", "moe/sparse_mla_decode"} <= kernels
    # the sweep searches only the TP degrees that split the sliding layer's 2 heads too
    assert {par.tp for par in layouts(model_inputs(spec, None).arch.structure, 8)} == {1, 2}


@pytest.mark.compat
def test_verify_proves_each_layers_latent_cache(tmp_path: Path) -> None:
    """Logits and every returned state (the sliding layer's 32-wide latent beside the DSA layers' 16 and
    their indexer keys) equal transformers' on a tiny random dots3 that keeps the sliding layer's shape."""
    spec = dots3_spec(tmp_path)
    options = dataclasses.replace(
        options_from_spec(spec, output_dir=tmp_path / "out"), verify_dtypes=("float32",)
    )
    overrides = tiny_overrides(spec, options)
    assert overrides["per_layer_config"]["2"]["kv_lora_rank"] == 32
    report = verify(spec, options, echo=lambda line: None, keep_in=tmp_path / "out")
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    mapping = json.loads((tmp_path / "out" / "dots3_note_text_kv_mapping.json").read_text())
    assert [layer["cache"]["key"]["dim"] for layer in mapping["layers"]] == [16, 16, 32]
    assert mapping["layers"][2]["decode_key_input"]["shape"][-1] == 32


def test_the_verify_model_of_published_sizes_keeps_each_shape(tmp_path: Path) -> None:
    """A published-size dots3 (transformers' defaults): the tiny verify model's sliding layers get their
    own tiny heads, rank and nope (half, twice, twice the tiny stack's), its vision tower's per-layer
    experts cut to its one layer and its adapters the tiny widths, so the model builds."""
    _, built = buildable_config("dots3_note")
    (tmp_path / "default").mkdir()
    from transformers import Dots3NoteConfig

    raw = {**Dots3NoteConfig().to_dict(), "model_type": "dots3_note"}
    spec = load_spec(write_spec(tmp_path / "default", "dots3_note", raw, module_paths(built)))
    overrides = tiny_overrides(spec, options_from_spec(spec, output_dir=tmp_path / "out"))
    assert overrides["text_config.per_layer_config"] == {
        "02": {
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 32,
            "head_dim": 40,
        }
    }
    assert overrides["vision_config.per_layer_config"] == {}
    assert (
        overrides["vision_config.adapter_in_dim"] == 32 and overrides["vision_config.adapter_out_dim"] == 64
    )


def test_a_graph_below_float32_is_refused_before_export(tmp_path: Path) -> None:
    """dots3's forward computes its DSA layers' rotary embedding from float32 embeddings, so their indexer
    keys are float32 in a bfloat16 model, which the ABI (every indexer key in abi.dtype) does not state:
    apply refuses, located at abi.dtype, and writes nothing."""
    path = dots3_spec(tmp_path).path
    path.write_text(path.read_text().replace("dtype: float32", "dtype: bfloat16"))
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["apply", str(path), "--output-dir", str(out)])
    assert result.exit_code != 0
    assert "refused (outside-layers)" in result.output
    assert "indexer keys are float32" in result.output
    assert load_spec(path).locate("abi.dtype") in result.output
    assert not out.exists() or not any(out.iterdir())
