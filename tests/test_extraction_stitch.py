"""Layer replication: a stitched graph is the full trace, node for node, names included."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
import torch_ir
from fixtures.spec_files import KIMI_SPEC as SPEC
from torch import nn

from kimi_adapter_core.backends.extraction import options_from_spec
from kimi_adapter_core.backends.extraction.ir.graph import (
    CONSTANT,
    INPUT,
    NODE,
    Graph,
    GraphInput,
    GraphOutput,
    Node,
    Ref,
)
from kimi_adapter_core.backends.extraction.ir.irjson import ir_chunks
from kimi_adapter_core.backends.extraction.ir.stitch import NotStitchable, Plan, plan, stitch
from kimi_adapter_core.backends.extraction.job import pipeline as pipeline_module
from kimi_adapter_core.backends.extraction.job.pipeline import Clock, backbone_of, bound_to, build_graph
from kimi_adapter_core.backends.extraction.runtime import abi as runtime
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.checkpoint.tensors import TensorType
from kimi_adapter_core.loading import applied, load_config, load_model
from kimi_adapter_core.structure.derive import derive_structure

LAYERS = 4


class _Dense(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.zeros(2, 4, 4))


def test_plan_traces_the_shortest_prefix_with_templates() -> None:
    assert plan([_Dense(), *(_Moe() for _ in range(60))]) == Plan(2, {j: 1 for j in range(2, 61)})
    assert plan([_Dense() for _ in range(5)]) == Plan(2, {j: 1 for j in range(2, 5)})
    alternating = [_Dense() if i % 2 else _Moe() for i in range(6)]
    assert plan(alternating) == Plan(3, {3: 1, 4: 2, 5: 1})
    assert plan([_Dense(), _Dense(), _Dense(8)]) == Plan(3)  # the last kind has no template
    assert plan([_Dense()]) == Plan(1)
    sliding = _Dense()
    sliding.sliding_window = 128  # same weights, different attention: never a copy of the others
    assert plan([_Dense(), _Dense(), _Dense(), sliding]) == Plan(4)


def _tiny_backbone(kv_layout: str) -> tuple[Any, Any]:
    options = options_from_spec(SPEC, output_dir="/tmp", prefill_len=4, max_cache_len=12, kv_layout=kv_layout)
    overrides = {**tiny_overrides(SPEC, options), "text_config.num_hidden_layers": LAYERS}
    config = load_config(SPEC, overrides=overrides)
    model = load_model(SPEC, device="meta", config=config, dtype=torch.float32)
    backbone = backbone_of(SPEC, model)
    return backbone, bound_to(SPEC, backbone, dataclasses.replace(options, dtype="float32"))


def _document(graph: Graph, options: Any) -> dict[str, Any]:
    chunks = ir_chunks(
        graph, model_name="m", pytorch_version="", metadata={}, weights=[], renames=options.weight_renames
    )
    return json.loads("".join(chunks))


@pytest.mark.parametrize(
    ("kv_layout", "kind"), [("latent", "prefill"), ("latent", "decode"), ("expanded", "decode")]
)
def test_stitched_equals_full_trace(kv_layout: str, kind: str) -> None:
    clock = Clock(lambda _: None)
    with applied(SPEC, backend="extraction"):
        backbone, options = _tiny_backbone(kv_layout)
        chosen = plan(backbone.layers)
        assert chosen == Plan(2, {2: 1, 3: 1})
        stitched = build_graph(kind, backbone, options, chosen, clock)
        full = build_graph(kind, backbone, options, Plan(LAYERS), clock)
    assert [name for name, _ in clock.steps] == [
        f"export {kind}",
        f"convert {kind}",
        f"replicate {kind}",
        f"export {kind}",
        f"convert {kind}",
    ]
    assert stitched.notes == {"traced_layers": 2, "replicated_from": {"2": 1, "3": 1}}
    ours, theirs = _document(stitched, options), _document(full, options)
    assert len(ours["nodes"]) == len(theirs["nodes"]) > 0
    assert ours == theirs  # names, ops, operands, attributes, inputs, outputs, weights: identical
    assert set(stitched.weights) == set(full.weights) and len(stitched.weights) > 40
    if kind == "decode" and kv_layout == "latent":
        _assert_same_execution(ours, theirs, backbone, options)


def _assert_same_execution(ours: dict, theirs: dict, backbone: Any, options: Any) -> None:
    from kimi_adapter_core.checkpoint.naming import rename_weight

    torch.manual_seed(0)
    weights = {
        rename_weight(name, options.weight_renames): torch.randn(t.shape) * 0.1
        for name, t in [*backbone.model.named_parameters(), *backbone.model.named_buffers()]
        if name.startswith(("model.language_model", "lm_head")) and "rotary" not in name
    }
    inputs = list(
        runtime.decode_inputs(
            derive_structure(backbone.config).attention.kv_dims("latent"),
            batch=1,
            position=5,
            max_cache_len=12,
            num_layers=LAYERS,
            dtype=torch.float32,
            device="cpu",
        )
    )
    inputs[0] = torch.tensor([[7]])
    inputs[4:] = [torch.randn(t.shape) for t in inputs[4:]]
    results = []
    for document in (ours, theirs):
        ir = torch_ir.IR.from_dict(document)
        results.append(torch_ir.IRExecutor(ir, weights).execute(tuple(inputs)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def _node(node_id: int, layer: int | None, inputs: list[Ref]) -> Node:
    scope = f"layers.{layer}" if layer is not None else "embed"
    return Node(node_id, "aten.add.Tensor", scope, inputs, [TensorType((1,), "float32")], (), {})


def test_a_layer_reading_an_older_layer_is_not_stitchable() -> None:
    value = TensorType((1,), "float32")
    graph = Graph(
        "prefill",
        [GraphInput("x", value, "fixed")],
        [GraphOutput("logits", Ref(NODE, 3), "logits")],
        [
            _node(0, None, [Ref(INPUT, 0)]),
            _node(1, 0, [Ref(NODE, 0)]),
            _node(2, 1, [Ref(NODE, 1)]),
            _node(4, 2, [Ref(NODE, 2), Ref(NODE, 1)]),  # layer 2 reads layer 0 directly
            _node(3, None, [Ref(NODE, 4)]),
        ],
        {},
    )
    names = options_from_spec(SPEC, output_dir="/tmp").prefill_names
    with pytest.raises(NotStitchable, match="layer 2 reads layer 0"):
        stitch(graph, Plan(3, {3: 2}), layer_paths=["l0", "l1", "l2", "l3"], tensor_types={}, names=names)


def test_a_layer_reading_its_own_constant_is_not_stitchable() -> None:
    """Without ``constant_values`` a per-layer non-persistent buffer has a value only for the traced
    layers: no copy may read it. (Layers found under another wrapper path, as the vision encoder's, via
    ``layer_scope``.)"""
    value = TensorType((1,), "float32")

    def node(node_id: int, layer: int | None, inputs: list[Ref]) -> Node:
        scope = f"encoder.layers.{layer}.attn" if layer is not None else "encoder.patch_embed"
        return Node(node_id, "aten.add.Tensor", scope, inputs, [value], (), {})

    graph = Graph(
        "vision",
        [GraphInput("x", value, "fixed")],
        [GraphOutput("y", Ref(NODE, 3), "logits")],
        [
            node(0, None, [Ref(INPUT, 0)]),
            node(1, 0, [Ref(NODE, 0), Ref(CONSTANT, "vt.layers.0.table")]),
            node(2, 1, [Ref(NODE, 1), Ref(CONSTANT, "vt.layers.1.table")]),
            node(3, None, [Ref(NODE, 2)]),
        ],
        {},
        {"vt.layers.0.table": torch.zeros(1), "vt.layers.1.table": torch.ones(1)},
    )
    names = options_from_spec(SPEC, output_dir="/tmp").prefill_names
    paths = [f"vt.layers.{i}" for i in range(3)]
    with pytest.raises(NotStitchable, match="layer 1 reads its own constant vt.layers.1.table"):
        stitch(
            graph,
            Plan(2, {2: 1}),
            layer_paths=paths,
            tensor_types={},
            names=names,
            layer_scope="encoder.layers",
        )
    with pytest.raises(NotStitchable, match="hands more or less than one value"):  # no layers.<i> scopes
        stitch(graph, Plan(2, {2: 1}), layer_paths=paths, tensor_types={}, names=names)


def test_build_graph_falls_back_to_tracing_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Graph:
        raise NotStitchable("test")

    monkeypatch.setattr(pipeline_module, "stitch", refuse)
    lines: list[str] = []
    with applied(SPEC, backend="extraction"):
        backbone, options = _tiny_backbone("latent")
        graph = build_graph("prefill", backbone, options, plan(backbone.layers), Clock(lines.append))
    assert any("tracing all 4 layers" in line for line in lines)
    assert not graph.notes and {node.layer for node in graph.nodes} >= {0, 1, 2, 3}


def test_a_clone_reads_its_own_layers_constant_where_its_value_is_known() -> None:
    """DeepSeek-V4's compressors each hold a rotary table (a non-persistent buffer): a copy of a layer
    reads its own layer's, whose value ``constant_values`` gives (the model's, or on meta the value
    transformers' init gives it); without one, or of another shape, the layer is not stitchable."""
    value = TensorType((1,), "float32")
    graph = Graph(
        "prefill",
        [GraphInput("x", value, "fixed")],
        [GraphOutput("logits", Ref(NODE, 3), "logits")],
        [
            _node(0, None, [Ref(INPUT, 0)]),
            _node(1, 0, [Ref(NODE, 0), Ref(CONSTANT, "l0.table")]),
            _node(2, 1, [Ref(NODE, 1), Ref(CONSTANT, "l1.table")]),
            _node(3, None, [Ref(NODE, 2)]),
        ],
        {},
        {"l0.table": torch.zeros(1), "l1.table": torch.ones(1)},
    )
    names = options_from_spec(SPEC, output_dir="/tmp").prefill_names
    paths = ["l0", "l1", "l2", "l3"]
    own = {"l2.table": torch.full((1,), 2.0, dtype=torch.float64), "l3.table": torch.full((1,), 3.0)}
    stitched = stitch(
        graph, Plan(2, {2: 1, 3: 1}), layer_paths=paths, tensor_types={}, names=names, constant_values=own.get
    )
    reads = [r.key for node in stitched.nodes for r in node.inputs if r.kind == CONSTANT]
    assert reads == ["l0.table", "l1.table", "l2.table", "l3.table"]
    assert stitched.constants["l2.table"].dtype == torch.float32  # stored as the traced one is
    assert stitched.constants["l2.table"].item() == 2.0 and stitched.constants["l3.table"].item() == 3.0
    wrong = (  # no value for layer 3, none at all, another shape
        {"l2.table": torch.ones(1)}.get,
        {}.get,
        {"l2.table": torch.ones(2), "l3.table": torch.ones(1)}.get,
    )
    for values in wrong:
        with pytest.raises(NotStitchable, match="layer 1 reads its own constant l1.table"):
            stitch(
                graph,
                Plan(2, {2: 1, 3: 1}),
                layer_paths=paths,
                tensor_types={},
                names=names,
                constant_values=values,
            )
