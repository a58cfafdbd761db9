"""Command-line options shared by the commands that load a spec's model: where it comes from.

The config comes from the file shipped next to the spec unless the user points elsewhere:
``--source-dir`` (a model checkout: config.json + remote code) or ``--from-hub`` (the spec's
``source.hub`` repo at its pinned revision). Remote code runs only with ``--trust-remote-code``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def source_options(command: F) -> F:
    """Add ``--trust-remote-code``, ``--source-dir`` and ``--from-hub`` to ``command``."""
    for option in reversed(
        (
            click.option(
                "--trust-remote-code",
                is_flag=True,
                help="Allow the model's own remote code (the spec must allow it too).",
            ),
            click.option(
                "--source-dir",
                type=click.Path(exists=True, file_okay=False, path_type=Path),
                help="Model directory (config.json + remote code) instead of the spec's shipped config.",
            ),
            click.option(
                "--from-hub",
                is_flag=True,
                help="Load config (and remote code) from the spec's source.hub at its pinned revision.",
            ),
        )
    ):
        command = option(command)
    return command
