"""Names of nodes and values: the module a node came from plus its op, unique by construction.

FX names (``getitem_719``, ``split_1``) say nothing and depend on tracing order across the whole
graph. Here a node is ``<module path>.<op>`` (``layers.3.self_attn.kv_b_proj.linear``), numbered only
against earlier nodes of the same module and op (``layers.3.mlp.experts.bmm_1``). Layer ``j`` thus
gets the same names whether it was exported or replicated from another layer, and graph outputs
carry their ABI names (``logits``, ``present.3.key``).
"""

from __future__ import annotations

from collections import Counter

from ....errors import KadaptError
from .graph import NODE, Graph

Slot = tuple[int, int]  # (node id, output index)


def short_op(op: str) -> str:
    """``aten.linear.default`` -> ``linear``."""
    return op.split(".")[1]


def node_names(graph: Graph) -> tuple[dict[int, str], dict[Slot, str]]:
    """Node names and value names; graph outputs are named after the ABI."""
    abi_names: dict[Slot, str] = {}
    for output in graph.outputs:
        if output.ref.kind != NODE:
            raise KadaptError(f"{graph.kind} output {output.name} is not computed by the graph")
        slot = (output.ref.key, output.ref.index)
        if slot in abi_names:
            raise KadaptError(f"{graph.kind} outputs {abi_names[slot]} and {output.name} are the same tensor")
        abi_names[slot] = output.name
    seen: Counter[str] = Counter()
    nodes: dict[int, str] = {}
    values: dict[Slot, str] = {}
    for node in graph.nodes:
        single_abi = abi_names.get((node.id, 0)) if len(node.outputs) == 1 else None
        if single_abi is not None:
            name = single_abi
        else:
            base = f"{node.scope}.{short_op(node.op)}" if node.scope else short_op(node.op)
            name = base if not seen[base] else f"{base}_{seen[base]}"
            seen[base] += 1
        nodes[node.id] = name
        for index in range(len(node.outputs)):
            if (node.id, index) in abi_names:
                values[(node.id, index)] = abi_names[(node.id, index)]
            elif len(node.outputs) == 1:
                values[(node.id, index)] = name
            else:
                label = node.output_labels[index] if node.output_labels else str(index)
                values[(node.id, index)] = f"{name}.{label}"
    return nodes, values
