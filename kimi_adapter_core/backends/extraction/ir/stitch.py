"""Replicate exported layers instead of tracing all of them.

Layers of one kind (same module tree, same parameter shapes and dtypes) trace to the same
node sequence; only their weights, KV tensors and names differ. Tracing all 61 Kimi layers takes
~3 minutes here for the two graphs and yields 60 identical MoE copies, so kadapt traces the shortest
prefix that holds every kind at a position >= 1 (Kimi: dense layer 0 + MoE layer 1) and clones the
template layer for the rest, re-pointing each clone at its own weights, its own past/present KV and
the previous layer's hidden state. The same holds for any stack of layers run in sequence: the vision
encoder's 27 MoonViT layers are stitched the same way (``layer_scope`` names where a graph's layers
sit in its wrapper: ``layers`` for the text wrappers, ``encoder.layers`` for the vision wrapper).

The clone is only valid if a layer is self-contained: it may read shared values computed before the
first layer (embedding, rotary cos/sin), graph inputs, its own weights, and exactly one value of the
layer before it (the hidden state); it may not read a constant of its own (a per-layer buffer has no
value for the layers that were not traced). ``plan``/``stitch`` check that and raise ``NotStitchable``
otherwise, and the caller falls back to tracing every layer. Tests compare stitched graphs with full
traces node for node.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from ....checkpoint.tensors import TensorType
from ..names import GraphNames
from .graph import CONSTANT, INPUT, NODE, WEIGHT, Graph, GraphInput, GraphOutput, Node, Ref


class NotStitchable(Exception):
    """The traced layers do not have the shape replication needs; trace every layer instead."""


@dataclass(frozen=True)
class Plan:
    """Trace ``prefix`` layers; layer ``j >= prefix`` is a copy of layer ``templates[j]``."""

    prefix: int
    templates: dict[int, int] = field(default_factory=dict)


_SCALARS = (bool, int, float, str, type(None))
_PER_LAYER = {"layer_idx", "training"}  # differ between layers without changing the traced graph


def layer_kind(layer: nn.Module) -> Hashable:
    """What decides a layer's graph: module types, scalar settings, tensor names, shapes and dtypes.

    Scalar attributes (``sliding_window``, ``is_causal``, ...) are part of the kind, so layers that a
    config sets up differently are never replicated from each other, even with identical weights.
    """
    modules = tuple(
        (
            name,
            type(module).__qualname__,
            tuple(
                (key, value)
                for key, value in sorted(vars(module).items())
                if isinstance(value, _SCALARS) and not key.startswith("_") and key not in _PER_LAYER
            ),
        )
        for name, module in layer.named_modules()
    )
    tensors = tuple(
        (name, tuple(t.shape), t.dtype) for name, t in [*layer.named_parameters(), *layer.named_buffers()]
    )
    return modules, tensors


def plan(layers: Sequence[nn.Module]) -> Plan:
    """Shortest prefix holding, at positions >= 1, a template for every layer after it. A layer that
    holds a parameter another layer holds too (Zamba2's shared blocks) is a kind of its own: which of
    the shared tensors it reads (its own adapters among a block's) is decided by its index at trace
    time, so no clone of another layer is it."""
    kinds: list[Hashable] = [layer_kind(layer) for layer in layers]
    holders: dict[int, set[int]] = {}
    for index, layer in enumerate(layers):
        for parameter in layer.parameters():
            holders.setdefault(id(parameter), set()).add(index)
    for index in {i for held in holders.values() if len(held) > 1 for i in held}:
        kinds[index] = ("shares parameters with another layer", index)
    for prefix in range(min(2, len(kinds)), len(kinds) + 1):
        last = {kinds[i]: i for i in range(1, prefix)}
        if all(kinds[j] in last for j in range(prefix, len(kinds))):
            return Plan(prefix, {j: last[kinds[j]] for j in range(prefix, len(kinds))})
    return Plan(len(kinds))


def through(chosen: Plan, layers: int) -> Plan:
    """``chosen`` tracing at least its first ``layers`` layers (the rest still replicated)."""
    if layers <= chosen.prefix:
        return chosen
    return Plan(layers, {j: source for j, source in chosen.templates.items() if j >= layers})


LayerOf = Callable[[Node], int | None]


def _layer_finder(layer_scope: str) -> LayerOf:
    """Index of the layer a node belongs to (scope ``<layer_scope>.<i>...``), else None."""
    head = layer_scope + "."

    def index(node: Node) -> int | None:
        if not node.scope.startswith(head):
            return None
        position = node.scope[len(head) :].split(".", 1)[0]
        return int(position) if position.isdigit() else None

    return index


def _rescope(scope: str, layer_scope: str, source: int, target: int) -> str:
    head = f"{layer_scope}.{source}"
    if scope == head or scope.startswith(head + "."):
        return f"{layer_scope}.{target}" + scope[len(head) :]
    raise NotStitchable(f"node scope {scope} is outside layer {source}")


Slot = tuple[int, int]  # (node id, output index)


@dataclass
class _Layout:
    """The traced graph cut into the part before the layers, each layer, and the part after."""

    head: list[Node]
    layers: list[list[Node]]
    tail: list[Node]
    carry: list[Slot]  # per traced layer: the one value it hands to the next layer


def _layout(graph: Graph, prefix: int, layer_of: LayerOf, tail_reads: Collection[int] = ()) -> _Layout:
    """``graph`` cut at its layers; the final nodes may read the last traced layer and the layers
    ``tail_reads`` names (the step graph's aux layers: traced, so kept as they are)."""
    head: list[Node] = []
    tail: list[Node] = []
    layers: list[list[Node]] = [[] for _ in range(prefix)]
    last_layer = -1
    for node in graph.nodes:
        layer = layer_of(node)
        if layer is None:
            (head if last_layer < 0 else tail).append(node)
        elif tail or layer < last_layer or layer >= prefix:
            raise NotStitchable(f"the nodes of layer {layer} are not contiguous")
        else:
            last_layer = layer
            layers[layer].append(node)
    owner = {node.id: index for index, nodes in enumerate(layers) for node in nodes}
    graph_outputs = {(o.ref.key, o.ref.index) for o in graph.outputs if o.ref.kind == NODE}
    handed: list[set[Slot]] = [set() for _ in range(prefix)]
    for reader in [*(node for nodes in layers for node in nodes), *tail]:
        reader_layer = layer_of(reader)
        for ref in reader.inputs:
            source = owner.get(ref.key) if ref.kind == NODE else None
            if source is None or source == reader_layer:
                continue
            if reader_layer is not None and source != reader_layer - 1:
                raise NotStitchable(f"layer {reader_layer} reads layer {source}")
            if reader_layer is None and source != prefix - 1 and source not in tail_reads:
                raise NotStitchable(f"the final nodes read layer {source}")
            if (ref.key, ref.index) not in graph_outputs:
                handed[source].add((ref.key, ref.index))
    if any(len(values) != 1 for values in handed):
        raise NotStitchable("a layer hands more or less than one value to the next")
    return _Layout(head, layers, tail, [next(iter(values)) for values in handed])


class _Clone:
    """Re-points the operands of template layer ``source`` for its copy at layer ``target``."""

    def __init__(
        self,
        stitched: Graph,
        template: Graph,
        layout: _Layout,
        layer_paths: Sequence[str],
        layer_scope: str,
        tensor_types: dict[str, TensorType],
        source: int,
        target: int,
        carry_in: Slot,
        constant_values: Callable[[str], Any] | None = None,
    ) -> None:
        self.stitched = stitched
        self.template = template
        self.layer_paths = layer_paths
        self.layer_scope = layer_scope
        self.tensor_types = tensor_types
        self.constant_values = constant_values
        self.source = source
        self.target = target
        self.source_carry_in = layout.carry[source - 1]
        self.carry_in = carry_in
        self.ids: dict[int, int] = {}
        self.kv_inputs: dict[str, int] = {}

    def add_kv_inputs(self, names: GraphNames) -> None:
        for graph_input in self.template.inputs:
            if graph_input.layer == self.source:
                template = names.template("past", graph_input.role)
                assert template is not None, f"no past {graph_input.role} name"
                self.kv_inputs[graph_input.role] = len(self.stitched.inputs)
                self.stitched.inputs.append(
                    GraphInput(
                        template.format(layer=self.target), graph_input.type, graph_input.role, self.target
                    )
                )

    def ref(self, ref: Ref) -> Ref:
        if ref.kind == NODE:
            if ref.key in self.ids:
                return Ref(NODE, self.ids[ref.key], ref.index)
            if (ref.key, ref.index) == self.source_carry_in:
                return Ref(NODE, *self.carry_in)
            return ref  # a value computed before the first layer (embedding, rotary)
        if ref.kind == INPUT and self.template.inputs[ref.key].layer is not None:
            graph_input = self.template.inputs[ref.key]
            if graph_input.layer != self.source:
                raise NotStitchable(f"layer {self.source} reads {graph_input.name}")
            return Ref(INPUT, self.kv_inputs[graph_input.role])
        prefix = self.layer_paths[self.source] + "."
        if ref.kind == WEIGHT and ref.key.startswith(prefix):
            path = self.layer_paths[self.target] + "." + ref.key[len(prefix) :]
            if self.tensor_types.get(path) != self.template.weights[ref.key]:
                raise NotStitchable(f"{path} does not match the traced {ref.key}")
            self.stitched.weights[path] = self.template.weights[ref.key]
            return Ref(WEIGHT, path)
        if ref.kind == CONSTANT and ref.key.startswith(prefix):
            # a layer's own non-persistent buffer (DeepSeek-V4's compressors each hold a rotary table):
            # the clone reads the target layer's own value, as a trace of it would
            path = self.layer_paths[self.target] + "." + ref.key[len(prefix) :]
            traced = self.template.constants[ref.key]
            value = self.constant_values(path) if self.constant_values is not None else None
            if value is None or tuple(value.shape) != tuple(traced.shape):
                raise NotStitchable(f"layer {self.source} reads its own constant {ref.key}")
            self.stitched.constants[path] = value.to(traced.dtype)  # as stored (a float cast follows)
            return Ref(CONSTANT, path)
        return ref

    def node(self, node: Node, new_id: int) -> Node:
        self.ids[node.id] = new_id
        scope = _rescope(node.scope, self.layer_scope, self.source, self.target)
        return Node(
            new_id,
            node.op,
            scope,
            [self.ref(r) for r in node.inputs],
            node.outputs,
            node.output_labels,
            node.attrs,
        )


def stitch(
    graph: Graph,
    chosen: Plan,
    *,
    layer_paths: Sequence[str],
    tensor_types: dict[str, TensorType],
    names: GraphNames,
    layer_scope: str = "layers",
    constant_values: Callable[[str], Any] | None = None,
    tail_reads: Collection[int] = (),
) -> Graph:
    """The graph of all ``len(layer_paths)`` layers from a trace of ``chosen.prefix`` layers.

    ``layer_paths[j]`` is layer ``j``'s module path in the model (``model.language_model.layers.5``);
    ``tensor_types`` the model's parameters, to check every clone's weights exist as traced;
    ``layer_scope`` the layers' module path inside the traced wrapper (node scopes ``<layer_scope>.<j>...``);
    ``constant_values`` a layer's own non-persistent buffer by model path (None: a layer reading one is
    not stitchable); ``tail_reads`` the traced layers whose hand-on value the final nodes read besides
    the last one's (the step graph's aux layers).
    """
    if not chosen.templates:
        return graph
    layout = _layout(graph, chosen.prefix, _layer_finder(layer_scope), tail_reads)
    stitched = Graph(
        graph.kind,
        list(graph.inputs),
        list(graph.outputs),
        [*layout.head],
        dict(graph.weights),
        dict(graph.constants),
    )
    for nodes in layout.layers:
        stitched.nodes += nodes
    carry = list(layout.carry)
    next_id = max(node.id for node in graph.nodes) + 1
    for target in range(chosen.prefix, len(layer_paths)):
        source = chosen.templates[target]
        clone = _Clone(
            stitched,
            graph,
            layout,
            layer_paths,
            layer_scope,
            tensor_types,
            source,
            target,
            carry[-1],
            constant_values,
        )
        clone.add_kv_inputs(names)
        for node in layout.layers[source]:
            stitched.nodes.append(clone.node(node, next_id))
            next_id += 1
        carry.append((clone.ids[layout.carry[source][0]], layout.carry[source][1]))
        for output in graph.outputs:
            if output.layer == source:
                template = names.template("present", output.role)
                assert template is not None, f"no present {output.role} name"
                stitched.outputs.append(
                    GraphOutput(template.format(layer=target), clone.ref(output.ref), output.role, target)
                )
    last_traced = layout.carry[-1]
    for node in layout.tail:
        inputs = [
            Ref(NODE, *carry[-1]) if r.kind == NODE and (r.key, r.index) == last_traced else r
            for r in node.inputs
        ]
        stitched.nodes.append(replace(node, inputs=inputs))
    stitched.notes = {
        "traced_layers": chosen.prefix,
        "replicated_from": {str(j): s for j, s in chosen.templates.items()},
    }
    return stitched
