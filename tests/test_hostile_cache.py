"""Hostile extraction-cache entries (issue 34): a damaged or tampered entry never writes outside the
output directory, never raises, is dropped with its reason, and the next run extracts and stores again.

Each case of ``hostile/cache/*.json`` edits a good entry, stored by one real ``kadapt apply`` of the
llama spec, and names the reason it must be dropped with (``dropped``, a part of the reason):

- ``entry_file``: entry.json becomes that raw file of ``hostile/cache/raw/`` (a list, 10,000 levels
  deep, cut short, not UTF-8, non-finite numbers);
- ``list``: each name is added to the entry's file list with the sha256 and size of the stored file it
  maps to, whose bytes are planted where the name points (``{outside}``: a folder outside the output
  and the cache), so only the name itself can give it away;
- ``unlist`` / ``remove``: names taken off the list / stored files deleted;
- ``set`` / ``delete``: values of entry.json at ``/``-separated paths.

Cases that need a filesystem shape (a FIFO, symlinks, a file where the entry folder belongs) are
built here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kimi_adapter_core.backends.extraction.job import cache as cache_module
from kimi_adapter_core.backends.extraction.job.cache import ExtractionCache
from kimi_adapter_core.backends.extraction.job.summary import ExtractionSummary
from kimi_adapter_core.cli import cli

REPO = Path(__file__).resolve().parents[1]
LLAMA = REPO / "specs" / "llama.yaml"
CASES = Path(__file__).parent / "hostile" / "cache"
DECODE = "llama_decode_ir.json"


def apply(out: Path) -> dict[str, Any]:
    result = CliRunner().invoke(
        cli, ["apply", str(LLAMA), "--output-dir", str(out), "--format", "json"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def snapshot(root: Path, cache: Path) -> dict[str, tuple[int, int, int]]:
    """Every file below ``root`` but the cache, with inode, mtime and size: any write shows."""
    found = {}
    for path in root.rglob("*"):
        if cache not in path.parents and not path.is_dir():
            info = path.lstat()
            found[str(path.relative_to(root))] = (info.st_ino, info.st_mtime_ns, info.st_size)
    return found


@pytest.fixture(scope="module")
def stored(shipped_apply: Any) -> tuple[Path, Path]:
    """A good entry (its folder, named by its key) and the output folder of the run that stored it:
    the shared first run of the llama spec (``fixtures/shared_apply.py``), which has its own cache."""
    run = shipped_apply("llama")
    assert run.exit_code == 0, run.output
    (entry,) = (run.out.parent / "cache").iterdir()
    return entry, run.out


@pytest.fixture
def planted(stored: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the good entry in a fresh cache root below ``tmp_path`` (entry folder, output folder)."""
    entry = tmp_path / "cache" / "root" / stored[0].name
    shutil.copytree(stored[0], entry)
    (tmp_path / "outside").mkdir()
    out = tmp_path / "run" / "out"
    out.mkdir(parents=True)
    return entry, out


def _at(document: Any, path: str) -> tuple[Any, str]:
    *parents, last = path.split("/")
    for key in parents:
        document = document[key]
    return document, last


def _expanded(value: Any, outside: Path) -> Any:
    return value.replace("{outside}", str(outside)) if isinstance(value, str) else value


def tamper(entry: Path, case: dict[str, Any], outside: Path) -> None:
    """Apply ``case`` (see the module docstring) to the entry folder ``entry``."""
    if "entry_file" in case:
        shutil.copyfile(CASES / case["entry_file"], entry / "entry.json")
        return
    document = json.loads((entry / "entry.json").read_text(encoding="utf-8"))
    for name, source in case.get("list", {}).items():
        name = _expanded(name, outside)
        blob = (entry / source).read_bytes()
        (entry / name).parent.mkdir(parents=True, exist_ok=True)
        (entry / name).write_bytes(blob)
        document["files"][name] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    for name in case.get("unlist", []):
        del document["files"][name]
    for name in case.get("remove", []):
        (entry / name).unlink()
    for path, value in case.get("set", {}).items():
        parent, key = _at(document, path)
        parent[key] = _expanded(value, outside)
    for path in case.get("delete", []):
        parent, key = _at(document, path)
        del parent[key]
    (entry / "entry.json").write_text(json.dumps(document), encoding="utf-8")


def assert_dropped(entry: Path, out: Path, reason: str, *, outside_of: Path) -> ExtractionCache:
    """Restoring ``entry`` returns nothing, writes nothing anywhere, removes it and says ``reason``."""
    cache = ExtractionCache(entry.parent)
    before = snapshot(outside_of, entry.parent)
    assert cache.restore(entry.name, out, "llama") is None
    assert snapshot(outside_of, entry.parent) == before
    assert not os.path.lexists(entry)
    (note,) = cache.dropped
    assert note.startswith(f"extraction cache entry {entry.name[:12]} removed: "), note
    assert reason in note, note
    return cache


def assert_stored_again(cache: ExtractionCache, stored: tuple[Path, Path], out: Path) -> None:
    """Never sticky: the run that extracts again stores under the same key, and the next restores."""
    good, good_out = stored
    record = json.loads((good / "entry.json").read_text(encoding="utf-8"))
    summary = ExtractionSummary.from_record(record["summary"], good_out)
    assert cache.store(good.name, record["parts"], summary, record["reach"]) is None
    restored = cache.restore(good.name, out, "llama")
    assert restored is not None and [p.name for p in restored.summary.artifacts] == list(record["files"])
    assert files(out) == files(good_out)


@pytest.mark.parametrize("case", sorted(CASES.glob("*.json")), ids=lambda path: path.stem)
def test_hostile_entry_is_dropped_and_stored_again(
    case: Path, stored: tuple[Path, Path], planted: tuple[Path, Path], tmp_path: Path
) -> None:
    spec = json.loads(case.read_text(encoding="utf-8"))
    entry, out = planted
    tamper(entry, spec, tmp_path / "outside")
    cache = assert_dropped(entry, out, _expanded(spec["dropped"], tmp_path / "outside"), outside_of=tmp_path)
    assert list(out.iterdir()) == []
    assert_stored_again(cache, stored, out)


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging (a FIFO opened for reading blocks until a writer comes)."""

    def expired(*_: Any) -> None:
        raise AssertionError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _symlink_outside(path: Path) -> None:
    """The same bytes (the sha256 matches) but through a symlink to a file outside the entry."""
    copy = path.parents[2] / "elsewhere.json"
    shutil.copyfile(path, copy)
    path.unlink()
    path.symlink_to(copy)


@pytest.mark.parametrize(
    ("shape", "name", "reason"),
    [
        (_fifo, DECODE, f"{DECODE} is not a regular file"),
        (_symlink_outside, DECODE, f"{DECODE} is a symbolic link"),
        (_symlink_outside, "entry.json", "entry.json is a symbolic link"),
    ],
    ids=["fifo", "file-symlink", "entry-json-symlink"],
)
def test_stored_files_must_be_regular_files_of_the_entry(
    shape: Any, name: str, reason: str, stored: tuple[Path, Path], planted: tuple[Path, Path], tmp_path: Path
) -> None:
    entry, out = planted
    shape(entry / name)
    with deadline(10):
        cache = assert_dropped(entry, out, reason, outside_of=tmp_path)
    assert (tmp_path / "cache" / "elsewhere.json").exists() == (shape is _symlink_outside)
    assert_stored_again(cache, stored, out)


def test_an_entry_that_is_no_folder_is_removed_not_followed(
    stored: tuple[Path, Path], planted: tuple[Path, Path], tmp_path: Path
) -> None:
    entry, out = planted
    target = tmp_path / "outside" / "entry-copy"
    entry.rename(target)
    entry.symlink_to(target)
    assert_dropped(entry, out, "it is not a directory", outside_of=tmp_path)
    assert (target / "entry.json").is_file()  # the symlink went, never what it points to
    entry.write_text("a file where the entry folder belongs")
    cache = assert_dropped(entry, out, "it is not a directory", outside_of=tmp_path)
    assert_stored_again(cache, stored, out)


def test_a_run_over_a_hostile_entry_extracts_and_stores_a_whole_one(
    stored: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end through ``kadapt apply``: the traversal case is planted under the key the run looks
    up (kadapt's own files are part of the key, so the stored entry's key may be another one)."""
    root = tmp_path / "cache" / "root"
    monkeypatch.setenv("KADAPT_CACHE_DIR", str(root))
    case = json.loads((CASES / "traversal_name.json").read_text(encoding="utf-8"))
    real_key = cache_module.run_key

    def planting(*args: Any, **kwargs: Any) -> Any:
        key = real_key(*args, **kwargs)
        shutil.copytree(stored[0], root / key.digest)
        tamper(root / key.digest, {**case, "set": {**case["set"], "key": key.digest}}, tmp_path / "outside")
        return key

    monkeypatch.setattr(cache_module, "run_key", planting)
    out = tmp_path / "run" / "out"
    doc = apply(out)
    cache = doc["extraction"]["cache"]
    assert (cache["hit"], cache["stored"]) == (False, True)
    assert [n for n in doc["extraction"]["notes"] if "removed" in n] == [
        f"extraction cache entry {cache['key'][:12]} removed: {case['dropped']}"
    ]
    assert not (tmp_path / "escape.json").exists() and files(out) == files(stored[1])
    restored = ExtractionCache(root).restore(cache["key"], tmp_path / "next", "llama")  # the next run's
    assert restored is not None and files(tmp_path / "next") == files(stored[1])
