"""``kadapt schema``: print the spec language's JSON Schema (or write it atomically to a file).

Its output is a JSON document already, so it takes no ``--format``; ``-q`` does not hide it (it is
the answer), ``-v`` names the schema file read.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..atomic import atomic_write_text
from ..resources import schema_path
from .output import reporter, verbosity_options


@click.command(name="schema")
@click.option(
    "--output", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Write to FILE instead of stdout."
)
@verbosity_options
def command(output: Path | None) -> None:
    """Print the JSON Schema (draft 2020-12) that adapter specs are validated against.

    \b
    Examples:
      kadapt schema > adapter-spec.v1.json
      kadapt schema -o .schemas/adapter-spec.v1.json
    """
    out = reporter()
    source = schema_path()
    out.detail(f"schema: {source}")
    text = source.read_text(encoding="utf-8")
    if output is None:
        out.result(text, nl=not text.endswith("\n"))
    else:
        atomic_write_text(output, text)
        out.detail(f"wrote {output}")
