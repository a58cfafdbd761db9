"""Falcon-H1 (issue 36): every layer runs a Mamba2 mixer and attention side by side on one normed input
and sums them, with muP multipliers around and inside the layers. The ABI layer kind ``hybrid`` carries
the attention's key and value, then the mixer's conv window and recurrent state.

The family matrix's spec on its tiny config (each multiplier set apart from 1: ``tiny.SCALES``) is
rendered in a temp directory; the generated extraction module's wrappers give transformers' logits and
every state of each layer (KV, conv, recurrent) over a prefill and several decode steps, fed by
transformers' own ``DynamicCache``. The structure, the state mapping, plan's inventory (the mixer's
gated norm only where the config keeps it) and simulate's trace (both mixers priced) are held to the
model transformers builds; a meta-built model gets its mixers' ``mup_vector`` from FalconH1Model's init.
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest
import torch
from fixtures.modules import import_path
from transformers import CONFIG_MAPPING, AutoConfig, DynamicCache

from kimi_adapter_core import upstream
from kimi_adapter_core.backends import extraction
from kimi_adapter_core.backends.simulation.model.census import census
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.model.rank_model import RankModel
from kimi_adapter_core.families.tiny import SCALES
from kimi_adapter_core.families.trial import buildable_config, module_paths, write_spec
from kimi_adapter_core.generate import render_spec
from kimi_adapter_core.loading import model_class
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.structure.derive import derive_structure

KINDS = ("hybrid", "hybrid")
# the conv window: x (4 heads x 16) and B and C (2 groups x 16 each); the state: heads x head x state size
CONV, RECURRENT = (128, 4), (4, 16, 16)
BATCH, PROMPT, CAPACITY, STEPS = 2, 20, 32, 4  # the prompt crosses the scan's 16-token chunk
TOLERANCE = 1e-4
Tiny = tuple[dict, torch.nn.Module]  # the family matrix's tiny config and the model built from it


@pytest.fixture(scope="module")
def tiny() -> Tiny:
    found = buildable_config("falcon_h1")
    assert not isinstance(found, str)
    return found


@pytest.fixture(scope="module")
def spec(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Spec:
    config, built = tiny
    folder = tmp_path_factory.mktemp("falcon_h1_spec")
    return load_spec(write_spec(folder, "falcon_h1", config, module_paths(built)))


@pytest.fixture(scope="module")
def module(spec: Spec, tmp_path_factory: pytest.TempPathFactory) -> types.ModuleType:
    files, _ = render_spec(spec, ["extraction"])
    text = {str(item.path): item.text for item in files}["adapters/falcon_h1/extraction.py"]
    path = tmp_path_factory.mktemp("falcon_h1_module") / "extraction.py"
    path.write_text(text)
    return import_path(path, "generated_falcon_h1_extraction")


def test_the_raw_json_reads_every_layer_as_hybrid_with_its_multipliers(tiny: Tiny) -> None:
    """config.json holds no layer list (FalconH1Config.layers_block_type is a property): every layer is
    ``hybrid`` by ``uniform_layer_types``, attending and keeping the mixer's states; the embedding and
    head multipliers are the math outside the layers; the mixer has no gated norm (mamba_rms_norm off)."""
    config, _ = tiny
    assert "layer_types" not in config and "layers_block_type" not in config
    s = derive_structure(config)
    assert s.layer_kinds == KINDS
    assert s.attention_layer_ids == s.linear_layer_ids == s.hybrid_layer_ids == (0, 1)
    assert s.linear is not None and s.linear.kind == "mamba2" and not s.linear.gated_norm
    assert s.outside_ops("embeddings") == (("mul", SCALES["falcon_h1"]["embedding_multiplier"]),)
    assert s.outside_ops("logits") == (("mul", SCALES["falcon_h1"]["lm_head_multiplier"]),)
    assert s.linear.conv_state.shape() == CONV


def test_the_module_bakes_in_each_layers_kind_and_names_four_states(module: types.ModuleType) -> None:
    assert module.LAYER_KINDS == KINDS
    assert module.layer_kinds(module.SOURCE_CONFIG) == KINDS  # no layer list: the class's rule
    assert module.layer_kinds(module.text_config(module.load_config())) == KINDS
    assert module.LINEAR_STATES == ((CONV, "float32"), (RECURRENT, "float32"))
    prefill, decode = module.graph_names("prefill", 2), module.graph_names("decode", 2)
    assert prefill[1][:5] == ["logits", "k.0", "v.0", "c.0", "r.0"]
    assert decode[0][4:8] == ["pk.0", "pv.0", "pc.0", "pr.0"] and decode[1] == prefill[1]


def reference_states(cache: DynamicCache) -> list[torch.Tensor]:
    """transformers' cache in the ABI's order: per layer its keys, values, conv window, recurrent state."""
    flat = []
    for index, layer in enumerate(cache.layers):
        flat += [layer.keys.clone(), layer.values.clone()]
        flat += [cache.get_conv_state(index).clone(), cache.get_recurrent_state(index).clone()]
    return flat


def assert_states_equal(ours: list[torch.Tensor], theirs: list[torch.Tensor], written: int) -> None:
    assert len(ours) == len(theirs) == 4 * len(KINDS)
    for index, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        if index % 4 < 2:  # the attention cache: the slots written so far
            mine = mine[:, :, :written]
        assert mine.shape == reference.shape, index
        assert (mine - reference).abs().max() <= TOLERANCE * max(1.0, reference.abs().max()), index


@pytest.mark.compat
def test_prefill_and_decode_carry_kv_and_mixer_states_as_transformers_does(module: types.ModuleType) -> None:
    """Prefill and STEPS decode steps, batch 2: logits, and each layer's keys, values, conv window and
    recurrent state equal transformers' with its own DynamicCache (a multiplier dropped anywhere, or the
    mixer's states mixed with the attention's, would part them)."""
    torch.manual_seed(0)
    model = module.build_model(device="cpu", dtype=None)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "A_log" not in name:  # keep the scan's decay stable
                parameter.normal_(std=0.2 if parameter.dim() > 1 else 0.5)
    config = module.text_config(model.config)
    assert config.lm_head_multiplier != 1 and config.ssm_multipliers != [1.0] * 5
    prefill, decode = module.prefill_wrapper(model), module.decode_wrapper(model)
    prompt = torch.randint(3, config.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    keyword = module.cache_keyword(model.model.layers[0])
    _, mask, positions = module.prefill_example_inputs("cpu", batch=BATCH, prefill_len=PROMPT, dtype=None)
    with torch.no_grad():
        reference = model(prompt, **{keyword: cache}, use_cache=True).logits
        logits, *present = prefill(prompt, mask, positions)
    assert (logits - reference).abs().max() <= TOLERANCE * reference.abs().max()
    assert_states_equal(present, reference_states(cache), PROMPT)
    states = module.place_prefill_kv(present, CAPACITY, KINDS)
    token = logits[:, -1:].argmax(-1)
    for step in range(STEPS):
        position = PROMPT + step
        positions = torch.full((BATCH, 1), position)
        mask = module.additive_causal_mask(positions, CAPACITY, torch.float32)
        before = states[3]
        with torch.no_grad():
            reference = model(token, **{keyword: cache}, position_ids=positions, use_cache=True).logits
            logits, *states = decode(token, mask, positions, positions.view(-1), *states)
        assert (logits - reference).abs().max() <= TOLERANCE * reference.abs().max(), step
        assert_states_equal(states, reference_states(cache), position + 1)
        assert not torch.equal(states[3], before)
        token = logits[:, -1:].argmax(-1)


def test_the_state_mapping_lists_kv_then_mixer_states_per_layer(module: types.ModuleType) -> None:
    config = module.text_config(module.load_config())
    mapping = module.kv_mapping(config, batch=BATCH, prefill_len=PROMPT, max_cache_len=CAPACITY)
    first = mapping["layers"][0]
    assert first["kind"] == "hybrid"
    assert first["decode_key_input"]["shape"] == [BATCH, 2, CAPACITY, 16]
    assert first["decode_conv_input"] == {"name": "pc.0", "shape": [BATCH, *CONV], "dtype": "float32"}
    recurrent = {"name": "r.0", "shape": [BATCH, *RECURRENT], "dtype": "float32"}
    assert first["prefill_recurrent_output"] == recurrent
    contract = mapping["contract"]
    assert "hybrid_layers" in contract and {"conv", "recurrent"} <= contract["linear_states"].keys()
    assert contract["padding"]["supported"] == "none"


def test_a_meta_model_gets_its_mixers_mup_vector_from_the_models_init(tiny: Tiny) -> None:
    """The buffer is not persistent and FalconH1Model's ``_init_weights`` (not the mixer's) writes it:
    rebuilt on CPU through a copy of the model holding the mixer, equal to the model built on CPU."""
    config, _ = tiny
    built = AutoConfig.for_model(**config)
    with torch.device("meta"):
        meta = model_class(built)._from_config(built)
    cpu = model_class(built)._from_config(built)
    rebuilt = upstream.rebuild_buffer(meta, "model.layers.1.mamba.mup_vector")
    assert rebuilt is not None and torch.equal(rebuilt, cpu.model.layers[1].mamba.mup_vector)
    assert not torch.equal(rebuilt, torch.ones_like(rebuilt))  # the ssm multipliers are in it


@pytest.mark.compat
def test_a_bf16_paged_batch_verifies_and_its_graphs_cast_the_mup_vector_back(
    spec: Spec, tmp_path: Path
) -> None:
    """kadapt's own export and verify of the tiny model, batch 2 on a paged cache, in bfloat16: rows
    join a running batch (never padded: each prefill takes its own prompt whole) and every state is
    transformers'. torch_ir's reader restores a JSON constant of bfloat16 as float32, which would
    promote the mixer's projections: the graph holds the bf16 ``mup_vector`` as float32 and casts it."""
    text = spec.path.read_text().replace(
        "  batch: 1\n", "  batch: 2\n  kv_cache: {kind: paged, block_size: 8}\n"
    )
    path = tmp_path / "falcon_h1.yaml"
    path.write_text(text)
    (tmp_path / "falcon_h1").symlink_to(spec.path.parent / "falcon_h1")
    paged = load_spec(path)
    options = extraction.options_from_spec(paged, output_dir=tmp_path / "out")
    options = dataclasses.replace(options, verify_dtypes=("bfloat16",))
    report = extraction.verify(paged, options, echo=lambda line: None, keep_in=tmp_path / "out")
    assert report.passed, [c for c in report.checks if not c.passed]
    names = {check.name for check in report.checks}
    assert {"joining rows (bfloat16)", "returned states (bfloat16)"} <= names
    ir = json.loads((tmp_path / "out" / "falcon_h1_prefill_ir.json").read_text())
    constants = {name: c["dtype"] for name, c in ir["constants"].items() if "mup_vector" in name}
    assert constants and set(constants.values()) == {"float32"}
    casts = [n for n in ir["nodes"] if n["op_type"] == "aten._to_copy.default" and "mup" in str(n["inputs"])]
    assert len(casts) == len(constants)


@pytest.fixture(scope="module")
def full_size(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The guide's spec on transformers' default Falcon-H1 config (full size, built on meta only)."""
    config = {**CONFIG_MAPPING["falcon_h1"]().to_dict(), "model_type": "falcon_h1"}
    config.pop("time_step_limit")  # [0, inf]: JSON has no infinity, the class default stays
    built = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = model_class(built)._from_config(built)
    folder = tmp_path_factory.mktemp("falcon_h1_full")
    return write_spec(folder, "falcon_h1", config, module_paths(model)), config


@pytest.mark.parametrize("rms_norm", [False, True])
def test_plan_counts_both_mixers_and_the_gated_norm_where_the_config_keeps_it(
    full_size: tuple[Path, dict], rms_norm: bool, tmp_path: Path
) -> None:
    path, config = full_size
    config = {**config, "mamba_rms_norm": rms_norm}
    built = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = model_class(built)._from_config(built)
    spec = load_spec(write_spec(tmp_path, "falcon_h1", config, module_paths(model)))
    inputs = model_inputs(spec, None)
    names = {g.name for g in inputs.groups}
    assert {"attn.q_proj", "attn.k_proj", "mamba2.in_proj", "mamba2.out_proj", "dense_mlp"} <= names
    assert ("mamba2.norm" in names) is rms_norm
    found = census(inputs.groups, inputs.naming, model)
    assert found.problems() == [] and found.planned == found.built


def test_simulate_prices_attention_and_the_mixer_in_each_layer(full_size: tuple[Path, dict]) -> None:
    spec = load_spec(full_size[0])
    inputs, dep = model_inputs(spec, None), Deployment(Parallel(1), 8, 1, 1024, True)
    ops = RankModel(spec, inputs, dep).trace(inputs, dep).ops
    scoped = {op.name for op in ops if op.scope == "hybrid_dense"}
    assert {"attention_decode", "selective_state_update", "causal_conv1d_update"} <= scoped
    assert {op.repeat for op in ops if op.name == "selective_state_update"} == {32}  # every layer
