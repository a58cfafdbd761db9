"""What the model's forward computes around the layers beyond learned positions and ALiBi (issue 37, the
rest): Beam's query scale of its NoPE layers (``runtime.AttentionScaling``), position embeddings a module
or a buffer computes from the positions (XGLM's sinusoidal ``embed_positions``, CTRL's ``pos_encoding``),
a token table inside an embeddings module (GIT), a layer that names its hidden states otherwise (CTRL's
``x``); and the stacks no spec field describes, refused naming their operation (OpenAI-GPT's cacheless
attention, CPM-Ant's relative bias, ModernBERT-decoder's prediction head).

Proven on tiny random models of transformers' own classes against unpatched transformers: a ragged batch
prefilled by the wrappers and decoded for several steps, each row at its own position, gives every row
the logits ``generate`` gives that row alone. The rows themselves (export, ``--verify`` ragged and
paged) are the family matrix's.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.ragged import ragged_greedy
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, MoshiConfig
from transformers.models.beam.modeling_beam import compute_attention_scaling

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction.equivalence.reference import reference_run
from kimi_adapter_core.backends.extraction.ir.stack import Backbone, check_positions, check_stack
from kimi_adapter_core.backends.extraction.job.whole_model import _head_transforms
from kimi_adapter_core.backends.extraction.runtime import abi
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.errors import Refusal
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import buildable_config, module_paths, write_spec
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.spec.loader import check_spec
from kimi_adapter_core.spec.model import StackParts
from kimi_adapter_core.structure.derive import derive_structure

CAPACITY = 32  # the static cache's positions
STEPS = 4  # decode steps after the prefill


def tiny(model_type: str, **over: Any) -> torch.nn.Module:
    """The family matrix's tiny config of ``model_type`` (``over`` on top), random weights, eager."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**tiny_config(model_type), **over})
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config).eval()


def matrix_spec(folder: Path, model_type: str) -> Path:
    """The spec the family matrix writes for ``model_type``."""
    found = buildable_config(model_type)
    assert not isinstance(found, str), found
    config, model = found
    return write_spec(folder, model_type, config, module_paths(model))


def _wrappers(spec: Spec, model: torch.nn.Module) -> tuple[abi.PrefillWrapper, abi.DecodeWrapper]:
    paths, parts = spec.module_paths, spec.stack_parts()
    stack = model.get_submodule(paths["language_model"])
    keyword = upstream.cache_keyword(abi.stack_layers(stack, parts.stated)[0])
    structure = derive_structure(stack.config, spec)
    built = {
        "kv_layout": "heads",
        "cache_keyword": keyword,
        "parts": parts.stated,
        "windows": structure.windows,
        "embedding_ops": structure.outside_ops("embeddings"),
        "rope_layer_types": upstream.rope_layer_types(stack),
    }
    head = model.get_submodule(paths["lm_head"])
    return (
        abi.PrefillWrapper.from_language_model(stack, head, **built),
        abi.DecodeWrapper.from_language_model(stack, head, **built),
    )


def _ragged(prefill: Any, decode: Any, model: torch.nn.Module) -> tuple[list[torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, model.config.get_text_config().vocab_size, (3, 9), generator=generator)
    return ragged_greedy(prefill, decode, prompt, torch.tensor([9, 6, 3]), CAPACITY, STEPS), prompt


@pytest.mark.compat
@pytest.mark.parametrize("model_type", ["beam", "xglm", "ctrl", "git"])
def test_ragged_rows_decode_as_transformers_generates_each_row(tmp_path: Path, model_type: str) -> None:
    """Beam (its full-attention layers NoPE, handed the query scale of each row's positions), XGLM
    (sinusoidal positions from its module), CTRL (sqrt(n_embd) embedding scale, positions from its
    buffer, layers taking ``x``) and GIT (word and position tables and their norm inside its embeddings
    module, post-norm BERT layers, its attention one level down): rows of 9, 6 and 3 tokens
    right-padded into one prefill, then ``STEPS`` greedy decode steps over the static cache, each row
    at its own position: every row's logits at every step are those of unpatched transformers'
    ``generate`` on that row alone."""
    spec = load_spec(matrix_spec(tmp_path, model_type))
    model = tiny(model_type)
    prefill, decode = _wrappers(spec, model)
    steps, prompt = _ragged(prefill, decode, model)
    for row, length in enumerate([9, 6, 3]):
        _, _, expected = reference_run(model, prompt[row : row + 1, :length], STEPS)
        for ours, theirs in zip(steps, expected, strict=True):
            assert (ours[row] - theirs[0]).abs().max() <= 1e-4, (model_type, row)


@pytest.mark.compat
def test_beams_nope_layers_take_the_query_scale_and_no_rope(tmp_path: Path) -> None:
    """Beam's full-attention layers have no rope (``rope_parameters`` None for their type): they get no
    position embeddings and the scale of their own positions (far from 1 only thousands of positions
    in, so the ragged test above cannot tell it apart); its sliding layers their rope and no scale."""
    spec = load_spec(matrix_spec(tmp_path, "beam"))
    model = tiny("beam")
    types = model.config.layer_types
    assert "full_attention" in types and "sliding_attention" in types
    assert upstream.rope_layer_types(model.model) == tuple(
        None if t == "full_attention" else t for t in types
    )
    prefill, _ = _wrappers(spec, model)
    seen: dict[int, tuple[Any, Any]] = {}

    def record(index: int) -> Any:
        def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            seen[index] = (kwargs.get("attention_scaling"), kwargs.get("position_embeddings"))

        return hook

    hooks = [
        layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(prefill.layers)
    ]
    positions = torch.tensor([[4000, 4001, 4002]])
    _, mask, _ = abi.prefill_inputs(batch=1, prefill_len=3, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        prefill(torch.tensor([[3, 4, 5]]), mask, positions)
    for hook in hooks:
        hook.remove()
    want = compute_attention_scaling(positions)
    assert want.min() > 1.07  # the scale the NoPE layers' queries take this far in
    for index, kind in enumerate(types[: len(prefill.layers)]):
        scaling, rope = seen[index]
        if kind == "full_attention":
            assert rope is None and torch.equal(scaling, want), index
        else:
            assert rope is not None and scaling is None, index


def test_the_matrix_spec_names_nested_and_computed_parts(tmp_path: Path) -> None:
    """The default spec builder writes the fields a user writes: GIT's tables and norm by their path
    inside its embeddings module and its attention one level down (not its vision tower's layers),
    ModernBERT-decoder's table and norm, XGLM's sinusoidal module and CTRL's position buffer; plain
    ``validate`` reads them."""
    expected = {
        "git": {
            "layers": "encoder.layer",
            "embeddings": "embeddings.word_embeddings",
            "position_embeddings": "embeddings.position_embeddings",
            "embedding_norm": "embeddings.LayerNorm",
            "final_norm": None,
            "layer_attention": "attention.self",
        },
        "modernbert-decoder": {
            "embeddings": "embeddings.tok_embeddings",
            "embedding_norm": "embeddings.norm",
            "final_norm": "final_norm",
        },
        "xglm": {"final_norm": "layer_norm", "position_embeddings": "embed_positions"},
        "ctrl": {
            "layers": "h",
            "embeddings": "w",
            "final_norm": "layernorm",
            "position_embeddings": "pos_encoding",
            "layer_attention": "multi_head_attention",
        },
    }
    for model_type, parts in expected.items():
        path = matrix_spec(tmp_path / model_type, model_type)
        assert not check_spec(path).diagnostics, model_type
        assert dict(load_spec(path).stack_parts().stated) == parts, model_type


def test_plan_counts_no_table_for_positions_that_are_no_parameters(tmp_path: Path) -> None:
    """XGLM's sinusoidal table and CTRL's ``pos_encoding`` are non-persistent buffers: plan sizes no
    position parameters for them, where GPT-2's learned table is one (``test_stack_positions``)."""
    for model_type in ("xglm", "ctrl"):
        spec = load_spec(matrix_spec(tmp_path / model_type, model_type))
        names = [name for g in model_inputs(spec, None).groups for name, _ in g.tensors()]
        assert not any("embed_positions" in n or "pos_encoding" in n for n in names), model_type
        params = {n for n, _ in tiny(model_type).named_parameters()}
        assert not any("embed_positions" in n or "pos_encoding" in n for n in params), model_type


def test_a_position_bias_is_refused_naming_what_its_forward_takes() -> None:
    """CPM-Ant's ``position_bias`` is a relative bias of query and key positions and segments: neither
    a table nor a module of the positions alone."""
    model = tiny("cpmant")
    parts = StackParts(
        {"embeddings": "input_embedding", "position_embeddings": "position_bias"},
        {"position_embeddings": "spec:9:1"},
    )
    with pytest.raises(Refusal) as refused:
        check_positions(Backbone(model, model.cpmant, model.lm_head, parts))
    assert refused.value.code == "stack-layout"
    assert "CpmAntSegmentPositionEmbedding whose forward takes (key_pos, query_pos" in refused.value.message
    assert refused.value.location == "spec:9:1"


def test_a_layer_that_keeps_no_cache_is_refused_naming_it() -> None:
    """OpenAI-GPT's blocks take no cache: its attention keeps no keys and values between calls."""
    model = tiny("openai-gpt")
    parts = StackParts(
        {
            "layers": "h",
            "embeddings": "tokens_embed",
            "position_embeddings": "positions_embed",
            "final_norm": None,
        },
        {},
    )
    with pytest.raises(Refusal) as refused:
        check_stack(Backbone(model, model.transformer, model.lm_head, parts))
    assert refused.value.code == "stack-layout"
    assert (
        "Block.forward (layer 0) takes no cache (x, attention_mask, output_attentions)"
        in refused.value.message
    )


def test_moshis_prefill_and_decode_attend_over_different_spans() -> None:
    """What moshi's refusal claims: the cache its forward builds from a config with a sliding window
    keeps a window per layer, while its forward's mask is the causal one (no window)."""
    config = MoshiConfig(sliding_window=8, num_hidden_layers=2)
    assert {type(layer).__name__ for layer in DynamicCache(config=config).layers} == {
        "DynamicSlidingWindowLayer"
    }
    model = tiny("moshi")
    layer = model.model.layers[0].self_attn
    source = inspect.getsource(type(model.model).forward) + inspect.getsource(type(layer).forward)
    assert "create_causal_mask" in source and "sliding" not in source


def test_a_module_between_the_final_norm_and_the_lm_head_is_named(tmp_path: Path) -> None:
    """ModernBERT-decoder's logits are ``decoder(lm_head(hidden))``: the whole-model check names the
    prediction head its forward calls before the LM head."""
    spec = load_spec(matrix_spec(tmp_path, "modernbert-decoder"))
    assert spec.module_paths["lm_head"] == "decoder"
    assert _head_transforms(tiny("modernbert-decoder"), spec) == ["lm_head (ModernBertDecoderPredictionHead)"]
