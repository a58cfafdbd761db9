"""Transformers as the reference a saved graph is compared with: unpatched, eager or the exported experts.

fp32 checks the exported experts' math against transformers' eager loop; bf16 checks the graph against
transformers running the exported experts implementation (the two round differently in bf16)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

# Why absorbed MLA has no bf16 round trip: transformers has no absorbed attention to compare with, and
# the two orders round differently. Measured on the tiny verify models (32-token prefill, logits vs the
# fp32 model): upstream reexpand in bf16 is off by 2.17 (DeepSeek-V3) / 0.27 (Kimi-K2.5), absorbed in
# bf16 by 2.43 / 0.22 - the same size, so it is rounding, not a defect (fp32 absorbed: 6e-6 / 8e-6).
ABSORBED_LOW_PRECISION = (
    "absorbed MLA is checked in float32 only: in bf16 it rounds in another order than transformers' "
    "re-expanding attention (its error against fp32 matches upstream bf16's: "
    "2.43 vs 2.17 on tiny DeepSeek-V3)"
)


@contextlib.contextmanager
def _upstream_experts(config: Any) -> Iterator[None]:
    """Run the reference with transformers' own eager experts loop, not the export-friendly one."""
    saved = getattr(config, "_experts_implementation", None)
    config._experts_implementation = "eager"
    try:
        yield
    finally:
        config._experts_implementation = saved


def reference_experts(text_config: Any, low_precision: bool) -> contextlib.AbstractContextManager[None]:
    """The experts transformers runs as the reference.

    fp32 checks the exported experts' math against transformers' eager loop; bf16 checks the graph
    against transformers running the exported experts implementation (eager and batched_mm round
    differently in bf16: on tiny Kimi-K2.5 their own outputs drift apart by up to 8 logits).
    """
    return contextlib.nullcontext() if low_precision else _upstream_experts(text_config)


def reference_run(
    model: nn.Module, prompt: torch.Tensor, steps: int, **inputs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Unpatched transformers: prefill logits, greedy tokens and per-token logits of ``generate``;
    ``inputs`` go to both (``pixel_values``/``image_grid_thw`` for an image prompt)."""
    from transformers import GenerationConfig

    generation = GenerationConfig(
        max_new_tokens=steps + 1,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    # generate() merges None with the model's own generation config, whose eos (the tiny config's 2)
    # would end the reference early; the IR decodes a fixed number of steps.
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        prefill_logits = model(input_ids=prompt, **inputs).logits
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), generation_config=generation, **inputs
        )
    return prefill_logits, out.sequences[:, prompt.shape[1] :], list(out.logits)
