"""Zamba's and Zamba2's hybrid layers (issue 36): each runs one of a few transformer blocks shared
across the stack, fed its hidden states concatenated with the input embeddings (Zamba2: with LoRA
adapters of its own), then its own mixer (Zamba2: Mamba2; Zamba: a multi-head Mamba1). Their state is
the ABI kind ``hybrid``: the shared attention's keys and values and the mixer's conv window and
recurrent state, under the layer's index. The structure reads them through the ``shared_blocks`` rule;
the wrappers hand every layer the call's embeddings and its index; verify equals transformers (logits
and every state, rows joining a paged batch) on tiny models whose hybrid layers outnumber their blocks;
plan counts each shared block once and each layer's adapters; simulate prices a hybrid layer and the
multi-head scan; the generated module carries the four states.
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
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, Zamba2Config, ZambaConfig

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction import options_from_spec, verify
from kimi_adapter_core.backends.extraction.ir.stitch import plan as stitch_plan
from kimi_adapter_core.backends.simulation.model.census import census
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import Refusal
from kimi_adapter_core.families.trial import module_paths, write_spec
from kimi_adapter_core.generate import render_spec
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.derive import derive_structure

# two shared blocks serving three hybrid layers (blocks 0, 1, 0), q/k/v adapters, rope in the blocks
TINY: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
    "layers_block_type": ["linear_attention", "hybrid"] * 3, "num_attention_heads": 4, "n_mamba_heads": 4,
    "mamba_d_state": 16, "mamba_ngroups": 2, "mamba_expand": 2, "chunk_size": 16, "num_mem_blocks": 2,
    "use_shared_attention_adapter": True, "adapter_rank": 8, "use_mem_rope": True,
    "max_position_embeddings": 256,
}  # fmt: skip
KINDS = ["linear", "hybrid"] * 3
BATCH, PROMPT, CAPACITY, STEPS = 2, 9, 24, 4


def _config() -> dict[str, Any]:
    """TINY as transformers writes its config.json (the keys its class derives included)."""
    return {**Zamba2Config(**TINY).to_dict(), "model_type": "zamba2"}


def test_the_structure_reads_hybrid_layers_their_blocks_and_no_mlp_elsewhere() -> None:
    config = _config()
    for found in (derive_structure(config), derive_structure(AutoConfig.for_model(**config))):
        assert found.layer_kinds == tuple(KINDS)
        assert [layer.mlp for layer in found.layers] == ["none", "dense"] * 3
        assert found.attention_layer_ids == (1, 3, 5) and found.linear_layer_ids == tuple(range(6))
        blocks = found.shared_blocks
        assert (blocks.count, blocks.adapter_rank, blocks.attention_adapters, blocks.input_width) == (
            2,
            8,
            True,
            2,
        )
        assert found.attention.head_dim == 32  # 2 x hidden / heads: the block attends over the wide input
        linear = found.linear
        assert (linear.kind, linear.num_value_heads, linear.value_head_dim, linear.num_key_heads) == (
            "mamba2", 4, 32, 2
        )  # fmt: skip
    # a key another family's rule does not model stays refused (Zamba has no mamba_headdim)
    with pytest.raises(Refusal) as refused:
        derive_structure({**config, "model_type": "zamba"})
    assert refused.value.code == "hybrid" and "mamba_headdim" in refused.value.message


def test_the_hybrid_layer_type_is_modelled_only_where_a_rule_says_what_its_layers_are() -> None:
    """One ABI kind ``hybrid`` for two layer designs: Zamba's shared block then its mixer
    (``shared_blocks``) and Falcon-H1's attention and Mamba2 side by side (``uniform_layer_types``); a
    ``hybrid`` layer type in any other family stays refused, naming it."""
    falcon = AutoConfig.for_model("falcon_h1", num_hidden_layers=2).to_dict()
    assert derive_structure(falcon).layer_kinds == ("hybrid", "hybrid")
    assert derive_structure(_config()).layer_kinds == tuple(KINDS)
    other = {
        "model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 128,
        "layer_types": ["full_attention", "hybrid"],
    }  # fmt: skip
    with pytest.raises(Refusal) as refused:
        derive_structure(other)
    assert refused.value.code == "hybrid" and "layer 1 is 'hybrid'" in refused.value.message


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    config = AutoConfig.for_model(**_config())
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(std=0.2 if parameter.dim() > 1 else 0.5)
            if name.endswith("A_log"):  # a decay that neither vanishes nor explodes
                parameter.uniform_(-1.0, 1.0)
    return model.to(dtype)


def test_stitching_traces_every_layer_that_shares_a_block() -> None:
    """Hybrid layers 1 and 5 run the same block (same tensors), but each reads its own adapters: none is
    a clone of another, and the mixer layers after the last one are the only copies."""
    chosen = stitch_plan(list(_model().model.layers))
    assert chosen.prefix == 6 and not chosen.templates


def _spec(tmp_path: Path, paged: bool = True) -> Path:
    """The guide's spec for TINY, batch 2, its decode KV in block pools (``paged``) or contiguous."""
    config = _config()
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    path = write_spec(tmp_path, "zamba2", config, module_paths(built))
    text = path.read_text().replace("batch: 1", f"batch: {BATCH}")
    pool = "dtype: float32\n  kv_cache: {kind: paged, block_size: 8}\n"
    path.write_text(text.replace("dtype: float32\n", pool) if paged else text)
    return path


@pytest.mark.compat
def test_verify_proves_every_state_with_rows_joining_a_paged_batch(tmp_path: Path) -> None:
    spec = load_spec(_spec(tmp_path))
    options = options_from_spec(spec, output_dir=tmp_path / "out")
    report = verify(spec, dataclasses.replace(options, verify_dtypes=("float32",)), echo=lambda line: None)
    checks = {check.name: check for check in report.checks}
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    assert "3 linear layers, 3 hybrid layers, prefill + 24 decode steps" in checks["returned states"].detail
    for state in ("conv", "recurrent", "key", "value"):
        assert f"{state} max |diff|" in checks["returned states"].detail
    assert "2 rows joining at steps [0, 2], paged" in checks["joining rows"].detail


def test_the_embeddings_each_hybrid_layer_reads_are_the_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handing the hybrid layers zeros instead of the call's embeddings fails verify at the first one."""
    from kimi_adapter_core.backends.extraction.runtime import abi as runtime

    real = runtime.run_layer

    def forgetful(layer: Any, hidden: Any, carried: dict[str, Any], **kwargs: Any) -> Any:
        if carried.get("original_hidden_states") is not None:
            carried = {
                **carried,
                "original_hidden_states": torch.zeros_like(carried["original_hidden_states"]),
            }
        return real(layer, hidden, carried, **kwargs)

    monkeypatch.setattr(runtime, "run_layer", forgetful)
    spec = load_spec(_spec(tmp_path))
    options = options_from_spec(spec, output_dir=tmp_path / "out")
    options = dataclasses.replace(options, verify_dtypes=("float32",), verify_decode_steps=2)
    report = verify(spec, options, echo=lambda line: None)
    assert not report.passed
    assert report.first_departure.startswith("prefill: layer 1 ")


def test_plan_counts_each_shared_block_once_and_each_layers_adapters(tmp_path: Path) -> None:
    spec = load_spec(_spec(tmp_path))
    inputs = model_inputs(spec, None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**_config()))
    found = census(inputs.groups, inputs.naming, model)
    assert found.problems() == [] and found.planned == found.built
    groups = {group.name: group for group in inputs.groups}
    assert groups["shared_block.q_proj"].instances == 2  # two blocks, though three layers run them
    assert groups["shared_block.q_proj"].tensor_shapes == ((128, 128),)  # input: hidden and embeddings
    adapters = groups["shared_block.adapters"]
    assert adapters.instances == 3  # one set per hybrid layer, inside the block it runs
    assert (
        adapters.checkpoint_names[2][0]
        == "model.layers.1.shared_transformer.feed_forward.gate_up_proj_adapter_list.2.0.weight"
    )
    assert groups["mamba2.in_proj"].instances == 6


def test_simulate_prices_a_hybrid_layer(tmp_path: Path) -> None:
    path = _spec(tmp_path)
    args = ["simulate", str(path), "--device", "h200", "--decode", "--context-len", "32", "--format", "json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    priced = json.loads(result.stdout)
    assert priced["step_time_s"] > 0
    counts = {op["module"]: op["count"] for op in priced["ops"] if op["op"].startswith("mm")}
    # three hybrid layers, each its block's attention and MLP, its adapters, projection and mixer
    assert counts["hybrid_dense_layer.shared_transformer.self_attn"] == 3  # q, k, v fused
    assert counts["hybrid_dense_layer.shared_transformer.self_attn.linear_q_adapter_list.0.0"] == 3
    assert counts["hybrid_dense_layer.linear"] == 3
    assert counts["hybrid_dense_layer.mamba_decoder.mamba.in_proj"] == 3
    assert counts["linear_layer.mamba.in_proj"] == 3


def _theirs(cache: DynamicCache) -> list[torch.Tensor]:
    flat: list[torch.Tensor] = []
    for layer, kind in enumerate(KINDS):
        if kind == "hybrid":
            flat += [cache.layers[layer].keys.clone(), cache.layers[layer].values.clone()]
        flat += [cache.get_conv_state(layer).clone(), cache.get_recurrent_state(layer).clone()]
    return flat


@pytest.fixture(scope="module")
def module(tmp_path_factory: pytest.TempPathFactory) -> types.ModuleType:
    folder = tmp_path_factory.mktemp("zamba2_spec")
    files, _ = render_spec(load_spec(_spec(folder, paged=False)), ["extraction"])
    text = {str(item.path): item.text for item in files}["adapters/zamba2/extraction.py"]
    path = tmp_path_factory.mktemp("zamba2_module") / "extraction.py"
    path.write_text(text)
    return import_path(path, "generated_zamba2_extraction")


@pytest.mark.compat
def test_the_generated_module_carries_the_four_states_as_transformers_does(module: types.ModuleType) -> None:
    assert module.LAYER_KINDS == tuple(KINDS)
    assert module.layer_kinds(module.SOURCE_CONFIG) == module.LAYER_KINDS
    names = module.graph_names("prefill", 6, KINDS)[1]
    assert names[1:7] == ["c.0", "r.0", "k.1", "v.1", "c.1", "r.1"]
    model = _model()
    upstream.forget()
    prefill, decode = module.prefill_wrapper(model), module.decode_wrapper(model)
    prompt = torch.randint(3, 128, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    keyword = module.cache_keyword(model.model.layers[0])  # 5.24: cache, 5.23: past_key_values
    _, mask, positions = module.prefill_example_inputs("cpu", batch=BATCH, prefill_len=PROMPT, dtype=None)
    with torch.no_grad():
        reference = model(prompt, **{keyword: cache}, use_cache=True).logits
        logits, *present = prefill(prompt, mask, positions)
    assert (logits - reference).abs().max() <= 1e-4
    for ours, theirs in zip(present, _theirs(cache), strict=True):
        assert ours.shape == theirs.shape and (ours - theirs).abs().max() <= 1e-4
    states = module.place_prefill_kv(present, CAPACITY, KINDS)
    token = logits[:, -1:].argmax(-1)
    for step in range(STEPS):
        position = PROMPT + step
        positions = torch.full((BATCH, 1), position)
        mask = module.additive_causal_mask(positions, CAPACITY, torch.float32)
        with torch.no_grad():
            reference = model(token, position_ids=positions, **{keyword: cache}, use_cache=True).logits
            logits, *states = decode(token, mask, positions, positions.view(-1), *states)
        assert (logits - reference).abs().max() <= 1e-3, step
        for index, (ours, theirs) in enumerate(zip(states, _theirs(cache), strict=True)):
            if ours.dim() == 4 and ours.shape[2] == CAPACITY:  # a KV cache: the rows written so far
                ours = ours[:, :, : position + 1]
            assert (ours - theirs).abs().max() <= 1e-3, (step, index)
        token = logits[:, -1:].argmax(-1)
    mapping = module.kv_mapping(model.config, batch=BATCH, prefill_len=PROMPT, max_cache_len=CAPACITY)
    hybrid = mapping["layers"][1]
    assert hybrid["kind"] == "hybrid" and hybrid["decode_key_input"]["name"] == "pk.1"
    assert hybrid["decode_recurrent_input"]["shape"] == [BATCH, 4, 32, 16]
    assert "hybrid" in mapping["contract"]["hybrid_layers"]


# Zamba: one block every hybrid layer runs, no adapters; each mixer a Mamba1 scan per SSM head
ZAMBA: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "layers_block_type": ["linear_attention", "hybrid"] * 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "n_mamba_heads": 2, "mamba_d_state": 8, "mamba_dt_rank": 8,
    "max_position_embeddings": 256,
}  # fmt: skip


def _zamba_spec(tmp_path: Path) -> Path:
    config = {**ZambaConfig(**ZAMBA).to_dict(), "model_type": "zamba"}
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return write_spec(tmp_path, "zamba", config, module_paths(built))


def test_zambas_mixer_is_a_mamba1_scan_per_ssm_head() -> None:
    found = derive_structure({**ZambaConfig(**ZAMBA).to_dict(), "model_type": "zamba"})
    assert found.layer_kinds == ("linear", "hybrid") * 2
    linear = found.linear
    assert (linear.kind, linear.num_value_heads, linear.value_head_dim, linear.dt_rank) == (
        "mamba1_heads",
        2,
        64,
        8,
    )
    assert (linear.conv.shape(), linear.recurrent.shape()) == ((128, 4), (2, 64, 8))  # x alone; [H, P, N]
    blocks = found.shared_blocks
    assert (blocks.count, blocks.adapter_rank, blocks.attention_adapters) == (1, 0, False)


@pytest.mark.compat
def test_zamba_verifies_every_state_and_plans_its_one_block(tmp_path: Path) -> None:
    spec = load_spec(_zamba_spec(tmp_path))
    options = options_from_spec(spec, output_dir=tmp_path / "out")
    options = dataclasses.replace(options, verify_dtypes=("float32",), verify_decode_steps=8)
    report = verify(spec, options, echo=lambda line: None)
    checks = {check.name: check for check in report.checks}
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    assert "2 linear layers, 2 hybrid layers" in checks["returned states"].detail
    inputs = model_inputs(spec, None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**ZambaConfig(**ZAMBA).to_dict()))
    found = census(inputs.groups, inputs.naming, model)
    assert found.problems() == [] and found.planned == found.built
    groups = {group.name: group for group in inputs.groups}
    assert groups["shared_block.mlp"].instances == 1 and "shared_block.adapters" not in groups
    assert groups["mamba1_heads.head_proj"].tensor_shapes[0] == (2, 8 + 2 * 8, 64)  # per head: dt, B, C


def test_simulate_prices_zambas_scan_per_head_and_refuses_a_tp_past_its_heads(tmp_path: Path) -> None:
    path = _zamba_spec(tmp_path)
    args = ["simulate", str(path), "--device", "h200", "--decode", "--context-len", "32", "--format", "json"]
    result = CliRunner().invoke(cli, [*args, "--tp", "2"])
    assert result.exit_code == 0, result.output
    ops = {(op["module"], op["op"]): op["count"] for op in json.loads(result.stdout)["ops"]}
    assert ops[("linear_layer.mamba", "selective_state_update")] == 2
    assert ops[("hybrid_dense_layer.mamba_decoder.mamba", "bmm")] == 4  # x_proj and dt_proj per head
    refused = CliRunner().invoke(cli, [*args, "--tp", "4"])
    assert (
        refused.exit_code != 0 and "2 linear-attention value heads (config n_mamba_heads)" in refused.output
    )


def test_the_generated_module_sizes_zambas_states_from_any_config(tmp_path: Path) -> None:
    """The states a multi-head Mamba1 keeps follow from sizes its config class derives (channels per
    head): the module computes them as kadapt does, for its own config and a larger one."""
    files, _ = render_spec(load_spec(_zamba_spec(tmp_path)), ["extraction"])
    text = {str(item.path): item.text for item in files}["adapters/zamba/extraction.py"]
    (tmp_path / "zamba_extraction.py").write_text(text)
    module = import_path(tmp_path / "zamba_extraction.py", "generated_zamba_extraction")
    assert module.LAYER_KINDS == ("linear", "hybrid") * 2
    assert (
        module.linear_states(module.SOURCE_CONFIG)
        == module.LINEAR_STATES
        == (
            ((128, 4), "float32"),
            ((2, 64, 8), "float32"),
        )
    )
    wide = {**module.SOURCE_CONFIG, "hidden_size": 128, "n_mamba_heads": 4}
    assert module.linear_states(wide, None) == (((256, 4), "float32"), ((4, 64, 8), "float32"))
