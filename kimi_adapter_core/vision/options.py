"""The vision graph's fixed image ABI (``abi.vision``) as read from a spec, without torch."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import KadaptError
from ..spec.model import LAYER, Spec, VisionAbi


@dataclass(frozen=True)
class VisionOptions:
    """The vision graph's fixed image ABI (``abi.vision``): which images one call packs, and names."""

    projector: str  # module path of the projector
    grid_thws: tuple[tuple[int, int, int], ...]
    merge_kernel: tuple[int, int] | None  # the spec's claim, checked against the config at export
    input_name: str
    output_name: str
    where: str | None = None  # spec location of abi.vision

    @property
    def num_patches(self) -> int:
        return sum(t * h * w for t, h, w in self.grid_thws)


def vision_options(spec: Spec, vision: VisionAbi) -> VisionOptions:
    """``abi.vision`` read and checked (one input, one output, plain names) without torch."""
    where = spec.locate("abi.vision")
    for side, names in (("inputs", vision.inputs), ("outputs", vision.outputs)):
        if len(names) != 1 or LAYER in names[0]:
            raise KadaptError(
                f"abi.vision.{side} must name exactly one tensor (no {{layer}}), got {list(names)}",
                location=spec.locate(f"abi.vision.{side}"),
            )
    if vision.merge_kernel is not None:
        rows, cols = vision.merge_kernel
        for index, (_, h, w) in enumerate(vision.grid_thws):
            if h % rows or w % cols:
                raise KadaptError(
                    f"abi.vision.grid_thws[{index}] = [{h}, {w}] patches is not divisible by the "
                    f"merge kernel {rows}x{cols}",
                    location=spec.locate(f"abi.vision.grid_thws[{index}]"),
                )
    return VisionOptions(
        projector=vision.projector,
        grid_thws=vision.grid_thws,
        merge_kernel=vision.merge_kernel,
        input_name=vision.inputs[0],
        output_name=vision.outputs[0],
        where=where,
    )
