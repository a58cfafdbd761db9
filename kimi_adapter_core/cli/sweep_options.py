"""``kadapt simulate --sweep``: the options and the report of a layout / batch / weight-mode search.

``sweep_options`` adds ``--sweep --devices --batches --plot`` to a command; ``run_sweep`` prices the
grid of one step (``backends/simulation/search/sweep.py``), keeps what fits in memory and reports the Pareto
front of tokens/s per device against tokens/s per user, as text or JSON, writing the plot when asked.
Every row says what it priced: its weights and the checkpoint's (``search/weight_labels.py``), the
KV-cache dtype, and the topology notes of its layout (``estimate/topology.py``).
The request-level search (``--isl --osl``) is ``serving_options``, which reports its rows with the
same helpers. Only click is imported here: the sweep itself (torch) is imported when it runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from .int_list import IntList

if TYPE_CHECKING:
    from ..backends.simulation.estimate.topology import TopologyNote
    from ..backends.simulation.model.deployment import Deployment
    from ..backends.simulation.model.inputs import ModelInputs
    from ..backends.simulation.model.parallel import Parallel
    from ..backends.simulation.search.grid import Point, SweepResult
    from ..backends.simulation.search.sweep import Pricer
    from ..backends.simulation.search.weight_labels import WeightModes
    from ..backends.simulation.tables.device import Device
    from ..spec.model import Spec

F = TypeVar("F", bound=Callable[..., Any])


_OPTIONS = (
    click.option(
        "--sweep",
        is_flag=True,
        help="Search TP/DP/EP layouts and batches (in the checkpoint's weights, or the modes --quant names) "
        "for --devices devices; report the Pareto front of tokens/s per device vs per user "
        "(configurations that do not fit are dropped).",
    ),
    click.option(
        "--devices",
        type=click.IntRange(1, 1 << 16),
        default=None,
        help="Devices the sweep lays out [default: tp x dp].",
    ),
    click.option(
        "--batches",
        type=IntList(1, "batch sizes"),
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


def with_options(options: tuple[Callable[[F], F], ...], command: F) -> F:
    """``command`` with ``options`` added, listed in ``--help`` in their order."""
    for option in reversed(options):
        command = option(command)
    return command


def sweep_options(command: F) -> F:
    """Add ``--sweep --devices --batches --plot`` to ``command``."""
    return with_options(_OPTIONS, command)


def sweep_modes(spec: Spec, quant: str | None) -> tuple[dict[str | None, ModelInputs], WeightModes]:
    """The inputs of each weight mode ``--quant`` asks a sweep to price (the checkpoint as shipped by
    default; ``grid.quant_modes``) and what each row says about them."""
    from ..backends.simulation.model.inputs import model_inputs
    from ..backends.simulation.search.grid import declared_modes, quant_modes, sweep_inputs
    from ..backends.simulation.search.weight_labels import WeightModes, shipped_label

    modes = quant_modes(spec, quant)
    by_mode = sweep_inputs(spec, modes)
    shipped = shipped_label(by_mode[None] if None in by_mode else model_inputs(spec, None))
    formats = {mode: shipped_label(inputs) for mode, inputs in by_mode.items()}
    return by_mode, WeightModes(shipped, modes, declared_modes(spec), formats)


def check_plot(plot: Path | None) -> None:
    """Refuse a ``--plot`` the sweep could not write, before any configuration is priced: a suffix
    without a writer (usage error) or a .png without matplotlib (``pareto_plot.require_writer``)."""
    from ..backends.simulation.search.pareto_plot import SUFFIXES, require_writer

    if plot is None:
        return
    if plot.suffix.lower() not in SUFFIXES:
        raise click.UsageError(f"--plot {plot}: the suffix must be one of {', '.join(SUFFIXES)}")
    require_writer(plot)


def run_sweep(
    spec: Spec,
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

    ``quant`` is ``--quant``: the weight modes to sweep (``grid.quant_modes``; default the checkpoint as
    shipped). ``pricer`` replaces the default per-kernel pricing (a measured cost model)."""
    from ..backends.simulation.search.pareto_plot import PlotPoint, write_plot
    from ..backends.simulation.search.sweep import Sweep

    check_plot(plot)
    by_mode, weights = sweep_modes(spec, quant)
    sweep = Sweep(spec, by_mode, device, base, devices, pricer=pricer, batches=batches)
    result = sweep.run()
    weights = replace(weights, quants=result.quants)
    front = result.front
    notes, marks = layout_notes(device, DEFAULT_FRAMEWORK, [p.config.parallel for p in front])
    if plot is not None:
        on_front = {id(p) for p in front}
        points = [
            PlotPoint(
                p.tokens_per_s_per_user,
                p.tokens_per_s_per_device,
                weights.label(p.config.quant),
                _label(p, weights, base.kv_dtype),
                id(p) in on_front,
                f"{p.config.layout} b{p.config.batch}" if id(p) in on_front else "",
            )
            for p in result.fitting
        ]
        write_plot(
            plot, points, f"{spec.name} on {devices} x {device.name}: {_phase(base)}, KV {base.kv_dtype}"
        )
    if fmt == "json":
        return json.dumps(sweep_json(result, spec, device, base, plot, weights, (notes, marks)), indent=2)
    return sweep_text(result, spec, device, base, plot, weights, (notes, marks))


DEFAULT_FRAMEWORK = "trtllm"  # the kernel tables a step sweep prices with (``cost.price``'s default)
Notes = tuple[list["TopologyNote"], dict[str, tuple[str, ...]]]


def layout_notes(device: Device, framework: str, layouts: Sequence[Parallel]) -> Notes:
    """The topology notes of the reported rows' layouts, and each layout's note ids."""
    from ..backends.simulation.estimate.topology import topology_notes
    from ..backends.simulation.search.grid import Config

    return topology_notes(device, framework, [(Config(par, 1, None).layout, par) for par in layouts])


def _phase(dep: Deployment) -> str:
    if dep.decode:
        return f"decode, context {dep.context_len}, {dep.tokens_per_query} tokens/query"
    return f"prefill {dep.query_len} tokens, context {dep.context_len}"


def _label(p: Point, weights: WeightModes, kv_dtype: str) -> str:
    c = p.config
    return (
        f"{c.layout}, batch {c.batch}, weights {weights.label(c.quant)}, KV {kv_dtype}: "
        f"{p.tokens_per_s_per_user:.1f} tok/s/user, {p.tokens_per_s_per_device:.1f} tok/s/device, "
        f"step {p.step_time * 1e3:.2f} ms"
    )


def _point_json(
    p: Point, weights: WeightModes, kv_dtype: str, marks: dict[str, tuple[str, ...]]
) -> dict[str, Any]:
    c = p.config
    return {
        "tp": c.parallel.tp,
        "dp": c.parallel.dp,
        "ep": c.parallel.ep,
        "batch": c.batch,
        **weights.row(c.quant, kv_dtype),
        "step_time_s": p.step_time,
        "tokens_per_s_per_user": p.tokens_per_s_per_user,
        "tokens_per_s_per_device": p.tokens_per_s_per_device,
        "memory_per_device_bytes": p.memory.used,
        "topology_notes": list(marks.get(c.layout, ())),
    }


def notes_json(notes: Notes) -> list[dict[str, Any]]:
    return [{"id": n.id, "devices": n.devices, "layouts": list(n.layouts), "note": n.text} for n in notes[0]]


def notes_text(notes: Notes) -> list[str]:
    if not notes[0]:
        return []
    lines = ["topology notes (the rows' notes column):"]
    return lines + [f"  {n.id} ({', '.join(n.layouts)}): {n.text}" for n in notes[0]]


def sweep_json(
    result: SweepResult,
    spec: Spec,
    device: Device,
    base: Deployment,
    plot: Path | None,
    weights: WeightModes,
    notes: Notes,
) -> dict[str, Any]:
    return {
        "model": spec.name,
        "device": device.name,
        "devices": result.devices,
        "phase": "decode" if base.decode else "prefill",
        "query_len": base.tokens_per_query,
        "context_len": base.context_len,
        "kv_dtype": base.kv_dtype,
        "shipped_weights": weights.shipped,
        "layouts": [[p.tp, p.dp, p.ep] for p in result.layouts],
        "quantizations": [q or "checkpoint" for q in result.quants],
        "declared_quantizations": list(weights.declared),
        "same_weights": {q or "checkpoint": m or "checkpoint" for q, m in result.same_as.items()},
        "batches": list(result.batches),
        "configurations": result.configs,
        "priced": len(result.points),
        "skipped": result.skipped,
        "dropped_memory": len(result.dropped),
        "fit": len(result.fitting),
        "traces": result.traces,
        "traced_per_configuration": result.fallbacks,
        "front": [_point_json(p, weights, base.kv_dtype, notes[1]) for p in result.front],
        "topology_notes": notes_json(notes),
        "plot": str(plot) if plot is not None else None,
    }


def column_width(values: Sequence[str], title: str) -> int:
    """The width of a text column holding ``values`` under ``title``."""
    return max([len(title), *(len(v) for v in values)])


def shipped_column(weights: WeightModes) -> tuple[str, str]:
    """A row table's shipped-format column: its header and each row's cell, both empty when only the
    shipped format was priced (every row's weights are then the shipped ones)."""
    if weights.only_shipped:
        return "", ""
    width = column_width([weights.shipped], "shipped")
    return f" {'shipped':<{width}}", f" {weights.shipped:<{width}}"


def sweep_text(
    result: SweepResult,
    spec: Spec,
    device: Device,
    base: Deployment,
    plot: Path | None,
    weights: WeightModes,
    notes: Notes,
) -> str:
    modes = ", ".join(q or "checkpoint" for q in result.quants)
    same = "".join(
        f"; {q} stores every weight as {m or 'checkpoint'} does" for q, m in result.same_as.items()
    )
    skipped = "; ".join(f"{n} skipped: {why}" for why, n in result.skipped.items())
    lines = [
        f"sweep: {spec.name} on {result.devices} x {device.name}, {_phase(base)}, KV cache {base.kv_dtype}",
        weights.summary(),
        f"configurations: {result.configs} = {len(result.layouts)} layouts x {len(result.quants)} "
        f"weight modes ({modes}{same}) x {len(result.batches)} batches",
        f"  priced {len(result.points)}" + (f" ({skipped})" if skipped else ""),
        f"  dropped {len(result.dropped)} that do not fit in {device.name} memory; {len(result.fitting)} fit",
    ]
    front = result.front
    if not front:  # nothing priced (every configuration skipped, above) is not a memory verdict
        why = "no configuration fits in memory" if result.points else "no configuration was priced"
        lines.append(f"{why}: no Pareto front")
    else:
        labels = [weights.label(p.config.quant) for p in front]
        w = column_width(labels, "weights")
        shipped, row_shipped = shipped_column(weights)
        lines += [
            f"Pareto front ({len(front)} points; tokens/s per user vs tokens/s per device):",
            f"  {'tok/s/user':>11} {'tok/s/device':>13} {'step ms':>9} {'batch':>6}  {'layout':<18} "
            f"{'weights':<{w}}{shipped} {'KV':<4} {'GB/device':>9}  notes",
        ]
        for p, label in zip(front, labels, strict=True):
            c = p.config
            marks = ",".join(notes[1].get(c.layout, ()))
            lines.append(
                f"  {p.tokens_per_s_per_user:>11.1f} {p.tokens_per_s_per_device:>13.1f} "
                f"{p.step_time * 1e3:>9.2f} {c.batch:>6}  {c.layout:<18} {label:<{w}}{row_shipped} "
                f"{base.kv_dtype:<4} {p.memory.used / 1e9:>9.1f}  {marks}".rstrip()
            )
    lines += notes_text(notes)
    lines.append(f"per-rank traces: {result.traces}")
    for family, why in result.fallbacks.items():
        lines.append(f"WARNING: {family} traced per configuration: {why}")
    if plot is not None:
        lines.append(f"plot: {plot}")
    return "\n".join(lines)
