"""The extraction cache: a finished run's artifacts stored under its key and restored byte for byte.

``kadapt apply`` spends most of its time tracing graphs that the previous run with the same inputs
already traced. ``cache_key.run_key`` hashes every input that can change an artifact; a run whose
key is stored writes the stored files instead of extracting (issue #23: a second run at the import
floor). What a run reports besides its files (graph statistics, notes, and which patches the
export reached, which the ledger shows) is stored with them, so a restored run says the same.

Layout: ``<root>/<key>/`` holds the artifacts as written plus ``entry.json`` (key and the digest of
each part, kadapt version, the sha256 and size of each file, the summary, the patch reach counts).
An entry is written to a hidden temp directory and renamed into place, so a reader sees a whole
entry or none, and of two processes storing one key the first wins. A file whose sha256 does not
match its entry drops the entry and the run extracts (a damaged cache is never restored). Entries
beyond ``MAX_ENTRIES``, least recently used first, are removed. A cache that cannot be written
(read-only home, full disk) never fails a run: the summary says why nothing was stored.

The root is ``$KADAPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/kadapt/extraction``, else
``~/.cache/kadapt/extraction``; ``kadapt apply --no-cache`` neither reads nor writes it. The recorded
hashes catch damage, not tampering: whoever can write the cache can write what a run restores, so it
is trusted like the output directory (keep ``$KADAPT_CACHE_DIR`` out of reach of other users).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import __version__
from .cache_key import Uncacheable, run_key
from .summary import CacheUse, ExtractionSummary
from .write import write_all

if TYPE_CHECKING:
    from torch import nn

    from ...patching.session import Session
    from ...spec.model import Spec
    from .options import ExtractionOptions

ENTRY_FORMAT = 1
MAX_ENTRIES = 16  # a full-size Kimi-K2.5 entry is ~17 MB
_ENTRY = "entry.json"
_STALE_TEMP_SECONDS = 24 * 3600  # a temp directory this old belongs to a run that died


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

    def restore(self, digest: str, output_dir: Path) -> Restored | None:
        """Write entry ``digest``'s files into ``output_dir`` (all or nothing); None if absent or damaged."""
        entry_dir = self.root / digest
        try:
            entry = json.loads((entry_dir / _ENTRY).read_text(encoding="utf-8"))
            if entry.get("format") != ENTRY_FORMAT or entry.get("key") != digest:
                return self._drop(entry_dir, "written by another cache format")
            texts = {}
            for name, meta in entry["files"].items():
                blob = (entry_dir / name).read_bytes()
                if hashlib.sha256(blob).hexdigest() != meta["sha256"]:
                    return self._drop(entry_dir, f"{name} does not match its recorded sha256")
                texts[output_dir / name] = [blob.decode("utf-8")]
            summary = ExtractionSummary.from_record(entry["summary"], output_dir)
            reach = {str(k): int(v) for k, v in entry["reach"].items()}
        except FileNotFoundError:
            return None if not entry_dir.exists() else self._drop(entry_dir, "a file of it is missing")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return self._drop(entry_dir, f"unreadable ({type(exc).__name__}: {exc})")
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
        shutil.rmtree(entry_dir, ignore_errors=True)
        self.dropped.append(f"extraction cache entry {entry_dir.name[:12]} removed: {why}")


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
    from ...patching.remote import uses_remote_code
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
    restored = cache.restore(key.digest, options.output_dir)
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
