"""A spec's model structure: which section of its config is the text model, read raw or built.

``derive`` turns one config (object or JSON) into a ``ModelStructure``; this module is how commands
call it for a spec: it finds the text section (``text_config`` or the root), names the shipped file
in every finding, and serves torch-free ``plan`` and ``validate`` (raw JSON) and ``apply`` (the
built config object) alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import KadaptError
from ..spec.model import Spec
from . import bounds
from .derive import derive_structure, refuse_unmodelled, value_violations
from .model import ModelStructure


def text_config_key(spec: Spec, has_text_config: bool) -> str | None:
    """Key of the text sub-config in the root config, or None when the root is the text config.

    ``architecture.config`` or ``abi.config`` says it; otherwise a ``text_config`` entry decides.
    """
    stated = (spec.architecture or {}).get("config")
    if stated:
        return stated
    if spec.abi is not None and spec.abi.config:
        return spec.abi.config
    return "text_config" if has_text_config else None


def raw_text_section(spec: Spec, raw: Mapping[str, Any]) -> tuple[str | None, Mapping[str, Any] | None]:
    """The text backbone's key in a raw root config dict (None: the root is it) and its section (None:
    the config has no such section)."""
    key = text_config_key(spec, isinstance(raw.get("text_config"), Mapping))
    text = raw.get(key) if key else raw
    return key, text if isinstance(text, Mapping) else None


def _where(key: str | None) -> str:
    """How errors name the text section of the config."""
    return f"config {key}" if key else "config"


def _missing(key: str | None) -> KadaptError:
    return KadaptError(f"config has no '{key}' sub-config holding the text backbone")


def _prefix(key: str | None) -> str:
    """How value findings name the keys of the text section: ``text_config.vocab_size``."""
    return f"{key}." if key else ""


def _shipped(spec: Spec) -> str:
    """The shipped config file, as value findings name it."""
    return bounds.shown_path(spec.source.config) if spec.source.config is not None else "config"


def structure_of_raw(spec: Spec, raw: Mapping[str, Any]) -> ModelStructure:
    """Structure from a raw root config dict, the spec's shipped config (torch-free: ``kadapt plan``
    uses this)."""
    key, text = raw_text_section(spec, raw)
    if text is None:
        raise _missing(key)
    return derive_structure(text, spec, where=_where(key), origin=_shipped(spec), prefix=_prefix(key))


def config_value_violations(spec: Spec, raw: Mapping[str, Any]) -> tuple[str, list[bounds.Violation]]:
    """The config file's name and the value findings of its text section (the same check as
    ``derive_structure``), for plain ``validate`` to report beside its other findings."""
    key, text = raw_text_section(spec, raw)
    if text is None:
        return _shipped(spec), []
    return value_violations(text, spec, _where(key), _shipped(spec), _prefix(key))


def refuse_unmodelled_in_raw(spec: Spec, raw: Mapping[str, Any]) -> None:
    """``refuse_unmodelled`` on the text section of a raw root config dict (no section: nothing to refuse,
    the structure reports it missing)."""
    key, text = raw_text_section(spec, raw)
    if text is not None:
        refuse_unmodelled(text, spec, where=_where(key))


def structure_of_config(spec: Spec, config: Any) -> ModelStructure:
    """Structure from a built transformers config (after bridges; the root or its text sub-config)."""
    key = text_config_key(spec, getattr(config, "text_config", None) is not None)
    text = getattr(config, key, None) if key else config
    if text is None:
        raise _missing(key)
    # the object may come from the hub or a model directory, not the shipped file: named as "config"
    return derive_structure(text, spec, where=_where(key), origin="config", prefix=_prefix(key))
