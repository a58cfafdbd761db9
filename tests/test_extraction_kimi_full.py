"""The real thing: full Kimi-K2.5 (61 layers x 384 experts) on meta, extracted by ``run``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch_ir
from fixtures.spec_files import KIMI_SPEC as SPEC

from kimi_adapter_core.backends.extraction import options_from_spec, run
from kimi_adapter_core.loading import applied, load_model


@pytest.mark.slow
def test_full_kimi_extraction(tmp_path: Path) -> None:
    options = options_from_spec(SPEC, output_dir=tmp_path)
    with applied(SPEC, backend="extraction"):
        summary = run(SPEC, load_model(SPEC, device="meta"), options, echo=lambda _: None)
    for kind in ("prefill", "decode"):
        stats = summary.graphs[kind]
        assert (stats.layers, stats.traced_layers) == (61, 2)
        assert 7_000 < stats.nodes < 10_000  # O(layers): 384 experts add no nodes
        assert stats.bytes < 16.6e6  # <= 40% of pytorch-ir's 41.5 MB per graph
        assert 1.0e12 < stats.parameters < 1.1e12
        ir = torch_ir.load_ir(options.path(kind))
        assert len(ir.nodes) == stats.nodes and len(ir.graph_outputs) == 1 + 2 * 61
    decode = json.loads(options.path("decode").read_text())
    assert decode["graph_inputs"][4] == {
        "name": "past.0.key",
        "shape": [1, 1, 2048, 512],
        "dtype": "bfloat16",
    }
    assert decode["graph_outputs"][0] == {"name": "logits", "shape": [1, 1, 163840], "dtype": "bfloat16"}
    weights = {w["name"]: w for w in decode["weights"]}
    gate_up = weights["language_model.model.layers.60.mlp.experts.gate_up_proj"]
    assert gate_up["shape"] == [384, 4096, 7168] and gate_up["dtype"] == "bfloat16"
    # the checkpoint's per-expert gate/up weight_packed int32 [2048, 896], weight_scale bf16 [2048, 224]
    for source in gate_up["quantization"]["sources"]:
        assert source["count"] == 384 and source["shape"] == [2048, 7168]
        assert source["storage"]["tensors"]["packed"] == {
            "suffix": "_packed",
            "dtype": "int32",
            "shape": [2048, 896],
        }
        assert source["storage"]["tensors"]["scale"] == {
            "suffix": "_scale",
            "dtype": "bfloat16",
            "shape": [2048, 224],
        }
    assert weights["language_model.model.layers.60.mlp.gate.e_score_correction_bias"]["dtype"] == "float32"
    assert weights["language_model.lm_head.weight"]["shape"] == [163840, 7168]
    assert "layers.60.mlp.experts.bmm_1" in {node["name"] for node in decode["nodes"]}
    assert decode["metadata"]["abi"]["dtype"] == "bfloat16" and decode["metadata"]["num_layers"] == 61
    assert torch.__version__ == decode["metadata"]["versions"]["torch"]
