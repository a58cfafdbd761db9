"""``kadapt generate [SPEC] --target extraction|simulation|docs|all --out DIR [--check]``.

Renders everything to memory first (formatted with ruff, compiled), then writes each file
atomically, so a failing spec or template leaves the output tree as it was. ``--check`` writes
nothing: it exits 1 listing missing or stale files with a short diff, 0 when all are up to date.
Without SPEC it covers every shipped spec in ``specs/``.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import KadaptError, UsageError
from ..generate import ALL, TARGETS, check_all, expand_targets, render_spec, write_all
from ..resources import shipped_dir
from ..spec import load_spec
from .spec_argument import SpecReference

_SHIPPED_SUFFIXES = (".yaml", ".yml")


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
def command(spec: Path | None, target: str, out: Path | None, check: bool) -> None:
    """Render wrapper modules and docs from a spec (all shipped specs when SPEC is omitted)."""
    paths = [spec] if spec is not None else shipped_specs()
    targets = expand_targets(target)
    stale = 0
    for path in paths:
        loaded = load_spec(path)
        root = out if out is not None else default_out(path)
        files, notes = render_spec(loaded, targets, skip_inexpressible=target == ALL)
        for note in notes:
            click.echo(f"note: {note}", err=True)
        if check:
            for drift in check_all(files, root):
                stale += 1
                click.echo(f"{drift.status}: {drift.path}")
                if drift.diff:
                    click.echo(drift.diff)
            continue
        written = write_all(files, root)
        click.echo(f"{loaded.name}: {len(files)} files, {len(written)} written under {root}")
    if check:
        if stale:
            raise KadaptError(f"{stale} generated file(s) out of date: run `kadapt generate` and commit them")
        click.echo("generated files are up to date")
