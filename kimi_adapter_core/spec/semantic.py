"""Checks the schema cannot express: cross-references, the shipped config, the builtin catalogue.

Runs after the schema on the same document. A check skips any node that already has a schema
error (so one mistake is reported once) and reads everything defensively, because ancestors of
the node may be malformed. Bridges are replayed in order on a copy of the shipped config, so a
``rename`` makes its ``to`` exist for later bridges and its ``from`` disappear.
"""

from __future__ import annotations

import bisect
import copy
import difflib
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from ..builtins import registry
from .diagnostics import Diagnostic, Locator, Severity, join_breadcrumb
from .model import paged_name_problems, paged_size_problems
from .yaml_loader import FileRefused, read_regular_file

_SECTIONS_WITH_IDS = ("environment", "config_bridges", "patches", "quantization")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_CLASS_ATTR = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_PATH_PART = re.compile(r"([A-Za-z_]\w*)((?:\[\d+\])*)")
_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
_MISSING = object()
_FEW_BUILTINS = 12  # list every valid name when the catalogue is this small
MAX_CONFIG_BYTES = 16 << 20  # a model's config.json is kilobytes; never read a huge file or a device


def semantic_diagnostics(
    raw: dict[str, Any], spec_path: Path, locator: Locator, schema_errors: Iterable[Diagnostic]
) -> list[Diagnostic]:
    """All semantic problems of ``raw`` (loaded from ``spec_path``), skipping schema-invalid nodes."""
    checks = _Checks(raw, spec_path, locator, {d.breadcrumb for d in schema_errors})
    return checks.run()


def _entries(raw: dict[str, Any], section: str) -> Iterator[tuple[str, dict[str, Any]]]:
    items = raw.get(section)
    if isinstance(items, list):
        for index, item in enumerate(items):
            if isinstance(item, dict):
                yield f"{section}[{index}]", item


def _closest(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or ``""``."""
    match = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {prefix + match[0]!r}?)" if match else ""


class _Checks:
    def __init__(self, raw: dict[str, Any], spec_path: Path, locator: Locator, dirty: set[str]) -> None:
        self.raw = raw
        self.spec_path = spec_path
        self.locator = locator
        self.found: list[Diagnostic] = []
        # sorted, so ``clean`` is a few binary searches rather than a scan of every schema error (a
        # large broken spec has thousands of errors and as many checks)
        self.dirty = sorted(set(dirty))

    def clean(self, where: str) -> bool:
        """True if no schema error sits at ``where`` or below it."""
        for prefix in (where, f"{where}.", f"{where}["):
            index = bisect.bisect_left(self.dirty, prefix)
            if index < len(self.dirty) and (
                self.dirty[index] == where if prefix is where else self.dirty[index].startswith(prefix)
            ):
                return False
        return True

    def error(self, where: str, message: str, code: str) -> None:
        self.found.append(self.locator.at(where, message, code))

    def warn(self, where: str, message: str, code: str) -> None:
        self.found.append(self.locator.at(where, message, code, Severity.WARNING))

    def section(self, name: str) -> dict[str, Any]:
        value = self.raw.get(name)
        return value if isinstance(value, dict) else {}

    def run(self) -> list[Diagnostic]:
        self.check_ids()
        self.check_impls()
        self.check_targets()
        self.check_source()
        self.check_requires()
        self.check_abi()
        self.check_module_paths()
        self.check_backends()
        config = self.load_config()
        if config is not None:
            self.check_gate(config)
            bridged = self.replay_bridges(config)
            self.check_config_references(config, bridged)
        return self.found

    # -- entries -----------------------------------------------------------------------------

    def check_ids(self) -> None:
        seen: dict[str, str] = {}
        for section in _SECTIONS_WITH_IDS:
            for where, entry in _entries(self.raw, section):
                ident = entry.get("id")
                if not isinstance(ident, str) or not self.clean(f"{where}.id"):
                    continue
                if ident in seen:
                    line, _ = self.locator.position(f"{seen[ident]}.id")
                    self.error(
                        f"{where}.id",
                        f"duplicate id {ident!r} (first used by {seen[ident]}, line {line})",
                        "duplicate-id",
                    )
                else:
                    seen[ident] = where

    def check_impls(self) -> None:
        known = registry.BUILTINS
        for section in ("environment", "patches"):
            for where, entry in _entries(self.raw, section):
                impl = entry.get("impl")
                if (
                    not isinstance(impl, str)
                    or not impl.startswith("builtin:")
                    or not self.clean(f"{where}.impl")
                ):
                    continue
                name = impl.removeprefix("builtin:")
                if name in known:
                    continue
                message = f"unknown builtin {name!r}{_closest(name, known)}"
                if not known:
                    message += "; no builtins are registered"
                elif len(known) <= _FEW_BUILTINS:
                    message += f"; known builtins: {', '.join(sorted(known))}"
                self.error(f"{where}.impl", message, "unknown-builtin")

    def check_targets(self) -> None:
        trusted = self.section("source").get("trust_remote_code") is True
        for where, entry in _entries(self.raw, "patches"):
            target = entry.get("target")
            if not isinstance(target, str) or not self.clean(f"{where}.target"):
                continue
            remote = target.startswith("remote:")
            module, _, attr = target.removeprefix("remote:").partition(":")
            self.check_target_parts(
                f"{where}.target", module, attr, _CLASS_ATTR, "Class.attr (e.g. DeepseekV3MoE.forward)"
            )
            if remote and not trusted:
                self.error(
                    f"{where}.target",
                    "remote: targets patch the model's own code; set source.trust_remote_code: true",
                    "remote-untrusted",
                )
        for where, entry in _entries(self.raw, "environment"):
            target = entry.get("target")
            if isinstance(target, str) and self.clean(f"{where}.target"):
                module, _, attr = target.partition(":")
                self.check_target_parts(f"{where}.target", module, attr, _IDENT, "a single name")

    def check_target_parts(
        self, where: str, module: str, attr: str, attr_form: re.Pattern[str], shape: str
    ) -> None:
        if not _DOTTED.fullmatch(module):
            self.error(where, f"module part {module!r} is not a dotted Python module name", "target-syntax")
        if not attr_form.fullmatch(attr):
            self.error(where, f"attribute part {attr!r} must be {shape}", "target-syntax")

    # -- sections ----------------------------------------------------------------------------

    def check_source(self) -> None:
        hub = self.section("source").get("hub")
        if not isinstance(hub, dict) or not self.clean("source.hub.revision"):
            return
        revision = hub.get("revision")
        if isinstance(revision, str) and not _COMMIT_SHA.fullmatch(revision):
            self.warn(
                "source.hub.revision",
                f"revision {revision!r} is not pinned; use a 40-hex commit sha so the code cannot change",
                "unpinned-revision",
            )

    def check_requires(self) -> None:
        for package, spec in self.section("requires").items():
            where = join_breadcrumb("requires", package)
            if not isinstance(spec, str) or not self.clean(where):
                continue
            try:
                SpecifierSet(spec)
            except InvalidSpecifier:
                self.error(where, f"{spec!r} is not a valid PEP 440 version specifier", "requires-specifier")

    def check_abi(self) -> None:
        abi = self.section("abi")
        prefill, cache = abi.get("prefill_len"), abi.get("max_cache_len")
        if (
            isinstance(prefill, int)
            and isinstance(cache, int)
            and prefill > cache
            and self.clean("abi.prefill_len")
        ):
            self.error(
                "abi.prefill_len", f"prefill_len {prefill} exceeds max_cache_len {cache}", "abi-lengths"
            )
        self.check_paged(abi.get("kv_cache"), abi.get("batch"), cache)
        vision = abi.get("vision") if isinstance(abi.get("vision"), dict) else {}
        merged = vision.get("merged_prefill")
        graphs = {"prefill": abi.get("prefill"), "decode": abi.get("decode")}
        if isinstance(merged, dict):
            graphs["vision.merged_prefill"] = merged
            self.check_merged_prefill(merged, vision, prefill, cache)
        for graph, section in graphs.items():
            for side in ("inputs", "outputs"):
                names = section.get(side) if isinstance(section, dict) else None
                for index, name in enumerate(names if isinstance(names, list) else []):
                    where = f"abi.{graph}.{side}[{index}]"
                    if isinstance(name, str) and "." in name and "{layer}" not in name and self.clean(where):
                        self.error(
                            where,
                            f"{name!r} is a per-layer (dotted) name: it must contain {{layer}}",
                            "abi-layer-name",
                        )

    def check_paged(self, kv_cache: Any, batch: Any, cache: Any) -> None:
        """A paged cache's blocks tile max_cache_len, its pool holds one row at full length, and its
        block-table name is not one of the decode graph's other inputs (what apply checks, said here)."""
        kv_cache = {"kind": "paged"} if kv_cache == "paged" else kv_cache
        if (
            not isinstance(kv_cache, dict)
            or kv_cache.get("kind") != "paged"
            or not self.clean("abi.kv_cache")
        ):
            return

        def at(key: str) -> str:
            return f"abi.kv_cache.{key}" if key in kv_cache else "abi.kv_cache"

        size, blocks = kv_cache.get("block_size", 16), kv_cache.get("num_blocks")
        problems = []
        if isinstance(cache, int) and isinstance(size, int):
            problems += [
                (field, message, "abi-lengths")
                for field, message in paged_size_problems(
                    size, blocks if isinstance(blocks, int) else None, cache
                )
            ]
        decode = self.section("abi").get("decode")
        inputs = decode.get("inputs") if isinstance(decode, dict) else None
        if isinstance(inputs, list):
            name = kv_cache.get("block_table", "block_table")
            problems += [
                (field, message, "abi-layer-name") for field, message in paged_name_problems(name, inputs)
            ]
        for field, message, code in problems:
            self.error(at(field), message, code)

    def check_merged_prefill(
        self, merged: dict[str, Any], vision: dict[str, Any], prefill: Any, cache: Any
    ) -> None:
        """The multimodal prompt fits the cache (abi.prefill_len, its default, is checked already) and
        holds the image's placeholder tokens (counted with the spec's merge_kernel claim; without one the
        export counts them from the encoder)."""
        own = "prefill_len" in merged
        where = "abi.vision.merged_prefill.prefill_len" if own else "abi.vision.merged_prefill"
        length = merged.get("prefill_len", prefill)
        if not isinstance(length, int) or not self.clean(where if own else "abi.prefill_len"):
            return
        named = "" if own else " (abi.prefill_len; set abi.vision.merged_prefill.prefill_len)"
        if own and isinstance(cache, int) and length > cache and self.clean("abi.max_cache_len"):
            self.error(
                where, f"merged prefill length {length}{named} exceeds max_cache_len {cache}", "abi-lengths"
            )
        kernel, grids = vision.get("merge_kernel"), vision.get("grid_thws")
        if (
            kernel is None
            or not self.clean("abi.vision.merge_kernel")
            or not self.clean("abi.vision.grid_thws")
        ):
            return
        rows, cols = kernel
        tokens = sum(h // rows * (w // cols) for _, h, w in grids)
        if length < tokens:
            self.error(
                where,
                f"merged prefill length {length}{named} is shorter than the {tokens} image placeholder "
                "tokens of abi.vision.grid_thws",
                "abi-image-tokens",
            )

    def check_module_paths(self) -> None:
        paths = self.section("module_paths")
        for parent, child in (("language_model", "language_layers"), ("vision_tower", "vision_layers")):
            outer, inner = paths.get(parent), paths.get(child)
            where = f"module_paths.{child}"
            if (
                isinstance(outer, str)
                and isinstance(inner, str)
                and self.clean(where)
                and self.clean(f"module_paths.{parent}")
            ):
                if not inner.startswith(f"{outer}."):
                    self.warn(where, f"{inner!r} is not inside {parent} {outer!r}", "module-path-nesting")

    def check_backends(self) -> None:
        backends = self.section("backends")
        extraction = backends.get("extraction") if isinstance(backends.get("extraction"), dict) else {}
        renames = extraction.get("weight_renames")
        for index, rename in enumerate(renames if isinstance(renames, list) else []):
            where = f"backends.extraction.weight_renames[{index}].from"
            pattern = rename.get("from") if isinstance(rename, dict) else None
            if isinstance(pattern, str) and self.clean(where):
                try:
                    re.compile(pattern)
                except (re.error, OverflowError, RecursionError, ValueError) as exc:
                    problem = "nested too deeply" if isinstance(exc, RecursionError) else exc
                    self.error(where, f"not a valid regular expression: {problem}", "weight-rename-regex")
        verify = extraction.get("verify")
        if isinstance(verify, dict) and self.clean("backends.extraction.verify"):
            total = verify["prefill_len"] + verify["decode_steps"]
            if total > verify["max_cache_len"]:
                self.error(
                    "backends.extraction.verify.decode_steps",
                    f"prefill_len + decode_steps = {total} exceeds max_cache_len {verify['max_cache_len']}",
                    "verify-lengths",
                )
        simulation = backends.get("simulation")
        gate_type = self.section("gate").get("model_type")
        if isinstance(simulation, dict) and self.clean("backends.simulation.model_type"):
            sim_type = simulation.get("model_type")
            if isinstance(sim_type, str) and isinstance(gate_type, str) and sim_type != gate_type:
                self.warn(
                    "backends.simulation.model_type",
                    f"simulation profile model_type {sim_type!r} differs from gate.model_type {gate_type!r}",
                    "simulation-model-type",
                )

    # -- the shipped config ------------------------------------------------------------------

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
                f"{relative} is not valid JSON ({exc.msg} at {exc.lineno}:{exc.colno})",
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
                self.error(where, f"{name} has no sub-config {sub!r}{_closest(sub, nested)}", "gate-mismatch")
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
        for where, bridge in _entries(self.raw, "config_bridges"):
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
        hint = (
            _closest(leaf, container, f"{parent}." if parent else "") if isinstance(container, dict) else ""
        )
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
                f"{name} has no sub-config {abi_config!r}{_closest(abi_config, nested)}",
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
