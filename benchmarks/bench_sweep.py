"""How fast ``kadapt simulate --sweep`` prices configurations, against calling ``simulate`` per configuration;
and what the request-level search picks, against AIConfigurator's ``cli default``.

Run: ``python benchmarks/bench_sweep.py`` (Kimi-K2.5 decode on 16 x H200 by default; ``--help`` for
the grid). Both paths run in the same process after the model is loaded (spec, inputs of every weight
mode, one warm-up ``simulate`` so imports and first-call caches are paid for):

- sweep: ``Sweep.run()`` over every layout x weight mode x batch, timed end to end, with the time
  spent in per-rank traces (three or four per TP size, shared by every weight mode) reported
  separately, and the repricing rate without them;
- naive: ``simulate`` for a random sample of the same configurations, the path the sweep replaces;
  its configurations/s is extrapolated from the sample;
- one trace on a per-rank model built for it (what ``simulate`` does) against one on a model built
  once and traced again (what the sweep does), at the sweep's shapes.

Each sampled configuration's step time is also compared between the two paths (they must agree to
rounding: the sweep reproduces ``simulate``'s kernels, see tests/test_sweep.py).

``--requests`` runs the request-level search instead (``kadapt simulate --sweep --isl --osl --ttft
--tpot``; DeepSeek-V3 on 8 and 16 x H200, ISL 4000, OSL 1000, TTFT 2000 ms, TPOT 30 ms by default,
AIConfigurator's defaults) and prints kadapt's aggregated and disaggregated picks and wall time per
device count. When AIConfigurator's CLI is available (``--aiconfigurator PATH``, else
``aiconfigurator`` on PATH; the ``aiconfigurator`` distribution, not ``aiconfigurator-core``) it runs
``aiconfigurator cli default`` on the same model (the spec's shipped config directory), system, SLA,
ISL/OSL and backend and prints its picks beside kadapt's; otherwise the output says it was not run.
The two aggregated models differ beyond the step prices, and the output says how: kadapt chunks
prompts into the steps (its chunk: prompt tokens per step per DP group) and models no queueing;
AIConfigurator's ``cli default`` puts whole prompts in a step (its ctx: prompt tokens per step),
multiplies TTFT by a 2-4x queueing heuristic and leaves 3 mixed steps out of TPOT.
"""

from __future__ import annotations

import argparse
import csv
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from kimi_adapter_core.backends.simulation.estimate.cost import framework_pricer
from kimi_adapter_core.backends.simulation.estimate.simulator import simulate, trace_kernels
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.model.rank_model import RankModel
from kimi_adapter_core.backends.simulation.search.grid import quant_modes, sweep_inputs
from kimi_adapter_core.backends.simulation.search.request_pricing import Workload
from kimi_adapter_core.backends.simulation.search.serving import ServingSearch
from kimi_adapter_core.backends.simulation.search.sweep import Sweep
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.spec.loader import resolve_spec_path

AIC_SYSTEMS = {"h200": "h200_sxm", "h100": "h100_sxm", "a100": "a100_sxm"}


def _pick(best: Any) -> str:
    return (
        f"{best.layout} {best.quant or 'checkpoint'}: {best.tokens_per_s_per_device:.1f} tok/s/GPU, "
        f"{best.tokens_per_s_per_user:.1f} tok/s/user, TTFT {best.ttft * 1e3:.0f} ms, "
        f"TPOT {best.tpot * 1e3:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="kimi_k25")
    parser.add_argument("--device", default="h200")
    parser.add_argument("--devices", type=int, default=16)
    parser.add_argument(
        "--batches", default=",".join(str(b) for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64))
    )
    parser.add_argument("--prefill", type=int, default=0, help="Prefill this many tokens per query instead.")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=12, help="Configurations the naive path prices.")
    parser.add_argument("--requests", action="store_true", help="Benchmark the request-level search.")
    parser.add_argument("--device-counts", default="8,16", help="--requests: devices to search.")
    parser.add_argument("--isl", type=int, default=4000)
    parser.add_argument("--osl", type=int, default=1000)
    parser.add_argument("--ttft", type=float, default=2000.0, help="ms")
    parser.add_argument("--tpot", type=float, default=30.0, help="ms")
    parser.add_argument("--framework", default="trtllm")
    parser.add_argument("--aiconfigurator", default=None, help="Path of the aiconfigurator executable.")
    args = parser.parse_args()
    if args.requests:
        requests(args)
        return

    spec = load_spec(resolve_spec_path(args.spec))
    device = get_device(args.device)
    inputs = sweep_inputs(spec, quant_modes(spec, "all"))  # every mode, as the timings in docs
    base = Deployment(Parallel(), 1, args.prefill or 1, 0 if args.prefill else args.context, not args.prefill)
    simulate(inputs[None], spec, base, device)  # warm-up: imports and first-call caches

    batches = tuple(int(b) for b in args.batches.split(","))
    sweep = Sweep(spec, inputs, device, base, args.devices, batches=batches)
    start = time.perf_counter()
    result = sweep.run()
    elapsed = time.perf_counter() - start
    priced = len(result.points)

    sample = random.Random(0).sample(result.points, min(args.samples, priced))
    start = time.perf_counter()
    worst = 0.0
    for point in sample:
        c = point.config
        sim = simulate(
            inputs[sweep.same_as.get(c.quant, c.quant)], spec, sweep.deployment(c.parallel, c.batch), device
        )
        worst = max(worst, abs(sim.step_time - point.step_time) / sim.step_time)
    naive = len(sample) / (time.perf_counter() - start)

    # a trace on a freshly built per-rank model against one on a model built once, same shapes
    tp = max(p.tp for p in result.layouts if p.tp < args.devices) if args.devices > 1 else 1
    dp = args.devices // tp
    deps = [sweep.deployment(Parallel(tp, dp, 1), b * dp) for b in (2, 3, 4)]
    start = time.perf_counter()
    for dep in deps:
        trace_kernels(spec, inputs[None], dep)
    fresh = (time.perf_counter() - start) / len(deps)
    model = RankModel(spec, inputs[None], deps[0])
    start = time.perf_counter()
    for dep in deps:
        model.trace(inputs[None], dep)
    reused = (time.perf_counter() - start) / len(deps)

    rate = priced / elapsed
    reprice = priced / max(elapsed - result.trace_seconds, 1e-9)
    phase = f"prefill {args.prefill}" if args.prefill else f"decode ctx {args.context}"
    print(f"{spec.name} on {args.devices} x {device.name}, {phase}")
    print(
        f"grid: {len(result.layouts)} layouts x {len(result.quants)} weight modes x {len(batches)} batches = "
        f"{result.configs} configurations; {priced} priced, {sum(result.skipped.values())} skipped "
        f"(invalid), {len(result.dropped)} do not fit, front {len(result.front)} points"
    )
    print(
        f"sweep: {elapsed:.2f} s, {result.traces} per-rank traces ({result.trace_seconds:.2f} s), "
        f"{len(result.fallbacks)} families traced per configuration"
    )
    print(f"  configs/s end to end:      {rate:10.0f}")
    print(f"  configs/s without traces:  {reprice:10.0f}")
    print(f"naive simulate per config:   {naive:10.1f} configs/s ({len(sample)} sampled)")
    print(f"ratio sweep / naive: {rate / naive:.0f}x end to end, {reprice / naive:.0f}x without traces")
    print(
        f"one trace at TP{tp}: {fresh * 1e3:.0f} ms building the per-rank model, {reused * 1e3:.0f} ms "
        f"on a model built once ({fresh / reused:.1f}x)"
    )
    print(f"largest step-time difference on the sample: {worst:.1e} (relative)")


def requests(args: argparse.Namespace) -> None:
    """kadapt's request-level picks (and wall time) per device count, beside AIConfigurator's."""
    spec = load_spec(resolve_spec_path("deepseek_v3" if args.spec == "kimi_k25" else args.spec))
    device = get_device(args.device)
    workload = Workload(args.isl, args.osl, args.ttft / 1e3, args.tpot / 1e3)
    aic = args.aiconfigurator or shutil.which("aiconfigurator")
    system = AIC_SYSTEMS.get(device.name.split()[0].lower())
    print(
        f"{spec.name} on {args.device}, ISL {args.isl}, OSL {args.osl}, TTFT <= {args.ttft:g} ms, "
        f"TPOT <= {args.tpot:g} ms, {args.framework}"
    )
    print(
        "agg: kadapt chunks prompts into decode steps (chunk = prompt tokens per step per DP group), "
        "no queueing factor; AIC puts whole prompts in a step (ctx), TTFT x its 2-4x queueing "
        "heuristic, TPOT without 3 of the mixed steps"
    )
    for devices in (int(n) for n in args.device_counts.split(",")):
        start = time.perf_counter()
        inputs = sweep_inputs(spec, quant_modes(spec, "all"))  # every mode: the benchmark prints both picks
        base = Deployment(Parallel(), 1, 1, 0, True)
        pricer = framework_pricer(args.framework)  # the framework's kernel table, as the CLI prices
        result = ServingSearch(
            spec, inputs, device, base, devices, workload, args.framework, pricer=pricer
        ).run()
        wall = time.perf_counter() - start
        print(
            f"\n{devices} devices: kadapt {wall:.1f} s wall ({result.traces} per-rank traces, "
            f"{result.trace_seconds:.1f} s), {result.steps_priced} steps priced, "
            f"{len(result.candidates)} deployments, {len(result.feasible)} meet the SLA"
        )
        for mode in result.modes:
            best = result.best(mode)
            if best is None:
                print(f"  kadapt {mode:<6} none")
                continue
            print(f"  kadapt {mode:<6} {_pick(best)}")
            if best.quant is not None:  # AIConfigurator prices the checkpoint's own weights only
                as_shipped = [c for c in result.feasible if c.mode == mode and c.quant is None]
                if as_shipped:
                    own = max(as_shipped, key=lambda c: (c.tokens_per_s_per_device, c.tokens_per_s_per_user))
                    print(f"  kadapt {mode:<6} {_pick(own)} (the checkpoint's weights, as AIC prices)")
        if aic is None or system is None:
            why = "no aiconfigurator executable (pip install aiconfigurator)" if aic is None else "no system"
            print(f"  AIConfigurator cli default: not run ({why})")
            continue
        for mode, row in aiconfigurator_picks(aic, spec, system, devices, args).items():
            print(f"  AIC    {mode:<6} {row}")


def aiconfigurator_picks(
    aic: str, spec: Spec, system: str, devices: int, args: argparse.Namespace
) -> dict[str, str]:
    """Run ``aiconfigurator cli default`` on the spec's config directory; its top pick per mode."""
    if spec.source.config is None:
        return {"agg": "not run (the spec ships no config)", "disagg": ""}
    model = spec.source.config.parent  # AIConfigurator reads config.json from a local directory
    with tempfile.TemporaryDirectory() as out:
        command = [aic, "cli", "default", "--model-path", str(model), "--total-gpus", str(devices)]
        command += ["--system", system, "--backend", args.framework, "--isl", str(args.isl)]
        command += [
            "--osl",
            str(args.osl),
            "--ttft",
            str(args.ttft),
            "--tpot",
            str(args.tpot),
            "--save-dir",
            out,
        ]
        start = time.perf_counter()
        run = subprocess.run(command, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
        picks = {"wall": f"{wall:.1f} s (exit {run.returncode})"}
        for mode in ("agg", "disagg"):
            found = sorted(Path(out).rglob(f"{mode}/best_config_topn.csv"))
            rows = list(csv.DictReader(found[0].open())) if found else []
            picks[mode] = _aic_row(mode, rows[0]) if rows else "none"
    return picks


def _aic_row(mode: str, row: dict[str, str]) -> str:
    if mode == "agg":
        layout = (
            f"{row['parallel']} bs{row['bs']} (x{row['dp']} DP = {row['global_bs']}) ctx {row['ctx_tokens']}"
        )
    else:
        layout = (
            f"{row['(p)workers']}P({row['(p)parallel']} bs{row['(p)bs']}) + "
            f"{row['(d)workers']}D({row['(d)parallel']} bs{row['(d)bs']})"
        )
    return (
        f"{layout}: {float(row['tokens/s/gpu']):.1f} tok/s/GPU, "
        f"{float(row['tokens/s/user']):.1f} tok/s/user, "
        f"TTFT {float(row['ttft']):.0f} ms, TPOT {float(row['tpot']):.1f} ms"
    )


if __name__ == "__main__":
    main()
