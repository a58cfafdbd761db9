"""The IR JSON document: pytorch-ir's layout (``torch_ir.load_ir`` reads it) plus kadapt's extras.

Layout kept from pytorch-ir: ``graph_inputs``/``graph_outputs``/``weights`` as ``{name, shape,
dtype}``, ``nodes`` with ``op_type``, ``inputs`` (each with ``producer_node``/``producer_output_idx``
when a node computes it), ``outputs`` and ``attrs``, plus ``constants`` with their values. Extras that
loader ignores: ``format_version``, ``metadata``, ``tied``/``quantization`` on weights.

Compact on purpose: no indentation, ``producer_output_idx`` only when non-zero, ``attrs`` only when
non-empty, graph inputs and weights referenced by name without a producer.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

from ....checkpoint.naming import rename_weight
from ....errors import KadaptError
from .graph import CONSTANT, INPUT, NODE, WEIGHT, Graph, Ref
from .naming import node_names

FORMAT_VERSION = "kadapt-ir/1"


# Python writes infinities as the non-JSON tokens Infinity/-Infinity; 1e400 is a valid JSON number that
# Python's (so torch_ir's) and JavaScript's parsers read back as infinity. Such values are the -inf
# fill of masks. They are swapped for NUL-prefixed marker strings (no real name contains NUL) and the
# markers' JSON text for the numbers, so no string content is ever rewritten.
_MARKS = {math.inf: "\0+inf", -math.inf: "\0-inf"}
_NUMBERS = {json.dumps(mark): number for mark, number in (("\0+inf", "1e400"), ("\0-inf", "-1e400"))}


def _marked(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return _MARKS[value]
    if isinstance(value, dict):
        return {key: _marked(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_marked(item) for item in value]
    return value


def _dumps(value: Any) -> str:
    text = json.dumps(value, separators=(",", ":"))
    if "Infinity" not in text:
        return text
    text = json.dumps(_marked(value), separators=(",", ":"))
    for mark, number in _NUMBERS.items():
        text = text.replace(mark, number)
    return text


class _Namer:
    def __init__(self, graph: Graph, renames: tuple[tuple[str, str], ...]) -> None:
        self.graph = graph
        self.renames = renames
        self.nodes, self.values = node_names(graph)
        self.node_types = graph.node_types()
        self._check_unique()

    def _check_unique(self) -> None:
        names = [i.name for i in self.graph.inputs]
        names += [rename_weight(p, self.renames) for p in (*self.graph.weights, *self.graph.constants)]
        names += list(self.values.values())
        duplicates = sorted(name for name, count in Counter(names).items() if count > 1)
        if duplicates:
            raise KadaptError(f"{self.graph.kind} IR would reuse names: {', '.join(duplicates[:5])}")

    def ref(self, ref: Ref) -> dict[str, Any]:
        tensor_type = self.graph.type_of(ref, self.node_types)
        if ref.kind == NODE:
            name = self.values[(ref.key, ref.index)]
        elif ref.kind == INPUT:
            name = self.graph.inputs[ref.key].name
        elif ref.kind in (WEIGHT, CONSTANT):
            name = rename_weight(ref.key, self.renames)
        else:
            raise AssertionError(ref)
        meta: dict[str, Any] = {"name": name, "shape": list(tensor_type.shape), "dtype": tensor_type.dtype}
        if ref.kind == NODE:
            meta["producer_node"] = self.nodes[ref.key]
            if ref.index:
                meta["producer_output_idx"] = ref.index
        return meta


def ir_chunks(
    graph: Graph,
    *,
    model_name: str,
    pytorch_version: str,
    metadata: dict[str, Any],
    weights: list[dict[str, Any]],
    renames: tuple[tuple[str, str], ...],
) -> Iterator[str]:
    """The document as text chunks (one per node), so a 12k-node graph never sits in one string."""
    namer = _Namer(graph, renames)
    node_types = namer.node_types
    header = {
        "format_version": FORMAT_VERSION,
        "model_name": model_name,
        "pytorch_version": pytorch_version,
        "metadata": metadata,
        "graph_inputs": [
            {"name": i.name, "shape": list(i.type.shape), "dtype": i.type.dtype} for i in graph.inputs
        ],
        "graph_outputs": [
            {"name": o.name, "shape": list(t.shape), "dtype": t.dtype}
            for o in graph.outputs
            for t in [graph.type_of(o.ref, node_types)]
        ],
        "weights": weights,
        "weight_name_mapping": {},
        "constants": {
            rename_weight(path, renames): {
                "data": tensor.tolist(),
                "dtype": str(tensor.dtype).removeprefix("torch."),
            }
            # by name: torch.export's one-trace and two-call paths list a layer's buffers in other
            # orders (DeepSeek-V4's compressor and indexer rotary tables), and the bytes must not care
            for path, tensor in sorted(graph.constants.items())
        },
    }
    yield _dumps(header)[:-1] + ',"nodes":['
    for position, node in enumerate(graph.nodes):
        entry: dict[str, Any] = {
            "name": namer.nodes[node.id],
            "op_type": node.op,
            "inputs": [namer.ref(r) for r in node.inputs],
            "outputs": [
                {"name": namer.values[(node.id, i)], "shape": list(t.shape), "dtype": t.dtype}
                for i, t in enumerate(node.outputs)
            ],
        }
        if node.attrs:
            entry["attrs"] = node.attrs
        yield ("," if position else "") + _dumps(entry)
    yield "]}"
