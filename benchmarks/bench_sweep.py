"""How fast ``kadapt simulate --sweep`` prices configurations, against calling ``simulate`` per configuration.

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
"""

from __future__ import annotations

import argparse
import random
import time

from kimi_adapter_core.backends.simulation.deployment import Deployment
from kimi_adapter_core.backends.simulation.device import get_device
from kimi_adapter_core.backends.simulation.parallel import Parallel
from kimi_adapter_core.backends.simulation.rank_model import RankModel
from kimi_adapter_core.backends.simulation.simulator import simulate, trace_kernels
from kimi_adapter_core.backends.simulation.sweep import Sweep, quant_modes, sweep_inputs
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.spec.loader import resolve_spec_path


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
    args = parser.parse_args()

    spec = load_spec(resolve_spec_path(args.spec))
    device = get_device(args.device)
    inputs = sweep_inputs(spec, quant_modes(spec))
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


if __name__ == "__main__":
    main()
