"""What makes two extraction runs produce the same artifacts: the key of the extraction cache.

A cached run may only be reused when every input that can change a byte of the artifacts is the
same, so the key hashes all of them and a run whose inputs cannot all be hashed is not cached
(``Uncacheable`` says why) rather than keyed on a part of them:

- kadapt itself: its version and the bytes of every file of the ``kimi_adapter_core`` package
  (any edit to the code, a schema or a data table is a new key);
- the libraries that trace and serialise: the Python version, torch and transformers by version
  and by the sha256 of their installed file list (``RECORD`` holds each file's hash, so a rebuilt
  wheel under the same version is a new key); an editable install has no such list, so its
  source files' sizes and modification times are hashed instead;
- the rest of the environment: every installed distribution by name and version (an optional
  package can change what transformers runs, e.g. a kernels package replacing a layer's forward)
  and the ``TORCH*``/``PYTORCH*``/``TRANSFORMERS*`` environment variables;
- the spec as applied: its validated mapping, the entries left after ``--without`` and the source
  file of every ``impl`` that is not a kadapt builtin;
- the model's config as read (before bridges: the bridges are in the spec) and, when remote code
  runs, every ``.py`` file of the model directory (or the pinned hub revision);
- the extraction options bound to the model's structure, except the output directory: no artifact
  names the directory it was written to (the cache tests check it), so one cached run serves any.

Only the CLI's ``apply`` uses the cache: a process that monkey-patches kadapt, torch or
transformers in memory (as tests and notebooks do) is not visible in any file, so the Python API
always extracts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .... import __version__
from ....resources import package_file
from ....spec.model import Spec
from ..options import ExtractionOptions

KEY_FORMAT = 1  # bump when what the key covers changes
_PACKAGE = package_file()  # kimi_adapter_core/, wherever this module sits inside it
_LIBRARIES = ("torch", "transformers")
_ENVIRONMENT_PREFIXES = ("TORCH", "PYTORCH", "TRANSFORMERS")


class Uncacheable(Exception):
    """An input of the run that the key cannot cover (the run extracts and is not stored)."""


@dataclass(frozen=True)
class RunKey:
    """The cache key (``digest``) and the digest of each part, kept in the entry to explain it."""

    digest: str
    parts: dict[str, str]

    @property
    def short(self) -> str:
        return self.digest[:12]


def run_key(
    spec: Spec,
    options: ExtractionOptions,
    *,
    source_raw: Mapping[str, Any],
    remote_code: Path | str | None,
    revision: str | None,
    device: str,
) -> RunKey:
    """The key of extracting ``spec`` with ``options`` from the config ``source_raw``.

    ``remote_code`` is the model directory (or hub repo id, then ``revision`` pins it) whose code the
    run executes, None when transformers' own classes run. Raises ``Uncacheable``."""
    parts = {
        "format": _digest(str(KEY_FORMAT).encode()),
        "kadapt": _digest(__version__.encode(), *_files(_PACKAGE)),
        "python": _digest(sys.version.encode(), sys.platform.encode()),
        **{name: library_digest(name) for name in _LIBRARIES},
        "environment": environment_digest(),
        "spec": _digest(
            _canonical_json({"raw": spec.raw, "entries": spec.entry_ids}),
            *(impl_source(ref) for ref in sorted(_impl_refs(spec.raw))),
        ),
        "config": _digest(_canonical_json(dict(source_raw))),
        "remote_code": remote_code_digest(remote_code, revision),
        "options": _digest(_canonical_json({"options": options_record(options), "device": device})),
    }
    return RunKey(_digest(_canonical_json(parts)), parts)


def options_record(options: ExtractionOptions) -> Any:
    """The options as plain data, without the output directory (artifacts never name it)."""
    return canonical(dataclasses.replace(options, output_dir=Path(".")))


def canonical(value: Any) -> Any:
    """``value`` as JSON-able data that is equal exactly when the values are.

    Dataclasses, enums, paths, tuples, lists, dicts, sets and scalars only: anything else raises
    ``Uncacheable`` (a ``repr`` might hold an address or drop a field)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "__type__": type(value).__qualname__,
            **{f.name: canonical(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }
    if isinstance(value, enum.Enum):
        return {"__enum__": f"{type(value).__qualname__}.{value.name}"}
    if isinstance(value, Path):
        return {"__path__": value.as_posix()}
    if isinstance(value, (tuple, list)):
        return [canonical(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((canonical(item) for item in value), key=_canonical_json)
    if isinstance(value, Mapping):
        return [[canonical(k), canonical(v)] for k, v in value.items()]  # insertion order is data too
    raise Uncacheable(f"an extraction option holds a {type(value).__name__}, which the cache key cannot hash")


def library_digest(name: str) -> str:
    """Version and installed file list of distribution ``name`` (file sizes and times if editable)."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError as exc:
        raise Uncacheable(f"{name} is not an installed distribution") from exc
    record = dist.read_text("RECORD")
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if record is not None and not direct.get("dir_info", {}).get("editable"):
        return _digest(dist.version.encode(), record.encode())
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise Uncacheable(f"{name} is installed without a file list and cannot be located")
    root = Path(spec.origin).parent
    stats = (f"{p.relative_to(root)} {p.stat().st_size} {p.stat().st_mtime_ns}" for p in _sources(root))
    return _digest(dist.version.encode(), "\n".join(stats).encode())


def environment_digest() -> str:
    """Every distribution on ``sys.path`` (its ``name-version.dist-info`` folder names) and the
    environment variables torch and transformers read."""
    installed = set()
    for entry in sys.path:
        with contextlib.suppress(OSError):
            installed.update(n for n in os.listdir(entry or ".") if n.endswith((".dist-info", ".egg-info")))
    variables = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(_ENVIRONMENT_PREFIXES))
    return _digest("\n".join(sorted(installed)).encode(), "\n".join(variables).encode())


def remote_code_digest(location: Path | str | None, revision: str | None) -> str:
    """The model's own code: every ``.py`` below a local directory, or the pinned hub revision."""
    if location is None:
        return _digest(b"none")
    if revision is not None:
        return _digest(f"{location}@{revision}".encode())
    return _digest(*_files(Path(location), suffixes=(".py",)))


def impl_source(ref: str) -> bytes:
    """The source file of a spec's ``module:callable`` impl, found without importing it."""
    module = ref.split(":", 1)[0]
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        raise Uncacheable(f"impl {ref}: module {module} cannot be located ({exc})") from exc
    if found is None or found.origin is None or not Path(found.origin).is_file():
        raise Uncacheable(f"impl {ref}: module {module} has no source file to hash")
    return ref.encode() + b"\0" + Path(found.origin).read_bytes()


def _impl_refs(raw: Any) -> Iterator[str]:
    """Every ``impl`` of the spec that is user code (``builtin:`` ones are in kadapt's own files)."""
    if isinstance(raw, Mapping):
        for key, value in raw.items():
            if key == "impl" and isinstance(value, str) and not value.startswith("builtin:"):
                yield value
            else:
                yield from _impl_refs(value)
    elif isinstance(raw, list):
        for item in raw:
            yield from _impl_refs(item)


def _files(root: Path, suffixes: tuple[str, ...] | None = None) -> Iterator[bytes]:
    """Relative path and bytes of every file below ``root`` (sorted; compiled caches skipped)."""
    for path in _sources(root, suffixes):
        yield path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes()


def _sources(root: Path, suffixes: tuple[str, ...] | None = (".py",)) -> list[Path]:
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and p.suffix != ".pyc"
        and (suffixes is None or p.suffix in suffixes)
    )


def _digest(*chunks: bytes) -> str:
    sha = hashlib.sha256()
    for chunk in chunks:
        sha.update(len(chunk).to_bytes(8, "little"))  # length-prefixed: no two chunk lists collide
        sha.update(chunk)
    return sha.hexdigest()


def _canonical_json(value: Any) -> bytes:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_refuse).encode()
    except (TypeError, ValueError) as exc:  # keys of mixed types, a circular reference
        raise Uncacheable(f"the spec or config cannot be hashed as JSON: {exc}") from exc


def _refuse(value: Any) -> Any:
    raise Uncacheable(f"the spec or config holds a {type(value).__name__}, which the cache key cannot hash")
