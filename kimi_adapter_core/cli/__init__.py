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

Signals (``main`` only; the Python API and ``CliRunner`` keep the interpreter's own handling):
SIGINT and SIGTERM go to one handler that records the signal. Inside a command (and while the
command line is parsed) it raises ``KeyboardInterrupt``, so the same ``finally`` blocks clean up;
elsewhere (click's own plumbing, the way out) it only records, and ``_leave`` reports it. Once a
signal was received the run ends as stopped whatever follows it: a ``KeyboardInterrupt`` inside a
lazy import leaves a half-initialised module (numpy) whose next use raises ``ImportError``,
``AttributeError`` or ``RecursionError``, and that is reported as ``interrupted``, not as a bug.
torch's own import is the exception: interrupted halfway it has aborted the process (SIGABRT), so
``apply`` holds both signals back while it imports (``signals_deferred``) and they stop the run as
soon as the import is done.
SIGINT prints ``interrupted`` and exits 130, SIGTERM prints ``terminated`` and exits 143 (128 + the
signal number, as a shell reports a process the signal ended). A signal ignored when ``kadapt``
starts (a background job's SIGINT) stays ignored. Only the first ~0.1 s, the interpreter starting
and this module importing, keeps Python's default (a SIGINT there is a ``KeyboardInterrupt`` traceback).
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
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
            with _signals_raise():
                return super().make_context(*args, **kwargs)
        except BaseException as exc:  # while parsing the command line: still not click's "Aborted!"
            if not _stopped_by(exc):
                raise
            raise click.exceptions.Exit(_report_stop()) from None

    def invoke(self, ctx: click.Context):  # noqa: ANN201 - click's signature
        try:
            with _signals_raise():
                return super().invoke(ctx)
        except BaseException as exc:
            if _stopped_by(exc):
                ctx.exit(_report_stop())
            error = _user_error(ctx, exc)
            if error is None:
                raise
            report_error(ctx, error)
            ctx.exit(error.exit_code)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kadapt")
@verbosity_options
def cli() -> None:
    """kadapt: declarative adapters that make huge Hugging Face models extractable and simulatable.

    A YAML spec (see `kadapt schema`) declares config bridges, environment shims, class patches,
    module paths and the prefill/decode ABI; `kadapt apply SPEC` applies it behind its model_type
    gate and runs the extraction backend. -q/-v work before or after the command; every command
    that reports takes --format json (keys: docs/cli.md). Exit status: 0 ok, 1 failed check or
    user error, 2 usage error, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM).

    \b
    Examples:
      kadapt validate specs/
      kadapt -q generate --check
      kadapt apply kimi_k25 --format json -v
    """


INTERRUPTED = 130  # 128 + SIGINT (SIGTERM: 143)
_REDELIVER_SECONDS = 0.05
# Not core dependencies (`kadapt validate` and `plan` run without them): the `model` extra brings them.
MODEL_PACKAGES = ("torch", "transformers")
_STOPPING = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}


class _Signals:
    """What ``main``'s handler has seen (the module docstring says why). Reset by each ``main``."""

    def __init__(self, *, active: bool = False) -> None:
        self.active = active  # ``main`` runs: its handlers are installed, it reports once
        self.received: int | None = None  # the first SIGINT/SIGTERM, once one arrived
        self.raising = False  # inside a command: the handler raises KeyboardInterrupt
        self.reported = False  # ``interrupted``/``terminated`` is printed

    def code(self) -> int:
        """The exit status of a stopped run: 128 + the signal (130 for a bare KeyboardInterrupt)."""
        return 128 + self.received if self.received is not None else INTERRUPTED


_SIGNALS = _Signals()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """``main``'s SIGINT/SIGTERM handler: record it; inside a command, stop it there."""
    if _SIGNALS.received is None:
        _SIGNALS.received = signum
    if _SIGNALS.raising:
        raise KeyboardInterrupt


def _install_signal_handlers() -> None:
    """Route SIGINT and SIGTERM to ``_on_signal``, unless they were ignored (or taken) before."""
    global _SIGNALS
    _SIGNALS = _Signals(active=True)
    for signum, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        with contextlib.suppress(ValueError):  # not the main thread: nothing to route
            if signal.getsignal(signum) == default:
                signal.signal(signum, _on_signal)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """Inside the block a signal raises ``KeyboardInterrupt``; one that arrived before raises at once."""
    _SIGNALS.raising = True
    try:
        if _SIGNALS.received is not None:
            raise KeyboardInterrupt
        yield
    finally:
        _SIGNALS.raising = False


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held back (blocked) inside the block and delivered as it ends, where they
    stop the run as anywhere else. For torch's import: a ``KeyboardInterrupt`` raised halfway through
    it has ended the process with SIGABRT (-6) instead of ``interrupted``."""
    if not _SIGNALS.active:  # the Python API and CliRunner keep the interpreter's own handling
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _stopped_by(exc: BaseException) -> bool:
    """``exc`` ends a stopped run: a KeyboardInterrupt, or whatever follows a received signal."""
    return isinstance(exc, KeyboardInterrupt) or _SIGNALS.received is not None


def _report_stop() -> int:
    """Print ``interrupted`` (``terminated`` for SIGTERM), once per ``main`` (in process, with
    ``CliRunner``, once per command); the exit status to end with."""
    if not _SIGNALS.reported:
        _SIGNALS.reported = _SIGNALS.active
        # on a terminal, start a fresh line after the echoed ``^C``
        newline = "\n" if sys.stderr.isatty() else ""
        word = _STOPPING.get(_SIGNALS.received or signal.SIGINT, "interrupted")
        with contextlib.suppress(OSError, ValueError):  # a closed stderr: the status still says it
            click.echo(f"{newline}{word}", err=True)
    return _SIGNALS.code()


def _user_error(ctx: click.Context, exc: BaseException) -> KadaptError | None:
    """The user error ``exc`` stands for (printed as ``error: ...``), None for any other exception."""
    if isinstance(exc, KadaptError):
        return exc
    if isinstance(exc, ContactPointMoved):  # before any export: what moved, and the tested versions
        return KadaptError(str(exc))
    package = (exc.name or "").split(".")[0] if isinstance(exc, ModuleNotFoundError) else None
    if package in MODEL_PACKAGES:
        return KadaptError(
            f"kadapt {ctx.invoked_subcommand} needs {package}, which is not installed; "
            "install the model extra: pip install torch==2.13.0 'kadapt[model]'"
        )
    return None


def _redeliver_swallowed_interrupt(unraisable: Any) -> None:
    """A Ctrl-C that lands inside a destructor (torch frees storages in ``__del__``) cannot propagate:
    Python would print it as an ignored exception with a traceback and the run would go on. Deliver
    it again, shortly, from another thread: raised here it would be swallowed the same way, a moment
    later the main thread has left the destructor (if it is in another one, this repeats)."""
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
        signum = _SIGNALS.received or signal.SIGINT
        timer = threading.Timer(_REDELIVER_SECONDS, _thread.interrupt_main, args=(signum,))
        timer.daemon = True
        timer.start()
        return
    sys.__unraisablehook__(unraisable)


def main() -> None:
    try:  # from the first instruction: a SIGINT before the handlers are in place is still "interrupted"
        _install_signal_handlers()
        sys.unraisablehook = _redeliver_swallowed_interrupt
        cli(prog_name="kadapt")
    except SystemExit as done:  # click ends every command this way
        _leave(done.code)
    except BaseException as exc:  # outside the group's ``invoke``: click's own parsing or teardown
        if not _stopped_by(exc):
            raise
        _leave(_report_stop())


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
        if _SIGNALS.received is not None:  # a signal on the way out, or one click's plumbing ended with
            code = _report_stop()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing to flush
                stream.flush()
        os._exit(code or 0)
