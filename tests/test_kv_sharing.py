"""Gemma-4's KV-sharing layers: the last ``num_kv_shared_layers`` layers attend with their own queries over
the keys and values the last earlier layer of their type computed in the same call, and cache nothing
(issue 36, the per-layer state contract: a layer kind with no state of its own).

The structure derives each sharing layer's source from the config (object and JSON alike), the ABI
carries a ``shared`` kind with no state tensors, the KV mapping names each one's source and the contract
states the rule, ``--verify`` proves logits and every returned state against transformers on a tiny
random model with two ragged rows through a paged pool, ``plan`` counts exactly the model's tensors
(their q/o projections, no k/v, the double-wide MLP) and ``simulate`` prices the sharing layers as
attention that writes no cache.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, Gemma4TextConfig

from kimi_adapter_core.backends.extraction import options_from_spec, verify
from kimi_adapter_core.backends.extraction.tiny_model import _shared_tail
from kimi_adapter_core.backends.simulation.model.params import Naming, text_groups
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import Refusal
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.derive import derive_structure

pytestmark = pytest.mark.compat

REPO = Path(__file__).resolve().parents[1]

TYPES = ["sliding_attention"] * 4 + ["full_attention", "sliding_attention", "full_attention"]


def gemma4(**changes: Any) -> dict[str, Any]:
    """Tiny Gemma-4 text config: 4 sliding layers, a full one, then a sliding and a full layer that reuse
    layers 3 and 4; per-layer embeddings; full layers 512 wide."""
    raw = {**tiny_config("gemma4_text"), "num_hidden_layers": 7, "num_kv_shared_layers": 2}
    raw.pop("per_layer_config", None)
    return {**raw, "layer_types": list(TYPES), "sliding_window": 4, **changes}


def test_each_sharing_layer_reads_the_last_earlier_layer_of_its_type() -> None:
    raw = gemma4()
    structure = derive_structure(raw)
    assert [layer.kv_source for layer in structure.layers] == [None] * 5 + [3, 4]
    assert structure.layer_kinds[5:] == ("shared", "shared") and structure.attention_layer_ids == (
        0,
        1,
        2,
        3,
        4,
    )
    assert structure.shared_layer_ids == (5, 6)
    assert "the last 2/7 layers reuse the keys and values of layers 3, 4 (KV sharing)" in structure.describe()
    config = Gemma4TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert config.kv_sharing_modes == [None, None, None, "store", "store", "reuse", "reuse"]  # transformers'
    assert derive_structure(config) == structure  # the config object reads alike
    runs = structure.to_dict()["layers"]
    assert [run.get("kv_source") for run in runs] == [None, None, 3, 4]


def test_a_double_wide_mlp_doubles_the_sharing_layers_only() -> None:
    structure = derive_structure(gemma4(use_double_wide_mlp=True))
    assert [layer.mlp_width for layer in structure.layers] == [None] * 5 + [256, 256]
    assert "dense MLP 128 (2/7 layers 256)" in structure.describe()
    assert all(layer.mlp_width is None for layer in derive_structure(gemma4()).layers)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_kv_shared_layers": 7}, "makes every layer reuse keys and values it does not compute"),
        (
            {"layer_types": ["sliding_attention"] * 5 + ["full_attention"] * 2},
            "layer 5 (full_attention) reuses the keys and values of the last earlier layer of its type, "
            "but none of the first 5 layers is one",
        ),
    ],
)
def test_a_sharing_layout_the_abi_cannot_carry_is_refused(changes: dict, message: str) -> None:
    with pytest.raises(Refusal) as refused:
        derive_structure(gemma4(**changes))
    assert refused.value.code == "kv-shared-layers" and message in refused.value.message


def test_plan_counts_the_models_own_tensors() -> None:
    raw = gemma4(use_double_wide_mlp=True)
    groups = {
        g.name: g for g in text_groups(derive_structure(raw), Naming("model", "model.layers", "lm_head", ()))
    }
    named = {
        name: shape
        for g in groups.values()
        for names in g.checkpoint_names
        for name, shape in zip(names, g.tensor_shapes, strict=True)
    }
    config = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    real = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert all(real.get(name) == shape for name, shape in named.items())  # nothing the model lacks
    # all the model has, but the norms plan leaves out (per-head q/k norms, the sandwich norms)
    assert all("norm" in name for name in set(real) - set(named)), sorted(set(real) - set(named))
    assert {n for n in real if "proj" in n or "embed" in n} <= set(named)
    assert not any(
        f"layers.{i}.self_attn.{p}" in n for i in (5, 6) for p in ("k_proj", "v_proj") for n in named
    )
    assert groups["dense_mlp.256"].tensor_shapes[0] == (256, 64)  # gate of a double-wide layer


SPEC = """\
apiVersion: kadapt/v1
kind: AdapterSpec
metadata: {name: gemma4_shared}
gate: {model_type: gemma4_text}
source: {config: gemma4_shared/config.json}
config_bridges:
  - {id: X1, why: eager attention exports as plain ops, op: set, path: _attn_implementation,
     value: eager, backends: [extraction]}
module_paths: {language_model: model, language_layers: model.layers, lm_head: lm_head}
architecture: {attention: gqa}
abi:
  batch: 2
  prefill_len: 8
  max_cache_len: 64
  dtype: float32
  kv_cache: {kind: paged, block_size: 8}
  prefill:
    inputs: [input_ids, attention_mask, position_ids]
    outputs: [logits, "k.{layer}", "v.{layer}"]
  decode:
    inputs: [input_ids, attention_mask, position_ids, cache_position, "pk.{layer}", "pv.{layer}"]
    outputs: [logits, "k.{layer}", "v.{layer}"]
"""


def shared_spec(tmp_path: Path, **changes: Any) -> Any:
    (tmp_path / "gemma4_shared").mkdir()
    (tmp_path / "gemma4_shared" / "config.json").write_text(json.dumps(gemma4(**changes)))
    (tmp_path / "gemma4_shared.yaml").write_text(SPEC)
    return load_spec(tmp_path / "gemma4_shared.yaml")


def test_verify_proves_logits_and_states_with_ragged_paged_rows(tmp_path: Path) -> None:
    """Two rows of different lengths through a paged pool, decoding past the sliding window of 4: logits
    and the five producing layers' keys and values equal transformers' at every step."""
    spec = shared_spec(tmp_path, use_double_wide_mlp=True)
    options = dataclasses.replace(
        options_from_spec(spec, output_dir=tmp_path / "out"), verify_dtypes=("float32",)
    )
    report = verify(spec, options, echo=lambda line: None)
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    checks = {check.name: check.detail for check in report.checks}
    assert "2 shared layers" in checks["returned states"]
    assert "paged, blocks out of order" in checks["ragged batch"]


def test_the_state_mapping_names_each_sharing_layers_source(tmp_path: Path) -> None:
    spec = shared_spec(tmp_path)
    result = CliRunner().invoke(cli, ["apply", str(spec.path), "--output-dir", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    mapping = json.loads(next((tmp_path / "out").glob("*_kv_mapping.json")).read_text())
    entries = {entry["layer"]: entry for entry in mapping["layers"]}
    assert entries[5] == {"layer": 5, "kind": "shared", "kv_source": 3}
    assert entries[6] == {"layer": 6, "kind": "shared", "kv_source": 4}
    assert "decode_key_input" in entries[4] and "kind" in entries[4]
    assert "kv_source" in mapping["contract"]["shared_layers"]
    decode = json.loads(next((tmp_path / "out").glob("*_decode_ir.json")).read_text())
    inputs = [i["name"] for i in decode["graph_inputs"]]
    assert "pk.4" in inputs and "pk.5" not in inputs and "pk.6" not in inputs


def test_simulate_prices_the_sharing_layers_as_attention_that_writes_no_cache(tmp_path: Path) -> None:
    spec = shared_spec(tmp_path, use_double_wide_mlp=True)
    command = ["simulate", str(spec.path), "--device", "h200", "--tp", "2", "--format", "json"]
    result = CliRunner().invoke(cli, [*command, "--decode", "--context-len", "2"])
    assert result.exit_code == 0, result.output
    ops = {f"{op['scope']}/{op['op']}": op for op in json.loads(result.stdout)["ops"]}
    producer, sharing = ops["dense/attention_decode"], ops["dense.shared.256/attention_decode"]
    assert sharing["bytes"] < producer["bytes"]  # same keys read, none written
    assert "dense.shared.256/mm(gate_proj+up_proj)" in ops  # the double-wide MLP, traced


def test_the_tiny_verify_model_keeps_a_sharing_tail_of_each_type() -> None:
    """E2B's layout: (4 sliding, 1 full) x 7, the last 20 sharing; the tiny stack keeps one period and a
    sliding then a full sharing layer (Gemma-4's last layer is full attention)."""
    types = (["sliding_attention"] * 4 + ["full_attention"]) * 7
    structure = derive_structure(gemma4(num_hidden_layers=35, layer_types=types, num_kv_shared_layers=20))
    tail = _shared_tail(structure, {"layer_types": types}, 5)
    assert tail["layer_types"] == types[:5] + ["sliding_attention", "full_attention"]
    assert tail["num_kv_shared_layers"] == 2 and tail["num_hidden_layers"] == 7


def test_the_generated_module_carries_the_sharing_layers_as_transformers_does(monkeypatch) -> None:
    """Gemma-4-E2B's generated extraction module on its tiny verify model (a sharing sliding and a full
    layer after one period): prefill and decode logits and the producing layers' states equal
    transformers' (its DynamicCache keeps no keys or values for the sharing layers either)."""
    import test_generate_per_layer_kv as generated

    from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides

    spec = load_spec(REPO / "specs" / "gemma4_e2b.yaml")
    module = generated.import_path(REPO / "adapters" / "gemma4_e2b" / "extraction.py", "generated_gemma4_e2b")
    overrides = tiny_overrides(spec, options_from_spec(spec, output_dir=REPO / "out" / "unused"))
    assert module.LAYER_KINDS == ("attention",) * 15 + ("shared",) * 20
    config = module.text_config(module.load_config(overrides=overrides))
    assert module.kv_sources(config) == (None,) * 5 + (3, 4)
    dummies = [type(layer).__name__ for layer in DynamicCache(config=config).layers][5:]
    assert dummies == ["DummyLayer"] * 2  # transformers caches nothing for the two sharing layers
    monkeypatch.setattr(
        generated,
        "reference_states",
        lambda cache: [
            s.clone()
            for layer in cache.layers
            if getattr(layer, "keys", None) is not None
            for s in (layer.keys, layer.values)
        ],
    )
    states = generated.run_against_transformers(module, overrides)
    assert len(states) == 2 * 5


def test_the_spec_page_says_which_layers_read_whose_keys_and_values() -> None:
    page = (REPO / "docs" / "specs" / "gemma4_e2b.md").read_text()
    assert "| layers | attention | window | keys and values | MLP |" in page
    assert "| 14 | full | — | own | dense |" in page
    assert "| 15 .. 18 | sliding | 512 | layer 13's | dense 12288 |" in page
    assert "| 34 | full | — | layer 14's | dense 12288 |" in page
    assert "lists, for each of the 15 layers that keep their own keys and values" in page
    assert "other 20 layers reuse another layer's, kind `shared`" in page
    # a stack without sharing keeps the table it had
    assert "| layers | attention | window | MLP |" in (REPO / "docs" / "specs" / "gemma4_31b.md").read_text()
