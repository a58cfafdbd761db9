"""KV mapping v2: a runtime written from the mapping's contract and the IR files alone.

The driver below reads nothing of kadapt's at run time: tensor names, shapes, dtypes, the mask rule,
the slot rule, the padding rule and the capacity come from the saved ``*_kv_mapping.json``; the graphs
run in torch_ir's executor. 200 greedy decode steps after a right-padded, shorter-than-ABI prompt must
equal transformers' ``generate()`` on the unpadded prompt. For Kimi-K2.5 the mapping's ``merged_prefill``
section drives an image prompt too: pixels through the vision graph it names, the features into the
multimodal prefill at the placeholder token it names, its KV into the same decode graph, equal to
``generate()`` given the pixels.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch_ir
from transformers import GenerationConfig

from kimi_adapter_core.backends.extraction import options_from_spec, run
from kimi_adapter_core.backends.extraction.naming import rename_weight
from kimi_adapter_core.backends.extraction.roundtrip import tiny_overrides
from kimi_adapter_core.loading import applied, load_config, load_model
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
PREFILL, CACHE, STEPS, PROMPT = 8, 216, 200, 5
# Kimi-K2.5's image prompt: a 4x4-patch image (4 placeholder tokens) in a 12-token multimodal prefill,
# prompted with 3 text tokens, the image, 2 text tokens (9 tokens, right padded), then decoded
GRID, MERGED_LEN, IMAGE_STEPS = ((1, 4, 4),), 12, 40


def _mask(mapping: dict, positions: torch.Tensor, key_len: int, real: int) -> torch.Tensor:
    """The contract's rule: slot k visible to position p iff k <= p and slot k holds a real token."""
    dtype = getattr(torch, mapping["dtype"])
    keys = torch.arange(key_len)
    visible = (keys.view(1, 1, 1, -1) <= positions.view(1, 1, -1, 1)) & (keys < real).view(1, 1, 1, -1)
    hidden = torch.finfo(dtype).min if mapping["contract"]["mask"]["hidden"] == "finfo(dtype).min" else None
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, hidden)


def _drive(
    out: Path, prefix: str, weights: dict, prompt: torch.Tensor, pixels: torch.Tensor | None = None
) -> list[int]:
    """Greedy tokens after ``prompt``: the text prefill, or with ``pixels`` the multimodal prefill."""
    mapping = json.loads((out / f"{prefix}_kv_mapping.json").read_text())
    contract = mapping["contract"]
    assert contract["version"] == 2 and contract["padding"]["supported"] == "right"
    decode = torch_ir.IRExecutor(torch_ir.load_ir(str(out / mapping["decode_graph"])), weights)
    n = prompt.shape[1]
    if pixels is None:
        graph, width, extra, layers = mapping["prefill_graph"], mapping["prefill_len"], (), mapping["layers"]
    else:  # the features of the vision graph the mapping names go to the multimodal prefill
        merged = mapping["merged_prefill"]
        features_from = merged["image_features"]["from"]
        vision = torch_ir.IRExecutor(torch_ir.load_ir(str(out / features_from["graph"])), weights)
        (features,) = vision.execute((pixels,))
        assert list(features.shape) == merged["image_features"]["shape"]
        assert int((prompt == merged["placeholder_token_id"]).sum()) == features.shape[0]
        assert merged["inputs"][1] == merged["image_features"]["input"]
        graph, width, extra, layers = merged["graph"], merged["prefill_len"], (features,), merged["layers"]
    prefill = torch_ir.IRExecutor(torch_ir.load_ir(str(out / graph)), weights)
    padded = torch.cat([prompt, torch.zeros(1, width - n, dtype=torch.long)], dim=1)  # right padding
    positions = torch.arange(width).unsqueeze(0)  # slot rule: position == slot
    logits, *present = prefill.execute((padded, *extra, _mask(mapping, positions, width, n), positions))
    dtype = getattr(torch, mapping["dtype"])
    cache = []
    for source, layer in zip(layers, mapping["layers"], strict=True):  # prefill_to_decode: index_copy
        for role in ("key", "value"):  # into zeros of the decode shape
            spec = layer[f"decode_{role}_input"]
            if pixels is not None:
                assert source[f"decode_{role}_input"] == spec["name"]
            cache.append(
                torch.zeros(spec["shape"], dtype=dtype).index_copy(
                    mapping["sequence_dim"], torch.arange(width), present[len(cache)]
                )
            )
    token = logits[:, n - 1].argmax(-1, keepdim=True)
    tokens = [token.item()]
    for position in range(n, n + (STEPS if pixels is None else IMAGE_STEPS)):
        assert position <= contract["capacity"]["max_position"]
        pos = torch.tensor([[position]])
        logits, *cache = decode.execute(
            (
                token,
                _mask(mapping, pos, mapping["max_cache_len"], position + 1),
                pos,
                torch.tensor([position]),
                *cache,
            )
        )
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token.item())
    return tokens


def _generate(model: torch.nn.Module, prompt: torch.Tensor, steps: int, **inputs: torch.Tensor) -> list[int]:
    generation = GenerationConfig(
        max_new_tokens=steps + 1, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    model.generation_config.eos_token_id = None  # else the tiny config's eos (2) ends generate() early
    with torch.no_grad():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), generation_config=generation, **inputs
        )
    return out[0, prompt.shape[1] :].tolist()


def _with_image_prompt(spec: Any, options: Any) -> Any:
    """Kimi-K2.5's options with a small image ABI whose multimodal prefill fits the test's cache."""
    merged = options_from_spec(spec, output_dir=options.output_dir, max_cache_len=600).merged_prefill
    assert merged is not None and options.vision is not None
    return dataclasses.replace(
        options,
        vision=dataclasses.replace(options.vision, grid_thws=GRID),
        merged_prefill=dataclasses.replace(merged, prefill_len=MERGED_LEN),
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "kimi_k25"])
def test_runtime_from_the_mapping_alone_decodes_200_steps(name: str, tmp_path: Path) -> None:
    spec = load_spec(name)
    options = options_from_spec(spec, output_dir=tmp_path, prefill_len=PREFILL, max_cache_len=CACHE)
    if options.vision is not None:
        options = _with_image_prompt(spec, options)
    config = load_config(spec, overrides=tiny_overrides(spec, options))
    torch.manual_seed(0)
    with applied(spec):
        model = load_model(spec, device="cpu", config=config, dtype=torch.float32).eval()
        meta = load_model(spec, device="meta", config=config, dtype=torch.float32).eval()
        run(spec, meta, dataclasses.replace(options, dtype="float32"), echo=lambda _: None)
    weights = {rename_weight(k, options.weight_renames): v for k, v in model.state_dict().items()}
    text = config.text_config if hasattr(config, "text_config") else config
    prompt = torch.randint(3, text.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    ours = _drive(tmp_path, options.file_prefix, weights, prompt)
    image = None
    if options.merged_prefill is not None:
        pixels = torch.randn(16, 3, 14, 14, generator=torch.Generator().manual_seed(4))
        placeholders = torch.full((1, 4), config.image_token_id)
        image = torch.cat([prompt[:, :3], placeholders, prompt[:, 3:]], dim=1)
        image_tokens = _drive(tmp_path, options.file_prefix, weights, image, pixels)
    if hasattr(text, "_experts_implementation"):
        text._experts_implementation = "eager"
    assert ours == _generate(model, prompt, STEPS)
    if image is not None:
        grid = torch.tensor(GRID)
        assert image_tokens == _generate(model, image, IMAGE_STEPS, pixel_values=pixels, image_grid_thw=grid)
        assert len(set(image_tokens)) > 5 and image_tokens != ours[: IMAGE_STEPS + 1]
