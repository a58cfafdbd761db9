"""What every target needs: the rendered-file record, spec identity and the 'needs' checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from ..errors import KadaptError
from ..resources import shipped_dir
from ..spec.model import Spec
from .environment import render


@dataclass(frozen=True)
class Rendered:
    """One generated file, held in memory until every target rendered without error."""

    path: PurePosixPath  # relative to the output directory
    text: str


def spec_file(spec: Spec) -> str:
    """How generated headers name the spec: ``specs/<file>`` for shipped specs, else the file name.

    Never an absolute path, so the bytes do not depend on where the checkout lives.
    """
    try:
        spec.path.relative_to(shipped_dir("specs").resolve())
    except (ValueError, FileNotFoundError):
        return spec.path.name
    return f"specs/{spec.path.name}"


def spec_identity(spec: Spec) -> dict[str, Any]:
    meta = spec.raw.get("metadata") or {}
    return {
        "name": spec.name,
        "model": meta.get("model", spec.name),
        "description": meta.get("description", ""),
        "file": spec_file(spec),
    }


class NotExpressible(KadaptError):
    """The spec lacks what a target needs, or says something the target cannot carry.

    ``--target all`` skips such targets with a note; naming the target explicitly makes it an error.
    """

    def __init__(self, spec: Spec, target: str, reason: str, where: str | None = None) -> None:
        location = spec.locate(where) if where else str(spec.path)
        super().__init__(
            f"cannot generate target '{target}' for spec '{spec.name}': {reason}", location=location
        )
        self.note = f"{spec.name}: target '{target}' skipped: {reason}"


def cannot(spec: Spec, target: str, reason: str, where: str | None = None) -> NotExpressible:
    return NotExpressible(spec, target, reason, where)


def require(spec: Spec, target: str, *entries: str) -> None:
    """Raise ``NotExpressible`` naming the first top-level spec entry ``target`` needs but lacks."""
    for entry in entries:
        if not spec.raw.get(entry):
            raise cannot(spec, target, f"the spec has no '{entry}' entry")


def package_files(spec: Spec, target: str) -> list[Rendered]:
    """``adapters/__init__.py`` and ``adapters/<name>/__init__.py``: identical for every target."""
    context = {"spec": spec_identity(spec)}
    return [
        Rendered(
            PurePosixPath("adapters", "__init__.py"),
            render("package/adapters_init.py.j2", context, spec_name=spec.name, target=target),
        ),
        Rendered(
            PurePosixPath("adapters", spec.name, "__init__.py"),
            render("package/spec_init.py.j2", context, spec_name=spec.name, target=target),
        ),
    ]


def gate_context(spec: Spec) -> dict[str, Any]:
    """The gate as plain data: root model_type and accepted model_types per sub-config."""
    return {
        "model_type": spec.gate.model_type,
        "sub_configs": {name: list(types) for name, types in spec.gate.sub_configs.items()},
    }


def lookup(raw: dict[str, Any], dotted: str) -> Any:
    """``raw['a']['b']`` for ``'a.b'``; None when any step is missing."""
    node: Any = raw
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node
