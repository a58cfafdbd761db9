"""The vision graph's round trip: the saved vision JSON, executed by ``torch_ir``, against transformers.

Part of ``--verify``: after ``pipeline.run`` wrote the tiny model's files, random pixel patches at the
spec's fixed grid go through the saved ``…_vision_ir.json`` (loaded with ``torch_ir.load_ir``, run by
its executor with the CPU model's weights) and through transformers' own
``model.get_image_features`` (encoder + projector, patches unmodified), and the features must agree
within the dtype's tolerance (``tolerance.compare``, each image token's row against its largest |feature|).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from ....spec.model import Spec
from ..options import ExtractionOptions
from ..runtime.symbolic import bind_ir
from .tolerance import Tolerance, compare


class Report(Protocol):
    def add(self, name: str, passed: bool, detail: str) -> None: ...


def random_pixels(
    spec: Spec, model: nn.Module, options: ExtractionOptions, dtype: torch.dtype
) -> torch.Tensor:
    """Random normalised pixel patches ``[patches, channels, patch, patch]`` for the ABI's grids."""
    from ....loading import submodule

    assert options.vision is not None
    proj = submodule(model, spec, "vision_tower").patch_embed.proj
    shape = (options.vision.num_patches, proj.in_channels, *proj.kernel_size)
    return torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)


def reference_features(model: nn.Module, pixels: torch.Tensor, options: ExtractionOptions) -> torch.Tensor:
    """transformers' image features for ``pixels``: one row per image token, images in grid order."""
    assert options.vision is not None
    grid = torch.tensor(options.vision.grid_thws, dtype=torch.long)
    with torch.no_grad():
        out = model.get_image_features(pixels, image_grid_thw=grid)
    return torch.cat(list(out.pooler_output), dim=0)


def check_vision(
    report: Report,
    spec: Spec,
    model: nn.Module,
    options: ExtractionOptions,
    weights: dict[str, torch.Tensor],
    *,
    tolerance: Tolerance,
    suffix: str = "",
) -> dict[str, Any]:
    """Execute the saved vision IR and compare it with transformers; adds two checks to ``report``."""
    import torch_ir
    from torch_ir.weight_loader import validate_weights_against_ir

    assert options.vision is not None
    ir = torch_ir.load_ir(options.path("vision"))
    problems = validate_weights_against_ir(weights, ir)
    report.add(
        f"vision weights bind{suffix}", not problems, "; ".join(problems) or "all names, shapes, dtypes"
    )
    dtype = getattr(torch, options.dtype)
    pixels = random_pixels(spec, model, options, dtype)
    expected = reference_features(model, pixels, options)
    (features,) = torch_ir.IRExecutor(bind_ir(ir, (pixels,), {}, graph="vision"), weights).execute((pixels,))
    result = compare([(features, expected)], tolerance)
    grids = ", ".join(f"{t}x{h}x{w}" for t, h, w in options.vision.grid_thws)
    report.add(
        f"vision features{suffix}",
        result.passed,
        f"over {tuple(features.shape)} (grid {grids}) vs get_image_features: {result.detail()}",
    )
    return {"max_diff": result.max_diff, "shape": list(features.shape)}
