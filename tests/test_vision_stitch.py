"""Vision layer replication: the stitched MoonViT graph is the full trace, node for node, names included;
a layer that differs is planned to be traced, and a template that does not fit its copy falls back to a
full trace. (Its numbers against transformers: test_extraction_vision, on a stitched graph.)"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.spec_files import KIMI_SPEC as SPEC
from torch import nn

from kimi_adapter_core.backends.extraction import options_from_spec
from kimi_adapter_core.backends.extraction.ir import vision as vision_module
from kimi_adapter_core.backends.extraction.ir.graph import Graph
from kimi_adapter_core.backends.extraction.ir.irjson import ir_chunks
from kimi_adapter_core.backends.extraction.ir.stitch import Plan, plan
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.loading import applied, load_config, load_model

LAYERS = 4
GRIDS = ((1, 4, 6), (1, 2, 4))  # two packed images: the per-image attention split is in every layer


@pytest.fixture
def tiny(tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """A fresh meta Kimi-K2.5 with a 4-layer tiny MoonViT (tests mutate its layers) and fp32 options."""
    options = options_from_spec(SPEC, output_dir=tmp_path, prefill_len=8, max_cache_len=32)
    assert options.vision is not None
    options = dataclasses.replace(
        options, dtype="float32", vision=dataclasses.replace(options.vision, grid_thws=GRIDS)
    )
    overrides = {**tiny_overrides(SPEC, options), "vision_config.vt_num_hidden_layers": LAYERS}
    with applied(SPEC, backend="extraction"):
        meta = load_model(SPEC, device="meta", config=load_config(SPEC, overrides=overrides))
        yield vision_module.prepare(SPEC, meta, options), options


def _document(graph: Graph) -> dict[str, Any]:
    chunks = ir_chunks(graph, model_name="m", pytorch_version="", metadata={}, weights=[], renames=())
    return json.loads("".join(chunks))


def _full(modules: Any, options: Any) -> Graph:
    return vision_module.build_vision_graph(modules, dataclasses.replace(options, stitch=False), "cpu")


def test_stitched_vision_equals_full_trace(tiny: tuple) -> None:
    modules, options = tiny
    assert plan(list(modules.encoder.layers)) == Plan(2, {2: 1, 3: 1})
    stitched = vision_module.build_vision_graph(modules, options, "cpu")
    full = _full(modules, options)
    assert stitched.notes == {"traced_layers": 2, "replicated_from": {"2": 1, "3": 1}}
    assert not full.notes
    ours, theirs = _document(stitched), _document(full)
    assert len(ours["nodes"]) == len(theirs["nodes"]) > 4 * 20
    assert ours == theirs  # names, ops, operands, attributes, constants, inputs, outputs, weights
    assert "model.vision_tower.layers.3.mlp.fc2.weight" in stitched.weights
    assert len(modules.encoder.layers) == LAYERS  # the shortened trace left the model alone


def test_a_layer_that_differs_is_traced_not_copied(tiny: tuple) -> None:
    """Layer 2 normalises with another epsilon (same weights): the plan traces it and copies only layer 1."""
    modules, _ = tiny
    modules.encoder.layers[2].norm1.eps = 1e-3
    assert plan(list(modules.encoder.layers)) == Plan(3, {3: 1})


def test_a_template_that_does_not_fit_falls_back_to_a_full_trace(
    tiny: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forced to copy layer 1 onto a wider layer 3, stitching refuses its weights and every layer is
    traced; the echo says why."""
    modules, options = tiny
    mlp = modules.encoder.layers[3].mlp
    width = mlp.fc1.in_features
    with torch.device("meta"):
        mlp.fc1, mlp.fc2 = nn.Linear(width, 3 * width), nn.Linear(3 * width, width)
    monkeypatch.setattr(vision_module, "plan", lambda layers: Plan(2, {2: 1, 3: 1}))
    lines: list[str] = []
    graph = vision_module.build_vision_graph(modules, options, "cpu", echo=lines.append)
    assert len(lines) == 1 and "layers.3.mlp.fc1.weight does not match" in lines[0]
    assert "tracing all 4 layers" in lines[0]
    assert not graph.notes  # traced, not stitched
    traced = {node.scope.split(".")[2] for node in graph.nodes if node.scope.startswith("encoder.layers.")}
    assert traced == {"0", "1", "2", "3"}
    assert graph.weights["model.vision_tower.layers.3.mlp.fc1.weight"].shape == (3 * width, width)
