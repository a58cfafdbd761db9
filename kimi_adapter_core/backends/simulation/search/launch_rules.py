"""Serving frameworks: which parallel layouts each can launch, and its per-step token budget.

``frameworks.yaml`` (next to this module) holds, per framework (TensorRT-LLM, SGLang, vLLM), the
rules refusing layouts it cannot launch, each with its documented source, and the cap on the tokens
one forward step carries per DP group (``step_tokens``). ``framework`` reads it once, checked: a typo
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
    """The framework's cap on the tokens one forward step carries per DP group (its default; smaller
    budgets are a launch option), and whether the decode rows count against it."""

    max: int
    counts_decode: bool
    source: str

    def chunks(self, decode_rows: int, most: int, budgets: tuple[int, ...] = STEP_BUDGETS) -> list[int]:
        """Prompt tokens a mixed step carries beside ``decode_rows`` decode tokens, one per budget
        tried (``budgets`` up to the cap; ``(max,)``: the framework's default alone), at most ``most``
        (the prompt tokens a cycle brings: a step cannot carry more than are waiting); a budget the
        decode rows already fill carries no prompt and is left out."""
        found = []
        for budget in (b for b in budgets if b <= self.max):
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
