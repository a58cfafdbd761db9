"""``kadapt generate`` for LFM2's gated short convolutions (issue 36): ``short_conv`` layers, a conv window
alone per request and no recurrent state.

The family matrix's LFM2 spec (a short convolution, then attention) is rendered in a temp directory. The
generated extraction module, imported by path, bakes in each layer's kind and the window's shape and
reads both from a config built with overrides; on a tiny random model its wrappers' logits, the window
and the attention layer's keys and values over a prefill and several decode steps equal transformers'
own ``DynamicCache``. Its state mapping carries the window alone, its saved graphs (outside the
checkout, through torch_ir) name it as the mapping does, and the docs page sizes it per request.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import roundtrip
import torch
from fixtures.modules import import_path
from transformers import DynamicCache

from kimi_adapter_core.families.trial import buildable_config, module_paths, write_spec
from kimi_adapter_core.generate import render_spec
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.structure.of_spec import structure_of_raw

KINDS = ("short_conv", "attention")
WINDOW = (64, 3)  # the hidden channels, conv_L_cache
BATCH, PROMPT, CAPACITY, STEPS = 2, 9, 24, 4
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> Spec:
    found = buildable_config("lfm2")
    assert not isinstance(found, str)
    config, built = found
    return load_spec(write_spec(tmp_path_factory.mktemp("lfm2_spec"), "lfm2", config, module_paths(built)))


def rendered(spec: Spec, target: str) -> dict[str, str]:
    files, _ = render_spec(spec, [target])
    return {str(item.path): item.text for item in files}


@pytest.fixture(scope="module")
def module_text(spec: Spec) -> str:
    return rendered(spec, "extraction")["adapters/lfm2/extraction.py"]


@pytest.fixture(scope="module")
def module(module_text: str, tmp_path_factory: pytest.TempPathFactory) -> types.ModuleType:
    path = tmp_path_factory.mktemp("lfm2_module") / "extraction.py"
    path.write_text(module_text)
    return import_path(path, "generated_lfm2_extraction")


def test_the_module_bakes_in_each_layers_kind_and_the_window(module: types.ModuleType, spec: Spec) -> None:
    found = structure_of_raw(spec, dict(module.SOURCE_CONFIG))
    assert module.LAYER_KINDS == found.layer_kinds == KINDS
    assert module.LINEAR_STATES == ((WINDOW, "float32"),) == ((found.linear.conv_state.shape(), "float32"),)
    assert module.layer_kinds(module.SOURCE_CONFIG) == KINDS
    assert module.linear_states(module.SOURCE_CONFIG) == module.LINEAR_STATES
    overrides = {"hidden_size": 32, "conv_L_cache": 4, "layer_types": ["conv", "conv", "full_attention"]}
    config = module.text_config(module.load_config(overrides={**overrides, "num_hidden_layers": 3}))
    assert module.layer_kinds(config) == ("short_conv", "short_conv", "attention")
    assert module.linear_states(config, "bfloat16") == (((32, 4), "bfloat16"),)
    prefill, decode = module.graph_names("prefill", 2), module.graph_names("decode", 2)
    assert prefill[1] == ["logits", "c.0", "k.1", "v.1"]
    assert decode[0][4:] == ["pc.0", "pk.1", "pv.1"] and decode[1] == prefill[1]


def reference_states(cache: DynamicCache) -> list[torch.Tensor]:
    """transformers' cache in the ABI's order: the conv layer's window, the attention layer's KV."""
    assert cache.get_recurrent_state(0) is None  # no other state
    return [cache.get_conv_state(0).clone(), cache.layers[1].keys.clone(), cache.layers[1].values.clone()]


def assert_states_equal(ours: list[torch.Tensor], theirs: list[torch.Tensor], written: int) -> None:
    assert len(ours) == len(theirs) == 3
    for index, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        if mine.dim() == 4:  # the attention cache: the slots written so far
            mine = mine[:, :, :written]
        assert mine.shape == reference.shape, index
        assert (mine - reference).abs().max() <= TOLERANCE, index


@pytest.mark.compat
def test_prefill_and_decode_carry_the_window_as_transformers_does(module: types.ModuleType) -> None:
    """Prefill and STEPS decode steps, batch 2: logits, the window and the KV equal transformers' with
    its own DynamicCache; every step moves the window; the decode example inputs have the shapes and
    dtypes the wrappers return."""
    torch.manual_seed(0)
    model = module.build_model(device="cpu", dtype=None)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.3 if parameter.dim() > 1 else 0.5)
    config = module.text_config(model.config)
    prefill, decode = module.prefill_wrapper(model), module.decode_wrapper(model)
    prompt = torch.randint(3, config.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    keyword = module.cache_keyword(model.model.layers[0])
    _, mask, positions = module.prefill_example_inputs("cpu", batch=BATCH, prefill_len=PROMPT, dtype=None)
    with torch.no_grad():
        reference = model(prompt, **{keyword: cache}, use_cache=True).logits
        logits, *present = prefill(prompt, mask, positions)
    assert (logits - reference).abs().max() <= TOLERANCE
    assert present[0].shape == (BATCH, *WINDOW)
    assert_states_equal(present, reference_states(cache), PROMPT)
    example = module.decode_example_inputs(
        config, "cpu", batch=BATCH, position=PROMPT, max_cache_len=CAPACITY, dtype=None
    )
    states = module.place_prefill_kv(present, CAPACITY, KINDS)
    assert [(t.shape, t.dtype) for t in example[4:]] == [(t.shape, t.dtype) for t in states]
    token = logits[:, -1:].argmax(-1)
    for step in range(STEPS):
        position = PROMPT + step
        positions = torch.full((BATCH, 1), position)
        mask = module.additive_causal_mask(positions, CAPACITY, torch.float32)
        before = states[0]
        with torch.no_grad():
            reference = model(token, **{keyword: cache}, use_cache=True).logits
            logits, *states = decode(token, mask, positions, positions.view(-1), *states)
        assert (logits - reference).abs().max() <= TOLERANCE, step
        assert_states_equal(states, reference_states(cache), position + 1)
        assert not torch.equal(states[0], before)
        token = logits[:, -1:].argmax(-1)


def test_the_state_mapping_carries_the_window_alone(module: types.ModuleType) -> None:
    config = module.text_config(module.load_config())
    mapping = module.kv_mapping(config, batch=BATCH, prefill_len=PROMPT, max_cache_len=CAPACITY)
    conv, attention = mapping["layers"]
    assert conv == {
        "layer": 0,
        "kind": "short_conv",
        "prefill_conv_output": {"name": "c.0", "shape": [BATCH, *WINDOW], "dtype": "float32"},
        "decode_conv_input": {"name": "pc.0", "shape": [BATCH, *WINDOW], "dtype": "float32"},
        "decode_conv_output": {"name": "c.0", "shape": [BATCH, *WINDOW], "dtype": "float32"},
    }
    assert attention["kind"] == "attention" and attention["decode_key_input"]["shape"] == [
        BATCH,
        2,
        CAPACITY,
        16,
    ]
    states = mapping["contract"]["linear_states"]
    assert "recurrent" not in states and "no recurrent state" in states["conv"]["holds"]
    assert mapping["contract"]["padding"]["supported"] == "none"


@pytest.fixture(scope="module")
def vendored(spec: Spec, module_text: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The module vendored outside the checkout and run by the user's script of ``roundtrip.py`` (no
    kadapt importable), float32 and bfloat16."""
    tmp = tmp_path_factory.mktemp("vendored_short_conv")
    path = tmp / "lfm2_extraction.py"
    path.write_text(module_text)
    return roundtrip.run_user_script({"lfm2": roundtrip.user_job("lfm2", spec, path, tmp)}, tmp)


@pytest.mark.slow  # torch_ir extracts and replays both graphs in two dtypes
@pytest.mark.compat
@pytest.mark.parametrize("dtype", roundtrip.DTYPES)
def test_the_vendored_module_round_trips_through_torch_ir(vendored: dict[str, Any], dtype: str) -> None:
    """The saved graphs name the window as the mapping does (``save_ir`` tells a conv layer's one state
    from an attention layer's two) and generate like transformers."""
    assert vendored["kadapt_importable"] is False and vendored["kadapt_modules"] == []
    result = vendored["results"][f"lfm2/{dtype}"]
    prefill, decode = result["graphs"]["prefill"], result["graphs"]["decode"]
    assert prefill["outputs"] == prefill["abi"][1] == ["logits", "c.0", "k.1", "v.1"]
    assert decode["inputs"] == decode["abi"][0] and decode["inputs"][4:] == ["pc.0", "pk.1", "pv.1"]
    assert decode["metadata"]["num_layers"] == result["mapping"]["num_layers"] == 2
    references = result["references"]
    key = "eager" if dtype == "float32" else "as built"
    assert result["tokens"] == references[key]["tokens"]
    assert references[key]["max_diff"] <= (roundtrip.FP32_TOLERANCE if dtype == "float32" else 0.0)


def test_the_docs_size_the_window_per_request(spec: Spec) -> None:
    page = rendered(spec, "docs")["docs/specs/lfm2.md"]
    assert "a linear-attention layer (1 of them) its conv window in their place" in page
    assert "| output | short_conv | `c.{layer}` | `[1, 64, 3]` | float32 |" in page
    cells = [
        "the other 1",
        "linear",
        "conv",
        "`c.{layer}`",
        "`pc.{layer}`",
        "`c.{layer}`",
        "[64, 3] per request",
    ]
    assert f"| {' | '.join(cells)} | float32 | 768 B per request |" in page
    assert "recurrent" not in page.split("## State mapping")[1]
    assert 'DW["Decode wrapper<br/>static heads KV cache of 64<br/>conv windows per row"]' in page
