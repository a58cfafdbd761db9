"""The IR files of a tiny Kimi-K2.5 (bf16, meta, the real ``run`` path) and what other tools need of them."""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch_ir
from fixtures.loader import loaded_dtypes
from fixtures.spec_files import KIMI_SPEC

from kimi_adapter_core.backends.extraction import options_from_spec, run
from kimi_adapter_core.backends.extraction.ir.encoding import dtype_codes
from kimi_adapter_core.backends.extraction.job import pipeline as pipeline_module
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import applied, load_config, load_model

SPEC = KIMI_SPEC
LAYERS = 3


def tiny_model(overrides: dict[str, Any] | None = None) -> torch.nn.Module:
    options = options_from_spec(SPEC, output_dir=Path(tempfile.gettempdir()))  # only sizes are read
    config = load_config(SPEC, overrides={**tiny_overrides(SPEC, options), **(overrides or {})})
    return load_model(SPEC, device="meta", config=config)  # fp32 parameters: run() casts to the ABI's bf16


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, list[str]]]:
    out = tmp_path_factory.mktemp("ir")
    options = options_from_spec(SPEC, output_dir=out, prefill_len=8, max_cache_len=32)
    lines: list[str] = []
    with applied(SPEC, backend="extraction"):
        summary = run(SPEC, tiny_model(), options, echo=lines.append)
    yield options, summary, lines


def load(options: Any, graph: str) -> dict[str, Any]:
    return json.loads(options.path(graph).read_text())


def test_files_load_with_torch_ir(extracted: tuple) -> None:
    options, summary, _ = extracted
    for graph in ("prefill", "decode"):
        ir = torch_ir.load_ir(options.path(graph))
        assert torch_ir.validate_ir(ir)
        assert len(ir.nodes) == summary.graphs[graph].nodes > 0
        text = options.path(graph).read_text()
        assert "\n" not in text and ": " not in text  # compact


def test_interface_names_shapes_dtypes(extracted: tuple) -> None:
    options, _, _ = extracted
    prefill, decode = load(options, "prefill"), load(options, "decode")
    assert [(i["name"], i["shape"], i["dtype"]) for i in prefill["graph_inputs"]] == [
        ("input_ids", [1, 8], "int64"),
        ("attention_mask", [1, 1, 8, 8], "bfloat16"),
        ("position_ids", [1, 8], "int64"),
    ]
    assert [o["name"] for o in prefill["graph_outputs"]] == ["logits"] + [
        f"present.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")
    ]
    assert prefill["graph_outputs"][1]["shape"] == [1, 1, 8, 16]  # latent: kv_lora_rank
    assert prefill["graph_outputs"][2]["shape"] == [1, 1, 8, 8]  # latent: qk_rope_head_dim
    assert [i["name"] for i in decode["graph_inputs"][:4]] == [
        "input_ids",
        "attention_mask",
        "position_ids",
        "cache_position",
    ]
    assert decode["graph_inputs"][4] == {"name": "past.0.key", "shape": [1, 1, 32, 16], "dtype": "bfloat16"}
    assert decode["graph_outputs"][-1] == {
        "name": f"present.{LAYERS - 1}.value",
        "shape": [1, 1, 32, 8],
        "dtype": "bfloat16",
    }
    assert decode["graph_outputs"][0]["shape"] == [1, 1, 128]


def test_functional_and_named(extracted: tuple) -> None:
    options, _, _ = extracted
    for graph in ("prefill", "decode"):
        document = load(options, graph)
        ops = {n["op_type"] for n in document["nodes"]}
        assert all(op.startswith("aten.") for op in ops), ops
        assert not [op for op in ops if re.search(r"\.[a-z0-9_]*[a-z0-9]_\.", op)], "in-place op left"
        assert not any("copy_" in op or "new_empty" in op for op in ops)
        names = [n["name"] for n in document["nodes"]]
        values = [o["name"] for n in document["nodes"] for o in n["outputs"]]
        assert len(set(names)) == len(names) and len(set(values)) == len(values)
        assert not any(re.fullmatch(r"(getitem|new_empty|split)(_\d+)?", n) for n in names)
        assert f"layers.{LAYERS - 1}.self_attn.kv_b_proj.linear" in names
        assert "layers.1.mlp.gate.topk.indices" in values
        all_weights = {w["name"] for w in document["weights"]}
        for node in document["nodes"]:
            for tensor in node["inputs"]:
                assert "producer_node" in tensor or tensor["name"] in all_weights | set(
                    document["constants"]
                ) | {i["name"] for i in document["graph_inputs"]}


def test_weights_bind_to_the_checkpoint(extracted: tuple) -> None:
    options, _, _ = extracted
    weights = {w["name"]: w for w in load(options, "decode")["weights"]}
    assert all(name.startswith(("language_model.model.", "language_model.lm_head.")) for name in weights)
    assert all(0 not in w["shape"] for w in weights.values())
    bias = weights["language_model.model.layers.2.mlp.gate.e_score_correction_bias"]
    assert bias["dtype"] == "float32"  # transformers keeps it fp32; the checkpoint stores it fp32
    # the router as transformers' loader gives it (kept float32 since 5.24; bf16 before)
    router = str(loaded_dtypes("deepseek_v3")["model.layers.1.mlp.gate.weight"]).removeprefix("torch.")
    assert weights["language_model.model.layers.2.mlp.gate.weight"]["dtype"] == router
    assert weights["language_model.lm_head.weight"]["shape"] == [128, 64]
    gate_up = weights["language_model.model.layers.2.mlp.experts.gate_up_proj"]
    assert gate_up["shape"] == [8, 64, 64] and gate_up["dtype"] == "bfloat16"
    # what the checkpoint holds: per expert, gate and up [32, 64] as int32 words + bf16 group scales
    quantization = gate_up["quantization"]
    assert quantization["weight_map"] == "language_model.model.layers.2.mlp.experts.gate_up_proj"
    assert [op["op"] for op in quantization["ops"]] == ["stack", "concat"]
    for source, proj in zip(quantization["sources"], ("gate_proj", "up_proj"), strict=True):
        assert source["first"] == f"language_model.model.layers.2.mlp.experts.0.{proj}.weight"
        assert source["count"] == 8 and source["shape"] == [32, 64]
        stored = source["storage"]["tensors"]
        assert (stored["packed"]["shape"], stored["packed"]["dtype"]) == ([32, 64 * 4 // 32], "int32")
        assert (stored["scale"]["shape"], stored["scale"]["dtype"]) == ([32, 64 // 32], "bfloat16")
    assert "quantization" not in weights["language_model.model.layers.2.mlp.shared_experts.up_proj.weight"]
    assert not any("rotary" in name for name in weights)
    constants = load(options, "decode")["constants"]
    (inv_freq,) = constants.values()  # rotary inv_freq: real values although traced on meta
    assert inv_freq["dtype"] == "float32" and len(inv_freq["data"]) == 4 and inv_freq["data"][0] == 1.0


def test_dtype_attributes_are_executable_codes(extracted: tuple) -> None:
    options, _, _ = extracted
    document = load(options, "decode")
    enums = document["metadata"]["enums"]["dtype"]
    casts = [n for n in document["nodes"] if n["op_type"] == "aten._to_copy.default"]
    assert casts and all(isinstance(n["attrs"]["dtype"], int) for n in casts)
    for node in casts:
        assert enums[str(node["attrs"]["dtype"])] == node["outputs"][0]["dtype"]
    assert dtype_codes()[torch.bfloat16] == 15
    devices = [n["attrs"]["device"] for n in document["nodes"] if "device" in n.get("attrs", {})]
    assert all(d == "cpu" for d in devices)
    # the router's -inf mask fill: strict JSON (no Infinity token) that still loads as -inf
    text = options.path("decode").read_text()
    assert "Infinity" not in text and "NaN" not in text
    fills = [n["attrs"]["value"] for n in document["nodes"] if n["op_type"] == "aten.masked_fill.Scalar"]
    assert fills and all(value == float("-inf") for value in fills)


def test_metadata_and_kv_mapping(extracted: tuple) -> None:
    options, summary, lines = extracted
    meta = load(options, "prefill")["metadata"]
    assert load(options, "prefill")["format_version"] == "kadapt-ir/1"
    assert meta["abi"] == {
        "batch": 1,
        "prefill_len": 8,
        "max_cache_len": 32,
        "dtype": "bfloat16",
        "kv_layout": "latent",
    }
    assert meta["model"] == "moonshotai/Kimi-K2.5" and meta["spec"] == "kimi_k25"
    assert meta["versions"]["torch"] == torch.__version__ and "transformers" in meta["versions"]
    assert meta["stitching"] == {"traced_layers": 2, "replicated_from": {"2": 1}}
    mapping = json.loads(options.path("kv_mapping").read_text())
    assert (mapping["kv_layout"], mapping["prefill_len"], mapping["max_cache_len"]) == ("latent", 8, 32)
    assert mapping["prefill_to_decode"] == {
        "op": "index_copy",
        "dim": 2,
        "positions": [0, 8],
        "into": "zeros of the decode input shape",
    }
    layer = mapping["layers"][2]
    assert layer["prefill_key_output"] == {
        "name": "present.2.key",
        "shape": [1, 1, 8, 16],
        "dtype": "bfloat16",
    }
    assert layer["decode_value_input"] == {
        "name": "past.2.value",
        "shape": [1, 1, 32, 8],
        "dtype": "bfloat16",
    }
    assert layer["decode_key_output"]["name"] == "present.2.key"
    text = summary.render()
    assert "prefill" in text and "decode" in text and "ops:" in text and "3 layers, 2 traced" in text
    assert any("export decode" in line for line in lines)
    assert summary.to_dict()["graphs"]["decode"]["nodes"] == summary.graphs["decode"].nodes


def test_eager_experts_are_refused_without_output(tmp_path: Path) -> None:
    options = options_from_spec(SPEC, output_dir=tmp_path, prefill_len=4, max_cache_len=8)
    with applied(SPEC, backend="extraction"):
        model = tiny_model({"text_config._experts_implementation": "eager"})
        model.config.text_config._experts_implementation = "eager"
        with pytest.raises(KadaptError, match="cannot be exported with static shapes"):
            run(SPEC, model, options, echo=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_no_partial_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    options = options_from_spec(SPEC, output_dir=tmp_path, prefill_len=4, max_cache_len=8)
    options.path("prefill").write_text("previous run")
    real = pipeline_module.ir_chunks

    def failing(graph: Any, **kwargs: Any) -> Iterator[str]:
        if graph.kind == "decode":
            yield "{"
            raise OSError("disk full")
        yield from real(graph, **kwargs)

    monkeypatch.setattr(pipeline_module, "ir_chunks", failing)
    with applied(SPEC, backend="extraction"), pytest.raises(OSError, match="disk full"):
        run(SPEC, tiny_model(), options, echo=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [options.path("prefill").name]
    assert options.path("prefill").read_text() == "previous run"


def test_tied_weights_are_listed_once_and_marked(tmp_path: Path) -> None:
    options = options_from_spec(SPEC, output_dir=tmp_path, prefill_len=4, max_cache_len=8)
    with applied(SPEC, backend="extraction"):
        model = tiny_model({"tie_word_embeddings": True, "text_config.tie_word_embeddings": True})
        assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
        run(SPEC, model, options, echo=lambda _: None)
    weights = load(options, "prefill")["weights"]
    tied = [w for w in weights if "embed_tokens" in w["name"] or "lm_head" in w["name"]]
    assert tied == [
        {
            "name": "language_model.model.embed_tokens.weight",
            "shape": [128, 64],
            "dtype": "bfloat16",
            "tied": ["language_model.lm_head.weight"],
        }
    ]
