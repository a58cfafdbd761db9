"""The images a vision-language prompt carries: patch grid, placeholder tokens and vision-cache bytes.

Torch-free arithmetic on the config's vision tower (``tower.VisionArch``), shared by ``kadapt plan``
(vision cache) and ``kadapt simulate --images`` (what the encoder traces and how many placeholder
tokens join the text prefill).

An image size here is what the encoder sees: the image processor's output after its resize and pad.
Each side must be a whole number of merge blocks (patch x merge pixels: 14 x 2 = 28 for Kimi-K2.5),
because the processor pads every image to that (transformers' ``Kimi_K25ImageProcessor``:
``navit_resize`` pads each side up to a multiple of ``merge_size * patch_size``); a size that is not is
refused with the padded size to use instead. One image of ``H x W`` pixels is then a ``1 x H/p x W/p``
patch grid (``grid_thw``), and the merger pools each ``merge_h x merge_w`` block into one token, so it
fills ``(H/p / merge_h) x (W/p / merge_w)`` placeholder tokens of the prompt - the processor's
``grid_thw.prod() // merge_size**2`` and the rows ``get_image_features`` returns for it.

Each token's feature is one text-hidden-wide bf16 row, which is what a vision cache keeps per image
(MAX's ``estimate_vision_cache_entry_bytes`` sizes an entry for the largest image the position grid
covers: ``pos_emb_height * pos_emb_width / merge^2`` tokens).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from ..spec.model import Spec
from .tower import VisionArch

FEATURE_BYTES = 2  # bf16 image features, as MAX's vision-cache estimate
_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_image_size(text: str) -> tuple[int, int]:
    """``"448x448"`` -> ``(448, 448)`` (height x width in pixels); ``ValueError`` for anything else."""
    match = _SIZE.match(text)
    if not match or not all(int(side) > 0 for side in match.groups()):
        raise ValueError(f"{text!r} is not HEIGHTxWIDTH in pixels, e.g. 448x448")
    return int(match.group(1)), int(match.group(2))


def max_tokens_per_image(v: VisionArch) -> int:
    """Tokens of the largest image the learned position grid covers (MAX's vision-cache entry basis)."""
    return v.pos_emb_height * v.pos_emb_width // (v.merge_h * v.merge_w)


def vision_cache_entry_bytes(v: VisionArch) -> int:
    """MAX's per-image vision-cache entry: max tokens per image x text hidden x 2 bytes (bf16)."""
    return max_tokens_per_image(v) * v.text_hidden * FEATURE_BYTES


@dataclass(frozen=True)
class ImageBatch:
    """``per_query`` images of ``height x width`` pixels in every query's prompt."""

    vision: VisionArch
    per_query: int
    height: int
    width: int

    @property
    def label(self) -> str:
        return f"{self.height}x{self.width}"

    @property
    def grid(self) -> tuple[int, int]:
        """Patch rows and columns of one image (its ``grid_thw`` is ``(1, rows, cols)``)."""
        return self.height // self.vision.patch_size, self.width // self.vision.patch_size

    @property
    def patches_per_image(self) -> int:
        rows, cols = self.grid
        return rows * cols

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens (and projected feature rows) of one image: one per merge block."""
        rows, cols = self.grid
        return rows // self.vision.merge_h * (cols // self.vision.merge_w)

    @property
    def tokens_per_query(self) -> int:
        return self.per_query * self.tokens_per_image

    @property
    def feature_bytes_per_image(self) -> int:
        """One image's projected features as a vision cache keeps them (bf16, text hidden wide)."""
        return self.tokens_per_image * self.vision.text_hidden * FEATURE_BYTES

    def images(self, queries: int) -> int:
        return queries * self.per_query

    def notes(self) -> list[str]:
        """What a runtime sized like MAX would not hold: an image larger than the position grid."""
        most = max_tokens_per_image(self.vision)
        if self.tokens_per_image <= most:
            return []
        v = self.vision
        return [
            f"an image of {self.label} fills {self.tokens_per_image} tokens, more than the {most} a "
            f"vision-cache entry sized from the position grid holds ({v.pos_emb_height}x{v.pos_emb_width} "
            f"patches / merge {v.merge_h}x{v.merge_w}, MAX's estimate)"
        ]

    def to_dict(self) -> dict[str, Any]:
        rows, cols = self.grid
        return {
            "images_per_query": self.per_query,
            "image_size": [self.height, self.width],
            "patch_size": self.vision.patch_size,
            "merge_kernel": [self.vision.merge_h, self.vision.merge_w],
            "grid_thw": [1, rows, cols],
            "patches_per_image": self.patches_per_image,
            "tokens_per_image": self.tokens_per_image,
            "image_tokens_per_query": self.tokens_per_query,
            "feature_bytes_per_image": self.feature_bytes_per_image,
        }


def default_image_size(spec: Spec, v: VisionArch) -> tuple[int, int] | None:
    """The image the spec's vision ABI declares (``abi.vision.grid_thws[0]``, one frame), in pixels."""
    vision = spec.abi.vision if spec.abi else None
    if vision is None or not vision.grid_thws:
        return None
    frames, rows, cols = vision.grid_thws[0]
    return (rows * v.patch_size, cols * v.patch_size) if frames == 1 else None


def image_batch(
    spec: Spec, vision: VisionArch | None, per_query: int, size: tuple[int, int] | None
) -> ImageBatch:
    """Check ``per_query`` images of ``size`` (default: the spec's ``abi.vision`` image) against the
    model's vision tower; a usage error (exit 2) names what is wrong and what would work."""
    v = vision
    if v is None:
        raise UsageError(
            f"--images: the model of spec {spec.name} has no vision tower (its config has no vision_config)"
        )
    if per_query < 1:
        raise UsageError(f"--images must be >= 1 (got {per_query})")
    if size is None:
        size = default_image_size(spec, v)
        if size is None:
            raise UsageError(
                f"--images needs --image-size HxW: spec {spec.name} declares no abi.vision image"
            )
    height, width = size
    unit_h, unit_w = v.patch_size * v.merge_h, v.patch_size * v.merge_w
    if height % unit_h or width % unit_w:
        padded = f"{math.ceil(height / unit_h) * unit_h}x{math.ceil(width / unit_w) * unit_w}"
        raise UsageError(
            f"--image-size {height}x{width}: the encoder takes whole {unit_h}x{unit_w}-pixel merge blocks "
            f"(patch {v.patch_size} x merge {v.merge_h}x{v.merge_w}); the image processor pads this image to "
            f"{padded}, pass that"
        )
    return ImageBatch(v, per_query, height, width)
