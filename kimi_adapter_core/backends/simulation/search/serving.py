"""Request-level search: ``kadapt simulate --sweep --isl N --osl M [--ttft MS --tpot MS]``.

A step-level sweep prices one decode (or prefill) step per layout. A deployment is chosen for
requests: an ISL-token prompt (prefill) and OSL output tokens (decode), against a time-to-first-token
(TTFT) and a time-per-output-token (TPOT) target. This module searches whole requests priced from
the step sweep's kernels in two serving modes (``request_pricing`` has the arithmetic of each):
**aggregated** (one pool of workers serves both phases: chunked prefill, or SGLang's prompt steps
apart from decoding) and **disaggregated**
(xPyD: a prefill and a decode pool, each with its own layout).

A layout is searched only when the serving framework can launch it (``launch_rules``, from
``frameworks.yaml``: each rule with its documented source), and only in weight modes whose weights
fit. Decode is priced at the mean context ``ISL + OSL / 2`` (attention is linear in the context, so
the mean step is the mean over a request), with the KV cache sized for the last token
(``ISL + OSL``); an aggregated worker must also hold a mixed step's activations.

Every step is priced by ``sweep.Sweep`` (a few traces per TP size and phase, the per-rank models
shared between phases and worker sizes; a mixed step's rows are a third sweep's), so thousands of
request configurations cost a few dozen traces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ....errors import UsageError
from ....spec.model import Spec
from ..estimate.cost import Priced
from ..estimate.eager import HOST_US, eager_step
from ..estimate.planner import activation_bytes
from ..model.deployment import Deployment
from ..model.inputs import ModelInputs
from ..model.parallel import Parallel
from ..model.rank_model import RankModel
from ..tables.device import Device
from .grid import Config, Point, divisors, layouts
from .launch_rules import Framework, framework
from .pareto import pareto_front
from .pareto_plot import PlotPoint
from .request_pricing import (
    EAGER,
    EVERY_GROUP_GRAPHED,
    GRAPHED,
    Candidate,
    Workload,
    aggregated,
    disaggregated,
    mixed_step,
    prefill_first,
    prompt_attention,
    prompt_batches,
)
from .sweep import Pricer, Sweep

MODES = ("agg", "disagg")
DEFAULT_PREFILL_BATCHES = (1, 2, 4, 8)  # requests per DP group in one disaggregated prefill step
MAX_PREFILL_TOKENS = 16384  # per DP group and step: larger prefill batches are not tried (but k = 1)
# concurrent requests per worker: a 1-1.5-2 grid (powers of two alone skip most batches that just
# meet a TPOT target)
REQUEST_BATCHES = tuple(sorted({2**e for e in range(11)} | {3 * 2**e for e in range(10)}))  # 1, 2, 3, 4, 6 ..


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
        layout: Parallel | None = None,
        budgets: tuple[int, ...] | None = None,
        framework_version: str | None = None,
    ) -> None:
        if devices < 1:
            raise UsageError(f"--devices must be >= 1 (got {devices})")
        self.spec, self.inputs, self.device, self.devices = spec, dict(inputs), device, devices
        self.s = next(iter(self.inputs.values())).arch.structure
        workload.check(self.s.max_positions)
        unknown = set(modes) - set(MODES)
        if unknown or not modes:
            raise UsageError(f"serving modes must be among {', '.join(MODES)} (got {', '.join(modes)})")
        # the framework's facts as of ``framework_version`` (None: the newest release read)
        self.framework = framework(framework_name, framework_version)
        self.workload, self.modes = workload, tuple(modes)
        self.batches = tuple(sorted(set(batches))) if batches else REQUEST_BATCHES
        self.prefill_batches = tuple(sorted(set(prefill_batches)))
        self.pricer = pricer
        # ``layout``: search that one layout only (``kadapt simulate --concurrency``); ``budgets``: the
        # aggregated step budgets per DP group tried (default: ``STEP_BUDGETS`` up to the framework's
        # cap on the device, shared by the DP groups where it divides them)
        self.layout, self.budgets = layout, budgets
        self.decode_base = replace(
            base, query_len=1, context_len=workload.isl + workload.osl // 2, decode=True, batch=1
        )
        # prompt steps apart from decoding (``prompt_steps.mixed`` false), and the host time per launch of
        # a step carrying prompt tokens (a prefill worker's, an aggregated worker's prompt step) where the
        # framework launches it eagerly (``_prompt_host``): applied to the kernels as priced, after
        # ``prompt_attention`` scales the attention to a step
        self.apart = not self.framework.prompt_steps.mixed
        self.eager_host = max(base.eager_host, HOST_US * 1e-6)
        self.architectures = next(iter(self.inputs.values())).arch.architectures
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
            framework=self.framework.name,
        )

    def _prompt_host(
        self, tokens: int, budget: int, par: Parallel, every_group: bool = True, disaggregated: bool = False
    ) -> float:
        """The host time per launch of a pass of worker ``par`` carrying ``tokens`` prompt tokens per DP
        group at a step budget of ``budget`` per group: 0 where the framework replays it as a CUDA graph
        (``prompt_steps``; ``every_group``: every DP group carries prompt tokens in it;
        ``disaggregated``: a disaggregated prefill worker's)."""
        replayed = self.framework.prompt_steps.replayed(
            tokens,
            budget,
            mla=self.s.attention.is_mla,
            every_group=every_group,
            architectures=self.architectures,
            device=self.device.name,
            dp=par.dp,
            disaggregated=disaggregated,
        )
        return 0.0 if replayed else self.eager_host

    def _server_budget(self, par: Parallel) -> int:
        """Per DP group, the step budget the server runs with: the largest tried (``--step-tokens``), else
        the framework's default on the device."""
        if self.budgets:
            return max(self.budgets)
        return self.framework.step_tokens.default(self.device.memory_bytes, par.dp, self.device.name)

    def _weights_fit(self, sweep: Sweep, par: Parallel, quant: str | None) -> bool:
        return sweep.memory(Config(par, par.dp, quant)).weights <= (self.device.memory_bytes or math.inf)

    def run(self) -> ServingResult:
        w = self.workload
        result = ServingResult(self.devices, w, self.framework, self.modes)
        decode_points: list[Point] = []
        prefill_points: list[Point] = []
        for workers in divisors(self.devices):
            if self.layout is not None and workers != self.layout.devices:
                continue
            try:
                candidates = layouts(self.s, workers)
            except UsageError:
                result.worker_sizes[workers] = "no layout divides the model's heads and widths"
                continue
            if self.layout is not None:
                # the one layout asked for, expert TP included (the grid enumerates EP layouts)
                asked = self.layout
                candidates = [asked for par in candidates if replace(par, moe_tp=asked.moe_tp) == asked]
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
                if phase == "prefill":
                    points[phase] = [self._launched_eagerly(p, sweep) for p in priced.points]
                result.steps_priced += len(priced.points)
                for family, why in priced.fallbacks.items():
                    result.fallbacks[f"{phase} on {workers} devices, {family}"] = why
            sweeps = [prefill, decode]
            if "agg" in self.modes:
                chunks = self._chunks(pars)
                rows_configs = [
                    config
                    for c in decode_configs
                    for chunk in chunks[(c.parallel, c.batch)]
                    for config in self._mixed_rows(c, chunk)
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
        """Per layout and decode batch, the prompt chunks its mixed steps (or the budgets its prompt
        steps) are tried with: the framework's step budgets per DP group, less the decode rows when
        they count, at most a cycle's prompt tokens."""
        tpq, w, step = self.decode_base.tokens_per_query, self.workload, self.framework.step_tokens
        chunks = {
            (par, b): step.chunks(
                b // par.dp * tpq,
                b // par.dp * w.isl,
                self.budgets or step.budgets(self.device.memory_bytes, par.dp, self.device.name),
            )
            for par in pars
            for b in self.batches
            if b % par.dp == 0
        }
        if self.apart:
            # budgets above what most prompt batches bring give the same prompt steps (their mean
            # tokens): one candidate each, at the largest such budget
            for (par, b), budgets in chunks.items():
                seen = {self._prompt_tokens(Config(par, b, None), budget)[2]: budget for budget in budgets}
                chunks[(par, b)] = sorted(seen.values())
        return chunks

    def _prompt_tokens(self, decode: Config, budget: int) -> tuple[float, float, int]:
        """``prompt_batches`` of a worker running ``decode``'s batch with prompt steps apart."""
        n = (self.workload.osl - 1) / self.mtp_tokens
        return prompt_batches(decode.batch // decode.parallel.dp, n, self.workload.isl, budget)

    def _launched_eagerly(self, p: Point, sweep: Sweep) -> Point:
        """Prefill point ``p`` as the framework launches a prompt step: where it launches it eagerly
        (``_prompt_host``), each kernel at least the host's time per launch, the step longer by what the
        floors add."""
        par = p.config.parallel
        tokens = p.config.batch // par.dp * self.workload.isl
        host = self._prompt_host(tokens, self._server_budget(par), par, disaggregated=True)
        if not host:
            return p
        kernels = sweep.kernels(p.config)
        added = sum(k.total for k in eager_step(kernels, host)) - sum(k.total for k in kernels)
        slower = p.step_time / (p.step_time + added)
        return replace(
            p,
            step_time=p.step_time + added,
            tokens_per_s_per_device=p.tokens_per_s_per_device * slower,
            tokens_per_s_per_user=p.tokens_per_s_per_user * slower,
        )

    def _mixed_rows(self, decode: Config, chunk: int) -> list[Config]:
        """The rows steps a pass carrying prompt tokens is priced from: the decode rows plus the chunk
        per DP group (prompt steps apart: the prompt step's tokens alone), and under attention DP the
        step putting one group's prompt tokens on the MoE group's rows (``_one_group_share``; prompt
        steps apart: beside the other groups' decode rows only, the prefilling group decodes none)."""
        par = decode.parallel
        if not self.apart:
            own = self._rows_config(decode, chunk)
            one = self._rows_config(decode, self._one_group_share(par, chunk))
            return [own, one] if par.dp > 1 else [own]
        tokens = self._prompt_tokens(decode, chunk)[2]
        own = replace(decode, batch=tokens * par.dp)
        if par.dp == 1:
            return [own]
        others = (par.dp - 1) * (decode.batch // par.dp) * self.decode_base.tokens_per_query
        return [own, replace(decode, batch=-(-(others + tokens) // par.dp) * par.dp)]

    @staticmethod
    def _one_group_share(par: Parallel, chunk: int) -> int:
        """Prompt tokens per DP group that put one group's ``chunk`` on the MoE group's rows: the
        rows step whose experts price a pass in which one group carries the chunk (``mixed_step``)."""
        return -(-chunk // par.dp)

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
            prompt = prefill.kernels(p.config)  # one whole prompt's step, each chunk's attention a share
            decode_kernels = decode.kernels(d.config)
            decode_rows = d.config.batch // par.dp * tpq
            budget = self._server_budget(par)
            for chunk in chunks[(par, d.config.batch)]:
                if self.apart:
                    found.append(self._prefill_first(d, p, rows, prompt, chunk))
                    continue
                # a mixed pass launched as the framework launches a step carrying prompt tokens
                # (``_prompt_host``: where eager, every kernel of it at least the host's time)
                host = self._prompt_host(chunk, budget, par)
                decode_step = eager_step(decode_kernels, host)
                # the rows steps the sweep priced for this pass (``_mixed_rows``: the same configs)
                configs = self._mixed_rows(d.config, chunk)
                rows_step = eager_step(rows.kernels(configs[0]), host)
                attention = prompt_attention(prompt, chunk / w.isl, host)
                t_mix = mixed_step(rows_step, decode_step, attention, 1.0)
                t_one = t_mix  # one group: its chunk is every group's
                if par.dp > 1:
                    one_group = eager_step(rows.kernels(configs[1]), host)
                    t_one = mixed_step(rows_step, decode_step, attention, 1.0, one_group)
                peak = activation_bytes(self.s, par, decode_rows + chunk, decode_rows)
                memory = replace(d.memory, activations=max(d.memory.activations, peak))
                c = aggregated(d, p, t_mix, chunk, memory, w, self.mtp_tokens, self.devices, t_one)
                found.append(replace(c, prompt_launch=EAGER if host else GRAPHED))
        return found

    def _prefill_first(
        self, d: Point, p: Point, rows: Sweep, prompt: Sequence[Priced], budget: int
    ) -> Candidate:
        """The candidate of decode point ``d`` with prompt steps apart at ``budget`` tokens per step and
        DP group, each launched as the framework launches it (``_prompt_host``): a pass in which every
        group prefills its prompt step, and under attention DP one in which a single group does (the
        experts at its tokens and the other groups' decode rows). ``prompt``: the kernels of prefill
        point ``p``'s step (one whole prompt per DP group), whose attention a prompt step runs a share of."""
        par = d.config.parallel
        configs = self._mixed_rows(d.config, budget)
        tokens = self._prompt_tokens(d.config, budget)[2]
        # every group prefilling, then (attention DP) one group prefilling beside the others' decode rows
        host_all = self._prompt_host(tokens, budget, par)
        host_one = self._prompt_host(tokens, budget, par, par.dp == 1)
        share = tokens / self.workload.isl
        # the whole prompt's attention kernels, each layer's run once at the step's share of its work
        every = eager_step(rows.kernels(configs[0]), host_all)
        t_all = mixed_step(every, [], prompt_attention(prompt, share, host_all), 1.0)
        t_one = t_all
        if par.dp > 1:
            own = every if host_one == host_all else eager_step(rows.kernels(configs[0]), host_one)
            one = eager_step(rows.kernels(configs[1]), host_one)
            t_one = mixed_step(own, [], prompt_attention(prompt, share, host_one), 1.0, one)
        peak = activation_bytes(self.s, par, tokens, 1)
        memory = replace(d.memory, activations=max(d.memory.activations, peak))
        w = self.workload
        c = prefill_first(d, p, t_one, t_all, budget, memory, w, self.mtp_tokens, self.devices)
        launch = EAGER if host_all else (EVERY_GROUP_GRAPHED if host_one else GRAPHED)
        return replace(c, prompt_launch=launch)

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


def plot_points(
    result: ServingResult, label: Callable[[Candidate], str], weights: Callable[[str | None], str]
) -> list[PlotPoint]:
    """Every fitting candidate as a plot point: front points tagged with their layout, SLA misses hollow;
    one series per serving mode and weights (``weights`` names a weight mode)."""
    front = {id(c) for c in result.front}
    return [
        PlotPoint(
            c.tokens_per_s_per_user,
            c.tokens_per_s_per_device,
            f"{c.mode} {weights(c.quant)}",
            label(c),
            id(c) in front,
            c.tag if id(c) in front else "",
            c.meets_sla,
        )
        for c in result.candidates
        if c.fits
    ]
