"""Serving frameworks: which parallel layouts each can launch, its per-step token budget, and how it
runs prompt steps.

``frameworks.yaml`` (next to this module) holds, per framework (TensorRT-LLM, SGLang, vLLM), the
rules refusing layouts it cannot launch, each with its documented source, the cap on the tokens one
forward step carries per DP group (``step_tokens``) and whether prompt tokens share a step with the
decode rows and run as a CUDA graph (``prompt_steps``). ``framework`` reads it once, checked: a typo
in a variable or bound would silently refuse nothing.

Those facts move between releases (SGLang 0.4.3 halves its step budget under DP attention, 0.5.6
divides it by the DP size; vLLM before 0.8 ran the V0 engine, which launches a step carrying prompt
tokens eagerly). Each framework's facts are those of the newest release whose source was read
(``read``, ``versions``); ``releases`` holds older releases whose facts differ, each naming the
releases read. ``framework(name, version)`` (``--framework-version``) picks the entry covering a
release; a release no entry covers is priced with the newest facts read and a note saying so.

Separate from ``serving`` because it is data about the frameworks, not search: the CLI lists the
rules (``describe_rules``) without running a search.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

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
    # SGLang before 0.4.5: --enable-dp-attention halves the budget, every DP group running the half
    halved_over_dp: bool = False
    by_device: tuple[tuple[str, int], ...] = ()  # (device profile name, cap): ahead of the memory rule

    def cap(self, memory_bytes: int | None, device: str | None = None) -> int:
        """The default budget of a worker on devices of ``memory_bytes`` (None: not stated, ``max``)
        named ``device`` (a profile name a ``by_device`` entry may name)."""
        for name, cap in self.by_device:
            if device == name:
                return cap
        if memory_bytes is not None:
            for below_gib, cap in self.by_memory:
                if memory_bytes < below_gib * 2**30:
                    return cap
        return self.max

    def default(self, memory_bytes: int | None, dp: int, device: str | None = None) -> int:
        """Per DP group, the budget a worker of ``dp`` groups runs without a budget flag."""
        return self.per_group(self.cap(memory_bytes, device), dp)

    def budgets(self, memory_bytes: int | None, dp: int, device: str | None = None) -> tuple[int, ...]:
        """Per DP group, the budgets the request sweep tries: ``STEP_BUDGETS`` up to the device's cap."""
        cap = self.cap(memory_bytes, device)
        return tuple(dict.fromkeys(self.per_group(b, dp) for b in STEP_BUDGETS if b <= cap))

    def per_group(self, budget: int, dp: int) -> int:
        """The budget each of ``dp`` DP groups runs of a worker launched with ``budget``."""
        if self.divided_over_dp:
            return max(budget // dp, 1)
        if self.halved_over_dp and dp > 1:
            return max(budget // 2, 1)
        return budget

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
class EagerFor:
    """Models whose prompt steps a framework launches eagerly although it replays other models' (matched
    by their config's ``architectures``; on the named device profiles only, when ``devices`` is set)."""

    architectures: frozenset[str]
    devices: frozenset[str]  # empty: on every device
    why: str

    def matches(self, architectures: tuple[str, ...], device: str) -> bool:
        return bool(self.architectures & set(architectures)) and (not self.devices or device in self.devices)


@dataclass(frozen=True)
class GraphLimits:
    """Which steps carrying prompt tokens a framework that replays them as CUDA graphs replays (SGLang's
    prefill graphs are captured per token count up to a cap, and not for every model or pass)."""

    within_step_budget: bool  # a step of more prompt tokens per DP group than the step budget is eager
    # multi-head latent attention: one of more tokens per DP group is eager (0: every one)
    mla_max_tokens: int | None
    every_group: bool  # under attention DP a pass replays only when every DP group carries prompt tokens
    eager_for: tuple[EagerFor, ...]
    source: str
    attention_dp: bool = True  # False: under attention DP no prompt step is replayed
    disaggregated: bool = True  # False: a disaggregated prefill worker replays no prompt step


@dataclass(frozen=True)
class PromptSteps:
    """How a framework runs prompt tokens by default: beside the decode rows in one step (``mixed``,
    chunked prefill) or in steps of their own run before decoding whenever a prompt waits; and
    whether a step carrying prompt tokens is replayed as a CUDA graph (else launched eagerly,
    ``estimate/eager.py``), within ``limits`` when only some are."""

    mixed: bool
    cuda_graphs: bool
    source: str
    limits: GraphLimits | None = None

    def replayed(
        self,
        tokens: int,
        budget: int,
        *,
        mla: bool,
        every_group: bool,
        architectures: tuple[str, ...],
        device: str,
        dp: int = 1,
        disaggregated: bool = False,
    ) -> bool:
        """Whether a pass carrying ``tokens`` prompt tokens per DP group (at a step budget of ``budget``
        per group) is replayed as a CUDA graph; ``every_group``: every DP group carries prompt tokens in
        it (always true without attention DP); ``dp``: the worker's attention DP groups;
        ``disaggregated``: the worker is a disaggregated prefill worker."""
        limits = self.limits
        if not self.cuda_graphs or limits is None:
            return self.cuda_graphs
        return not (
            (limits.within_step_budget and tokens > budget)
            or (mla and limits.mla_max_tokens is not None and tokens > limits.mla_max_tokens)
            or (limits.every_group and not every_group)
            or (not limits.attention_dp and dp > 1)
            or (not limits.disaggregated and disaggregated)
            or any(rule.matches(architectures, device) for rule in limits.eager_for)
        )

    def eager_reason(
        self, architectures: tuple[str, ...], device: str, *, mla: bool = False, dp: int = 1
    ) -> str | None:
        """Why this model's prompt steps are never replayed on ``device`` (an ``eager_for`` entry, or a
        limit no step of a model with ``mla`` at ``dp`` attention DP groups passes), if so."""
        limits = self.limits
        if limits is None:
            return None
        if mla and limits.mla_max_tokens == 0:
            return f"this release replays no prompt step of a latent-attention (MLA) model ({limits.source})"
        if dp > 1 and not limits.attention_dp:
            return f"this release replays no prompt step under attention DP ({limits.source})"
        return next((rule.why for rule in limits.eager_for if rule.matches(architectures, device)), None)


@dataclass(frozen=True)
class Release:
    """Releases of a framework whose step budget or prompt steps differ from its newest facts, and the
    releases whose source was read to say so (``read``)."""

    versions: SpecifierSet
    read: str
    step_tokens: StepTokens | None
    prompt_steps: PromptSteps | None
    note: str = ""  # what these facts leave out for the release (printed with every price of it)


@dataclass(frozen=True)
class Framework:
    name: str
    title: str
    rules: tuple[Rule, ...]
    step_tokens: StepTokens
    prompt_steps: PromptSteps
    read: str = ""  # the releases whose source these facts were read in
    versions: SpecifierSet | None = None  # the releases they hold for (None: not stated)
    releases: tuple[Release, ...] = ()  # older releases whose facts differ
    # what the facts leave out for the release asked for: a release entry's note, or that no entry
    # covers it and the newest facts read stand for it
    note: str = ""

    def refusal(self, par: Parallel) -> Rule | None:
        """The first rule that refuses ``par``, or None when the framework can launch it."""
        return next((rule for rule in self.rules if rule.refuses(par)), None)

    def at(self, version: str | None) -> Framework:
        """The facts of release ``version`` (None: the newest read): the release entry covering it, or
        these facts with a ``note`` saying that the release asked for was not read."""
        if version is None:
            return self
        try:
            wanted = Version(version)
        except InvalidVersion:
            raise UsageError(
                f"--framework-version {version!r} is not a release version (e.g. 0.5.6)"
            ) from None
        for release in self.releases:
            if release.versions.contains(wanted, prereleases=True):
                steps = release.prompt_steps or self.prompt_steps
                tokens = release.step_tokens or self.step_tokens
                return replace(
                    self,
                    step_tokens=tokens,
                    prompt_steps=steps,
                    read=release.read,
                    releases=(),
                    note=release.note,
                )
        if self.versions is not None and self.versions.contains(wanted, prereleases=True):
            return replace(self, releases=())
        note = f"{self.title} {version} was not read: priced with the facts read in {self.read}"
        return replace(self, releases=(), note=note)


def frameworks() -> tuple[str, ...]:
    return tuple(_load())


def framework(name: str, version: str | None = None) -> Framework:
    """Serving framework ``name`` (``frameworks.yaml``): its launch rules, step budget and prompt
    steps, as of release ``version`` (None: the newest release read; ``Framework.at``)."""
    table = _load()
    if name not in table:
        raise UsageError(f"unknown serving framework {name!r} (known: {', '.join(table)})")
    return table[name].at(version)


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
        tokens = _step_tokens(entry.get("step_tokens") or {}, f"{name}.step_tokens")
        steps = _prompt_steps(entry.get("prompt_steps") or {}, f"{name}.prompt_steps")
        releases = tuple(
            _release(raw, f"{name}.releases[{i}]") for i, raw in enumerate(entry.get("releases", ()))
        )
        versions = _versions(entry["versions"], f"{name}.versions") if "versions" in entry else None
        read = entry.get("read")
        if not isinstance(read, str) or not read:
            raise KadaptError(
                f"{FRAMEWORKS_FILE.name}: {name} needs `read`: the releases its facts were read in"
            )
        table[name] = Framework(name, entry["title"], tuple(rules), tokens, steps, read, versions, releases)
    _check_device_names(table)
    return table


def _named_devices(fw: Framework) -> list[tuple[str, str]]:
    """``(where, device profile name)`` for every device a framework's facts name."""
    named: list[tuple[str, str]] = []
    for where, tokens, steps in [
        (fw.name, fw.step_tokens, fw.prompt_steps),
        *((f"{fw.name}.releases[{i}]", r.step_tokens, r.prompt_steps) for i, r in enumerate(fw.releases)),
    ]:
        if tokens is not None:
            named += [(f"{where}.step_tokens.by_device", device) for device, _ in tokens.by_device]
        if steps is not None and steps.limits is not None:
            for i, rule in enumerate(steps.limits.eager_for):
                named += [
                    (f"{where}.prompt_steps.limits.eager_for[{i}].devices", d) for d in sorted(rule.devices)
                ]
    return named


def _check_device_names(table: Mapping[str, Framework]) -> None:
    """Refuse a device name no shipped profile has: it is matched against the profile's name, so a typo
    would silently never match and the rule would never apply."""
    from ..tables.device import shipped_device_names

    shipped = shipped_device_names()
    for fw in table.values():
        for where, device in _named_devices(fw):
            if device not in shipped:
                raise KadaptError(
                    f"{FRAMEWORKS_FILE.name}: {where}: no device profile is named {device!r} "
                    f"(shipped: {', '.join(shipped)})"
                )


def _step_tokens(step: Mapping[str, Any], where: str) -> StepTokens:
    if not isinstance(step.get("max"), int) or step["max"] < 1 or not step.get("source"):
        raise KadaptError(f"{FRAMEWORKS_FILE.name}: {where} needs a max >= 1 and a source")
    by_memory = tuple((float(b["below_gib"]), int(b["max"])) for b in step.get("by_memory", ()))
    if list(by_memory) != sorted(by_memory) or any(cap < 1 for _, cap in by_memory):
        raise KadaptError(
            f"{FRAMEWORKS_FILE.name}: {where}.by_memory: expected rising bounds and caps >= 1, "
            f"found {by_memory}"
        )
    by_device = tuple((str(d["device"]), int(d["max"])) for d in step.get("by_device", ()))
    if any(cap < 1 for _, cap in by_device):
        raise KadaptError(f"{FRAMEWORKS_FILE.name}: {where}.by_device: caps must be >= 1, found {by_device}")
    divided, halved = bool(step.get("divided_over_dp", False)), bool(step.get("halved_over_dp", False))
    if divided and halved:
        raise KadaptError(f"{FRAMEWORKS_FILE.name}: {where}: divided_over_dp or halved_over_dp, not both")
    counts = bool(step.get("counts_decode", True))
    return StepTokens(step["max"], counts, step["source"], by_memory, divided, halved, by_device)


def _prompt_steps(prompt: Mapping[str, Any], where: str) -> PromptSteps:
    if {"mixed", "cuda_graphs", "source"} - set(prompt) or set(prompt) - {
        "mixed",
        "cuda_graphs",
        "source",
        "limits",
    }:
        found = sorted(prompt)
        raise KadaptError(
            f"{FRAMEWORKS_FILE.name}: {where}: expected mixed, cuda_graphs, a source and optional limits, "
            f"found {found}"
        )
    limits = None
    if "limits" in prompt:
        if not prompt["cuda_graphs"]:
            raise KadaptError(
                f"{FRAMEWORKS_FILE.name}: {where}.limits: limits only where cuda_graphs is true"
            )
        limits = _graph_limits(prompt["limits"], f"{where}.limits")
    return PromptSteps(bool(prompt["mixed"]), bool(prompt["cuda_graphs"]), prompt["source"], limits)


_LIMIT_KEYS = {
    "within_step_budget", "mla_max_tokens", "every_group", "eager_for", "attention_dp", "disaggregated",
    "source",
}  # fmt: skip


def _graph_limits(raw: Any, where: str) -> GraphLimits:
    if not isinstance(raw, Mapping) or set(raw) - _LIMIT_KEYS or not raw.get("source"):
        found = sorted(raw) if isinstance(raw, Mapping) else raw
        keys = ", ".join(sorted(_LIMIT_KEYS - {"source"}))
        raise KadaptError(
            f"{FRAMEWORKS_FILE.name}: {where}: expected a source and some of {keys}, found {found}"
        )
    most = raw.get("mla_max_tokens")
    if most is not None and (not isinstance(most, int) or most < 0):
        raise KadaptError(
            f"{FRAMEWORKS_FILE.name}: {where}.mla_max_tokens: expected a count >= 0, found {most!r}"
        )
    eager = []
    for i, rule in enumerate(raw.get("eager_for", ())):
        archs, devices = rule.get("architectures"), rule.get("devices", [])
        if not archs or not rule.get("why") or set(rule) - {"architectures", "devices", "why"}:
            raise KadaptError(
                f"{FRAMEWORKS_FILE.name}: {where}.eager_for[{i}]: expected architectures, a why and optional "
                f"devices, found {sorted(rule)}"
            )
        eager.append(EagerFor(frozenset(archs), frozenset(devices), str(rule["why"])))
    return GraphLimits(
        bool(raw.get("within_step_budget", False)),
        most,
        bool(raw.get("every_group", False)),
        tuple(eager),
        raw["source"],
        bool(raw.get("attention_dp", True)),
        bool(raw.get("disaggregated", True)),
    )


def _versions(text: Any, where: str) -> SpecifierSet:
    try:
        return SpecifierSet(str(text))
    except InvalidSpecifier:
        raise KadaptError(f"{FRAMEWORKS_FILE.name}: {where}: {text!r} is not a version specifier") from None


def _release(raw: Mapping[str, Any], where: str) -> Release:
    """One ``releases`` entry: the versions it covers, the releases read, and what it overrides."""
    if not raw.get("read") or not ({"step_tokens", "prompt_steps"} & set(raw)):
        raise KadaptError(
            f"{FRAMEWORKS_FILE.name}: {where}: needs versions, read and step_tokens or prompt_steps"
        )
    tokens = _step_tokens(raw["step_tokens"], f"{where}.step_tokens") if "step_tokens" in raw else None
    steps = _prompt_steps(raw["prompt_steps"], f"{where}.prompt_steps") if "prompt_steps" in raw else None
    versions = _versions(raw.get("versions"), f"{where}.versions")
    return Release(versions, str(raw["read"]), tokens, steps, str(raw.get("note", "")))


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
