"""Config loading: paths, every bridge op, backend filtering, overrides, the gate."""

from __future__ import annotations

import json

import pytest
from fixtures.spec_files import tiny_kimi_config, write_spec

from kimi_adapter_core.config import paths
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import load_config
from kimi_adapter_core.patching.ledger import APPLIED, FAILED, GATED_OFF, NOT_FOR_BACKEND, Ledger
from kimi_adapter_core.spec import load_spec

GATE = """
gate:
  model_type: kimi_k25
  sub_configs:
    text_config: [deepseek_v3, kimi_k2]
source:
  config: model/config.json
"""


def test_paths_parse_get_set_and_errors():
    tree = {"a": {"b": [1, 2]}}
    assert paths.parse("a.b[1]") == ("a", "b", 1)
    assert paths.get(tree, "a.b[-1]") == 2
    assert paths.get(tree, "a.c") is paths.MISSING
    paths.set_(tree, "x.y", 3)
    assert tree["x"] == {"y": 3}
    paths.delete(tree, "x.y")
    assert tree["x"] == {}
    for bad in ("a..b", "a.", "[0]", "a b"):
        with pytest.raises(KadaptError, match="bad config path"):
            paths.parse(bad)


def _model_dir(tmp_path, raw) -> object:
    directory = tmp_path / "other_model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    return directory


def _spec(tmp_path, bridges: str, config=None):
    return load_spec(
        write_spec(tmp_path, GATE + "config_bridges:\n" + bridges, config=config or tiny_kimi_config())
    )


def test_bridge_ops_and_ledger(tmp_path):
    spec = _spec(
        tmp_path,
        """
  - {id: R1, why: rename, op: rename, from: vision_config.vt_hidden_size, to: vision_config.hidden_size}
  - {id: R2, why: absent, op: rename, from: vision_config.vt_num_hidden_layers, to: vision_config.depth}
  - {id: D1, why: indexed, op: derive, from: "vision_config.merge_kernel_size[0]",
     to: vision_config.spatial_merge_size}
  - {id: C1, why: hoist, op: copy, from: text_config.n_routed_experts, to: n_routed_experts, fallback: 384}
  - {id: C2, why: fallback, op: copy, from: text_config.ep_size, to: hoisted, fallback: 7}
  - {id: S1, why: default, op: set_default, path: vision_config.in_channels, value: 3}
  - {id: S2, why: kept, op: set_default, path: vision_config.in_channels, value: 4}
  - {id: X1, why: private, op: set, path: text_config._attn_implementation, value: eager,
     backends: [extraction]}
""",
    )
    raw = tiny_kimi_config()  # the same model without two optional fields
    del raw["vision_config"]["vt_num_hidden_layers"], raw["text_config"]["ep_size"]
    ledger = Ledger(spec.name, "extraction")
    config = load_config(spec, backend="extraction", ledger=ledger, source_dir=_model_dir(tmp_path, raw))
    assert config.vision_config.hidden_size == 32  # vt_hidden_size of the tiny config
    assert config.vision_config.spatial_merge_size == 2
    assert config.n_routed_experts == 8 and config.hoisted == 7
    assert config.vision_config.in_channels == 3
    assert config.text_config._attn_implementation == "eager"  # private: re-applied on the object
    status = {e.id: (e.status, e.reason) for e in ledger.entries}
    assert status["R1"][0] == APPLIED
    assert status["R2"] == (GATED_OFF, "vision_config.vt_num_hidden_layers is not in the config")
    assert status["C2"] == (APPLIED, "text_config.ep_size absent: fallback 7")
    assert status["S2"] == (GATED_OFF, "already set to 3")
    assert all(e.location and e.location.startswith(str(spec.path)) for e in ledger.entries)

    other = Ledger(spec.name, "none")
    load_config(spec, backend="none", ledger=other)
    assert other.status_of("X1") == NOT_FOR_BACKEND


def test_rewrite_conditions(tmp_path):
    raw = tiny_kimi_config()
    raw["text_config"]["_attn_implementation"] = "flash_attention_2"
    spec = _spec(
        tmp_path,
        """
  - id: W1
    why: fires
    op: rewrite
    path: text_config._attn_implementation
    when: {equals: flash_attention_2, unless_importable: surely_not_a_module_here}
    value: eager
  - id: W2
    why: importable
    op: rewrite
    path: text_config.hidden_act
    when: {unless_importable: json}
    value: gelu
  - id: W3
    why: if importable
    op: rewrite
    path: text_config.hidden_act
    when: {if_importable: surely_not_a_module_here}
    value: relu
  - id: W4
    why: mismatch
    op: rewrite
    path: text_config.hidden_act
    when: {equals: tanh}
    value: relu
""",
        raw,
    )
    ledger = Ledger(spec.name, "extraction")
    config = load_config(spec, ledger=ledger)
    assert ledger.status_of("W1") == APPLIED and config.text_config._attn_implementation == "eager"
    assert [ledger.status_of(i) for i in ("W2", "W3", "W4")] == [GATED_OFF] * 3
    assert config.text_config.hidden_act == "silu"


def test_copy_without_fallback_fails_at_spec_line(tmp_path):
    spec = _spec(tmp_path, "  - {id: C9, why: x, op: copy, from: text_config.ep_size, to: hoisted}\n")
    raw = tiny_kimi_config()
    del raw["text_config"]["ep_size"]
    ledger = Ledger(spec.name, "extraction")
    with pytest.raises(KadaptError, match="C9: text_config.ep_size is not in the config") as err:
        load_config(spec, ledger=ledger, source_dir=_model_dir(tmp_path, raw))
    assert err.value.location.startswith(f"{spec.path}:")
    assert ledger.status_of("C9") == FAILED


def test_overrides_apply_before_bridges(tmp_path):
    spec = _spec(
        tmp_path,
        "  - {id: C1, why: hoist, op: copy, from: text_config.n_routed_experts, to: n_routed_experts}\n",
    )
    config = load_config(spec, overrides={"text_config.n_routed_experts": 16, "text_config.hidden_size": 48})
    assert config.n_routed_experts == 16 and config.text_config.hidden_size == 48


def test_gate_mismatch_names_gate_and_type(tmp_path):
    spec = _spec(tmp_path, "  []\n")
    raw = tiny_kimi_config()
    raw["model_type"] = "qwen3_vl"
    with pytest.raises(
        KadaptError, match=r"model_type 'qwen3_vl' does not match the gate .*'kimi_k25'"
    ) as err:
        load_config(spec, source_dir=_model_dir(tmp_path, raw))
    assert err.value.location.startswith(f"{spec.path}:")
    raw = tiny_kimi_config()
    raw["text_config"] = {"model_type": "qwen3", "hidden_size": 64}
    (tmp_path / "other_model" / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    with pytest.raises(
        KadaptError, match=r"text_config.model_type 'qwen3' does not match .*deepseek_v3, kimi_k2"
    ):
        load_config(spec, source_dir=tmp_path / "other_model")


def test_source_dir_override_and_missing_config(tmp_path):
    spec = _spec(tmp_path, "  []\n")
    raw = tiny_kimi_config()
    raw["text_config"]["hidden_size"] = 96
    assert load_config(spec, source_dir=_model_dir(tmp_path, raw)).text_config.hidden_size == 96
    with pytest.raises(KadaptError, match="cannot read model config"):
        load_config(spec, source_dir=tmp_path / "nowhere")
