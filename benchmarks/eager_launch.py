"""The published points whose engine ran without CUDA graphs: the host time per launch, chosen and scored.

Run: ``python benchmarks/bench_simulation.py --only eager``. A point of ``serving_points.yaml`` whose
``engine`` fact says ``cuda_graphs: false`` (its engine's source, at the stated release, runs the decode
step eagerly) is priced by ``kadapt simulate --concurrency --eager``: every launched kernel takes at least
the host's time to launch it (``estimate/eager.py``). That time is the one free parameter. It is chosen
on a development split - the eager points at concurrency <= ``DEV_CONCURRENCY``, where a decode step is
latency-bound and the launches set it - as the median over those points of the host time that makes
kadapt's TPOT the measured one, printed against the shipped ``eager.HOST_US``; then every eager point,
development and test, is priced as the kernel tables price a CUDA graph (host time 0) and eager (the
shipped host time), and the test split is scored once.

Last, per point, kadapt's decode step at the point's shape, graphed and eager, beside the launch
queue's lower bound ``max(sum of device times, launches x host time)``: the gap between that bound
and the eager price is what the rule charges beyond an ideal asynchronous queue (``eager.py``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from serving_anchors import kadapt_estimate
from serving_gap import decode_step

from kimi_adapter_core.backends.simulation.estimate import eager
from kimi_adapter_core.backends.simulation.search.serving_points import ServingPoint, serving_points

DEV_CONCURRENCY = 8  # eager points at this concurrency or below choose the host time; the rest test it
US = 1e-6


def _solve(f: Callable[[float], float], lo: float = 0.0, hi: float = 200.0, tol: float = 0.005) -> float:
    """The root of ``f`` (increasing, convex, piecewise linear in the host time, us) in ``[lo, hi]``:
    regula falsi with the Illinois step, to ``tol`` us."""
    f_lo, f_hi = f(lo), f(hi)
    if f_lo > 0 or f_hi < 0:
        raise ValueError(f"no host time in [{lo}, {hi}] us closes the gap ({f_lo:+.2f} .. {f_hi:+.2f} ms)")
    side = 0
    while hi - lo > tol:
        x = hi - f_hi * (hi - lo) / (f_hi - f_lo)
        fx = f(x)
        if fx > 0:
            hi, f_hi = x, fx
            f_lo = f_lo / 2 if side == -1 else f_lo
            side = -1
        else:
            lo, f_lo = x, fx
            f_hi = f_hi / 2 if side == 1 else f_hi
            side = 1
        if abs(fx) < 1e-6:
            return x
    return (lo + hi) / 2


def host_closing(point: ServingPoint) -> float:
    """The host time per launch (us) at which kadapt's TPOT of ``point`` is the measured one."""
    return _solve(lambda us: kadapt_estimate(point, us * US).tpot_ms - point.mean_tpot_ms)


def _ratios(point: ServingPoint, host: float) -> tuple[float, float]:
    """(TPOT, output tok/s per GPU) ratios to the measurement at ``host`` seconds per launch."""
    est = kadapt_estimate(point, host)
    return est.tpot_ms / point.mean_tpot_ms, est.tok_s_per_device / point.output_tok_s_per_device


def _median_error(rows: Sequence[tuple[float, float]]) -> str:
    return f"{statistics.median(abs(r - 1) for pair in rows for r in pair):.1%}"


def decode_steps(point: ServingPoint, host: float) -> tuple[float, float, float, int]:
    """kadapt's decode step (ms) at the point's shape graphed and eager at ``host`` seconds per launch,
    the launch queue's lower bound (ms) and the kernels the step launches."""
    graphed = decode_step(point, 0.0)
    launched = eager.launches(graphed.kernels)
    eager_step = sum(k.total for k in eager.eager_step(graphed.kernels, host))
    bound = max(graphed.step_time, launched * host)
    return graphed.step_time * 1e3, eager_step * 1e3, bound * 1e3, launched


def eager_table() -> None:
    """The host time chosen on the development split, and every eager point graphed and eager."""
    points = [p for p in serving_points() if not p.cuda_graphs]
    dev = [p for p in points if p.concurrency <= DEV_CONCURRENCY]
    test = [p for p in points if p.concurrency > DEV_CONCURRENCY]
    print(
        f"{len(points)} published points whose engine ran without CUDA graphs (serving_points.yaml engine "
        f"facts): development {len(dev)} (concurrency <= {DEV_CONCURRENCY}), test {len(test)}"
    )
    closing = {p.id: host_closing(p) for p in dev}
    for p in dev:
        print(f"    {p.id:44} host time closing its TPOT: {closing[p.id]:6.2f} us per launch")
    chosen = statistics.median(closing.values())
    shipped = eager.HOST_US * US
    print(
        f"host time per launch chosen on the development split (median): {chosen:.2f} us "
        f"(shipped, eager.HOST_US: {eager.HOST_US:g} us)"
    )
    print("ratios = kadapt / measured: TPOT, output tok/s/GPU; graphed (host 0) -> eager (shipped host time)")
    before: dict[str, list[tuple[float, float]]] = {"development": [], "test": []}
    after: dict[str, list[tuple[float, float]]] = {"development": [], "test": []}
    for split, some in (("development", dev), ("test", test)):
        for p in some:
            b, a = _ratios(p, 0.0), _ratios(p, shipped)
            before[split].append(b)
            after[split].append(a)
            tpot, tput = f"{b[0]:5.2f} -> {a[0]:5.2f}", f"{b[1]:5.2f} -> {a[1]:5.2f}"
            print(f"    {split:11} {p.id:44} TPOT {tpot}   tok/s/GPU {tput}")
    for split in ("development", "test"):
        if before[split]:
            print(
                f"{split} median |ratio-1| (TPOT and tok/s/GPU): {_median_error(before[split])} -> "
                f"{_median_error(after[split])}"
            )
    print(
        "decode step at each point's shape (ms): graphed, eager (every kernel >= the host time), the launch "
        "queue's lower bound max(device, launches x host); kernels launched"
    )
    for p in points:
        graphed, eager_ms, bound, launched = decode_steps(p, shipped)
        print(f"    {p.id:44} {graphed:7.2f} {eager_ms:7.2f} {bound:7.2f} {launched:6d}")
