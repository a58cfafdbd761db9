"""Command-line options shared by ``plan`` and ``simulate``: the deployment being sized.

Both commands size the same model the same way (``backends/simulation/model/inputs.py``), so they take
the parallel layout, weight mode, KV-cache dtype and device with one spelling and one default, and
the images each prompt carries (``--images``, ``--image-size``) alike.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from ..backends.simulation.model.arch import Architecture
    from ..spec.model import Spec
    from ..vision.images import ImageBatch

F = TypeVar("F", bound=Callable[..., Any])
PARALLEL = click.IntRange(1, 1 << 16)  # devices per dimension: 0 or a typo's 1e12 is a usage error


class DeviceOption(click.Option):
    """``--device``: its help lists the shipped profiles, read from their folder when help is shown
    (a profile added there is listed without editing this file; parsing them all takes ~0.1 s, which
    no other command pays). Not a ``click.Choice``: aliases, any case and the user's own profiles
    (``~/.config/kadapt/devices``, ``$KADAPT_DEVICE_PATH``) are names too, checked by ``get_device``."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        from ..backends.simulation.tables.device import shipped_device_names

        self.help = (
            f"Device profile name: {', '.join(shipped_device_names())} (see docs/cost_model.md; profiles "
            "of your own go in ~/.config/kadapt/devices or $KADAPT_DEVICE_PATH)."
        )
        return super().get_help_record(ctx)


_OPTIONS = (
    click.option("--device", cls=DeviceOption, default=None),
    click.option(
        "--device-file",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None,
        help="A device profile YAML outside the shipped set.",
    ),
    click.option(
        "--tp",
        type=PARALLEL,
        default=1,
        show_default=True,
        help="Tensor-parallel size (attention heads, dense MLP, shared experts; KV heads are "
        "replicated once tp exceeds them).",
    ),
    click.option(
        "--dp", type=PARALLEL, default=1, show_default=True, help="Data-parallel groups (devices = tp x dp)."
    ),
    click.option(
        "--ep", type=PARALLEL, default=1, show_default=True, help="Expert-parallel size for routed experts."
    ),
    click.option(
        "--moe-tp",
        type=PARALLEL,
        default=None,
        help="Expert-TP size: each rank holds 1/N of every local expert's intermediate width (vLLM's and "
        "SGLang's --tp without expert parallelism: --moe-tp = devices, --ep 1). Above 1, --moe-tp x --ep "
        "must equal the devices (tp x dp), as AIConfigurator's moe_tp_size x moe_ep_size; 1: whole experts. "
        "[default: the devices --ep leaves (devices / ep), as every framework shards the experts without "
        "the flag, where that divides the expert width; else 1; --sweep: 1]",
    ),
    click.option(
        "--quant",
        default=None,
        help="Weight mode the spec declares (its backends.simulation.quant_modes) [default: checkpoint, "
        "i.e. what the config's quantization_config stores; dense without one]. With simulate --sweep also "
        "a comma-separated list (checkpoint names the shipped weights) or all: the checkpoint and every "
        "declared mode.",
    ),
    click.option(
        "--kv-dtype",
        type=click.Choice(["bf16", "fp8"]),
        default="bf16",
        show_default=True,
        help="KV-cache element type (the layout follows the attention: MLA latent, else per KV head).",
    ),
)


class ImageSize(click.ParamType):
    """``HEIGHTxWIDTH`` in pixels (``448x448``); whether the model's patch grid takes it is checked later."""

    name = "HxW"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        from ..vision.images import parse_image_size

        try:
            return parse_image_size(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


_IMAGE_OPTIONS = (
    click.option(
        "--images",
        type=click.IntRange(1, 1 << 16),
        default=None,
        help="Images in each query's (plan: sequence's) prompt, for vision-language models; each adds its "
        "placeholder tokens.",
    ),
    click.option(
        "--image-size",
        type=ImageSize(),
        metavar="HxW",
        default=None,
        help="Image size HxW in pixels as the encoder sees it (after the processor's resize and pad: whole "
        "patch x merge blocks) [default: the spec's abi.vision image].",
    ),
)


def image_options(command: F) -> F:
    """Add ``--images --image-size`` to ``command``."""
    for option in reversed(_IMAGE_OPTIONS):
        command = option(command)
    return command


def requested_images(
    spec: Spec, arch: Architecture, images: int | None, size: tuple[int, int] | None
) -> ImageBatch | None:
    """The images ``--images`` / ``--image-size`` ask for, checked against the model (usage errors)."""
    from ..vision.images import image_batch

    if images is None:
        if size is not None:
            raise click.UsageError("--image-size applies to --images N")
        return None
    return image_batch(spec, arch.vision, images, size)


def deployment_options(command: F) -> F:
    """Add ``--device --device-file --tp --dp --ep --moe-tp --quant --kv-dtype`` to ``command``."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command
