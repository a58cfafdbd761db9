"""Command-line options shared by ``plan`` and ``simulate``: the deployment being sized.

Both commands size the same model the same way (``backends/simulation/inputs.py``), so they take
the parallel layout, weight mode, KV-cache dtype and device with one spelling and one default.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])
PARALLEL = click.IntRange(1, 1 << 16)  # devices per dimension: 0 or a typo's 1e12 is a usage error

_OPTIONS = (
    click.option(
        "--device",
        default=None,
        help="Device profile name: a100, atlas_800_a3, h100, h200, h800 (see docs/cost_model.md).",
    ),
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
        "--quant",
        default=None,
        help="Weight mode from backends.simulation.quant_modes [default: checkpoint, i.e. the spec's "
        "quantization schemes and the config's FP8 quantization_config].",
    ),
    click.option(
        "--kv-dtype",
        type=click.Choice(["bf16", "fp8"]),
        default="bf16",
        show_default=True,
        help="KV-cache element type (the layout follows the attention: MLA latent, else per KV head).",
    ),
)


def deployment_options(command: F) -> F:
    """Add ``--device --device-file --tp --dp --ep --quant --kv-dtype`` to ``command``."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command
