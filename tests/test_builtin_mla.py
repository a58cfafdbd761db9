"""builtin:mla_expand_kv_functional: upstream's numbers, without in-place writes into slices."""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from kimi_adapter_core.builtins import BUILTINS, resolve
from kimi_adapter_core.builtins.mla import mla_expand_kv_functional

CONFIG = DeepseekV3Config(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    vocab_size=32,
)


class _Expand(torch.nn.Module):
    def __init__(self, attention: DeepseekV3Attention, fn) -> None:  # noqa: ANN001 - test helper
        super().__init__()
        self.attention = attention
        self.fn = fn

    def forward(self, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(self.attention, kv_nope, k_rot)


def test_registered_under_the_spec_name() -> None:
    assert resolve("mla_expand_kv_functional") is mla_expand_kv_functional
    assert BUILTINS["mla_expand_kv_functional"][0].startswith("kimi_adapter_core.builtins.mla:")


def test_same_tensors_as_upstream_expand_kv() -> None:
    torch.manual_seed(0)
    attention = DeepseekV3Attention(CONFIG, layer_idx=0)
    kv_nope, k_rot = torch.randn(2, 1, 5, 16), torch.randn(2, 1, 5, 8)
    expected_key, expected_value = DeepseekV3Attention.expand_kv(attention, kv_nope, k_rot)
    key, value = mla_expand_kv_functional(attention, kv_nope, k_rot)
    assert key.shape == (2, 4, 5, 24) and value.shape == (2, 4, 5, 12)
    assert torch.equal(key, expected_key) and torch.equal(value, expected_value)


def test_exports_without_in_place_ops() -> None:
    attention = DeepseekV3Attention(CONFIG, layer_idx=0)
    inputs = (torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 8))

    def targets(fn) -> set[str]:  # noqa: ANN001
        program = torch.export.export(_Expand(attention, fn), inputs, strict=False)
        return {str(node.target) for node in program.graph.nodes if node.op == "call_function"}

    upstream = targets(DeepseekV3Attention.expand_kv)
    assert any(t.endswith("copy_.default") for t in upstream)  # what the builtin exists to remove
    ours = targets(mla_expand_kv_functional)
    assert not any(t.split(".")[-2].endswith("_") or "new_empty" in t for t in ours if t.startswith("aten."))
    assert "aten.cat.default" in ours
