"""The rotary embedding a config describes: one for every layer, one per layer type, or one per label.

transformers 5 keeps ``rope_parameters`` per layer type for families whose sliding and full layers
rotate differently (Gemma-3, OLMo-3, ...): ``{"full_attention": {...}, "sliding_attention": {...}}``;
DeepSeek-V4 nests them under labels its ``layer_types`` never names (``{"main", "compress"}``): ``rope``.
Read through ``derive``'s reader, so a config object and its raw JSON describe the rope alike: a config
object holds what ``PreTrainedConfig.standardize_rope_params`` moved into ``rope_parameters`` (a top-level
``partial_rotary_factor``, the ``original_max_position_embeddings`` a scaled rope stretches), which the
raw JSON keeps at the top or leaves to ``max_position_embeddings``; both are read the way that method
fills them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Protocol

from .rope import BY_LABEL, PER_LAYER_TYPE, Rope

# rope types whose scaling stretches a trained context: transformers fills their
# original_max_position_embeddings from max_position_embeddings when the mapping has none
STRETCHING = ("llama3", "yarn", "longrope")
# Llama-4's NoPE rule when its config lists no layers and states no interval (Llama4TextConfig's default)
DEFAULT_NOPE_INTERVAL = 4


class Reader(Protocol):
    """What rope reads of ``derive.Reader``: facts by name (``rope_parameters``, ``rope_theta``,
    ``partial_rotary_factor``, ``rope_layer_flags``) and raw config keys (``layer_types``); ``where``
    names the config in a finding."""

    where: str

    def get(self, fact: str, default: Any = None) -> Any: ...

    def raw(self, key: str) -> Any: ...


def rope_of(read: Reader, num_layers: int) -> Rope:
    """One rope, or one per layer type when ``rope_parameters`` nests a mapping per layer type (as
    transformers 5 keeps Gemma-3's and OLMo-3's), or per label when none of its keys is a type of the
    config's ``layer_types`` (DeepSeek-V4's); a missing theta is the config's ``rope_theta``, as
    transformers fills it. The layers without rope come from ``rope_flags``."""
    params = read.get("rope_parameters")
    if params is None and read.get("rope_theta") is None:
        # transformers 5 gives every config class that rotates a rope_parameters; a config without
        # any rope key (Kimi-Linear's NoPE MLA, Mamba/SSM stacks) has no rope
        return Rope("none", None)
    flags = rope_flags(read, num_layers)
    nope = tuple(i for i, flag in enumerate(flags or ()) if not flag)
    params = params or {}
    nested = _rope_by_layer_type(read, params)
    if not nested:
        return replace(_rope_kind(read, params, top_level=True), nope_layers=nope)
    by_layer_type = tuple((name, _rope_kind(read, nested[name], top_level=False)) for name in sorted(nested))
    named = named_layer_types(read)
    labelled = bool(named) and not named & nested.keys()  # keyed by labels, not by the layers' types
    kind = BY_LABEL if labelled else PER_LAYER_TYPE
    return Rope(type=kind, theta=None, by_layer_type=by_layer_type, nope_layers=nope)


def rope_flags(read: Reader, num_layers: int) -> list[int] | None:
    """Per layer 1 when it applies rope, 0 for a NoPE layer, as transformers' ``no_rope_layers`` holds
    them (model types llama4_text, smollm3, mistral_large4; 1 = uses rope despite the name): that list
    when the config has one, else every ``no_rope_layer_interval``-th layer NoPE, else with an
    ``attention_chunk_size`` (Llama-4's) every 4th (the class's default). None: the config says nothing
    of NoPE layers."""
    flags = read.get("rope_layer_flags")
    if flags:  # a flag for every layer at least (``bounds``: checked with the config's values)
        return [int(flag) for flag in flags[:num_layers]]
    interval = read.get("no_rope_interval")
    if interval is None and not read.get("attention_chunk_size"):
        return None
    interval = int(interval or DEFAULT_NOPE_INTERVAL)
    return [int((i + 1) % interval != 0) for i in range(num_layers)]


def named_layer_types(read: Reader) -> frozenset[str]:
    """The layer types the config's ``layer_types`` names (empty without a list): what tells a rope
    mapping keyed by layer types from one keyed by labels. Entries are read as text, as the value check
    (``bounds``) sees them before it has refused any that are not."""
    types = read.raw("layer_types")
    return frozenset(map(str, types)) if isinstance(types, (list, tuple)) else frozenset()


def _rope_by_layer_type(read: Reader, params: Mapping[str, Any]) -> dict[str, Mapping[str, Any] | None]:
    """Layer type -> its rope mapping when ``params`` is nested: the keys holding a mapping, and those
    the config's ``layer_types`` names that hold null (no rope there); empty for a flat mapping."""
    if not any(isinstance(value, Mapping) for value in params.values()):
        return {}
    named = named_layer_types(read)
    return {
        str(key): value
        for key, value in params.items()
        if isinstance(value, Mapping) or (value is None and key in named)
    }


def _rope_kind(read: Reader, params: Mapping[str, Any] | None, *, top_level: bool) -> Rope:
    """One rope mapping (null: ``none``): its type, theta (else the config's ``rope_theta``), scaling
    factor, the context a stretching type scales from and the share of the head it rotates (below 1),
    each filled as ``standardize_rope_params`` fills it: ``top_level`` (one rope for the stack) gives a
    top-level ``original_max_position_embeddings`` precedence over the mapping's, as it does Phi-3's."""
    if params is None:
        return Rope("none", None)
    # as transformers reads it (``bounds`` refuses a null or empty type: only a remote-code config,
    # whose classes name their own types, gets here with one, read as ``default``)
    rope_type = str(params.get("rope_type", params.get("type", "default")) or "default")
    theta = params.get("rope_theta") or read.get("rope_theta")
    return Rope(
        type=rope_type,
        theta=float(theta) if theta is not None else None,
        factor=_number(params.get("factor")),
        original_positions=_original_positions(read, params, rope_type, top_level=top_level),
        partial=_partial(read, params),
    )


def _partial(read: Reader, params: Mapping[str, Any]) -> float | None:
    """The share of each head's width the rope rotates, below 1 (None: all of it, or a stated size):
    the mapping's ``partial_rotary_factor``, else the config's (``standardize_rope_params`` moves a
    top-level one into every mapping). Where the config states ``qk_rope_head_dim`` (MLA, DeepSeek-V4)
    the rotated width is that size, which the attention's description gives: a fraction beside it says
    it twice, and some config classes recompute it per layer type from that size and the layer's head
    width (Dots3NoteTextConfig), so the JSON's would lie."""
    if read.get("qk_rope_head_dim") is not None:
        return None
    partial = _number(params.get("partial_rotary_factor"))
    if partial is None:
        partial = _number(read.get("partial_rotary_factor"))
    return partial if partial is not None and partial != 1 else None


def _original_positions(
    read: Reader, params: Mapping[str, Any], rope_type: str, *, top_level: bool
) -> int | None:
    """The context the scaling stretches: the mapping's own ``original_max_position_embeddings``; for a
    stretching type without one the config's (Phi-3 keeps it at the top, and there it wins for one rope),
    else ``max_position_embeddings``."""
    own = _number(params.get("original_max_position_embeddings"))
    if rope_type not in STRETCHING:
        return int(own) if own is not None else None
    top = _number(read.get("original_positions")) if top_level else None
    positions = top or own or _number(read.get("max_positions"))
    return int(positions) if positions is not None and positions > 0 else None


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a number (bounds checked it already), else None."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
