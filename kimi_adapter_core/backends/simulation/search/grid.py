"""What a sweep covers and what it returns: layouts, weight modes and batches; priced points.

``layouts`` enumerates the TP x DP layouts of N devices the model accepts (EP too for MoE models),
``quant_modes`` the weight modes it prices (the checkpoint as shipped unless ``--quant`` asks for
others) and ``batch_grid`` the batches; a ``Config`` is one of each, a ``Point`` one priced, and a
``SweepResult`` all of them with what was skipped and why.

Separate from ``sweep`` (which traces and prices) so that the request-level search and the CLI name
configurations and read results without the pricing machinery.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ....errors import UsageError
from ....spec.model import Spec
from ....structure.model import ModelStructure
from ..estimate.planner import Memory
from ..model.inputs import ModelInputs, model_inputs
from ..model.parallel import Parallel
from ..model.quant import MODES
from ..model.rank_config import check_rank_shapes

DEFAULT_BATCHES = tuple(2**i for i in range(11))  # 1 .. 1024 concurrent queries
ALL, CHECKPOINT = "ALL", "CHECKPOINT"  # --quant names (any case) of every mode, and of the checkpoint


@dataclass(frozen=True)
class Config:
    parallel: Parallel
    batch: int  # global concurrent queries
    quant: str | None  # a --quant mode, or None for the checkpoint as shipped

    @property
    def quant_label(self) -> str:
        return self.quant or "checkpoint"

    @property
    def layout(self) -> str:
        p = self.parallel
        return f"TP{p.tp} DP{p.dp} EP{p.ep}" + (f" MoE-TP{p.moe_tp}" if p.moe_tp > 1 else "")


@dataclass(frozen=True)
class Point:
    """One priced configuration."""

    config: Config
    step_time: float  # seconds
    tokens_per_s_per_device: float
    tokens_per_s_per_user: float  # tokens one query gets per second (decode: its output speed)
    memory: Memory

    @property
    def fits(self) -> bool:
        return self.memory.free is None or self.memory.free >= 0


@dataclass
class SweepResult:
    devices: int
    layouts: tuple[Parallel, ...]
    quants: tuple[str | None, ...]
    batches: tuple[int, ...]
    points: list[Point] = field(default_factory=list)  # every priced configuration, fitting or not
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> configurations not priced
    traces: int = 0  # per-rank traces run (the expensive part)
    trace_seconds: float = 0.0  # time spent in them
    same_as: dict[str | None, str | None] = field(default_factory=dict)  # mode -> identical earlier one
    fallbacks: dict[str, str] = field(default_factory=dict)  # family -> why it was traced per config

    @property
    def configs(self) -> int:
        """Configurations enumerated: priced plus skipped."""
        return len(self.points) + sum(self.skipped.values())

    @property
    def fitting(self) -> list[Point]:
        return [p for p in self.points if p.fits]

    @property
    def dropped(self) -> list[Point]:
        """Configurations that do not fit in device memory."""
        return [p for p in self.points if not p.fits]

    @property
    def front(self) -> list[Point]:
        """Fitting points no other fitting point beats on both tokens/s per user and per device."""
        from .pareto import pareto_front

        return pareto_front(self.fitting, lambda p: (p.tokens_per_s_per_user, p.tokens_per_s_per_device))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(s: ModelStructure, devices: int) -> list[Parallel]:
    """Every TP x DP = ``devices`` layout the model accepts (``Parallel.check``); EP > 1 only for MoE
    models, over the divisors of ``devices`` that also divide the routed experts."""
    if devices < 1:
        raise UsageError(f"--devices must be >= 1 (got {devices})")
    moe = s.moe is not None and bool(s.moe_layer_ids)
    found = []
    for tp in divisors(devices):
        for ep in divisors(devices) if moe else [1]:
            par = Parallel(tp=tp, dp=devices // tp, ep=ep)
            try:
                par.check(s)
                check_rank_shapes(s, tp)  # a TP the per-rank trace cannot build is no layout to search
            except UsageError:
                continue
            found.append(par)
    if not found:
        raise UsageError(f"no TP x DP layout of {devices} devices divides this model's heads and widths")
    return found


def declared_modes(spec: Spec) -> tuple[str, ...]:
    """The modes the spec's ``quant_modes`` declares that kadapt prices, in its order."""
    declared = spec.backend_options("simulation").get("quant_modes") or []
    return tuple(dict.fromkeys(m.upper() for m in declared if m.upper() in MODES))


def quant_modes(spec: Spec, only: str | None = None) -> tuple[str | None, ...]:
    """The weight modes a sweep prices (None: the checkpoint as shipped).

    By default the checkpoint as shipped alone: a sweep free to pick any declared mode would report
    DeepSeek-V3 in W8A8 (265 tok/s/GPU on 16 H200) when its checkpoint is FP8 block (208.5), a choice
    nobody made. ``only`` asks otherwise: a comma-separated list of modes (``W8A8``, ``checkpoint``)
    or ``all``, the checkpoint plus every mode the spec declares that kadapt prices. A mode the spec
    does not declare is refused by ``model_inputs``."""
    if only is None:
        return (None,)
    modes: list[str | None] = []
    for part in only.split(","):
        name = part.strip().upper()
        if not name:
            continue
        if name == ALL:
            modes += [None, *declared_modes(spec)]
        else:
            modes.append(None if name == CHECKPOINT else name)
    if not modes:
        raise UsageError(f"--quant {only!r} names no weight mode")
    # the checkpoint first: a mode storing every weight as an earlier one is dropped (``Sweep.same_as``),
    # and a BF16 mode must be dropped for Llama's BF16 checkpoint, not the checkpoint for it
    return tuple(sorted(dict.fromkeys(modes), key=lambda mode: mode is not None))


def sweep_inputs(spec: Spec, quants: Sequence[str | None]) -> dict[str | None, ModelInputs]:
    """``model_inputs`` of each weight mode (torch-free, milliseconds each)."""
    return {quant: model_inputs(spec, quant) for quant in quants}


def batch_grid(batches: Sequence[int] | None) -> tuple[int, ...]:
    grid = tuple(sorted(set(batches))) if batches else DEFAULT_BATCHES
    if grid[0] < 1:
        raise UsageError(f"--batches must be >= 1 (got {grid[0]})")
    return grid
