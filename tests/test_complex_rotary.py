"""Complex rotary embeddings in real arithmetic: DeepSeek-V2's and Llama-4's builtins against upstream.

DeepSeek-V2 and Llama-4 rotate with complex ``freqs_cis``; their builtins (``builtins/deepseek_v2.py``,
``builtins/llama4.py``) give ``(cos, sin)`` and rotate interleaved pairs in real arithmetic. Here, on
tiny random models of transformers' own classes: the ``(cos, sin)`` are upstream's ``freqs_cis``
(attention scaling included), the pair rotation is the complex multiply bit for bit, DeepSeek-V2's
attention gives upstream's output and caches upstream's latents over a prefill and a decode step (with
and without a query LoRA), and the family matrix's guide patches are pinned to the installed sources.
The row (adapted in the default latent layout, verified ragged and paged) is the family matrix's; the
expanded layout and absorbed attention are verified here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV2Config, DynamicCache, Llama4TextConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
    DeepseekV2Attention,
    DeepseekV2RotaryEmbedding,
)
from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding

from kimi_adapter_core.backends import extraction
from kimi_adapter_core.backends.extraction.runtime.abi import absorbed_mla_forward
from kimi_adapter_core.builtins import registry
from kimi_adapter_core.builtins.deepseek_v2 import (
    _rotate_pairs,
    deepseek_v2_attention_forward,
    deepseek_v2_rotary_cos_sin,
)
from kimi_adapter_core.builtins.llama4 import llama4_rotary_cos_sin
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import GUIDE_PATCHES, buildable_config, module_paths, write_spec
from kimi_adapter_core.patching import pins
from kimi_adapter_core.patching.targets import import_module, parse_target, resolve_in
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.spec.model import Pin

MIN = torch.finfo(torch.float32).min
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 32, "beta_slow": 1}  # fmt: skip


def _deepseek_v2_config(**over: object) -> DeepseekV2Config:
    """The family matrix's tiny deepseek_v2 config (eager attention), with ``over`` on top."""
    raw = {**tiny_config("deepseek_v2"), **over}
    config = DeepseekV2Config(**{k: v for k, v in raw.items() if k != "model_type"})
    config._attn_implementation = "eager"
    return config


def _positions(batch: int, length: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + length).repeat(batch, 1) + torch.arange(batch)[:, None] * 3


@pytest.mark.parametrize(
    ("rotary", "builtin"),
    [
        (lambda: DeepseekV2RotaryEmbedding(_deepseek_v2_config()), deepseek_v2_rotary_cos_sin),
        (
            lambda: DeepseekV2RotaryEmbedding(_deepseek_v2_config(rope_parameters=YARN)),
            deepseek_v2_rotary_cos_sin,
        ),
        (lambda: Llama4TextRotaryEmbedding(Llama4TextConfig(**_llama4_sizes())), llama4_rotary_cos_sin),
    ],
    ids=["deepseek_v2", "deepseek_v2-yarn", "llama4_text"],
)
def test_cos_sin_are_upstreams_complex_frequencies(rotary, builtin) -> None:
    embedding = rotary()
    positions = _positions(2, 37)
    x = torch.zeros(2, 37, 8)
    freqs_cis = embedding(x, positions)
    cos, sin = builtin(embedding, x, positions)
    assert cos.shape == sin.shape == freqs_cis.shape
    # polar's cos/sin and torch.cos/sin differ by at most an ulp or two
    torch.testing.assert_close(cos, freqs_cis.real, rtol=0, atol=4e-7 * max(1.0, embedding.attention_scaling))
    torch.testing.assert_close(sin, freqs_cis.imag, rtol=0, atol=4e-7 * max(1.0, embedding.attention_scaling))
    if "yarn" in str(embedding.rope_type):  # the scaling is carried, not dropped
        assert embedding.attention_scaling != 1.0
        assert cos.abs().max() > 1.0


def _llama4_sizes() -> dict[str, object]:
    return {k: v for k, v in tiny_config("llama4_text").items() if k != "model_type"}


def test_dynamic_rope_types_are_refused() -> None:
    embedding = DeepseekV2RotaryEmbedding(_deepseek_v2_config())
    embedding.rope_type = "dynamic"
    with pytest.raises(ValueError, match="deepseek_v2_rotary_cos_sin: rope_type 'dynamic'"):
        deepseek_v2_rotary_cos_sin(embedding, torch.zeros(1, 2, 8), _positions(1, 2))


def test_pair_rotation_is_the_complex_multiply_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 5, 16, generator=generator)
    angles = torch.randn(2, 1, 5, 8, generator=generator) * 100
    cos, sin = torch.cos(angles), torch.sin(angles)
    expected = torch.view_as_real(torch.view_as_complex(x.reshape(2, 4, 5, 8, 2)) * torch.complex(cos, sin))
    assert torch.equal(_rotate_pairs(x, cos, sin), expected.flatten(3))


def _causal_mask(queries: int, keys: int) -> torch.Tensor:
    """``[1, 1, Q, K]`` additive mask: query ``q`` (at position ``keys - queries + q``) sees keys up to it."""
    past = keys - queries
    visible = torch.arange(keys)[None, :] <= (past + torch.arange(queries))[:, None]
    return torch.where(visible, 0.0, MIN)[None, None]


@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["query-lora", "no-query-lora"])
def test_deepseek_v2_attention_is_upstreams_and_caches_its_latents(q_lora_rank: int | None) -> None:
    config = _deepseek_v2_config(q_lora_rank=q_lora_rank, rope_parameters=YARN)
    torch.manual_seed(0)
    attention = DeepseekV2Attention(config, layer_idx=0).eval()
    rotary = DeepseekV2RotaryEmbedding(config)
    caches = DynamicCache(config=config), DynamicCache(config=config)
    generator = torch.Generator().manual_seed(1)
    seen = 0
    for length in (7, 1):  # a prefill, then a decode step over the cache
        hidden = torch.randn(2, length, config.hidden_size, generator=generator)
        positions = _positions(2, length, start=seen)
        mask = _causal_mask(length, seen + length)
        with torch.no_grad():
            expected, _ = attention(hidden, mask, caches[0], rotary(hidden, positions))
            ours, _ = deepseek_v2_attention_forward(
                attention, hidden, mask, caches[1], deepseek_v2_rotary_cos_sin(rotary, hidden, positions)
            )
        seen += length
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
        assert ours.abs().max() > 1e-3  # not a vacuous comparison
    upstream_layer, our_layer = caches[0].layers[0], caches[1].layers[0]
    assert our_layer.keys.shape == (2, 1, seen, config.kv_lora_rank)  # the latent, cached compressed
    assert our_layer.values.shape == (2, 1, seen, config.qk_rope_head_dim)  # the rope'd shared key
    torch.testing.assert_close(our_layer.keys, upstream_layer.keys, rtol=0, atol=0)
    torch.testing.assert_close(our_layer.values, upstream_layer.values, rtol=0, atol=1e-6)


def test_deepseek_v2_attention_routes_expand_kv_through_the_instance() -> None:
    """The ``expanded`` layout's cache shadows ``self_attn.expand_kv`` on the instance: the builtin must
    call it there, not the class's."""
    config = _deepseek_v2_config()
    attention = DeepseekV2Attention(config, layer_idx=0).eval()
    rotary = DeepseekV2RotaryEmbedding(config)
    calls = []

    def expand_kv(k_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((k_nope.shape, k_rot.shape))
        return DeepseekV2Attention.expand_kv(attention, k_nope, k_rot)

    attention.__dict__["expand_kv"] = expand_kv
    hidden = torch.randn(1, 3, config.hidden_size)
    positions = _positions(1, 3)
    with torch.no_grad():
        deepseek_v2_attention_forward(
            attention, hidden, _causal_mask(3, 3), None, deepseek_v2_rotary_cos_sin(rotary, hidden, positions)
        )
    assert calls == [((1, 1, 3, config.kv_lora_rank), (1, 1, 3, config.qk_rope_head_dim))]


@pytest.mark.parametrize("model_type", ["deepseek_v2", "llama4", "llama4_text"])
def test_guide_patches_are_registered_and_pinned_to_the_installed_sources(model_type: str) -> None:
    for patch in GUIDE_PATCHES[model_type]:
        assert patch["impl"].removeprefix("builtin:") in registry.BUILTINS
        registry.resolve(patch["impl"].removeprefix("builtin:"))
        ref = parse_target(patch["target"])
        function = resolve_in(ref, import_module(ref)).function()
        entries = patch["pin"] if isinstance(patch["pin"], list) else [patch["pin"]]  # per release, or one
        found = [
            pins.drift(Pin(entry.get("signature"), entry.get("source_sha256")), function) for entry in entries
        ]
        assert [] in found, (patch["id"], found)


@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["query-lora", "no-query-lora"])
def test_absorbed_mla_rotates_deepseek_v2_pairs_as_upstream(q_lora_rank: int | None) -> None:
    """``absorbed`` replaces the attention's forward: given the builtin's one angle per pair, it rotates
    the pairs itself, to upstream's output and upstream's cached latents."""
    config = _deepseek_v2_config(q_lora_rank=q_lora_rank)
    torch.manual_seed(0)
    attention = DeepseekV2Attention(config, layer_idx=0).eval()
    rotary = DeepseekV2RotaryEmbedding(config)
    caches = DynamicCache(config=config), DynamicCache(config=config)
    generator = torch.Generator().manual_seed(2)
    seen = 0
    for length in (6, 1):
        hidden = torch.randn(2, length, config.hidden_size, generator=generator)
        positions = _positions(2, length, start=seen)
        mask = _causal_mask(length, seen + length)
        with torch.no_grad():
            expected, _ = attention(hidden, mask, caches[0], rotary(hidden, positions))
            ours, _ = absorbed_mla_forward(
                attention,
                hidden,
                deepseek_v2_rotary_cos_sin(rotary, hidden, positions),
                mask,
                cache_keyword="cache",
                cache=caches[1],
            )
        seen += length
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
        assert ours.abs().max() > 1e-3
    torch.testing.assert_close(caches[1].layers[0].values, caches[0].layers[0].values, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("kv_layout", "mla_attention"), [("expanded", "reexpand"), ("latent", "absorbed")])
def test_deepseek_v2_verifies_in_every_mla_layout(tmp_path: Path, kv_layout: str, mla_attention: str) -> None:
    """The family matrix's row is the default layout (latent, reexpand); the guide's spec in the other
    two, exported and replayed against transformers."""
    config, built = buildable_config("deepseek_v2")
    spec_path = write_spec(tmp_path, "deepseek_v2", config, module_paths(built))
    text = spec_path.read_text()
    spec_path.write_text(
        text.replace("abi:\n", f"abi:\n  kv_layout: {kv_layout}\n  mla_attention: {mla_attention}\n")
    )
    spec = load_spec(spec_path)
    options = extraction.options_from_spec(spec, output_dir=tmp_path / "out")
    report = extraction.verify(
        spec, dataclasses.replace(options, verify_dtypes=("float32",)), echo=lambda line: None
    )
    assert report.passed, [c.detail for c in report.checks if not c.passed]
    assert report.attention_label == f"{kv_layout} KV, {mla_attention} MLA"
