"""What each Kimi-K2.5 config bridge is for, shown by removing it (``Spec.without``, as ``--without``).

The shipped config's vision values happen to equal ``KimiK25VisionConfig``'s defaults, so on that
config the renames B1..B7 change nothing but a leftover key; they matter for any config whose values
differ - a smaller variant, or verify's tiny model - and there, without them, transformers silently
builds the default-sized tower. Each test uses such a config and fails if its entry stops mattering.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures.shared_apply import SharedApplies

from kimi_adapter_core.cli import cli
from kimi_adapter_core.loading import load_config
from kimi_adapter_core.spec import load_spec

SPEC = load_spec("kimi_k25")

RENAMES = {  # id: (hub key, transformers key, a value unlike the default)
    "B1": ("vt_hidden_size", "hidden_size", 64),
    "B2": ("vt_num_hidden_layers", "num_hidden_layers", 2),
    "B3": ("vt_num_attention_heads", "num_attention_heads", 4),
    "B4": ("vt_intermediate_size", "intermediate_size", 96),
    "B5": ("init_pos_emb_height", "pos_emb_height", 8),
    "B6": ("init_pos_emb_width", "pos_emb_width", 8),
    "B7": ("init_pos_emb_time", "pos_emb_time", 2),
}


@pytest.mark.parametrize("entry", sorted(RENAMES))
def test_vision_renames_carry_the_hub_value(entry: str) -> None:
    hub_key, key, value = RENAMES[entry]
    overrides = {f"vision_config.{hub_key}": value}
    with_it = load_config(SPEC, overrides=overrides).vision_config
    without = load_config(SPEC.without([entry]), overrides=overrides).vision_config
    assert getattr(with_it, key) == value
    assert getattr(without, key) != value  # transformers ignores the hub key and keeps its default


@pytest.mark.parametrize(
    ("entry", "key", "value"),
    [("P3", "spatial_merge_size", 2), ("P3b", "temporal_patch_size", 1), ("P3c", "in_channels", 3)],
)
def test_input_generator_fields_exist_only_through_their_bridge(entry: str, key: str, value: int) -> None:
    assert getattr(load_config(SPEC).vision_config, key) == value
    assert getattr(load_config(SPEC.without([entry])).vision_config, key, None) is None


@pytest.mark.parametrize(
    ("entry", "key", "value"), [("P12", "n_routed_experts", 384), ("P12b", "n_shared_experts", 1)]
)
def test_root_moe_counts_come_from_the_text_config(entry: str, key: str, value: int) -> None:
    assert getattr(load_config(SPEC), key) == value
    assert getattr(load_config(SPEC.without([entry])), key, None) is None


@pytest.mark.parametrize(("entry", "section"), [("P2", "text_config"), ("P2b", "vision_config")])
def test_a_flash_attention_request_falls_back_to_eager_without_flash_attn(entry: str, section: str) -> None:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("flash_attn is installed: the rewrite is meant not to fire")
    overrides = {f"{section}._attn_implementation": "flash_attention_2"}
    kept = getattr(load_config(SPEC, backend="simulation", overrides=overrides), section)
    dropped = getattr(load_config(SPEC.without([entry]), backend="simulation", overrides=overrides), section)
    assert kept._attn_implementation == "eager"
    # without the rewrite transformers drops the unrunnable request and picks its own default (sdpa)
    assert dropped._attn_implementation != "eager"


@pytest.mark.slow
def test_k1_keeps_kimis_graph_small(tmp_path: Path, shipped_apply: SharedApplies) -> None:
    """As on DeepSeek-V3: without K1 every layer's expand_kv exports as empty + slice_scatter."""
    without = ["apply", "kimi_k25", "--output-dir", str(tmp_path / "without"), "--format", "json"]
    nodes = {}
    # with every entry: the spec's own run, which every test reading it shares
    for label, result in (
        ("with", shipped_apply("kimi_k25")),
        ("without", CliRunner().invoke(cli, [*without, "--without", "K1"])),
    ):
        assert result.exit_code == 0, result.output
        nodes[label] = json.loads(result.output)["extraction"]["graphs"]["prefill"]["nodes"]
    assert nodes["without"] - nodes["with"] == 6 * 61
