"""KV mapping v2: a runtime written from the mapping's contract and the IR files alone.

The driver below reads nothing of kadapt's at run time: tensor names, shapes, dtypes, the mask rule,
the slot rule, the padding rule and the capacity come from the saved ``*_kv_mapping.json``; the graphs
run in torch_ir's executor. 200 greedy decode steps after a right-padded, shorter-than-ABI prompt must
equal transformers' ``generate()`` on the unpadded prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def _mask(mapping: dict, positions: torch.Tensor, key_len: int, real: int) -> torch.Tensor:
    """The contract's rule: slot k visible to position p iff k <= p and slot k holds a real token."""
    dtype = getattr(torch, mapping["dtype"])
    keys = torch.arange(key_len)
    visible = (keys.view(1, 1, 1, -1) <= positions.view(1, 1, -1, 1)) & (keys < real).view(1, 1, 1, -1)
    hidden = torch.finfo(dtype).min if mapping["contract"]["mask"]["hidden"] == "finfo(dtype).min" else None
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, hidden)


def _drive(out: Path, prefix: str, weights: dict, prompt: torch.Tensor) -> list[int]:
    mapping = json.loads((out / f"{prefix}_kv_mapping.json").read_text())
    contract = mapping["contract"]
    assert contract["version"] == 2 and contract["padding"]["supported"] == "right"
    prefill = torch_ir.IRExecutor(torch_ir.load_ir(str(out / mapping["prefill_graph"])), weights)
    decode = torch_ir.IRExecutor(torch_ir.load_ir(str(out / mapping["decode_graph"])), weights)
    n, width = prompt.shape[1], mapping["prefill_len"]
    padded = torch.cat([prompt, torch.zeros(1, width - n, dtype=torch.long)], dim=1)  # right padding
    positions = torch.arange(width).unsqueeze(0)  # slot rule: position == slot
    logits, *present = prefill.execute((padded, _mask(mapping, positions, width, n), positions))
    dtype = getattr(torch, mapping["dtype"])
    cache = []
    for layer in mapping["layers"]:  # prefill_to_decode: index_copy into zeros of the decode shape
        for role in ("key", "value"):
            spec = layer[f"decode_{role}_input"]
            cache.append(
                torch.zeros(spec["shape"], dtype=dtype).index_copy(
                    mapping["sequence_dim"], torch.arange(width), present[len(cache)]
                )
            )
    token = logits[:, n - 1].argmax(-1, keepdim=True)
    tokens = [token.item()]
    for position in range(n, n + STEPS):
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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "kimi_k25"])
def test_runtime_from_the_mapping_alone_decodes_200_steps(name: str, tmp_path: Path) -> None:
    spec = load_spec(name)
    options = options_from_spec(spec, output_dir=tmp_path, prefill_len=PREFILL, max_cache_len=CACHE)
    config = load_config(spec, overrides=tiny_overrides(spec, options))
    torch.manual_seed(0)
    with applied(spec):
        model = load_model(spec, device="cpu", config=config, dtype=torch.float32).eval()
        meta = load_model(spec, device="meta", config=config, dtype=torch.float32).eval()
        import dataclasses

        run(spec, meta, dataclasses.replace(options, dtype="float32"), echo=lambda _: None)
    weights = {rename_weight(k, options.weight_renames): v for k, v in model.state_dict().items()}
    text = config.text_config if hasattr(config, "text_config") else config
    prompt = torch.randint(3, text.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    ours = _drive(tmp_path, options.file_prefix, weights, prompt)
    if hasattr(text, "_experts_implementation"):
        text._experts_implementation = "eager"
    generation = GenerationConfig(
        max_new_tokens=STEPS + 1, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    model.generation_config.eos_token_id = None  # else the tiny config's eos (2) ends generate() early
    with torch.no_grad():
        reference = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), generation_config=generation
        )
    assert ours == reference[0, PROMPT:].tolist()
