"""The extraction cache: a finished run's artifacts stored under its key and restored byte for byte.

``kadapt apply`` spends most of its time tracing graphs that the previous run with the same inputs
already traced. ``cache_key.run_key`` hashes every input that can change an artifact; a run whose
key is stored writes the stored files instead of extracting (issue #23: a second run at the import
floor). What a run reports besides its files (graph statistics, notes, and which patches the
export reached, which the ledger shows) is stored with them, so a restored run says the same.

Layout: ``<root>/<key>/`` holds the artifacts as written plus ``entry.json`` (key and the digest of
each part, kadapt version, the sha256 and size of each file, the summary, the patch reach counts).
An entry is written to a hidden temp directory and renamed into place, so a reader sees a whole
entry or none, and of two processes storing one key the first wins. Entries beyond ``MAX_ENTRIES``,
least recently used first, are removed. A cache that cannot be written (read-only home, full disk)
never fails a run: the summary says why nothing was stored.

An entry is read as untrusted data. It is restored only when ``entry.json`` is a JSON object of this
format and key; every file it lists has a plain name a run writes (``<file_prefix>_<kind>.json``: no
separator, no ``..``, never absolute), is a regular file in the entry (no symlink, FIFO or device;
nothing is opened that could block) of the recorded size and sha256; the stored summary rebuilds and
renders, and its artifacts are exactly the listed files, in order, each directly in the output
directory. Anything else (any JSON shape, any nesting, any missing or extra file) drops the entry:
it is removed, the reason goes to ``ExtractionCache.dropped`` (the run's notes), and the run extracts
and stores a fresh entry, so no damage outlives one run.

The root is ``$KADAPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/kadapt/extraction``, else
``~/.cache/kadapt/extraction``; ``kadapt apply --no-cache`` neither reads nor writes it. The recorded
hashes catch damage, not tampering: whoever can write the cache can write what a run restores, so it
is trusted like the output directory (keep ``$KADAPT_CACHE_DIR`` out of reach of other users).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .... import __version__
from .cache_key import Uncacheable, run_key
from .summary import CacheUse, ExtractionSummary
from .write import write_all

if TYPE_CHECKING:
    from torch import nn

    from ....patching.session import Session
    from ....spec.model import Spec
    from ..options import ExtractionOptions

ENTRY_FORMAT = 1
MAX_ENTRIES = 16  # a full-size Kimi-K2.5 entry is ~17 MB
_ENTRY = "entry.json"
_STALE_TEMP_SECONDS = 24 * 3600  # a temp directory this old belongs to a run that died
_ENTRY_LIMIT = 16 * 2**20  # bytes of entry.json read at most (a run's is a few kB)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_OPEN = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
# What reading a malformed entry can raise besides OSError: bad JSON or UTF-8 (ValueError), a value of
# the wrong shape (KeyError, TypeError, AttributeError, IndexError), nesting past the recursion limit.
_MALFORMED = (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError, RecursionError)


def default_root() -> Path:
    """``$KADAPT_CACHE_DIR``, else the user cache directory's ``kadapt/extraction``."""
    if explicit := os.environ.get("KADAPT_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kadapt" / "extraction"


def usage(root: Path) -> dict[str, Any]:
    """Where the cache is, how many entries it holds and their bytes (``kadapt doctor`` says it)."""
    entries = [p for p in root.iterdir() if not p.name.startswith(".")] if root.is_dir() else []
    size = 0
    for entry in entries:
        with contextlib.suppress(OSError):  # pruned by another run meanwhile
            size += sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
    return {"path": str(root), "entries": len(entries), "bytes": size}


@dataclass(frozen=True)
class Restored:
    summary: ExtractionSummary
    reach: dict[str, int]  # patch id -> calls the stored run's export made through it


class ExtractionCache:
    """Entries under ``root``; see the module docstring."""

    def __init__(self, root: Path, max_entries: int = MAX_ENTRIES) -> None:
        self.root = root
        self.max_entries = max_entries
        self.dropped: list[str] = []  # entries found damaged and removed, with why

    def restore(self, digest: str, output_dir: Path, prefix: str) -> Restored | None:
        """Write entry ``digest``'s files into ``output_dir`` (all or nothing); None if absent or damaged
        (then dropped). ``prefix`` is the run's ``file_prefix``: every listed name must be one it writes."""
        entry_dir = self.root / digest
        if not os.path.lexists(entry_dir):
            return None
        try:
            entry = _entry(entry_dir, digest)
            files = _listed_files(entry, prefix)
            texts = {output_dir / name: [_stored_text(entry_dir / name, *m)] for name, m in files.items()}
            summary = _stored_summary(entry, output_dir, list(files))
            reach = _stored_reach(entry)
        except _Damaged as exc:
            if not os.path.lexists(entry_dir):  # pruned by another run meanwhile: nothing to drop
                return None
            return self._drop(entry_dir, str(exc))
        write_all(texts)
        with contextlib.suppress(OSError):
            os.utime(entry_dir / _ENTRY)  # recently used: pruned last
        return Restored(summary, reach)

    def store(
        self, digest: str, parts: Mapping[str, str], summary: ExtractionSummary, reach: Mapping[str, int]
    ) -> str | None:
        """Keep the run's artifacts under ``digest``; returns why not when they could not be stored."""
        temp = self.root / f".{digest}.{secrets.token_hex(6)}.tmp"
        try:
            temp.mkdir(parents=True)
            files = {}
            for path in summary.artifacts:
                blob = path.read_bytes()
                (temp / path.name).write_bytes(blob)
                files[path.name] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
            entry = {
                "format": ENTRY_FORMAT,
                "key": digest,
                "parts": dict(parts),
                "kadapt": __version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "files": files,
                "summary": summary.to_record(),
                "reach": dict(reach),
            }
            (temp / _ENTRY).write_text(json.dumps(entry, indent=1), encoding="utf-8")
            try:
                temp.rename(self.root / digest)
            except OSError:
                if not (self.root / digest).is_dir():
                    raise
                # another process stored the same key first: its entry is as good as ours
        except OSError as exc:
            return f"cannot write the cache at {self.root}: {exc.strerror or exc}"
        finally:
            shutil.rmtree(temp, ignore_errors=True)
        self.prune()
        return None

    def prune(self) -> None:
        """Remove entries beyond ``max_entries`` (least recently used first) and dead temp directories."""
        try:
            children = list(self.root.iterdir())
        except OSError:
            return
        now = time.time()
        entries = []
        for child in children:
            if child.name.startswith("."):
                if now - _mtime(child) > _STALE_TEMP_SECONDS:
                    shutil.rmtree(child, ignore_errors=True)
            else:  # a directory without its entry file is no entry: it goes first
                entries.append((_mtime(child / _ENTRY), child))
        for _, child in sorted(entries, reverse=True)[self.max_entries :]:
            shutil.rmtree(child, ignore_errors=True)

    def _drop(self, entry_dir: Path, why: str) -> None:
        """Remove a damaged entry (the run then extracts) and remember why, for the run's notes."""
        if entry_dir.is_dir() and not entry_dir.is_symlink():
            shutil.rmtree(entry_dir, ignore_errors=True)
        else:  # a file or a symlink where an entry directory belongs: remove it, never what it points to
            with contextlib.suppress(OSError):
                entry_dir.unlink()
        self.dropped.append(f"extraction cache entry {entry_dir.name[:12]} removed: {why}")


class _Damaged(Exception):
    """Why an entry cannot be restored (the message becomes the reason it is dropped)."""


@contextlib.contextmanager
def _reading(what: str) -> Iterator[None]:
    """Any failure to read or interpret ``what`` inside the block becomes ``_Damaged`` naming it."""
    try:
        yield
    except FileNotFoundError as exc:
        raise _Damaged(f"{what} is missing") from exc
    except OSError as exc:
        why = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be read ({exc.strerror or exc})"
        raise _Damaged(f"{what} {why}") from exc
    except _MALFORMED as exc:
        raise _Damaged(f"{what} is malformed ({type(exc).__name__}: {_shortened(exc)})") from exc


def _shortened(value: object, limit: int = 160) -> str:
    """``str(value)`` cut to ``limit`` characters (a KeyError may print a whole record)."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_regular(path: Path, limit: int) -> bytes:
    """The bytes of ``path`` when it is a regular file of at most ``limit`` bytes.

    Opened without following a symlink and without blocking (a FIFO or device is refused after
    ``fstat``, before any read), so an entry can neither point outside itself nor hang a run."""
    fd = os.open(path, _OPEN)
    with open(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _Damaged(f"{path.name} is not a regular file")
        if info.st_size > limit:
            raise _Damaged(f"{path.name} holds {info.st_size} bytes, more than {limit}")
        return handle.read(limit)


def _entry(entry_dir: Path, digest: str) -> dict[str, Any]:
    """``entry.json`` of ``entry_dir``: a JSON object of this format written for ``digest``."""
    if not entry_dir.is_dir() or entry_dir.is_symlink():
        raise _Damaged("it is not a directory")
    with _reading(_ENTRY):
        text = _read_regular(entry_dir / _ENTRY, _ENTRY_LIMIT).decode("utf-8")
        entry = json.loads(text, parse_constant=_not_json_number, parse_float=_finite_number)
    if not isinstance(entry, dict):
        raise _Damaged(f"{_ENTRY} holds a JSON {type(entry).__name__}, not an object")
    if entry.get("format") != ENTRY_FORMAT or entry.get("key") != digest:
        raise _Damaged("written by another cache format")
    return entry


def _not_json_number(name: str) -> Any:
    """``NaN``/``Infinity``: Python's json reads them, JSON has no such numbers and kadapt writes none."""
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_number(text: str) -> float:
    """A JSON number as a float; one beyond float range (``1e999999``) would read as infinity."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is not a finite number")
    return value


def _listed_files(entry: dict[str, Any], prefix: str) -> dict[str, tuple[str, int]]:
    """The files ``entry`` lists, name -> (sha256, bytes); each name one the run writes (a plain
    ``<prefix>_<kind>.json``, so it can only ever be written directly into the output directory)."""
    files = entry.get("files")
    if not isinstance(files, dict):
        raise _Damaged(f"its file list is a {type(files).__name__}, not a mapping of file names")
    if not files:
        raise _Damaged("its file list is empty")
    name_pattern = re.compile(rf"{re.escape(prefix)}_[a-z0-9_]+\.json")
    listed = {}
    for name, meta in files.items():
        if not name_pattern.fullmatch(name):
            shown = _shortened(repr(name), 200)
            raise _Damaged(f"it lists {shown}, not a file name a run writes ({prefix}_*.json)")
        if (
            not isinstance(meta, dict)
            or not isinstance(meta.get("sha256"), str)
            or not _SHA256.fullmatch(meta["sha256"])
            or type(meta.get("bytes")) is not int
            or meta["bytes"] < 0
        ):
            raise _Damaged(f"its record of {name} is not a sha256 and a byte count")
        listed[name] = (meta["sha256"], meta["bytes"])
    return listed


def _stored_text(path: Path, sha256: str, size: int) -> str:
    """The text of stored file ``path``, which must have the recorded ``size`` and ``sha256``."""
    with _reading(path.name):
        blob = _read_regular(path, size)
        if len(blob) != size or hashlib.sha256(blob).hexdigest() != sha256:
            raise _Damaged(f"{path.name} does not match its recorded sha256")
        return blob.decode("utf-8")


def _stored_summary(entry: dict[str, Any], output_dir: Path, names: list[str]) -> ExtractionSummary:
    """The stored run's summary for files in ``output_dir``: it must rebuild, render, and list exactly
    ``names`` (the entry's files, in order) as its artifacts, each directly in ``output_dir``."""
    with _reading("its summary"):
        summary = ExtractionSummary.from_record(entry["summary"], output_dir)
        summary.render()  # every stored number is one: a restored run reports without a traceback
        summary.to_dict()
    artifacts = summary.artifacts
    if [path.name for path in artifacts] != names or any(path.parent != output_dir for path in artifacts):
        shown = ", ".join(_shortened(str(path), 80) for path in artifacts)
        raise _Damaged(f"its summary reports the files [{shown}], its file list [{', '.join(names)}]")
    return summary


def _stored_reach(entry: dict[str, Any]) -> dict[str, int]:
    """Patch id -> calls, as stored: a mapping of strings to integers."""
    reach = entry.get("reach")
    if not isinstance(reach, dict) or not all(type(count) is int for count in reach.values()):
        raise _Damaged("its patch reach is not a mapping of patch ids to counts")
    return dict(reach)


def _mtime(path: Path) -> float:
    """When ``path`` was last modified (0 if it cannot be read: oldest)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def extract_or_restore(
    spec: Spec,
    model: nn.Module,
    options: ExtractionOptions,
    *,
    session: Session,
    device: str,
    cache: ExtractionCache | None,
    processes: int,
    echo: Callable[[str], Any],
) -> tuple[ExtractionSummary, dict[str, int]]:
    """The run's summary and patch reach counts: restored from ``cache`` if its key is stored, else
    extracted (``pipeline.run`` in ``processes``) and stored. ``cache`` None (``--no-cache``)
    extracts only."""
    from ....patching.remote import uses_remote_code
    from .pipeline import run

    def extract() -> tuple[ExtractionSummary, dict[str, int]]:
        summary = run(spec, model, options, echo=echo, processes=processes)
        return summary, {patch: reach.count for patch, reach in session.reach.items()}

    if cache is None:
        summary, reach = extract()
        return replace(summary, cache=CacheUse(None, reason="--no-cache")), reach
    assert session.source is not None, "the session loads its config when it is applied"
    try:
        key = run_key(
            spec,
            options,
            source_raw=session.source.raw,
            remote_code=session.source.location if uses_remote_code(spec) else None,
            revision=session.source.revision,
            device=device,
        )
    except Uncacheable as exc:
        summary, reach = extract()
        return replace(summary, cache=CacheUse(None, reason=str(exc))), reach
    start = time.perf_counter()
    restored = cache.restore(key.digest, options.output_dir, options.file_prefix)
    if restored is not None:
        summary = restored.summary
        use = CacheUse(key.digest, hit=True, first_seconds=round(summary.seconds, 3))
        steps = [("restore from cache", time.perf_counter() - start)]
        echo(f"restored {len(summary.artifacts)} files from the extraction cache (key {key.short})")
        return replace(summary, steps=steps, cache=use), restored.reach
    summary, reach = extract()
    reason = cache.store(key.digest, key.parts, summary, reach)
    notes = [*summary.notes, *cache.dropped]  # a damaged entry was removed: say so
    use = CacheUse(key.digest, stored=reason is None, reason=reason)
    return replace(summary, notes=notes, cache=use), reach
