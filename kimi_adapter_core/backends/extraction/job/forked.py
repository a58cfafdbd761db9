"""Exports in forked processes: the graphs of one run traced in two children, each writing its own.

Tracing is CPU-bound Python (``torch.export``), one graph at a time, and a run builds two to four
graphs. With two CPUs each of two children takes half of them (Kimi-K2.5: prefill + decode, and
prefill_mm + vision). Fork, not spawn: a child starts with the spec applied, the model on meta and
every import done, which a new interpreter would spend the import floor redoing.

This process traces nothing: torch's export machinery (~30 MB the first time it runs) and the graphs
live only in the children, so the run's peak memory is a child's, not the sum of everything. A run
is three steps, the same with or without children (``in_processes``):

1. **build** each group's graphs, then ``report`` on them (the pipeline: the weights they read, and
   the last group maps its own weights ahead, since every graph of a run usually reads the same
   text weights);
2. ``decide`` here, from every group's report, what each group needs to finish (the pipeline: the
   run's one weight map, the last group's when it is the run's, else mapped here);
3. ``finish`` each group with its decision (the pipeline: write its graphs' IR to temp files this
   process named; this process renames every file once all succeeded).

The children send their reports and results (and the clock steps they took and how many calls
reached each patch: the ledger reports a run's reach) pickled through a pipe, length-prefixed; never
their graphs.

Safety:
- a child sets torch's intra-op threads to 1 before any op: the OpenMP pool this process used
  before the fork (the whole-model check runs the model on CPU) hangs a forked child that enters a
  parallel region (measured: a matmul in such a child never returns); one thread never enters it;
- a child ends with ``os._exit``: none of this process's cleanup (taking patches back, removing
  temp files) runs twice, and it writes nothing but its result and the files it was given names for;
- an error in a child comes back as a ``Failure`` (its message, whether it is a user error, the
  ``OSError`` fields, the child's traceback), never as a pickled exception object, and is raised here
  as one error: a user error as a ``KadaptError`` with the same message and exit status, an
  ``OSError`` (a full disk) as ``cannot write PATH: why``, a bug as ``ExportProcessFailed`` carrying
  the child's traceback; a child that ends without a result is an error naming how it ended; an
  error or Ctrl-C here kills and reaps every child. Ctrl-C in the children's terminal ends them at
  once, as SIGTERM does (both back to the default action in a child);
- a child whose parent is gone finds its decision pipe closed and ends.
One process where ``os.fork`` is missing, one CPU is available, one graph is built, or
``KADAPT_EXPORT_PROCESSES=1``. The artifacts are the same bytes either way (tested).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import struct
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import IO, Any, NoReturn, Protocol

from ....atomic import write_error
from ....errors import KadaptError
from ....upstream import ContactPointMoved
from .summary import process_mark

Task = tuple[str, Callable[[], Any]]  # a graph's name and what builds it
Report = Callable[[Mapping[str, Any], int, int], tuple[Any, Any]]  # (built, group, groups) -> (sent, kept)
Decide = Callable[[list[Any]], list[Any]]  # every group's report -> each group's decision
Finish = Callable[[Mapping[str, Any], Any, Any], Any]  # (built, kept, decision) -> the group's result
Around = Callable[[], AbstractContextManager[Any]]  # what a group's builds run inside, together

_LENGTH = struct.Struct("<Q")


class Steps(Protocol):
    steps: list[tuple[str, float]]
    echo: Callable[[str], None]

    def record(self, name: str, seconds: float) -> None: ...


class Counter(Protocol):
    count: int


class ExportProcessFailed(RuntimeError):
    """A bug in an export process (neither a user error nor an ``OSError``): its type, message and
    the child's own traceback, which this process's traceback cannot show."""


@dataclass(frozen=True)
class Failure:
    """A child's error as plain data (an exception object may not pickle, or not unpickle whole:
    kadapt's ``Refusal`` takes other ``__init__`` arguments than its ``args``)."""

    kind: str  # the exception's class name
    message: str  # str(exc): a user error's whole located message
    user: bool  # a KadaptError (or a moved contact point): the message is for the user as is
    exit_code: int = 1
    errno: int | None = None  # set for an OSError
    filename: str | None = None
    trace: str = ""

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        user = isinstance(exc, (KadaptError, ContactPointMoved))
        return cls(
            kind=type(exc).__name__,
            message=str(exc),
            user=user,
            exit_code=getattr(exc, "exit_code", 1) if user else 1,
            errno=exc.errno if isinstance(exc, OSError) else None,
            filename=os.fsdecode(exc.filename) if isinstance(exc, OSError) and exc.filename else None,
            trace="".join(traceback.format_exception(exc)),
        )

    def error(self, names: str) -> BaseException:
        """The error to raise here for the export process building ``names``."""
        if self.user:
            error = KadaptError(self.message)
            error.exit_code = self.exit_code
            return error
        if self.kind == "KeyboardInterrupt":  # the child was interrupted before it dropped Python's handler
            return KeyboardInterrupt()
        if self.errno is not None:
            target = self.filename or f"the output of the export process building {names}"
            return write_error(target, OSError(self.errno, os.strerror(self.errno)))
        return ExportProcessFailed(
            f"the export process building {names} failed: {self.kind}: {self.message}\n"
            f"its traceback:\n{self.trace}"
        )


def export_processes() -> int:
    """Processes the exports may use: ``$KADAPT_EXPORT_PROCESSES``, else 2 when this process may run
    on two CPUs and can fork, else 1."""
    if explicit := os.environ.get("KADAPT_EXPORT_PROCESSES"):
        try:
            return max(1, int(explicit))
        except ValueError as exc:
            raise KadaptError(f"KADAPT_EXPORT_PROCESSES={explicit!r} is not a number of processes") from exc
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 2 if cpus > 1 and hasattr(os, "fork") else 1


def groups_of(tasks: Sequence[Task], processes: int) -> list[Sequence[Task]]:
    """``tasks`` in at most ``processes`` contiguous groups, the first ones taking one more when
    they do not divide evenly (one group when this platform cannot fork)."""
    count = max(1, min(processes, len(tasks))) if hasattr(os, "fork") else 1
    size, extra = divmod(len(tasks), count)
    groups, start = [], 0
    for index in range(count):
        end = start + size + (index < extra)
        groups.append(tasks[start:end])
        start = end
    return groups


def in_processes(
    tasks: Sequence[Task],
    *,
    processes: int,
    clock: Steps,
    reach: Mapping[str, Counter],
    report: Report,
    decide: Decide,
    finish: Finish,
    around: Around = nullcontext,
) -> list[Any]:
    """Each group's ``finish`` result, in group order: the tasks built, reported on, decided on and
    finished in one child per group, or here when there is one group (the module docstring says
    what each step is for and how the children stay safe)."""
    groups = groups_of(tasks, processes)
    if len(groups) == 1:
        with around():
            built = {name: build() for name, build in tasks}
        sent, kept = report(built, 0, 1)
        (decision,) = decide([sent])
        return [finish(built, kept, decision)]
    children: list[_Child] = []
    try:
        for index, group in enumerate(groups):
            children.append(_fork(index, len(groups), group, children, clock, reach, report, finish, around))
        start = time.perf_counter()
        reports = [child.expect(clock, reach) for child in children]
        clock.record("wait for exports", time.perf_counter() - start)
        for child, decision in zip(children, decide(reports), strict=True):
            try:
                _send(child.decisions, decision)
            except BrokenPipeError:  # it ended after its report: its error, or how it ended
                child.expect(clock, reach)
                raise KadaptError(f"the export process building {', '.join(child.names)} stopped") from None
        start = time.perf_counter()
        results = [child.expect(clock, reach) for child in children]
        for child in children:
            child.reap()
        clock.record("wait for writes", time.perf_counter() - start)
        return results
    finally:
        for child in children:
            child.close()


@dataclass
class _Child:
    """A forked child, from this process's side: its pid, its messages and its decisions pipe."""

    pid: int
    number: int  # 1-based, as its steps are marked
    names: list[str]
    messages: IO[bytes]
    decisions: IO[bytes]
    reaped: bool = False

    def expect(self, clock: Steps, reach: Mapping[str, Counter]) -> Any:
        """The child's next message (its steps recorded, its reach added); its error raised, or an
        error naming how it ended if it sent nothing."""
        message = _receive(self.messages)
        if message is None:
            _, status = os.waitpid(self.pid, 0)
            self.reaped = True
            names, how = ", ".join(self.names), _ended(status)
            raise KadaptError(f"the export process building {names} ended without a result ({how})")
        if "error" in message:
            raise message["error"].error(", ".join(self.names))
        for name, seconds in message["steps"]:
            clock.record(f"{name}{process_mark(self.number)}", seconds)
        for patch, calls in message["reach"].items():
            reach[patch].count += calls
        return message["value"]

    def reap(self) -> None:
        os.waitpid(self.pid, 0)
        self.reaped = True

    def close(self) -> None:
        """Kill and reap the child if it still runs; close this side of its pipes."""
        if not self.reaped:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            self.reaped = True
        for pipe in (self.messages, self.decisions):
            with contextlib.suppress(OSError):
                pipe.close()


def _fork(
    index: int,
    groups: int,
    tasks: Sequence[Task],
    siblings: Sequence[_Child],
    clock: Steps,
    reach: Mapping[str, Counter],
    report: Report,
    finish: Finish,
    around: Around,
) -> _Child:
    messages_read, messages_write = os.pipe()
    decisions_read, decisions_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        for fd in (messages_read, decisions_write):
            os.close(fd)
        for sibling in siblings:  # else a sibling's pipes stay open here: no end-of-file for it
            for pipe in (sibling.messages, sibling.decisions):
                os.close(pipe.fileno())
        _child(index, groups, tasks, messages_write, decisions_read, clock, reach, report, finish, around)
    os.close(messages_write)
    os.close(decisions_read)
    names = [name for name, _ in tasks]
    return _Child(pid, index + 1, names, os.fdopen(messages_read, "rb"), os.fdopen(decisions_write, "wb"))


def _child(
    index: int,
    groups: int,
    tasks: Sequence[Task],
    messages: int,
    decisions: int,
    clock: Steps,
    reach: Mapping[str, Counter],
    report: Report,
    finish: Finish,
    around: Around,
) -> NoReturn:
    """Build ``tasks``, send the report, wait for the decision, finish and send the result (or the
    error, at any point) through ``messages``; never returns."""
    out = os.fdopen(messages, "wb")
    try:
        with contextlib.suppress(ValueError):  # forked from another thread: that thread's handlers
            for number in (signal.SIGINT, signal.SIGTERM):  # not the CLI's: a child just ends
                signal.signal(number, signal.SIG_DFL)
        import torch

        torch.set_num_threads(1)
        clock.echo = _silent  # the parent says the child's steps when it has them (stdout stays its)
        before = {patch: counter.count for patch, counter in reach.items()}
        done = len(clock.steps)

        def message(value: Any) -> dict[str, Any]:
            nonlocal done
            steps, done = clock.steps[done:], len(clock.steps)
            counts = {patch: counter.count - before[patch] for patch, counter in reach.items()}
            before.update({patch: counter.count for patch, counter in reach.items()})
            return {"value": value, "steps": steps, "reach": counts}

        with around():
            built = {name: build() for name, build in tasks}
        sent, kept = report(built, index, groups)
        _send(out, message(sent))
        with os.fdopen(decisions, "rb") as pipe:
            decision = _receive(pipe)
        if decision is None:  # the parent is gone, or gave up on this run
            os._exit(1)
        _send(out, message(finish(built, kept, decision)))
    except BaseException as exc:  # noqa: BLE001 - every failure is the parent's to report
        with contextlib.suppress(BaseException):
            _send(out, {"error": Failure.of(exc)})
    finally:
        os._exit(0)


def _send(pipe: IO[bytes], value: Any) -> None:
    """``value`` pickled, after its length; a value pickle cannot carry is sent as an error."""
    try:
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - a value pickle cannot carry
        failure = Failure.of(ExportProcessFailed(f"its result could not be sent ({exc})"))
        payload = pickle.dumps({"error": failure}, protocol=pickle.HIGHEST_PROTOCOL)
    pipe.write(_LENGTH.pack(len(payload)))
    pipe.write(payload)
    pipe.flush()


def _receive(pipe: IO[bytes]) -> Any:
    """The next value ``_send`` sent through ``pipe``; None at end of file (the sender is gone)."""
    header = pipe.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(header)
    payload = pipe.read(length)
    if len(payload) < length:
        return None
    return pickle.loads(payload)  # noqa: S301 - our own processes, through our own pipe


def _silent(_: str) -> None:
    """A child's echo: nothing (see ``_child``)."""


def _ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"
