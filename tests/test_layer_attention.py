"""Where a decoder layer keeps its attention, and the KV addressing of layers whose attention does not
carry ``layer_idx`` (issue 37, third slice): ``module_paths.layer_attention`` (relative to one layer)
read by the layer probe, the stack check and the wrappers; GPT-Neo's attention, which keeps its index
as ``layer_id`` and its local window in a buffer sliced by the cache's length (``gpt_neo_attn``); and
LongCat-Flash's two attentions per layer, refused naming the cache entry no spec field can add.

Proven on tiny random models of transformers' own classes against unpatched transformers: a ragged
GPT-Neo batch prefilled by the wrappers and decoded past its local window, each row at its own
position, gives every row the logits ``generate`` gives that row alone. The rows themselves (export,
``--verify`` ragged and paged) are the family matrix's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.ragged import ragged_greedy
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction.equivalence.reference import reference_run
from kimi_adapter_core.backends.extraction.ir.stack import Backbone, check_stack
from kimi_adapter_core.backends.extraction.runtime import abi
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.builtins import registry
from kimi_adapter_core.builtins.gpt_neo import gpt_neo_attn
from kimi_adapter_core.errors import Refusal
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import (
    GUIDE_PATCHES,
    _layer_attention,
    buildable_config,
    module_paths,
    write_spec,
)
from kimi_adapter_core.loading import applied
from kimi_adapter_core.patching import pins
from kimi_adapter_core.patching.gate import claim_model
from kimi_adapter_core.patching.targets import import_module, parse_target, resolve_in
from kimi_adapter_core.resolve import resolve_diagnostics
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.spec.loader import check_spec
from kimi_adapter_core.spec.model import Pin, StackParts
from kimi_adapter_core.structure.derive import derive_structure

CAPACITY = 32  # the static cache's positions
STEPS = 6  # decode steps after the prefill: the longest row ends past WINDOW keys, the shortest too
WINDOW = 4  # GPT-Neo's local window in the tiny models here


def tiny(model_type: str, **over: Any) -> nn.Module:
    """The family matrix's tiny config of ``model_type`` (``over`` on top), random weights, eager."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**tiny_config(model_type), **over})
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config).eval()


def matrix_spec(folder: Path, model_type: str, **paths: str) -> Path:
    """The spec the family matrix writes for ``model_type`` (``paths`` over its module paths)."""
    found = buildable_config(model_type)
    assert not isinstance(found, str), found
    config, model = found
    return write_spec(folder, model_type, config, {**module_paths(model), **paths})


def test_validate_reads_the_layer_attention_and_rejects_a_malformed_one(tmp_path: Path) -> None:
    """``module_paths.layer_attention`` is a field a user writes: plain ``validate`` reads it, the stack's
    parts carry it (to the probe and the wrappers), and a path that is no dotted path is a located error."""
    path = matrix_spec(tmp_path, "gpt_neo", layer_attention="attn.attention")
    assert not check_spec(path).diagnostics
    assert load_spec(path).stack_parts().stated["layer_attention"] == "attn.attention"
    bad = matrix_spec(tmp_path / "bad", "gpt_neo", layer_attention="attn/attention")
    found = [(d.breadcrumb, d.message) for d in check_spec(bad).diagnostics]
    assert [b for b, _ in found] == ["module_paths.layer_attention"], found
    assert "relative to one decoder layer" in found[0][1]


def test_resolve_points_at_the_layer_attention_when_no_attention_is_there(tmp_path: Path) -> None:
    """``validate --resolve`` refuses, where apply would, a spec whose ``layer_attention`` finds no
    attention, naming the key; the matrix's spec (the usual names find ``attn``) resolves."""
    wrong = matrix_spec(tmp_path, "gpt_neo", layer_attention="attn.missing")
    found = [d.message for d in resolve_diagnostics(load_spec(wrong), wrong)]
    assert any("no attention at attn.missing" in m and "module_paths.layer_attention" in m for m in found), (
        found
    )
    named = matrix_spec(tmp_path / "named", "gpt_neo", layer_attention="attn.attention")
    assert resolve_diagnostics(load_spec(named), named) == []
    guessed = matrix_spec(tmp_path / "guessed", "gpt_neo")
    assert resolve_diagnostics(load_spec(guessed), guessed) == []


def test_the_attention_is_where_the_spec_says_and_caches_under_layer_id() -> None:
    """GPT-Neo's ``attn.attention`` is the module that calls ``update``, under its ``layer_id``; the probe
    finds the cache keyword and the index through it, and the runtime addresses the layer by it."""
    model = tiny("gpt_neo")
    layers = list(model.transformer.h)
    inner = abi.mixer_of(layers[1], "attention", "attn.attention")
    assert inner is layers[1].attn.attention and abi.index_of(inner) == 1
    assert abi.layer_index(layers[1], "attention", 0, "attn.attention") == 1
    with pytest.raises(ValueError, match="looked for attn.nothing"):
        abi.mixer_of(layers[1], "attention", "attn.nothing")
    protocol = upstream.probe_decoder_layers(layers, None, attention="attn.attention")
    assert protocol.cache_keyword == "layer_past"


def test_the_matrix_spec_names_the_layer_attention_only_where_the_usual_names_find_none() -> None:
    """A layer whose attention sits under another name (here ``block.inner``) gets the key, the first
    submodule that says it is an attention and caches under index 0; GPT-Neo's ``attn`` needs none."""

    class OddAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer_idx = 0

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = OddAttention()

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

    assert _layer_attention(Layer()) == {"layer_attention": "block.inner"}
    assert _layer_attention(tiny("gpt_neo").transformer.h[0]) == {}


def test_a_layer_with_two_attentions_is_refused_naming_its_cache_entries() -> None:
    """LongCat-Flash's layer runs ``self_attn[0]`` and ``self_attn[1]``, caching under ``2 i`` and
    ``2 i + 1``: two KV entries per decoder layer, which the ABI's cache cannot hold."""
    found = buildable_config("longcat_flash")
    assert not isinstance(found, str), found
    _, model = found
    with pytest.raises(Refusal) as refused:
        check_stack(Backbone(model, model.model, model.lm_head, StackParts()))
    assert refused.value.code == "stack-layout"
    assert "runs 2 attentions in turn" in refused.value.message
    assert "caching under indices 0, 1" in refused.value.message


def test_gpt_neos_guide_patch_is_pinned_to_the_installed_source() -> None:
    (patch,) = GUIDE_PATCHES["gpt_neo"]
    assert patch["impl"].removeprefix("builtin:") in registry.BUILTINS
    ref = parse_target(patch["target"])
    assert pins.drift(Pin(**patch["pin"]), resolve_in(ref, import_module(ref)).function()) == []


@pytest.mark.parametrize("layer", [0, 1])  # global, local
def test_gpt_neos_attention_builtin_is_upstreams_on_the_models_own_inputs(layer: int) -> None:
    """Without a mask the builtin is upstream's, bit for bit; with the model's causal mask (what its own
    forward hands the layers) the same scores: the local layer's window counted over the visible keys is
    the buffer's."""
    model = tiny("gpt_neo", window_size=WINDOW)
    attention = model.transformer.h[layer].attn.attention
    generator = torch.Generator().manual_seed(2)
    query, key, value = (torch.randn(2, 4, 9, 16, generator=generator) for _ in range(3))
    causal = torch.zeros(2, 1, 9, 9).masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), -3.4e38)
    with torch.no_grad():
        theirs = attention._attn(query, key, value)[0]
        theirs_masked = attention._attn(query, key, value, causal)[0]
        ours = gpt_neo_attn(attention, query, key, value)[0]
        ours_masked = gpt_neo_attn(attention, query, key, value, causal)[0]
    assert torch.equal(ours, theirs)
    assert (ours_masked - theirs_masked).abs().max() <= 1e-6


def test_gpt_neos_ragged_rows_decode_past_the_local_window_as_transformers_generates(tmp_path: Path) -> None:
    """The matrix spec (its ``architecture.fields`` make the local layers sliding, ``gpt_neo_attn`` patched
    in): rows of 9, 6 and 3 tokens right-padded into one prefill, then ``STEPS`` greedy decode steps over
    the static cache, each row at its own position and past the window: every row's logits at every step
    are those of unpatched transformers' ``generate`` on that row alone."""
    spec = load_spec(matrix_spec(tmp_path, "gpt_neo"))
    model = tiny("gpt_neo", window_size=WINDOW)
    structure = derive_structure(model.config, spec)
    assert structure.windows == (None, WINDOW)
    parts = spec.stack_parts()
    stack = model.transformer
    built = {
        "kv_layout": "heads",
        "cache_keyword": upstream.cache_keyword(stack.h[0]),
        "parts": parts.stated,
        "windows": structure.windows,
    }
    prompt = torch.randint(3, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([9, 6, 3])
    with applied(spec, backend="extraction"):
        claim_model(model, spec.name)
        prefill = abi.PrefillWrapper.from_language_model(stack, model.lm_head, **built)
        decode = abi.DecodeWrapper.from_language_model(stack, model.lm_head, **built)
        steps = ragged_greedy(prefill, decode, prompt, lengths, CAPACITY, STEPS)
    for row, length in enumerate(lengths.tolist()):
        _, _, expected = reference_run(model, prompt[row : row + 1, :length], STEPS)
        for ours, theirs in zip(steps, expected, strict=True):
            assert (ours[row] - theirs[0]).abs().max() <= 1e-4, row


@pytest.mark.parametrize("model_type", ["bloom", "gpt_neo"])
def test_plan_sizes_an_mlp_four_times_the_hidden_size_no_config_key_states(
    tmp_path: Path, model_type: str
) -> None:
    """BLOOM's MLP (``dense_h_to_4h``) and GPT-Neo's with a null ``intermediate_size`` are 4 x hidden wide
    (``config_keys.yaml`` ``implied``): plan sizes each layer's MLP as the model builds it."""
    spec = load_spec(matrix_spec(tmp_path, model_type))
    found = buildable_config(model_type)
    assert not isinstance(found, str)
    _, model = found
    (mlp,) = [g for g in model_inputs(spec, None).groups if g.name == "dense_mlp"]
    built = sum(
        p.numel() for name, p in model.named_parameters() if ".mlp." in name and name.endswith("weight")
    )
    assert mlp.count == built
