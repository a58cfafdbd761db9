"""The multimodal prefill's round trip: pixels -> saved vision JSON -> saved merged prefill JSON -> decode.

Part of ``--verify`` when the spec declares ``abi.vision.merged_prefill``. Everything the IR side does is
read from the saved files the way a serving runtime would: the KV mapping's ``merged_prefill`` section
gives the graph file, the feature input's shape, the placeholder token and the dynamic ranges; random
pixel patches at the spec's grid go through the saved vision IR, a prompt with one placeholder per
feature row (text before and after the image) through the saved merged prefill IR, and its KV into the
saved decode IR. ``roundtrip`` compares that with transformers' own
``model(input_ids, pixel_values, image_grid_thw)`` and ``generate`` (which run the vision tower and
``masked_scatter`` themselves), in each verify dtype.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ....errors import KadaptError
from ....spec.model import Spec
from ..options import MERGED, ExtractionOptions
from ..runtime import abi as runtime
from ..runtime.symbolic import Placeholders, bind_ir, ranges_from
from .vision import Report, random_pixels

Prefill = Callable[[torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]


def image_prompt(
    *, batch: int, text_len: int, image_tokens: int, placeholder: int, vocab_size: int, seed: int = 2
) -> torch.Tensor:
    """``[batch, text_len + image_tokens]`` token ids: the image's placeholder run in row 0 between two
    halves of random text (other rows text only), no text token equal to the placeholder."""
    generator = torch.Generator().manual_seed(seed)
    length = text_len + image_tokens
    prompt = torch.randint(3, vocab_size, (batch, length), generator=generator)
    prompt[prompt == placeholder] = 3
    start = text_len // 2
    prompt[0, start : start + image_tokens] = placeholder
    return prompt


Place = Callable[[list[torch.Tensor], torch.Tensor], list[torch.Tensor]]


class MergedReplay:
    """Runs the saved multimodal prefill as the KV mapping describes it; its KV goes into a decode cache."""

    def __init__(
        self, options: ExtractionOptions, weights: dict[str, torch.Tensor], place: Place | None = None
    ) -> None:
        """``place`` turns the prefill's KV (and each row's length) into the decode graph's cache; None:
        per-row contiguous caches."""
        import torch_ir

        self.place = place

        mapping = json.loads(options.path("kv_mapping").read_text())
        if "merged_prefill" not in mapping:
            raise KadaptError(f"{options.path('kv_mapping')} has no merged_prefill section")
        merged: dict[str, Any] = mapping["merged_prefill"]
        self.ir = torch_ir.load_ir(options.output_dir / merged["graph"])
        self.weights = weights
        self.placeholders = Placeholders.from_document(merged)  # checked by bind_ir on every run
        self.placeholder = self.placeholders.token_id
        self.feature_rows = int(merged["image_features"]["shape"][0])
        self.ranges = ranges_from(merged.get("dynamic") or {})
        self.dtype = getattr(torch, options.dtype)
        self.max_cache_len = int(mapping["max_cache_len"])

    def run(self, prompt: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits and the decode cache of ``prompt`` with ``features`` at its placeholders.

        A placeholder count other than the feature rows, or a shape outside the graph's, is refused
        before execution (``KadaptError``).
        """
        import torch_ir

        _, mask, positions = runtime.prefill_inputs(
            batch=prompt.shape[0], prefill_len=prompt.shape[1], dtype=self.dtype, device="cpu"
        )
        inputs = (prompt, features, mask, positions)
        ir = bind_ir(
            self.ir,
            inputs,
            self.ranges,
            graph=MERGED,
            placeholders=self.placeholders,
            max_cache_len=self.max_cache_len,
        )
        logits, *present = torch_ir.IRExecutor(ir, self.weights).execute(inputs)
        if self.place is not None:  # the decode cache the text replay keeps (a paged pool)
            return logits, self.place(present, torch.full((prompt.shape[0],), prompt.shape[1]))
        return logits, runtime.place_prefill_kv(present, self.max_cache_len)


@dataclass(frozen=True)
class MergedCase:
    """One multimodal prompt: what transformers gets, and the saved files' prefill for it."""

    prompt: torch.Tensor
    reference_inputs: dict[str, torch.Tensor]  # pixel_values, image_grid_thw
    prefill: Prefill  # the image's features from the saved vision IR, merged by the saved merged IR
    replay: MergedReplay


def image_tokens(spec: Spec, model: nn.Module, options: ExtractionOptions) -> int:
    """Image placeholder tokens of one call at the spec's grid, by the model's own merge kernel."""
    from ....vision.wrapper import vision_modules

    assert options.vision is not None
    return sum(vision_modules(spec, model, options.vision).tokens_per_image)


def vision_ir_features(
    options: ExtractionOptions, weights: dict[str, torch.Tensor], pixels: torch.Tensor
) -> torch.Tensor:
    """The saved vision IR's image features for ``pixels`` (executed by torch_ir)."""
    import torch_ir

    ir = bind_ir(torch_ir.load_ir(options.path("vision")), (pixels,), {}, graph="vision")
    (features,) = torch_ir.IRExecutor(ir, weights).execute((pixels,))
    return features


def merged_case(
    spec: Spec,
    model: nn.Module,
    options: ExtractionOptions,
    weights: dict[str, torch.Tensor],
    *,
    text_len: int,
    vocab_size: int,
    place: Place | None = None,
) -> MergedCase:
    """Pixels, their features through the saved vision IR, and an image prompt of ``text_len`` text tokens."""
    assert options.vision is not None
    replay = MergedReplay(options, weights, place)
    pixels = random_pixels(spec, model, options, getattr(torch, options.dtype))
    features = vision_ir_features(options, weights, pixels)
    prompt = image_prompt(
        batch=options.batch,
        text_len=text_len,
        image_tokens=replay.feature_rows,
        placeholder=replay.placeholder,
        vocab_size=vocab_size,
    )
    grid = torch.tensor(options.vision.grid_thws, dtype=torch.long)
    return MergedCase(
        prompt=prompt,
        reference_inputs={"pixel_values": pixels, "image_grid_thw": grid},
        prefill=lambda ids: replay.run(ids, features),
        replay=replay,
    )


def check_placeholder_refusal(report: Report, case: MergedCase, *, suffix: str = "") -> None:
    """A prompt with one placeholder too few must be refused before execution, not merged wrongly."""
    short = case.prompt.clone()
    first = int((short[0] == case.replay.placeholder).nonzero()[0, 0])
    short[0, first] = 3
    name = f"multimodal placeholder count checked before execution{suffix}"
    try:
        case.prefill(short)
    except KadaptError as exc:
        report.add(name, "must be equal" in str(exc), str(exc))
    else:
        report.add(name, False, f"a prompt with {case.replay.feature_rows - 1} placeholders ran")
