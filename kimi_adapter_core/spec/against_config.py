"""Plain ``validate``'s checks of a spec against the config it ships, still torch-free.

Schema and semantic checks read the YAML and the config's keys. This reads what the config *says*,
with the same code ``apply`` runs later, so a spec that cannot work fails at lint time, located:

- what kadapt refuses to model (hybrid layers, per-layer configs, other attention kinds, math
  outside the layers it does not reproduce) - ``structure.derive.refuse_unmodelled`` on the raw JSON;
- a ``quantization_config`` whose storage the weight map cannot describe (``quant_method``, format);
- an ``abi.kv_layout`` (or ``mla_attention``) the model's attention cannot hold (``expanded`` on GQA).

A fact a bare ``config.json`` leaves to its transformers class's defaults cannot be read here; the
KV-layout check is then left to ``validate --resolve``, which builds the config object.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import KadaptError
from .diagnostics import Diagnostic, Location, Locator


def config_diagnostics(
    spec_path: Path, raw: dict[str, Any], positions: dict[str, Location], locator: Locator
) -> list[Diagnostic]:
    """Findings of ``raw`` (a schema- and semantic-clean spec) against its shipped config."""
    from ..config.source import resolve_source
    from .model import build_spec

    spec = build_spec(spec_path, raw, positions)
    if spec.source.config is None:
        return []
    try:
        config = resolve_source(spec).raw
    except KadaptError:
        return []  # unreadable config: the semantic checks reported it
    found = _refusals(spec, config, locator)
    found += _quantization(spec, config, locator)
    if not found and spec.abi is not None:
        found += _kv_layout(spec, config, locator)
    return found


def _refusals(spec: Any, config: dict[str, Any], locator: Locator) -> list[Diagnostic]:
    from ..structure.derive import raw_text_section, refuse_unmodelled_in_raw

    key, text = raw_text_section(spec, config)
    if text is None:
        return [
            locator.at(
                "source.config", f"config has no '{key}' sub-config holding the text backbone", "config"
            )
        ]
    try:
        refuse_unmodelled_in_raw(spec, config)
    except KadaptError as exc:
        return [locator.at("source.config", exc.message, "refused")]
    return []


def _quantization(spec: Any, config: dict[str, Any], locator: Locator) -> list[Diagnostic]:
    from ..backends.extraction.checkpoint_storage import quantization_config_of, storage_rule
    from ..structure.derive import raw_text_section

    _, text = raw_text_section(spec, config)
    qc, where = quantization_config_of(text or {}, config)
    if qc is None:
        return []
    try:
        storage_rule(qc, (), head="lm_head", where=where)
    except KadaptError as exc:
        return [locator.at("source.config", exc.message, "quantization")]
    return []


def _kv_layout(spec: Any, config: dict[str, Any], locator: Locator) -> list[Diagnostic]:
    from ..backends.extraction.options import resolve_kv_layout
    from ..errors import Refusal
    from ..structure.derive import structure_of_raw

    try:
        structure = structure_of_raw(spec, config)
    except Refusal as exc:
        if exc.code == "unknown-key":  # a fact left to the config class's defaults: --resolve checks it
            return []
        return [locator.at("source.config", exc.message, "refused")]
    except KadaptError:
        return []  # likewise: --resolve checks with the built config
    abi = spec.abi
    try:
        resolve_kv_layout(structure.attention, abi.kv_layout, abi.mla_attention)
    except KadaptError as exc:
        where = "abi.kv_layout" if abi.kv_layout and exc.message.startswith("kv_layout") else "abi"
        return [locator.at(where, exc.message, "abi-kv-layout")]
    return []
