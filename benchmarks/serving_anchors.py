"""Untouched real-world anchors: published end-to-end serving points, kadapt vs measured (and AIConfigurator).

Run: ``python benchmarks/bench_simulation.py --only serving``. Every point of
``kimi_adapter_core/backends/simulation/tables/published/serving_points.yaml`` (its source, layout,
workload and every assumption are recorded there) is priced as published with ``kadapt simulate
--concurrency`` (``search/concurrency.price_concurrency``: the request sweep's aggregated candidate for
that layout and batch, the roofline cost model, the framework's own kernel-efficiency table, the
checkpoint as shipped). A point of bench_serving's random dataset is priced as the finite run it was,
with ``--requests --random-range-ratio --seed`` (``price_run``): its requests' lengths are drawn
again and the last ones finish while slots stand empty; its tok/s/GPU is the run's, and the run's
mean requests in flight are printed beside the published ``concurrency`` as a check. When
``aiconfigurator-core`` is installed, AIConfigurator 0.12's own aggregated serving estimate of the same
point is printed beside (its backend's ``run_agg`` at the step budget per DP group the engine ran
with, as kadapt prices it, the batch split over attention-DP ranks; the reason is printed when it
cannot price it).

Scored: TPOT and output tokens/s per GPU (AIConfigurator's the steady state's, kadapt's the run's
where the run can be drawn again). TTFT is printed with its ratio to the published median TTFT (the
mean includes queueing behind earlier prompts, which neither kadapt nor - beyond a fitted factor -
AIConfigurator models) and summarised apart, not scored. A point kadapt cannot price is listed with
the reason and counted as a miss.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from pathlib import Path

from kimi_adapter_core.backends.simulation.estimate import aiconfigurator, eager
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.search.concurrency import price_concurrency, price_run
from kimi_adapter_core.backends.simulation.search.grid import quant_modes, sweep_inputs
from kimi_adapter_core.backends.simulation.search.launch_rules import framework as framework_of
from kimi_adapter_core.backends.simulation.search.request_pricing import Workload
from kimi_adapter_core.backends.simulation.search.serving_points import ServingPoint, serving_points
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
BAR = 0.25  # every anchor within +-25% (issue 38 item 3); median |ratio - 1| <= 15%
MEDIAN_BAR = 0.15
# kadapt spec -> AIConfigurator model and the quant modes that match the checkpoint as shipped
AIC_MODELS: dict[str, tuple[str, dict[str, str]]] = {
    "deepseek_v3": ("deepseek-ai/DeepSeek-V3", {"fmha_quant_mode": "bfloat16"}),
    "qwen3_moe": ("Qwen/Qwen3-235B-A22B", {}),
    "gpt_oss": ("openai/gpt-oss-120b", {}),
}
AIC_KV = {"bf16": "bfloat16", "fp8": "fp8"}


@dataclass(frozen=True)
class Estimate:
    """One tool's price of a point: TTFT and TPOT in ms, output tokens/s per GPU."""

    ttft_ms: float
    tpot_ms: float
    tok_s_per_device: float
    in_flight: float | None = None  # a run's mean requests in flight (None: the steady state's)


def host_time(point: ServingPoint) -> float:
    """Seconds of host time per launched kernel the point is priced with: ``eager.HOST_US`` where its
    engine ran without CUDA graphs (its ``engine`` fact), else 0."""
    return 0.0 if point.cuda_graphs else eager.HOST_US * 1e-6


def kadapt_estimate(point: ServingPoint, host: float | None = None) -> Estimate:
    """``kadapt simulate SPEC --device D --tp --dp --ep --framework F --framework-version V --kv-dtype K
    --isl --osl --concurrency N`` of the point (``--requests`` where its run can be drawn again), the
    checkpoint as shipped, with ``--eager`` where its engine ran without CUDA graphs, its stated step
    budget or its release's default; ``host`` overrides the host time per launch (seconds)."""
    spec = load_spec(REPO / "specs" / f"{point.spec}.yaml")
    eager_host = host_time(point) if host is None else host
    base = Deployment(point.parallel, 1, 1, 0, False, kv_dtype=point.kv_dtype, eager_host=eager_host)
    inputs, device = sweep_inputs(spec, quant_modes(spec, None)), get_device(point.device)
    if point.prompts is not None:
        c, run = price_run(
            spec, inputs, device, base, point.framework, point.concurrency, point.prompts,
            step_tokens=point.step_tokens, framework_version=point.release,
        )  # fmt: skip
        per_device = run.output_tok_s / c.devices
        return Estimate(c.ttft * 1e3, c.tpot * 1e3, per_device, run.mean_in_flight)
    c = price_concurrency(
        spec,
        inputs,
        device,
        base,
        Workload(point.isl, point.osl),
        point.framework,
        point.concurrency,
        step_tokens=point.step_tokens,
        framework_version=point.release,
    )
    return Estimate(c.ttft * 1e3, c.tpot * 1e3, c.tokens_per_s_per_device)


class AicServing:
    """AIConfigurator's aggregated serving estimate of a point (``run_agg``), or why it has none."""

    def __init__(self) -> None:
        aiconfigurator.require()
        logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)

    def estimate(self, point: ServingPoint) -> Estimate | str:
        from aiconfigurator_core.sdk.backends.factory import get_backend
        from aiconfigurator_core.sdk.config import RuntimeConfig
        from aiconfigurator_core.sdk.config_builders import build_model_config
        from aiconfigurator_core.sdk.models import get_model

        if point.spec not in AIC_MODELS:
            return f"no AIConfigurator model for {point.spec}"
        par = point.parallel
        if point.concurrency % par.dp:
            return f"concurrency {point.concurrency} does not split over {par.dp} attention-DP ranks"
        try:
            system = aiconfigurator.system_for(point.device)
            database = aiconfigurator._database(system, point.framework)
            model_path, quant = AIC_MODELS[point.spec]
            config = build_model_config(
                tp_size=par.tp,
                pp_size=1,
                attention_dp_size=par.dp,
                moe_tp_size=point.moe_tp,  # the stated expert sharding, as kadapt prices it
                moe_ep_size=point.moe_ep,
                gemm_quant_mode=quant.get("gemm_quant_mode"),
                kvcache_quant_mode=AIC_KV[point.kv_dtype],
                fmha_quant_mode=quant.get("fmha_quant_mode"),
                moe_quant_mode=quant.get("moe_quant_mode"),
                comm_quant_mode=None,
                forward_model=None,
                attention_backend=None,
            )
            model = get_model(model_path, config, point.framework)
            runtime = RuntimeConfig(batch_size=point.concurrency // par.dp, isl=point.isl, osl=point.osl)
            device = get_device(point.device)
            step = point.step_tokens or framework_of(point.framework, point.release).step_tokens.default(
                device.memory_bytes, par.dp, device.name
            )  # the budget per DP group the engine ran with (its release's default), as kadapt prices it
            summary = get_backend(point.framework).run_agg(model, database, runtime, ctx_tokens=step)
            row = summary.get_summary_df().iloc[0]
        except Exception as exc:  # noqa: BLE001 - AIConfigurator's own errors (a kernel it never measured)
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
        return Estimate(float(row["ttft"]), float(row["tpot"]), float(row["tokens/s/gpu"]))


def _ratio(est: float, measured: float) -> float:
    return est / measured


def _cell(est: Estimate | str, point: ServingPoint) -> tuple[str, list[float], float | None]:
    """The printed ratios (TPOT, tok/s/GPU, TTFT to the median) and the scored ones."""
    if isinstance(est, str):
        return f"{'-':>6} {'-':>6} {'-':>6}", [], None
    tpot = _ratio(est.tpot_ms, point.mean_tpot_ms)
    tput = _ratio(est.tok_s_per_device, point.output_tok_s_per_device)
    ttft = _ratio(est.ttft_ms, point.median_ttft_ms)
    return f"{tpot:6.2f} {tput:6.2f} {ttft:6.2f}", [tpot, tput], ttft


def _summary(name: str, ratios: list[list[float]], misses: int, ttfts: list[float]) -> str:
    flat = [r for rs in ratios for r in rs]
    if not flat:
        return f"  {name}: nothing priced"
    errors = [abs(r - 1) for r in flat]
    within = sum(1 for rs in ratios if rs and all(abs(r - 1) <= BAR for r in rs))
    points = len(ratios) + misses
    ttft = statistics.median(abs(r - 1) for r in ttfts) if ttfts else float("nan")
    return (
        f"  {name}: median |ratio-1| {statistics.median(errors):.1%} over {len(flat)} ratios "
        f"(bar {MEDIAN_BAR:.0%}); points with TPOT and tok/s/GPU both within +-{BAR:.0%}: "
        f"{within}/{points}{f' ({misses} not priced)' if misses else ''}; "
        f"TTFT (vs median, not scored) median |ratio-1| {ttft:.1%}"
    )


def serving_table() -> None:
    """kadapt (and AIConfigurator) vs every published serving point, then the scores."""
    points = serving_points()
    aic: AicServing | None = AicServing() if aiconfigurator.available() else None
    devices = sorted({p.device for p in points})
    frameworks = sorted({p.framework for p in points})
    print(
        f"{len(points)} published points, {len(devices)} devices ({', '.join(devices)}), "
        f"{len(frameworks)} frameworks ({', '.join(frameworks)}); kadapt: roofline, the framework's kernel "
        f"table, checkpoint as shipped; AIConfigurator: {'run_agg, computed now' if aic else 'not installed'}"
    )
    print("ratios = estimate / measured: TPOT (mean), tok/s/GPU (output), TTFT (to the median; not scored)")
    print(
        f"{'point':44} {'meas TPOT':>9} {'tok/s/GPU':>9} {'TTFT med':>8} | {'kadapt TPOT':>11} "
        f"{'tok/s/GPU':>9} {'TTFT':>7} | {'kadapt ratios':>20} | {'AIC ratios':>20}"
    )
    scores: dict[str, tuple[list[list[float]], int, list[float]]] = {
        "kadapt": ([], 0, []),
        "AIC": ([], 0, []),
        "kadapt on AIC's points": ([], 0, []),
    }
    in_flight: list[float] = []  # a priced run's mean requests in flight over the published concurrency
    paired_k: list[list[float]] = []
    paired_a: list[list[float]] = []
    by_source: dict[str, tuple[list[float], list[float]]] = {}  # source title -> kadapt, AIC errors
    for p in points:
        try:
            k: Estimate | str = kadapt_estimate(p)
        except KadaptError as exc:
            k = str(exc).splitlines()[0]
        a: Estimate | str = aic.estimate(p) if aic else "not installed"
        k_cell, k_scored, k_ttft = _cell(k, p)
        a_cell, a_scored, a_ttft = _cell(a, p)
        measured = f"{p.mean_tpot_ms:9.2f} {p.output_tok_s_per_device:9.1f} {p.median_ttft_ms:8.0f}"
        est = (
            f"{k.tpot_ms:11.2f} {k.tok_s_per_device:9.1f} {k.ttft_ms:7.0f}"
            if isinstance(k, Estimate)
            else f"{'-':>11} {'-':>9} {'-':>7}"
        )
        print(f"{p.id:44} {measured} | {est} | {k_cell:>20} | {a_cell:>20}")
        # one request at a time is in flight whatever the run (a check only above one)
        if (
            isinstance(k, Estimate)
            and k.in_flight is not None
            and p.measured_concurrency
            and p.concurrency > 1
        ):
            in_flight.append(k.in_flight / p.measured_concurrency)
        for label, est_, scored, ttft in (("kadapt", k, k_scored, k_ttft), ("AIC", a, a_scored, a_ttft)):
            ratios, misses, ttfts = scores[label]
            if isinstance(est_, str):
                if label == "kadapt" or aic is not None:
                    print(f"    {label} cannot price it: {est_}")
                scores[label] = (ratios, misses + 1, ttfts)
            else:
                ratios.append(scored)
                if ttft is not None:
                    ttfts.append(ttft)
        if k_scored and a_scored:
            paired_k.append(k_scored)
            paired_a.append(a_scored)
        k_errors, a_errors = by_source.setdefault(p.title.split(" (")[0], ([], []))
        k_errors += [abs(r - 1) for r in k_scored]
        a_errors += [abs(r - 1) for r in a_scored]
    print("summary (scored: TPOT and output tok/s/GPU ratios):")
    for name in ("kadapt", "AIC"):
        if name == "AIC" and aic is None:
            print("  AIC: not installed (pip install 'kadapt[measured]')")
            continue
        ratios, misses, ttfts = scores[name]
        print(_summary(name, ratios, misses, ttfts))
    if paired_k:
        k_med = statistics.median(abs(r - 1) for rs in paired_k for r in rs)
        a_med = statistics.median(abs(r - 1) for rs in paired_a for r in rs)
        verdict = "no worse than" if k_med <= a_med else "worse than"
        print(
            f"  same {len(paired_k)} points both price: kadapt median |ratio-1| {k_med:.1%}, AIC {a_med:.1%} "
            f"(kadapt {verdict} AIC)"
        )
    for title, (k_errors, a_errors) in by_source.items():
        k_med = f"{statistics.median(k_errors):.1%}" if k_errors else "-"
        a_med = f"{statistics.median(a_errors):.1%}" if a_errors else "-"
        print(f"  {title}: median |ratio-1| kadapt {k_med}, AIC {a_med}")
    if in_flight:
        runs = sum(1 for p in points if p.prompts is not None)
        print(
            f"  priced as their finite runs (bench_serving's random dataset drawn again): {runs} points; "
            f"mean requests in flight vs the published concurrency, {len(in_flight)} points above one "
            "request: median "
            f"|ratio-1| {statistics.median(abs(r - 1) for r in in_flight):.1%}, range "
            f"{min(in_flight):.2f}-{max(in_flight):.2f}"
        )
    unread = sorted(
        {f"{p.framework} {p.release}" for p in points if framework_of(p.framework, p.release).note}
    )
    if unread:
        print(
            f"  releases whose step budget and prompt steps are priced with a caveat (frameworks.yaml "
            f"releases: not read, or what the facts leave out): {', '.join(unread)}"
        )
    graphless = [p.id for p in points if not p.cuda_graphs]
    if graphless:
        print(
            f"  priced eager (their engine ran without CUDA graphs, as its source says): {len(graphless)} "
            f"points, {graphless[0]} ..; every launched kernel at least {eager.HOST_US:g} us of host time"
        )
    assumed = [p.id for p in points if p.layout_assumed]
    if assumed:
        print(
            f"  layouts assumed (not as stated; see their certainty notes): {len(assumed)} points, "
            f"{assumed[0]} .."
        )
    print(
        "  sources and every assumption: "
        "kimi_adapter_core/backends/simulation/tables/published/serving_points.yaml"
    )
