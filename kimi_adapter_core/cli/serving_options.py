"""``kadapt simulate --sweep --isl N --osl M``: the options and the report of a request-level search.

``serving_options`` adds ``--isl --osl --ttft --tpot --concurrency --serving``; with them
``run_serving`` prices whole requests, aggregated and disaggregated, under the SLA
(``backends/simulation/search/serving.py``) and reports the picks and the front, and
``run_concurrency`` prices one given layout at N requests in flight (``search/concurrency.py``),
each row saying its weights, the checkpoint's, the KV-cache dtype
and its layouts' topology notes as a step sweep's rows do (``sweep_options``). Separate from
``sweep_options`` because a deployment is two pools of workers, not one priced step. Only click is
imported here: the search itself (torch) is imported when it runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from .release_facts import release_json, release_text
from .run_options import RUN_OPTIONS, run_json, run_text
from .sweep_options import (
    Notes,
    check_plot,
    column_width,
    layout_notes,
    notes_json,
    notes_text,
    shipped_column,
    sweep_modes,
    with_options,
)

if TYPE_CHECKING:
    from ..backends.simulation.model.deployment import Deployment
    from ..backends.simulation.model.parallel import Parallel
    from ..backends.simulation.search.benchmark_run import RandomPrompts
    from ..backends.simulation.search.grid import Point
    from ..backends.simulation.search.request_pricing import Candidate, Workload
    from ..backends.simulation.search.serving import ServingResult
    from ..backends.simulation.search.weight_labels import WeightModes
    from ..backends.simulation.tables.device import Device
    from ..spec.model import Spec

F = TypeVar("F", bound=Callable[..., Any])


class _TargetMs(click.FloatRange):
    """An SLA target in ms, > 0 and finite: click's bounds compare false against nan and let it
    through, and a nan target silently excluded every deployment ("none ... meets the SLA")."""

    def __init__(self) -> None:
        super().__init__(0, min_open=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(
                f"{number} is not a finite number of milliseconds (omit the option for no target)", param, ctx
            )
        return number


_SERVING_OPTIONS = (
    click.option(
        "--isl",
        type=click.IntRange(1, 1 << 24),
        default=None,
        help="With --sweep: prompt tokens per request; the sweep then prices whole requests "
        "(prefill + decode), aggregated and disaggregated, for --framework (or, with --concurrency, "
        "one layout's).",
    ),
    click.option(
        "--osl", type=click.IntRange(2, 1 << 24), default=None, help="With --isl: output tokens per request."
    ),
    click.option(
        "--ttft",
        type=_TargetMs(),
        default=None,
        help="With --isl: time-to-first-token target in ms (deployments above it are excluded).",
    ),
    click.option(
        "--tpot",
        type=_TargetMs(),
        default=None,
        help="With --isl: time-per-output-token target in ms (deployments above it are excluded).",
    ),
    click.option(
        "--concurrency",
        type=click.IntRange(1, 1 << 20),
        default=None,
        help="With --isl/--osl, without --sweep: price the one layout --tp/--dp/--ep serving this many "
        "concurrent requests, aggregated at --framework's default step budget (chunked prefill; SGLang: "
        "prompt steps of their own, run first): TTFT, TPOT and output tokens/s per device and per user. "
        "Requests whose KV cache does not fit wait in the engine's queue (in TTFT).",
    ),
    click.option(
        "--step-tokens",
        type=click.IntRange(1, 1 << 24),
        default=None,
        help="With --concurrency: the server's step budget flag (TensorRT-LLM --max_num_tokens, SGLang "
        "--chunked-prefill-size, vLLM --max-num-batched-tokens) where it was launched with one; SGLang "
        "divides it over the DP groups. Default: the framework's default on the device.",
    ),
    *RUN_OPTIONS,
    click.option(
        "--serving",
        type=click.Choice(["both", "agg", "disagg"]),
        default="both",
        show_default=True,
        help="With --isl: aggregated (one pool), disaggregated (prefill and decode pools) or both.",
    ),
)


def serving_options(command: F) -> F:
    """Add ``--isl --osl --ttft --tpot --concurrency --step-tokens --requests --random-range-ratio --seed
    --serving`` (the request-level search, the one-deployment request price and its finite run) to
    ``command``."""
    return with_options(_SERVING_OPTIONS, command)


def run_serving(
    spec: Spec,
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
    framework_version: str | None = None,
) -> str:
    """Search aggregated and disaggregated deployments of ``workload`` on ``devices`` devices; return
    the report in ``fmt`` (and write the plot when asked). ``base`` carries MTP, the KV dtype and the
    routing; ``quant`` names the weight modes as in ``run_sweep`` (default: the checkpoint as shipped);
    ``framework_version`` the release whose step budget and prompt steps price it (None: the newest
    read)."""
    from ..backends.simulation.estimate.cost import framework_pricer
    from ..backends.simulation.search.pareto_plot import SlaLine, write_plot
    from ..backends.simulation.search.serving import ServingSearch, plot_points

    check_plot(plot)
    by_mode, weights = sweep_modes(spec, quant)
    search = ServingSearch(
        spec,
        by_mode,
        device,
        base,
        devices,
        workload,
        framework,
        modes=modes,
        batches=batches,
        pricer=framework_pricer(framework),  # the framework's kernel table, as ``simulate --framework``
        framework_version=framework_version,
    )
    result = search.run()
    if result.quants:
        weights = replace(weights, quants=result.quants)
    shown = [*result.front, *(b for m in result.modes if (b := result.best(m)) is not None)]
    notes = layout_notes(device, framework, [par for c in shown for par in _pools(c)])

    def label(c: Candidate) -> str:
        return _candidate_label(c, weights, base.kv_dtype)

    if plot is not None and result.candidates:
        sla = None
        if workload.tpot is not None:
            sla = SlaLine(1 / workload.tpot, f"TPOT {workload.tpot * 1e3:g} ms")
        title = (
            f"{spec.name} on {devices} x {device.name}: {_workload(workload)}, KV {base.kv_dtype}, "
            f"{result.framework.title}"
        )
        write_plot(plot, plot_points(result, label, weights.label), title, sla)
    if fmt == "json":
        doc = serving_json(result, spec, device, plot, weights, base.kv_dtype, notes)
        doc["workload"].update(mtp=base.mtp, mtp_acceptance=base.mtp_acceptance)
        return json.dumps(doc, indent=2)
    return serving_text(result, spec, device, plot, weights, base.kv_dtype, notes, _mtp_text(base))


def _pools(c: Candidate) -> tuple[Parallel, ...]:
    """The layouts a candidate's workers run (agg: one)."""
    decode = c.decode.config.parallel
    return (decode,) if c.mode == "agg" else (c.prefill.config.parallel, decode)


def _marks(c: Candidate, notes: Notes) -> tuple[str, ...]:
    """The topology note ids of a candidate's worker layouts."""
    from ..backends.simulation.search.grid import Config

    found = [i for par in _pools(c) for i in notes[1].get(Config(par, 1, None).layout, ())]
    return tuple(sorted(set(found)))


def _workload(w: Workload) -> str:
    sla = [f"TTFT <= {w.ttft * 1e3:g} ms" if w.ttft else "", f"TPOT <= {w.tpot * 1e3:g} ms" if w.tpot else ""]
    return ", ".join([f"ISL {w.isl}, OSL {w.osl}", *(s for s in sla if s)])


def _candidate_label(c: Candidate, weights: WeightModes, kv_dtype: str) -> str:
    shipped = "" if c.quant is None else f" (shipped: {weights.shipped})"
    return (
        f"{c.mode} {c.layout}, weights {weights.label(c.quant)}{shipped}, KV {kv_dtype}: "
        f"{c.tokens_per_s_per_user:.1f} tok/s/user, {c.tokens_per_s_per_device:.1f} tok/s/device, "
        f"TTFT {c.ttft * 1e3:.0f} ms, TPOT {c.tpot * 1e3:.1f} ms"
    )


def _worker_json(p: Point, workers: int) -> dict[str, Any]:
    c = p.config
    return {
        "tp": c.parallel.tp,
        "dp": c.parallel.dp,
        "ep": c.parallel.ep,
        "moe_tp": c.parallel.moe_tp,
        "batch": c.batch,
        "workers": workers,
        "step_time_s": p.step_time,
    }


def candidate_json(c: Candidate, weights: WeightModes, kv_dtype: str, notes: Notes) -> dict[str, Any]:
    return {
        "mode": c.mode,
        "layout": c.layout,
        **weights.row(c.quant, kv_dtype),
        "prefill": _worker_json(c.prefill, c.prefill_workers),
        "decode": _worker_json(c.decode, c.decode_workers),
        "devices": c.devices,
        "ttft_s": c.ttft,
        "tpot_s": c.tpot,
        "tokens_per_s_per_device": c.tokens_per_s_per_device,
        "tokens_per_s_per_user": c.tokens_per_s_per_user,
        "requests_per_s": c.requests_per_s,
        "memory_per_device_bytes": c.memory.used,
        "topology_notes": list(_marks(c, notes)),
    }


def serving_json(
    result: ServingResult,
    spec: Spec,
    device: Device,
    plot: Path | None,
    weights: WeightModes,
    kv_dtype: str,
    notes: Notes,
) -> dict[str, Any]:
    from ..backends.simulation.search.launch_rules import describe_rules

    w, fw = result.workload, result.framework

    def row(c: Candidate) -> dict[str, Any]:
        return candidate_json(c, weights, kv_dtype, notes)

    return {
        "model": spec.name,
        "device": device.name,
        "devices": result.devices,
        "workload": {"isl": w.isl, "osl": w.osl, "ttft_s": w.ttft, "tpot_s": w.tpot},
        "framework": {"name": fw.name, "title": fw.title, **release_json(fw), "rules": describe_rules(fw)},
        "modes": list(result.modes),
        "kv_dtype": kv_dtype,
        "shipped_weights": weights.shipped,
        "quantizations": [q or "checkpoint" for q in result.quants],
        "declared_quantizations": list(weights.declared),
        "worker_sizes": {str(k): v for k, v in result.worker_sizes.items()},
        "refused": result.refused,
        "steps_priced": result.steps_priced,
        "traces": result.traces,
        "traced_per_configuration": result.fallbacks,
        "deployments": len(result.candidates),
        "feasible": len(result.feasible),
        "picks": {m: (row(b) if (b := result.best(m)) else None) for m in result.modes},
        "front": [row(c) for c in result.front],
        "topology_notes": notes_json(notes),
        "plot": str(plot) if plot is not None and result.candidates else None,
    }


def serving_text(
    result: ServingResult,
    spec: Spec,
    device: Device,
    plot: Path | None,
    weights: WeightModes,
    kv_dtype: str,
    notes: Notes,
    mtp: Sequence[str] = (),
) -> str:
    """The request sweep's report; ``mtp``: the line saying the drafts priced (``_mtp_text``), if any."""
    fw = result.framework
    sizes = "; ".join(f"{n}: {why}" for n, why in result.worker_sizes.items())
    lines = [
        f"request sweep: {spec.name} on {result.devices} x {device.name}, {_workload(result.workload)}, "
        f"KV cache {kv_dtype}, {fw.title} ({fw.name})",
        weights.summary(),
        *mtp,
        *release_text(fw),
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
            marks = _marks(best, notes)
            seen = f" [notes {','.join(marks)}]" if marks else ""
            label = _candidate_label(best, weights, kv_dtype)[len(mode) + 1 :]
            lines.append(f"  {mode:<6} {label}, {best.devices} devices{seen}")
        elif not any(c.mode == mode for c in result.candidates):
            why = "no prefill + decode worker pair fits" if mode == "disagg" else "no worker fits"
            lines.append(f"  {mode:<6} none: {why} in {result.devices} devices")
        else:
            lines.append(f"  {mode:<6} none fits and meets the SLA")
    front = result.front
    if front:
        labels = [weights.label(c.quant) for c in front]
        w = column_width(labels, "weights")
        shipped, row_shipped = shipped_column(weights)
        lines += [
            f"Pareto front ({len(front)} points meeting the SLA; tokens/s per user vs tokens/s per device):",
            f"  {'mode':<6} {'tok/s/user':>10} {'tok/s/device':>12} {'TTFT ms':>8} {'TPOT ms':>8} "
            f"{'devices':>7}  {'weights':<{w}}{shipped} {'KV':<4} {'notes':<5} layout",
        ]
        for c, label in zip(front, labels, strict=True):
            lines.append(
                f"  {c.mode:<6} {c.tokens_per_s_per_user:>10.1f} {c.tokens_per_s_per_device:>12.1f} "
                f"{c.ttft * 1e3:>8.0f} {c.tpot * 1e3:>8.1f} {c.devices:>7}  "
                f"{label:<{w}}{row_shipped} {kv_dtype:<4} {','.join(_marks(c, notes)):<5} {c.layout}"
            )
    lines += notes_text(notes)
    for family, why in result.fallbacks.items():
        lines.append(f"WARNING: {family} traced per configuration: {why}")
    if plot is not None and result.candidates:
        lines.append(f"plot: {plot}")
    return "\n".join(lines)


def _mtp_text(base: Deployment) -> list[str]:
    """The MTP line of a request report (``--concurrency``, the request sweep): the drafts change every
    TPOT and rate, so the report says they were priced."""
    if not base.mtp:
        return []
    return [
        f"MTP: {base.mtp} draft token{'s' if base.mtp > 1 else ''} verified per decode step, "
        f"{base.mtp_acceptance:g} accepted "
        f"({1 + base.mtp * base.mtp_acceptance:g} output tokens per request per decode step)"
    ]


def run_concurrency(
    spec: Spec,
    device: Device,
    base: Deployment,
    workload: Workload,
    concurrency: int,
    *,
    step_tokens: int | None = None,
    framework: str,
    quant: str | None = None,
    fmt: str = "text",
    prompts: RandomPrompts | None = None,
    framework_version: str | None = None,
) -> str:
    """Price ``base.parallel`` serving ``concurrency`` requests of ``workload`` (aggregated; the sweep's
    candidate for that layout and batch) and report it in ``fmt``, with its weights and KV modes;
    ``step_tokens`` is the server's step budget flag (default: the framework's on the device). With
    ``prompts`` (``--requests``), the requests are the run's, priced at their mean lengths, and the
    report adds the finite run (``price_run``). ``framework_version``: the release whose step budget
    and prompt steps price it (None: the newest read)."""
    from ..backends.simulation.report.simulation import eager_json, eager_text
    from ..backends.simulation.search.concurrency import price_concurrency, price_run
    from ..backends.simulation.search.launch_rules import framework as framework_of
    from ..backends.simulation.search.request_pricing import EAGER, EVERY_GROUP_GRAPHED, Workload

    by_mode, weights = sweep_modes(spec, quant)
    fw = framework_of(framework, framework_version)
    dp = base.parallel.dp
    if step_tokens is None:
        budget = fw.step_tokens.default(device.memory_bytes, dp, device.name)
    elif fw.step_tokens.divided_over_dp and step_tokens < dp:
        raise click.UsageError(
            f"--step-tokens {step_tokens} over {dp} DP groups leaves no token per group ({fw.title} divides "
            "it over the DP groups)"
        )
    else:
        budget = fw.step_tokens.per_group(step_tokens, dp)
    run = None
    priced_as = {"step_tokens": budget, "framework_version": framework_version}
    if prompts is None:
        c = price_concurrency(spec, by_mode, device, base, workload, framework, concurrency, **priced_as)
    else:
        c, run = price_run(spec, by_mode, device, base, framework, concurrency, prompts, **priced_as)
        workload = Workload(*prompts.means())
    notes = layout_notes(device, framework, [base.parallel])
    in_flight = min(concurrency, c.decode.config.batch)  # the even split's idle slots hold none
    # the engine eager throughout (``base.eager_host``) launches its prompt steps eagerly too
    launch = EAGER if base.eager_host else c.prompt_launch
    a = next(iter(by_mode.values())).arch
    why = fw.prompt_steps.eager_reason(a.architectures, device.name, mla=a.structure.attention.is_mla, dp=dp)
    why_eager = why if launch == EAGER else None
    if fmt == "json":
        doc = {
            "model": spec.name,
            "device": device.name,
            "workload": {
                "isl": workload.isl,
                "osl": workload.osl,
                "concurrency": concurrency,
                "mtp": base.mtp,
                "mtp_acceptance": base.mtp_acceptance,
            },
            "framework": {
                "name": fw.name,
                "title": fw.title,
                **release_json(fw),
                "step_tokens": budget,
                "prompt_steps": "apart" if c.apart else "mixed",
                "prompt_cuda_graphs": launch != EAGER,
                **({"prompt_cuda_graphs_when": launch.value} if launch == EVERY_GROUP_GRAPHED else {}),
                **({"prompt_eager_why": why_eager} if why_eager else {}),
            },
            **eager_json(base.eager_host),
            **candidate_json(c, weights, base.kv_dtype, notes),
            "chunk": c.chunk,
            "mixed_step_time_s": c.mixed_step_time,
            "fits": c.fits,
            "in_flight": in_flight,
            "queued": concurrency - in_flight,
            "idle_slots": c.idle,
            **({} if run is None or prompts is None else {"run": run_json(run, prompts, c.devices)}),
            "notes": notes_json(notes),
        }
        return json.dumps(doc, indent=2)
    marks = _marks(c, notes)
    if c.apart:
        how = (
            f"prompt steps apart, run before decoding resumes, step budget {budget} tokens per DP group, "
            f"{c.chunk} prompt tokens per prompt step"
        )
    else:
        how = f"chunked prefill, step budget {budget} tokens, {c.chunk} prompt tokens per mixed step"
    step = "prompt" if c.apart else "mixed"
    lines = [
        f"{spec.name} on {c.devices} x {device.name}, {c.decode.config.layout}, {concurrency} concurrent "
        f"requests of ISL {workload.isl}, OSL {workload.osl}, {fw.title} ({fw.name}), aggregated: {how}",
        f"weights {weights.label(c.quant)}, KV cache {base.kv_dtype}",
        *_mtp_text(base),
        *release_text(fw),
        *eager_text(base.eager_host),
        f"TTFT {c.ttft * 1e3:.1f} ms, TPOT {c.tpot * 1e3:.2f} ms",
        f"output tokens/s: {c.tokens_per_s_per_device:.1f} per device, "
        f"{c.tokens_per_s_per_user:.1f} per user ({c.requests_per_s:.2f} requests/s)",
        f"steps: decode {c.decode.step_time * 1e3:.2f} ms, {step} {c.mixed_step_time * 1e3:.2f} ms"
        + (launch.aside if launch else ""),
        *([f"NOTE: {why_eager}"] if why_eager else []),
    ]
    if c.queued:
        lines.append(
            f"in flight: {in_flight} requests, as many as the KV cache holds beside the weights and "
            f"activations ({c.memory.used / 1e9:.1f} GB used per device of "
            f"{(device.memory_bytes or 0) / 1e9:.1f} GB); the other {concurrency - in_flight} wait in the "
            "engine's queue (in TTFT)"
        )
    if c.idle:
        lines.append(
            f"{concurrency} requests over {dp} DP groups: priced as {c.decode.config.batch // dp} per group, "
            "the busiest group's pace (the groups step in lockstep: one with fewer requests waits for it, "
            f"one with none runs an idle batch), at the rate of the {concurrency} requests"
        )
    if run is not None and prompts is not None:
        lines.append(run_text(run, prompts, concurrency, c.devices))
    if marks:
        lines.append(f"topology notes: {','.join(marks)}")
    lines += notes_text(notes)
    if not c.fits:
        lines.append(
            f"WARNING: does not fit in device memory ({c.memory.used / 1e9:.1f} GB used per device of "
            f"{(device.memory_bytes or 0) / 1e9:.1f} GB, not one request per DP group beside the weights "
            "and activations); priced as if it did"
        )
    return "\n".join(lines)
