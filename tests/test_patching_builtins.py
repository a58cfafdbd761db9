"""The builtins this engine ships: each one's contract, called directly."""

from __future__ import annotations

import types

import torch

from kimi_adapter_core.builtins.environment import is_torch_fx_available
from kimi_adapter_core.builtins.moe_stubs import moe_gate_uniform, moe_zeros
from kimi_adapter_core.builtins.registry import BUILTINS, resolve
from kimi_adapter_core.builtins.rotary import rotary_seq_len_as_int
from kimi_adapter_core.builtins.vision import meta_merged_embeddings, patch_embed_flat_linear
from kimi_adapter_core.patching.portable import pad_or_trim

MINE = (
    "is_torch_fx_available",
    "moe_zeros",
    "moe_gate_uniform",
    "patch_embed_flat_linear",
    "meta_merged_embeddings",
    "rotary_seq_len_as_int",
)


def test_registry_entries_resolve_and_are_documented():
    for name in MINE:
        impl = resolve(name)
        assert impl.__name__ == name and impl.__doc__ and BUILTINS[name][1]


def test_environment_and_moe_stubs():
    assert is_torch_fx_available() is True
    hidden = torch.randn(2, 3, 8)
    assert torch.equal(moe_zeros(None, hidden), torch.zeros_like(hidden))
    gate = types.SimpleNamespace(top_k=3, n_routed_experts=4)
    index, weight = moe_gate_uniform(gate, hidden)
    assert index.shape == weight.shape == (6, 3) and index.dtype == torch.int64
    assert index[:2].tolist() == [[0, 1, 2], [3, 0, 1]] and torch.allclose(weight, torch.full((6, 3), 1 / 3))
    meta_index, _ = moe_gate_uniform(gate, hidden.to("meta"))
    assert meta_index.device.type == "meta"


def test_vision_builtins():
    proj = torch.nn.Conv2d(3, 5, kernel_size=2, stride=2)
    embed = types.SimpleNamespace(proj=proj, pos_emb=lambda x, grid: x + 1)

    def original(self, x, grid):
        return self.pos_emb(self.proj(x).view(x.size(0), -1), grid)

    patches = torch.randn(4, 3, 2, 2)
    flat = patch_embed_flat_linear(original, embed, patches.reshape(4, -1), None)
    assert torch.allclose(flat, original(embed, patches, None), atol=1e-6)
    merged = meta_merged_embeddings(None, None, torch.empty(1, 7, 16, device="meta"))
    assert merged.shape == (1, 7, 16) and merged.device.type == "meta"


def test_rotary_seq_len_and_pad_or_trim():
    seen = []
    rotary = types.SimpleNamespace(max_seq_len_cached=64)

    def original(self, x, seq_len):
        seen.append(seq_len)

    rotary_seq_len_as_int(original, rotary, None, torch.tensor(5))
    rotary_seq_len_as_int(original, rotary, None, torch.empty((), device="meta"))
    rotary_seq_len_as_int(original, rotary, None, 7)
    assert seen == [5, 64, 7] and all(type(s) is int for s in seen)
    assert pad_or_trim((1, 2), 3) == (1, 2, None) and pad_or_trim((1, 2, 3, 4), 3) == (1, 2, 3)
    assert pad_or_trim("x", 2) == ("x", None)
