"""Families refused for one operation kadapt cannot express (``config_keys.yaml`` ``refused_families``):
the refusal names that operation and why no spec can supply it, on the config object and its JSON alike,
and what it claims is what transformers' code does (RWKV threads its states through the blocks,
RecurrentGemma keeps its recurrent ones in module attributes: neither reaches the cache)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kimi_adapter_core.errors import Refusal
from kimi_adapter_core.structure.derive import refuse_unmodelled

NAMED = {  # model type -> code, what the reason names
    "rwkv": ("hybrid", "RwkvBlock takes and returns a stack-wide `state` list"),
    "recurrent_gemma": ("hybrid", "module attributes (conv1d_state, recurrent_states) set by _setup_cache"),
    "zaya": ("hybrid", "keeps beside its KV cache a q/k conv window"),
    "inkling2_text": ("hybrid", "four short-convolution windows"),
    "dory": ("outside-layers", "reruns its recurrent section n_recurrent_loops times"),
    "mllama_text_model": ("stack-layout", "skips the layers it lists (MllamaCrossAttentionDecoderLayer)"),
    "blt": ("stack-layout", "runs three stacks"),
    "xlnet": ("stack-layout", "two-stream attention"),
    "cpmant": ("stack-layout", "prepends prompt_length prompt tokens"),
    "moshi": ("stack-layout", "keeps only the last sliding_window keys and values"),
}


def _refusal(config: Any) -> Refusal:
    with pytest.raises(Refusal) as refused:
        refuse_unmodelled(config, where="config")
    return refused.value


@pytest.mark.parametrize("model_type", sorted(NAMED))
def test_a_refused_family_names_its_operation_and_why_a_spec_cannot_supply_it(model_type: str) -> None:
    config = AutoConfig.for_model(model_type)
    code, named = NAMED[model_type]
    for form in (config, config.to_dict()):
        refusal = _refusal(form)
        assert refusal.code == code
        assert named in refusal.message
        assert "a spec" in refusal.message and "only models with non-attention layers" not in refusal.message


def test_a_hybrid_key_of_an_unlisted_family_keeps_the_generic_reason() -> None:
    refusal = _refusal({"model_type": "new_recurrent", "block_types": ["recurrent", "attention"]})
    assert refusal.code == "hybrid"
    assert "sets block_types, which only models with non-attention layers" in refusal.message


def _tiny(model_type: str, **sizes: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, **sizes)
    return AutoModelForCausalLM.from_config(config).eval()


def test_rwkv_blocks_carry_their_state_outside_any_cache() -> None:
    """What the rwkv reason claims: five [batch, hidden, layers] tensors come back beside the logits."""
    model = _tiny("rwkv", num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64)
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), use_cache=True)
    assert [tuple(s.shape) for s in out.state] == [(1, 32, 2)] * 5
    assert getattr(out, "cache", None) is None and getattr(out, "past_key_values", None) is None


def test_recurrent_gemma_keeps_its_recurrent_states_in_module_attributes() -> None:
    """What the recurrent_gemma reason claims: after a cached forward the recurrent block's conv window and
    RG-LRU state sit on the modules, and the forward returns no cache at all (logits alone)."""
    model = _tiny(
        "recurrent_gemma", num_hidden_layers=3, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, lru_width=32, block_types=["recurrent", "recurrent", "attention"],
    )  # fmt: skip
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), use_cache=True)
    block = model.model.layers[0].temporal_block
    assert block.conv1d_state is not None and block.rg_lru.recurrent_states is not None
    assert list(out.keys()) == ["logits"]
