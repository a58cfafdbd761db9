"""Config bridges: declarative edits of the raw config mapping before the config class sees it.

Hub configs and the code that reads them disagree on field names and locations (``vt_hidden_size``
vs ``hidden_size``, expert counts under ``text_config``); each bridge states one such fix. They run
on the raw JSON mapping, in spec order, so later bridges see earlier results. Every bridge leaves a
ledger row; a bridge that cannot do what it says raises ``KadaptError`` at its spec line.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

from ..errors import KadaptError
from ..patching.ledger import APPLIED, FAILED, GATED_OFF, NOT_FOR_BACKEND, Ledger
from ..patching.selection import applies_to
from ..spec.model import ConfigBridge, Spec
from . import paths
from .paths import MISSING

SECTION = "config_bridge"


def importable(module: str) -> bool:
    """True if ``module`` can be imported here, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _target(bridge: ConfigBridge) -> str:
    if bridge.source and bridge.dest:
        return f"{bridge.source} -> {bridge.dest}"
    return bridge.path or ""


def _condition_failure(bridge: ConfigBridge, current: Any) -> str | None:
    """Why a ``rewrite`` does not fire, or None when every ``when`` clause holds."""
    when = bridge.when
    if "equals" in when and current != when["equals"]:
        shown = "absent" if current is MISSING else repr(current)
        return f"{bridge.path} is {shown}, not {when['equals']!r}"
    if "unless_importable" in when and importable(when["unless_importable"]):
        return f"{when['unless_importable']} is importable"
    if "if_importable" in when and not importable(when["if_importable"]):
        return f"{when['if_importable']} is not importable"
    return None


def _source_value(bridge: ConfigBridge, raw: dict[str, Any]) -> tuple[Any, str]:
    value = paths.get(raw, bridge.source or "")
    if value is not MISSING:
        return value, f"= {value!r}"
    if bridge.has_fallback:
        return bridge.fallback, f"{bridge.source} absent: fallback {bridge.fallback!r}"
    raise KadaptError(f"{bridge.source} is not in the config and the bridge has no fallback")


def apply_bridge(bridge: ConfigBridge, raw: dict[str, Any]) -> tuple[str, str, str | None]:
    """Apply one bridge to ``raw``; return (status, reason, written path or None)."""
    op = bridge.op
    if op == "rename":
        value = paths.get(raw, bridge.source or "")
        if value is MISSING:
            return GATED_OFF, f"{bridge.source} is not in the config", None
        paths.set_(raw, bridge.dest or "", value)
        paths.delete(raw, bridge.source or "")
        return APPLIED, f"moved {value!r}", bridge.dest
    if op in ("copy", "derive"):
        value, reason = _source_value(bridge, raw)
        paths.set_(raw, bridge.dest or "", value)
        return APPLIED, reason, bridge.dest
    if op == "set_default":
        current = paths.get(raw, bridge.path or "")
        if current is not MISSING:
            return GATED_OFF, f"already set to {current!r}", None
        paths.set_(raw, bridge.path or "", bridge.value)
        return APPLIED, f"defaulted to {bridge.value!r}", bridge.path
    if op == "set":
        paths.set_(raw, bridge.path or "", bridge.value)
        return APPLIED, f"set to {bridge.value!r}", bridge.path
    if op == "rewrite":
        current = paths.get(raw, bridge.path or "")
        failure = _condition_failure(bridge, current)
        if failure:
            return GATED_OFF, failure, None
        paths.set_(raw, bridge.path or "", bridge.value)
        return APPLIED, f"rewrote {current!r} to {bridge.value!r}", bridge.path
    raise KadaptError(f"unknown config bridge op {op!r}")


def apply_bridges(spec: Spec, raw: dict[str, Any], *, backend: str, ledger: Ledger) -> list[str]:
    """Apply the spec's bridges for ``backend`` to ``raw`` in place; return the paths written."""
    written: list[str] = []
    for bridge in spec.config_bridges:
        location = spec.locate(bridge.where)
        if not applies_to(bridge.backends, backend):
            reason = f"backends: {', '.join(bridge.backends)}"
            ledger.record(bridge.id, SECTION, _target(bridge), bridge.op, NOT_FOR_BACKEND, reason, location)
            continue
        try:
            status, reason, path = apply_bridge(bridge, raw)
        except KadaptError as exc:
            ledger.record(bridge.id, SECTION, _target(bridge), bridge.op, FAILED, exc.message, location)
            raise KadaptError(f"config bridge {bridge.id}: {exc.message}", location=location) from exc
        ledger.record(bridge.id, SECTION, _target(bridge), bridge.op, status, reason, location)
        if path:
            written.append(path)
    return written


def bridged(spec: Spec, raw: dict[str, Any], backend: str) -> dict[str, Any]:
    """A copy of ``raw`` as ``backend``'s bridges leave it, no ledger kept: what plain ``validate`` and
    ``plan`` hold a backend's reading of the config against, torch-free (``load`` builds the object)."""
    copied = copy.deepcopy(raw)
    apply_bridges(spec, copied, backend=backend, ledger=Ledger(spec.name, backend))
    return copied
