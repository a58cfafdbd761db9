"""The ``kadapt`` command: a click group whose subcommands are imported only when run.

One module per subcommand (``cli/<name>.py`` exposing ``command``). The group imports none of
them for ``--help`` and only the one invoked otherwise, so ``kadapt --help`` and
``kadapt validate`` never import torch or transformers.

Errors reach the user as one line, never a traceback: a ``KadaptError`` (or an
``upstream.ContactPointMoved``: a transformers internal kadapt relies on has moved) prints
``error: ...`` and exits with its code (1, or 2 for usage; with ``--format json`` an exit-1 error is
also a JSON document on stdout, see ``output.py``); Ctrl-C (``KeyboardInterrupt``, wherever it lands: while
importing torch, building a model, tracing or writing) prints ``interrupted`` and exits 130, the
shell convention for SIGINT, after ``applied`` has taken its patches back and every atomic write in
flight has removed its temp file (both run on the way out, in ``finally`` blocks).
The process then ends without the interpreter's teardown (``_leave``): the ``atexit`` handlers run
and the streams are flushed, the ~1 s of freeing a torch-sized heap is skipped.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import importlib
import os
import sys
import threading
from typing import Any, NoReturn

import click

from .. import __version__
from ..errors import KadaptError
from ..upstream import ContactPointMoved
from .output import report_error, verbosity_options

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("kimi_adapter_core.cli.validate", "Validate and lint adapter specs (files or folders)."),
    "schema": ("kimi_adapter_core.cli.schema", "Print the JSON Schema of the spec language."),
    "apply": ("kimi_adapter_core.cli.apply", "Apply a spec, build the model and run a backend."),
    "pin": ("kimi_adapter_core.cli.pin", "Recompute the signature/source pins of a spec's patches."),
    "generate": ("kimi_adapter_core.cli.generate", "Render wrapper modules and docs from a spec."),
    "plan": ("kimi_adapter_core.cli.plan", "Size a deployment: KV cache, weights, activations."),
    "simulate": ("kimi_adapter_core.cli.simulate", "Estimate latency and memory with a roofline model."),
    "doctor": ("kimi_adapter_core.cli.doctor", "Check versions, transformers contact points and pins."),
}


class LazyGroup(click.Group):
    """Resolve ``SUBCOMMANDS`` on demand; ``--help`` lists them from their one-line summaries."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = SUBCOMMANDS.get(cmd_name)
        if entry is None:
            return None
        return importlib.import_module(entry[0]).command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, SUBCOMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt:  # while parsing the command line: still not click's "Aborted!"
            _interrupted()
            raise click.exceptions.Exit(INTERRUPTED) from None

    def invoke(self, ctx: click.Context):  # noqa: ANN201 - click's signature
        try:
            return super().invoke(ctx)
        except KadaptError as exc:
            report_error(ctx, exc)
            ctx.exit(exc.exit_code)
        except ContactPointMoved as exc:  # before any export: what moved, and the tested versions
            moved = KadaptError(str(exc))
            report_error(ctx, moved)
            ctx.exit(moved.exit_code)
        except ModuleNotFoundError as exc:
            package = (exc.name or "").split(".")[0]
            if package not in MODEL_PACKAGES:
                raise
            missing = KadaptError(
                f"kadapt {ctx.invoked_subcommand} needs {package}, which is not installed; "
                "install the model extra: pip install torch==2.13.0 'kadapt[model]'"
            )
            report_error(ctx, missing)
            ctx.exit(missing.exit_code)
        except KeyboardInterrupt:
            _interrupted()
            ctx.exit(INTERRUPTED)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kadapt")
@verbosity_options
def cli() -> None:
    """kadapt: declarative adapters that make huge Hugging Face models extractable and simulatable.

    A YAML spec (see `kadapt schema`) declares config bridges, environment shims, class patches,
    module paths and the prefill/decode ABI; `kadapt apply SPEC` applies it behind its model_type
    gate and runs the extraction backend. -q/-v work before or after the command; every command
    that reports takes --format json (keys: docs/cli.md). Exit status: 0 ok, 1 failed check or
    user error, 2 usage error, 130 interrupted.

    \b
    Examples:
      kadapt validate specs/
      kadapt -q generate --check
      kadapt apply kimi_k25 --format json -v
    """


INTERRUPTED = 130  # 128 + SIGINT
_REDELIVER_SECONDS = 0.05
# Not core dependencies (`kadapt validate` and `plan` run without them): the `model` extra brings them.
MODEL_PACKAGES = ("torch", "transformers")


def _interrupted() -> None:
    # on a terminal, start a fresh line after the echoed ``^C``
    newline = "\n" if sys.stderr.isatty() else ""
    click.echo(f"{newline}interrupted", err=True)


def _redeliver_swallowed_interrupt(unraisable: Any) -> None:
    """A Ctrl-C that lands inside a destructor (torch frees storages in ``__del__``) cannot propagate:
    Python would print it as an ignored exception with a traceback and the run would go on. Deliver
    it again, shortly, from another thread: raised here it would be swallowed the same way, a moment
    later the main thread has left the destructor (if it is in another one, this repeats)."""
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        timer = threading.Timer(_REDELIVER_SECONDS, _thread.interrupt_main)
        timer.daemon = True
        timer.start()
        return
    sys.__unraisablehook__(unraisable)


def main() -> None:
    sys.unraisablehook = _redeliver_swallowed_interrupt
    try:
        cli(prog_name="kadapt")
    except KeyboardInterrupt:  # outside the group's ``invoke``: click's own parsing or teardown
        _interrupted()
        _leave(INTERRUPTED)
    except SystemExit as done:  # click ends every command this way
        _leave(done.code)


def _leave(code: int | str | None) -> NoReturn:
    """End the process as ``sys.exit(code)`` would, without the interpreter's teardown.

    Tearing down an interpreter that imported torch and transformers (every module cleared, every
    object freed one by one, libtorch's static destructors) takes ~0.8 s, a run's heap more: measured
    0.95 s after the Kimi-K2.5 main job, whose artifacts were complete long before. What exit would
    still do is done here: the ``atexit`` handlers (and with them ``weakref.finalize`` callbacks and
    logging's flush), then stdout and stderr flushed; only the freeing is skipped, which the OS does
    at once. The Python API and ``CliRunner`` never come here."""
    if isinstance(code, str):  # sys.exit("message"): the message on stderr, status 1
        print(code, file=sys.stderr)
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing to flush
                stream.flush()
        os._exit(code or 0)
