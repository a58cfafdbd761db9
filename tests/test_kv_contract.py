"""KV mapping (contract version 3): a runtime written from the mapping's contract and the IR files alone.

The driver below reads nothing of kadapt's at run time but the reference binder (``symbolic.bind_ir``,
torch-free, which a runtime copies): tensor names, shapes, dtypes, the mask rule, the slot rule, the
padding rule and the capacity come from the saved ``*_kv_mapping.json``; every graph call is checked by
the binder against the IR's declarations (and, for the multimodal prefill, the mapping's placeholder
rule) and run in torch_ir's executor. 200 greedy decode steps after a right-padded, shorter-than-ABI
prompt must equal transformers' ``generate()`` on the unpadded prompt, token for token and logits within
``--verify``'s own comparison (``tolerance.compare``). For Kimi-K2.5 the mapping's ``merged_prefill``
section drives an image prompt too: pixels through the vision graph it names, the features into the
multimodal prefill at the placeholder token it names, its KV into the same decode graph, equal to
``generate()`` given the pixels; the same prompt one placeholder short is refused before execution.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch_ir
from transformers import GenerationConfig

from kimi_adapter_core.backends.extraction import options_from_spec, run
from kimi_adapter_core.backends.extraction.equivalence.tolerance import Tolerance, compare
from kimi_adapter_core.backends.extraction.runtime.symbolic import Placeholders, bind_ir, ranges_from
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.checkpoint.naming import rename_weight
from kimi_adapter_core.errors import KadaptError
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


def _executor(
    out: Path, graph: str, weights: dict, section: dict, placeholders: Placeholders | None = None
) -> Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]:
    """Run ``graph`` (a file the mapping names) on inputs the binder has checked first."""
    ir = torch_ir.load_ir(str(out / graph))
    ranges = ranges_from(section.get("dynamic") or {})

    def execute(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        bound = bind_ir(ir, inputs, ranges, graph=graph, placeholders=placeholders)
        return torch_ir.IRExecutor(bound, weights).execute(inputs)

    return execute


def _drive(
    out: Path, prefix: str, weights: dict, prompt: torch.Tensor, pixels: torch.Tensor | None = None
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens after ``prompt`` and the logits that chose each: the text prefill, or with
    ``pixels`` the multimodal prefill."""
    mapping = json.loads((out / f"{prefix}_kv_mapping.json").read_text())
    contract = mapping["contract"]
    assert contract["version"] == 3 and contract["padding"]["supported"] == "right"
    decode = _executor(out, mapping["decode_graph"], weights, mapping)
    n = prompt.shape[1]
    if pixels is None:
        prefill = _executor(out, mapping["prefill_graph"], weights, mapping)
        width, extra, layers = mapping["prefill_len"], (), mapping["layers"]
    else:  # the features of the vision graph the mapping names go to the multimodal prefill
        merged = mapping["merged_prefill"]
        features_from = merged["image_features"]["from"]
        (features,) = _executor(out, features_from["graph"], weights, {})((pixels,))
        assert list(features.shape) == merged["image_features"]["shape"]
        assert merged["inputs"][1] == merged["image_features"]["input"]
        rule = Placeholders.from_document(merged)  # the binder counts the placeholders
        prefill = _executor(out, merged["graph"], weights, merged, rule)
        width, extra, layers = merged["prefill_len"], (features,), merged["layers"]
    padded = torch.cat([prompt, torch.zeros(1, width - n, dtype=torch.long)], dim=1)  # right padding
    positions = torch.arange(width).unsqueeze(0)  # slot rule: position == slot
    logits, *present = prefill((padded, *extra, _mask(mapping, positions, width, n), positions))
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
    tokens, chosen_by = [token.item()], [logits[:, n - 1]]
    for position in range(n, n + (STEPS if pixels is None else IMAGE_STEPS)):
        assert position <= contract["capacity"]["max_position"]
        pos = torch.tensor([[position]])
        logits, *cache = decode(
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
        chosen_by.append(logits[:, -1])
    return tokens, chosen_by


def _generate(
    model: torch.nn.Module, prompt: torch.Tensor, steps: int, **inputs: torch.Tensor
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and the logits of each step."""
    generation = GenerationConfig(
        max_new_tokens=steps + 1,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    model.generation_config.eos_token_id = None  # else the tiny config's eos (2) ends generate() early
    with torch.no_grad():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), generation_config=generation, **inputs
        )
    return out.sequences[0, prompt.shape[1] :].tolist(), list(out.logits)


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
    ours, our_logits = _drive(tmp_path, options.file_prefix, weights, prompt)
    image = None
    if options.merged_prefill is not None:
        pixels = torch.randn(16, 3, 14, 14, generator=torch.Generator().manual_seed(4))
        placeholders = torch.full((1, 4), config.image_token_id)
        image = torch.cat([prompt[:, :3], placeholders, prompt[:, 3:]], dim=1)
        image_tokens, image_logits = _drive(tmp_path, options.file_prefix, weights, image, pixels)
        short = image.clone()
        short[0, 3] = prompt[0, 0]  # one placeholder too few: refused, not merged with a row unused
        with pytest.raises(
            KadaptError, match="has 3 image placeholder tokens .* has 4 rows; they must be equal"
        ):
            _drive(tmp_path, options.file_prefix, weights, short, pixels)
    if hasattr(text, "_experts_implementation"):
        text._experts_implementation = "eager"
    within = Tolerance.of("float32", relative=options.verify_tolerance, ulps=options.verify_tolerance_ulps)
    theirs, their_logits = _generate(model, prompt, STEPS)
    assert ours == theirs
    logits = compare(zip(our_logits, their_logits, strict=True), within)
    assert logits.passed, logits.detail()
    if image is not None:
        grid = torch.tensor(GRID)
        theirs, their_logits = _generate(model, image, IMAGE_STEPS, pixel_values=pixels, image_grid_thw=grid)
        assert image_tokens == theirs
        logits = compare(zip(image_logits, their_logits, strict=True), within)
        assert logits.passed, logits.detail()
        assert len(set(image_tokens)) > 5 and image_tokens != ours[: IMAGE_STEPS + 1]
