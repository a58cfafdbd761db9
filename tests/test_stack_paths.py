"""The layer list is a stack part the spec names (issue 37 items 1-3, first slice): GPT-J, CodeGen,
GPT-NeoX and Falcon keep their layers at ``h`` (or take the cache as ``layer_past``, or their attention
under ``attn`` / ``attention`` / ``self_attention``), and a spec says so in YAML only.

Proven on tiny random models of transformers' own classes: ``module_paths.language_layers`` is the
wrappers' layer list (relative to the language model; the usual ``layers`` states nothing, so shipped
generated modules are unchanged), the prefill wrapper (kadapt's and a generated module's) gives each
model's own logits through it, a wrong path is refused at that key by apply's check and by ``validate
--resolve``, GPT-NeoX's layers take the cache as ``layer_past``, Falcon's ``_split_heads`` builtin is
upstream's split without the constant a list index lifts into an exported graph, and what is not
expressible (learned positions the spec does not name, ALiBi other than BLOOM's) is refused naming
exactly that (the positions that are: ``test_stack_positions.py``). The rows themselves
(export, ``--verify`` against unpatched transformers, plan's census) are the family matrix's
(docs/families.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from fixtures.modules import import_path
from transformers import AutoConfig, AutoModelForCausalLM, FalconConfig
from transformers.models.falcon.modeling_falcon import FalconAttention

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction.ir.stack import Backbone, alibi_of, check_parts, check_positions
from kimi_adapter_core.backends.extraction.runtime import abi
from kimi_adapter_core.builtins import registry
from kimi_adapter_core.builtins.falcon import falcon_split_heads_slices
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import Refusal
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import GUIDE_PATCHES, buildable_config, module_paths, write_spec
from kimi_adapter_core.generate import render_spec
from kimi_adapter_core.patching import pins
from kimi_adapter_core.patching.targets import import_module, parse_target, resolve_in
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.spec.model import Pin, StackParts
from kimi_adapter_core.structure.derive import derive_structure


def tiny(model_type: str, **over: Any) -> torch.nn.Module:
    """The family matrix's tiny config of ``model_type`` (``over`` on top), random weights, eager."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**tiny_config(model_type), **over})
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config).eval()


def matrix_spec(folder: Path, model_type: str, **paths: str) -> Spec:
    """The spec the family matrix writes for ``model_type`` (``paths`` over its module paths)."""
    found = buildable_config(model_type)
    assert not isinstance(found, str), found
    config, model = found
    return load_spec(write_spec(folder, model_type, config, {**module_paths(model), **paths}))


@pytest.mark.parametrize(
    ("model_type", "layers", "parts"),
    [
        ("gptj", "transformer.h", {"layers": "h", "embeddings": "wte", "final_norm": "ln_f"}),
        ("falcon", "transformer.h", {"layers": "h", "embeddings": "word_embeddings", "final_norm": "ln_f"}),
        ("gpt_neox", "gpt_neox.layers", {"embeddings": "embed_in", "final_norm": "final_layer_norm"}),
        ("llama", "model.layers", {}),
    ],
)
def test_the_matrix_spec_names_the_layer_list_where_the_stack_keeps_it(
    tmp_path: Path, model_type: str, layers: str, parts: dict[str, str]
) -> None:
    """The default spec builder writes ``language_layers`` (a path a user writes), and the wrappers read
    it relative to the language model; the usual ``layers`` is stated nowhere (generated modules of the
    shipped specs are unchanged)."""
    spec = matrix_spec(tmp_path, model_type)
    assert spec.module_paths["language_layers"] == layers
    stack = spec.stack_parts()
    assert dict(stack.stated) == parts
    assert stack.where("layers") == spec.locate("module_paths.language_layers")
    assert stack.path("layers") == layers.partition(".")[2]


def prefill_departure(model: torch.nn.Module, stack: torch.nn.Module, parts: dict[str, str]) -> float:
    """How far the prefill wrapper over ``parts`` is from the model's own logits (largest difference)."""
    wrapper = abi.PrefillWrapper.from_language_model(
        stack,
        model.lm_head,
        kv_layout="heads",
        cache_keyword=upstream.decoder_protocol(abi.probed_stack(stack, parts)).cache_keyword,
        parts=parts,
    )
    ids = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    _, mask, positions = abi.prefill_inputs(batch=1, prefill_len=7, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        return (wrapper(ids, mask, positions)[0] - model(ids).logits).abs().max().item()


@pytest.mark.parametrize(
    ("model_type", "stack", "parts", "keyword"),
    [
        ("gptj", "transformer", {"layers": "h", "embeddings": "wte", "final_norm": "ln_f"}, "cache"),
        ("codegen", "transformer", {"layers": "h", "embeddings": "wte", "final_norm": "ln_f"}, "cache"),
        ("gpt_neox", "gpt_neox", {"embeddings": "embed_in", "final_norm": "final_layer_norm"}, "layer_past"),
        (
            "falcon",
            "transformer",
            {"layers": "h", "embeddings": "word_embeddings", "final_norm": "ln_f"},
            "layer_past",
        ),
    ],
)
def test_the_wrappers_call_the_layers_at_the_named_path(
    model_type: str, stack: str, parts: dict[str, str], keyword: str
) -> None:
    """The prefill wrapper over the named parts gives the model's own logits (Falcon: its rotary,
    multi-query, parallel-attention layers called through their own forward, with ``alibi=None`` as
    its forward passes it); without the layer path the wrappers find no ``layers``."""
    model = tiny(model_type)
    language_model = model.get_submodule(stack)
    assert upstream.cache_keyword(abi.stack_layers(language_model, parts)[0]) == keyword
    assert prefill_departure(model, language_model, parts) <= 1e-5
    if "layers" in parts:
        with pytest.raises(AttributeError, match="layers"):
            abi.stack_layers(language_model, {k: v for k, v in parts.items() if k != "layers"})


def test_a_wrong_layer_path_is_refused_at_its_key_with_the_stacks_children(tmp_path: Path) -> None:
    """GPT-J's spec written the Llama way (``transformer.layers``): apply's check and ``validate
    --resolve`` point at ``module_paths.language_layers`` and list the children the stack does have."""
    spec = matrix_spec(tmp_path, "gptj", language_layers="transformer.layers")
    model = tiny("gptj")
    with pytest.raises(Refusal) as refused:
        check_parts(Backbone(model, model.transformer, model.lm_head, spec.stack_parts()))
    assert refused.value.code == "stack-layout"
    assert refused.value.location == spec.locate("module_paths.language_layers")
    message = refused.value.message
    assert "GPTJModel has no layers (module_paths.language_layers" in message
    assert "its children: wte, drop, h, ln_f, rotary_emb" in message
    result = CliRunner().invoke(cli, ["validate", "--resolve", str(spec.path)])
    assert result.exit_code == 1, result.output
    assert f"{spec.locate('module_paths.language_layers')}: " in result.output
    assert "'transformer.layers' does not exist in GPTJForCausalLM" in result.output


def test_the_matrix_spec_of_an_adapted_stack_resolves(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["validate", "--resolve", str(matrix_spec(tmp_path, "gpt_neox").path)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("over", "kv_heads"),
    [({}, 1), ({"new_decoder_architecture": True, "num_kv_heads": 2}, 4), ({"multi_query": False}, 4)],
    ids=["multi-query", "new-architecture", "neither"],
)
def test_falcons_split_heads_builtin_is_upstreams_split_by_slices(
    over: dict[str, Any], kv_heads: int
) -> None:
    """Bit for bit upstream's query, key and value in every branch; the structure caches the KV heads
    Falcon's attention does (one for multi-query, every head in the new architecture); exported on
    meta, upstream's list index lifts a constant with no value, the builtin's slices none."""
    raw = {**tiny_config("falcon"), "num_kv_heads": 4, **over}
    config = FalconConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    attention = FalconAttention(config, layer_idx=0)
    fused = torch.randn(2, 3, attention.query_key_value.out_features)
    for ours, theirs in zip(
        falcon_split_heads_slices(attention, fused), attention._split_heads(fused), strict=True
    ):
        assert torch.equal(ours, theirs)
    assert derive_structure(config).attention.num_kv_heads == kv_heads

    class Split(torch.nn.Module):
        def __init__(self, split: Any) -> None:
            super().__init__()
            self.split = split

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return self.split(attention, x)

    def constants(split: Any) -> int:
        program = torch.export.export(Split(split), (fused.to("meta"),), strict=False)
        return len(program.constants)

    assert constants(falcon_split_heads_slices) == 0
    assert constants(FalconAttention._split_heads) == (0 if over.get("multi_query") is False else 2)


def test_falcons_guide_patch_is_pinned_to_the_installed_source() -> None:
    (patch,) = GUIDE_PATCHES["falcon"]
    assert patch["impl"].removeprefix("builtin:") in registry.BUILTINS
    ref = parse_target(patch["target"])
    assert pins.drift(Pin(**patch["pin"]), resolve_in(ref, import_module(ref)).function()) == []


@pytest.mark.parametrize(
    ("model_type", "over", "named"),
    [
        ("gpt2", {}, "learned absolute position embeddings (wpe: Embedding of 256 positions)"),
        ("opt", {}, "learned absolute position embeddings (embed_positions: OPTLearnedPositionalEmbedding"),
        ("falcon", {"alibi": True}, "ALiBi biases to the attention scores (config.alibi) other than through"),
    ],
)
def test_positions_the_wrappers_do_not_hand_the_layers_are_refused_by_name(
    model_type: str, over: dict[str, Any], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Falcon's ALiBi is built (tests/test_falcon_alibi.py); a stack whose config turns ALiBi on with no
    # builder the wrappers know is refused: Falcon's, were FalconModel not one they fold the bias for
    monkeypatch.setattr(abi.AlibiBias, "FOLDING_STACKS", ())
    found = buildable_config(model_type)
    assert not isinstance(found, str), found
    config, _ = found
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**config, **over}))
    paths = module_paths(model)
    stack = model.get_submodule(paths["language_model"])
    parts = {k: paths[k] for k in ("embeddings",) if k in paths}
    with pytest.raises(Refusal) as refused:
        check_positions(Backbone(model, stack, model.lm_head, StackParts(parts)))
    assert refused.value.code == "stack-layout"
    assert named in refused.value.message
    learned = model_type in ("gpt2", "opt")  # a spec that does not name the table: the key to set
    assert ("set module_paths.position_embeddings" in refused.value.message) == learned
    assert ("the ALiBi the prefill/decode wrappers build" in refused.value.message) != learned


def test_a_rotary_falcon_uses_no_alibi() -> None:
    assert alibi_of(tiny("falcon").transformer) is None
    assert abi.AlibiBias.of(tiny("falcon").transformer) is None  # no build_alibi_tensor of its own


@pytest.mark.parametrize(
    ("model_type", "width"),
    [("gptj", 4 * 64), ("codegen", 4 * 64), ("gpt_neox_japanese", 4 * 64), ("falcon", 128), ("mpt", 4 * 64)],
)
def test_the_structure_reads_the_mlp_width_each_family_states(model_type: str, width: int) -> None:
    """GPT-J and CodeGen: a null ``n_inner`` is four times the hidden size; GPT-NeoX-Japanese: the
    hidden size times ``intermediate_multiple_size`` (MPT: ``expansion_ratio``); Falcon:
    ``ffn_hidden_size`` - what the built MLP's up projection is."""
    config = tiny_config(model_type)
    assert derive_structure(config).intermediate_size == width
    model = tiny(model_type)
    names = ("fc_in", "h_to_4h", "ffn.up_proj")
    ups = [m.out_features for n, m in model.named_modules() if n.endswith(names)]
    assert ups and set(ups) == {width}


@pytest.mark.parametrize(
    ("model_type", "parts", "keyword"),
    [
        ("gptj", {"layers": "h", "embeddings": "wte", "final_norm": "ln_f"}, "cache"),
        ("gpt_neox", {"embeddings": "embed_in", "final_norm": "final_layer_norm"}, "layer_past"),
        ("opt", {"final_norm": "final_layer_norm", "position_embeddings": "embed_positions"}, "cache"),
        (
            "bloom",
            {
                "layers": "h",
                "embeddings": "word_embeddings",
                "final_norm": "ln_f",
                "embedding_norm": "word_embeddings_layernorm",
            },
            "layer_past",
        ),
        ("mpt", {"layers": "blocks", "embeddings": "wte", "final_norm": "norm_f"}, "layer_past"),
        (
            "trocr",
            {
                "final_norm": None,
                "position_embeddings": "embed_positions",
                "embedding_norm": "layernorm_embedding",
            },
            "cache",
        ),
    ],
)
def test_a_generated_module_calls_the_layers_its_spec_names(
    tmp_path: Path, model_type: str, parts: dict[str, str], keyword: str
) -> None:
    """A generated extraction module (no kadapt import) carries ``STACK_PART_PATHS`` and probes the
    layers its spec names (GPT-J's at ``h``), with OPT's learned positions, BLOOM's embedding norm and
    ALiBi, MPT's ALiBi under its embedded builtin and TrOCR's missing final norm: its prefill wrapper gives
    the model's own logits."""
    spec = matrix_spec(tmp_path, model_type)
    files, _ = render_spec(spec, ["extraction"])
    text = {str(item.path): item.text for item in files}[f"adapters/{model_type}/extraction.py"]
    (tmp_path / "extraction.py").write_text(text)
    module = import_path(tmp_path / "extraction.py", f"generated_{model_type}_stack_paths")
    assert module.STACK_PART_PATHS == parts
    torch.manual_seed(0)
    model = module.build_model(device="cpu", dtype=None)
    wrapper = module.prefill_wrapper(model)
    assert wrapper.cache_keyword == keyword
    ids = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    _, mask, positions = abi.prefill_inputs(batch=1, prefill_len=7, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        with module.patches_applied():  # MPT's attention builtin, as the module's own usage runs it
            ours = wrapper(ids, mask, positions)[0]
        assert (ours - model(ids).logits).abs().max() <= 1e-5


@pytest.mark.parametrize(
    ("tp", "refused"),
    [
        ("1", "never called transformers' attention interface"),  # FalconAttention computes inline
        ("2", "takes its head width from config hidden_size / num_attention_heads"),
    ],
)
def test_simulate_refuses_falcons_attention_with_a_reason_at_every_tp(
    tmp_path: Path, tp: str, refused: str
) -> None:
    """Falcon's per-rank config cannot be given a head width (a read-only property: the rank's config
    leaves it to the class) and its attention runs inline, not through the interface simulate prices:
    refused at TP 1 for the attention, past it for the head width, never a traceback."""
    spec = matrix_spec(tmp_path, "falcon")
    result = CliRunner().invoke(
        cli, ["simulate", str(spec.path), "--device", "h100", "--tp", tp, "--query-len", "64"]
    )
    assert result.exit_code != 0
    assert refused in result.output
    assert "Traceback" not in result.output and "has no setter" not in result.output
