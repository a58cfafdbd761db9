"""``kadapt generate`` for DeepSeek sparse attention (issue 36): DeepSeek-V3.2's indexed layers.

A DSA layer's indexer keeps keys of its own beside the latent KV cache and the attention sees each
query's top-k keys only. The spec (DeepSeek-V3.2-Exp's published sizes: 61 layers, indexer 64 heads x
128, top-2048) is rendered in a temp directory. The generated extraction module, imported by path,
bakes in the indexer keys' width and each layer's kind; on a tiny random model (top-4 of up to 32
visible keys, so the selection decides every step) its wrappers return the indexer keys as a third
state per layer and over a prefill and several decode steps its logits and every returned state equal
transformers' own ``DynamicCache``. Its state mapping, the docs page and (outside the checkout, through
torch_ir) the saved graphs carry them too; the TensorCast profile swaps the attention for TensorCast's
DSA module, which prices the indexer and the top-k sparse attention.
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path
from typing import Any

import pytest
import roundtrip
import torch
from fixtures.modules import import_path
from transformers import DynamicCache

from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.generate import NotExpressible, render_spec
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.structure.of_spec import structure_of_raw

REPO = Path(__file__).resolve().parents[1]
LAYERS = 61
# DeepSeek-V3.2-Exp's published config: DeepSeek-V3's with its model type and indexer sizes. Its config
# class lists every layer as indexed_attention; written in, because kadapt reads the JSON as it is.
DSA_CONFIG = {
    "model_type": "deepseek_v32",
    "architectures": ["DeepseekV32ForCausalLM"],
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "layer_types": ["indexed_attention"] * LAYERS,
}
SPEC_YAML = (REPO / "specs" / "deepseek_v32.yaml").read_text(encoding="utf-8")
TINY: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": 4,  # fewer than the visible keys from the prompt on: the selection decides every step
    "layer_types": ["indexed_attention"] * 3,
}
KINDS = ("indexed",) * 3
BATCH, PROMPT, CAPACITY, STEPS = 2, 9, 32, 6
TOLERANCE = 1e-4


def dsa_spec(directory: Path, text: str = SPEC_YAML) -> Spec:
    """The DeepSeek-V3.2-Exp spec and its config (DeepSeek-V3's published one with the DSA keys)."""
    config = json.loads((REPO / "specs" / "deepseek_v3" / "config.json").read_text()) | DSA_CONFIG
    (directory / "deepseek_v32").mkdir(exist_ok=True)
    (directory / "deepseek_v32" / "config.json").write_text(json.dumps(config))
    (directory / "deepseek_v32.yaml").write_text(text)
    return load_spec(directory / "deepseek_v32.yaml")


def rendered(spec: Spec, target: str) -> dict[str, str]:
    files, _ = render_spec(spec, [target])
    return {str(item.path): item.text for item in files}


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> Spec:
    return dsa_spec(tmp_path_factory.mktemp("dsa_spec"))


@pytest.fixture(scope="module")
def module_text(spec: Spec) -> str:
    return rendered(spec, "extraction")["adapters/deepseek_v32/extraction.py"]


@pytest.fixture(scope="module")
def module(module_text: str, tmp_path_factory: pytest.TempPathFactory) -> types.ModuleType:
    path = tmp_path_factory.mktemp("dsa_module") / "extraction.py"
    path.write_text(module_text)
    return import_path(path, "generated_deepseek_v32_extraction")


def tiny_model(module: types.ModuleType) -> torch.nn.Module:
    """A float32 tiny model built by the module, weights large enough that every state matters."""
    torch.manual_seed(0)
    model = module.build_model(device="cpu", overrides=TINY, dtype=None)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.2 if parameter.dim() > 1 else 0.5)
    return model


def reference_states(cache: DynamicCache) -> list[torch.Tensor]:
    """transformers' cache in the ABI's order: per layer the latent key and value, then the indexer keys
    (``[batch, tokens, dim]`` there, a one-head key ``[batch, 1, tokens, dim]`` in the ABI)."""
    flat: list[torch.Tensor] = []
    for layer in range(len(KINDS)):
        entry = cache.layers[layer]
        flat += [entry.keys.clone(), entry.values.clone(), entry.indexer_keys.unsqueeze(1).clone()]
    return flat


def assert_states_equal(ours: list[torch.Tensor], theirs: list[torch.Tensor], written: int) -> None:
    """Every state equal over the ``written`` slots transformers holds (ours are decode-sized)."""
    assert len(ours) == len(theirs) == 3 * len(KINDS)
    for index, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        mine = mine[:, :, :written]
        assert mine.shape == reference.shape, index
        assert (mine - reference).abs().max() <= TOLERANCE, index


def test_the_module_bakes_in_the_indexer_keys(module: types.ModuleType, spec: Spec) -> None:
    """What the module states about the published config is kadapt's structure of it, its config readers
    follow a tiny config built with overrides, and every layer is named with three states."""
    found = structure_of_raw(spec, dict(module.SOURCE_CONFIG))
    assert found.indexer is not None
    assert module.LAYER_KINDS == found.layer_kinds == ("indexed",) * LAYERS
    assert module.INDEX_DIM == found.indexer.head_dim == 128
    assert module.layer_kinds(module.SOURCE_CONFIG) == module.LAYER_KINDS
    assert module.index_dim(module.SOURCE_CONFIG) == module.INDEX_DIM
    config = module.text_config(module.load_config(overrides=TINY))
    assert (module.layer_kinds(config), module.index_dim(config)) == (KINDS, 16)
    prefill, decode = module.graph_names("prefill", 2), module.graph_names("decode", 2)
    assert prefill[1] == [
        "logits",
        *(f"present.{i}.{part}" for i in range(2) for part in ("key", "value", "index_key")),
    ]
    assert decode[0][4:] == [f"past.{i}.{part}" for i in range(2) for part in ("key", "value", "index_key")]
    assert module.layer_kinds({"num_hidden_layers": 2}) == ("indexed",) * 2  # as the config class fills it
    assert (
        module.layer_kinds({"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2})
        == ("attention",) * 2
    )
    # a layer reusing an earlier one's top-k (GLM-5's and HY-V4's indexer_types "shared") caches KV alone
    reusing = {"num_hidden_layers": 3, "indexer_types": ["full", "shared", "full"]}
    assert module.layer_kinds(reusing) == ("indexed", "attention", "indexed")
    assert module.graph_names("prefill", 3, module.layer_kinds(reusing))[1][4:6] == [
        "present.1.key",
        "present.1.value",
    ]


def test_prefill_and_decode_carry_the_indexer_keys_as_transformers_does(module: types.ModuleType) -> None:
    """Prefill and STEPS decode steps, batch 2: logits, the latent KV and the indexer keys equal
    transformers' with its own DynamicCache; the decode example inputs have the shapes and dtypes of the
    states the wrappers return."""
    model = tiny_model(module)
    config = module.text_config(model.config)
    prefill, decode = module.prefill_wrapper(model), module.decode_wrapper(model)
    prompt = torch.randint(3, TINY["vocab_size"], (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    keyword = module.cache_keyword(model.model.layers[0])  # 5.24: cache, 5.23: past_key_values
    _, mask, positions = module.prefill_example_inputs("cpu", batch=BATCH, prefill_len=PROMPT, dtype=None)
    with torch.no_grad():
        reference = model(prompt, **{keyword: cache}, use_cache=True).logits
        logits, *present = prefill(prompt, mask, positions)
    assert (logits - reference).abs().max() <= TOLERANCE
    assert_states_equal(present, reference_states(cache), PROMPT)
    assert present[2].shape == (BATCH, 1, PROMPT, 16)
    example = module.decode_example_inputs(
        config, "cpu", batch=BATCH, position=PROMPT, max_cache_len=CAPACITY, dtype=None
    )
    states = module.place_prefill_kv(present, CAPACITY, KINDS)
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


def test_the_state_mapping_states_the_indexer_keys(module: types.ModuleType) -> None:
    config = module.text_config(module.load_config(overrides=TINY))
    mapping = module.kv_mapping(config, batch=BATCH, prefill_len=PROMPT, max_cache_len=CAPACITY)
    assert mapping["num_layers"] == len(mapping["layers"]) == len(KINDS)
    layer = mapping["layers"][1]
    assert layer["prefill_index_key_output"] == {
        "name": "present.1.index_key",
        "shape": [BATCH, 1, PROMPT, 16],
        "dtype": "bfloat16",
    }
    for role, name in (
        ("decode_index_key_input", "past.1.index_key"),
        ("decode_index_key_output", "present.1.index_key"),
    ):
        assert layer[role] == {"name": name, "shape": [BATCH, 1, CAPACITY, 16], "dtype": "bfloat16"}
    assert layer["decode_key_input"]["shape"] == [BATCH, 1, CAPACITY, 16]  # the latent, kv_lora_rank 16
    assert mapping["contract"]["cache"]["index_key"]["heads"] == 1
    assert mapping["contract"]["cache"]["index_key"]["dim"] == 16


PAGED_SPEC = SPEC_YAML.replace(
    "  dtype: bfloat16\n", "  dtype: bfloat16\n  kv_cache: {kind: paged, block_size: 16}\n"
)


def test_a_paged_spec_pools_the_indexer_keys_like_the_key(tmp_path: Path) -> None:
    """``abi.kv_cache: paged``: the decode indexer keys are a one-head block pool beside the KV pools, in
    the module's mapping and in the docs' graph table."""
    spec = dsa_spec(tmp_path, PAGED_SPEC)
    path = tmp_path / "extraction.py"
    path.write_text(rendered(spec, "extraction")["adapters/deepseek_v32/extraction.py"])
    module = import_path(path, "generated_deepseek_v32_paged")
    config = module.text_config(module.load_config(overrides=TINY))
    mapping = module.kv_mapping(config, batch=BATCH, prefill_len=PROMPT, max_cache_len=CAPACITY)
    pool = mapping["layers"][0]["decode_index_key_input"]["shape"]
    assert pool == [module.PAGED.num_blocks, 16, 1, 16]
    page = rendered(spec, "docs")["docs/specs/deepseek_v32.md"]
    assert (
        f"| input | `past.{{layer}}.index_key` | `[{module.PAGED.num_blocks}, 16, 1, 128]` | bfloat16 |"
        in page
    )


@pytest.mark.parametrize(
    ("edit", "message", "entry"),
    [
        (
            lambda text: re.sub(r',\s*"(present|past)\.\{layer\}\.index_key"', "", text),
            'add "<present index_key {layer}>"',
            "abi.prefill.outputs",
        ),
        (
            lambda text: text.replace(
                "  dtype: bfloat16\n", "  dtype: bfloat16\n  mla_attention: absorbed\n"
            ),
            "would drop the DSA indexer",
            "abi.mla_attention",
        ),
    ],
    ids=["no-index-key-names", "absorbed"],
)
def test_a_spec_that_would_lose_the_indexer_is_refused_located(
    tmp_path: Path, edit: Any, message: str, entry: str
) -> None:
    spec = dsa_spec(tmp_path, edit(SPEC_YAML))
    with pytest.raises(KadaptError) as refused:
        render_spec(spec, ["extraction"])
    assert message in refused.value.message
    assert refused.value.location == spec.locate(entry)


def test_the_docs_state_the_indexer_keys_beside_the_kv_cache(spec: Spec) -> None:
    page = rendered(spec, "docs")["docs/specs/deepseek_v32.md"]
    assert "## State mapping" in page and "## KV mapping" not in page
    names = ["`present.{layer}.index_key`", "`past.{layer}.index_key`", "`present.{layer}.index_key`"]
    cells = ["61: 0, 1, 2, ..., 60", "indexed", "index_key", *names, "1 x 128 per token", "bfloat16"]
    assert f"| {' | '.join(cells)} | 256 B per token |" in page
    assert "| 61: 0, 1, 2, ..., 60 | indexed | key | `present.{layer}.key` |" in page
    assert "| output | `present.{layer}.index_key` | `[1, 1, 128, 128]` | bfloat16 |" in page
    assert "| input | `past.{layer}.index_key` | `[1, 1, 2048, 128]` | bfloat16 |" in page
    assert "KV cache: 70,272 B per token (61 layers x 1 x (512 + 64) x 2 B)" in page
    assert "Indexer keys: 15,616 B per token (61 indexed layers x 1 x 128 x 2 B), 30.50 MiB at" in page


@pytest.fixture(scope="module")
def vendored(spec: Spec, module_text: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The module vendored outside the checkout and run by the user's script of
    ``test_generated_module_roundtrip.py`` (no kadapt importable), float32 and bfloat16."""
    tmp = tmp_path_factory.mktemp("vendored_dsa")
    path = tmp / "deepseek_v32_extraction.py"
    path.write_text(module_text)
    return roundtrip.run_user_script(
        {"deepseek_v32": roundtrip.user_job("deepseek_v32", spec, path, tmp)}, tmp
    )


@pytest.mark.compat  # ~35 s: torch_ir extracts and replays both graphs in two dtypes
@pytest.mark.parametrize("dtype", roundtrip.DTYPES)
def test_the_vendored_module_round_trips_through_torch_ir(vendored: dict[str, Any], dtype: str) -> None:
    """Issue 36 item 5: extracted with torch_ir, saved, loaded and executed outside the checkout, the
    graphs carry every layer's key, value and indexer keys under the mapping's names and generate like
    transformers."""
    assert vendored["kadapt_importable"] is False and vendored["kadapt_modules"] == []
    result = vendored["results"][f"deepseek_v32/{dtype}"]
    mapping = result["mapping"]

    def names(role: str) -> list[str]:
        return [
            layer[role.format(part)]["name"]
            for layer in mapping["layers"]
            for part in ("key", "value", "index_key")
        ]

    prefill, decode = result["graphs"]["prefill"], result["graphs"]["decode"]
    assert prefill["outputs"] == prefill["abi"][1] == ["logits", *names("prefill_{}_output")]
    assert decode["inputs"] == decode["abi"][0]
    assert decode["inputs"][4:] == names("decode_{}_input")
    assert decode["outputs"] == ["logits", *names("decode_{}_output")]
    assert decode["inputs"][4:7] == ["past.0.key", "past.0.value", "past.0.index_key"]
    assert prefill["metadata"]["num_layers"] == decode["metadata"]["num_layers"] == mapping["num_layers"]
    references = result["references"]
    if dtype == "float32":
        assert result["tokens"] == references["eager"]["tokens"]
        assert references["eager"]["max_diff"] <= roundtrip.FP32_TOLERANCE
    else:
        assert result["tokens"] == references["as built"]["tokens"]
        assert references["as built"]["max_diff"] == 0.0


def test_the_tensorcast_profile_of_a_dsa_stack_is_refused_at_the_gate(spec: Spec) -> None:
    """TensorCast prices DSA only through the sparse MLA class its builtin profiles set: the target names
    that class and why a generated swap would misprice the layers, located at the gate."""
    with pytest.raises(NotExpressible) as refused:
        render_spec(spec, ["simulation"])
    gate = SPEC_YAML.splitlines().index("gate:") + 1
    assert refused.value.location == f"{spec.path}:{gate}:1"
    message = refused.value.message
    assert "the 61 layers use DeepSeek sparse attention (DSA indexer 64x128 top-2048)" in message
    assert "deepseek_v32: tensor_cast.layers.mla.DeepseekSparseAttention" in message
    assert "allocates no indexer cache" in message
    files, notes = render_spec(spec, ["simulation", "docs"], skip_inexpressible=True)
    assert [str(f.path) for f in files] == ["docs/specs/deepseek_v32.md"]
    assert notes and "target 'simulation' skipped: the 61 layers use DeepSeek sparse attention" in notes[0]


# dots3 (families.tiny): DSA layers 0 and 1 beside a sliding attention layer 2 of its own latent shape
# (rank 32 against 16); the indexed layers alone keep indexer keys. Was refused (layer-types): "the
# generated extraction module carries indexer keys for stacks whose every layer is indexed".
DOTS3_KINDS = ("indexed", "indexed", "attention")


@pytest.fixture(scope="module")
def dots3_text(tmp_path_factory: pytest.TempPathFactory) -> tuple[Spec, dict[str, str]]:
    from test_per_layer_latent_kv import dots3_spec

    spec = dots3_spec(tmp_path_factory.mktemp("dots3_dsa_spec"))
    return spec, {**rendered(spec, "extraction"), **rendered(spec, "docs")}


@pytest.fixture(scope="module")
def dots3(
    dots3_text: tuple[Spec, dict[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> types.ModuleType:
    path = tmp_path_factory.mktemp("dots3_dsa_module") / "extraction.py"
    path.write_text(dots3_text[1]["adapters/dots3_note_text/extraction.py"])
    return import_path(path, "generated_dots3_dsa_extraction")


def test_a_stack_mixing_dsa_and_attention_layers_carries_indexer_keys_in_its_indexed_layers_alone(
    dots3: types.ModuleType,
) -> None:
    """Prefill and STEPS decode steps, batch 2, float32: logits and every state (indexer keys of the two
    DSA layers only, the sliding layer's 32-wide latent) equal transformers' own ``DynamicCache``."""
    assert dots3.LAYER_KINDS == DOTS3_KINDS
    assert dots3.LAYER_KV_DIMS == (((1, 16), (1, 8)),) * 2 + (((1, 32), (1, 8)),)
    torch.manual_seed(0)
    model = dots3.build_model(device="cpu", overrides={}, dtype=None)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.2 if parameter.dim() > 1 else 0.5)
    config = dots3.text_config(model.config)
    prefill, decode = dots3.prefill_wrapper(model), dots3.decode_wrapper(model)
    prompt = torch.randint(3, config.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    keyword = dots3.cache_keyword(model.model.layers[0])

    def expected() -> list[torch.Tensor]:
        flat: list[torch.Tensor] = []
        for entry, kind in zip(cache.layers, DOTS3_KINDS, strict=True):
            flat += [entry.keys.clone(), entry.values.clone()]
            flat += [entry.indexer_keys.unsqueeze(1).clone()] if kind == "indexed" else []
        return flat

    def equal(ours: list[torch.Tensor], written: int) -> None:
        theirs = expected()
        assert len(ours) == len(theirs) == 8
        for index, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
            mine = mine[:, :, written - reference.shape[2] : written]  # a sliding layer keeps its window
            assert mine.shape == reference.shape and (mine - reference).abs().max() <= TOLERANCE, index

    _, mask, positions = dots3.prefill_example_inputs("cpu", batch=BATCH, prefill_len=PROMPT, dtype=None)
    with torch.no_grad():
        reference = model(prompt, **{keyword: cache}, use_cache=True).logits
        logits, *present = prefill(prompt, mask, positions)
    assert (logits - reference).abs().max() <= TOLERANCE
    equal(present, PROMPT)
    example = dots3.decode_example_inputs(
        config, "cpu", batch=BATCH, position=PROMPT, max_cache_len=CAPACITY, dtype=None
    )
    states = dots3.place_prefill_kv(present, CAPACITY, DOTS3_KINDS)
    assert [(t.shape, t.dtype) for t in example[4:]] == [(t.shape, t.dtype) for t in states]
    token = logits[:, -1:].argmax(-1)
    for step in range(STEPS):
        position = PROMPT + step
        positions = torch.full((BATCH, 1), position)
        mask = dots3.additive_causal_mask(positions, CAPACITY, torch.float32)
        with torch.no_grad():
            reference = model(token, **{keyword: cache}, use_cache=True).logits
            logits, *states = decode(token, mask, positions, positions.view(-1), *states)
        assert (logits - reference).abs().max() <= TOLERANCE, step
        equal(states, position + 1)
        token = logits[:, -1:].argmax(-1)


def test_a_saved_graph_of_a_mixed_stack_is_walked_by_its_layer_kinds(dots3: types.ModuleType) -> None:
    """``save_ir`` counts a mixed stack's layers by ``LAYER_KINDS`` (three states an indexed layer, two
    an attention one), not by three states a layer (which made 8 states 2 layers)."""

    def document(states: int) -> dict[str, Any]:
        return {"graph_outputs": [{"name": "logits"}] + [{"name": f"s{i}"} for i in range(states)]}

    assert dots3._graph_kinds(document(8)) == list(DOTS3_KINDS)
    assert dots3._graph_kinds(document(6)) == ["indexed", "indexed"]
    with pytest.raises(ValueError, match="the graph returns 7 states, which LAYER_KINDS' pattern"):
        dots3._graph_kinds(document(7))


def test_the_docs_of_a_mixed_stack_list_each_kinds_states(dots3_text: tuple[Spec, dict[str, str]]) -> None:
    page = dots3_text[1]["docs/specs/dots3_note_text.md"]
    assert "Each indexed layer returns its DSA indexer keys after its key and value; the other" in page
    assert "| output | indexed: 2 indexed | `i.{layer}` | `[1, 1, 8, 128]` | float32 |" in page
    assert "| output | attention: 1 sliding | `k.{layer}` | `[1, 1, 8, 32]` | float32 |" in page
    assert (
        "| 1: 2 (sliding) | attention | key | `k.{layer}` | `pk.{layer}` | `k.{layer}` | 1 x 32 per token |"
        in page
    )
    assert "Indexer keys: 1,024 B per token (2 indexed layers x 1 x 128 x 4 B)" in page


@pytest.mark.compat  # ~15 s: torch_ir extracts and replays both graphs
def test_a_mixed_stacks_vendored_module_round_trips_through_torch_ir(
    dots3_text: tuple[Spec, dict[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """float32: the saved graphs name each layer's states by its kind (no indexer keys for layer 2),
    state 3 layers and generate like transformers. (bfloat16 is refused: dots3's DSA layers keep float32
    indexer keys there, ``test_a_dots3_module_refuses_to_build_below_float32``.)"""
    spec, files = dots3_text
    tmp = tmp_path_factory.mktemp("vendored_dots3")
    path = tmp / "dots3_note_text_extraction.py"
    path.write_text(files["adapters/dots3_note_text/extraction.py"])
    job = roundtrip.user_job("dots3_note_text", spec, path, tmp)
    # float32 only: the module refuses a dots3 build below it
    report = roundtrip.run_user_script({"dots3_note_text": job}, tmp, dtypes=("float32",))
    result = report["results"]["dots3_note_text/float32"]
    prefill = result["graphs"]["prefill"]
    assert prefill["outputs"] == ["logits", "k.0", "v.0", "i.0", "k.1", "v.1", "i.1", "k.2", "v.2"]
    assert prefill["metadata"]["num_layers"] == result["mapping"]["num_layers"] == 3
    assert result["tokens"] == result["references"]["eager"]["tokens"]
    assert result["references"]["eager"]["max_diff"] <= roundtrip.FP32_TOLERANCE


def test_a_dots3_module_refuses_to_build_below_float32(dots3: types.ModuleType, tmp_path: Path) -> None:
    """dots3's DSA layers' rope comes from float32 embeddings, so below float32 their indexer keys are
    float32 where the state mapping says the model's dtype: the module refuses the build, and generate a
    spec whose abi.dtype is bfloat16, located (``kadapt apply`` refuses the same)."""
    from test_per_layer_latent_kv import dots3_spec

    with pytest.raises(dots3.KadaptError, match="build it in float32"):
        dots3.build_model(device="meta", dtype="bfloat16")
    assert dots3.build_model(device="meta", dtype="float32") is not None
    path = dots3_spec(tmp_path).path
    path.write_text(path.read_text().replace("dtype: float32", "dtype: bfloat16"))
    spec = load_spec(path)
    with pytest.raises(KadaptError) as refused:
        render_spec(spec, ["extraction"])
    assert "generate it in float32" in refused.value.message
    assert refused.value.location == spec.locate("abi.dtype")
