"""Request-level search: ``kadapt simulate --sweep --isl N --osl M [--ttft MS --tpot MS]``.

A step-level sweep prices one decode (or prefill) step per layout. A deployment is chosen for
requests: an ISL-token prompt (prefill) and OSL output tokens (decode), against a time-to-first-token
(TTFT) and a time-per-output-token (TPOT) target. This module prices whole requests from the step
sweep's kernels, in two serving modes:

- **aggregated** (chunked prefill, as TensorRT-LLM, SGLang and vLLM schedule by default): one pool
  of workers (each a TP x DP layout of ``w`` devices, replicated ``devices // w`` times) serves both
  phases. Each step of a DP group carries its ``r = batch / dp`` decoding requests and, in a *mixed*
  step, a chunk of ``c`` prompt tokens; ``c`` is the framework's per-step token budget less the decode
  rows when they count against it (``frameworks.yaml`` ``step_tokens``; budgets of 512 tokens up to
  the framework's default cap are tried, a smaller budget trading TTFT for TPOT). A mixed step is
  priced as one forward pass, the weights read once for decode and prompt rows: the row kernels
  (projections, experts and their all-to-all, norms) of a prefill-path step over ``r x (1 + mtp) + c``
  one-token rows, plus the decode step's per-request kernels (attention over each context, logits,
  MTP drafts), plus ``c / ISL`` of one whole prompt's attention. In steady state ``r`` requests
  finish per cycle of ``n = (OSL - 1) / (1 + mtp x acceptance)`` decode steps per request, ``m = r x
  ISL / c`` of the steps mixed (all of them when ``m > n``): ``cycle = m x t_mix + max(n - m, 0) x
  t_decode``; a request's decode steps hold the other ``r - 1`` requests' chunks, so ``TPOT = (k x
  t_mix + (n - k) x t_decode) / (OSL - 1)`` with ``k = min(m - ISL / c, n)`` mixed steps among them;
  ``TTFT = ceil(ISL / c) x t_mix + half a mean step`` (waiting for the step in flight). The prompts
  being prefilled (about ``c / ISL + 1`` per group) come on top of the ``r`` decoding requests and
  their KV cache is not counted.
- **disaggregated** (xPyD): ``x`` prefill workers and ``y`` decode workers, each pool with its own
  layout. A prefill worker runs ``k`` requests per DP group per step (``TTFT = t_prefill(k)``; the
  fastest option meeting the TTFT target per worker size), a decode worker ``batch`` requests
  (``TPOT = t_decode / (1 + mtp x acceptance)``); ``x`` and ``y`` are sized so that ``x`` prefill
  and ``y`` decode workers fit in the devices and the slower pool sets the request rate as high as it
  goes: ``min(x x prefill rate, y x decode rate)``. The KV-cache transfer between pools is not priced.

Queueing is not modelled in either mode: TTFT is that of a lightly loaded server. AIConfigurator
0.12 multiplies its aggregated TTFT by ``min(2 + (steps to prefill the batch - 3) / 20, 4)``
(TensorRT-LLM and SGLang; vLLM: ``1 + log2(b) / 8``, calibrated), which its source calls a legacy
heuristic; it also leaves 3 mixed steps out of TensorRT-LLM's and SGLang's TPOT (an empirical
"pipeline drain" correction) and prefills whole prompts per step unless asked to chunk. None of
these is applied here.

tokens/s per device = request rate x OSL / devices used; tokens/s per user = 1 / TPOT. A layout is
searched only when the serving framework can launch it (``frameworks.yaml``: each rule with its
documented source), and only in weight modes whose weights fit. Decode is priced at the mean context
``ISL + OSL / 2`` (attention is linear in the context, so the mean step is the mean over a request),
with the KV cache sized for the last token (``ISL + OSL``); an aggregated worker must also hold a
mixed step's activations.

Every step is priced by ``sweep.Sweep`` (a few traces per TP size and phase, the per-rank models
shared between phases and worker sizes; a mixed step's rows are a third sweep's), so thousands of
request configurations cost a few dozen traces.
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
from .cost import Priced
from .deployment import Deployment
from .device import Device
from .inputs import ModelInputs
from .parallel import Parallel
from .pareto import pareto_front
from .pareto_plot import PlotPoint
from .planner import Memory, activation_bytes
from .rank_model import RankModel
from .sweep import Config, Point, Pricer, Sweep, divisors, layouts
from .tracer import Op

FRAMEWORKS_FILE = Path(__file__).with_name("frameworks.yaml")
MODES = ("agg", "disagg")
DEFAULT_PREFILL_BATCHES = (1, 2, 4, 8)  # requests per DP group in one disaggregated prefill step
MAX_PREFILL_TOKENS = 16384  # per DP group and step: larger prefill batches are not tried (but k = 1)
# tokens per step per DP group an aggregated worker is tried with, up to the framework's cap
STEP_BUDGETS = (512, 1024, 2048, 4096, 8192, 16384)
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
class StepTokens:
    """The framework's cap on the tokens one forward step carries per DP group (its default; smaller
    budgets are a launch option), and whether the decode rows count against it."""

    max: int
    counts_decode: bool
    source: str

    def chunks(self, decode_rows: int, most: int) -> list[int]:
        """Prompt tokens a mixed step carries beside ``decode_rows`` decode tokens, one per budget
        tried (``STEP_BUDGETS`` up to the cap), at most ``most`` (the prompt tokens a cycle brings: a
        step cannot carry more than are waiting); a budget the decode rows already fill carries no
        prompt and is left out."""
        found = []
        for budget in (b for b in STEP_BUDGETS if b <= self.max):
            chunk = min(budget - decode_rows if self.counts_decode else budget, most)
            if chunk > 0 and chunk not in found:
                found.append(chunk)
        return found


@dataclass(frozen=True)
class Framework:
    name: str
    title: str
    rules: tuple[Rule, ...]
    step_tokens: StepTokens

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
        step = entry.get("step_tokens") or {}
        if not isinstance(step.get("max"), int) or step["max"] < 1 or not step.get("source"):
            raise KadaptError(f"{FRAMEWORKS_FILE.name}: {name}.step_tokens needs a max >= 1 and a source")
        tokens = StepTokens(step["max"], bool(step.get("counts_decode", True)), step["source"])
        table[name] = Framework(name, entry["title"], tuple(rules), tokens)
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
    chunk: int = 0  # agg: prompt tokens per DP group a mixed step carries beside the decode batch
    mixed_step_time: float = 0.0  # agg: seconds of a mixed step (the longest gap between two tokens)

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
        fits = self.memory.free is None or self.memory.free >= 0
        return fits and (self.mode == "agg" or self.prefill.fits)  # agg: the chunk's rows are in memory

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
            return f"{d.layout}{replicas} b{d.batch} chunk {self.chunk}"
        p = self.prefill.config
        return (
            f"{self.prefill_workers}P({p.layout} b{p.batch}) + {self.decode_workers}D({d.layout} b{d.batch})"
        )

    @property
    def tag(self) -> str:
        """The layout, short enough to print beside a plotted point (sizes of 1 left out)."""
        d = _short(self.decode.config)
        if self.mode == "agg":
            d = f"{d} c{self.chunk}"
            return d if self.decode_workers == 1 else f"{d} x{self.decode_workers}"
        return f"{self.prefill_workers}P {_short(self.prefill.config)} + {self.decode_workers}D {d}"


def _short(config: Config) -> str:
    p = config.parallel
    sizes = [f"{name}{n}" for name, n in (("tp", p.tp), ("dp", p.dp), ("ep", p.ep)) if n > 1]
    return " ".join([*sizes, f"b{config.batch}"])


def follows_requests(op: Op) -> bool:
    """Whether a kernel's work follows the step's requests rather than its rows: attention (over each
    request's own context), the logits (a row per decoding request, one per finished prompt) and the
    MTP drafts (decoding requests only). Every other kernel (projections, experts, their
    communication, norms) runs once over all the rows the step feeds, whichever request they are.
    The markers are the names ``rank_model`` records for every model (``lm_head``, ``...(logits)``,
    the ``mtp`` scope)."""
    return (
        op.kind == "attention" or op.module == "lm_head" or op.name.endswith("(logits)") or op.scope == "mtp"
    )


def rows_and_requests(kernels: Iterable[Priced]) -> tuple[float, float]:
    """A step's time split into its row kernels and its per-request kernels (``follows_requests``).

    A kernel that carries a whole measured module (``cost.fold_modules``: vLLM's MLA decode) splits
    too: the module's floor (its projections, norms, launches) is row work, the rest per request; so a
    mixed step does not count the decode rows' projections twice (once in the module, once in the
    rows step, which prices them on their own)."""
    rows = requests = 0.0
    for k in kernels:
        if follows_requests(k.op):
            module = k.module_time * k.op.repeat
            requests += k.total - module
            rows += module
        else:
            rows += k.total
    return rows, requests


def prompt_attention(kernels: Iterable[Priced]) -> float:
    """The attention time of a prefill step (its ``attention`` kernels)."""
    return sum(k.total for k in kernels if k.op.kind == "attention")


def mixed_step(
    rows_step: Iterable[Priced], decode_step: Iterable[Priced], attention: float, share: float
) -> float:
    """One forward pass carrying a DP group's decode batch and a chunk of prompt tokens, priced as one
    pass (the weights read once for both): the row kernels of ``rows_step``, a prefill-path step over
    all the pass's rows (decode tokens plus the chunk: frameworks run a pass holding prompt tokens on
    their prefill path, e.g. its all-to-all mode), the decode batch's per-request kernels
    (``decode_step``), and the chunk's ``share`` (chunk / ISL) of one whole prompt's ``attention``
    (causal attention over a prompt does the same work in chunks as in one step)."""
    return rows_and_requests(rows_step)[0] + rows_and_requests(decode_step)[1] + attention * share


def aggregated(
    decode: Point,
    prefill: Point,
    t_mix: float,
    chunk: int,
    memory: Memory,
    workload: Workload,
    mtp_tokens: float,
    devices: int,
) -> Candidate:
    """One worker serving both phases with chunked prefill (see the module docstring), replicated
    over the devices. Per DP group, ``r`` requests finish per cycle: ``n`` decode steps each, their
    ``r x ISL`` prompt tokens carried by ``m = r x ISL / chunk`` of the steps (mixed, ``t_mix``); a
    request's decode steps hold the other ``r - 1`` requests' chunks, never its own."""
    par, batch = decode.config.parallel, decode.config.batch
    n = (workload.osl - 1) / mtp_tokens  # decode steps per request
    per_prompt = workload.isl / chunk  # mixed steps one prompt's tokens take
    m = batch / par.dp * per_prompt  # mixed steps per cycle
    t_dec = decode.step_time
    cycle = m * t_mix + max(n - m, 0) * t_dec
    seen = min(max(m - per_prompt, 0), n)  # mixed steps among a request's n decode steps
    tpot = (seen * t_mix + (n - seen) * t_dec) / n / mtp_tokens
    ttft = math.ceil(per_prompt) * t_mix + cycle / max(n, m) / 2
    replicas = devices // par.devices
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
        chunk,
        t_mix,
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
    steps_priced: int = 0  # prefill, decode and mixed (chunked-prefill) steps priced
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
        # an aggregated worker's mixed steps: their row kernels, one-token queries on the prefill path
        self.rows_base = replace(self.prefill_base, query_len=1)
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
                ks = [1]  # an aggregated worker's prompt attention: one whole prompt per DP group
            prefill_configs = [Config(par, k * par.dp, q) for par, q in fitting for k in ks]
            decode_configs = [
                Config(par, b, q) for par, q in fitting for b in self.batches if b % par.dp == 0
            ]
            prefill = self._sweep(self.prefill_base, workers, [c.batch for c in prefill_configs], None)
            points: dict[str, list[Point]] = {}
            for phase, sweep, configs in (
                ("prefill", prefill, prefill_configs),
                ("decode", decode, decode_configs),
            ):
                priced = sweep.run(configs)
                points[phase] = priced.points
                result.steps_priced += len(priced.points)
                for family, why in priced.fallbacks.items():
                    result.fallbacks[f"{phase} on {workers} devices, {family}"] = why
            sweeps = [prefill, decode]
            if "agg" in self.modes:
                chunks = self._chunks(pars)
                rows_configs = [
                    self._rows_config(c, chunk)
                    for c in decode_configs
                    for chunk in chunks[(c.parallel, c.batch)]
                ]
                rows = self._sweep(self.rows_base, workers, [c.batch for c in rows_configs], None)
                rows.run(rows_configs)  # traced and priced here; ``_aggregated`` reads the kernels
                sweeps.append(rows)
                found = self._aggregated(decode, prefill, rows, points["decode"], points["prefill"], chunks)
                result.candidates += found
                result.steps_priced += len(found)  # one mixed step each
            for sweep in sweeps:
                result.traces += sweep.traces
                result.trace_seconds += sweep.trace_seconds
            prefill_points += points["prefill"]
            decode_points += points["decode"]
            result.worker_sizes[workers] = f"{len(fitting)} layouts x weight modes searched"
        if "disagg" in self.modes:
            result.candidates += self._disaggregated(decode_points, prefill_points)
        return result

    def _chunks(self, pars: Sequence[Parallel]) -> dict[tuple[Parallel, int], list[int]]:
        """Per layout and decode batch, the prompt chunks its mixed steps are tried with: the
        framework's step budgets, less the decode rows when they count, at most a cycle's prompt
        tokens."""
        tpq, w = self.decode_base.tokens_per_query, self.workload
        return {
            (par, b): self.framework.step_tokens.chunks(b // par.dp * tpq, b // par.dp * w.isl)
            for par in pars
            for b in self.batches
            if b % par.dp == 0
        }

    def _rows_config(self, decode: Config, chunk: int) -> Config:
        """The prefill-path step whose rows are a mixed step's: per DP group, the decode batch's tokens
        plus the chunk, as one-token queries."""
        par = decode.parallel
        return replace(
            decode, batch=(decode.batch // par.dp * self.decode_base.tokens_per_query + chunk) * par.dp
        )

    def _aggregated(
        self,
        decode: Sweep,
        prefill: Sweep,
        rows: Sweep,
        decode_points: list[Point],
        prefill_points: list[Point],
        chunks: Mapping[tuple[Parallel, int], list[int]],
    ) -> list[Candidate]:
        """Every decode point of one worker size with every chunk it is tried with, its mixed step
        priced from the three sweeps' kernels (``mixed_step``), each already priced by its ``run``."""
        w, tpq = self.workload, self.decode_base.tokens_per_query
        one_prompt = {
            (p.config.parallel, p.config.quant): p
            for p in prefill_points
            if p.config.batch == p.config.parallel.dp
        }
        found = []
        for d in decode_points:
            par, quant = d.config.parallel, d.config.quant
            p = one_prompt.get((par, quant))
            if p is None:
                continue
            decode_step = decode.kernels(d.config)
            attention = prompt_attention(prefill.kernels(p.config))
            decode_rows = d.config.batch // par.dp * tpq
            for chunk in chunks[(par, d.config.batch)]:
                rows_step = rows.kernels(self._rows_config(d.config, chunk))
                t_mix = mixed_step(rows_step, decode_step, attention, chunk / w.isl)
                peak = activation_bytes(self.s, par, decode_rows + chunk, decode_rows)
                memory = replace(d.memory, activations=max(d.memory.activations, peak))
                found.append(aggregated(d, p, t_mix, chunk, memory, w, self.mtp_tokens, self.devices))
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
