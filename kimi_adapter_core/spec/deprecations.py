"""Forms of the spec language a release retired, kept working for one more release with a warning.

A spec that validated with the previous release must keep working for one release: ``DEPRECATED`` is
the table of such forms - the old form, the new one, the last release that accepted it silently and
the release that rejects it - and ``retire`` applies it when a spec is loaded, after the
schema and semantic checks and before the checks against the config. Each old form found becomes a
warning at its line (``kadapt validate`` prints it; the exit code stays 0 unless ``--strict``) and is
rewritten to its new form, so ``load_spec`` - and with it ``apply``, ``plan``, ``simulate`` and
``generate`` - sees the spec exactly as if it were written in the new form. ``docs/writing-a-spec.md``
lists the table ("Deprecations"); a test holds the two together.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import KadaptError
from .diagnostics import Diagnostic, Location, Locator, Severity

CODE = "deprecated"


@dataclass(frozen=True)
class Found:
    """One entry of a spec in an old form: its index in the section, and why it is that form."""

    index: int
    why: str


@dataclass(frozen=True)
class Deprecated:
    """One retired form. Entries of ``section`` that ``finds`` returns are removed: the new form of
    each is the spec without it (the only rewrite a retired form has needed so far)."""

    section: str  # the top-level list holding the old form
    old: str  # the old form, as the warning and the docs name it
    new: str  # what to write instead
    accepted_until: str  # the last release that accepted the old form without a word
    removed_in: str  # the release that rejects it
    finds: Callable[[Any, dict[str, Any]], Iterator[Found]]  # (typed spec, shipped config) -> entries


def _schemes_beside_other_storage(spec: Any, config: dict[str, Any]) -> Iterator[Found]:
    """``quantization`` schemes beside a ``quantization_config`` no scheme can describe (MXFP4, FP8): in
    0.1.0 a scheme only described a checkpoint whose config is silent, and was ignored beside one that
    speaks; now every scheme is a claim held against it, which such a scheme always contradicts."""
    from ..checkpoint.storage import undescribed_by_schemes
    from ..config.quantization import backend_quantization

    for view in backend_quantization(spec, config):
        stored = undescribed_by_schemes(view.config) if view.config is not None else None
        if stored is None:
            continue
        for index, scheme in enumerate(spec.quantization):
            yield Found(
                index,
                f"{scheme.id} is int{scheme.bits} storage, but {view.where} has {stored} (int schemes "
                "describe compressed-tensors pack-quantized only)",
            )


DEPRECATED: tuple[Deprecated, ...] = (
    Deprecated(
        section="quantization",
        old="a `quantization` scheme beside a `quantization_config` that no scheme describes (one that is "
        "not compressed-tensors pack-quantized: gpt-oss's `mxfp4`, DeepSeek's `fp8`)",
        new="delete the entry; the config's `quantization_config` decides the storage",
        accepted_until="0.1.0",
        removed_in="0.3.0",
        finds=_schemes_beside_other_storage,
    ),
)


@dataclass(frozen=True)
class Retired:
    """A spec with its retired forms rewritten: the mapping, its positions, one warning per form."""

    raw: dict[str, Any]
    positions: dict[str, Location]
    diagnostics: tuple[Diagnostic, ...]


def retire(spec_path: Path, raw: dict[str, Any], positions: dict[str, Location], locator: Locator) -> Retired:
    """Find every ``DEPRECATED`` form in ``raw`` (a schema- and semantic-clean spec) against the config
    it ships, warn at each and return the spec in its new form. A spec without a readable shipped config
    is returned as is: its forms are judged against the config ``apply`` loads."""
    from ..config.source import resolve_source
    from .model import build_spec

    spec = build_spec(spec_path, raw, positions)
    if spec.source.config is None:
        return Retired(raw, positions, ())
    try:
        config = resolve_source(spec).raw
    except KadaptError:
        return Retired(raw, positions, ())  # unreadable config: the semantic checks reported it
    found: list[Diagnostic] = []
    for form in DEPRECATED:
        entries = {hit.index: hit for hit in form.finds(spec, config)}  # one warning per entry
        for index, hit in sorted(entries.items()):
            crumb = f"{form.section}[{index}]"
            found.append(locator.at(crumb, _message(form, crumb, hit.why), CODE, Severity.WARNING))
        if entries:
            raw, positions = _without(raw, positions, form.section, set(entries))
    return Retired(raw, positions, tuple(found))


def _message(form: Deprecated, crumb: str, why: str) -> str:
    return (
        f"deprecated form, an error from kadapt {form.removed_in}: {why}. kadapt {form.accepted_until} "
        f"ignored {form.old}, and so does this release, with this warning. New form of {crumb}: {form.new}"
    )


def _without(
    raw: dict[str, Any], positions: dict[str, Location], section: str, dropped: set[int]
) -> tuple[dict[str, Any], dict[str, Location]]:
    """``raw`` without entries ``dropped`` of list ``section`` (the section gone once empty), and the
    positions of what stays under their new breadcrumbs, so later findings still point at their lines."""
    entries = raw[section]
    renumber = {old: new for new, old in enumerate(i for i in range(len(entries)) if i not in dropped)}
    data = {key: value for key, value in raw.items() if key != section or renumber}
    if renumber:
        data[section] = [entries[i] for i in sorted(renumber)]  # in place: the keys keep their order
    entry = re.compile(rf"{re.escape(section)}\[(\d+)\](.*)")
    moved: dict[str, Location] = {}
    for crumb, where in positions.items():
        match = entry.fullmatch(crumb)
        if match is None:
            if crumb != section or renumber:
                moved[crumb] = where
        elif int(match[1]) in renumber:
            moved[f"{section}[{renumber[int(match[1])]}]{match[2]}"] = where
    return data, moved
