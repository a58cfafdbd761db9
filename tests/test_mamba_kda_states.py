"""Mamba2 and KDA layers carried as ``linear`` layers (issue 36): their sizes read from each family's
config keys, their decode states handed out as clones (a Mamba2 decode writes its recurrent state in
place, a KDA decode its conv window), and a tiny Granite-4.0-H through the family matrix's
export + verify."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction.runtime.abi import StaticStateCache
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import ADAPTED, run_trial
from kimi_adapter_core.structure.derive import derive_structure


def _tiny(model_type: str) -> tuple[object, torch.nn.Module]:
    config = AutoConfig.for_model(**tiny_config(model_type))
    torch.manual_seed(0)
    return config, AutoModelForCausalLM.from_config(config).eval()


def _decode(layer: torch.nn.Module, hidden: torch.Tensor, cache: object) -> torch.Tensor:
    return layer(hidden, **{upstream.cache_keyword(layer): cache})


@pytest.mark.parametrize("model_type", ["mamba2", "kimi_linear"])
def test_a_decode_step_never_writes_its_inputs_and_returns_what_transformers_keeps(model_type: str) -> None:
    config, model = _tiny(model_type)
    layer = model.model.layers[0] if hasattr(model, "model") else model.backbone.layers[0]
    prompt, step = torch.randn(1, 5, config.hidden_size), torch.randn(1, 1, config.hidden_size)
    reference = DynamicCache(config=config)
    with torch.no_grad():
        _decode(layer, prompt, reference)
        conv, recurrent = reference.get_conv_state(0).clone(), reference.get_recurrent_state(0).clone()
        past = (conv.clone(), recurrent.clone())
        cache = StaticStateCache("heads", [0], [past], torch.tensor([5]), kinds=["linear"])
        ours = _decode(layer, step, cache)
        theirs = _decode(layer, step, reference)
    assert torch.equal(past[0], conv) and torch.equal(past[1], recurrent)  # the inputs are untouched
    present = cache.flat_present()
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert torch.allclose(present[0], reference.get_conv_state(0), atol=1e-6)
    assert torch.allclose(present[1], reference.get_recurrent_state(0), atol=1e-6)
    assert not torch.equal(present[1], recurrent)  # the step did move the state


def test_mamba2_sizes_follow_each_familys_keys() -> None:
    """Nemotron-H's published layout (hybrid_override_pattern) and Granite's "auto" head width."""
    nemotron = {
        "model_type": "nemotron_h", "num_hidden_layers": 4, "hybrid_override_pattern": "M*M*",
        "hidden_size": 64, "vocab_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 32, "n_groups": 2,
        "conv_kernel": 4, "intermediate_size": 128,
    }  # fmt: skip
    found = derive_structure(nemotron)
    assert found.layer_kinds == ("linear", "attention") * 2
    assert found.linear.kind == "mamba2"
    assert found.linear.conv.shape() == (8 * 16 + 2 * 2 * 32, 4)
    assert found.linear.recurrent.shape() == (8, 16, 32)
    granite = {
        "model_type": "granitemoehybrid", "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 128,
        "num_attention_heads": 4, "layer_types": ["mamba", "attention"], "mamba_n_heads": 4,
        "mamba_d_head": "auto", "mamba_expand": 2, "mamba_d_state": 16, "mamba_n_groups": 1,
        "mamba_d_conv": 4,
    }  # fmt: skip
    found = derive_structure(granite)
    assert found.linear.recurrent.shape() == (4, 32, 16)  # 2 x 64 inner channels over 4 heads
    assert found.linear.conv.shape() == (128 + 2 * 16, 4)


def test_kda_sizes_and_mamba1_is_no_mamba2() -> None:
    kimi = derive_structure(tiny_config("kimi_linear"))
    assert kimi.linear.kind == "kda"
    assert (kimi.linear.conv.shape(), kimi.linear.recurrent.shape()) == ((3 * 2 * 8, 4), (2, 8, 8))
    assert "KDA 2x8 heads, conv 4" in kimi.describe()
    mamba = derive_structure(tiny_config("mamba"))  # a state size without SSM heads: tests/test_mamba1_states
    assert mamba.linear.kind == "mamba1" and len(mamba.linear.recurrent.shape()) == 2


def test_a_tiny_granite_4_h_is_adapted_and_verified() -> None:
    row = run_trial("granitemoehybrid")
    assert (row.outcome, row.code) == (ADAPTED, ""), row.detail
    assert "verify max |diff|" in row.detail


def test_kimi_linears_dense_first_layer_comes_from_mlp_layer_types() -> None:
    """Kimi-Linear states its MLP kinds per layer (``mlp_layer_types``), not by first_k_dense_replace."""
    config = AutoConfig.for_model("kimi_linear")
    structure = derive_structure(config)
    assert config.mlp_layer_types[0] == "dense" and set(config.mlp_layer_types[1:]) == {"sparse"}
    assert structure.dense_layer_ids == (0,)
    assert structure.n_moe_layers == config.num_hidden_layers - 1
