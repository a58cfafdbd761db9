"""``kadapt plan SPEC``: size a deployment before loading anything (KV cache, weights, activations).

Pure Python from the spec's shipped config and the model structure derived from it (any decoder
family: MHA/GQA/MQA/MLA attention, dense or MoE, sliding windows): never imports torch, so it
answers instantly. A device is
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
from .deployment_options import deployment_options
from .spec_argument import spec_argument


@click.command(name="plan")
@spec_argument()
@deployment_options
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
        inputs,
        Parallel(tp=tp, dp=dp, ep=ep),
        batch=batch,
        seq_len=seq_len,
        prefill_chunk=prefill_chunk,
        kv_dtype=kv_dtype,
        device=profile,
    )
    click.echo(json.dumps(plan_json(plan), indent=2) if fmt == "json" else plan_text(plan))
