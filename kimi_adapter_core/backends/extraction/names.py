"""The ABI names of the graphs: fixed inputs, the per-layer state name templates, the logits.

A spec names each graph's inputs and outputs positionally (``abi.prefill``, ``abi.decode``,
``abi.vision.merged_prefill``): the fixed inputs first, then ``{layer}`` templates of the attention
key and value, optionally followed by a linear-attention layer's conv and recurrent state, or by a DSA
layer's indexer keys. Each layer uses the templates of its kind (``LAYER_STATES``). Torch-free, like
``options``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import KadaptError
from ...spec.model import LAYER, GraphAbi, MergedPrefillAbi, Spec

PREFILL_FIXED = ("input_ids", "attention_mask", "position_ids")
DECODE_FIXED = (*PREFILL_FIXED, "cache_position")
MERGED_FIXED = ("input_ids", "image_features", "attention_mask", "position_ids")


# The states each layer kind carries, in ABI order (the runtime's ``LAYER_STATES``, torch-free here).
LAYER_STATES = {
    "attention": ("key", "value"),
    "linear": ("conv", "recurrent"),
    "lightning": ("recurrent",),  # MiniMax's lightning attention: its recurrent state alone
    "short_conv": ("conv",),  # LFM2's gated short convolution: its conv window alone
    "indexed": ("key", "value", "index_key"),
    "none": (),  # a block with no token mixer (Nemotron-H's mlp and moe blocks): no state
    "shared": (),  # attends over an earlier layer's keys and values of the same call (Gemma-4): no state
    "hybrid": ("key", "value", "conv", "recurrent"),  # attention and a linear mixer (Falcon-H1, Zamba)
    # DeepSeek-V4's hca: a sliding KV, a compressor's ring and entries; csa: also its indexer's ring and
    # entries
    "hca": ("key", "value", "comp_src", "comp"),
    "csa": ("key", "value", "comp_src", "comp", "index_src", "index_comp"),
}
# States of one fixed size per request (no sequence dimension; a compressor's ring): never paged.
FIXED_ROLES = ("conv", "recurrent", "comp_src", "index_src")
# A compressor's entries: per request too (``max_cache_len / rate`` slots per row), never paged.
COMPRESSED_ROLES = ("comp", "index_comp")
# The optional templates after key and value, by how many there are: none, a DSA layer's indexer keys,
# or two: a linear layer's conv and recurrent state, or a compressed layer's ring and entries (a stack
# has one or the other: ``SECOND_PAIR`` reads the compressor's under the linear layer's names), or four:
# those and a csa layer's indexer's ring and entries.
EXTRA_ROLES = {
    0: (),
    1: ("index_key",),
    2: ("conv", "recurrent"),
    4: ("conv", "recurrent", "index_src", "index_comp"),
}
SECOND_PAIR = {"comp_src": "conv", "comp": "recurrent"}
Kinds = int | Sequence[str]  # a layer count (every layer attention) or each layer's kind


def layer_kinds(kinds: Kinds) -> list[str]:
    return ["attention"] * kinds if isinstance(kinds, int) else list(kinds)


def state_roles(kinds: Kinds) -> list[tuple[int, str]]:
    """``(layer, role)`` of every per-layer state tensor, in ABI order."""
    return [(layer, role) for layer, kind in enumerate(layer_kinds(kinds)) for role in LAYER_STATES[kind]]


@dataclass(frozen=True)
class GraphNames:
    """ABI names of one graph: fixed inputs in wrapper order, per-layer state name templates, logits.

    Attention layers use the key/value templates; linear-attention layers the conv/recurrent ones, DSA
    layers the index_key ones besides key/value (None when the spec names none: a stack without such
    layers)."""

    fixed_inputs: tuple[str, ...]
    past_key: str | None  # template with "{layer}"; None for prefill
    past_value: str | None
    logits: str
    present_key: str
    present_value: str
    past_conv: str | None = None
    past_recurrent: str | None = None
    present_conv: str | None = None
    present_recurrent: str | None = None
    past_index_key: str | None = None
    present_index_key: str | None = None
    hidden: str | None = None  # an output after the logits: their rows' final hidden states (MTP drafts)
    aux: str | None = None  # then their rows' hidden states of chosen layers, concatenated (EAGLE-3)
    past_index_src: str | None = None  # a csa layer's indexer ring and entries
    present_index_src: str | None = None
    past_index_comp: str | None = None
    present_index_comp: str | None = None

    def template(self, direction: str, role: str) -> str | None:
        """The ``{layer}`` template of state ``role`` (key, value, conv, recurrent) in ``direction``
        (past: decode inputs, present: outputs); a compressor's ring and entries (comp_src, comp) take
        the two templates a linear layer's conv and recurrent state would (``SECOND_PAIR``)."""
        return getattr(self, f"{direction}_{SECOND_PAIR.get(role, role)}")

    def _names(self, direction: str, kinds: Kinds) -> list[str]:
        names = []
        for layer, kind in enumerate(layer_kinds(kinds)):
            for role in LAYER_STATES[kind]:
                template = self.template(direction, role)
                if template is None:
                    raise KadaptError(f"the ABI names no {direction} {role} state for layer {layer} ({kind})")
                names.append(template.format(layer=layer))
        return names

    def inputs(self, kinds: Kinds) -> list[str]:
        """Input names of a stack of ``kinds`` (a count: that many attention layers)."""
        if self.past_key is None:
            return list(self.fixed_inputs)
        return [*self.fixed_inputs, *self._names("past", kinds)]

    def outputs(self, kinds: Kinds) -> list[str]:
        return [*self.heads, *self._names("present", kinds)]

    @property
    def heads(self) -> list[str]:
        """The outputs before the states: the logits, then the hidden states a draft reads, if any."""
        return [self.logits, *(name for name in (self.hidden, self.aux) if name)]

    @property
    def has_linear_states(self) -> bool:
        return self.present_conv is not None

    @property
    def has_index_keys(self) -> bool:
        return self.present_index_key is not None


def kv_names(prefill: GraphNames, decode: GraphNames) -> dict[str, str]:
    """The per-layer state name templates of both graphs, keyed as the KV mapping names them
    (``prefill_key``, ``decode_key_in``, ``decode_key_out``, ... and, when the ABI names them, the
    linear layers' ``conv`` and ``recurrent`` states alike)."""
    names: dict[str, str] = {}
    for roles in (("key", "value"), ("conv", "recurrent"), ("index_key",), ("index_src", "index_comp")):
        for key, graph, direction in (
            ("prefill_{}", prefill, "present"),
            ("decode_{}_in", decode, "past"),
            ("decode_{}_out", decode, "present"),
        ):
            for role in roles:
                template = graph.template(direction, role)
                if template is not None:
                    names[key.format(role)] = template
    return names


def read_graph_names(
    abi: GraphAbi | MergedPrefillAbi, fixed: tuple[str, ...], *, decode: bool, where: str, spec: Spec
) -> GraphNames:
    """Read the positional ABI of one graph: fixed names first, then the ``{layer}`` templates of the
    attention key and value, optionally followed by a linear layer's conv and recurrent state or a DSA
    layer's indexer keys (``EXTRA_ROLES``)."""
    location = spec.locate(where)
    inputs, outputs = list(abi.inputs), list(abi.outputs)
    n_fixed = len(fixed)
    templated_in = inputs[n_fixed:]
    extra = EXTRA_ROLES.get(len(outputs) - 3, ())
    want_in = n_fixed + (2 + len(extra) if decode else 0)
    if (
        len(inputs) != want_in
        or any(LAYER in name for name in inputs[:n_fixed])
        or not all(LAYER in name for name in templated_in)
    ):
        roles = ("key", "value", *extra) if decode else ()
        shape = ", ".join([*fixed, *(f'"<past {role} {{layer}}>"' for role in roles)])
        raise KadaptError(
            f"{where}.inputs must be [{shape}] (positional roles), got {inputs}", location=location
        )
    if len(outputs) - 3 not in EXTRA_ROLES or LAYER in outputs[0] or not all(LAYER in n for n in outputs[1:]):
        raise KadaptError(
            f'{where}.outputs must be [<logits>, "<present key {{layer}}>", "<present value {{layer}}>"], '
            'followed by "<present conv {layer}>", "<present recurrent {layer}>" for a stack with '
            'linear-attention layers (or a compressor\'s "<present comp_src {layer}>", "<present comp '
            '{layer}>", then for csa layers "<present index_src {layer}>", "<present index_comp '
            '{layer}>"), or by "<present index_key {layer}>" for DSA layers, got '
            f"{outputs}",
            location=location,
        )
    templates = {
        f"present_{role}": name for role, name in zip(("key", "value", *extra), outputs[1:], strict=True)
    }
    if decode:
        templates.update(
            {f"past_{role}": name for role, name in zip(("key", "value", *extra), templated_in, strict=True)}
        )
    return GraphNames(
        fixed_inputs=tuple(inputs[:n_fixed]),
        past_key=templates.get("past_key"),
        past_value=templates.get("past_value"),
        logits=outputs[0],
        **{name: template for name, template in templates.items() if name not in ("past_key", "past_value")},
    )
