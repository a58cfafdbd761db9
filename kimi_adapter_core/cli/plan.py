"""``kadapt plan SPEC``: size a deployment before loading anything (KV cache, weights, activations).

Pure Python from the spec's shipped config: never imports torch, so it answers instantly. A device is
optional; with one, the report adds capacity and free memory, and a deployment that does not fit
prints a ``WARNING:`` line (exit 0: a plan is advice, not a launch).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..backends.simulation.device import get_device
from ..backends.simulation.inputs import model_inputs
from ..backends.simulation.parallel import Parallel
from ..backends.simulation.planner import make_plan
from ..backends.simulation.report import plan_json, plan_text
from ..spec import load_spec


@click.command(name="plan")
@click.argument("spec_path", metavar="SPEC", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--tp", type=int, default=1, show_default=True, help="Tensor-parallel size (attention, dense, shared)."
)
@click.option(
    "--dp", type=int, default=1, show_default=True, help="Data-parallel groups (devices = tp x dp)."
)
@click.option("--ep", type=int, default=1, show_default=True, help="Expert-parallel size for routed experts.")
@click.option("--batch", type=int, default=1, show_default=True, help="Concurrent sequences (split over dp).")
@click.option(
    "--seq-len", type=int, default=None, help="Tokens per sequence to cache [default: max positions]."
)
@click.option(
    "--prefill-chunk",
    type=int,
    default=8192,
    show_default=True,
    help="Tokens per rank in the largest forward (for the activation estimate).",
)
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True)
@click.option(
    "--quant", default=None, help="Weight mode from backends.simulation.quant_modes [default: checkpoint]."
)
@click.option(
    "--device", default=None, help="Device profile name, to check fit (see kadapt simulate --help)."
)
@click.option(
    "--device-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A device profile YAML outside the shipped set.",
)
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def command(
    spec_path: Path,
    tp: int,
    dp: int,
    ep: int,
    batch: int,
    seq_len: int | None,
    prefill_chunk: int,
    kv_dtype: str,
    quant: str | None,
    device: str | None,
    device_file: Path | None,
    fmt: str,
) -> None:
    """Size KV cache, max length, weights per device, activations and vision-cache entries."""
    spec = load_spec(spec_path)
    inputs = model_inputs(spec, quant)
    profile = get_device(device, device_file) if (device or device_file) else None
    plan = make_plan(
        inputs.arch,
        Parallel(tp=tp, dp=dp, ep=ep),
        inputs.policy,
        inputs.quant_label,
        batch=batch,
        seq_len=seq_len,
        prefill_chunk=prefill_chunk,
        kv_dtype=kv_dtype,
        device=profile,
    )
    click.echo(json.dumps(plan_json(plan), indent=2) if fmt == "json" else plan_text(plan))
