"""Config bridges as template context: which bridges a target runs and which helpers they need.

The generated statements mirror ``kimi_adapter_core.config.bridges`` op for op (same missing-value
rules, same ``when`` clauses), so a generated module and ``kadapt apply`` edit a config identically.
"""

from __future__ import annotations

from typing import Any

from ..errors import KadaptError
from ..spec.model import ConfigBridge, Spec

# op -> generated helpers it calls (besides _lookup/_assign, which every module gets)
_HELPERS = {
    "rename": {"_rename"},
    "copy": {"_copy"},
    "derive": {"_copy"},
    "set_default": {"_set_default"},
    "set": set(),
    "rewrite": set(),
}
_WHEN_KEYS = {"equals", "unless_importable", "if_importable"}


def bridge_context(spec: Spec, *, backend: str | None, target: str) -> dict[str, Any]:
    """Template context for the bridges ``backend`` runs (all of them when ``backend`` is None)."""
    rows = []
    helpers: set[str] = set()
    for bridge in spec.config_bridges:
        if backend is not None and backend not in bridge.backends:
            continue
        _check(spec, bridge, target)
        helpers |= _HELPERS[bridge.op]
        if any(key in bridge.when for key in ("unless_importable", "if_importable")):
            helpers.add("_importable")
        rows.append(_row(bridge))
    return {"bridges": rows, "bridge_helpers": sorted(helpers)}


def _check(spec: Spec, bridge: ConfigBridge, target: str) -> None:
    problem = None
    if bridge.op not in _HELPERS:
        problem = f"op {bridge.op!r} has no generated form"
    elif set(bridge.when) - _WHEN_KEYS:
        problem = f"'when' keys {sorted(set(bridge.when) - _WHEN_KEYS)} have no generated form"
    if problem:
        raise KadaptError(
            f"cannot generate target '{target}' for spec '{spec.name}': config bridge {bridge.id}: {problem}",
            location=spec.locate(bridge.where),
        )


def _row(bridge: ConfigBridge) -> dict[str, Any]:
    return {
        "id": bridge.id,
        "why": bridge.why,
        "op": bridge.op,
        "source": bridge.source,
        "dest": bridge.dest,
        "path": bridge.path,
        "value": bridge.value,
        "fallback": bridge.fallback,
        "has_fallback": bridge.has_fallback,
        "when": dict(sorted(bridge.when.items())),
        "backends": list(bridge.backends),
    }
