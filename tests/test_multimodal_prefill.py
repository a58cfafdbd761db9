"""The multimodal prefill ABI (``abi.vision.merged_prefill``): image features merged at placeholder tokens.

The merge is checked against transformers' own ``masked_scatter``; the saved files (vision IR -> merged
prefill IR -> decode IR, executed by torch_ir) against ``Kimi_K25ForConditionalGeneration`` given the
pixels, through ``verify`` (passing: test_extraction_verify.py, and with dynamic batch and prompt length
test_dynamic_shapes.py); a wrong merge (features in reverse order) must fail that check; and wrong
sizes are located errors before anything is exported.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch_ir
import yaml
from fixtures.spec_files import KIMI_SPEC as SPEC
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.extraction import options_from_spec, run, verify
from kimi_adapter_core.backends.extraction.options import MERGED, bind_merged_prefill
from kimi_adapter_core.backends.extraction.runtime import abi as runtime
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import applied, load_config, load_model
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.spec.diagnostics import SpecInvalid

PLACEHOLDER = 7


def _transformers_merge(embed: torch.nn.Embedding, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """What ``Kimi_K25Model.forward`` does: placeholders embedded as 0, features scattered by mask."""
    mask = ids == PLACEHOLDER
    embeds = embed(ids.masked_fill(mask, 0))
    return embeds.masked_scatter(mask.unsqueeze(-1), features.to(embeds.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_is_transformers_masked_scatter(dtype: torch.dtype) -> None:
    """Placeholders anywhere in a batch (runs, single tokens, both rows) take the feature rows in
    row-major order; fp32 features are cast to the embedding dtype; text tokens keep their embedding."""
    generator = torch.Generator().manual_seed(0)
    embed = torch.nn.Embedding(32, 16).to(dtype)
    ids = torch.randint(8, 32, (2, 11), generator=generator)
    ids[0, 2:6] = PLACEHOLDER
    ids[0, 9] = PLACEHOLDER
    ids[1, 0:3] = PLACEHOLDER
    features = torch.randn(8, 16, generator=generator)
    merged = runtime.merge_image_features(embed, ids, features, PLACEHOLDER)
    assert merged.dtype == dtype
    assert torch.equal(merged, _transformers_merge(embed, ids, features))
    assert torch.equal(merged[1, 2], features[7].to(dtype))  # the last placeholder: row 1, position 2
    assert torch.equal(merged[0, 6], embed.weight[ids[0, 6]])


def test_placeholder_count_must_equal_feature_rows() -> None:
    ids = torch.tensor([[1, PLACEHOLDER, PLACEHOLDER, 2]])
    runtime.check_image_placeholders(ids, PLACEHOLDER, 2)
    with pytest.raises(ValueError, match="has 2 image placeholder tokens .* 3 rows; they must be equal"):
        runtime.check_image_placeholders(ids, PLACEHOLDER, 3)


def test_spec_declares_the_merged_prefill(tmp_path: Path) -> None:
    options = options_from_spec(SPEC, output_dir=tmp_path)
    merged = options.merged_prefill
    assert merged is not None and options.notes == ()
    assert merged.prefill_len == 512 and options.max_cache_len >= 512
    assert merged.names.fixed_inputs == ("input_ids", "image_features", "attention_mask", "position_ids")
    assert merged.feature_input == "image_features"
    assert merged.names.outputs(1) == ["logits", "present.0.key", "present.0.value"]
    assert options.path(MERGED) == tmp_path / "kimi_k25_text_prefill_mm_ir.json"
    assert merged.where is not None and "kimi_k25.yaml:" in merged.where


def test_a_cache_too_small_for_the_image_prompt_leaves_the_graph_out(tmp_path: Path) -> None:
    options = options_from_spec(SPEC, output_dir=tmp_path, prefill_len=8, max_cache_len=256)
    assert options.merged_prefill is None
    assert options.notes == (
        "multimodal prefill (abi.vision.merged_prefill, 512 tokens) not exported: max_cache_len 256 "
        "cannot hold its prompt",
    )


def _variant(tmp_path: Path, edit: Any) -> Path:
    shutil.copytree(REPO / "specs" / "kimi_k25", tmp_path / "kimi_k25")
    raw = yaml.safe_load((REPO / "specs" / "kimi_k25.yaml").read_text())
    edit(raw["abi"])
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize(
    ("edit", "breadcrumb", "message"),
    [
        (
            lambda abi: abi["vision"]["merged_prefill"].update(prefill_len=200),
            "abi.vision.merged_prefill.prefill_len",
            "merged prefill length 200 is shorter than the 256 image placeholder tokens",
        ),
        (
            lambda abi: abi["vision"]["merged_prefill"].pop("prefill_len"),  # abi.prefill_len: 128
            "abi.vision.merged_prefill",
            "merged prefill length 128 (abi.prefill_len; set abi.vision.merged_prefill.prefill_len) is "
            "shorter than the 256 image placeholder tokens",
        ),
        (
            lambda abi: abi["vision"]["merged_prefill"].update(prefill_len=4096),
            "abi.vision.merged_prefill.prefill_len",
            "merged prefill length 4096 exceeds max_cache_len 2048",
        ),
        (
            lambda abi: abi["vision"]["merged_prefill"].update(
                outputs=["logits", "present.key", "x.{layer}"]
            ),
            "abi.vision.merged_prefill.outputs[1]",
            "'present.key' is a per-layer (dotted) name",
        ),
    ],
)
def test_bad_merged_sizes_are_located_spec_errors(
    tmp_path: Path, edit: Any, breadcrumb: str, message: str
) -> None:
    with pytest.raises(SpecInvalid) as info:
        load_spec(_variant(tmp_path, edit))
    found = [d for d in info.value.diagnostics if d.breadcrumb == breadcrumb]
    assert len(found) == 1 and message in found[0].message, [d.render() for d in info.value.diagnostics]
    assert found[0].line > 1 and "variant.yaml" in found[0].file


def test_merged_inputs_have_positional_roles(tmp_path: Path) -> None:
    spec = load_spec(_variant(tmp_path, lambda abi: abi["vision"]["merged_prefill"].update(inputs=["ids"])))
    with pytest.raises(
        KadaptError, match=r"abi.vision.merged_prefill.inputs must be \[input_ids, image_feat"
    ):
        options_from_spec(spec, output_dir=tmp_path / "out")


def test_export_counts_the_image_tokens_itself(tmp_path: Path) -> None:
    """A grid whose tokens exceed the merged prompt (the spec claims no kernel, or the caller changed the
    grid) is refused before export, located at the merged prefill; so is a config without the token."""
    options = options_from_spec(SPEC, output_dir=tmp_path)
    with pytest.raises(
        KadaptError, match="prompt length 512 is shorter than the 1024 image placeholder"
    ) as info:
        bind_merged_prefill(options, 163605, 1024)
    assert info.value.location == options.merged_prefill.where
    with pytest.raises(KadaptError, match="needs the config's image_token_id"):
        bind_merged_prefill(options, None, 256)
    bound = bind_merged_prefill(options, 163605, 256).merged_prefill
    assert (bound.image_token_id, bound.feature_rows) == (163605, 256)


GRID = ((1, 4, 4),)  # 4 image tokens: a small merged graph to read


def test_run_writes_the_merged_graph_without_changing_the_text_graphs(tmp_path: Path) -> None:
    """The merged prefill IR, its metadata and KV mapping section; the text graphs are byte-identical to a
    run without it (the embedding step is the only difference and lives in the merged wrapper)."""
    base = options_from_spec(SPEC, output_dir=tmp_path / "mm", prefill_len=6, max_cache_len=600)
    assert base.vision is not None and base.merged_prefill is not None
    options = dataclasses.replace(
        base,
        dtype="float32",
        max_cache_len=16,
        vision=dataclasses.replace(base.vision, grid_thws=GRID),
        merged_prefill=dataclasses.replace(base.merged_prefill, prefill_len=10),
    )
    # the text graphs of a run without any vision (which never builds the merged wrapper)
    text_only = dataclasses.replace(options, output_dir=tmp_path / "text", vision=None, merged_prefill=None)
    config = load_config(SPEC, backend="extraction", overrides=tiny_overrides(SPEC, options))
    lines: list[str] = []
    with applied(SPEC, backend="extraction"):
        summary = run(SPEC, load_model(SPEC, device="meta", config=config), options, echo=lines.append)
        text_only.output_dir.mkdir()
        run(SPEC, load_model(SPEC, device="meta", config=config), text_only, echo=lambda _: None)
    for kind in ("prefill", "decode"):
        assert options.path(kind).read_bytes() == text_only.path(kind).read_bytes()
    assert not text_only.path(MERGED).exists()

    assert list(summary.graphs) == ["prefill", "decode", MERGED, "vision"]
    stats = summary.graphs[MERGED]
    assert (stats.inputs, stats.outputs, stats.layers, stats.traced_layers) == (4, 7, 3, 2)
    assert any("export prefill_mm" in line for line in lines)
    assert f"  {MERGED}" in summary.render()

    doc = json.loads(options.path(MERGED).read_text())
    hidden = config.text_config.hidden_size
    assert doc["graph_inputs"] == [
        {"name": "input_ids", "shape": [1, 10], "dtype": "int64"},
        {"name": "image_features", "shape": [4, hidden], "dtype": "float32"},
        {"name": "attention_mask", "shape": [1, 1, 10, 10], "dtype": "float32"},
        {"name": "position_ids", "shape": [1, 10], "dtype": "int64"},
    ]
    meta = doc["metadata"]
    assert meta["graph"] == MERGED and meta["abi"]["prefill_len"] == 10
    assert meta["multimodal"]["placeholder_token_id"] == config.image_token_id
    assert meta["multimodal"]["features_from"] == {
        "graph": options.path("vision").name,
        "output": "image_features",
    }
    assert (meta["multimodal"]["feature_input"], meta["multimodal"]["feature_rows"]) == ("image_features", 4)
    ops = [node["op_type"] for node in doc["nodes"][:12]]
    assert {"aten.cumsum.default", "aten.index_select.default", "aten.where.self"} <= set(ops)
    assert torch_ir.validate_ir(torch_ir.load_ir(options.path(MERGED)))

    mapping = json.loads(options.path("kv_mapping").read_text())["merged_prefill"]
    assert mapping["graph"] == options.path(MERGED).name
    assert mapping["image_features"]["shape"] == [4, hidden]
    assert mapping["placeholder_token_id"] == config.image_token_id
    assert mapping["prefill_to_decode"]["positions"] == [0, 10]
    assert mapping["layers"][2] == {
        "layer": 2,
        "prefill_key_output": {"name": "present.2.key", "shape": [1, 1, 10, 16], "dtype": "float32"},
        "prefill_value_output": {"name": "present.2.value", "shape": [1, 1, 10, 8], "dtype": "float32"},
        "decode_key_input": "past.2.key",
        "decode_value_input": "past.2.value",
    }
    assert "placeholder count must equal the feature rows" in mapping["rule"]


def _verify_options(tmp_path: Path) -> Any:
    options = options_from_spec(SPEC, output_dir=tmp_path)
    return dataclasses.replace(options, verify_dtypes=("float32",), verify_decode_steps=4)


@pytest.mark.slow
def test_features_merged_in_reverse_order_fail_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check decides on the merge: a graph that scatters the rows backwards fails it, while the text
    graphs (which never merge) still pass."""
    real = runtime.merge_image_features

    def reversed_rows(embed: Any, ids: torch.Tensor, features: torch.Tensor, token: int) -> torch.Tensor:
        return real(embed, ids, features.flip(0), token)

    monkeypatch.setattr(runtime, "merge_image_features", reversed_rows)
    report = verify(SPEC, _verify_options(tmp_path), echo=lambda _: None)
    verdicts = {check.name: check.passed for check in report.checks}
    assert not report.passed
    assert verdicts["prefill logits"] and verdicts["greedy generation"] and verdicts["vision features"]
    assert not verdicts["multimodal prefill logits"]
