"""Plain ``validate``'s checks of a spec against the config it ships, still torch-free.

Schema and semantic checks read the YAML and the config's keys. This reads what the config *says*,
with the same code ``apply`` runs later, so a spec that cannot work fails at lint time, located:

- what kadapt refuses to model (hybrid layers, per-layer configs, other attention kinds, math
  outside the layers it does not reproduce) - ``structure.derive.refuse_unmodelled`` on the raw JSON;
- config values that no model can have (a size of 0, -4, 4096.5, ``"abc"`` or ``NaN``, a count beyond
  every published model's, top-k above the experts): every one, each naming the config file and key -
  ``structure.derive.config_value_violations``, the check ``derive_structure`` runs first;
- a ``quantization_config`` whose storage the weight map cannot describe (``quant_method``, format),
  or that a spec ``quantization`` scheme contradicts - each backend's, as its config bridges leave the
  shipped one (a scheme beside no backend's ``quantization_config``: a warning, since extraction then
  reads the checkpoint dense);
- an ``abi.kv_layout`` (or ``mla_attention``) the model's attention cannot hold (``expanded`` on GQA);
- an ``abi.step.mtp`` whose config states no MTP layer, or more than the one depth exported
  (``num_nextn_predict_layers``; a config leaving it to its class's default is ``apply``'s to refuse);
- an ``abi.step.aux_layers`` id past the config's decoder layers.

A fact a bare ``config.json`` leaves to its transformers class's defaults cannot be read here; the
KV-layout check is then left to ``validate --resolve``, which builds the config object.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import KadaptError
from .diagnostics import Diagnostic, Location, Locator, Severity


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
    if not found:  # a refused model's other values do not matter
        found += _values(spec, config, locator)
    unreadable = _quantization_configs(spec, config, locator)
    found += unreadable or _quantization(spec, config, locator)
    if not found and spec.abi is not None:
        found += _kv_layout(spec, config, locator)
    return found + _mtp(spec, config, locator) + _aux_layers(spec, config, locator)


def _refusals(spec: Any, config: dict[str, Any], locator: Locator) -> list[Diagnostic]:
    from ..structure.of_spec import raw_text_section, refuse_unmodelled_in_raw

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


def _values(spec: Any, config: dict[str, Any], locator: Locator) -> list[Diagnostic]:
    """One finding per config value that breaks its rule, located at ``source.config``."""
    from ..structure.bounds import render
    from ..structure.of_spec import config_value_violations

    origin, violations = config_value_violations(spec, config)
    return [locator.at("source.config", render(origin, v), "config-value") for v in violations]


def _quantization_configs(spec: Any, config: dict[str, Any], locator: Locator) -> list[Diagnostic]:
    """A ``quantization_config`` (in the text section or the root) is a mapping, or nothing reads it."""
    from ..structure.bounds import MAPPING, shown_path
    from ..structure.of_spec import raw_text_section

    key, text = raw_text_section(spec, config)
    holders = {f"{key}.": text, "": config} if key else {"": config}
    found = []
    for prefix, holder in holders.items():
        qc = holder.get("quantization_config") if isinstance(holder, dict) else None
        problem = MAPPING.problem(qc) if qc else None
        if problem:
            message = f"{shown_path(spec.source.config)}: {prefix}quantization_config: {problem}"
            found.append(locator.at("source.config", message, "config-value"))
    return found


def _quantization(spec: Any, config: dict[str, Any], locator: Locator) -> list[Diagnostic]:
    """The ``quantization_config`` each backend reads (the shipped config's, as that backend's bridges
    leave it) must be one the weight map describes, and the spec's ``quantization`` schemes must agree
    with it (the config decides storage; a scheme is a claim). A backend whose bridges drop it reads the
    checkpoint dense and holds no scheme; a scheme no backend's config speaks of describes another
    checkpoint than the one shipped: a warning."""
    from ..checkpoint.storage import scheme_contradiction, storage_rule
    from ..config.quantization import backend_quantization

    views = backend_quantization(spec, config)
    read = [view for view in views if view.config is not None]
    if not read:
        dropped = not any(view.shipped for view in views)  # the shipped config has one, bridges drop it
        return [
            locator.at(f"quantization[{index}]", _unread(scheme, dropped), "quantization", Severity.WARNING)
            for index, scheme in enumerate(spec.quantization)
        ]
    found = []
    for view in read:
        try:
            storage_rule(view.config, head="lm_head", where=view.where)
        except KadaptError as exc:
            found.append(locator.at("source.config", exc.message, "quantization"))
            continue
        for index, scheme in enumerate(spec.quantization):
            problem = scheme_contradiction(scheme, view.config, view.where)
            if problem is not None:
                found.append(locator.at(f"quantization[{index}]", f"{scheme.id}: {problem}", "quantization"))
    return found


def _unread(scheme: Any, dropped: bool) -> str:
    """Why ``scheme`` describes no checkpoint a backend reads."""
    claim = f"{scheme.id} describes int{scheme.bits} storage, but "
    if dropped:
        return (
            f"{claim}every backend's config bridges drop the config's quantization_config: extraction "
            "reads the checkpoint dense and plan sizes it dense (the scheme describes the published "
            "checkpoint, not the one the bridges read)"
        )
    return (
        f"{claim}the config has no quantization_config: extraction reads that checkpoint dense, as "
        "transformers loads it (set the config's quantization_config if the checkpoint is quantized)"
    )


def _kv_layout(spec: Any, config: dict[str, Any], locator: Locator) -> list[Diagnostic]:
    from ..errors import Refusal
    from ..structure.kv_layout import resolve_kv_layout
    from ..structure.of_spec import structure_of_raw

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


def _mtp(spec: Any, config: dict[str, Any], locator: Locator) -> list[Diagnostic]:
    """``abi.step.mtp`` against the MTP layers the config states (``runtime.mtp.mtp_refusal``' rule)."""
    from ..structure.of_spec import raw_text_section

    if spec.abi is None or spec.abi.step is None or not spec.abi.step.mtp:
        return []
    _, text = raw_text_section(spec, config)
    stated = [text[key] for key in ("num_nextn_predict_layers", "num_mtp_layers") if key in (text or {})]
    if not stated or stated[0] == 1:
        return []
    why = "has no MTP layer" if not stated[0] else f"has {stated[0]!r} MTP layers; only one depth is exported"
    return [locator.at("abi.step.mtp", f"the config {why}: no MTP draft graph", "abi-step")]


def _aux_layers(spec: Any, config: dict[str, Any], locator: Locator) -> list[Diagnostic]:
    """``abi.step.aux_layers`` against the decoder layers the config states (``apply`` checks the same
    rule, ``aux_layer_range_problem``, against the model it builds)."""
    from ..structure.of_spec import structure_of_raw

    if spec.abi is None or spec.abi.step is None or not spec.abi.step.aux_layers:
        return []
    try:
        structure = structure_of_raw(spec, config)
    except KadaptError:
        return []  # refused or left to the config class's defaults: reported above or by --resolve
    problem = aux_layer_range_problem(spec.abi.step.aux_layers, structure.num_layers)
    return [locator.at("abi.step.aux_layers", problem, "abi-step")] if problem else []


def aux_layer_range_problem(layers: Sequence[int], num_layers: int) -> str | None:
    """Which ``abi.step.aux_layers`` a stack of ``num_layers`` decoder layers lacks (None: none): the rule
    ``validate`` checks against the config and ``apply`` against the model it builds."""
    outside = [layer for layer in layers if not 0 <= layer < num_layers]
    if not outside:
        return None
    return (
        f"aux_layers {outside} outside 0..{num_layers - 1}: the model has {num_layers} decoder layers "
        "(layer i's hidden state is the one after decoder layer i)"
    )
