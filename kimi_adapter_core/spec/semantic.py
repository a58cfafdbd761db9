"""Checks the schema cannot express: cross-references, the shipped config, the builtin catalogue.

Runs after the schema on the same document. A check skips any node that already has a schema
error (so one mistake is reported once) and reads everything defensively, because ancestors of
the node may be malformed. Bridges are replayed in order on a copy of the shipped config, so a
``rename`` makes its ``to`` exist for later bridges and its ``from`` disappear.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from ..builtins import registry
from .diagnostics import Diagnostic, Locator, Severity, join_breadcrumb
from .entries import closest, entries
from .model import paged_name_problems, paged_size_problems
from .shipped_config import ShippedConfigChecks

_SECTIONS_WITH_IDS = ("environment", "config_bridges", "patches", "quantization")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_CLASS_ATTR = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
_FEW_BUILTINS = 12  # list every valid name when the catalogue is this small


def semantic_diagnostics(
    raw: dict[str, Any], spec_path: Path, locator: Locator, schema_errors: Iterable[Diagnostic]
) -> list[Diagnostic]:
    """All semantic problems of ``raw`` (loaded from ``spec_path``), skipping schema-invalid nodes."""
    checks = _Checks(raw, spec_path, locator, {d.breadcrumb for d in schema_errors})
    return checks.run()


class _Checks(ShippedConfigChecks):
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
        self.check_pins()
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
            for where, entry in entries(self.raw, section):
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
            for where, entry in entries(self.raw, section):
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
                message = f"unknown builtin {name!r}{closest(name, known)}"
                if not known:
                    message += "; no builtins are registered"
                elif len(known) <= _FEW_BUILTINS:
                    message += f"; known builtins: {', '.join(sorted(known))}"
                self.error(f"{where}.impl", message, "unknown-builtin")

    def check_targets(self) -> None:
        trusted = self.section("source").get("trust_remote_code") is True
        for where, entry in entries(self.raw, "patches"):
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
        for where, entry in entries(self.raw, "environment"):
            target = entry.get("target")
            if isinstance(target, str) and self.clean(f"{where}.target"):
                module, _, attr = target.partition(":")
                self.check_target_parts(f"{where}.target", module, attr, _IDENT, "a single name")

    def check_pins(self) -> None:
        """A per-release pin (a list) names transformers releases: its target must be transformers' code
        (remote code is pinned by its revision), each release a PEP 440 version, listed once and inside
        the spec's ``requires`` range (an entry for a release the spec refuses is never checked)."""
        required = self.section("requires").get("transformers")
        try:
            allowed = SpecifierSet(required) if isinstance(required, str) else None
        except InvalidSpecifier:  # reported by check_requires
            allowed = None
        for where, entry in entries(self.raw, "patches"):
            listed, target = entry.get("pin"), entry.get("target")
            if not isinstance(listed, list) or not self.clean(f"{where}.pin"):
                continue
            if isinstance(target, str) and not target.startswith("transformers."):
                self.error(
                    f"{where}.pin",
                    f"a per-release pin lists transformers releases, and {target} is not transformers' code "
                    "(remote code is pinned by source.hub.revision); pin it with one source",
                    "pin-release-target",
                )
            seen: dict[Version, str] = {}
            for i, pin in enumerate(listed):
                at = f"{where}.pin[{i}].transformers"
                try:
                    release = Version(pin["transformers"])
                except InvalidVersion:
                    self.error(at, f"{pin['transformers']!r} is not a PEP 440 release", "pin-release")
                    continue
                if release in seen:
                    line, _ = self.locator.position(seen[release])
                    self.error(
                        at, f"transformers {release} is pinned twice (first line {line})", "pin-release"
                    )
                    continue
                seen[release] = at
                if allowed is not None and not allowed.contains(release, prereleases=True):
                    self.error(
                        at,
                        f"transformers {release} is outside the spec's requires range {required!r}, where "
                        "apply refuses the spec: this entry would never be checked",
                        "pin-release-outside-requires",
                    )

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
        self.check_step(abi.get("step"), abi.get("kv_cache"), abi.get("vision"))
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

    def check_step(self, step: Any, kv_cache: Any, vision: Any) -> None:
        """``abi.step`` returns logits of at most its tokens, reads a paged pool (a contiguous
        ``kv_cache`` contradicts it), is text only (what apply refuses, said here) and names its
        auxiliary layers in increasing order (the order they are concatenated in)."""
        if not isinstance(step, dict) or not self.clean("abi.step"):
            return
        tokens, logits = step.get("tokens"), step.get("logits")
        if isinstance(tokens, int) and isinstance(logits, int) and logits > tokens:
            self.error("abi.step.logits", f"step logits {logits} exceed its tokens {tokens}", "abi-lengths")
        problem = aux_layer_order_problem(step.get("aux_layers", []))
        if problem is not None:
            self.error("abi.step.aux_layers", problem, "abi-step")
        kind = kv_cache.get("kind") if isinstance(kv_cache, dict) else kv_cache
        if kind == "contiguous":
            self.error(
                "abi.step",
                "the step graph reads and writes the paged pool: kv_cache must be paged",
                "abi-step",
            )
        if vision is not None:
            self.error(
                "abi.step", "the packed step graph is text only: a spec with abi.vision has none", "abi-step"
            )

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


def aux_layer_order_problem(layers: Sequence[int]) -> str | None:
    """Why ``abi.step.aux_layers`` is out of order (None: it is not): their hidden states are concatenated
    in layer order, as vLLM collects them walking the layers. ``validate``'s rule and ``apply``'s."""
    if list(layers) != sorted(set(layers)):
        return f"aux_layers {list(layers)} must be increasing (their hidden states are concatenated in order)"
    return None
