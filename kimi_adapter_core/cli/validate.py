"""``kadapt validate PATH...``: check spec files (or folders of them) and report every problem.

Exit status: 0 all valid, 1 any invalid (with ``--strict``, warnings count), 2 usage errors.
Imports neither torch nor transformers, so it is cheap enough for a pre-commit hook.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import click

from ..errors import UsageError
from ..reporting import REPORTERS, FileReport, reporter_for
from ..spec.loader import check_spec

_SPEC_SUFFIXES = (".yaml", ".yml")


def discover(paths: Iterable[Path]) -> list[Path]:
    """Files as given; folders searched recursively for ``*.yaml``/``*.yml``, hidden dirs skipped."""
    found: list[Path] = []
    for path in paths:
        if not path.is_dir():
            found.append(path)
            continue
        specs = sorted(_walk(path))
        if not specs:
            raise UsageError(f"no *.yaml or *.yml specs found in folder {path}")
        found.extend(specs)
    return list(dict.fromkeys(found))


def _walk(folder: Path) -> Iterable[Path]:
    for root, dirs, files in os.walk(folder):
        dirs[:] = [name for name in dirs if not name.startswith(".")]  # prune: never descend into .git
        yield from (Path(root, name) for name in files if name.endswith(_SPEC_SUFFIXES))


@click.command(name="validate")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(sorted(REPORTERS)), default="text", show_default=True)
@click.option("--strict", is_flag=True, help="Treat warnings as errors.")
def command(paths: tuple[Path, ...], fmt: str, strict: bool) -> None:
    """Validate adapter specs: YAML, the JSON Schema, and cross-checks against the shipped config."""
    reports = []
    for path in discover(paths):
        result = check_spec(path)
        reports.append(FileReport(str(path), result.diagnostics))
    click.echo(reporter_for(fmt).render(reports, strict))
    if not all(report.valid(strict) for report in reports):
        raise SystemExit(1)
