"""``kadapt generate`` for a hybrid stack (issue 36): Qwen3-Next's gated-DeltaNet + full-attention layers.

The spec and Qwen3-Next-80B-A3B's published config are copied into a temp directory and rendered there.
The generated extraction module, imported by path, bakes in each layer's kind and a linear layer's
state shapes; on a tiny random model its wrappers take and return every state, and over a prefill and
several decode steps its logits and every returned state (a linear layer's conv window and recurrent
state, an attention layer's KV rows written so far) equal transformers' own ``DynamicCache``. Its state
mapping states the linear layers' shapes and dtypes. The docs page states each layer kind's states
instead of counting every layer as attention, and the TensorCast target is refused, located, for the
reason TensorCast cannot take a generated profile of such a stack.
"""

from __future__ import annotations

import shutil
import types
from pathlib import Path
from typing import Any

import pytest
import roundtrip
import torch
from fixtures.modules import import_path
from transformers import DynamicCache

from kimi_adapter_core.generate import NotExpressible, render_spec
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.structure.of_spec import structure_of_raw

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = REPO / "specs" / "qwen3_next" / "config.json"  # Qwen3-Next-80B-A3B's published config.json
# The shipped Qwen3-Next spec: its ABI names a linear layer's conv and recurrent state after key, value.
SPEC_YAML = (REPO / "specs" / "qwen3_next.yaml").read_text(encoding="utf-8")
# 3 linear : 1 full, as published (full_attention_interval 4), two periods, every size tiny
TINY: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
}
KINDS = ("linear", "linear", "linear", "attention") * 2
CONV, RECURRENT = (2 * 2 * 8 + 4 * 8, 4), (4, 8, 8)  # q and k over the key heads, v over the value heads
BATCH, PROMPT, CAPACITY, STEPS = 2, 9, 24, 5
TOLERANCE = 1e-4


def hybrid_spec(directory: Path) -> Spec:
    """The Qwen3-Next spec and its published config, written into ``directory``."""
    (directory / "qwen3_next.yaml").write_text(SPEC_YAML)
    (directory / "qwen3_next").mkdir()
    shutil.copyfile(PUBLISHED, directory / "qwen3_next" / "config.json")
    return load_spec(directory / "qwen3_next.yaml")


def rendered(spec: Spec, target: str) -> dict[str, str]:
    files, _ = render_spec(spec, [target])
    return {str(item.path): item.text for item in files}


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> Spec:
    return hybrid_spec(tmp_path_factory.mktemp("hybrid_spec"))


@pytest.fixture(scope="module")
def module_text(spec: Spec) -> str:
    return rendered(spec, "extraction")["adapters/qwen3_next/extraction.py"]


@pytest.fixture(scope="module")
def module(module_text: str, tmp_path_factory: pytest.TempPathFactory) -> types.ModuleType:
    path = tmp_path_factory.mktemp("hybrid_module") / "extraction.py"
    path.write_text(module_text)
    return import_path(path, "generated_qwen3_next_extraction")


def tiny_model(module: types.ModuleType) -> torch.nn.Module:
    """A float32 tiny model built by the module, weights large enough that every state matters."""
    torch.manual_seed(0)
    model = module.build_model(device="cpu", overrides=TINY, dtype=None)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.2 if parameter.dim() > 1 else 0.5)
    return model


def reference_states(cache: DynamicCache, kinds: tuple[str, ...]) -> list[torch.Tensor]:
    """transformers' cache in the ABI's order: conv and recurrent state, or keys and values, per layer."""
    flat: list[torch.Tensor] = []
    for layer, kind in enumerate(kinds):
        if kind == "linear":
            flat += [cache.get_conv_state(layer).clone(), cache.get_recurrent_state(layer).clone()]
        else:
            flat += [cache.layers[layer].keys.clone(), cache.layers[layer].values.clone()]
    return flat


def assert_states_equal(ours: list[torch.Tensor], theirs: list[torch.Tensor], written: int) -> None:
    """Every state equal; an attention cache compared over the ``written`` slots transformers holds."""
    assert len(ours) == len(theirs) == 2 * len(KINDS)
    for index, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        if KINDS[index // 2] == "attention" and mine.shape[2] != reference.shape[2]:
            mine = mine[:, :, :written]
        assert mine.shape == reference.shape, index
        assert (mine - reference).abs().max() <= TOLERANCE, index


def test_the_module_bakes_in_each_layers_kind_and_the_linear_states(
    module: types.ModuleType, spec: Spec
) -> None:
    """What the module states about the published config is kadapt's structure of it, and its config
    readers follow a tiny config built with overrides."""
    found = structure_of_raw(spec, dict(module.SOURCE_CONFIG))
    assert module.LAYER_KINDS == found.layer_kinds == (("linear",) * 3 + ("attention",)) * 12
    assert module.LINEAR_STATES == (
        (found.linear.conv_state.shape(), "bfloat16"),
        (found.linear.recurrent_state.shape(), "float32"),
    )
    assert module.layer_kinds(module.SOURCE_CONFIG) == module.LAYER_KINDS
    assert module.linear_states(module.SOURCE_CONFIG) == module.LINEAR_STATES
    config = module.text_config(module.load_config(overrides=TINY))
    assert module.layer_kinds(config) == KINDS
    assert module.linear_states(config, None) == ((CONV, "float32"), (RECURRENT, "float32"))
    prefill, decode = module.graph_names("prefill", 4), module.graph_names("decode", 4)
    assert prefill[1][1:5] == [
        "present.0.conv",
        "present.0.recurrent",
        "present.1.conv",
        "present.1.recurrent",
    ]
    assert decode[0][4:] == [
        *(f"past.{i}.{part}" for i in range(3) for part in ("conv", "recurrent")),
        "past.3.key",
        "past.3.value",
    ]


def test_prefill_and_decode_carry_every_state_as_transformers_does(module: types.ModuleType) -> None:
    """Prefill and STEPS decode steps, batch 2: logits and every state equal transformers' with its own
    DynamicCache; the decode example inputs have the shapes and dtypes the wrappers return."""
    model = tiny_model(module)
    config = module.text_config(model.config)
    prefill, decode = module.prefill_wrapper(model), module.decode_wrapper(model)
    prompt = torch.randint(0, TINY["vocab_size"], (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    keyword = module.cache_keyword(model.model.layers[0])  # 5.24: cache, 5.23: past_key_values
    _, mask, positions = module.prefill_example_inputs("cpu", batch=BATCH, prefill_len=PROMPT, dtype=None)
    with torch.no_grad():
        reference = model(prompt, **{keyword: cache}, use_cache=True).logits
        logits, *present = prefill(prompt, mask, positions)
    assert (logits - reference).abs().max() <= TOLERANCE
    assert_states_equal(present, reference_states(cache, KINDS), PROMPT)
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
        assert_states_equal(states, reference_states(cache, KINDS), position + 1)
        token = logits[:, -1:].argmax(-1)


def test_the_state_mapping_states_the_linear_layers(module: types.ModuleType) -> None:
    config = module.text_config(module.load_config(overrides=TINY))
    mapping = module.kv_mapping(config, batch=BATCH, prefill_len=PROMPT, max_cache_len=CAPACITY)
    assert mapping["num_layers"] == len(mapping["layers"]) == len(KINDS)
    assert [layer["kind"] for layer in mapping["layers"]] == list(KINDS)
    linear, attention = mapping["layers"][0], mapping["layers"][3]
    for prefix in ("prefill_{}_output", "decode_{}_input", "decode_{}_output"):
        conv, recurrent = linear[prefix.format("conv")], linear[prefix.format("recurrent")]
        assert (conv["shape"], conv["dtype"]) == ([BATCH, *CONV], "bfloat16")
        assert (recurrent["shape"], recurrent["dtype"]) == ([BATCH, *RECURRENT], "float32")
    assert linear["decode_conv_input"]["name"] == "past.0.conv"
    assert linear["prefill_recurrent_output"]["name"] == "present.0.recurrent"
    assert attention["decode_key_input"] == {
        "name": "past.3.key",
        "shape": [BATCH, 2, CAPACITY, 16],
        "dtype": "bfloat16",
    }
    assert "key" not in {k.split("_")[1] for k in linear if k != "layer" and k != "kind"}
    assert mapping["contract"]["padding"]["supported"] == "none"
    assert "never paged" in mapping["contract"]["linear_states"]["paged"]


@pytest.fixture(scope="module")
def vendored(spec: Spec, module_text: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The module vendored outside the checkout and run by the user's script of
    ``test_generated_module_roundtrip.py`` (no kadapt importable), float32 and bfloat16."""
    tmp = tmp_path_factory.mktemp("vendored_hybrid")
    path = tmp / "qwen3_next_extraction.py"
    path.write_text(module_text)
    return roundtrip.run_user_script({"qwen3_next": roundtrip.user_job("qwen3_next", spec, path, tmp)}, tmp)


@pytest.mark.slow  # ~140 s: torch_ir extracts and replays both graphs in two dtypes, as the other specs'
@pytest.mark.compat
@pytest.mark.parametrize("dtype", roundtrip.DTYPES)
def test_the_vendored_module_round_trips_through_torch_ir(vendored: dict[str, Any], dtype: str) -> None:
    """Issue 36 item 5: extracted with torch_ir, saved, loaded and executed outside the checkout, the
    graphs carry every layer's states under the mapping's names and generate like transformers."""
    assert vendored["kadapt_importable"] is False and vendored["kadapt_modules"] == []
    result = vendored["results"][f"qwen3_next/{dtype}"]
    mapping = result["mapping"]
    kinds = [layer["kind"] for layer in mapping["layers"]]
    assert kinds[:4] == ["linear", "linear", "linear", "attention"] and len(kinds) == mapping["num_layers"]

    def names(role: str) -> list[str]:
        parts = {"linear": ("conv", "recurrent"), "attention": ("key", "value")}
        return [
            layer[role.format(part)]["name"] for layer in mapping["layers"] for part in parts[layer["kind"]]
        ]

    prefill, decode = result["graphs"]["prefill"], result["graphs"]["decode"]
    assert prefill["outputs"] == prefill["abi"][1] == ["logits", *names("prefill_{}_output")]
    assert decode["inputs"] == decode["abi"][0]
    assert decode["inputs"][4:] == names("decode_{}_input")
    assert decode["outputs"] == ["logits", *names("decode_{}_output")]
    assert decode["inputs"][4:6] == ["past.0.conv", "past.0.recurrent"]
    recurrent = mapping["layers"][0]["decode_recurrent_input"]
    assert recurrent["dtype"] == "float32" and mapping["layers"][0]["decode_conv_input"]["dtype"] == dtype
    references = result["references"]
    if dtype == "float32":
        assert result["tokens"] == references["eager"]["tokens"]
        assert references["eager"]["max_diff"] <= roundtrip.FP32_TOLERANCE
    else:
        assert result["tokens"] == references["as built"]["tokens"]
        assert references["as built"]["max_diff"] == 0.0


def test_the_docs_state_each_layer_kinds_states(spec: Spec) -> None:
    """The KV cache counts the 12 attention layers only; the linear layers' states are sized per request."""
    page = rendered(spec, "docs")["docs/specs/qwen3_next.md"]
    assert "## State mapping" in page and "## KV mapping" not in page
    assert "| 12: 3, 7, 11, ..., 47 | attention | key | `present.{layer}.key` | `past.{layer}.key` |" in page
    names = ["`present.{layer}.conv`", "`past.{layer}.conv`", "`present.{layer}.conv`"]
    cells = ["the other 36", "linear", "conv", *names, "[8192, 4] per request", "bfloat16"]
    cells.append("65,536 B per request")
    assert f"| {' | '.join(cells)} |" in page
    assert "| [32, 128, 128] per request | float32 | 2,097,152 B per request |" in page
    assert "KV cache: 24,576 B per token (12 attention layers x 2 x (256 + 256) x 2 B)" in page
    assert "Linear-attention states: 77,856,768 B per request" in page
    assert "| output | linear | `present.{layer}.recurrent` | `[1, 32, 128, 128]` | float32 |" in page


def test_the_docs_flatten_nested_structure_facts() -> None:
    """Gemma-3's rope per layer type is spelled out fact by fact, not shown as a Python dict."""
    page = rendered(load_spec(REPO / "specs" / "gemma3_text.yaml"), "docs")["docs/specs/gemma3_text.md"]
    assert "| rope.by_layer_type.full_attention.factor | `8.0` |" in page
    assert "| rope.by_layer_type.sliding_attention.theta | `10000.0` |" in page
    assert "{'" not in page


def test_the_tensorcast_profile_of_a_hybrid_stack_is_refused_at_the_gate(spec: Spec) -> None:
    """TensorCast has no profile field for a linear-attention module: the target names that, located."""
    with pytest.raises(NotExpressible) as refused:
        render_spec(spec, ["simulation"])
    gate = SPEC_YAML.splitlines().index("gate:") + 1
    assert refused.value.location == f"{spec.path}:{gate}:1"
    assert "36 of the 48 layers are linear attention" in refused.value.message
    assert "ModelProfile has no field that declares a linear-attention module" in refused.value.message
    files, notes = render_spec(spec, ["simulation", "docs"], skip_inexpressible=True)
    assert [str(f.path) for f in files] == ["docs/specs/qwen3_next.md"]
    assert notes and "target 'simulation' skipped: 36 of the 48 layers" in notes[0]
