"""``kadapt generate`` for attention layers that cache different KV shapes (issue 36).

MiMo-V2-Flash's sliding layers have twice the config's KV heads (its modelling code says so, no key does)
and values narrower than its keys; Gemma-4-31B's full layers 4 KV heads of 512 against the sliding
layers' 16 of 256 (its config's ``per_layer_config``, built by the config class from a config.json that
has none). The generated extraction module, imported by path, bakes in each layer's KV dims
(``LAYER_KV_DIMS``) and reads them from a config built with overrides as kadapt does; on a tiny random
model its wrappers' logits and every layer's keys and values over a prefill and several decode steps
equal transformers' own ``DynamicCache``, its decode example inputs have each layer's shape (contiguous
or block pools) and its KV mapping states each layer's heads and width. The docs page states each
shape and its bytes per token. (``test_generated_module_roundtrip_1.py`` carries Gemma-4-31B's module
through torch_ir outside the checkout.)
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.modules import import_path
from transformers import DynamicCache

from kimi_adapter_core.backends.extraction import options_from_spec
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.generate import render_spec
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.structure.derive import derive_structure

REPO = Path(__file__).resolve().parents[1]
GEMMA = REPO / "specs" / "gemma4_31b.yaml"
# tiny MiMo (families.tiny), its keys 24 wide and its values 16: the full layer caches 2 KV heads, the
# sliding one 4
MIMO = {**tiny_config("mimo_v2_flash"), "head_dim": 24, "v_head_dim": 16}
MIMO_DIMS = (((2, 24), (2, 16)), ((4, 24), (4, 16)))
BATCH, PROMPT, CAPACITY, STEPS = 2, 9, 24, 4
TOLERANCE = 1e-4

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
KV_CACHE
  prefill:
    inputs: [input_ids, attention_mask, position_ids]
    outputs: [logits, "k.{layer}", "v.{layer}"]
  decode:
    inputs: [input_ids, attention_mask, position_ids, cache_position, "pk.{layer}", "pv.{layer}"]
    outputs: [logits, "k.{layer}", "v.{layer}"]
"""
PAGED = "  kv_cache: {kind: paged, block_size: 8}"


def mimo_spec(directory: Path, kv_cache: str = "") -> Spec:
    (directory / "mimo_v2_flash").mkdir()
    (directory / "mimo_v2_flash" / "config.json").write_text(json.dumps(MIMO))
    text = SPEC.replace("KV_CACHE\n", f"{kv_cache}\n" if kv_cache else "")
    (directory / "mimo_v2_flash.yaml").write_text(text)
    return load_spec(directory / "mimo_v2_flash.yaml")


def rendered(spec: Spec, target: str) -> dict[str, str]:
    files, _ = render_spec(spec, [target])
    return {str(item.path): item.text for item in files}


def module_of(spec: Spec, directory: Path, name: str) -> types.ModuleType:
    path = directory / "extraction.py"
    path.write_text(rendered(spec, "extraction")[f"adapters/{spec.name}/extraction.py"])
    return import_path(path, name)


@pytest.fixture(scope="module")
def mimo(tmp_path_factory: pytest.TempPathFactory) -> types.ModuleType:
    spec = mimo_spec(tmp_path_factory.mktemp("mimo_spec"))
    return module_of(spec, tmp_path_factory.mktemp("mimo_module"), "generated_mimo_extraction")


@pytest.fixture(scope="module")
def gemma() -> types.ModuleType:
    return import_path(REPO / "adapters" / "gemma4_31b" / "extraction.py", "generated_gemma4_31b_extraction")


def gemma_tiny() -> dict[str, Any]:
    """``--verify``'s tiny Gemma-4-31B: 5 sliding layers of 2 KV heads x 16, then a full one."""
    spec = load_spec(GEMMA)
    return tiny_overrides(spec, options_from_spec(spec, output_dir=REPO / "out" / "unused"))


def test_the_mimo_module_states_each_layers_kv_shape(mimo: types.ModuleType) -> None:
    """What the module states of its config is kadapt's structure of it (values narrower than keys
    included), and ``layer_kv_dims`` follows a config built with overrides, as object or JSON."""
    assert mimo.KV_DIMS == MIMO_DIMS[0] and mimo.LAYER_KV_DIMS == MIMO_DIMS
    assert mimo.layer_kv_dims(mimo.SOURCE_CONFIG) == mimo.LAYER_KV_DIMS
    config = mimo.text_config(mimo.load_config(overrides={"num_key_value_heads": 1, "head_dim": 8}))
    expected = (((1, 8), (1, 16)), ((2, 8), (2, 16)))
    assert mimo.layer_kv_dims(config) == expected == derive_structure(config).layer_kv_dims("heads")
    assert mimo.layer_kv_dims(config.to_dict()) == expected


@pytest.mark.compat
def test_the_gemma4_module_reads_the_per_layer_config_as_transformers_builds_it(
    gemma: types.ModuleType,
) -> None:
    """Gemma-4-31B: the shipped config.json has no per_layer_config (the module's rule builds the full
    layers' shape); a config object is heterogeneous (its per_layer_config read, its global head_dim
    refused by transformers and read as kadapt reads it)."""
    sliding, full = ((16, 256), (16, 256)), ((4, 512), (4, 512))
    assert gemma.LAYER_KV_DIMS == tuple(full if (i + 1) % 6 == 0 else sliding for i in range(60))
    assert gemma.layer_kv_dims(gemma.SOURCE_CONFIG) == gemma.LAYER_KV_DIMS
    config = gemma.text_config(gemma.load_config(overrides=gemma_tiny()))
    assert config.is_heterogeneous
    assert gemma.kv_dims(config) == ((2, 16), (2, 16))
    assert gemma.layer_kv_dims(config) == derive_structure(config).layer_kv_dims("heads")
    assert gemma.layer_kv_dims(config)[4:] == (((2, 16), (2, 16)), ((4, 512), (4, 512)))


def reference_states(cache: DynamicCache) -> list[torch.Tensor]:
    """transformers' cache in the ABI's order: each layer's keys and values (a sliding layer's last)."""
    return [state.clone() for layer in cache.layers for state in (layer.keys, layer.values)]


def assert_states_equal(ours: list[torch.Tensor], theirs: list[torch.Tensor], written: int) -> None:
    """Every layer's keys and values equal over the slots transformers keeps of the ``written`` ones."""
    assert len(ours) == len(theirs)
    for index, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        kept = reference.shape[2]
        mine = mine[:, :, written - kept : written]
        assert mine.shape == reference.shape, index
        assert (mine - reference).abs().max() <= TOLERANCE, index


def run_against_transformers(module: types.ModuleType, overrides: dict[str, Any]) -> list[torch.Tensor]:
    """Prefill and STEPS decode steps of ``module``'s wrappers, batch 2, on a float32 tiny random model:
    logits and every layer's keys and values equal transformers' with its own DynamicCache; the decode
    example inputs have the shapes the wrappers return. The last states."""
    torch.manual_seed(0)
    model = module.build_model(device="cpu", overrides=overrides, dtype=None)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.2 if parameter.dim() > 1 else 0.5)
    config = module.text_config(model.config)
    prefill, decode = module.prefill_wrapper(model), module.decode_wrapper(model)
    prompt = torch.randint(3, config.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    keyword = module.cache_keyword(model.model.layers[0])
    _, mask, positions = module.prefill_example_inputs("cpu", batch=BATCH, prefill_len=PROMPT, dtype=None)
    with torch.no_grad():
        reference = model(prompt, **{keyword: cache}, use_cache=True).logits
        logits, *present = prefill(prompt, mask, positions)
    assert (logits - reference).abs().max() <= TOLERANCE
    assert_states_equal(present, reference_states(cache), PROMPT)
    example = module.decode_example_inputs(
        config, "cpu", batch=BATCH, position=PROMPT, max_cache_len=CAPACITY, dtype=None
    )
    states = module.place_prefill_kv(present, CAPACITY)
    assert [(t.shape, t.dtype) for t in example[4:]] == [(t.shape, t.dtype) for t in states]
    token = logits[:, -1:].argmax(-1)
    for step in range(STEPS):
        position = PROMPT + step
        positions = torch.full((BATCH, 1), position)
        mask = module.additive_causal_mask(positions, CAPACITY, torch.float32)
        with torch.no_grad():
            reference = model(token, **{keyword: cache}, use_cache=True).logits
            logits, *states = decode(token, mask, positions, positions.view(-1), *states)
        assert (logits - reference).abs().max() <= TOLERANCE, step
        assert_states_equal(states, reference_states(cache), position + 1)
        token = logits[:, -1:].argmax(-1)
    return states


@pytest.mark.compat
def test_the_mimo_module_carries_each_layers_kv_as_transformers_does(mimo: types.ModuleType) -> None:
    states = run_against_transformers(mimo, {})
    assert [tuple(t.shape[1:]) for t in states] == [(2, CAPACITY, 24), (2, CAPACITY, 16)] + [
        (4, CAPACITY, 24),
        (4, CAPACITY, 16),
    ]


@pytest.mark.compat
def test_the_gemma4_module_carries_each_layers_kv_as_transformers_does(gemma: types.ModuleType) -> None:
    """The full layer's 4 KV heads of 512 (its values the key projection's, normed apart) beside the
    sliding layers' 2 of 16, each in its own shape."""
    states = run_against_transformers(gemma, gemma_tiny())
    assert [tuple(t.shape[1:]) for t in states[8:]] == [(2, CAPACITY, 16)] * 2 + [(4, CAPACITY, 512)] * 2


# dots3 (families.tiny) with its DSA layers full attention (generate refuses a stack mixing DSA layers with
# others): its sliding layer's own 2 heads, latent rank 32 and nope 32 beside the stack's 4, 16, 16
DOTS3 = {
    **{key: value for key, value in tiny_config("dots3_note_text").items() if key != "rope_parameters"},
    "layer_types": ["full_attention", "full_attention", "sliding_attention"],
}


@pytest.fixture(scope="module")
def dots3(tmp_path_factory: pytest.TempPathFactory) -> types.ModuleType:
    directory = tmp_path_factory.mktemp("dots3_spec")
    (directory / "dots3_note_text").mkdir()
    (directory / "dots3_note_text" / "config.json").write_text(json.dumps(DOTS3))
    (directory / "dots3_note_text.yaml").write_text(
        SPEC.replace("KV_CACHE\n", "").replace("mimo_v2_flash", "dots3_note_text")
    )
    spec = load_spec(directory / "dots3_note_text.yaml")
    return module_of(spec, tmp_path_factory.mktemp("dots3_module"), "generated_dots3_extraction")


@pytest.mark.compat
def test_the_dots3_module_carries_each_layers_latent_cache_as_transformers_does(
    dots3: types.ModuleType,
) -> None:
    """Each layer's latent width (the sliding layer's 32, its per_layer_config's) baked in, read from a
    heterogeneous config object or its JSON as kadapt reads it, and carried as transformers caches it."""
    stack, sliding = ((1, 16), (1, 8)), ((1, 32), (1, 8))
    assert dots3.LAYER_KV_DIMS == (stack, stack, sliding) == dots3.layer_kv_dims(dots3.SOURCE_CONFIG)
    wider = {"2": {**DOTS3["per_layer_config"]["2"], "kv_lora_rank": 48}}
    config = dots3.text_config(dots3.load_config(overrides={"per_layer_config": wider}))
    assert config.is_heterogeneous
    expected = (stack, stack, ((1, 48), (1, 8)))
    assert dots3.layer_kv_dims(config) == expected == derive_structure(config).layer_kv_dims("latent")
    assert dots3.layer_kv_dims(config.to_dict()) == expected
    states = run_against_transformers(dots3, {})
    assert [tuple(t.shape[1:]) for t in states] == [(1, CAPACITY, 16), (1, CAPACITY, 8)] * 2 + [
        (1, CAPACITY, 32),
        (1, CAPACITY, 8),
    ]


def test_the_kv_mapping_and_paged_inputs_take_each_layers_shape(tmp_path: Path) -> None:
    """A paged MiMo module: each layer's block pools in its own shape, the mapping's entries state each
    layer's heads and widths, the contract's cache says they do, as kadapt apply's mapping does."""
    (tmp_path / "spec").mkdir()
    spec = mimo_spec(tmp_path / "spec", PAGED)
    paged = module_of(spec, tmp_path, "generated_paged_mimo_extraction")
    config = paged.text_config(paged.load_config())
    inputs = paged.decode_example_inputs(config, max_cache_len=64)
    block_table, *pools = inputs[4:]
    assert tuple(block_table.shape) == (2, 8)
    assert [tuple(t.shape) for t in pools] == [(16, 8, 2, 24), (16, 8, 2, 16), (16, 8, 4, 24), (16, 8, 4, 16)]
    mapping = paged.kv_mapping(config)
    full, sliding = mapping["layers"]
    assert full["cache"] == {"key": {"heads": 2, "dim": 24}, "value": {"heads": 2, "dim": 16}}
    assert sliding["cache"] == {"key": {"heads": 4, "dim": 24}, "value": {"heads": 4, "dim": 16}}
    assert sliding["decode_key_input"] == {"name": "pk.1", "shape": [16, 8, 4, 24], "dtype": "float32"}
    assert sliding["prefill_value_output"]["shape"] == [2, 4, 8, 16]
    cache = mapping["contract"]["cache"]
    assert "heads" not in cache["key"] and "each attention layer's entry states its own" in cache["per_layer"]


def test_the_docs_state_each_kv_shape_and_its_bytes() -> None:
    """Gemma-4-31B's page: the graph tables list key and value per shape, the KV mapping each shape's
    layers and bytes per token, and the cache size sums both."""
    page = rendered(load_spec(GEMMA), "docs")["docs/specs/gemma4_31b.md"]
    assert (
        "| output | attention: 50 sliding | `present.{layer}.key` | `[1, 16, 128, 256]` | bfloat16 |" in page
    )
    assert "| input | attention: 10 full | `past.{layer}.value` | `[1, 4, 2048, 512]` | bfloat16 |" in page
    assert (
        "| 50: 0-4, 6-10, ..., 54-58 (sliding) | key | 16 x 256 per token | bfloat16 | 8,192 B per token |"
        in page
    )
    assert (
        "| 10: 5, 11, 17, ..., 59 (full) | value | 4 x 512 per token | bfloat16 | 4,096 B per token |" in page
    )
    # 50 x 16 x 512 x 2 B + 10 x 4 x 1024 x 2 B
    assert "901,120 B per token (50 sliding layers x 16 x (256 + 256) x 2 B + 10 full layers x 4 x" in page
    assert "| `heads` | 10 full | 4 x 512 | 4 x 512 | 4,096 |" in page
