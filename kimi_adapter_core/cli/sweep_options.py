"""``kadapt simulate --sweep``: the options and the report of a layout / batch / weight-mode search.

``sweep_options`` adds ``--sweep --devices --batches --plot`` to a command; ``run_sweep`` prices the
grid of one step (``backends/simulation/search/sweep.py``), keeps what fits in memory and reports the Pareto
front of tokens/s per device against tokens/s per user, as text or JSON, writing the plot when asked.
``serving_options`` adds ``--isl --osl --ttft --tpot --serving``; with them ``run_serving`` prices
whole requests, aggregated and disaggregated, under the SLA (``backends/simulation/search/serving.py``) and
reports the picks and the front. Only click is imported here: the sweep itself (torch) is imported
when it runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from ..backends.simulation.model.deployment import Deployment
    from ..backends.simulation.model.inputs import ModelInputs
    from ..backends.simulation.search.grid import Point, SweepResult
    from ..backends.simulation.search.request_pricing import Candidate, Workload
    from ..backends.simulation.search.serving import ServingResult
    from ..backends.simulation.search.sweep import Pricer
    from ..backends.simulation.tables.device import Device
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


def _with_options(options: tuple[Callable[[F], F], ...], command: F) -> F:
    """``command`` with ``options`` added, listed in ``--help`` in their order."""
    for option in reversed(options):
        command = option(command)
    return command


def sweep_options(command: F) -> F:
    """Add ``--sweep --devices --batches --plot`` to ``command``."""
    return _with_options(_OPTIONS, command)


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
    from ..backends.simulation.search.grid import quant_modes, sweep_inputs
    from ..backends.simulation.search.pareto_plot import SUFFIXES, PlotPoint, write_plot
    from ..backends.simulation.search.sweep import Sweep

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
                f"{p.config.layout} b{p.config.batch}" if id(p) in on_front else "",
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


# --- request-level search: --isl/--osl ---------------------------------------------------------------
_SERVING_OPTIONS = (
    click.option(
        "--isl",
        type=click.IntRange(1, 1 << 24),
        default=None,
        help="With --sweep: prompt tokens per request; the sweep then prices whole requests "
        "(prefill + decode), aggregated and disaggregated, for --framework.",
    ),
    click.option(
        "--osl", type=click.IntRange(2, 1 << 24), default=None, help="With --isl: output tokens per request."
    ),
    click.option(
        "--ttft",
        type=click.FloatRange(0, min_open=True),
        default=None,
        help="With --isl: time-to-first-token target in ms (deployments above it are excluded).",
    ),
    click.option(
        "--tpot",
        type=click.FloatRange(0, min_open=True),
        default=None,
        help="With --isl: time-per-output-token target in ms (deployments above it are excluded).",
    ),
    click.option(
        "--serving",
        type=click.Choice(["both", "agg", "disagg"]),
        default="both",
        show_default=True,
        help="With --isl: aggregated (one pool), disaggregated (prefill and decode pools) or both.",
    ),
)


def serving_options(command: F) -> F:
    """Add ``--isl --osl --ttft --tpot --serving`` (the request-level search) to ``command``."""
    return _with_options(_SERVING_OPTIONS, command)


def run_serving(
    spec: Spec,
    inputs: ModelInputs,
    device: Device,
    base: Deployment,
    workload: Workload,
    *,
    devices: int,
    framework: str,
    modes: Sequence[str],
    batches: Sequence[int] | None = None,
    quant: str | None = None,
    plot: Path | None = None,
    fmt: str = "text",
) -> str:
    """Search aggregated and disaggregated deployments of ``workload`` on ``devices`` devices; return
    the report in ``fmt`` (and write the plot when asked). ``base`` carries MTP, the KV dtype and the
    routing; ``quant`` restricts the weight modes as in ``run_sweep``."""
    from ..backends.simulation.search.grid import quant_modes, sweep_inputs
    from ..backends.simulation.search.pareto_plot import SUFFIXES, SlaLine, write_plot
    from ..backends.simulation.search.serving import ServingSearch, plot_points

    if plot is not None and plot.suffix.lower() not in SUFFIXES:
        raise click.UsageError(f"--plot {plot}: the suffix must be one of {', '.join(SUFFIXES)}")
    modes_ = quant_modes(spec, quant)
    by_mode = sweep_inputs(spec, [m for m in modes_ if m != (quant.upper() if quant else None)])
    by_mode[quant.upper() if quant else None] = inputs
    search = ServingSearch(
        spec,
        {m: by_mode[m] for m in modes_},
        device,
        base,
        devices,
        workload,
        framework,
        modes=modes,
        batches=batches,
    )
    result = search.run()
    if plot is not None and result.candidates:
        sla = None
        if workload.tpot is not None:
            sla = SlaLine(1 / workload.tpot, f"TPOT {workload.tpot * 1e3:g} ms")
        title = f"{spec.name} on {devices} x {device.name}: {_workload(workload)}, {result.framework.title}"
        write_plot(plot, plot_points(result, _candidate_label), title, sla)
    if fmt == "json":
        return json.dumps(serving_json(result, spec, device, plot), indent=2)
    return serving_text(result, spec, device, plot)


def _workload(w: Workload) -> str:
    sla = [f"TTFT <= {w.ttft * 1e3:g} ms" if w.ttft else "", f"TPOT <= {w.tpot * 1e3:g} ms" if w.tpot else ""]
    return ", ".join([f"ISL {w.isl}, OSL {w.osl}", *(s for s in sla if s)])


def _candidate_label(c: Candidate) -> str:
    return (
        f"{c.mode} {c.layout}, {c.quant or 'checkpoint'}: {c.tokens_per_s_per_user:.1f} tok/s/user, "
        f"{c.tokens_per_s_per_device:.1f} tok/s/device, TTFT {c.ttft * 1e3:.0f} ms, "
        f"TPOT {c.tpot * 1e3:.1f} ms"
    )


def _worker_json(p: Point, workers: int) -> dict[str, Any]:
    c = p.config
    return {
        "tp": c.parallel.tp,
        "dp": c.parallel.dp,
        "ep": c.parallel.ep,
        "batch": c.batch,
        "workers": workers,
        "step_time_s": p.step_time,
    }


def candidate_json(c: Candidate) -> dict[str, Any]:
    return {
        "mode": c.mode,
        "layout": c.layout,
        "quantization": c.quant or "checkpoint",
        "prefill": _worker_json(c.prefill, c.prefill_workers),
        "decode": _worker_json(c.decode, c.decode_workers),
        "devices": c.devices,
        "ttft_s": c.ttft,
        "tpot_s": c.tpot,
        "tokens_per_s_per_device": c.tokens_per_s_per_device,
        "tokens_per_s_per_user": c.tokens_per_s_per_user,
        "requests_per_s": c.requests_per_s,
        "memory_per_device_bytes": c.memory.used,
    }


def serving_json(result: ServingResult, spec: Spec, device: Device, plot: Path | None) -> dict[str, Any]:
    from ..backends.simulation.search.launch_rules import describe_rules

    w, fw = result.workload, result.framework
    return {
        "model": spec.name,
        "device": device.name,
        "devices": result.devices,
        "workload": {"isl": w.isl, "osl": w.osl, "ttft_s": w.ttft, "tpot_s": w.tpot},
        "framework": {"name": fw.name, "title": fw.title, "rules": describe_rules(fw)},
        "modes": list(result.modes),
        "quantizations": [q or "checkpoint" for q in result.quants],
        "worker_sizes": {str(k): v for k, v in result.worker_sizes.items()},
        "refused": result.refused,
        "steps_priced": result.steps_priced,
        "traces": result.traces,
        "traced_per_configuration": result.fallbacks,
        "deployments": len(result.candidates),
        "feasible": len(result.feasible),
        "picks": {m: (candidate_json(b) if (b := result.best(m)) else None) for m in result.modes},
        "front": [candidate_json(c) for c in result.front],
        "plot": str(plot) if plot is not None and result.candidates else None,
    }


def serving_text(result: ServingResult, spec: Spec, device: Device, plot: Path | None) -> str:
    fw = result.framework
    sizes = "; ".join(f"{n}: {why}" for n, why in result.worker_sizes.items())
    lines = [
        f"request sweep: {spec.name} on {result.devices} x {device.name}, {_workload(result.workload)}, "
        f"{fw.title} ({fw.name})",
        f"workers of N devices: {sizes}",
    ]
    for rule in fw.rules:
        if result.refused.get(rule.id):
            lines.append(f"  {fw.title} cannot launch {result.refused[rule.id]} layouts ({rule.id})")
    lines.append(
        f"priced {result.steps_priced} prefill, decode and mixed steps ({result.traces} per-rank traces, "
        f"{result.trace_seconds:.1f} s) into {len(result.candidates)} deployments; "
        f"{len(result.feasible)} fit and meet the SLA"
    )
    lines.append("picks (most tokens/s per device that fits and meets the SLA):")
    for mode in result.modes:
        best = result.best(mode)
        if best is not None:
            lines.append(f"  {mode:<6} {_candidate_label(best)[len(mode) + 1 :]}, {best.devices} devices")
        elif not any(c.mode == mode for c in result.candidates):
            why = "no prefill + decode worker pair fits" if mode == "disagg" else "no worker fits"
            lines.append(f"  {mode:<6} none: {why} in {result.devices} devices")
        else:
            lines.append(f"  {mode:<6} none fits and meets the SLA")
    front = result.front
    if front:
        lines += [
            f"Pareto front ({len(front)} points meeting the SLA; tokens/s per user vs tokens/s per device):",
            f"  {'mode':<6} {'tok/s/user':>10} {'tok/s/device':>12} {'TTFT ms':>8} {'TPOT ms':>8} "
            f"{'devices':>7}  {'weights':<10} layout",
        ]
        for c in front:
            lines.append(
                f"  {c.mode:<6} {c.tokens_per_s_per_user:>10.1f} {c.tokens_per_s_per_device:>12.1f} "
                f"{c.ttft * 1e3:>8.0f} {c.tpot * 1e3:>8.1f} {c.devices:>7}  "
                f"{c.quant or 'checkpoint':<10} {c.layout}"
            )
    for family, why in result.fallbacks.items():
        lines.append(f"WARNING: {family} traced per configuration: {why}")
    if plot is not None and result.candidates:
        lines.append(f"plot: {plot}")
    return "\n".join(lines)
