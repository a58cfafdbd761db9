"""``kadapt validate PATH...``: check spec files (or folders of them) and report every problem.

Exit status: 0 all valid, 1 any invalid (with ``--strict``, warnings count), 2 usage errors.
``-q`` prints only the findings (no summary line: nothing when every spec is valid); ``-v`` names
each file checked, with the absolute path a shipped-spec name resolved to.
Imports neither torch nor transformers, so it is cheap enough for a pre-commit hook.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import click

from ..errors import UsageError
from ..reporting import FileReport, reporter_for
from ..spec.loader import check_spec
from .output import QUIET, format_option, reporter, verbosity_options

_SPEC_SUFFIXES = (".yaml", ".yml")


def discover(paths: Iterable[Path]) -> list[Path]:
    """Files as given; folders searched recursively for ``*.yaml``/``*.yml``, hidden dirs skipped;
    a name that is no path is looked up among the shipped specs (``kadapt validate kimi_k25``)."""
    from ..errors import KadaptError
    from ..spec.loader import resolve_spec_path

    found: list[Path] = []
    for path in paths:
        if not path.exists():
            try:
                found.append(resolve_spec_path(path))
            except KadaptError as exc:
                raise UsageError(exc.message) from exc
            continue
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
@click.argument("paths", metavar="PATH_OR_NAME...", nargs=-1, required=True, type=click.Path(path_type=Path))
@format_option
@click.option("--strict", is_flag=True, help="Treat warnings as errors.")
@click.option(
    "--resolve",
    is_flag=True,
    help="Also import every patch target, build the config and its structure, and build a shortened "
    "model on meta to resolve module paths and class names (imports torch; runs the code a spec names).",
)
@verbosity_options
def command(paths: tuple[Path, ...], fmt: str, strict: bool, resolve: bool) -> None:
    """Validate adapter specs: YAML, the JSON Schema, and cross-checks against the shipped config.

    JSON (--format json): {"valid": bool, "files": [{"path", "valid", "diagnostics": [{"file",
    "line", "col", "breadcrumb", "message", "severity", "code"}]}]}.

    \b
    Examples:
      kadapt validate specs/
      kadapt validate kimi_k25 -q
      kadapt validate --resolve --format json specs/qwen3_moe.yaml
    """
    out = reporter(fmt)
    reports = []
    for path in discover(paths):
        result = check_spec(path)
        diagnostics = result.diagnostics
        if resolve and not result.errors:
            from ..resolve import resolve_diagnostics
            from ..spec.model import build_spec

            spec = build_spec(path.resolve(), result.raw, result.positions)
            diagnostics = (*diagnostics, *resolve_diagnostics(spec, path))
        report = FileReport(str(path), diagnostics)
        reports.append(report)
        errors = sum(d.is_error for d in diagnostics)
        verdict = "ok" if report.valid(strict) else "invalid"
        warnings = len(diagnostics) - errors
        out.detail(f"checked {path.resolve()}: {verdict}, {errors} errors, {warnings} warnings")
    if out.json:
        out.document(json.loads(reporter_for("json").render(reports, strict)))
    elif out.level == QUIET:  # the findings, without the summary line
        for line in (d.render() for report in reports for d in report.diagnostics):
            out.result(line)
    else:
        out.result(reporter_for("text").render(reports, strict))
    if not all(report.valid(strict) for report in reports):
        raise SystemExit(1)
