"""``kadapt validate --resolve``: check a valid spec against the code and config it names.

Schema and semantic checks read only the YAML and the shipped JSON. This goes further, collecting
every finding as a located ``Diagnostic`` instead of stopping at the first: each patch target is
imported and resolved, the config is built through the spec's bridges and its structure derived
(so an ``mla`` section on a GQA model or a ``kv_layout`` its attention cannot have is caught), and a
shortened copy of the model is built on meta (no weights) to resolve every ``module_paths`` entry
(the decoder stack's parts relative to its language model) and the ``mla``/``moe`` class names. It
imports torch and transformers, and imports the modules a spec names: like ``apply``, it treats the
spec as code. Remote-code targets are left to ``apply --trust-remote-code``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import KadaptError
from .spec.diagnostics import Diagnostic, Locator, Severity
from .spec.model import LAYER_ATTENTION, STACK_PARTS, Spec

_LOCATION = re.compile(r"^(?P<file>.*):(?P<line>\d+):(?P<col>\d+)$")


class _Findings:
    def __init__(self, spec: Spec, display: str) -> None:
        self.spec = spec
        self.locator = Locator(display, spec.positions)
        self.found: list[Diagnostic] = []

    def error(self, breadcrumb: str, message: str) -> None:
        self.found.append(self.locator.at(breadcrumb, message, "resolve"))

    def attempt(self, breadcrumb: str, action: Callable[[], Any]) -> Any:
        """Run ``action``; a ``KadaptError`` becomes a finding at its own location or ``breadcrumb``."""
        try:
            return action()
        except KadaptError as exc:
            match = _LOCATION.match(exc.location or "")
            if match:
                line, col = int(match["line"]), int(match["col"])
                self.found.append(
                    Diagnostic(self.locator.file, line, col, "", exc.message, Severity.ERROR, "resolve")
                )
            else:
                self.error(breadcrumb, exc.message)
            return None


def _check_targets(findings: _Findings) -> None:
    from .patching.targets import import_module, parse_target, resolve_in

    for i, patch in enumerate(findings.spec.patches):
        if patch.is_remote:
            continue
        ref = parse_target(patch.target)
        findings.attempt(f"patches[{i}].target", lambda ref=ref: resolve_in(ref, import_module(ref)))


def _short_model_overrides(spec: Spec) -> dict[str, Any]:
    """Keep enough layers to hold one of each kind (dense and MoE, attention, linear attention and each
    compressed kind), so class names can be found (and a config class that wants both mixers accepts the
    short stack), and the ABI's states bind to the short stack's kinds; a shared-block stack up to its
    first hybrid layer that reuses a block (transformers ties it there)."""
    from .config.source import resolve_source
    from .structure.layer_pattern import shorten_layers
    from .structure.of_spec import raw_text_section, structure_of_raw
    from .structure.shared_blocks import reusing_prefix

    raw = resolve_source(spec).raw
    structure = structure_of_raw(spec, raw)
    first_of_kind: dict[tuple[bool | str, str], int] = {}
    for layer in structure.layers:  # compressed kinds (DeepSeek-V4's hca, csa) each carry their own states
        mixer = layer.attention if layer.attention in ("hca", "csa") else layer.attention == "linear"
        first_of_kind.setdefault((mixer, layer.mlp), layer.index)
    keep = max(max(first_of_kind.values()) + 1, reusing_prefix(structure))
    key, section = raw_text_section(spec, raw)
    prefix = f"{key}." if key else ""
    # config classes need one entry per layer in every per-layer list
    lists = shorten_layers(section or {}, structure.num_layers, keep)
    return {prefix + structure.keys["num_layers"]: keep, **{prefix + k: v for k, v in lists.items()}}


def _check_classes(findings: _Findings, model: Any) -> None:
    spec = findings.spec
    present = sorted({type(module).__name__ for module in model.modules()})
    wanted = [("mla.attention_class", (spec.mla or {}).get("attention_class"))]
    wanted += [
        (f"moe.{key}", (spec.moe or {}).get(key)) for key in ("moe_class", "gate_class", "experts_class")
    ]
    for breadcrumb, name in wanted:
        if name and name not in present:
            close = difflib.get_close_matches(name, present, n=4, cutoff=0.4)
            hint = f"; close: {', '.join(close)}" if close else ""
            findings.error(breadcrumb, f"{type(model).__name__} has no module of class {name!r}{hint}")


def _check_model(findings: _Findings) -> None:
    from .backends.extraction.options import bind_structure, options_from_spec
    from .loading import applied, load_config, load_model, submodule
    from .structure.of_spec import structure_of_config

    spec = findings.spec
    overrides = findings.attempt("source", lambda: _short_model_overrides(spec))
    if overrides is None:
        return
    config = findings.attempt("config_bridges", lambda: load_config(spec, overrides=overrides))
    if config is None:
        return
    structure = findings.attempt("architecture", lambda: structure_of_config(spec, config))
    if structure is None:
        return
    if spec.abi is not None:
        import tempfile

        with tempfile.TemporaryDirectory() as scratch:
            options = findings.attempt("abi", lambda: options_from_spec(spec, output_dir=scratch))
            if options is not None:
                findings.attempt("abi", lambda: bind_structure(options, structure))
    if findings.found:
        return
    with applied(spec, backend="extraction"):
        model = findings.attempt("module_paths", lambda: load_model(spec, device="meta", config=config))
        if model is None:
            return
        found = {
            key: findings.attempt(f"module_paths.{key}", lambda key=key: submodule(model, spec, key))
            for key in spec.module_paths
            # relative to the language model, or to one layer: ``_check_stack_parts``
            if key not in STACK_PARTS and key != LAYER_ATTENTION
        }
        if spec.abi is not None and found.get("language_model") is not None:
            _check_stack_parts(
                findings, model, found["language_model"], found.get("lm_head"), structure.layer_kinds
            )
        _check_classes(findings, model)


def _check_stack_parts(
    findings: _Findings, model: Any, language_model: Any, lm_head: Any, kinds: Sequence[str]
) -> None:
    """The parts the extraction wrappers call on the decoder stack, where ``module_paths`` says (or
    transformers' usual names), the positions they hand its layers and each layer's attention (of
    ``kinds``, by layer): a missing part, learned position embeddings ``module_paths.position_embeddings``
    does not name, or a layer without an attention that caches under its index (where
    ``module_paths.layer_attention`` says, or the usual names) is the refusal apply would raise, at its
    spec key (``check_stack``)."""
    from .backends.extraction.ir.stack import Backbone, check_stack

    backbone = Backbone(model, language_model, lm_head, findings.spec.stack_parts())
    findings.attempt("module_paths", lambda: check_stack(backbone, kinds))


def resolve_diagnostics(spec: Spec, display: str | Path) -> list[Diagnostic]:
    """Every finding of resolving ``spec`` (already valid) against real code and config."""
    from .patching.remote import uses_remote_code

    findings = _Findings(spec, str(display))
    _check_targets(findings)
    if uses_remote_code(spec):
        findings.found.append(
            findings.locator.at(
                "source",
                "remote-code model: module paths and classes are resolved by `kadapt apply "
                "--trust-remote-code`, not by validate",
                "resolve",
                Severity.WARNING,
            )
        )
    elif not findings.found:
        _check_model(findings)
    return findings.found
