"""``kadapt generate [SPEC] --target extraction|simulation|docs|all --out DIR [--check]``.

Renders everything to memory first (formatted with ruff, compiled), then writes each file
atomically, so a failing spec or template leaves the output tree as it was. ``--check`` writes
nothing: it exits 1 listing missing or stale files with a short diff, 0 when all are up to date.
Without SPEC it covers every shipped spec in ``specs/``. Drift is the finding of ``--check``, so
``-q`` keeps it and drops the rest; ``-v`` lists every file with its status.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import KadaptError, UsageError
from ..generate import ALL, TARGETS, Rendered, check_all, expand_targets, render_spec, write_all
from ..resources import shipped_dir
from ..spec import load_spec
from .output import Output, format_option, reporter, verbosity_options
from .spec_argument import SpecReference

_SHIPPED_SUFFIXES = (".yaml", ".yml")
DRIFT = ("missing", "stale")  # --check statuses that fail the check


def shipped_specs() -> list[Path]:
    return sorted(p for p in shipped_dir("specs").iterdir() if p.suffix in _SHIPPED_SUFFIXES)


def default_out(spec_path: Path) -> Path:
    """The checkout root for a shipped spec in a checkout (``adapters/`` and ``docs/`` land in place)."""
    specs = shipped_dir("specs").resolve()
    if spec_path.resolve().parent == specs and specs.parent.name != "_shipped":
        return specs.parent
    raise UsageError(f"--out is required for {spec_path} (only shipped specs in a checkout have a default)")


@click.command(name="generate")
@click.argument("spec", metavar="[SPEC]", required=False, type=SpecReference())
@click.option(
    "--target",
    type=click.Choice([*TARGETS, ALL]),
    default=ALL,
    show_default=True,
    help="What to render; 'all' skips (with a note) targets a spec cannot produce.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Output root (adapters/<name>/..., docs/specs/<name>.md). Default: the checkout, for shipped specs.",
)
@click.option(
    "--check", is_flag=True, help="Write nothing; exit 1 if any generated file is missing or stale."
)
@format_option
@verbosity_options
def command(spec: Path | None, target: str, out: Path | None, check: bool, fmt: str) -> None:
    """Render wrapper modules and docs from a spec (all shipped specs when SPEC is omitted).

    JSON (--format json): {"check", "up_to_date", "specs": [{"spec", "path", "out", "notes",
    "files": [{"path", "status", "diff"}]}]}; status is written or unchanged, with --check ok,
    missing or stale (then exit 1 after the document).

    \b
    Examples:
      kadapt generate --check
      kadapt generate kimi_k25 --target extraction --out build/
    """
    report = reporter(fmt)
    paths = [spec] if spec is not None else shipped_specs()
    targets = expand_targets(target)
    specs = []
    for path in paths:
        report.detail(f"spec: {path.resolve()}")
        loaded = load_spec(path)
        for line in loaded.deprecations:
            report.note(line)
        root = out if out is not None else default_out(path)
        files, notes = render_spec(loaded, targets, skip_inexpressible=target == ALL)
        for note in notes:
            report.note(f"note: {note}")
        rows = _check(files, root, report) if check else _write(files, root)
        if not check:
            written = sum(row["status"] == "written" for row in rows)
            report.info(f"{loaded.name}: {len(files)} files, {written} written under {root}")
        for row in rows:
            report.detail(f"  {row['status']}: {root / row['path']}")
        specs.append(
            {"spec": loaded.name, "path": str(path), "out": str(root), "notes": list(notes), "files": rows}
        )
    stale = sum(row["status"] in DRIFT for entry in specs for row in entry["files"])
    if report.json:
        report.document({"check": check, "up_to_date": not stale, "specs": specs})
    if check:
        if stale:
            raise KadaptError(f"{stale} generated file(s) out of date: run `kadapt generate` and commit them")
        report.info("generated files are up to date")


def _check(files: list[Rendered], root: Path, report: Output) -> list[dict[str, str]]:
    """One row per file (ok, missing or stale); in text mode each drift and its diff is printed."""
    drifts = {drift.path: drift for drift in check_all(files, root)}
    rows = []
    for item in files:
        drift = drifts.get(str(item.path))
        rows.append(
            {
                "path": str(item.path),
                "status": drift.status if drift else "ok",
                "diff": drift.diff if drift else "",
            }
        )
        if drift is not None and not report.json:
            report.result(f"{drift.status}: {drift.path}")
            if drift.diff:
                report.result(drift.diff)
    return rows


def _write(files: list[Rendered], root: Path) -> list[dict[str, str]]:
    """Write what changed; one row per file (written or unchanged)."""
    written = set(write_all(files, root))
    return [
        {"path": str(f.path), "status": "written" if root / f.path in written else "unchanged", "diff": ""}
        for f in files
    ]
