"""Where a spec's model config (and, for remote code, its Python files) comes from.

Offline by default: the JSON shipped next to the spec (``source.config``). The Hugging Face hub is
used only when asked (``from_hub=True``) and then always at the revision the spec pins. Tests and
local checkouts point ``source_dir`` at a model directory holding ``config.json`` (+ code files).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import KadaptError
from ..spec.model import Spec

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class ResolvedSource:
    """The raw config mapping plus where its remote code (if any) would be loaded from."""

    raw: dict[str, Any]
    location: str  # model directory, or hub repo id
    revision: str | None  # hub revision; None for a local directory
    is_hub: bool

    def describe(self) -> str:
        return f"{self.location}@{self.revision}" if self.is_hub else self.location


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KadaptError(f"cannot read model config {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise KadaptError(f"model config {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise KadaptError(f"model config {path} must hold a JSON object")
    return data


def _from_hub(spec: Spec) -> ResolvedSource:
    hub = spec.source.hub
    if hub is None:
        raise KadaptError(
            "the spec's source has no hub entry (source.hub.repo/revision)", location=spec.locate("source")
        )
    if spec.source.trust_remote_code and not _COMMIT.match(hub.revision):
        raise KadaptError(
            f"source.hub.revision is {hub.revision!r}: a spec that runs the model's remote code must pin the "
            "hub revision to a full 40-character commit sha",
            location=spec.locate("source"),
        )
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(hub.repo, "config.json", revision=hub.revision)
    except Exception as exc:  # noqa: BLE001 - any hub/network failure is a user-facing problem
        raise KadaptError(f"cannot download config.json of {hub.repo}@{hub.revision}: {exc}") from exc
    return ResolvedSource(_read_json(Path(path)), hub.repo, hub.revision, True)


def resolve_source(
    spec: Spec, *, source_dir: str | Path | None = None, from_hub: bool = False
) -> ResolvedSource:
    """Read the raw config: ``source_dir`` if given, else the hub if asked, else the shipped JSON."""
    if source_dir is not None and from_hub:
        raise KadaptError("pass either a source directory or from_hub, not both")
    if source_dir is not None:
        directory = Path(source_dir).resolve()
        return ResolvedSource(_read_json(directory / "config.json"), str(directory), None, False)
    if from_hub:
        return _from_hub(spec)
    if spec.source.config is None:
        raise KadaptError(
            "the spec ships no config (source.config); load it from the hub or from a model directory",
            location=spec.locate("source"),
        )
    return ResolvedSource(_read_json(spec.source.config), str(spec.source.config.parent), None, False)
