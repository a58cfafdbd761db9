"""kadapt's in-memory graph between the exported program and the IR JSON.

Nodes refer to values by identity (node id, graph-input index, weight path) rather than by name, so
layers can be cloned and re-wired freely; names are given once, at the end (``naming``), from the
module scope of each node. Weights keep the model's own parameter paths until serialisation, where
the spec's ``weight_renames`` turn them into checkpoint names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ....checkpoint.tensors import TensorType, dtype_name

NODE, INPUT, WEIGHT, CONSTANT = "node", "input", "weight", "constant"


@dataclass(frozen=True)
class Ref:
    """One operand: output ``index`` of node ``key``, graph input ``key``, weight or constant ``key``."""

    kind: str
    key: Any  # int node id | int input position | str model parameter path
    index: int = 0


@dataclass
class Node:
    id: int
    op: str  # "aten.linear.default"
    scope: str  # module path inside the wrapper, e.g. "layers.3.self_attn.q_a_proj" ("" = wrapper)
    inputs: list[Ref]
    outputs: list[TensorType]
    output_labels: tuple[str, ...]  # schema return names ("values", "indices"), or () when unnamed
    attrs: dict[str, Any]

    @property
    def layer(self) -> int | None:
        """Index of the decoder layer this node belongs to (scope ``layers.<i>...``), else None."""
        parts = self.scope.split(".")
        if len(parts) >= 2 and parts[0] == "layers" and parts[1].isdigit():
            return int(parts[1])
        return None


@dataclass
class GraphInput:
    name: str
    type: TensorType
    role: str  # "fixed" | "key" | "value"
    layer: int | None = None


@dataclass
class GraphOutput:
    name: str
    ref: Ref
    role: str  # "logits" | "key" | "value"
    layer: int | None = None


@dataclass
class Graph:
    """One exported graph (prefill or decode) in kadapt's form."""

    kind: str
    inputs: list[GraphInput]
    outputs: list[GraphOutput]
    nodes: list[Node]
    weights: dict[str, TensorType]  # model parameter/buffer path -> type, only those the graph reads
    constants: dict[str, Any] = field(default_factory=dict)  # path -> CPU tensor (non-checkpoint buffers)
    notes: dict[str, Any] = field(default_factory=dict)  # how the graph was obtained (stitching, ...)

    def node_types(self) -> dict[int, list[TensorType]]:
        return {node.id: node.outputs for node in self.nodes}

    def type_of(self, ref: Ref, node_types: dict[int, list[TensorType]]) -> TensorType:
        if ref.kind == NODE:
            return node_types[ref.key][ref.index]
        if ref.kind == INPUT:
            return self.inputs[ref.key].type
        if ref.kind == WEIGHT:
            return self.weights[ref.key]
        tensor = self.constants[ref.key]
        return TensorType(tuple(tensor.shape), dtype_name(tensor.dtype))
