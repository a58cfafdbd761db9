"""The vision graph (MoonViT encoder + projector) of Kimi-K2.5: spec ABI, export on meta, saved JSON run by
torch_ir against transformers' own ``get_image_features``."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch_ir
import yaml
from fixtures.spec_files import KIMI_SPEC, REPO

from kimi_adapter_core.backends.extraction import options_from_spec, run
from kimi_adapter_core.backends.extraction.equivalence.tolerance import Tolerance
from kimi_adapter_core.backends.extraction.equivalence.verdict import VerifyReport
from kimi_adapter_core.backends.extraction.equivalence.vision import check_vision
from kimi_adapter_core.backends.extraction.ir import vision as vision_module
from kimi_adapter_core.backends.extraction.job.write import write_all
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.checkpoint.naming import rename_weight
from kimi_adapter_core.checkpoint.weight_map import weight_map_document
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import applied, load_config, load_model
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.vision.options import VisionOptions

SPEC = KIMI_SPEC
# two images packed into one call: the encoder attends within each image only
GRIDS = ((1, 4, 6), (1, 2, 4))
TOKENS = 4 * 6 // 4 + 2 * 4 // 4
# several encoder layers, so the graphs checked against transformers are stitched (2 traced, 2 copies)
VISION_LAYERS = 4


def _options(out: Path, grids: tuple[tuple[int, int, int], ...] = GRIDS, dtype: str = "float32") -> Any:
    options = options_from_spec(SPEC, output_dir=out, prefill_len=8, max_cache_len=32)
    assert options.vision is not None
    return dataclasses.replace(
        options, dtype=dtype, vision=dataclasses.replace(options.vision, grid_thws=grids)
    )


def _config(options: Any) -> Any:
    overrides = {**tiny_overrides(SPEC, options), "vision_config.vt_num_hidden_layers": VISION_LAYERS}
    return load_config(SPEC, backend="extraction", overrides=overrides)


@pytest.fixture(scope="module")
def exported(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Any, torch.nn.Module, dict[str, Any], Any]]:
    """The tiny model's vision IR (fp32, two images, stitched), written by the vision module on meta, plus
    a CPU model with random weights and the same config, and the graph written."""
    out = tmp_path_factory.mktemp("vision")
    options = _options(out)
    config = _config(options)
    torch.manual_seed(0)
    with applied(SPEC, backend="extraction"):
        model = load_model(SPEC, device="cpu", config=config).eval()
        meta = load_model(SPEC, device="meta", config=config).eval()
        modules = vision_module.prepare(SPEC, meta, options)
        graph = vision_module.build_vision_graph(modules, options, "cpu")
        weight_map = weight_map_document(
            SPEC, meta, graph.weights, model_name=options.model_name, renames=options.weight_renames
        )
        chunks = vision_module.vision_chunks(SPEC, modules, graph, options, "cpu", weight_map)
        write_all({options.path("vision"): chunks})
    weights = {rename_weight(name, options.weight_renames): t for name, t in model.state_dict().items()}
    yield options, model, weights, graph


def test_spec_declares_the_fixed_image_abi(tmp_path: Path) -> None:
    options = options_from_spec(SPEC, output_dir=tmp_path)
    assert options.vision is not None
    assert options.vision.grid_thws == ((1, 32, 32),)
    assert options.vision.merge_kernel == (2, 2)
    assert options.vision.num_patches == 1024
    assert (options.vision.input_name, options.vision.output_name) == ("pixel_values", "image_features")
    assert options.path("vision") == tmp_path / "kimi_k25_text_vision_ir.json"


def test_saved_vision_ir_equals_transformers(exported: tuple) -> None:
    options, model, weights, graph = exported
    assert graph.notes == {"traced_layers": 2, "replicated_from": {"2": 1, "3": 1}}
    assert len(model.model.vision_tower.layers) == VISION_LAYERS
    report = VerifyReport("latent", 1e-5)
    result = check_vision(report, SPEC, model, options, weights, tolerance=Tolerance("float32", 1e-5))
    assert report.passed, report.render()
    assert [c.name for c in report.checks] == ["vision weights bind", "vision features"]
    assert result["shape"] == [TOKENS, model.config.text_config.hidden_size]


def test_vision_ir_interface_and_metadata(exported: tuple) -> None:
    options, model, _, _ = exported
    doc = json.loads(options.path("vision").read_text())
    ir = torch_ir.load_ir(options.path("vision"))
    assert torch_ir.validate_ir(ir)
    patches = sum(t * h * w for t, h, w in GRIDS)
    assert doc["graph_inputs"] == [
        {"name": "pixel_values", "shape": [patches, 3, 14, 14], "dtype": "float32"}
    ]
    hidden = model.config.text_config.hidden_size
    assert doc["graph_outputs"] == [{"name": "image_features", "shape": [TOKENS, hidden], "dtype": "float32"}]
    # the layout tools read: stitching adds no key (the summary, not the IR, says how it was obtained)
    assert set(doc["metadata"]) == {
        "graph",
        "model_name",
        "model",
        "spec",
        "model_class",
        "abi",
        "feature_mapping",
        "num_layers",
        "attn_implementation",
        "device",
        "versions",
        "enums",
    }
    assert doc["metadata"]["num_layers"] == VISION_LAYERS
    abi = doc["metadata"]["abi"]
    assert abi["grid_thws"] == [list(g) for g in GRIDS]
    assert (abi["merge_kernel"], abi["tokens_per_image"], abi["num_image_tokens"]) == ([2, 2], [6, 2], TOKENS)
    mapping = doc["metadata"]["feature_mapping"]
    assert mapping["placeholder_token_id"] == model.config.image_token_id
    assert mapping["text_hidden_size"] == hidden
    # the grid-derived tensors are constants of the IR, with the values transformers computes
    interp = doc["constants"]["vision_abi.interp_indices"]
    assert torch.tensor(interp["data"]).shape == (patches, 16)  # bicubic: 4x4 taps per patch
    # weights under the spec's checkpoint names; the copied layers' own weights (layer 3), not layer 1's
    names = {w["name"] for w in doc["weights"]}
    paths = [f"model.vision_tower.layers.{i}.mlp.fc2.weight" for i in range(VISION_LAYERS)]
    paths += ["model.vision_tower.patch_embed.proj.weight", "model.mm_projector.out_proj.weight"]
    assert {rename_weight(path, options.weight_renames) for path in paths} <= names
    assert len(names) == len(model.model.vision_tower.state_dict()) + len(
        model.model.mm_projector.state_dict()
    )
    assert not any(name.startswith("language_model.") for name in names)


def test_a_wrong_grid_constant_fails_the_check(exported: tuple, tmp_path: Path) -> None:
    """The check compares numbers that the grid constants decide: zeroed interpolation weights (no
    position embedding) must fail it."""
    options, model, weights, _ = exported
    doc = json.loads(options.path("vision").read_text())
    entry = doc["constants"]["vision_abi.interp_weights"]
    entry["data"] = torch.zeros_like(torch.tensor(entry["data"])).tolist()
    broken = dataclasses.replace(options, output_dir=tmp_path)
    broken.path("vision").write_text(json.dumps(doc))
    report = VerifyReport("latent", 1e-5)
    check_vision(report, SPEC, model, broken, weights, tolerance=Tolerance("float32", 1e-5))
    assert [c.passed for c in report.checks] == [True, False]


def test_run_writes_the_vision_graph_and_its_summary_line(tmp_path: Path) -> None:
    options = _options(tmp_path, dtype="bfloat16")
    lines: list[str] = []
    with applied(SPEC, backend="extraction"):
        meta = load_model(SPEC, device="meta", config=_config(options))
        summary = run(SPEC, meta, options, echo=lines.append)
    assert set(summary.graphs) == {"prefill", "decode", "vision"}
    stats = summary.graphs["vision"]
    assert stats.path == options.path("vision") and stats.path.stat().st_size == stats.bytes
    assert stats.nodes == len(torch_ir.load_ir(stats.path).nodes) > 0
    assert stats.inputs == 1 and stats.outputs == 1
    assert (stats.layers, stats.traced_layers) == (VISION_LAYERS, 2)
    rendered = summary.render()
    assert f"-> {options.path('vision')}" in rendered
    assert (
        "2 images, t x h x w patch grid 1x4x6, 1x2x4 (32 patches of 14x14 px), merge 2x2 -> 8 image tokens"
        in rendered
    )
    assert f"{VISION_LAYERS} layers, 2 traced  -> {options.path('vision')}" in rendered
    assert summary.to_dict()["graphs"]["vision"]["layers"] == VISION_LAYERS
    assert any("export vision" in line for line in lines)
    # one weight map serves every graph: each vision weight is in it, q/k/v from the fused wqkv
    weight_map = json.loads(options.path("weight_map").read_text())
    doc = json.loads(options.path("vision").read_text())
    assert {w["name"] for w in doc["weights"]} <= set(weight_map["weights"])
    q_proj = next(
        entry for name, entry in weight_map["weights"].items() if name.endswith(".attn.q_proj.weight")
    )
    assert q_proj["sources"][0]["tensors"][0].endswith(".wqkv.weight")
    assert {w["dtype"] for w in doc["weights"]} == {"bfloat16"}


def _variant(tmp_path: Path, edit: Any) -> Any:
    shutil.copytree(REPO / "specs" / "kimi_k25", tmp_path / "kimi_k25")
    raw = yaml.safe_load((REPO / "specs" / "kimi_k25.yaml").read_text())
    edit(raw["abi"]["vision"])
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_spec(path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda v: v.update(grid_thws=[[1, 32, 31]]), "grid_thws[0] = [32, 31] patches is not divisible"),
        (lambda v: v.update(inputs=["pixel_values", "grid_thw"]), "abi.vision.inputs must name exactly one"),
        (lambda v: v.update(outputs=["features.{layer}"]), "abi.vision.outputs must name exactly one"),
    ],
)
def test_bad_vision_abi_is_a_located_error(tmp_path: Path, edit: Any, message: str) -> None:
    spec = _variant(tmp_path, edit)
    with pytest.raises(KadaptError, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
        options_from_spec(spec, output_dir=tmp_path / "out")
    assert info.value.location is not None and "variant.yaml:" in info.value.location


def test_merge_kernel_claim_is_checked_against_the_config(tmp_path: Path) -> None:
    options = _options(tmp_path)
    claim = VisionOptions("model.mm_projector", ((1, 4, 4),), (1, 1), "pixel_values", "f")
    with applied(SPEC, backend="extraction"):
        meta = load_model(SPEC, device="meta", config=_config(options))
        with pytest.raises(KadaptError, match=r"merge_kernel \[1, 1\] contradicts .* \[2, 2\]"):
            vision_module.vision_modules(SPEC, meta, claim)
        missing = dataclasses.replace(claim, merge_kernel=None, projector="model.no_projector")
        with pytest.raises(KadaptError, match="abi.vision.projector 'model.no_projector' does not exist"):
            vision_module.vision_modules(SPEC, meta, missing)
