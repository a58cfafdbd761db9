"""``kadapt simulate --sweep``: the options and the report of a layout / batch / weight-mode search.

``sweep_options`` adds ``--sweep --devices --batches --plot`` to a command; ``run_sweep`` prices the
grid (``backends/simulation/sweep.py``), keeps what fits in memory and reports the Pareto front of
tokens/s per device against tokens/s per user, as text or JSON, writing the plot when asked. Only
click is imported here: the sweep itself (torch) is imported when it runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from ..backends.simulation.deployment import Deployment
    from ..backends.simulation.device import Device
    from ..backends.simulation.inputs import ModelInputs
    from ..backends.simulation.sweep import Point, Pricer, SweepResult
    from ..spec.model import Spec

F = TypeVar("F", bound=Callable[..., Any])


class BatchList(click.ParamType):
    """A comma-separated list of positive batch sizes: ``1,8,64``."""

    name = "list"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            batches = tuple(int(part) for part in str(value).split(",") if part.strip())
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers", param, ctx)
        if not batches or min(batches) < 1:
            self.fail(f"{value!r}: batch sizes must be >= 1", param, ctx)
        return batches


_OPTIONS = (
    click.option(
        "--sweep",
        is_flag=True,
        help="Search TP/DP/EP layouts, batches and weight modes for --devices devices; report the Pareto "
        "front of tokens/s per device vs per user (configurations that do not fit are dropped).",
    ),
    click.option(
        "--devices",
        type=click.IntRange(1, 1 << 16),
        default=None,
        help="Devices the sweep lays out [default: tp x dp].",
    ),
    click.option(
        "--batches",
        type=BatchList(),
        default=None,
        help="Global batch sizes the sweep tries [default: 1,2,4,...,1024].",
    ),
    click.option(
        "--plot",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="With --sweep: write the throughput plot (.html or .svg self-contained; .png needs matplotlib).",
    ),
)


def sweep_options(command: F) -> F:
    """Add ``--sweep --devices --batches --plot`` to ``command``."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def run_sweep(
    spec: Spec,
    inputs: ModelInputs,
    device: Device,
    base: Deployment,
    *,
    devices: int,
    batches: Sequence[int] | None = None,
    quant: str | None = None,
    plot: Path | None = None,
    fmt: str = "text",
    pricer: Pricer | None = None,
) -> str:
    """Sweep ``devices`` devices for ``base``'s step shape; return the report in ``fmt``.

    ``inputs`` is ``model_inputs(spec, quant)`` (reused); ``quant`` restricts the sweep to that mode,
    else every mode the spec declares is swept along with the checkpoint. ``pricer`` replaces the
    default per-kernel pricing (a measured cost model)."""
    from ..backends.simulation.pareto_plot import SUFFIXES, PlotPoint, write_plot
    from ..backends.simulation.sweep import Sweep, quant_modes, sweep_inputs

    if plot is not None and plot.suffix.lower() not in SUFFIXES:
        raise click.UsageError(f"--plot {plot}: the suffix must be one of {', '.join(SUFFIXES)}")
    modes = quant_modes(spec, quant)
    by_mode = sweep_inputs(spec, [m for m in modes if m != (quant.upper() if quant else None)])
    by_mode[quant.upper() if quant else None] = inputs
    sweep = Sweep(spec, {m: by_mode[m] for m in modes}, device, base, devices, pricer=pricer, batches=batches)
    result = sweep.run()
    front = result.front
    if plot is not None:
        on_front = {id(p) for p in front}
        points = [
            PlotPoint(
                p.tokens_per_s_per_user,
                p.tokens_per_s_per_device,
                p.config.quant_label,
                _label(p),
                id(p) in on_front,
            )
            for p in result.fitting
        ]
        write_plot(plot, points, f"{spec.name} on {devices} x {device.name}: {_phase(base)}")
    if fmt == "json":
        return json.dumps(sweep_json(result, spec, device, base, plot), indent=2)
    return sweep_text(result, spec, device, base, plot)


def _phase(dep: Deployment) -> str:
    if dep.decode:
        return f"decode, context {dep.context_len}, {dep.tokens_per_query} tokens/query"
    return f"prefill {dep.query_len} tokens, context {dep.context_len}"


def _label(p: Point) -> str:
    c = p.config
    return (
        f"{c.layout}, batch {c.batch}, {c.quant_label}: {p.tokens_per_s_per_user:.1f} tok/s/user, "
        f"{p.tokens_per_s_per_device:.1f} tok/s/device, step {p.step_time * 1e3:.2f} ms"
    )


def _point_json(p: Point) -> dict[str, Any]:
    c = p.config
    return {
        "tp": c.parallel.tp,
        "dp": c.parallel.dp,
        "ep": c.parallel.ep,
        "batch": c.batch,
        "quantization": c.quant_label,
        "step_time_s": p.step_time,
        "tokens_per_s_per_user": p.tokens_per_s_per_user,
        "tokens_per_s_per_device": p.tokens_per_s_per_device,
        "memory_per_device_bytes": p.memory.used,
    }


def sweep_json(
    result: SweepResult, spec: Spec, device: Device, base: Deployment, plot: Path | None
) -> dict[str, Any]:
    return {
        "model": spec.name,
        "device": device.name,
        "devices": result.devices,
        "phase": "decode" if base.decode else "prefill",
        "query_len": base.tokens_per_query,
        "context_len": base.context_len,
        "layouts": [[p.tp, p.dp, p.ep] for p in result.layouts],
        "quantizations": [q or "checkpoint" for q in result.quants],
        "same_weights": {q or "checkpoint": m or "checkpoint" for q, m in result.same_as.items()},
        "batches": list(result.batches),
        "configurations": result.configs,
        "priced": len(result.points),
        "skipped": result.skipped,
        "dropped_memory": len(result.dropped),
        "fit": len(result.fitting),
        "traces": result.traces,
        "traced_per_configuration": result.fallbacks,
        "front": [_point_json(p) for p in result.front],
        "plot": str(plot) if plot is not None else None,
    }


def sweep_text(result: SweepResult, spec: Spec, device: Device, base: Deployment, plot: Path | None) -> str:
    modes = ", ".join(q or "checkpoint" for q in result.quants)
    same = "".join(
        f"; {q} stores every weight as {m or 'checkpoint'} does" for q, m in result.same_as.items()
    )
    skipped = "; ".join(f"{n} skipped: {why}" for why, n in result.skipped.items())
    lines = [
        f"sweep: {spec.name} on {result.devices} x {device.name}, {_phase(base)}",
        f"configurations: {result.configs} = {len(result.layouts)} layouts x {len(result.quants)} "
        f"weight modes ({modes}{same}) x {len(result.batches)} batches",
        f"  priced {len(result.points)}" + (f" ({skipped})" if skipped else ""),
        f"  dropped {len(result.dropped)} that do not fit in {device.name} memory; {len(result.fitting)} fit",
    ]
    front = result.front
    if not front:
        lines.append("no configuration fits in memory: no Pareto front")
    else:
        lines += [
            f"Pareto front ({len(front)} points; tokens/s per user vs tokens/s per device):",
            f"  {'tok/s/user':>11} {'tok/s/device':>13} {'step ms':>9} {'batch':>6}  {'layout':<18} "
            f"{'weights':<11} {'GB/device':>9}",
        ]
        for p in front:
            c = p.config
            lines.append(
                f"  {p.tokens_per_s_per_user:>11.1f} {p.tokens_per_s_per_device:>13.1f} "
                f"{p.step_time * 1e3:>9.2f} {c.batch:>6}  {c.layout:<18} {c.quant_label:<11} "
                f"{p.memory.used / 1e9:>9.1f}"
            )
    lines.append(f"per-rank traces: {result.traces}")
    for family, why in result.fallbacks.items():
        lines.append(f"WARNING: {family} traced per configuration: {why}")
    if plot is not None:
        lines.append(f"plot: {plot}")
    return "\n".join(lines)
