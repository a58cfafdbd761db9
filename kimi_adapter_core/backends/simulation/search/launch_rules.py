"""Serving frameworks: which parallel layouts each can launch, its per-step token budget, and how it
runs prompt steps.

``frameworks.yaml`` (next to this module) holds, per framework (TensorRT-LLM, SGLang, vLLM), the
rules refusing layouts it cannot launch, each with its documented source, the cap on the tokens one
forward step carries per DP group (``step_tokens``) and whether prompt tokens share a step with the
decode rows and run as a CUDA graph (``prompt_steps``). ``framework`` reads it once, checked: a typo
in a variable or bound would silently refuse nothing.

Separate from ``serving`` because it is data about the frameworks, not search: the CLI lists the
rules (``describe_rules``) without running a search.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from ....errors import KadaptError, UsageError
from ..model.parallel import Parallel

FRAMEWORKS_FILE = Path(__file__).with_name("frameworks.yaml")
# tokens per step per DP group an aggregated worker is tried with, up to the framework's cap
STEP_BUDGETS = (512, 1024, 2048, 4096, 8192, 16384)
_VARIABLES = ("tp", "dp", "ep", "ep_groups", "devices")


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
    """The framework's cap on the tokens one forward step carries (its default; smaller budgets are a
    launch option), and whether the decode rows count against it. The cap is ``max`` unless the
    device's memory is below a ``by_memory`` bound (GiB, smallest first: the first bound above the
    device's memory sets it); with ``divided_over_dp`` it is the worker's, each DP group taking its
    share (else every DP group's own)."""

    max: int
    counts_decode: bool
    source: str
    by_memory: tuple[tuple[float, int], ...] = ()  # (below GiB, cap)
    divided_over_dp: bool = False

    def cap(self, memory_bytes: int | None) -> int:
        """The default budget of a worker on devices of ``memory_bytes`` (None: not stated, ``max``)."""
        if memory_bytes is not None:
            for below_gib, cap in self.by_memory:
                if memory_bytes < below_gib * 2**30:
                    return cap
        return self.max

    def default(self, memory_bytes: int | None, dp: int) -> int:
        """Per DP group, the budget a worker of ``dp`` groups runs without a budget flag."""
        return self.per_group(self.cap(memory_bytes), dp)

    def budgets(self, memory_bytes: int | None, dp: int) -> tuple[int, ...]:
        """Per DP group, the budgets the request sweep tries: ``STEP_BUDGETS`` up to the device's cap."""
        cap = self.cap(memory_bytes)
        return tuple(dict.fromkeys(self.per_group(b, dp) for b in STEP_BUDGETS if b <= cap))

    def per_group(self, budget: int, dp: int) -> int:
        """The budget each of ``dp`` DP groups runs of a worker launched with ``budget``."""
        return max(budget // dp, 1) if self.divided_over_dp else budget

    def chunks(self, decode_rows: int, most: int, budgets: tuple[int, ...]) -> list[int]:
        """Prompt tokens a mixed step carries beside ``decode_rows`` decode tokens, one per budget
        tried (per DP group: ``budgets``), at most ``most`` (the prompt tokens a cycle brings: a step
        cannot carry more than are waiting); a budget the decode rows already fill carries no prompt
        and is left out."""
        found = []
        for budget in budgets:
            chunk = min(budget - decode_rows if self.counts_decode else budget, most)
            if chunk > 0 and chunk not in found:
                found.append(chunk)
        return found


@dataclass(frozen=True)
class PromptSteps:
    """How a framework runs prompt tokens by default: beside the decode rows in one step (``mixed``,
    chunked prefill) or in steps of their own run before decoding whenever a prompt waits; and
    whether a step carrying prompt tokens is replayed as a CUDA graph (else launched eagerly,
    ``estimate/eager.py``)."""

    mixed: bool
    cuda_graphs: bool
    source: str


@dataclass(frozen=True)
class Framework:
    name: str
    title: str
    rules: tuple[Rule, ...]
    step_tokens: StepTokens
    prompt_steps: PromptSteps

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
        by_memory = tuple((float(b["below_gib"]), int(b["max"])) for b in step.get("by_memory", ()))
        if list(by_memory) != sorted(by_memory) or any(cap < 1 for _, cap in by_memory):
            where = f"{FRAMEWORKS_FILE.name}: {name}.step_tokens.by_memory"
            raise KadaptError(f"{where}: expected rising bounds and caps >= 1, found {by_memory}")
        tokens = StepTokens(
            step["max"],
            bool(step.get("counts_decode", True)),
            step["source"],
            by_memory,
            bool(step.get("divided_over_dp", False)),
        )
        prompt = entry.get("prompt_steps") or {}
        if {"mixed", "cuda_graphs", "source"} - set(prompt):
            where = f"{FRAMEWORKS_FILE.name}: {name}.prompt_steps"
            raise KadaptError(f"{where}: expected mixed, cuda_graphs and a source, found {sorted(prompt)}")
        steps = PromptSteps(bool(prompt["mixed"]), bool(prompt["cuda_graphs"]), prompt["source"])
        table[name] = Framework(name, entry["title"], tuple(rules), tokens, steps)
    return table


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
