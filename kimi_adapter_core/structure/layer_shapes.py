"""Attention shapes that differ per layer: which layers attend with other KV heads or another head width.

transformers states such a stack two ways. A heterogeneous config keeps sparse overrides per layer
(``per_layer_config``: Gemma-4's full-attention layers are ``global_head_dim`` wide), which a config object
serialises with ``to_dict()`` and a ``config.json`` may hold; a family's modelling code may also fix them
(MiMo-V2-Flash's sliding layers have twice the config's KV heads, no key says so). Both are read as data
(``config_keys.yaml``: ``per_layer_attention``), so a config object and its JSON describe one structure.
Only the KV heads and the head width may differ: every layer still caches one key and one value per token,
which is all the ABI needs to carry per layer; any other per-layer attribute stays refused. A multi-head
latent attention's layer may also take its own query heads, latent rank and nope width (dots3's sliding
layers): it still caches one latent and one rope key per token, of its own widths.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..errors import KadaptError, Refusal
from .model import Attention
from .reader import MISSING, Reader, locate, tables


def _table() -> dict[str, Any]:
    return tables()["per_layer_attention"]


# the facts only a multi-head latent attention's layer may override (``config_keys.yaml``
# ``per_layer_attention.attributes`` names the config attribute of each)
LATENT_LAYER_FACTS = ("num_heads", "kv_lora_rank", "qk_nope_head_dim")


def per_layer_attributes() -> dict[str, str]:
    """Config attribute -> the fact it sets, for the attributes a layer may override."""
    return dict(_table()["attributes"])


def layer_attentions(
    read: Reader, attention: Attention, types: Sequence[Any] | None, num_layers: int
) -> tuple[Attention | None, ...]:
    """Per layer its own attention where it differs from ``attention`` (None: the stack's). Called by
    ``derive_structure`` after its refusals, ``refuse_other_layer_attributes`` among them."""
    overrides = _listed(read, num_layers)
    if overrides is None:
        overrides = _ruled(read, attention, types, num_layers)
    if overrides and not attention.is_mla:
        facts = sorted({fact for layer in overrides.values() for fact in layer} & set(LATENT_LAYER_FACTS))
        if facts:
            raise Refusal(
                "per-layer-config",
                f"{read.where}: layers {sorted(overrides)} override {facts} of a per-head KV attention; "
                "kadapt carries a layer's own query heads, latent rank and nope width for multi-head "
                "latent attention only (its KV heads and head width carry the shape a per-head KV caches)",
                location=locate(read.spec, "gate"),
            )
    keyed = _value_from_key(read, types, num_layers)
    shapes: list[Attention | None] = []
    for index in range(num_layers):
        facts = overrides.get(index)
        shape = _shape(read, attention, index, facts) if facts else attention
        if index in keyed:
            shape = replace(shape, value_from_key=True)
        shapes.append(None if shape == attention else shape)
    return tuple(shapes)


def _value_from_key(read: Reader, types: Sequence[Any] | None, num_layers: int) -> set[int]:
    """The layers whose values are the key projection's output (``per_layer_attention.value_from_key``)."""
    rule = _table().get("value_from_key", {}).get(read.raw("model_type"))
    if rule is None or types is None or read.raw(rule["key"]) in (MISSING, None, False):
        return set()
    return {i for i, layer_type in enumerate(list(types)[:num_layers]) if layer_type in rule["layer_types"]}


def _check_sizes(read: Reader, index: int, sizes: Mapping[str, Any]) -> None:
    """Each of layer ``index``'s ``sizes`` (fact -> value) a positive integer, as the stack's are."""
    for fact, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 1 << 20:
            raise KadaptError(
                f"{read.where}: layer {index}'s {fact} is {value!r}; expected a positive integer"
            )


def _latent_shape(read: Reader, attention: Attention, index: int, facts: Mapping[str, int]) -> Attention:
    """A multi-head latent attention with layer ``index``'s query heads, latent rank and nope width. Its
    keys stay expanded one per query head (a KV-head override must say so) and its head width is nope +
    rope, so a ``head_dim`` override sets nothing (dots3's sliding layers state nope + rope there)."""
    assert attention.qk_rope_head_dim is not None
    sizes = {fact: facts.get(fact, getattr(attention, fact)) for fact in LATENT_LAYER_FACTS}
    _check_sizes(read, index, sizes)
    heads = sizes["num_heads"]
    kv_heads = facts.get("num_kv_heads", heads)
    if kv_heads != heads:
        raise KadaptError(
            f"{read.where}: layer {index}'s {kv_heads} KV heads differ from its {heads} attention heads; "
            "a multi-head latent attention expands one KV head per query head"
        )
    nope = sizes["qk_nope_head_dim"]
    return replace(
        attention,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=nope + attention.qk_rope_head_dim,
        kv_lora_rank=sizes["kv_lora_rank"],
        qk_nope_head_dim=nope,
    )


def _shape(read: Reader, attention: Attention, index: int, facts: Mapping[str, int]) -> Attention:
    """``attention`` with layer ``index``'s KV heads and head width; both checked like the stack's."""
    if attention.is_mla:
        return _latent_shape(read, attention, index, facts)
    kv_heads = facts.get("num_kv_heads", attention.num_kv_heads)
    head_dim = facts.get("head_dim", attention.head_dim)
    _check_sizes(read, index, {"num_kv_heads": kv_heads, "head_dim": head_dim})
    heads = attention.num_heads
    if heads % kv_heads:
        raise KadaptError(
            f"{read.where}: layer {index}'s {kv_heads} KV heads do not split the {heads} attention heads"
        )
    kind = "mha" if kv_heads == heads else "mqa" if kv_heads == 1 else "gqa"
    # a layer's head width is its values' too, unless the stack's values have a width of their own
    value_dim = head_dim if attention.v_head_dim == attention.head_dim else attention.v_head_dim
    return Attention(kind, heads, kv_heads, head_dim, value_dim)


def tiny_latent_layers(
    listed: Mapping[Any, Any], stack: Mapping[str, int], tiny: Mapping[str, int], keep: int, head_dim: bool
) -> dict[Any, dict[str, Any]]:
    """``listed`` (a ``per_layer_config``) of a stack whose multi-head latent attention differs per layer,
    for a tiny copy of its first ``keep`` layers whose stack sizes are ``tiny`` (by fact; ``stack``: the
    full stack's). Each overridden latent fact is twice the tiny stack's where the layer's is larger than
    the stack's, else half, so the tiny layers keep a shape of their own; KV heads follow the heads (one
    per query head); with ``head_dim`` (the config states one) each layer's is its nope + rope width, as
    the config class may check (Dots3NoteTextConfig: its sliding layers')."""
    key_of = {fact: key for key, fact in per_layer_attributes().items()}
    shrunk: dict[Any, dict[str, Any]] = {}
    for layer, values in listed.items():
        if int(str(layer)) >= keep or not isinstance(values, Mapping):
            continue
        own = dict(values)
        for fact in LATENT_LAYER_FACTS:
            value = values.get(key_of[fact])
            if isinstance(value, int) and value != stack[fact]:
                own[key_of[fact]] = tiny[fact] * 2 if value > stack[fact] else max(tiny[fact] // 2, 1)
            elif isinstance(value, int):
                own[key_of[fact]] = tiny[fact]
        if key_of["num_kv_heads"] in own:
            own[key_of["num_kv_heads"]] = own.get(key_of["num_heads"], tiny["num_heads"])
        if head_dim:
            own["head_dim"] = (
                own.get(key_of["qk_nope_head_dim"], tiny["qk_nope_head_dim"]) + tiny["qk_rope_head_dim"]
            )
        shrunk[layer] = own
    return shrunk


def _listed(read: Reader, num_layers: int) -> dict[int, dict[str, int]] | None:
    """The config's own ``per_layer_config`` as ``{layer: {fact: value}}``; None: it lists none."""
    listed = read.per_layer_config()
    if not listed:
        return None
    if not isinstance(listed, Mapping):
        raise KadaptError(f"{read.where}: per_layer_config is {type(listed).__name__}; expected a mapping")
    attributes = per_layer_attributes()  # no other: refused first (``refuse_other_layer_attributes``)
    overrides: dict[int, dict[str, int]] = {}
    for layer, values in listed.items():
        index = int(layer) if isinstance(layer, str) and layer.isdigit() else layer
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_layers:
            raise KadaptError(
                f"{read.where}: per_layer_config names layer {layer!r}; expected 0..{num_layers - 1}"
            )
        if not isinstance(values, Mapping):
            raise KadaptError(f"{read.where}: per_layer_config[{layer!r}] is not a mapping of attributes")
        overrides[index] = {attributes[key]: value for key, value in values.items()}
    return overrides


def refuse_other_layer_attributes(read: Reader) -> None:
    """A ``per_layer_config`` that overrides anything but a layer's KV shape is refused, naming the layer
    and the attributes: on the raw JSON too (plain ``validate`` runs it before any config class)."""
    listed = read.per_layer_config()
    if not listed or not isinstance(listed, Mapping):
        return
    attributes = per_layer_attributes()
    for layer, values in listed.items():
        named = values if isinstance(values, Mapping) else {}
        other = sorted(str(key) for key in named if key not in attributes)
        if other:
            raise Refusal(
                "per-layer-config",
                f"{read.where}: per_layer_config[{layer!r}] overrides {', '.join(other)}; kadapt carries "
                f"only {', '.join(attributes)} per layer (the KV shape each layer caches)",
                location=locate(read.spec, "gate"),
            )


def _ruled(
    read: Reader, attention: Attention, types: Sequence[Any] | None, num_layers: int
) -> dict[int, dict[str, int]]:
    """The overrides the family's code derives (``per_layer_attention.rules``, by model_type)."""
    rules = _table()["rules"].get(read.raw("model_type"), {})
    if not rules or types is None:
        return {}
    stack = {"num_kv_heads": attention.num_kv_heads, "head_dim": attention.head_dim}
    overrides: dict[int, dict[str, int]] = {}
    for index, layer_type in enumerate(list(types)[:num_layers]):
        facts = {
            fact: value
            for fact, rule in rules.get(layer_type, {}).items()
            if (value := _ruled_value(read, rule, stack[fact])) is not None
        }
        if facts:
            overrides[index] = facts
    return overrides


def _ruled_value(read: Reader, rule: Mapping[str, Any], stack_value: int) -> Any:
    """One rule's value: ``times`` the stack's, or the value of ``key`` (else ``default``) when ``when``."""
    if "times" in rule:
        return stack_value * int(rule["times"])
    when = rule.get("when")
    if when is not None and read.raw(when) in (MISSING, None, False):
        return None
    value = read.raw(rule["key"])
    return rule.get("default") if value in (MISSING, None) else value
