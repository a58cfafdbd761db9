"""Request-level search: ``kadapt simulate --sweep --isl N --osl M [--ttft MS --tpot MS]``.

A step-level sweep prices one decode (or prefill) step per layout. A deployment is chosen for
requests: an ISL-token prompt (prefill) and OSL output tokens (decode), against a time-to-first-token
(TTFT) and a time-per-output-token (TPOT) target. This module prices whole requests from the step
sweep's kernels, in two serving modes:

- **aggregated**: one pool of workers (each a TP x DP layout of ``w`` devices, replicated
  ``devices // w`` times) serves both phases. In steady state each DP group of a worker holding
  ``r = batch / dp`` requests runs ``n = (OSL - 1) / (1 + mtp x acceptance)`` decode steps per request
  and one prefill step per arriving request (one request per DP group per prefill step: the groups
  run their MoE layers in lock step). So a cycle that completes ``r`` requests per group takes
  ``n x t_decode + r x t_prefill``; every other request's prefill stalls a request's decode, so
  ``TPOT = (n x t_decode + (r - 1) x t_prefill) / (OSL - 1)``; ``TTFT = t_prefill + t_decode / 2``
  (its own prefill after, on average, half the decode step in flight).
- **disaggregated** (xPyD): ``x`` prefill workers and ``y`` decode workers, each pool with its own
  layout. A prefill worker runs ``k`` requests per DP group per step (``TTFT = t_prefill(k)``; the
  fastest option meeting the TTFT target per worker size), a decode worker ``batch`` requests
  (``TPOT = t_decode / (1 + mtp x acceptance)``); ``x`` and ``y`` are sized so that ``x`` prefill
  and ``y`` decode workers fit in the devices and the slower pool sets the request rate as high as it
  goes: ``min(x x prefill rate, y x decode rate)``. The KV-cache transfer between pools is not priced.

Queueing is not modelled in either mode (TTFT is that of a lightly queued server; AIConfigurator
multiplies the aggregated prefill by a 2-4x heuristic queueing factor). tokens/s per device = request
rate x OSL / devices used; tokens/s per user = 1 / TPOT. A layout is searched only when the serving
framework can launch it (``frameworks.yaml``: each rule with its documented source), and only in
weight modes whose weights fit. Decode is priced at the mean context ``ISL + OSL / 2`` (attention is
linear in the context, so the mean step is the mean over a request), with the KV cache sized for the
last token (``ISL + OSL``); an aggregated worker must also hold a prefill's activations.

Every step is priced by ``sweep.Sweep`` (a few traces per TP size and phase, the per-rank models
shared between phases and worker sizes), so thousands of request configurations cost a few dozen
traces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from ...errors import KadaptError, UsageError
from ...spec.model import Spec
from .deployment import Deployment
from .device import Device
from .inputs import ModelInputs
from .parallel import Parallel
from .pareto import pareto_front
from .pareto_plot import PlotPoint
from .planner import Memory
from .rank_model import RankModel
from .sweep import Config, Point, Pricer, Sweep, divisors, layouts

FRAMEWORKS_FILE = Path(__file__).with_name("frameworks.yaml")
MODES = ("agg", "disagg")
DEFAULT_PREFILL_BATCHES = (1, 2, 4, 8)  # requests per DP group in one disaggregated prefill step
MAX_PREFILL_TOKENS = 16384  # per DP group and step: larger prefill batches are not tried (but k = 1)
_VARIABLES = ("tp", "dp", "ep", "ep_groups", "devices")
# concurrent requests per worker: a 1-1.5-2 grid (powers of two alone skip most batches that just
# meet a TPOT target)
REQUEST_BATCHES = tuple(sorted({2**e for e in range(11)} | {3 * 2**e for e in range(10)}))  # 1, 2, 3, 4, 6 ..


# --- serving frameworks: which layouts they can launch ------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """Layouts a framework cannot launch: those for which every ``when`` bound holds."""

    id: str
    when: Mapping[str, tuple[int | None, int | None]]  # variable -> (min, max), inclusive
    why: str
    source: str

    def refuses(self, par: Parallel) -> bool:
        values = {"tp": par.tp, "dp": par.dp, "ep": par.ep, "ep_groups": par.devices // par.ep}
        values["devices"] = par.devices
        return all(
            (lo is None or values[name] >= lo) and (hi is None or values[name] <= hi)
            for name, (lo, hi) in self.when.items()
        )


@dataclass(frozen=True)
class Framework:
    name: str
    title: str
    rules: tuple[Rule, ...]

    def refusal(self, par: Parallel) -> Rule | None:
        """The first rule that refuses ``par``, or None when the framework can launch it."""
        return next((rule for rule in self.rules if rule.refuses(par)), None)


def frameworks() -> tuple[str, ...]:
    return tuple(_load())


def framework(name: str) -> Framework:
    """The feasibility rules of serving framework ``name`` (``frameworks.yaml``)."""
    table = _load()
    if name not in table:
        raise UsageError(f"unknown serving framework {name!r} (known: {', '.join(table)})")
    return table[name]


@cache
def _load() -> dict[str, Framework]:
    """``frameworks.yaml``, checked: a typo in a variable or bound would silently refuse nothing."""
    data = yaml.safe_load(FRAMEWORKS_FILE.read_text(encoding="utf-8"))
    table = {}
    for name, entry in data.items():
        rules = []
        for raw in entry["rules"]:
            when = {}
            for variable, bounds in raw["when"].items():
                unknown = set(bounds) - {"min", "max"}
                if variable not in _VARIABLES or unknown or not bounds:
                    where = f"{FRAMEWORKS_FILE.name}: {name}.{raw['id']}"
                    raise KadaptError(f"{where}: bad bound {variable}: {bounds}")
                when[variable] = (bounds.get("min"), bounds.get("max"))
            rules.append(Rule(raw["id"], when, raw["why"], raw["source"]))
        if not rules and not entry.get("source"):
            raise KadaptError(f"{FRAMEWORKS_FILE.name}: {name} has no rules and no source saying why")
        table[name] = Framework(name, entry["title"], tuple(rules))
    return table


# --- the workload -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """Requests of ``isl`` prompt and ``osl`` output tokens; SLA targets in seconds (None: no target)."""

    isl: int
    osl: int
    ttft: float | None = None
    tpot: float | None = None

    def check(self, max_positions: int) -> None:
        if self.isl < 1:
            raise UsageError(f"--isl must be >= 1 (got {self.isl})")
        if self.osl < 2:
            raise UsageError(f"--osl must be >= 2 (got {self.osl}): a request's TPOT needs a second token")
        for name, value in (("--ttft", self.ttft), ("--tpot", self.tpot)):
            if value is not None and value <= 0:
                raise UsageError(f"{name} must be > 0 ms (got {value * 1e3:g})")
        if self.isl + self.osl > max_positions:
            raise UsageError(
                f"--isl {self.isl} + --osl {self.osl} exceeds the model's max_position_embeddings "
                f"{max_positions}"
            )

    def meets(self, ttft: float, tpot: float) -> bool:
        return (self.ttft is None or ttft <= self.ttft) and (self.tpot is None or tpot <= self.tpot)


# --- one priced deployment ----------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One way to serve the workload on the devices: a pool (aggregated) or two (disaggregated)."""

    mode: str  # agg | disagg
    decode: Point  # the decode step of a decode (agg: the only) worker
    prefill: Point  # the prefill step of a prefill (agg: the same) worker
    decode_workers: int  # agg: replicas of the one worker
    prefill_workers: int  # 0 for agg: the decode workers prefill
    ttft: float  # seconds
    tpot: float  # seconds
    requests_per_s: float
    osl: int
    memory: Memory  # per device of the decode (agg: the only) worker
    meets_sla: bool

    @property
    def quant(self) -> str | None:
        return self.decode.config.quant

    @property
    def devices(self) -> int:
        """Devices the pools use."""
        return (
            self.decode_workers * self.decode.config.parallel.devices
            + self.prefill_workers * self.prefill.config.parallel.devices
        )

    @property
    def fits(self) -> bool:
        return (self.memory.free is None or self.memory.free >= 0) and self.prefill.fits

    @property
    def feasible(self) -> bool:
        return self.fits and self.meets_sla

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.requests_per_s * self.osl / self.devices

    @property
    def tokens_per_s_per_user(self) -> float:
        return 1 / self.tpot

    @property
    def layout(self) -> str:
        d = self.decode.config
        if self.mode == "agg":
            replicas = f" x{self.decode_workers}" if self.decode_workers > 1 else ""
            return f"{d.layout}{replicas} b{d.batch}"
        p = self.prefill.config
        return (
            f"{self.prefill_workers}P({p.layout} b{p.batch}) + {self.decode_workers}D({d.layout} b{d.batch})"
        )

    @property
    def tag(self) -> str:
        """The layout, short enough to print beside a plotted point (sizes of 1 left out)."""
        d = _short(self.decode.config)
        if self.mode == "agg":
            return d if self.decode_workers == 1 else f"{d} x{self.decode_workers}"
        return f"{self.prefill_workers}P {_short(self.prefill.config)} + {self.decode_workers}D {d}"


def _short(config: Config) -> str:
    p = config.parallel
    sizes = [f"{name}{n}" for name, n in (("tp", p.tp), ("dp", p.dp), ("ep", p.ep)) if n > 1]
    return " ".join([*sizes, f"b{config.batch}"])


def aggregated(
    decode: Point, prefill: Point, workload: Workload, mtp_tokens: float, devices: int
) -> Candidate:
    """One worker serving both phases (see the module docstring), replicated over the devices."""
    par, batch = decode.config.parallel, decode.config.batch
    steps = (workload.osl - 1) / mtp_tokens
    per_group = batch / par.dp
    t_dec, t_pre = decode.step_time, prefill.step_time
    cycle = steps * t_dec + per_group * t_pre
    tpot = (steps * t_dec + (per_group - 1) * t_pre) / (workload.osl - 1)
    ttft = t_pre + t_dec / 2
    replicas = devices // par.devices
    d, p = decode.memory, prefill.memory
    memory = replace(d, activations=max(d.activations, p.activations))
    return Candidate(
        "agg",
        decode,
        prefill,
        replicas,
        0,
        ttft,
        tpot,
        replicas * batch / cycle,
        workload.osl,
        memory,
        workload.meets(ttft, tpot),
    )


def disaggregated(
    decode: Point, prefill: Point, workload: Workload, mtp_tokens: float, devices: int
) -> Candidate | None:
    """The best xPyD pools of these two workers within ``devices``: the (x, y) with the highest
    tokens/s per device (ties: fewer devices), or None when one of each does not fit."""
    nd, np_ = decode.config.parallel.devices, prefill.config.parallel.devices
    steps = (workload.osl - 1) / mtp_tokens
    decode_rate = decode.config.batch / (steps * decode.step_time)  # requests/s one decode worker ends
    prefill_rate = prefill.config.batch / prefill.step_time  # requests/s one prefill worker starts
    best: tuple[float, int, int, int] | None = None
    for x in range(1, (devices - nd) // np_ + 1):
        for y in range(1, (devices - x * np_) // nd + 1):
            used = x * np_ + y * nd
            rate = min(x * prefill_rate, y * decode_rate)
            key = (rate / used, -used, x, y)
            if best is None or key[:2] > best[:2]:
                best = key
    if best is None:
        return None
    _, _, x, y = best
    ttft, tpot = prefill.step_time, decode.step_time / mtp_tokens
    return Candidate(
        "disagg",
        decode,
        prefill,
        y,
        x,
        ttft,
        tpot,
        min(x * prefill_rate, y * decode_rate),
        workload.osl,
        decode.memory,
        workload.meets(ttft, tpot),
    )


# --- the search -----------------------------------------------------------------------------------
@dataclass
class ServingResult:
    devices: int
    workload: Workload
    framework: Framework
    modes: tuple[str, ...]
    quants: tuple[str | None, ...] = ()
    worker_sizes: dict[int, str] = field(default_factory=dict)  # devices per worker -> searched / why not
    refused: dict[str, int] = field(default_factory=dict)  # rule id -> layouts it refused
    candidates: list[Candidate] = field(default_factory=list)
    steps_priced: int = 0  # prefill and decode steps priced
    traces: int = 0
    trace_seconds: float = 0.0
    fallbacks: dict[str, str] = field(default_factory=dict)  # family -> why traced per configuration

    @property
    def feasible(self) -> list[Candidate]:
        """Candidates that fit in memory and meet the SLA."""
        return [c for c in self.candidates if c.feasible]

    @property
    def front(self) -> list[Candidate]:
        """Feasible candidates no other feasible one beats on tokens/s per user and per device."""
        return pareto_front(self.feasible, lambda c: (c.tokens_per_s_per_user, c.tokens_per_s_per_device))

    def best(self, mode: str | None = None) -> Candidate | None:
        """The feasible candidate (of ``mode``) with the most tokens/s per device: the pick."""
        pool = [c for c in self.feasible if mode is None or c.mode == mode]
        return max(pool, key=lambda c: (c.tokens_per_s_per_device, c.tokens_per_s_per_user), default=None)


class ServingSearch:
    """Prices the workload on ``devices`` devices for one model, device profile and framework.

    ``inputs`` maps each weight mode to its ``model_inputs``; ``base`` carries MTP, its acceptance,
    the KV dtype and the routing (its shapes and layout are replaced per phase and configuration)."""

    def __init__(
        self,
        spec: Spec,
        inputs: Mapping[str | None, ModelInputs],
        device: Device,
        base: Deployment,
        devices: int,
        workload: Workload,
        framework_name: str,
        *,
        modes: Sequence[str] = MODES,
        batches: Sequence[int] | None = None,
        prefill_batches: Sequence[int] = DEFAULT_PREFILL_BATCHES,
        pricer: Pricer | None = None,
    ) -> None:
        if devices < 1:
            raise UsageError(f"--devices must be >= 1 (got {devices})")
        self.spec, self.inputs, self.device, self.devices = spec, dict(inputs), device, devices
        self.s = next(iter(self.inputs.values())).arch.structure
        workload.check(self.s.max_positions)
        unknown = set(modes) - set(MODES)
        if unknown or not modes:
            raise UsageError(f"serving modes must be among {', '.join(MODES)} (got {', '.join(modes)})")
        self.workload, self.framework, self.modes = workload, framework(framework_name), tuple(modes)
        self.batches = tuple(sorted(set(batches))) if batches else REQUEST_BATCHES
        self.prefill_batches = tuple(sorted(set(prefill_batches)))
        self.pricer = pricer
        self.decode_base = replace(
            base, query_len=1, context_len=workload.isl + workload.osl // 2, decode=True, batch=1
        )
        self.prefill_base = replace(base, query_len=workload.isl, context_len=0, decode=False, mtp=0, batch=1)
        self.mtp_tokens = 1 + base.mtp * base.mtp_acceptance  # output tokens per request per decode step
        self.models: dict[tuple[int, bool], RankModel] = {}  # shared by every sweep of the search

    def _sweep(self, base: Deployment, workers: int, batches: Iterable[int], kv_tokens: int | None) -> Sweep:
        return Sweep(
            self.spec,
            self.inputs,
            self.device,
            base,
            workers,
            pricer=self.pricer,
            batches=tuple(sorted(set(batches))),
            kv_tokens=kv_tokens,
            models=self.models,
        )

    def _weights_fit(self, sweep: Sweep, par: Parallel, quant: str | None) -> bool:
        return sweep.memory(Config(par, par.dp, quant)).weights <= (self.device.memory_bytes or math.inf)

    def run(self) -> ServingResult:
        w = self.workload
        result = ServingResult(self.devices, w, self.framework, self.modes)
        decode_points: list[Point] = []
        prefill_points: list[Point] = []
        for workers in divisors(self.devices):
            try:
                candidates = layouts(self.s, workers)
            except UsageError:
                result.worker_sizes[workers] = "no layout divides the model's heads and widths"
                continue
            pars = []
            for par in candidates:
                rule = self.framework.refusal(par)
                if rule is None:
                    pars.append(par)
                else:
                    result.refused[rule.id] = result.refused.get(rule.id, 0) + 1
            if not pars:
                result.worker_sizes[workers] = f"{self.framework.title} can launch none of its layouts"
                continue
            decode = self._sweep(self.decode_base, workers, self.batches, w.isl + w.osl)
            result.quants = decode.quants
            fitting = [(par, q) for par in pars for q in decode.quants if self._weights_fit(decode, par, q)]
            if not fitting:
                result.worker_sizes[workers] = "the weights do not fit on this many devices"
                continue
            ks = [k for k in self.prefill_batches if k == 1 or k * w.isl <= MAX_PREFILL_TOKENS]
            if "disagg" not in self.modes:
                ks = [1]  # an aggregated worker prefills one request per DP group per step
            prefill_configs = [Config(par, k * par.dp, q) for par, q in fitting for k in ks]
            decode_configs = [
                Config(par, b, q) for par, q in fitting for b in self.batches if b % par.dp == 0
            ]
            prefill = self._sweep(self.prefill_base, workers, [c.batch for c in prefill_configs], None)
            for sweep, configs, sink in (
                (prefill, prefill_configs, prefill_points),
                (decode, decode_configs, decode_points),
            ):
                priced = sweep.run(configs)
                sink += priced.points
                result.steps_priced += len(priced.points)
                result.traces += sweep.traces
                result.trace_seconds += sweep.trace_seconds
                phase = "prefill" if sweep is prefill else "decode"
                for family, why in priced.fallbacks.items():
                    result.fallbacks[f"{phase} on {workers} devices, {family}"] = why
            result.worker_sizes[workers] = f"{len(fitting)} layouts x weight modes searched"
        if "agg" in self.modes:
            result.candidates += self._aggregated(decode_points, prefill_points)
        if "disagg" in self.modes:
            result.candidates += self._disaggregated(decode_points, prefill_points)
        return result

    def _aggregated(self, decode_points: list[Point], prefill_points: list[Point]) -> list[Candidate]:
        one_per_group = {
            (p.config.parallel, p.config.quant): p
            for p in prefill_points
            if p.config.batch == p.config.parallel.dp
        }
        found = []
        for d in decode_points:
            p = one_per_group.get((d.config.parallel, d.config.quant))
            if p is not None:
                found.append(aggregated(d, p, self.workload, self.mtp_tokens, self.devices))
        return found

    def _disaggregated(self, decode_points: list[Point], prefill_points: list[Point]) -> list[Candidate]:
        """Per weight mode and prefill worker size, the prefill option starting the most requests per
        second that fits and meets the TTFT target; then every decode point with the best pools."""
        ttft = self.workload.ttft
        best: dict[tuple[str | None, int], Point] = {}
        for p in prefill_points:
            if not p.fits or (ttft is not None and p.step_time > ttft):
                continue
            key = (p.config.quant, p.config.parallel.devices)
            rate = p.config.batch / p.step_time
            if key not in best or rate > best[key].config.batch / best[key].step_time:
                best[key] = p
        found = []
        for d in decode_points:
            for (quant, _), p in best.items():
                if quant != d.config.quant:
                    continue
                candidate = disaggregated(d, p, self.workload, self.mtp_tokens, self.devices)
                if candidate is not None:
                    found.append(candidate)
        return found


def describe_rules(fw: Framework) -> list[dict[str, Any]]:
    """The framework's rules as JSON: id, bounds, why and source."""
    return [
        {
            "id": rule.id,
            "when": {k: {"min": lo, "max": hi} for k, (lo, hi) in rule.when.items()},
            "why": rule.why,
            "source": rule.source,
        }
        for rule in fw.rules
    ]


def plot_points(result: ServingResult, label: Callable[[Candidate], str]) -> list[PlotPoint]:
    """Every fitting candidate as a plot point: front points tagged with their layout, SLA misses hollow."""
    front = {id(c) for c in result.front}
    return [
        PlotPoint(
            c.tokens_per_s_per_user,
            c.tokens_per_s_per_device,
            f"{c.mode} {c.quant or 'checkpoint'}",
            label(c),
            id(c) in front,
            c.tag if id(c) in front else "",
            c.meets_sla,
        )
        for c in result.candidates
        if c.fits
    ]
