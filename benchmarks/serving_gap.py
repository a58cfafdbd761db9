"""What the serving anchors miss at low concurrency: the measured TPOT against the priced decode step.

Run: ``python benchmarks/bench_simulation.py --only serving-gap``. At one to four requests in flight a
step is latency-bound: nearly every kernel runs at its floor, so the published TPOT minus kadapt's is
what the kernel tables do not hold. For every published point (``serving_points.yaml``) at
concurrency <= 4 that kadapt prices, this prints the measured TPOT, kadapt's (``simulate
--concurrency``) and AIConfigurator's (``run_agg``), then kadapt's decode step at the point's shape
(``concurrency / dp`` requests per attention group at the mean context ``ISL + OSL / 2``, as the
request pricing decodes) split as AIConfigurator splits its own step of the same shape
(``reference.COMPONENTS``), the kernels kadapt launches per layer, and the gap per step, per layer
and per launch.

It then recomputes the engine-kernel floor (``estimate/engine_kernels.py``: the small kernels a
framework launches that the trace does not hold, each its memory roofline plus the floor) on the
development source below, the median of the floors that close each of its points' gaps, prints it
against the shipped one, and prices the other points of its framework, device and release family
without and with the engine kernels (their test, scored once when the floor was chosen).

Last, it asks whether the gap is a per-framework constant (CPU scheduling, sampling, launch gaps: one
number a serving engine adds to every step whatever the model): such a constant is chosen on one
development source (its median gap) and scored once on the other sources of the same framework,
device and release, reported apart. Nothing here changes a price: it is the evidence for
docs/cost_model.md's account of the gap.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from unittest import mock

from serving_anchors import AIC_KV, AIC_MODELS, REPO, AicServing, Estimate, host_time, kadapt_estimate

from kimi_adapter_core.backends.simulation.estimate import aiconfigurator, engine_kernels, reference
from kimi_adapter_core.backends.simulation.estimate.simulator import Simulation, simulate
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.search.concurrency import lockstep_batch
from kimi_adapter_core.backends.simulation.search.grid import quant_modes, sweep_inputs
from kimi_adapter_core.backends.simulation.search.serving_points import ServingPoint, serving_points
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import load_spec

LOW = 4  # concurrency up to which a decode step is latency-bound on every anchor's layout
# the development source a per-step constant is chosen on: the first SGLang B200 source (three c1
# points); the other sources of its framework, device and release family are its test
DEV_SOURCE = "SGLang Cookbook: DeepSeek-R1, 5.1 Speed Benchmark"


@dataclass(frozen=True)
class Gap:
    """One low-concurrency point: measured and estimated TPOT (ms), kadapt's decode step parts."""

    point: ServingPoint
    kadapt: Estimate
    aic: Estimate | str
    step: Simulation
    aic_parts: dict[str, float] | str  # AIConfigurator's decode step by component (ms), or why none

    @property
    def gap_ms(self) -> float:
        return self.point.mean_tpot_ms - self.kadapt.tpot_ms

    @property
    def layers(self) -> int:
        """Decoder layers: one attention kernel each (no MTP is priced here)."""
        return sum(k.op.repeat for k in self.step.kernels if k.op.kind == "attention")

    @property
    def engine(self) -> int:
        """Engine kernels (``engine_kernels``) kadapt prices per step, off a second stream."""
        return sum(k.op.repeat for k in self.step.kernels if "engine_kernel" in k.op.attrs and k.total > 0)

    @property
    def launches(self) -> int:
        """Kernels kadapt prices per step (a kernel overlapped on a second stream costs no time)."""
        return sum(k.op.repeat for k in self.step.kernels if k.total > 0)

    @property
    def source(self) -> str:
        return self.point.title.split(" (")[0]  # as the serving table groups its sources

    @property
    def family(self) -> tuple[str, str, str]:
        """Framework, device and release family (the version before a ``.post`` patch)."""
        return self.point.framework, self.point.device, self.point.version.split(".post")[0]


def decode_step(point: ServingPoint, host: float | None = None) -> Simulation:
    """kadapt's decode step of the point as the request pricing decodes it (eager where its engine ran
    without CUDA graphs; ``host`` overrides the host time per launch, seconds)."""
    spec = load_spec(REPO / "specs" / f"{point.spec}.yaml")
    (inputs,) = sweep_inputs(spec, quant_modes(spec, None)).values()
    dep = Deployment(
        point.parallel,
        lockstep_batch(point.concurrency, point.parallel.dp),
        1,
        point.isl + point.osl // 2,
        True,
        kv_dtype=point.kv_dtype,
        eager_host=host_time(point) if host is None else host,
    )
    return simulate(inputs, spec, dep, get_device(point.device), framework=point.framework)


def aic_step(point: ServingPoint) -> dict[str, float] | str:
    """AIConfigurator's decode step of the same shape, by component, or why it has none."""
    if point.spec not in AIC_MODELS:
        return f"no AIConfigurator model for {point.spec}"
    model, quant = AIC_MODELS[point.spec]
    par = point.parallel
    try:
        ref = reference.reference_step(
            model,
            aiconfigurator.system_for(point.device),
            point.framework,
            tp=par.tp,
            ep=point.moe_ep,
            dp=par.dp,
            moe_tp=point.moe_tp,
            decode=True,
            batch=lockstep_batch(point.concurrency, par.dp) // par.dp,
            seq=point.isl + point.osl // 2,
            kvcache_quant_mode=AIC_KV[point.kv_dtype],
            **quant,
        )
    except Exception as exc:  # noqa: BLE001 - AIConfigurator's own errors (a kernel it never measured)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}"
    return {**ref.components, "total": ref.total_ms}


def parts(step: Simulation) -> dict[str, float]:
    """kadapt's step (ms) on AIConfigurator's component split."""
    out = dict.fromkeys(reference.COMPONENTS, 0.0)
    for k in step.kernels:
        out[reference.kadapt_component(k.op)] += k.total * 1e3
    return {**out, "total": step.step_time * 1e3}


def gaps() -> list[Gap]:
    aic = AicServing() if aiconfigurator.available() else None
    found = []
    for p in serving_points():
        if p.concurrency > LOW:
            continue
        try:
            k = kadapt_estimate(p)
        except KadaptError:
            continue  # the serving table lists it as not priced, with the reason
        a: Estimate | str = aic.estimate(p) if aic else "not installed"
        found.append(Gap(p, k, a, decode_step(p), aic_step(p) if aic else "not installed"))
    return found


def _split(values: dict[str, float] | str) -> str:
    if isinstance(values, str):
        return f"{'-':>27}"
    return " ".join(f"{values[name]:5.2f}" for name in (*reference.COMPONENTS[:3], "other")) + (
        f" {values['total']:5.2f}"
    )


def _constant(found: Sequence[Gap]) -> None:
    """A per-step constant chosen on the development source, scored once on the others of the same
    framework, device and release family (the text before the patch number)."""
    dev = [g for g in found if g.source == DEV_SOURCE]
    if not dev:
        return
    family = {g.family for g in dev}
    test = [g for g in found if g.source != DEV_SOURCE and g.family in family]
    constant = statistics.median(g.gap_ms for g in dev)
    print(
        f"a per-step constant chosen on {DEV_SOURCE} (development, {len(dev)} points): "
        f"{constant:+.2f} ms; scored once on the other {len(test)} points of "
        f"{', '.join(f'{f} {v} {d}' for f, d, v in sorted(family))} (test), TPOT ratio before -> after:"
    )
    for g in test:
        before = g.kadapt.tpot_ms / g.point.mean_tpot_ms
        after = (g.kadapt.tpot_ms + constant) / g.point.mean_tpot_ms
        print(f"    {g.point.id:44} {before:5.2f} -> {after:5.2f}")
    errors = [abs(g.kadapt.tpot_ms / g.point.mean_tpot_ms - 1) for g in test]
    shifted = [abs((g.kadapt.tpot_ms + constant) / g.point.mean_tpot_ms - 1) for g in test]
    if test:
        print(
            f"    test median |TPOT ratio - 1|: {statistics.median(errors):.1%} -> "
            f"{statistics.median(shifted):.1%} (not applied)"
        )


def _solve_floor(point: ServingPoint) -> float:
    """The engine-kernel floor (us) that makes kadapt's TPOT of ``point`` the measured one: the TPOT
    is linear in the floor (every engine kernel of a decode step adds it once), so two prices fix it."""
    device = point.device
    with mock.patch.dict(engine_kernels.FLOOR_US, {device: 0.0}):
        at0 = kadapt_estimate(point).tpot_ms
    with mock.patch.dict(engine_kernels.FLOOR_US, {device: 1.0}):
        at1 = kadapt_estimate(point).tpot_ms
    return (point.mean_tpot_ms - at0) / (at1 - at0)


def _floor(found: Sequence[Gap]) -> None:
    """The engine-kernel floor chosen on the development source (the median over its points of the
    floor that closes each one's gap) against the shipped ``FLOOR_US``, and the test points of its
    framework, device and release family priced without the engine kernels and with them."""
    dev = [g for g in found if g.source == DEV_SOURCE]
    if not dev:
        return
    family = {g.family for g in dev}
    test = [g for g in found if g.source != DEV_SOURCE and g.family in family]
    device = dev[0].point.device
    chosen = statistics.median(_solve_floor(g.point) for g in dev)
    print(
        f"engine-kernel floor chosen on {DEV_SOURCE} (development, {len(dev)} points): {chosen:.2f} us "
        f"(shipped, engine_kernels.FLOOR_US[{device!r}]: {engine_kernels.FLOOR_US.get(device)} us); "
        f"the other {len(test)} points of its family (test), TPOT ratio without -> with the engine kernels:"
    )
    before, after = [], []
    for g in test:
        with mock.patch.dict(engine_kernels.RULES, clear=True):
            without = kadapt_estimate(g.point).tpot_ms / g.point.mean_tpot_ms
        with_ = g.kadapt.tpot_ms / g.point.mean_tpot_ms
        before.append(abs(without - 1))
        after.append(abs(with_ - 1))
        per_layer = g.engine / g.layers
        print(f"    {g.point.id:44} {without:5.2f} -> {with_:5.2f} ({per_layer:.1f} engine kernels/layer)")
    if test:
        median = f"{statistics.median(before):.1%} -> {statistics.median(after):.1%}"
        print(f"    test median |TPOT ratio - 1|: {median}")


def serving_gap_table() -> None:
    """The low-concurrency points, their decode steps and the per-step constant test."""
    found = gaps()
    print(
        f"{len(found)} published points at concurrency <= {LOW} kadapt prices; TPOT ms (mean), decode step "
        "ms at the point's shape, split as AIConfigurator splits its step: attention / experts / "
        "communication / other / total"
    )
    print(
        f"{'point':44} {'meas':>6} {'kadapt':>6} {'AIC':>6} | {'kadapt step':>27} | "
        f"{'AIC step':>27} | {'L':>3} {'k/L':>4} {'gap ms':>6} {'us/L':>5} {'us/k':>5}"
    )
    for g in found:
        aic = f"{g.aic.tpot_ms:6.2f}" if isinstance(g.aic, Estimate) else f"{'-':>6}"
        print(
            f"{g.point.id:44} {g.point.mean_tpot_ms:6.2f} {g.kadapt.tpot_ms:6.2f} {aic} | "
            f"{_split(parts(g.step))} | {_split(g.aic_parts)} | {g.layers:3d} "
            f"{g.launches / g.layers:4.1f} {g.gap_ms:+6.2f} {g.gap_ms / g.layers * 1e3:+5.0f} "
            f"{g.gap_ms / g.launches * 1e3:+5.1f}"
        )
    by: dict[tuple[str, str, str], list[Gap]] = {}
    for g in found:
        by.setdefault((g.point.framework, g.point.version, g.point.device), []).append(g)
    print("gap per step (measured - kadapt TPOT) by framework release and device:")
    for (fw, version, device), some in by.items():
        models = sorted({g.point.spec for g in some})
        low, high = min(g.gap_ms for g in some), max(g.gap_ms for g in some)
        aic = [g.point.mean_tpot_ms - g.aic.tpot_ms for g in some if isinstance(g.aic, Estimate)]
        bound = f"; to AIC's TPOT {min(aic):+.2f} .. {max(aic):+.2f} ms" if aic else ""
        n = f"{len(some)} point{'s' if len(some) > 1 else ''}"
        print(f"    {fw} {version} {device}: {low:+.2f} .. {high:+.2f} ms{bound} ({n}; {', '.join(models)})")
    print(
        "    a cost the engine adds to every step whatever the model is at most the smallest gap of its "
        "release and device"
    )
    print(
        "    AIC step parts: reference_step's sum of its ops, before AIC overlaps DeepSeek's shared experts "
        "and with a measured module's fallback parts counted too (dstack vLLM): compare its totals there"
    )
    _floor(found)
    _constant(found)
