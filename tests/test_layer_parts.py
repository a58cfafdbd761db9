"""The layer-parts table plan names a family's tensors by: a regeneration from the classes transformers
builds (``python -m kimi_adapter_core.families.parts --write``), its classifier, and plan's inventory
of families it fixed held against the model they build (the family matrix's census, on meta)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from torch import nn

from kimi_adapter_core.backends.simulation.model.census import census
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.layer_parts import PARTS_TABLE, family_parts
from kimi_adapter_core.families import parts
from kimi_adapter_core.families.trial import buildable_config, module_paths, write_spec
from kimi_adapter_core.spec import load_spec

SHIPPED = json.loads(PARTS_TABLE.read_text(encoding="utf-8"))
# one family of each kind of entry, and one of the usual layer (no entry)
REGENERATED = (
    "phi3", "olmo", "olmo2", "cohere", "granitemoe", "nemotron_h", "llama4_text", "qwen2_moe", "llama", "gpt2"
)


def test_the_table_was_generated_on_the_installed_transformers() -> None:
    assert SHIPPED["transformers"] == transformers.__version__


@pytest.mark.parametrize("model_type", REGENERATED)
def test_the_shipped_entry_is_a_regeneration(model_type: str) -> None:
    assert parts.generate(model_type) == SHIPPED["families"].get(model_type)


def test_the_render_is_the_shipped_bytes_for_the_shipped_entries() -> None:
    shipped = PARTS_TABLE.read_text(encoding="utf-8")
    assert parts.render(SHIPPED["families"], SHIPPED["transformers"]) == shipped


class _Mlp(nn.Module):
    def __init__(self, **shapes: tuple[int, int]) -> None:
        super().__init__()
        for name, (out, inp) in shapes.items():
            self.add_module(name, nn.Linear(inp, out, bias=False, device="meta"))


@pytest.mark.parametrize(
    ("shapes", "roles"),
    [
        (
            {"gate_proj": (8, 4), "up_proj": (8, 4), "down_proj": (4, 8)},
            {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
        ),
        ({"gate_up_proj": (16, 4), "down_proj": (4, 8)}, {"gate_up": "gate_up_proj", "down": "down_proj"}),
        ({"fc1": (8, 4), "fc2": (4, 8)}, {"up": "fc1", "down": "fc2"}),
        ({"fc1": (8, 4), "fc2": (4, 8), "extra": (3, 4)}, None),  # a weight of no role: not an MLP
        ({"fc1": (8, 4)}, None),  # no projection back to hidden
    ],
)
def test_projections_are_told_by_shape(
    shapes: dict[str, tuple[int, int]], roles: dict[str, str] | None
) -> None:
    assert parts.projections(_Mlp(**shapes), hidden=4) == roles


def test_a_weightless_norm_is_no_part() -> None:
    layer = nn.Module()
    layer.add_module("input_layernorm", nn.LayerNorm(4, elementwise_affine=False))
    layer.add_module("post_attention_layernorm", nn.LayerNorm(4, device="meta"))
    assert parts._norms(layer) == ["post_attention_layernorm"]


@pytest.mark.parametrize("model_type", ["phi3", "olmo", "olmo2", "cohere", "granitemoe", "bamba", "apertus"])
def test_plan_sizes_what_the_family_builds(model_type: str, tmp_path: Path) -> None:
    """Families whose inventory the table fixed: no invented tensor, the count within 1% (they departed
    before the table: ``qkv_proj``, no norm weights, post-norms, one norm, ``block_sparse_moe.router``,
    ``feed_forward``, an ungated MLP)."""
    found = buildable_config(model_type)
    assert not isinstance(found, str), found
    config, model = found
    spec = load_spec(write_spec(tmp_path, model_type, config, module_paths(model)))
    inputs = model_inputs(spec, None)
    assert census(inputs.groups, inputs.naming, model).problems() == []


def test_plan_names_a_fused_projection_and_drops_a_weightless_norm() -> None:
    phi3, olmo = family_parts("phi3"), family_parts("olmo")
    assert (phi3.qkv, dict(phi3.dense_mlp)) == ("qkv_proj", {"gate_up": "gate_up_proj", "down": "down_proj"})
    assert (olmo.norms, olmo.final_norm) == ((), False)
    assert family_parts("llama") == family_parts("no_such_type")  # the usual layer
