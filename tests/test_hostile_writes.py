"""A full disk (issue 34 item 6): every way kadapt writes an artifact ends, when the disk or a
file-size limit refuses the bytes, with ``error: cannot write PATH: <why>`` (exit 1), no traceback,
no temp file and the previous files untouched; the extraction cache's own store stays silent.

The kernel's own refusal is used where it can be: ``RLIMIT_FSIZE`` with SIGXFSZ ignored makes a
write past the limit fail with ``EFBIG`` ("File too large"), as ``ulimit -f`` does; the ``kadapt
apply`` cases run in a subprocess under that limit (one process, forked export processes, a cache
restore). Errors the limit cannot produce (``ENOSPC``, ``EDQUOT``, ``EIO``) are raised by the
syscall they come from. A forked child's failure comes back as data (``forked.Failure``) and is
raised here as one error.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_adapter_core import atomic
from kimi_adapter_core.atomic import atomic_write_bytes, atomic_write_text
from kimi_adapter_core.backends.extraction.job import forked
from kimi_adapter_core.backends.extraction.job.cache import ExtractionCache
from kimi_adapter_core.backends.extraction.job.summary import ExtractionSummary
from kimi_adapter_core.backends.extraction.job.write import write_all
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError, Refusal, UsageError

REPO = Path(__file__).resolve().parents[1]
LLAMA = REPO / "specs" / "llama.yaml"
LIMIT = 64 * 1024  # bytes: the llama IR (~1 MB) does not fit, its weight map (~30 kB) does
FORKS = pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")


def _leftovers(folder: Path) -> list[str]:
    """Hidden or temp files left in ``folder`` (a write that failed must remove its temp file)."""
    if not folder.exists():
        return []
    return sorted(p.name for p in folder.rglob("*") if p.name.startswith(".") or p.suffix == ".tmp")


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """This process may not grow a file past ``limit`` bytes in the block: ``EFBIG``, as a full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


# -- in process: the writers themselves ----------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=6000), min_size=1, max_size=4),
    limit=st.integers(min_value=0, max_value=8000),
)
def test_write_all_under_a_size_limit_writes_everything_or_nothing(tmp_path_factory, sizes, limit):
    """Whatever the files' sizes and the limit: either every file is written whole, or the error is
    ``cannot write <one of them>: File too large`` and the folder holds exactly what it held."""
    folder = tmp_path_factory.mktemp("out")
    targets = [folder / f"f{index}.json" for index in range(len(sizes))]
    targets[0].write_text("previous")
    texts = {target: "x" * size for target, size in zip(targets, sizes, strict=True)}
    try:
        with file_size_limit(limit):
            write_all({target: [text[:7], text[7:]] for target, text in texts.items()})
    except KadaptError as exc:
        assert max(sizes) > limit
        assert str(exc).startswith("cannot write ") and str(exc).endswith(": File too large"), exc
        assert str(exc).split(": ")[0].removeprefix("cannot write ") in {str(t) for t in targets}
        assert sorted(p.name for p in folder.iterdir()) == ["f0.json"]
        assert targets[0].read_text() == "previous"
    else:
        assert max(sizes) <= limit
        assert {target: target.read_text() for target in targets} == texts


@pytest.mark.parametrize("write", [atomic_write_text, atomic_write_bytes])
def test_atomic_write_past_the_limit_is_cannot_write(tmp_path, write):
    target = tmp_path / "artifact.json"
    target.write_text("{}")
    data = "x" * 10_000
    with pytest.raises(KadaptError, match=rf"^cannot write {target}: File too large$"):
        with file_size_limit(4096):
            write(target, data.encode() if write is atomic_write_bytes else data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact.json"]
    assert target.read_text() == "{}"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
@pytest.mark.parametrize("where", ["open", "fsync", "replace"])
def test_each_step_of_an_atomic_write_failing_is_cannot_write(tmp_path, monkeypatch, code, where):
    """The disk refusing at the temp file's creation, at the sync or at the rename."""
    real = {"open": os.open, "fsync": os.fsync, "replace": os.replace}[where]

    def refused(*args: Any, **kwargs: Any) -> Any:
        if where == "open":
            real(*args, **kwargs)  # created, then the call fails: it must still be removed
        raise OSError(code, os.strerror(code))

    target = tmp_path / "artifact.json"
    with monkeypatch.context() as patched:
        patched.setattr(os, where, refused)
        with pytest.raises(KadaptError, match=rf"^cannot write {target}: {os.strerror(code)}$"):
            atomic_write_text(target, "{}")
    assert list(tmp_path.iterdir()) == []


def test_the_chunks_own_errors_pass_through(tmp_path):
    """Only the writes' errors are ``cannot write``: a bug in what produces the text is not."""

    def chunks() -> Iterator[str]:
        yield "{"
        raise FileNotFoundError(errno.ENOENT, "a file the serialiser reads", "missing.bin")

    with pytest.raises(FileNotFoundError, match="missing.bin"):
        atomic.write_new(tmp_path / ".a.tmp", chunks(), target=tmp_path / "a.json")


# -- forked export processes: a child's failure comes back as data -----------------------------


@pytest.mark.parametrize(
    ("raised", "expected", "message"),
    [
        (
            OSError(errno.ENOSPC, "No space left on device", "/out/x.json"),
            KadaptError,
            "cannot write /out/x.json: No space left on device",
        ),
        (
            OSError(errno.EFBIG, "File too large"),
            KadaptError,
            "cannot write the output of the export process building decode: File too large",
        ),
        (Refusal("stack-differs", "no stack"), KadaptError, "refused (stack-differs): no stack"),
        (KadaptError("bad size", location="spec.yaml:3:1"), KadaptError, "spec.yaml:3:1: bad size"),
        (
            TypeError("a bug"),
            forked.ExportProcessFailed,
            "the export process building decode failed: TypeError: a bug",
        ),
        (KeyboardInterrupt(), KeyboardInterrupt, ""),
    ],
)
def test_a_childs_failure_is_raised_here_as_one_error(raised, expected, message):
    try:
        raise raised
    except BaseException as exc:  # noqa: BLE001 - a traceback, as a child has one
        failure = forked.Failure.of(exc)
    error = failure.error("decode")
    assert type(error) is expected
    assert str(error).startswith(message)
    if expected is forked.ExportProcessFailed:  # a bug keeps the child's traceback
        assert "its traceback:" in str(error) and "raise raised" in str(error)


def test_a_childs_usage_error_keeps_its_exit_status():
    error = forked.Failure.of(UsageError("--tp 3 does not divide 32 heads")).error("decode")
    assert isinstance(error, KadaptError) and error.exit_code == 2


class _Clock:
    """What ``in_processes`` records its children's steps on."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, float]] = []
        self.echo = print

    def record(self, name: str, seconds: float) -> None:
        self.steps.append((name, seconds))


@FORKS
def test_a_child_that_cannot_write_is_cannot_write_here():
    """A child's ``OSError`` while finishing (the disk full under its writes) is the parent's
    ``cannot write`` error, naming the graphs of the child that failed."""

    def finish(built: Any, kept: Any, decision: Any) -> Any:
        if "b" in built:
            raise OSError(errno.ENOSPC, "No space left on device")
        return "ok"

    with pytest.raises(KadaptError) as caught:
        forked.in_processes(
            [("a", lambda: 1), ("b", lambda: 2)],
            processes=2,
            clock=_Clock(),
            reach={},
            report=lambda built, group, groups: (None, None),
            decide=lambda reports: ["go" for _ in reports],
            finish=finish,
        )
    assert str(caught.value) == (
        "cannot write the output of the export process building b: No space left on device"
    )


# -- kadapt apply under a file-size limit, in a subprocess --------------------------------------


def _apply_limited(out: Path, *extra: str, processes: int = 1) -> subprocess.CompletedProcess[str]:
    """``kadapt apply specs/llama.yaml`` with files limited to ``LIMIT`` bytes, as ``ulimit -f``."""

    def limit() -> None:  # in the child, before exec: the limit is inherited by forked exporters too
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))

    return subprocess.run(
        [sys.executable, "-m", "kimi_adapter_core", "apply", str(LLAMA), "--output-dir", str(out), *extra],
        preexec_fn=limit,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "KADAPT_EXPORT_PROCESSES": str(processes)},
        timeout=600,
    )


def _assert_cannot_write(ran: subprocess.CompletedProcess[str], out: Path) -> None:
    assert ran.returncode == 1, ran.stderr[-3000:]
    assert "Traceback" not in ran.stderr, ran.stderr[-3000:]
    (line,) = [line for line in ran.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: cannot write {out}/") and line.endswith(": File too large"), line
    assert _leftovers(out) == []


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=FORKS)])
def test_apply_on_a_full_disk_is_cannot_write_in_one_process_and_in_two(tmp_path, processes):
    out = tmp_path / "out"
    out.mkdir()
    (out / "llama_prefill_ir.json").write_text('{"previous": true}')
    ran = _apply_limited(out, "--no-cache", processes=processes)
    _assert_cannot_write(ran, out)
    assert sorted(p.name for p in out.iterdir()) == ["llama_prefill_ir.json"]  # nothing renamed
    assert (out / "llama_prefill_ir.json").read_text() == '{"previous": true}'


@pytest.mark.slow
def test_the_cache_on_a_full_disk_stores_silently_and_restores_as_cannot_write(
    tmp_path, monkeypatch, _private_extraction_cache
):
    """Restoring an entry into an output folder the disk refuses is ``cannot write`` and the entry
    stays; storing an entry the disk refuses is only the reason it was not stored."""
    root = _private_extraction_cache  # KADAPT_CACHE_DIR, for the subprocess too
    args = ["apply", str(LLAMA), "--format", "json", "--output-dir", str(tmp_path / "first")]
    stored = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert stored.exit_code == 0 and json.loads(stored.stdout)["extraction"]["cache"]["stored"] is True
    (entry,) = [p for p in root.iterdir() if not p.name.startswith(".")]

    out = tmp_path / "restored"
    ran = _apply_limited(out)
    _assert_cannot_write(ran, out)
    assert "extracting" not in ran.stdout and "restored" not in ran.stdout  # the restore failed
    assert not out.exists() or list(out.iterdir()) == []
    assert (entry / "entry.json").is_file()  # a disk that refuses the output does not damage the entry

    kv_mapping = tmp_path / "first" / "llama_kv_mapping.json"
    summary = ExtractionSummary(model_name="llama", kv_layout="heads", sizes={}, kv_mapping=kv_mapping)
    full = ExtractionCache(tmp_path / "full")
    real_write_bytes = Path.write_bytes

    def no_space_under(path: Path, data: bytes) -> int:
        if full.root in path.parents:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write_bytes(path, data)

    with monkeypatch.context() as patched:
        patched.setattr(Path, "write_bytes", no_space_under)
        why = full.store(entry.name, {}, summary, {})
    assert why == f"cannot write the cache at {full.root}: No space left on device"
    assert list(full.root.iterdir()) == []  # its temp folder removed
