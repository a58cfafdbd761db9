"""DeepSeek-V4 without its compressed layers (issue 36): the prerequisites of its compressor state, proven.

A tiny random DeepSeek-V4 whose layers are all ``sliding_attention`` (its compressed kinds, which
``unmodelled_layer_types`` refuses, left out) and whose first two MoE layers are ``hash_moe`` keeps every
other fact of the family: hyper-connection streams (``hc_mult`` 2), hash routing by the call's
``input_ids`` (``tid2eid``; the wrappers hand layers the token ids: ``STACK_INPUTS``), a rope keyed by
labels (``{"main", "compress"}``: every layer is handed both, ``upstream.rope_labels``) and the shared-KV
attention (one head read as key and value, sinks, a low-rank query, a grouped low-rank output, the rope
of the last channels interleaved and de-rotated on the output). Exported and verified against
transformers (a ragged batch, decoding past the window), the generated module's states are transformers'
own cache, plan's inventory is the model's, simulate prices it. transformers 5.23 has the family too.
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from fixtures.modules import import_path
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction import options_from_spec, verify
from kimi_adapter_core.backends.extraction.tiny_model import randomize_constants
from kimi_adapter_core.backends.simulation.model.census import census
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.rank_config import check_rank_shapes
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import UsageError
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import module_paths, write_spec
from kimi_adapter_core.generate import render_spec
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.structure.derive import derive_structure

BATCH, PROMPT, CAPACITY, STEPS = 2, 6, 24, 6  # the window is 8: the decode passes it
TOLERANCE = 1e-4
HASH = ("hash_moe", "hash_moe", "moe", "moe")


def _config() -> dict[str, Any]:
    """The family matrix's tiny DeepSeek-V4 with every layer sliding, two hash-routed MoE layers, two
    residual streams and the rope on half of each 16-wide head (8 channels, 4 interleaved pairs)."""
    config = tiny_config("deepseek_v4")
    config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]
    config["mlp_layer_types"] = list(HASH)
    config["hc_mult"] = 2
    config["partial_rotary_factor"] = 0.5
    for rope in config["rope_parameters"].values():
        rope["partial_rotary_factor"] = 0.5
    return config


def _spec(folder: Path, batch: int = 1, paged: bool = False) -> Spec:
    config = _config()
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    path = write_spec(folder, "deepseek_v4", config, module_paths(built))
    text = path.read_text().replace("batch: 1", f"batch: {batch}")
    pool = "dtype: float32\n  kv_cache: {kind: paged, block_size: 8}\n"
    path.write_text(text.replace("dtype: float32\n", pool) if paged else text)
    return load_spec(path)


def test_the_structure_states_the_attention_the_rope_labels_and_the_hash_layers() -> None:
    """One KV head whatever num_key_value_heads says (the class never reads it), the attention's form, a
    rope by label (no layer type is a label) and the hash-routed layers, in the description and the IR
    metadata alike; a config object reads as its JSON."""
    config = _config()
    assert config["num_key_value_heads"] == 2  # the tiny default, which DeepseekV4Attention ignores
    s = derive_structure(config)
    assert s == derive_structure(AutoConfig.for_model(**config))
    assert s.layer_kinds == ("attention",) * 4 and s.windows == (8,) * 4
    a = s.attention
    assert (a.kind, a.num_kv_heads, a.head_dim) == ("mqa", 1, 16)
    assert a.form is not None and (a.form.q_lora_rank, a.form.qk_rope_head_dim) == (32, 8)
    assert (a.form.o_groups, a.form.o_lora_rank, a.form.value_is_key, a.form.sinks) == (8, 16, True, True)
    assert s.moe is not None and s.moe.hash_layers == (0, 1)
    text = s.describe()
    assert "MQA 4 heads / 1 KV heads x 16, shared key/value head" in text
    assert "output in 8 groups of rank 16" in text and "2 layers pick them by token id" in text
    # the rotated width is qk_rope_head_dim (the attention's "rope on the last 8 channels"): the config's
    # partial_rotary_factor, the same width as a fraction, is not stated twice
    assert (
        "rope by label (every layer takes each): default theta 1.6e5 (compress), default theta 1e4 (main)"
        in text
    )
    data = s.to_dict()
    assert data["rope"] == {
        "type": "by_label",
        "theta": None,
        "by_label": {
            "compress": {"type": "default", "theta": 160000.0},
            "main": {"type": "default", "theta": 10000.0},
        },
    }
    assert data["attention"]["form"]["o_groups"] == 8 and data["moe"]["hash_layers"] == (0, 1)


def test_the_wrappers_hand_every_layer_both_labels_and_the_token_ids() -> None:
    """``rope_layer_types`` gives each layer the tuple of labels (not its type, which the rotary embedding
    keeps no frequencies for); a family keyed by layer type still gets its types."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**_config()))
    assert upstream.rope_labels(model.model) == ("main", "compress")
    assert upstream.rope_layer_types(model.model) == (("main", "compress"),) * 4
    gemma = AutoConfig.for_model(**tiny_config("gemma3_text"))
    with torch.device("meta"):
        other = AutoModelForCausalLM.from_config(gemma).model
    assert upstream.rope_labels(other) is None
    assert upstream.rope_layer_types(other) == tuple(gemma.layer_types)
    assert upstream.check(("rope_by_label", "layer_input_ids"))[0].ok


def test_the_tiny_models_hash_table_routes_each_token_to_distinct_valid_experts() -> None:
    """transformers' init leaves ``tid2eid`` all zeros (every token to expert 0, twice): the verify model
    gets random rows of distinct experts, so a wrong token id would route elsewhere."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**_config()))
    table = model.model.layers[0].mlp.gate.tid2eid
    assert int(table.abs().max()) == 0
    changed = randomize_constants(model)
    assert "model.layers.0.mlp.gate.tid2eid" in changed and "model.layers.2.mlp.gate.tid2eid" not in changed
    assert table.dtype == torch.long and table.shape == (128, 2)
    assert 0 <= int(table.min()) and int(table.max()) < 4 and bool((table[:, 0] != table[:, 1]).all())
    assert len({tuple(row) for row in table.tolist()}) > 1


# verify's model with five layers: the last two are copies of the third (stitching), each with the
# copy of its prefill value the IR gives a tensor returned as both key and value
STITCHED = {
    "num_hidden_layers": 5,
    "layer_types": ["sliding_attention"] * 5,
    "mlp_layer_types": [*HASH, "moe"],
}


@pytest.mark.compat
@pytest.mark.parametrize("paged", [False, True])
def test_a_ragged_batch_verifies_past_the_sliding_window(tmp_path: Path, paged: bool) -> None:
    """kadapt's own export and verify, batch 2, contiguous and paged: prefill and 24 decode steps
    (verify's window is 4) equal transformers' logits and generation, the rows of different lengths
    too, with layers 3 and 4 stitched from layer 2; the IR metadata states the rope by label, the
    attention's form and the hash layers."""
    spec = _spec(tmp_path, batch=2, paged=paged)
    out = tmp_path / "out"
    options = dataclasses.replace(
        options_from_spec(spec, output_dir=out), verify_dtypes=("float32",), verify_overrides=STITCHED
    )
    report = verify(spec, options, echo=lambda line: None, keep_in=out)
    checks = {check.name: check for check in report.checks}
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    assert "positions 8..31" in checks["greedy generation"].detail
    assert "2 rows of lengths [8, 6]" + (", paged" if paged else ":") in checks["ragged batch"].detail
    for graph in ("prefill", "decode"):
        metadata = json.loads((out / f"deepseek_v4_{graph}_ir.json").read_text())["metadata"]
        assert metadata["stitching"] == {"traced_layers": 3, "replicated_from": {"3": 2, "4": 2}}
    structure = metadata["structure"]
    assert structure["rope"]["type"] == "by_label" and set(structure["rope"]["by_label"]) == {
        "main",
        "compress",
    }
    assert structure["attention"]["form"]["value_is_key"] and structure["moe"]["hash_layers"] == [0, 1]


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory) -> types.ModuleType:
    spec = _spec(tmp_path_factory.mktemp("deepseek_v4_spec"))
    files, _ = render_spec(spec, ["extraction"])
    text = {str(item.path): item.text for item in files}["adapters/deepseek_v4/extraction.py"]
    path = tmp_path_factory.mktemp("deepseek_v4_module") / "extraction.py"
    path.write_text(text)
    return import_path(path, "generated_deepseek_v4_extraction")


def _assert_window_equal(ours: list[torch.Tensor], cache: DynamicCache, written: int) -> None:
    """Each layer's key and value (one tensor in transformers: ``update(kv, kv)``) over the positions
    transformers' sliding layer keeps, the last ones written."""
    assert len(ours) == 2 * len(cache.layers)
    for index, layer in enumerate(cache.layers):
        assert layer.keys is layer.values or torch.equal(layer.keys, layer.values)
        kept = layer.keys.shape[2]
        for mine in ours[2 * index : 2 * index + 2]:
            window = mine[:, :, written - kept : written]
            assert (window - layer.keys).abs().max() <= TOLERANCE * max(1.0, layer.keys.abs().max()), index


@pytest.mark.compat
def test_the_generated_modules_states_are_transformers_cache(module: types.ModuleType) -> None:
    """The generated module's prefill and decode, batch 2: logits equal transformers' with its own
    DynamicCache at every step and each layer's key and value equal the sliding window it keeps."""
    torch.manual_seed(0)
    model = module.build_model(device="cpu", dtype=None)
    randomize_constants(model)
    config = module.text_config(model.config)
    prefill, decode = module.prefill_wrapper(model), module.decode_wrapper(model)
    prompt = torch.randint(3, config.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    keyword = module.cache_keyword(model.model.layers[0])  # past_key_values (5.23), cache (5.24)
    _, mask, positions = module.prefill_example_inputs("cpu", batch=BATCH, prefill_len=PROMPT, dtype=None)
    with torch.no_grad():
        reference = model(prompt, **{keyword: cache}, use_cache=True).logits
        logits, *present = prefill(prompt, mask, positions)
    assert (logits - reference).abs().max() <= TOLERANCE * reference.abs().max()
    _assert_window_equal(present, cache, PROMPT)
    states = module.place_prefill_kv(present, CAPACITY)
    token = logits[:, -1:].argmax(-1)
    for step in range(STEPS):
        position = PROMPT + step
        positions = torch.full((BATCH, 1), position)
        mask = module.additive_causal_mask(positions, CAPACITY, torch.float32)
        with torch.no_grad():
            reference = model(token, **{keyword: cache}, position_ids=positions, use_cache=True).logits
            logits, *states = decode(token, mask, positions, positions.view(-1), *states)
        assert (logits - reference).abs().max() <= TOLERANCE * reference.abs().max(), step
        _assert_window_equal(states, cache, position + 1)
        token = logits[:, -1:].argmax(-1)


def test_plan_counts_the_model_transformers_builds(tmp_path: Path) -> None:
    """Every tensor of the built model in plan's inventory and nothing else: the shared-KV attention's
    parts, the sinks, the hash layers' tables (and no correction bias there), the streams' weights."""
    spec = _spec(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**_config()))
    inputs = model_inputs(spec, None)
    assert census(inputs.groups, inputs.naming, model).problems() == []
    names = {group.name: group for group in inputs.groups}
    assert names["router.tid2eid"].dtype == "int64" and len(names["router.tid2eid"].checkpoint_names) == 2
    assert len(names["router_bias"].checkpoint_names) == 2  # the two top-k layers only
    assert {"attn.o_a_proj", "attn.o_b_proj", "attn.sinks", "attn.kv_proj"} <= names.keys()


def _simulate(spec: Spec, tp: int) -> dict[str, Any]:
    args = ["simulate", str(spec.path), "--device", "h200", "--query-len", "64", "--tp", str(tp)]
    result = CliRunner().invoke(cli, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output[result.output.index("{") :])


def test_simulate_prices_the_attention_and_the_hash_routed_layers(tmp_path: Path) -> None:
    """Priced at TP 1 and 2: a rank projects its own groups of heads (o_groups / TP, so the output's
    two projections take half the FLOPs at TP 2); a TP that does not divide the groups is refused."""
    spec = _spec(tmp_path)
    report = _simulate(spec, 1)
    assert report["step_time_s"] > 0
    ops = {(op["module"], op["op"]): op for op in report["ops"]}
    attention = ops[("moe_layer.self_attn", "flash_attention_prefill")]
    assert attention["count"] == 4 and attention["source"].startswith("table:")
    assert ("moe_layer.mlp.experts", "grouped_gemm(routed_experts)") in ops
    halved = {(op["module"], op["op"]): op for op in _simulate(spec, 2)["ops"]}
    for output in (("moe_layer.self_attn.o_a_proj", "bmm"), ("moe_layer.self_attn.o_b_proj", "mm")):
        assert halved[output]["flops"] * 2 == ops[output]["flops"], output
    with pytest.raises(UsageError, match="8 groups of heads"):
        check_rank_shapes(derive_structure(_config()), 16)
