"""The vision tower as one call on a fixed image ABI: what both backends trace.

MoonViT derives its grid tensors (position-embedding taps, frame indices, rotary positions, the merge
gather) from ``grid_thw`` on every call. ``VisionWrapper`` computes them once, with transformers'
own helpers, and hands them to the encoder through the keyword arguments those helpers pop, so a
trace sees one input (the pixel patches) and one output (projected feature rows). Extraction exports
it (``backends/extraction/ir/vision.py``), simulation prices it (``estimate/vision.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import upstream
from ..errors import KadaptError
from ..spec.model import Spec
from .options import VisionOptions


def _grid_tensors(tower: nn.Module, grid_thw: torch.Tensor) -> tuple[dict[str, torch.Tensor], int | None]:
    """What MoonViT computes from ``grid_thw`` each call, computed on CPU by transformers' helpers.

    The tensors by IR constant name, and the merged token count the 5.24 scatter merge also takes.
    The temporal merge is the ``vision_grid_helpers`` contact point: a gather index up to transformers
    5.23; since 5.24 a destination index, a per-patch frame weight and the merged token count.
    """
    upstream.check(("vision_grid_helpers",))
    from transformers.models.kimi_k25 import modeling_kimi_k25 as kimi
    from transformers.vision_utils import (
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    pos_emb = tower.patch_embed.pos_emb
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid_thw,
        pos_emb.num_grid_per_side,
        mode=pos_emb.interpolation_mode,
        align_corners=pos_emb.interpolation_align_corners,
    )
    rows, cols = tower.merge_kernel_size
    tensors = {
        "interp_indices": indices,
        "interp_weights": weights,
        "frame_index": kimi.get_vision_frame_index(grid_thw),
        "position_ids": get_vision_position_ids(grid_thw, spatial_merge_size=1),
    }
    merge = kimi.get_vision_temporal_merge_index(grid_thw, rows, cols)
    if upstream.temporal_merge_layout() == "tensor":
        return {**tensors, "temporal_merge_index": merge}, None
    destination, frame_weight, merged_tokens = merge
    return {**tensors, "temporal_merge_index": destination, "temporal_merge_frame_weight": frame_weight}, int(
        merged_tokens
    )


class VisionWrapper(nn.Module):
    """``pixel_values [patches, channels, patch, patch]`` -> ``image features [tokens, text hidden]``.

    Equal to ``torch.cat(model.get_image_features(pixel_values, grid_thw).pooler_output)`` for the
    fixed ``grid_thw``. ``cu_seqlens`` is a numpy array on purpose: MoonViT's eager attention splits
    the packed images with ``(cu_seqlens[1:] - cu_seqlens[:-1]).tolist()``, which on a tensor traces
    into data-dependent ``item()`` calls and symbolic split sizes; numpy gives the static sizes.
    """

    def __init__(self, encoder: nn.Module, projector: nn.Module, grid_thws: tuple[tuple[int, int, int], ...]):
        super().__init__()
        self.encoder = encoder
        self.projector = projector
        self.grid_thw = torch.tensor(grid_thws, dtype=torch.long)
        # CPU values, for the IR's constants
        self.values, self.merged_tokens = _grid_tensors(encoder, self.grid_thw)
        device = next(encoder.parameters()).device
        for name, value in self.values.items():
            self.register_buffer(name, value.to(device), persistent=False)
        seqlens = [t * h * w for t, h, w in grid_thws]
        self.cu_seqlens = np.cumsum([0, *seqlens])

    def grid_kwargs(self) -> dict[str, Any]:
        """The precomputed values under the keyword arguments MoonViT's helpers pop."""
        grid: dict[str, Any] = {name: getattr(self, name) for name in upstream.VISION_GRID_KWARGS}
        if self.merged_tokens is not None:  # the scatter merge takes its three values as one argument
            grid["temporal_merge_index"] = (
                self.temporal_merge_index,
                self.temporal_merge_frame_weight,
                self.merged_tokens,
            )
        return grid

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.encoder(
            pixel_values, grid_thw=self.grid_thw, cu_seqlens=self.cu_seqlens, **self.grid_kwargs()
        )
        return self.projector(out.pooler_output).squeeze(1)


@dataclass(frozen=True)
class VisionModules:
    """The encoder and projector inside the full model, and the image ABI they are exported at."""

    model: nn.Module
    encoder: nn.Module
    projector: nn.Module
    abi: VisionOptions

    @property
    def config(self) -> Any:
        return self.encoder.config

    @property
    def patch_shape(self) -> tuple[int, int, int]:
        proj = self.encoder.patch_embed.proj
        return (proj.in_channels, *proj.kernel_size)

    @property
    def merge_kernel(self) -> tuple[int, int]:
        rows, cols = self.encoder.merge_kernel_size
        return int(rows), int(cols)

    @property
    def tokens_per_image(self) -> list[int]:
        rows, cols = self.merge_kernel
        return [h // rows * (w // cols) for _, h, w in self.abi.grid_thws]


def vision_modules(spec: Spec, model: nn.Module, abi: VisionOptions) -> VisionModules:
    """Find the encoder and projector, and check the ABI against them (merge kernel, grid divisibility)."""
    from ..loading import submodule

    encoder = submodule(model, spec, "vision_tower")
    try:
        projector = model.get_submodule(abi.projector)
    except AttributeError as exc:
        raise KadaptError(
            f"abi.vision.projector {abi.projector!r} does not exist in {type(model).__name__}: {exc}",
            location=abi.where,
        ) from exc
    if not hasattr(encoder, "merge_kernel_size") or not hasattr(encoder, "patch_embed"):
        raise KadaptError(
            f"abi.vision supports MoonViT encoders (Kimi_K25VisionModel); module_paths.vision_tower is a "
            f"{type(encoder).__name__}",
            location=abi.where,
        )
    modules = VisionModules(model, encoder, projector, abi)
    rows, cols = modules.merge_kernel
    if abi.merge_kernel is not None and abi.merge_kernel != (rows, cols):
        raise KadaptError(
            f"abi.vision.merge_kernel {list(abi.merge_kernel)} contradicts the vision config's "
            f"merge_kernel_size [{rows}, {cols}]",
            location=abi.where,
        )
    for index, (_, h, w) in enumerate(abi.grid_thws):
        if h % rows or w % cols:
            raise KadaptError(
                f"abi.vision.grid_thws[{index}] = [{h}, {w}] patches is not divisible by the merge kernel "
                f"{rows}x{cols}",
                location=abi.where,
            )
    if getattr(modules.config, "_attn_implementation", None) not in (None, "eager", "sdpa"):
        raise KadaptError(
            f"the vision encoder uses {modules.config._attn_implementation} attention; the vision graph "
            "needs eager or sdpa attention (set vision_config._attn_implementation in config_bridges)",
            location=abi.where,
        )
    return modules
