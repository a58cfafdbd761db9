"""How derive reads one config: which keys answer each structural fact (``config_keys.yaml``, plus the
spec's ``architecture.fields``), over a transformers config object or its raw JSON alike, remembering
which key answered so findings name it."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import yaml

from ..errors import Refusal
from ..resources import package_file
from ..spec.model import Spec

MISSING = object()  # a key the config does not have (None is a value it may hold)


# facts whose value is a list; every other fact is one number (or string) for the whole stack
LIST_FACTS = (
    "layer_types",
    "dense_layer_list",
    "indexer_types",
    "compress_ratios",
    "mlp_layer_types",
    "moe_layer_list",
    "rope_layer_flags",
)


@functools.cache
def tables() -> dict[str, Any]:
    """``config_keys.yaml``, read once: the fact keys and the tables derive refuses by."""
    return yaml.safe_load(package_file("structure", "config_keys.yaml").read_text(encoding="utf-8"))


def outside_modelled() -> dict[str, dict[str, Any]]:
    """Config key -> {site, op, neutral}: the math outside the layers the wrappers reproduce."""
    return {key: dict(rule) for key, rule in tables()["outside_modelled"].items()}


def mlp_block_types() -> dict[str, str]:
    """Layer type -> MLP kind of the blocks that are an MLP alone, in a stack of one-sublayer blocks."""
    return dict(tables()["mlp_blocks"]["kinds"])


def fact_keys() -> dict[str, list[str]]:
    """Fact -> candidate config keys, in lookup order."""
    return {fact: list(keys) for fact, keys in tables()["facts"].items()}


class Reader:
    """Looks facts up in one config (dict or object), remembering which key answered.

    ``origin`` names the config file in value findings, ``prefix`` the section holding the text
    backbone (``text_config.``), so a finding reads ``specs/x/config.json: text_config.vocab_size: ...``."""

    def __init__(
        self, config: Any, spec: Spec | None, where: str, origin: str | None = None, prefix: str = ""
    ) -> None:
        self.config = config
        self.spec = spec
        self.where = where
        self.origin = origin or where
        self.prefix = prefix
        self.keys: dict[str, str] = {}
        self._dict: dict[str, Any] | None = None
        self.candidates = fact_keys()
        for fact, key in _spec_fields(spec).items():
            self.candidates[fact] = [key]

    def raw(self, key: str) -> Any:
        if isinstance(self.config, Mapping):
            return self.config.get(key, MISSING)
        try:
            return getattr(self.config, key, MISSING)
        except Exception as exc:  # noqa: BLE001 - per-layer configs refuse global reads (Gemma-4)
            # an attribute a layer may override reads as the stack's value (``layer_shapes`` reads the
            # layers' own from ``per_layer_config``); any other stays refused
            if key in tables()["per_layer_attention"]["attributes"]:
                return self._serialised().get(key, MISSING)
            raise Refusal(
                "per-layer-config",
                f"{self.where} gives {key} per layer ({type(exc).__name__}); kadapt carries only "
                f"{', '.join(tables()['per_layer_attention']['attributes'])} per layer",
                location=locate(self.spec, "gate"),
            ) from exc

    def _serialised(self) -> dict[str, Any]:
        """The config object as its ``config.json`` holds it (global values, ``per_layer_config``)."""
        if self._dict is None:
            self._dict = self.config.to_dict()
        return self._dict

    def per_layer_config(self) -> Any:
        """The config's ``per_layer_config`` (sparse overrides per layer, as ``to_dict`` writes it), or
        None: a JSON dict's key, a config object's serialised form (its attribute is a per-layer view)."""
        if isinstance(self.config, Mapping):
            return self.config.get("per_layer_config")
        if not getattr(self.config, "is_heterogeneous", False):
            return None  # every layer as the config says (transformers' HeterogeneousConfigMixin)
        return self._serialised().get("per_layer_config")

    def get(self, fact: str, default: Any = None) -> Any:
        fixed = tables()["fixed"].get(self.raw("model_type"), {})
        if fact in fixed:  # the family's modelling code fixes it: its config key is not read
            return fixed[fact]
        for key in self.candidates.get(fact, [fact]):
            value = self.raw(key)
            if value is not MISSING and value is not None:
                if isinstance(value, (list, tuple)) and fact not in LIST_FACTS:
                    raise Refusal(
                        "per-layer-config",
                        f"{self.where}: {key} is a list (one value per layer); kadapt describes one "
                        f"{fact} for every layer",
                        location=locate(self.spec, "gate"),
                    )
                self.keys[fact] = key
                return value
        implied = tables()["implied"].get(self.raw("model_type"), {})
        if fact in implied:  # fixed by the family's modelling code: no config key to name (or shrink)
            return implied[fact]
        return default

    def peek(self, fact: str) -> tuple[str, Any] | None:
        """``(key, value)`` of the first present, non-null key of ``fact``, refusing nothing: the value
        check leaves a per-layer list or config to the reads that refuse it, in derive's order."""
        for key in self.candidates.get(fact, [fact]):
            try:
                value = self.raw(key)
            except Refusal:
                return None
            if value is not MISSING and value is not None:
                return key, value
        return None

    def require(self, fact: str) -> Any:
        value = self.get(fact)
        if value is None:
            names = ", ".join(self.candidates.get(fact, [fact]))
            raise Refusal(
                "unknown-key",
                f"{self.where} has no {fact} (looked for: {names}); name the config key under "
                f"architecture.fields.{fact} in the spec",
                location=self.spec.locate("architecture") if self.spec and self.spec.architecture else None,
            )
        return value


def _spec_fields(spec: Spec | None) -> dict[str, str]:
    if spec is None:
        return {}
    fields = dict((spec.architecture or {}).get("fields") or {})
    key = (spec.moe or {}).get("num_experts_key")
    if key and "num_experts" not in fields:
        # [text_config, n_routed_experts] names the key inside the text sub-config
        fields["num_experts"] = key[-1] if isinstance(key, list) else key
    return fields


def locate(spec: Spec | None, where: str) -> str | None:
    """The spec line of ``where`` (else of its parent section), for a finding about that entry."""
    if spec is None:
        return None
    return spec.locate(where if where in spec.positions else where.rsplit(".", 1)[0])
