"""``kadapt schema``: print the spec language's JSON Schema (or write it atomically to a file)."""

from __future__ import annotations

from pathlib import Path

import click

from ..atomic import atomic_write_text
from ..resources import schema_path


@click.command(name="schema")
@click.option(
    "--output", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Write to FILE instead of stdout."
)
def command(output: Path | None) -> None:
    """Print the JSON Schema (draft 2020-12) that adapter specs are validated against."""
    text = schema_path().read_text(encoding="utf-8")
    if output is None:
        click.echo(text, nl=not text.endswith("\n"))
    else:
        atomic_write_text(output, text)
