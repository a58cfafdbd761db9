"""Gemma-4: per-layer embeddings (PLE), the per-call ``shared_kv_states`` dict and values taken from the
key projection (issue 36).

Every Gemma-4 decoder layer takes ``per_layer_input`` (its slice of embeddings the model computes once
per call from the token ids and the input embeddings) and ``shared_kv_states`` (a dict the KV-storing
layers fill). The wrappers compute the first with the language model's own methods (``PerLayerInputs``)
and hand every layer one dict per call; equivalence is checked against transformers' own forward on a
tiny random model, and against a wrapper that drops the per-layer inputs (which must differ). Full
layers with ``attention_k_eq_v`` have no ``v_proj``: the structure says so and plan counts no such
tensor. ``use_bidirectional_attention: vision`` only widens the mask over image tokens, so text graphs
accept it; ``all`` stays refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction.runtime import abi
from kimi_adapter_core.backends.simulation.model.params import Naming, text_groups
from kimi_adapter_core.errors import Refusal
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.structure.derive import derive_structure, refuse_unmodelled

pytestmark = pytest.mark.compat


def gemma4(**changes: Any) -> dict[str, Any]:
    return {**tiny_config("gemma4_text"), **changes}


def build(raw: dict[str, Any]) -> torch.nn.Module:
    config = AutoConfig.for_model(**raw)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random norms and layer scalars: nothing the wrappers could get right by luck
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and ("norm" in name or "layer_scalar" in name):
                tensor.uniform_(0.5, 1.5)
    return model


class Zeroed(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(self.inner(input_ids, inputs_embeds))


def prefill_logits(model: torch.nn.Module, ids: torch.Tensor, per_layer: bool = True) -> torch.Tensor:
    wrapper = abi.PrefillWrapper.from_language_model(
        model.model,
        model.lm_head,
        kv_layout="heads",
        cache_keyword=upstream.cache_keyword(model.model.layers[0]),  # 5.23: past_key_values
        windows=[
            model.config.sliding_window if t == "sliding_attention" else None
            for t in model.config.layer_types
        ],
        logit_ops=[("softcap", model.config.final_logit_softcapping)]
        if model.config.final_logit_softcapping
        else [],
        rope_layer_types=model.config.layer_types,
    )
    if not per_layer:  # every layer's input zero: what a wrapper that ignored them would compute
        wrapper.per_layer_inputs = Zeroed(wrapper.per_layer_inputs)
    batch, length = ids.shape
    mask = abi.additive_causal_mask(torch.arange(length).expand(batch, length), length, torch.float32)
    positions = torch.arange(length).expand(batch, length)
    with torch.no_grad():
        return wrapper(ids, mask, positions)[0]


def test_the_wrappers_compute_the_per_layer_embeddings_as_the_model_does() -> None:
    raw = gemma4()
    assert raw["hidden_size_per_layer_input"] == 8 and raw["num_kv_shared_layers"] == 0
    model = build(raw)
    ids = torch.randint(3, raw["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids).logits
    ours = prefill_logits(model, ids)
    assert torch.allclose(ours, reference, atol=1e-5, rtol=1e-5), (ours - reference).abs().max()
    dropped = prefill_logits(model, ids, per_layer=False)  # a check that could fail: PLE matters
    assert (dropped - reference).abs().max() > 1e-3


def test_per_layer_inputs_reuse_the_model_tensors_under_their_names() -> None:
    model = build(gemma4())
    holder = abi.PerLayerInputs.of(model.model)
    assert holder is not None
    assert holder.embed_tokens_per_layer.weight is model.model.embed_tokens_per_layer.weight
    assert abi.PerLayerInputs.of(build(gemma4(hidden_size_per_layer_input=0)).model) is None


def test_structure_and_plan_count_the_per_layer_embeddings() -> None:
    raw = gemma4()
    structure = derive_structure(raw)
    ple = structure.per_layer_inputs
    assert ple is not None and (ple.width, ple.vocab) == (8, 128)
    assert "per-layer embeddings 8 wide (vocab 128)" in structure.describe()
    assert structure.to_dict()["per_layer_inputs"] == {"width": 8, "vocab": 128}
    assert "per_layer_inputs" not in derive_structure(gemma4(hidden_size_per_layer_input=0)).to_dict()
    groups = {g.name: g for g in text_groups(structure, Naming("model", "model.layers", "lm_head", ()))}
    layers = raw["num_hidden_layers"]
    assert groups["ple.embed"].tensor_shapes == ((128, layers * 8),)
    assert groups["ple.projection"].tensor_shapes == ((layers * 8, raw["hidden_size"]),)
    assert len(groups["ple.gates"].checkpoint_names) == layers
    # the inventory is the model's: every tensor it names exists with that shape
    model = build(raw)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for group in groups.values():
        for names in group.checkpoint_names:
            for name, shape in zip(names, group.tensor_shapes, strict=True):
                if name in shapes:
                    assert shapes[name] == shape, name
    named = {name for g in groups.values() for names in g.checkpoint_names for name in names}
    assert {n for n in shapes if "per_layer" in n} <= named


def test_full_layers_take_their_values_from_the_key_projection() -> None:
    raw = gemma4(attention_k_eq_v=True, num_global_key_value_heads=1)
    structure = derive_structure(raw)
    full = [layer.index for layer in structure.layers if layer.window is None]
    assert full and all(structure.layer_attention(i).value_from_key for i in full)
    assert not any(
        structure.layer_attention(i).value_from_key for i in range(structure.num_layers) if i not in full
    )
    assert "values from the key projection" in structure.describe()
    names = {
        name
        for g in text_groups(structure, Naming("model", "model.layers", "lm_head", ()))
        for ns in g.checkpoint_names
        for name in ns
    }
    assert not any(f"layers.{i}.self_attn.v_proj" in n for i in full for n in names)
    model = build(raw)
    assert all(model.model.layers[i].self_attn.v_proj is None for i in full)
    # without attention_k_eq_v every layer has its v_proj and the flag stays out of the metadata
    plain = derive_structure(gemma4())
    assert "value_from_key" not in plain.to_dict()["attention"]
    assert not any(plain.layer_attention(i).value_from_key for i in range(plain.num_layers))


def test_bidirectional_vision_is_causal_for_text_graphs_and_all_stays_refused() -> None:
    refuse_unmodelled(gemma4(use_bidirectional_attention="vision"))  # text tokens attend causally
    with pytest.raises(Refusal, match="use_bidirectional_attention = 'all'"):
        refuse_unmodelled(gemma4(use_bidirectional_attention="all"))
