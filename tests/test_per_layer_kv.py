"""Attention layers whose KV shapes differ per layer (issue 36, the per-layer state contract).

MiMo-V2-Flash's sliding layers have twice the config's KV heads (its modelling code says so, no key
does); Gemma-4's full-attention layers are ``global_head_dim`` wide (its config's ``per_layer_config``).
The structure says each layer's shape from transformers' own view, the KV mapping and the decode inputs
carry each layer's own, the plan sizes each layer's bytes, and a stack whose layers all cache one shape
keeps the mapping it always had. ``--verify`` on a tiny MiMo, two ragged rows through a paged pool,
compares logits and every returned state with transformers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from transformers import Gemma4TextConfig, MiMoV2FlashConfig

from kimi_adapter_core.backends.extraction import options_from_spec, verify
from kimi_adapter_core.backends.extraction.job.pipeline import check_kv_dims
from kimi_adapter_core.backends.extraction.options import bind_structure
from kimi_adapter_core.backends.extraction.runtime import abi
from kimi_adapter_core.backends.simulation.estimate.planner import kv_sizing
from kimi_adapter_core.backends.simulation.model.params import Naming, text_groups
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError, Refusal
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.derive import derive_structure, refuse_unmodelled
from kimi_adapter_core.upstream import LayerProtocol

# tiny MiMo (families.tiny): 2 layers, full then sliding, 4 heads of 16, 2 KV heads (sliding: 4)
FULL, SLIDING = ((2, 16), (2, 16)), ((4, 16), (4, 16))


def mimo(**changes: Any) -> dict[str, Any]:
    return {**tiny_config("mimo_v2_flash"), **changes}


def mimo_object(raw: dict[str, Any]) -> MiMoV2FlashConfig:
    return MiMoV2FlashConfig(**{k: v for k, v in raw.items() if k != "model_type"})


def test_mimo_sliding_layers_cache_twice_the_kv_heads_by_its_code_kept_as_data() -> None:
    raw = mimo()
    assert raw["layer_types"] == ["full_attention", "sliding_attention"]
    structure = derive_structure(raw)
    assert structure.layer_kv_dims("heads") == (FULL, SLIDING)
    assert structure.kv_dims(1, "heads") == SLIDING and structure.attention.kv_dims("heads") == FULL
    assert structure.layers[0].attention_shape is None
    assert structure.layers[1].attention_shape is not None
    assert structure.layers[1].attention_shape.kind == "mha"  # 4 heads over 4 KV heads
    assert "1/2 layers MHA 4 heads / 4 KV heads x 16" in structure.describe()
    assert derive_structure(mimo_object(raw)) == structure  # the config object reads alike
    layers = structure.to_dict()["layers"]
    assert "attention_shape" not in layers[0] and layers[1]["attention_shape"]["num_kv_heads"] == 4


def test_mimo_values_keep_their_own_width() -> None:
    """MiMo's values are narrower than its keys (``v_head_dim``): every layer caches that width."""
    structure = derive_structure(mimo(head_dim=24, v_head_dim=16))
    assert structure.layer_kv_dims("heads") == (((2, 24), (2, 16)), ((4, 24), (4, 16)))


def gemma4(**changes: Any) -> Gemma4TextConfig:
    values = {
        "num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "vocab_size": 128,
        "sliding_window": 8, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "hidden_size_per_layer_input": 0,
    }  # fmt: skip
    return Gemma4TextConfig(**{**values, **changes})


def test_gemma4_full_layers_take_the_per_layer_config_as_transformers_reads_it() -> None:
    config = gemma4()
    wide = ((2, 32), (2, 32))
    narrow = ((2, 16), (2, 16))
    for source in (config, config.to_dict()):  # the object's per-layer view and its JSON's overrides
        assert derive_structure(source).layer_kv_dims("heads") == (narrow, narrow, wide)
    # a config.json without per_layer_config: the class's rule (config_keys.yaml) builds the same
    bare = {k: v for k, v in config.to_dict().items() if k != "per_layer_config"}
    assert derive_structure({**bare, "global_head_dim": 32}) == derive_structure(config)
    assert derive_structure(bare).kv_dims(2, "heads") == ((2, 512), (2, 512))  # the class's default
    shared = gemma4(attention_k_eq_v=True, num_global_key_value_heads=1)
    assert derive_structure(shared).kv_dims(2, "heads") == ((1, 32), (1, 32))
    assert derive_structure(shared).layer_attention(2).kind == "mqa"


def test_other_per_layer_attributes_and_bad_overrides_are_refused_with_their_reason() -> None:
    raw = gemma4().to_dict()
    with pytest.raises(Refusal) as other:
        derive_structure({**raw, "per_layer_config": {"2": {"intermediate_size": 256}}})
    assert other.value.code == "per-layer-config"
    assert "per_layer_config['2'] overrides intermediate_size" in other.value.message
    # plain validate's check on the raw JSON, before any config class
    with pytest.raises(Refusal, match=r"per_layer_config\['2'\] overrides intermediate_size"):
        refuse_unmodelled({**raw, "per_layer_config": {"2": {"intermediate_size": 256}}})
    with pytest.raises(KadaptError, match=r"per_layer_config names layer '7'; expected 0..2"):
        derive_structure({**raw, "per_layer_config": {"7": {"head_dim": 32}}})
    with pytest.raises(KadaptError, match="layer 2's 3 KV heads do not split the 4 attention heads"):
        derive_structure({**raw, "per_layer_config": {"2": {"num_key_value_heads": 3}}})
    with pytest.raises(KadaptError, match=r"layer 2's head_dim is 0; expected a positive integer"):
        derive_structure({**raw, "per_layer_config": {"2": {"head_dim": 0}}})


@pytest.mark.parametrize(
    ("changes", "code", "key"),
    [
        ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
         "layer-mlp", "enable_moe_block = True"),
    ],
)
def test_gemma4_features_kadapt_lacks_are_refused_by_their_key(changes: dict, code: str, key: str) -> None:
    """What Gemma-4 needs beyond per-layer shapes, KV sharing and per-layer embeddings (a dense MLP beside
    routed experts): refused by name, object and JSON alike."""
    config = gemma4(**changes)
    for source in (config, config.to_dict()):
        with pytest.raises(Refusal) as refused:
            derive_structure(source)
        assert refused.value.code == code and key in refused.value.message
    with pytest.raises(Refusal, match=code):
        refuse_unmodelled(config.to_dict())  # plain validate, on the raw JSON


NAMES = {
    "prefill_key": "k.{layer}", "prefill_value": "v.{layer}", "decode_key_in": "pk.{layer}",
    "decode_value_in": "pv.{layer}", "decode_key_out": "k.{layer}", "decode_value_out": "v.{layer}",
}  # fmt: skip


def mapping(kv_dims: Any, **extra: Any) -> dict[str, Any]:
    return abi.build_kv_mapping(
        kv_dims, kv_layout="heads", batch=1, prefill_len=8, max_cache_len=32, num_layers=2,
        dtype="float32", names=NAMES, **extra,
    )  # fmt: skip


def test_the_mapping_states_each_layers_shape_only_where_layers_differ() -> None:
    per_layer = mapping(FULL, layer_kv_dims=(FULL, SLIDING))
    full, sliding = per_layer["layers"]
    assert full["cache"] == {"key": {"heads": 2, "dim": 16}, "value": {"heads": 2, "dim": 16}}
    assert sliding["cache"] == {"key": {"heads": 4, "dim": 16}, "value": {"heads": 4, "dim": 16}}
    assert full["prefill_key_output"]["shape"] == [1, 2, 8, 16]
    assert sliding["prefill_key_output"]["shape"] == [1, 4, 8, 16]
    assert sliding["decode_value_input"]["shape"] == [1, 4, 32, 16]
    cache = per_layer["contract"]["cache"]
    assert "heads" not in cache["key"] and cache["per_layer"] == abi.PER_LAYER_KV_RULE
    paged = mapping(FULL, layer_kv_dims=(FULL, SLIDING), paged=abi.PagedKV(8, 12, "block_table"))
    assert paged["layers"][1]["decode_key_input"]["shape"] == [12, 8, 4, 16]
    assert paged["layers"][0]["decode_key_input"]["shape"] == [12, 8, 2, 16]
    assert "(layers[i].cache's heads and dim)" in paged["contract"]["paged"]["pool"]
    # a stack whose layers cache one shape: no per-layer key anywhere, the mapping it always had
    uniform = derive_structure(tiny_config("llama"))
    assert uniform.layer_kv_dims("heads") is None
    plain = mapping(uniform.attention.kv_dims("heads"))
    assert mapping(uniform.attention.kv_dims("heads"), layer_kv_dims=None) == plain
    assert "cache" not in plain["layers"][0] and "per_layer" not in plain["contract"]["cache"]
    assert plain["contract"]["cache"]["key"]["heads"] == 2
    assert all("attention_shape" not in run for run in uniform.to_dict()["layers"])


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v3", "qwen3_next", "gemma3_text", "llama4_text"])
def test_stacks_of_one_shape_state_no_per_layer_shape(model_type: str) -> None:
    """GQA, MLA (whose latent is not a per-head shape), hybrid, sliding and chunked stacks: no layer has
    a shape of its own, so nothing they write changes."""
    structure = derive_structure(tiny_config(model_type))
    assert all(layer.attention_shape is None for layer in structure.layers)
    assert structure.layer_kv_dims(structure.attention.default_kv_layout) is None
    assert kv_sizing(structure, tp=1).layer_attentions == ()


def test_decode_inputs_take_each_layers_shape() -> None:
    inputs = abi.decode_inputs(
        FULL, batch=1, position=3, max_cache_len=16, num_layers=2, dtype=abi.torch.float32,
        layer_kv_dims=(FULL, SLIDING), paged=(8, 4),
    )  # fmt: skip
    *_, key0, value0, key1, value1 = inputs
    assert tuple(key0.shape) == (4, 8, 2, 16) and tuple(value1.shape) == (4, 8, 4, 16)


def test_the_plan_sizes_each_layers_kv_bytes() -> None:
    """Published MiMo-V2-Flash defaults: 48 layers, full at 0 and every 6th (9), the rest sliding (39,
    window 129); 4 KV heads (sliding 8) of 192-wide keys and 128-wide values, bf16."""
    kv = kv_sizing(derive_structure(MiMoV2FlashConfig()), tp=8, kv_dtype="bf16")
    full, sliding = 4 * (192 + 128) * 2, 8 * (192 + 128) * 2  # 2560 B, 5120 B per token per layer
    assert sorted(set(kv.layer_bytes_per_token())) == [full, sliding]
    assert kv.bytes_per_token == 9 * full + 39 * sliding == 222_720
    tokens = 1000
    assert kv.kv_bytes(tokens, per_rank=False) == tokens * 9 * full + 129 * 39 * sliding
    # tp=8: 4 KV heads replicated to one per rank, 8 split to one: (192 + 128) x 2 B on every layer
    assert kv.kv_bytes(tokens) == (tokens * 9 + 129 * 39) * 640
    uniform = kv_sizing(derive_structure(tiny_config("llama")), tp=1)
    assert uniform.layer_attentions == ()
    assert uniform.bytes_per_token == uniform.bytes_per_token_layer * uniform.layers


def test_kadapt_plan_states_each_layers_bytes(tmp_path: Path) -> None:
    """The tiny MiMo's plan: the full layer caches 2 x (16 + 16) bf16 elements per token (128 B), the
    sliding one 4 x (16 + 16) (256 B) of at most its 8-token window, over 256 positions."""
    spec = mimo_spec(tmp_path)
    document = CliRunner().invoke(cli, ["plan", str(spec.path), "--format", "json"])
    assert document.exit_code == 0, document.output
    kv = json.loads(document.stdout)["kv_cache"]
    assert kv["layer_bytes_per_token"] == [128, 256] and kv["bytes_per_token"] == 384
    assert kv["bytes_per_sequence"] == 256 * 128 + 8 * 256
    text = CliRunner().invoke(cli, ["plan", str(spec.path)])
    assert "per-layer shape: 1/2 layers cache MHA 4 heads / 4 KV heads x 16, 256 B per token" in text.output


def test_the_plan_inventory_sizes_the_sliding_layers_own_projections() -> None:
    structure = derive_structure(mimo())
    naming = Naming("model", "model.layers", "lm_head", ())
    groups = {g.name: g for g in text_groups(structure, naming)}
    full, sliding = groups["attn.k_proj"], groups["attn.k_proj.4x16"]
    assert full.tensor_shapes == ((2 * 16, 64),)
    assert full.checkpoint_names == (("model.layers.0.self_attn.k_proj.weight",),)
    assert sliding.tensor_shapes == ((4 * 16, 64),)
    assert sliding.checkpoint_names == (("model.layers.1.self_attn.k_proj.weight",),)
    assert len(groups["attn.layer_norms"].checkpoint_names) == 2  # every layer's norms, once


def test_the_probe_is_held_against_each_layers_shape(tmp_path: Path) -> None:
    spec = mimo_spec(tmp_path)
    structure = derive_structure(mimo())
    options = bind_structure(options_from_spec(spec, output_dir=tmp_path / "out"), structure)
    check_kv_dims(options, LayerProtocol("cache", FULL, layer_kv_dims=(FULL, SLIDING)))
    with pytest.raises(Refusal) as differs:
        check_kv_dims(options, LayerProtocol("cache", FULL, layer_kv_dims=(FULL, FULL)))
    assert differs.value.code == "stack-differs"
    assert "layer 1's MHA 4 heads / 4 KV heads x 16" in differs.value.message
    assert "but the layer caches ((2, 16), (2, 16))" in differs.value.message
    # a protocol stating one shape for the stack is held against every attention layer's own
    with pytest.raises(Refusal) as one:
        check_kv_dims(options, LayerProtocol("cache", FULL))
    assert "layer 1's" in one.value.message and "but the layer caches ((2, 16), (2, 16))" in one.value.message


SPEC = """\
apiVersion: kadapt/v1
kind: AdapterSpec
metadata: {name: mimo_v2_flash}
gate: {model_type: mimo_v2_flash}
source: {config: mimo_v2_flash/config.json}
config_bridges:
  - {id: X1, why: eager attention exports as plain ops, op: set, path: _attn_implementation,
     value: eager, backends: [extraction]}
  - {id: X2, why: batched_mm experts export with static shapes, op: set,
     path: _experts_implementation, value: batched_mm, backends: [extraction]}
module_paths: {language_model: model, language_layers: model.layers, lm_head: lm_head}
abi:
  batch: 2
  prefill_len: 8
  max_cache_len: 64
  dtype: float32
  kv_cache: {kind: paged, block_size: 8}
  prefill:
    inputs: [input_ids, attention_mask, position_ids]
    outputs: [logits, "k.{layer}", "v.{layer}"]
  decode:
    inputs: [input_ids, attention_mask, position_ids, cache_position, "pk.{layer}", "pv.{layer}"]
    outputs: [logits, "k.{layer}", "v.{layer}"]
"""


def mimo_spec(tmp_path: Path) -> Any:
    (tmp_path / "mimo_v2_flash").mkdir()
    (tmp_path / "mimo_v2_flash" / "config.json").write_text(json.dumps(mimo()))
    (tmp_path / "mimo_v2_flash.yaml").write_text(SPEC)
    return load_spec(tmp_path / "mimo_v2_flash.yaml")


def test_verify_proves_each_layers_kv_with_ragged_paged_rows(tmp_path: Path) -> None:
    """Two rows of different lengths through a paged pool: logits and each layer's keys and values
    (2 KV heads on the full layer, 4 on the sliding one) equal transformers' at every decode step."""
    spec = mimo_spec(tmp_path)
    options = dataclasses.replace(
        options_from_spec(spec, output_dir=tmp_path / "out"), verify_dtypes=("float32",)
    )
    report = verify(spec, options, echo=lambda line: None)
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    checks = {check.name: check.detail for check in report.checks}
    assert "2 attention layers, prefill + " in checks["returned states"]
    assert "paged, blocks out of order" in checks["ragged batch"]
