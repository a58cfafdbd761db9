"""Exports in two processes: the graphs of one run traced half here, half in a forked child.

Tracing is CPU-bound Python (``torch.export``), one graph at a time, and a run builds two to four
graphs. With two CPUs the child takes the second half (Kimi-K2.5: prefill_mm and vision; measured,
4.1 s of tracing became 2.6 s). Fork, not spawn: the child starts with the spec applied, the model
on meta and every import done, which a new interpreter would spend the import floor redoing. Only
its graphs come back (pickled: ~1.5 MB for Kimi-K2.5), with the clock steps it took and how many
calls reached each patch (the ledger reports a run's reach, so the child's counts are added here).
A caller may also have the child ``summarize`` its graphs while this process finishes its own half
(the pipeline: the weight map of the child's graphs, which the run uses when it is the whole run's).

Safety:
- the child sets torch's intra-op threads to 1 before any op: the OpenMP pool this process used
  before the fork (the whole-model check runs the model on CPU) hangs a forked child that enters a
  parallel region (measured: a matmul in such a child never returns); one thread never enters it;
- the child ends with ``os._exit``: none of this process's cleanup (taking patches back, removing
  temp files) runs twice, and it writes nothing but its result;
- an error in the child is raised here (a ``KadaptError`` with its message if it cannot be sent);
  a child that ends without a result is an error naming how it ended; an error or Ctrl-C here kills
  and reaps the child. Ctrl-C in the child's terminal ends it at once (default SIGINT).
One process where ``os.fork`` is missing, one CPU is available, one graph is built, or
``KADAPT_EXPORT_PROCESSES=1``. The artifacts are the same bytes either way (tested).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, Protocol

from ...errors import KadaptError
from .summary import SECOND_PROCESS

Task = tuple[str, Callable[[], Any]]  # a graph's name and what builds it


class Steps(Protocol):
    steps: list[tuple[str, float]]
    echo: Callable[[str], None]

    def record(self, name: str, seconds: float) -> None: ...


class Counter(Protocol):
    count: int


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


def build_all(
    tasks: Sequence[Task],
    *,
    processes: int,
    clock: Steps,
    reach: Mapping[str, Counter],
    summarize: Callable[[Mapping[str, Any]], Any] | None = None,
) -> tuple[dict[str, Any], Any]:
    """Each task's result by name, in task order: the first half built here, the rest in a child
    when ``processes`` > 1 (the module docstring says how it stays safe); and ``summarize`` of the
    child's results, computed in the child while this process finishes its half (None with one
    process: a caller computes what it needs from all the results)."""
    if processes < 2 or len(tasks) < 2 or not hasattr(os, "fork"):
        return {name: build() for name, build in tasks}, None
    split = (len(tasks) + 1) // 2
    mine, theirs = tasks[:split], tasks[split:]
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _child(theirs, summarize, write_end, clock, reach)
    os.close(write_end)
    reaped = False
    try:
        built = {name: build() for name, build in mine}
        start = time.perf_counter()
        with os.fdopen(read_end, "rb") as pipe:
            read_end = -1
            payload = pipe.read()
        _, status = os.waitpid(pid, 0)
        reaped = True
        clock.record("join second process", time.perf_counter() - start)
        graphs, summary = _received(payload, status, [name for name, _ in theirs], clock, reach)
        built.update(graphs)
    finally:
        if read_end != -1:
            os.close(read_end)
        if not reaped:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    return {name: built[name] for name, _ in tasks}, summary


def _child(
    tasks: Sequence[Task],
    summarize: Callable[[Mapping[str, Any]], Any] | None,
    write_end: int,
    clock: Steps,
    reach: Mapping[str, Counter],
) -> NoReturn:
    """Build ``tasks`` (and ``summarize`` them) and send the result (or the error) through
    ``write_end``; never returns."""
    try:
        with contextlib.suppress(ValueError):  # forked from another thread: that thread's handlers
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        import torch

        torch.set_num_threads(1)
        clock.echo = _silent  # the parent says the child's steps when it has them (stdout stays its)
        before = {patch: counter.count for patch, counter in reach.items()}
        done = len(clock.steps)
        graphs = {name: build() for name, build in tasks}
        result: dict[str, Any] = {
            "graphs": graphs,
            "summary": summarize(graphs) if summarize is not None else None,
            "steps": clock.steps[done:],
            "reach": {patch: counter.count - before[patch] for patch, counter in reach.items()},
        }
    except BaseException as exc:  # noqa: BLE001 - every failure is the parent's to report
        # class, args and attributes: an exception whose __init__ takes other arguments than its
        # args (kadapt's Refusal) does not unpickle whole
        result = {"error": (type(exc), exc.args, vars(exc))}
    try:
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - an error or graph pickle cannot carry
        error = result.get("error")
        message = str(error[1]) if error is not None else f"its graphs could not be sent ({exc})"
        payload = pickle.dumps({"error": (KadaptError, (f"export process: {message}",), {})})
    try:
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(payload)
    finally:
        os._exit(0)


def _silent(_: str) -> None:
    """The child's echo: nothing (see ``_child``)."""


def _received(
    payload: bytes, status: int, names: list[str], clock: Steps, reach: Mapping[str, Counter]
) -> tuple[dict[str, Any], Any]:
    """The child's graphs and summary; its steps echoed and added to ``clock``, its reach added to
    ``reach``."""
    if not payload:
        raise KadaptError(
            f"the export process building {', '.join(names)} ended without a result ({_ended(status)})"
        )
    result = pickle.loads(payload)  # noqa: S301 - our own child, through our own pipe
    if "error" in result:
        kind, args, state = result["error"]
        error = kind.__new__(kind, *args)
        error.args = args
        error.__dict__.update(state)
        raise error
    for name, seconds in result["steps"]:
        clock.record(f"{name}{SECOND_PROCESS}", seconds)
    for patch, calls in result["reach"].items():
        reach[patch].count += calls
    return result["graphs"], result["summary"]


def _ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"
