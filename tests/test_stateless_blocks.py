"""Blocks with no token mixer and no state (Nemotron-H's ``mlp`` and ``moe`` blocks), and mixer blocks with
no MLP: a stack of one-sublayer blocks, end to end.

Nemotron-H lists its blocks (``layers_block_type``; older JSON ``hybrid_override_pattern``: ``M`` Mamba2,
``*`` attention, ``-`` MLP, ``E`` MoE). transformers' cache keeps a DummyLayer for an MLP block and the
model hands it ``attention_mask=None``. The family trial (a tiny random model of every block kind, export,
``--verify`` with every returned state) adapts it; the state mapping and the wrappers carry no state for
those blocks; ``plan``'s inventory is the built model's parameters and its state bytes what
``DynamicCache`` holds; ``simulate`` prices each block as what it is. Dory's JSON, whose ``layer_types``
lists each layer's attention and MLP as two entries, stays refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from kimi_adapter_core.backends.extraction.runtime import abi as runtime
from kimi_adapter_core.backends.simulation.model.params import naming, text_groups
from kimi_adapter_core.backends.simulation.model.rank_config import layer_kinds
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import Refusal
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import ADAPTED, module_paths, run_trial, write_spec
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.derive import derive_structure, refuse_unmodelled

BLOCKS = ["linear_attention", "moe", "full_attention", "mlp"]  # the config class's default: M E * -
KINDS = ("linear", "none", "attention", "none")


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    """transformers' default Nemotron-H config, tiny, as a config.json holds it."""
    found = tiny_config("nemotron_h")
    assert found["layers_block_type"] == BLOCKS
    return found


@pytest.fixture(scope="module")
def spec_path(raw: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The family trial's spec (the guide's) for the tiny config."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))
    return write_spec(tmp_path_factory.mktemp("nemotron_h"), "nemotron_h", raw, module_paths(model))


def _cli(*args: object) -> dict[str, Any]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    return json.loads(result.output)


def test_the_nemotron_h_trial_is_adapted_with_every_state_verified() -> None:
    row = run_trial("nemotron_h")
    assert (row.outcome, row.code) == (ADAPTED, ""), row.detail
    assert row.detail.startswith("heads KV, GQA; verify max |diff|")


def test_the_hybrid_override_pattern_and_layers_block_type_readings_agree(raw: dict[str, Any]) -> None:
    """The raw JSON's list, an older JSON's letters (with or without the layer count) and the built
    config object describe one structure: each block a mixer alone or an MLP alone."""
    listed = derive_structure(raw)
    lettered = {k: v for k, v in raw.items() if k != "layers_block_type"}
    lettered["hybrid_override_pattern"] = "ME*-"
    no_count = {k: v for k, v in lettered.items() if k != "num_hidden_layers"}
    built = AutoConfig.for_model(**lettered)
    assert built.layers_block_type == BLOCKS
    assert derive_structure(lettered) == derive_structure(no_count) == derive_structure(built) == listed
    assert listed.layer_kinds == KINDS
    assert [(layer.attention, layer.mlp) for layer in listed.layers] == [
        ("linear", "none"),
        ("none", "moe"),
        ("full", "none"),
        ("none", "dense"),
    ]
    assert (listed.attention_layer_ids, listed.linear_layer_ids) == ((2,), (0,))
    assert (listed.mixerless_layer_ids, listed.mlpless_layer_ids) == ((1, 3), (0, 2))
    assert "2/4 blocks an MLP alone (no mixer)" in listed.describe()
    assert "2/4 blocks a mixer alone (no MLP)" in listed.describe()
    assert {"attention": "none", "layers": [1, 1], "mlp": "moe", "window": None} in listed.to_dict()["layers"]


def test_an_mlp_entry_that_is_part_of_a_layer_stays_refused() -> None:
    """Dory's JSON lists each layer's attention and MLP as two layer_types entries: not MLP blocks."""
    dory = {"model_type": "dory", "num_hidden_layers": 4, "layer_types": ["full_attention", "mlp"] * 2}
    with pytest.raises(Refusal) as refused:
        refuse_unmodelled(dory)
    assert refused.value.code == "hybrid"
    assert "layer 1 is 'mlp'" in refused.value.message


def test_a_moe_block_without_experts_is_a_located_error(raw: dict[str, Any]) -> None:
    with pytest.raises(Exception, match="layer 1 is a moe block but the config declares no routed experts"):
        derive_structure({**raw, "n_routed_experts": 0})


def test_the_state_mapping_and_the_wrappers_carry_no_state_for_mlp_blocks(raw: dict[str, Any]) -> None:
    kinds = derive_structure(raw).layer_kinds
    names = {
        key.format(role): f"{role}.{{layer}}"
        for role in ("key", "value", "conv", "recurrent")
        for key in ("prefill_{}", "decode_{}_in", "decode_{}_out")
    }
    linear = (((96, 4), "float32"), ((4, 8, 16), "float32"))
    mapping = runtime.build_kv_mapping(
        ((2, 16), (2, 16)),
        kv_layout="heads",
        batch=1,
        prefill_len=8,
        max_cache_len=16,
        num_layers=4,
        dtype="float32",
        names=names,
        kinds=kinds,
        linear_states=linear,
    )
    assert [layer["kind"] for layer in mapping["layers"]] == list(KINDS)
    assert mapping["layers"][1] == {"layer": 1, "kind": "none"} == {**mapping["layers"][3], "layer": 1}
    assert "keeps no state" in mapping["contract"]["stateless_layers"]
    past = runtime.decode_inputs(
        ((2, 16), (2, 16)), batch=1, position=8, max_cache_len=16, num_layers=4,
        dtype=torch.float32, kinds=kinds, linear_states=linear,
    )[4:]  # fmt: skip
    assert [tuple(t.shape) for t in past] == [(1, 96, 4), (1, 4, 8, 16), (1, 2, 16, 16), (1, 2, 16, 16)]
    assert runtime.flat_state_roles(kinds, 4) == ["conv", "recurrent", "key", "value"]


def test_plan_names_every_parameter_transformers_builds(raw: dict[str, Any], spec_path: Path) -> None:
    """Per block exactly its one part under ``mixer`` after ``norm``: no phantom attention or MLP; the
    MLPs ungated, the router in fp32 as transformers keeps it."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))
    theirs = {name: p.numel() for name, p in model.named_parameters()}
    groups = text_groups(derive_structure(raw), naming(load_spec(spec_path)))
    mine = {name: params for group in groups for name, params in group.tensors()}
    assert mine == theirs
    assert "model.layers.3.mixer.up_proj.weight" in mine
    assert "model.layers.3.mixer.gate_proj.weight" not in mine
    assert {g.name: g.dtype for g in groups}["router"] == "fp32"


def test_plan_state_bytes_are_what_dynamic_cache_holds(raw: dict[str, Any], spec_path: Path) -> None:
    config = AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    cache = DynamicCache(config=config)
    with torch.no_grad():
        model(torch.arange(1, 9).unsqueeze(0), cache=cache, use_cache=True)
    held = sum(t.numel() * t.element_size() for t in (cache.get_conv_state(0), cache.get_recurrent_state(0)))
    attention = cache.layers[2]
    per_token = sum(t.numel() * t.element_size() for t in (attention.keys, attention.values)) // 8
    assert [type(cache.layers[i]).__name__ for i in (1, 3)] == ["DummyLayer"] * 2
    states = _cli("plan", spec_path, "--format", "json")["states"]
    assert states["linear_attention"]["bytes_per_request"] == held
    assert (states["attention_kv"]["layer_ids"], states["linear_attention"]["layer_ids"]) == ([2], [0])
    assert states["attention_kv"]["bytes_per_token"] == per_token


def test_simulate_prices_each_block_as_what_it_is(raw: dict[str, Any], spec_path: Path) -> None:
    """One traced block per kind: the MLP blocks price no attention, the mixer blocks no MLP, and each
    one-sublayer block ends in one TP all-reduce, not two."""
    kinds = layer_kinds(derive_structure(raw))
    assert [(k.scope, k.sublayers, k.attends) for k in kinds] == [
        ("linear", 1, False),
        ("moe_only", 1, False),
        ("attention", 1, True),
        ("dense_only", 1, False),
    ]
    sim = _cli("simulate", spec_path, "--device", "h200", "--tp", 2, "--batch", 4, "--decode",
               "--context-len", 64, "--format", "json")  # fmt: skip
    ops: dict[str, list[str]] = {}
    for op in sim["ops"]:
        ops.setdefault(op["scope"], []).append(op["op"])
    assert ops["attention"].count("attention_decode") == 1
    assert "grouped_gemm(routed_experts)" in ops["moe_only"]
    for scope in ("linear", "moe_only", "attention", "dense_only"):
        assert ops[scope].count("tp_all_reduce") == 1, scope
    for scope in ("linear", "moe_only", "dense_only"):
        assert not [op for op in ops[scope] if "attention" in op], scope
    assert not [op for op in ops["attention"] + ops["linear"] if "experts" in op]
