"""Load a spec file: positioned YAML, then the JSON Schema, then the semantic checks.

``check_spec`` never raises for a bad spec: it returns every diagnostic (what ``kadapt validate``
prints). ``load_spec`` is what the rest of kadapt calls: it raises ``SpecInvalid`` listing all
errors, or returns the typed ``Spec`` whose ``positions`` let later stages say ``file:line:col``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import KadaptError
from .deprecations import CODE as DEPRECATED_CODE
from .diagnostics import Diagnostic, Location, Locator, SpecInvalid, sort_diagnostics
from .model import Spec, build_spec
from .schema_loader import schema_diagnostics
from .semantic import semantic_diagnostics
from .yaml_loader import load_yaml


@dataclass(frozen=True)
class SpecCheck:
    """Outcome of checking one file. ``raw`` is ``None`` when the YAML itself could not be loaded; a spec
    in a retired form (``deprecations``) is held in its new form, ``positions`` renumbered to match."""

    path: Path
    raw: Any
    positions: dict[str, Location] = field(repr=False)
    diagnostics: tuple[Diagnostic, ...]

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.is_error]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if not d.is_error]


def check_spec(path: str | Path) -> SpecCheck:
    """Run every check on ``path``; diagnostics name the file as given (relative paths stay relative)."""
    spec_path = Path(path)
    loaded = load_yaml(spec_path, display=str(path))
    if loaded.diagnostics:
        return SpecCheck(spec_path, None, loaded.positions, tuple(sort_diagnostics(loaded.diagnostics)))
    raw, positions = loaded.data, loaded.positions
    locator = Locator(str(path), positions)
    found = schema_diagnostics(raw, locator)
    if isinstance(raw, dict):
        found += semantic_diagnostics(raw, spec_path.resolve(), locator, found)
        if not any(d.is_error for d in found):
            from .against_config import config_diagnostics
            from .deprecations import retire

            retired = retire(spec_path.resolve(), raw, positions, locator)  # warned at the old lines
            raw, positions = retired.raw, retired.positions
            found += [
                *retired.diagnostics,
                *config_diagnostics(spec_path.resolve(), raw, positions, Locator(str(path), positions)),
            ]
    return SpecCheck(spec_path, raw, positions, tuple(sort_diagnostics(found)))


def shipped_spec_names() -> list[str]:
    """Names of the specs kadapt ships (``kimi_k25``, ``llama``, ...), checkout or installed wheel."""
    from ..resources import shipped_dir

    try:
        return sorted(p.stem for p in shipped_dir("specs").glob("*.yaml"))
    except FileNotFoundError:
        return []


def resolve_spec_path(ref: str | os.PathLike[str]) -> Path:
    """A spec file from a path, or from the name of a shipped spec (``kimi_k25``).

    A file that exists wins; ``specs/<name>.yaml`` relative to a directory that is not the
    checkout also finds the shipped copy, so README commands work from an installed wheel. A name
    that is also a directory in the working directory (``--output-dir llama``) still means the
    shipped spec; any other existing path is returned for the caller to refuse.
    """
    path = Path(ref)
    if path.is_file():
        return path
    from ..resources import shipped_dir

    names = shipped_spec_names()
    stem = path.stem if path.suffix in (".yaml", ".yml") and path.parent.name in ("specs", "") else str(ref)
    if stem in names:
        return shipped_dir("specs") / f"{stem}.yaml"
    if path.exists():
        return path
    raise KadaptError(
        f"no spec file {str(ref)!r} and no shipped spec of that name; shipped: {', '.join(names) or 'none'}"
    )


def load_spec(ref: str | os.PathLike[str] | Spec) -> Spec:
    """Load and validate a spec file, given as a path or a shipped spec's name (a ``Spec`` passes through).

    Raises ``SpecInvalid`` (a ``KadaptError``) listing every error; warnings do not stop loading. A
    spec in a retired form comes back in its new form, with ``Spec.deprecations`` saying so.
    ``Spec.positions`` maps breadcrumbs (``patches[0].target``) to 1-based ``(line, col)``;
    ``Spec.locate(where)`` renders ``file:line:col``.
    """
    if isinstance(ref, Spec):
        return ref
    path = resolve_spec_path(ref)
    result = check_spec(path)
    if result.errors:
        raise SpecInvalid(result.errors)
    spec = build_spec(path.resolve(), result.raw, result.positions)
    retired = tuple(d.render() for d in result.warnings if d.code == DEPRECATED_CODE)
    return dataclasses.replace(spec, deprecations=retired) if retired else spec
