"""What every ``kadapt`` command prints, and where: one place for ``-q``/``-v`` and ``--format json``.

Commands never call ``click.echo`` for their own output; they ask the shared ``Output`` (kept on the
click context, so ``kadapt -q CMD`` and ``kadapt CMD -q`` set the same thing) for one of four kinds:

- ``result``: the answer asked for (a plan, the findings of a failed check, a JSON document).
  Always printed, on stdout: ``-q`` never hides it.
- ``info``: progress and success summaries. stdout in text mode; dropped by ``-q`` and in JSON mode
  (there stdout is exactly one document).
- ``note``: advice on stderr (a skipped target); dropped by ``-q``.
- ``detail``: stderr, only with ``-v`` (resolved spec paths, each file checked, stage timings).

Errors do not pass through here: a ``KadaptError`` reaches the group, which prints ``error: ...``
on stderr whatever the verbosity and, in JSON mode, also prints ``error_document`` on stdout, so a
tool reading ``--format json`` gets one JSON document whenever the exit status is 0 or 1. Usage
errors (exit 2) stay click's text on stderr, as ``kadapt validate --format json`` always did.
Imports nothing heavy: ``kadapt --help`` and ``kadapt validate`` load this module.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from ..errors import KadaptError

QUIET, NORMAL, VERBOSE = -1, 0, 1
FORMATS = ("text", "json")
F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Output:
    """Verbosity and format of this invocation, and whether stdout already holds a JSON document."""

    level: int = NORMAL
    fmt: str = "text"
    document_written: bool = False

    @property
    def json(self) -> bool:
        return self.fmt == "json"

    def result(self, text: str, *, nl: bool = True) -> None:
        click.echo(text, nl=nl)

    def info(self, text: str) -> None:
        if self.level > QUIET and not self.json:
            click.echo(text)

    def note(self, text: str) -> None:
        if self.level > QUIET:
            click.echo(text, err=True)

    def detail(self, text: str) -> None:
        if self.level >= VERBOSE:
            click.echo(text, err=True)

    def document(self, data: dict[str, Any]) -> None:
        """The command's JSON document on stdout (at most one per run)."""
        click.echo(json.dumps(data, indent=2))
        self.document_written = True

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a stage; ``-v`` prints ``stage NAME: S s`` when it ends (also when it fails)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.detail(f"stage {name}: {time.perf_counter() - start:.2f} s")


def current() -> Output:
    """The ``Output`` of the running command (created on first use)."""
    return click.get_current_context().ensure_object(Output)


def reporter(fmt: str = "text") -> Output:
    """The running command's ``Output``, told the command's ``--format``."""
    out = current()
    out.fmt = fmt
    return out


def error_document(exc: KadaptError) -> dict[str, Any]:
    """``{"error": {message, location, exit_code, diagnostics}}``; diagnostics as ``validate`` gives them."""
    diagnostics = getattr(exc, "diagnostics", None) or []
    return {
        "error": {
            "message": exc.message,
            "location": exc.location,
            "exit_code": exc.exit_code,
            "diagnostics": [d.to_json() for d in diagnostics],
        }
    }


def report_error(ctx: click.Context, exc: KadaptError) -> None:
    """``error: ...`` on stderr always; in JSON mode also the error document, unless one was printed."""
    out = ctx.find_object(Output)
    if out is not None and out.json and not out.document_written and exc.exit_code != 2:
        out.document(error_document(exc))
    click.echo(f"error: {exc}", err=True)


def _set_level(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    out = ctx.ensure_object(Output)  # always: the group's context must own the object errors read
    if not value:
        return
    level = QUIET if param.name == "quiet" else VERBOSE
    if out.level not in (NORMAL, level):
        raise click.UsageError("-q/--quiet and -v/--verbose cannot be combined", ctx)
    out.level = level
    if level == QUIET:
        _quiet_transformers(ctx)


def _quiet_transformers(ctx: click.Context) -> None:
    """``-q`` silences transformers' warnings too (a published config's own oddity, such as Llama-4's
    equal rope frequency factors, is not a finding of the check), without importing it: its logger
    now, and the verbosity its first import reads; both as they were when the command ends."""
    logger = logging.getLogger("transformers")
    level, env = logger.level, os.environ.get("TRANSFORMERS_VERBOSITY")

    def restore() -> None:
        logger.setLevel(level)
        if env is None:
            os.environ.pop("TRANSFORMERS_VERBOSITY", None)
        else:
            os.environ["TRANSFORMERS_VERBOSITY"] = env

    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    logger.setLevel(logging.ERROR)
    ctx.call_on_close(restore)


_VERBOSITY = (
    click.option(
        "-q",
        "--quiet",
        is_flag=True,
        expose_value=False,
        callback=_set_level,
        help="Print only results and errors (nothing when a check passes).",
    ),
    click.option(
        "-v",
        "--verbose",
        is_flag=True,
        expose_value=False,
        callback=_set_level,
        help="Also print details on stderr: resolved paths, each file checked, stage timings.",
    ),
)


def verbosity_options(command: F) -> F:
    """Add ``-q/--quiet`` and ``-v/--verbose`` (the group has them too; either place works)."""
    for option in reversed(_VERBOSITY):
        command = option(command)
    return command


def format_option(command: F) -> F:
    """Add ``--format text|json`` (the keys of each command's document: ``docs/cli.md``)."""
    return click.option(
        "--format",
        "fmt",
        type=click.Choice(FORMATS),
        default="text",
        show_default=True,
        help="json: one document on stdout (also for errors, exit 1).",
    )(command)
