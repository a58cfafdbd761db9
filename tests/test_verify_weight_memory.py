"""Verify's replay binds the checkpoint's weights in torch's own memory, as the model holds its own.

safetensors hands out each tensor where it sits in the file (after the tensors before it, so a
float32 vector of 36 puts every later tensor off 64-byte alignment), and MKL's float32 GEMM sums
in another order over an operand not 64-byte aligned. Tiny DeepSeek-V4-Flash's bf16 replay parted
from ``generate`` after 178 of 200 decode steps on that last bit alone (its hyper-connection
``attn_hc.fn`` product is float32): ``checkpoint_binding.in_torch_memory``. The checkpoint here is
a tiny random Llama whose widths put its tensors off alignment in the file (36 floats: every one of its
products differs in the last bit when read in place, on an AVX-512 CPU).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from kimi_adapter_core.backends.extraction.equivalence.checkpoint_binding import saved_and_loaded
from kimi_adapter_core.checkpoint.loader import load_weights

ALIGNMENT = 64  # bytes: torch's CPU allocator's, and an AVX-512 register's


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40, hidden_size=36, intermediate_size=100, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=18,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _identity_map(model: LlamaForCausalLM, path: Path) -> Path:
    """A weight map reading each of the model's tensors under its own name, unchanged."""
    weights = {}
    for name, tensor in model.state_dict().items():
        shape, dtype = list(tensor.shape), str(tensor.dtype).removeprefix("torch.")
        source = {"tensors": [name], "shape": shape, "dtype": dtype}
        weights[name] = {"shape": shape, "dtype": dtype, "sources": [source], "ops": []}
    path.write_text(json.dumps({"format": "kadapt-weight-map", "version": 1, "weights": weights}))
    return path


def test_the_replay_weights_sit_in_torch_memory_and_multiply_as_the_models(tmp_path: Path) -> None:
    model = _model()
    weight_map = _identity_map(model, tmp_path / "weight_map.json")
    options = SimpleNamespace(weight_renames=(), path=lambda kind: weight_map)
    weights = saved_and_loaded(model, options, tmp_path)  # type: ignore[arg-type]
    # the file's own tensors are off alignment, else this checkpoint proves nothing
    raw = load_weights(weight_map, tmp_path / "checkpoint")
    assert any(tensor.data_ptr() % ALIGNMENT for tensor in raw.values())
    params = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(1)
    for name, tensor in weights.items():
        assert torch.equal(tensor, params[name]), name
        if tensor.dim() == 2 and name != "model.embed_tokens.weight":
            x = torch.randn(1, 1, tensor.shape[1], generator=generator)
            with torch.no_grad():
                ours, theirs = F.linear(x, tensor), F.linear(x, params[name])
            assert torch.equal(ours, theirs), (name, (ours - theirs).abs().max())
    assert all(tensor.data_ptr() % ALIGNMENT == 0 for tensor in weights.values())
