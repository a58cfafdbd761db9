"""Whole requests priced from step kernels: the workload, and one deployment's TTFT, TPOT and rate.

A request is an ISL-token prompt (prefill) and OSL output tokens (decode). Each candidate deployment
is priced from the step sweep's kernels in one of two serving modes, the aggregated one under the
framework's prompt-step policy (``frameworks.yaml`` ``prompt_steps``):

- **aggregated** (chunked prefill, as TensorRT-LLM and vLLM schedule by default): one pool
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
  ``TTFT = ceil(ISL / c) x t_mix + half a mean step`` (waiting for the step in flight), or, prefill-bound
  (``m > n``), ``(m - n) x t_mix + half a step`` when longer: a request lives one cycle, ``n`` steps of it
  decoding, so its prompt waits for the chunks of the prompts ahead of it. Attention-DP
  groups step in lockstep (the experts run on every group's rows each step), so with ``dp`` groups
  every group's chunks stall every group: ``dp x m`` chunks per cycle, each in a pass of its own
  priced with one group's chunk on the experts while the cycle has steps enough (``aggregated``). The prompts
  being prefilled (about ``c / ISL + 1`` per group) come on top of the ``r`` decoding requests and
  their KV cache is not counted.
- **aggregated, prompt steps apart** (SGLang's default, ``frameworks.yaml`` ``prompt_steps``): a
  waiting prompt runs in a step of its own before decoding resumes, launched eagerly where the
  framework replays only decode steps as CUDA graphs. A finished request is replaced at once (the
  clients' closed loop), so prompts arrive at the decode steps where requests finish: the ``r`` of a
  cycle land on ``n`` steps, and those landing on the same step are prefilled together
  (``prompt_batches``: uniformly over the steps, a batch in steps of at most the budget). A cycle is
  ``P`` prompt steps of ``T`` tokens and ``n`` decode steps; a request's TPOT holds the other
  requests' prompt steps, its TTFT its own batch's. With attention-DP groups in lockstep, each group's
  prompt steps are passes every other group decodes in, at the prompt pass's pace, and passes where
  several groups prefill at once are priced toward all of them prefilling (``prefill_first``).
  SGLang prefills a batch without CUDA graphs: every kernel of a prompt step (and of a disaggregated
  prefill worker's step) takes at least the host's time to launch it (``estimate/eager.py``).
- **disaggregated** (xPyD): ``x`` prefill workers and ``y`` decode workers, each pool with its own
  layout. A prefill worker runs ``k`` requests per DP group per step (``TTFT = t_prefill(k)``; the
  fastest option meeting the TTFT target per worker size), a decode worker ``batch`` requests
  (``TPOT = t_decode / (1 + mtp x acceptance)``); ``x`` and ``y`` are sized so that ``x`` prefill
  and ``y`` decode workers fit in the devices and the slower pool sets the request rate as high as it
  goes: ``min(x x prefill rate, y x decode rate)``. The KV-cache transfer between pools is not priced.

Beyond a prefill-bound worker's wait (above), queueing is not modelled in either mode: TTFT is that of
a lightly loaded server (``concurrency`` adds the wait of requests the KV cache cannot hold beside the
ones in flight). AIConfigurator
0.12 multiplies its aggregated TTFT by ``min(2 + (steps to prefill the batch - 3) / 20, 4)``
(TensorRT-LLM and SGLang; vLLM: ``1 + log2(b) / 8``, calibrated), which its source calls a legacy
heuristic; it also leaves 3 mixed steps out of TensorRT-LLM's and SGLang's TPOT (an empirical
"pipeline drain" correction) and prefills whole prompts per step unless asked to chunk. None of
these is applied here.

tokens/s per device = request rate x OSL / devices used; tokens/s per user = 1 / TPOT.

Separate from ``serving``, which enumerates the workers and layouts to try and keeps the result:
this module is the serving-mode arithmetic for one decode (and prefill) worker.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from ....errors import UsageError
from ..estimate.cost import Priced
from ..estimate.planner import Memory
from ..model.tracer import Op
from .grid import Config, Point


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
        if max_positions and self.isl + self.osl > max_positions:  # 0: the config states none
            raise UsageError(
                f"--isl {self.isl} + --osl {self.osl} exceeds the model's max_position_embeddings "
                f"{max_positions}"
            )

    def meets(self, ttft: float, tpot: float) -> bool:
        return (self.ttft is None or ttft <= self.ttft) and (self.tpot is None or tpot <= self.tpot)


# --- one priced deployment ----------------------------------------------------------------------
class PromptLaunch(Enum):
    """How a framework launches an aggregated worker's steps carrying prompt tokens."""

    GRAPHED = "graphed"
    EAGER = "eager"
    # attention DP: replayed only in a pass in which every DP group carries prompt tokens
    EVERY_GROUP_GRAPHED = "graphed when every DP group carries prompt tokens"

    @property
    def aside(self) -> str:
        """What a report adds after the prompt step's time (nothing for a replayed one)."""
        if self is PromptLaunch.GRAPHED:
            return ""
        return " (launched eagerly)" if self is PromptLaunch.EAGER else f" ({self.value}, else eager)"


GRAPHED, EAGER, EVERY_GROUP_GRAPHED = (
    PromptLaunch.GRAPHED,
    PromptLaunch.EAGER,
    PromptLaunch.EVERY_GROUP_GRAPHED,
)


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
    chunk: int = 0  # agg: prompt tokens per DP group a mixed (``apart``: prompt) step carries
    mixed_step_time: float = 0.0  # agg: seconds of a mixed (prompt) step: the longest gap between tokens
    # ``--concurrency``: requests the clients keep open beyond what the KV cache holds, waiting (in ttft)
    queued: int = 0
    # ``--concurrency`` not a multiple of the DP groups: request slots of the even split left empty
    idle: int = 0
    # agg: prompt tokens run in steps of their own before decoding resumes (``prefill_first``)
    apart: bool = False
    # agg: how the framework launches a step carrying prompt tokens (disaggregated: None)
    prompt_launch: PromptLaunch | None = None

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
            return f"{d.layout}{replicas} b{d.batch} {'prompt' if self.apart else 'chunk'} {self.chunk}"
        p = self.prefill.config
        return (
            f"{self.prefill_workers}P({p.layout} b{p.batch}) + {self.decode_workers}D({d.layout} b{d.batch})"
        )

    @property
    def tag(self) -> str:
        """The layout, short enough to print beside a plotted point (sizes of 1 left out)."""
        d = _short(self.decode.config)
        if self.mode == "agg":
            d = f"{d} {'p' if self.apart else 'c'}{self.chunk}"
            return d if self.decode_workers == 1 else f"{d} x{self.decode_workers}"
        return f"{self.prefill_workers}P {_short(self.prefill.config)} + {self.decode_workers}D {d}"


def _short(config: Config) -> str:
    p = config.parallel
    layout = (("tp", p.tp), ("dp", p.dp), ("ep", p.ep), ("moe_tp", p.moe_tp))
    sizes = [f"{name}{n}" for name, n in layout if n > 1]
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


def prompt_attention(kernels: Iterable[Priced], share: float = 1.0, host: float = 0.0) -> float:
    """The attention time of a prefill step (its ``attention`` kernels), or of ``share`` of its work
    in one step (a chunk of the prompt, or several prompts) launched with ``host`` seconds per kernel:
    each layer's kernel runs once per step whatever the share, so the launch floor is paid once."""
    return sum(max(k.time * share, host) * k.op.repeat for k in kernels if k.op.kind == "attention")


def moe_group_kernel(op: Op) -> bool:
    """Whether a kernel runs on the MoE group's rows, every DP group's together, rather than on one
    DP group's own: the routed experts and their dispatch and combine (all-to-all, or expert TP's
    all-gather and reduce-scatter across the groups)."""
    return op.kind == "experts" or op.name.startswith(("ep_dispatch", "ep_combine"))


def mixed_step(
    rows_step: Iterable[Priced],
    decode_step: Iterable[Priced],
    attention: float,
    share: float,
    moe_rows_step: Iterable[Priced] | None = None,
) -> float:
    """One forward pass carrying a DP group's decode batch and a chunk of prompt tokens, priced as one
    pass (the weights read once for both): the row kernels of ``rows_step``, a prefill-path step over
    all the pass's rows (decode tokens plus the chunk: frameworks run a pass holding prompt tokens on
    their prefill path, e.g. its all-to-all mode), the decode batch's per-request kernels
    (``decode_step``), and the chunk's ``share`` (chunk / ISL) of one whole prompt's ``attention``
    (causal attention over a prompt does the same work in chunks as in one step). With
    ``moe_rows_step`` the MoE group's kernels (``moe_group_kernel``) are that step's instead: a pass in
    which one DP group carries the chunk, whose experts see every group's decode rows and one chunk
    (``rows_step`` then prices what the chunk's own group runs)."""
    rows_step = list(rows_step)
    if moe_rows_step is not None:
        own = [k for k in rows_step if not moe_group_kernel(k.op)]
        rows_step = own + [k for k in moe_rows_step if moe_group_kernel(k.op)]
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
    t_one: float | None = None,
) -> Candidate:
    """One worker serving both phases with chunked prefill (see the module docstring), replicated
    over the devices. Per DP group, ``r`` requests finish per cycle: ``n`` decode steps each, their
    ``r x ISL`` prompt tokens carried by ``m = r x ISL / chunk`` of the steps (mixed, ``t_mix``); a
    request's decode steps hold the other requests' chunks, never its own.

    Attention-DP groups step in lockstep (the experts run on every group's rows each step; a group
    without work runs an idle batch), so every group's chunks stall every group: a cycle's ``dp x m``
    chunks each take a step of their own at ``t_one`` (a pass in which one group carries a chunk; all
    groups' chunks at once: ``t_mix``) while there are steps enough, and share the cycle's steps
    beyond (a step carrying ``k`` groups' chunks priced between the two, linearly in ``k``)."""
    par, batch = decode.config.parallel, decode.config.batch
    n = (workload.osl - 1) / mtp_tokens  # decode steps per request
    per_prompt = workload.isl / chunk  # mixed steps one prompt's tokens take
    m = batch / par.dp * per_prompt  # one group's mixed steps per cycle
    steps = max(n, m)  # steps per cycle
    mixed = min(par.dp * m, steps)  # steps carrying a chunk of some group
    t_step = t_mix
    if par.dp > 1:
        groups = par.dp * m / mixed  # groups carrying a chunk in such a step
        t_step = (t_mix if t_one is None else t_one) * (par.dp - groups) / (par.dp - 1)
        t_step += t_mix * (groups - 1) / (par.dp - 1)
    t_dec = decode.step_time
    cycle = mixed * t_step + (steps - mixed) * t_dec
    seen = min(max(mixed - per_prompt, 0), n)  # mixed steps among a request's n decode steps
    tpot = (seen * t_step + (n - seen) * t_dec) / n / mtp_tokens
    # prefill-bound (m > n): every step is mixed and a request lives one cycle of m steps, n of them
    # decoding, so its prompt waits m - n steps for its first token (the r requests in flight cannot
    # all be prefilling at once); ceil(ISL / c) alone put TTFT + (OSL - 1) x TPOT far below the cycle
    ttft = max(math.ceil(per_prompt), steps - n) * t_step + cycle / steps / 2
    return _one_pool(decode, prefill, devices, workload, memory, ttft, tpot, cycle, chunk, t_step)


def _one_pool(
    decode: Point,
    prefill: Point,
    devices: int,
    workload: Workload,
    memory: Memory,
    ttft: float,
    tpot: float,
    cycle: float,
    chunk: int,
    t_prompt: float,
    apart: bool = False,
) -> Candidate:
    """The aggregated candidate of a worker whose DP groups each finish ``batch / dp`` requests per
    ``cycle`` seconds, replicated over the devices."""
    replicas = devices // decode.config.parallel.devices
    return Candidate(
        "agg",
        decode,
        prefill,
        replicas,
        0,
        ttft,
        tpot,
        replicas * decode.config.batch / cycle,
        workload.osl,
        memory,
        workload.meets(ttft, tpot),
        chunk,
        t_prompt,
        apart=apart,
    )


def _binomial(trials: int, p: float) -> list[tuple[int, float]]:
    """``(k, P(k))`` of Binomial(trials, p) over the k that hold its mass (12 standard deviations about
    the mean), in logs so that large trials hold."""
    if trials == 0 or p >= 1:
        return [(trials if p >= 1 else 0, 1.0)]
    mean, spread = trials * p, 12 * math.sqrt(trials * p * (1 - p)) + 10
    lo, hi = max(0, math.floor(mean - spread)), min(trials, math.ceil(mean + spread))
    head = math.lgamma(trials + 1)
    return [
        (
            k,
            math.exp(
                head
                - math.lgamma(k + 1)
                - math.lgamma(trials - k + 1)
                + k * math.log(p)
                + (trials - k) * math.log1p(-p)
            ),
        )
        for k in range(lo, hi + 1)
    ]


def prompt_batches(requests: int, steps: float, isl: int, budget: int) -> tuple[float, float, int]:
    """A framework that runs waiting prompts in steps of their own (prefill first): a DP group's
    ``requests`` each arrive once a cycle, at one of its ``steps`` decode steps (where a request
    finishes: spread uniformly), and those arriving at one step are prefilled together, a batch of
    ``k`` prompts in ``ceil(k x ISL / budget)`` steps. Seen from one request: its own batch holds it
    and Binomial(requests - 1, 1 / steps) others; each other decode step brings Binomial(requests - 1,
    1 / steps) of the others. Returns the prompt steps of a request's cycle, those of its own batch
    (in its TTFT; the rest are in its TPOT) and the mean prompt tokens of one step."""
    slots = max(steps, 1.0)  # below one decode step per request every prompt lands on the same one

    def steps_of(prompts: int) -> int:
        return math.ceil(prompts * isl / budget)

    others = _binomial(requests - 1, 1 / slots)
    own = sum(p * steps_of(1 + k) for k, p in others)
    elsewhere = (slots - 1) * sum(p * steps_of(k) for k, p in others)
    total = own + elsewhere
    return total, own, min(budget, math.ceil(requests * isl / total))


def prefill_first(
    decode: Point,
    prefill: Point,
    t_one: float,
    t_all: float,
    budget: int,
    memory: Memory,
    workload: Workload,
    mtp_tokens: float,
    devices: int,
) -> Candidate:
    """One worker serving both phases with prompt steps apart (see the module docstring), replicated
    over the devices. Per DP group, ``r`` requests finish per cycle of ``n`` decode steps each; their
    prompts take ``P`` steps a cycle (``prompt_batches``), ``s`` of them a request's own batch's (in
    its TTFT) and the others in its TPOT. With ``dp`` attention-DP groups in lockstep every pass in
    which some group prefills stalls the others' decoding: a group's cycle is its ``P`` prompt passes,
    the ``min((dp - 1) x P, n)`` passes in which only other groups prefill (it decodes in them) and its
    other decode steps. The ``dp x P`` group prompt steps share ``min(dp x P, P + n)`` passes, each
    priced between one group prefilling (``t_one``) and all of them (``t_all``), linearly in the groups
    per pass."""
    par, batch = decode.config.parallel, decode.config.batch
    n = (workload.osl - 1) / mtp_tokens  # decode steps per request
    steps, own, tokens = prompt_batches(batch // par.dp, n, workload.isl, budget)
    passes = min(par.dp * steps, steps + n)  # passes in which some group prefills
    t_prompt = t_all
    if par.dp > 1:
        groups = par.dp * steps / passes  # groups prefilling in such a pass
        t_prompt = t_one + (t_all - t_one) * (groups - 1) / (par.dp - 1)
    slow = passes - steps  # this group's decode steps in another group's prompt pass
    t_dec = decode.step_time
    cycle = (steps + slow) * t_prompt + (n - slow) * t_dec
    tpot = ((steps - own + slow) * t_prompt + (n - slow) * t_dec) / n / mtp_tokens
    ttft = own * t_prompt + cycle / (steps + n) / 2  # its batch's steps, half a mean step's wait
    return _one_pool(decode, prefill, devices, workload, memory, ttft, tpot, cycle, tokens, t_prompt, True)


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
