"""The spec against the config it ships: its gate, and every bridge path replayed in order.

Part of ``kadapt validate``'s semantic checks (``semantic._Checks`` mixes this class in and provides
``raw``, ``spec_path``, ``clean``, ``error`` and ``section``). Torch-free: it reads the JSON file,
never transformers. Bridges are replayed on a copy of the config, so a ``rename`` makes its ``to``
exist for later bridges and its ``from`` disappear, exactly as ``apply`` will see them.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

from ..safe_files import FileRefused, read_regular_file
from .diagnostics import Diagnostic, Locator, join_breadcrumb
from .entries import closest, entries

_PATH_PART = re.compile(r"([A-Za-z_]\w*)((?:\[\d+\])*)")
_MISSING = object()
MAX_CONFIG_BYTES = 16 << 20  # a model's config.json is kilobytes; never read a huge file or a device


class ShippedConfigChecks:
    """The checks of ``source.config``'s content; see the module docstring for what the host provides."""

    raw: dict[str, Any]
    spec_path: Path
    locator: Locator
    found: list[Diagnostic]

    def load_config(self) -> dict[str, Any] | None:
        relative = self.section("source").get("config")
        if not isinstance(relative, str) or not self.clean("source.config"):
            return None
        path = self.spec_path.parent / relative
        try:
            config = json.loads(read_regular_file(path, MAX_CONFIG_BYTES, "config file").decode("utf-8"))
        except FileNotFoundError:
            self.error(
                "source.config", f"config file {relative!r} not found (looked for {path})", "config-missing"
            )
            return None
        except FileRefused as exc:
            self.error(
                "source.config", f"cannot read config file {relative!r}: {exc.message}", "config-unreadable"
            )
            return None
        except (OSError, UnicodeDecodeError) as exc:
            self.error("source.config", f"cannot read config file {relative!r}: {exc}", "config-unreadable")
            return None
        except json.JSONDecodeError as exc:
            self.error(
                "source.config",
                f"{relative} is not valid JSON ({exc.msg}: line {exc.lineno}, column {exc.colno})",
                "config-json",
            )
            return None
        except (ValueError, RecursionError) as exc:  # numbers over int's digit limit, deep nesting
            problem = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            self.error("source.config", f"{relative} is not usable JSON ({problem})", "config-json")
            return None
        if not isinstance(config, dict):
            self.error("source.config", f"{relative} must hold a JSON object", "config-json")
            return None
        return config

    def check_gate(self, config: dict[str, Any]) -> None:
        gate = self.section("gate")
        name = self.section("source").get("config")
        expected = gate.get("model_type")
        actual = config.get("model_type")
        if isinstance(expected, str) and self.clean("gate.model_type") and expected != actual:
            shown = f"model_type {actual!r}" if actual is not None else "no model_type"
            self.error(
                "gate.model_type", f"gate expects {expected!r} but {name} has {shown}", "gate-mismatch"
            )
        sub_configs = gate.get("sub_configs")
        for sub, types in sub_configs.items() if isinstance(sub_configs, dict) else ():
            where = join_breadcrumb("gate.sub_configs", sub)
            if not isinstance(types, list) or not self.clean(where):
                continue
            section = config.get(sub)
            if not isinstance(section, dict):
                nested = [key for key, value in config.items() if isinstance(value, dict)]
                self.error(where, f"{name} has no sub-config {sub!r}{closest(sub, nested)}", "gate-mismatch")
            elif "model_type" in section and section["model_type"] not in types:
                self.error(
                    where,
                    f"{name} has {sub}.model_type {section['model_type']!r}, not one of: {', '.join(types)}",
                    "gate-mismatch",
                )

    def replay_bridges(self, config: dict[str, Any]) -> dict[str, Any]:
        """Apply each clean bridge's effect to a copy of ``config``, reporting paths that do not exist."""
        state = copy.deepcopy(config)
        removed: dict[str, str] = {}  # path -> id of the rename that moved it away
        for where, bridge in entries(self.raw, "config_bridges"):
            if not self.clean(where):
                continue
            op, ident = bridge["op"], bridge["id"]
            if op in ("rename", "copy", "derive"):
                value = _lookup(state, bridge["from"])
                if value is _MISSING and not (op == "copy" and "fallback" in bridge):
                    self.missing_path(f"{where}.from", state, bridge["from"], removed)
                    continue
                if not self.parent_exists(f"{where}.to", state, bridge["to"]):
                    continue
                _assign(state, bridge["to"], bridge.get("fallback") if value is _MISSING else value)
                if op == "rename":
                    _delete(state, bridge["from"])
                    removed[bridge["from"]] = ident
            elif self.parent_exists(f"{where}.path", state, bridge["path"]):
                if op != "set_default" or _lookup(state, bridge["path"]) is _MISSING:
                    _assign(state, bridge["path"], bridge["value"])
        return state

    def missing_path(self, where: str, state: dict[str, Any], path: str, removed: dict[str, str]) -> None:
        name = self.section("source").get("config")
        if path in removed:
            self.error(where, f"{path!r} was renamed away by bridge {removed[path]}", "bridge-path")
            return
        parent, _, leaf = path.rpartition(".")
        container = _lookup(state, parent) if parent else state
        leaf = re.sub(r"(\[\d+\])+$", "", leaf)
        hint = closest(leaf, container, f"{parent}." if parent else "") if isinstance(container, dict) else ""
        self.error(where, f"{path!r} is not in {name}{hint}", "bridge-path")

    def parent_exists(self, where: str, state: dict[str, Any], path: str) -> bool:
        parent = path.rpartition(".")[0]
        container = _lookup(state, parent) if parent else state
        if isinstance(container, dict):
            return True
        name = self.section("source").get("config")
        problem = "does not exist" if container is _MISSING else "is not a mapping"
        self.error(where, f"parent {parent!r} of {path!r} {problem} in {name}", "bridge-path")
        return False

    def check_config_references(self, config: dict[str, Any], bridged: dict[str, Any]) -> None:
        name = self.section("source").get("config")
        abi_config = self.section("abi").get("config")
        if (
            isinstance(abi_config, str)
            and self.clean("abi.config")
            and not isinstance(config.get(abi_config), dict)
        ):
            nested = [key for key, value in config.items() if isinstance(value, dict)]
            self.error(
                "abi.config",
                f"{name} has no sub-config {abi_config!r}{closest(abi_config, nested)}",
                "abi-config",
            )
        key = self.section("moe").get("num_experts_key")
        if isinstance(key, (str, list)) and self.clean("moe.num_experts_key"):
            path = key if isinstance(key, str) else ".".join(key)
            if _lookup(bridged, path) is _MISSING:
                self.error(
                    "moe.num_experts_key",
                    f"{path!r} is not in {name} (after config_bridges)",
                    "moe-experts-key",
                )


def _parts(path: str) -> list[str | int]:
    """``a.b[0]`` -> ``["a", "b", 0]`` (paths are schema-checked before they get here)."""
    parts: list[str | int] = []
    for piece in path.split("."):
        match = _PATH_PART.fullmatch(piece)
        if match is None:
            return [path]
        parts.append(match.group(1))
        parts.extend(int(index) for index in re.findall(r"\[(\d+)\]", match.group(2)))
    return parts


def _lookup(state: Any, path: str) -> Any:
    for part in _parts(path):
        if isinstance(part, int) and isinstance(state, list) and part < len(state):
            state = state[part]
        elif isinstance(part, str) and isinstance(state, dict) and part in state:
            state = state[part]
        else:
            return _MISSING
    return state


def _assign(state: dict[str, Any], path: str, value: Any) -> None:
    parent, _, leaf = path.rpartition(".")
    container = _lookup(state, parent) if parent else state
    container[leaf] = value


def _delete(state: dict[str, Any], path: str) -> None:
    parent, _, leaf = path.rpartition(".")
    container = _lookup(state, parent) if parent else state
    container.pop(leaf, None)
