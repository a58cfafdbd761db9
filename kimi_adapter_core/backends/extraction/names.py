"""The ABI names of the graphs: fixed inputs, the per-layer state name templates, the logits.

A spec names each graph's inputs and outputs positionally (``abi.prefill``, ``abi.decode``,
``abi.vision.merged_prefill``): the fixed inputs first, then ``{layer}`` templates of the attention
key and value, optionally followed by a linear-attention layer's conv and recurrent state. Each layer
uses the templates of its kind (``LAYER_STATES``). Torch-free, like ``options``.
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
LAYER_STATES = {"attention": ("key", "value"), "linear": ("conv", "recurrent")}
Kinds = int | Sequence[str]  # a layer count (every layer attention) or each layer's kind


def layer_kinds(kinds: Kinds) -> list[str]:
    return ["attention"] * kinds if isinstance(kinds, int) else list(kinds)


def state_roles(kinds: Kinds) -> list[tuple[int, str]]:
    """``(layer, role)`` of every per-layer state tensor, in ABI order."""
    return [(layer, role) for layer, kind in enumerate(layer_kinds(kinds)) for role in LAYER_STATES[kind]]


@dataclass(frozen=True)
class GraphNames:
    """ABI names of one graph: fixed inputs in wrapper order, per-layer state name templates, logits.

    Attention layers use the key/value templates; linear-attention / SSM layers the conv/recurrent
    ones (None when the spec names none: a stack without such layers)."""

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

    def template(self, direction: str, role: str) -> str | None:
        """The ``{layer}`` template of state ``role`` (key, value, conv, recurrent) in ``direction``
        (past: decode inputs, present: outputs)."""
        return getattr(self, f"{direction}_{role}")

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
        return [self.logits, *self._names("present", kinds)]

    @property
    def has_linear_states(self) -> bool:
        return self.present_conv is not None


def kv_names(prefill: GraphNames, decode: GraphNames) -> dict[str, str]:
    """The per-layer state name templates of both graphs, keyed as the KV mapping names them
    (``prefill_key``, ``decode_key_in``, ``decode_key_out``, ... and, when the ABI names them, the
    linear layers' ``conv`` and ``recurrent`` states alike)."""
    names: dict[str, str] = {}
    for roles in (("key", "value"), ("conv", "recurrent")):
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
    attention key and value, optionally followed by a linear layer's conv and recurrent state."""
    location = spec.locate(where)
    inputs, outputs = list(abi.inputs), list(abi.outputs)
    n_fixed = len(fixed)
    templated_in = inputs[n_fixed:]
    linear = len(outputs) == 5
    want_in = n_fixed + ((4 if linear else 2) if decode else 0)
    if (
        len(inputs) != want_in
        or any(LAYER in name for name in inputs[:n_fixed])
        or not all(LAYER in name for name in templated_in)
    ):
        shape = ", ".join(fixed) + (', "<past key {layer}>", "<past value {layer}>"' if decode else "")
        if decode and linear:
            shape += ', "<past conv {layer}>", "<past recurrent {layer}>"'
        raise KadaptError(
            f"{where}.inputs must be [{shape}] (positional roles), got {inputs}", location=location
        )
    if len(outputs) not in (3, 5) or LAYER in outputs[0] or not all(LAYER in name for name in outputs[1:]):
        raise KadaptError(
            f'{where}.outputs must be [<logits>, "<present key {{layer}}>", "<present value {{layer}}>"], '
            'followed by "<present conv {layer}>", "<present recurrent {layer}>" for a stack with '
            f"linear-attention / SSM layers, got {outputs}",
            location=location,
        )
    return GraphNames(
        fixed_inputs=tuple(inputs[:n_fixed]),
        past_key=templated_in[0] if decode else None,
        past_value=templated_in[1] if decode else None,
        logits=outputs[0],
        present_key=outputs[1],
        present_value=outputs[2],
        past_conv=templated_in[2] if decode and linear else None,
        past_recurrent=templated_in[3] if decode and linear else None,
        present_conv=outputs[3] if linear else None,
        present_recurrent=outputs[4] if linear else None,
    )
