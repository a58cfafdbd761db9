"""The generated extraction module, used the way other tools use it: imported by path, no kadapt.

A tiny config of Kimi-K2.5's architecture (config overrides) goes through the generated
``build_model``; its wrappers are handed to ``torch_ir.extract_ir`` and ``torch.export.export`` and
compared with what kadapt's own extraction backend produces for the same spec and overrides: the
same graph input/output names, shapes and dtypes, and equal outputs on the same random weights.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch_ir
from fixtures.modules import import_path

from kimi_adapter_core.backends.extraction import options_from_spec, run, runtime
from kimi_adapter_core.backends.extraction.weights import cast_to_abi_dtype, keep_fp32_names
from kimi_adapter_core.generate import render_spec, write_all
from kimi_adapter_core.loading import applied, load_config, load_model
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
SPEC = load_spec(REPO / "specs" / "kimi_k25.yaml")
PREFILL, CACHE = 8, 16
TINY: dict[str, Any] = {
    "text_config.num_hidden_layers": 2,  # first_k_dense_replace 1: one dense and one MoE layer
    "text_config.hidden_size": 64,
    "text_config.intermediate_size": 96,
    "text_config.moe_intermediate_size": 32,
    "text_config.n_routed_experts": 4,
    "text_config.num_experts_per_tok": 2,
    "text_config.num_attention_heads": 4,
    "text_config.num_key_value_heads": 4,
    "text_config.q_lora_rank": 32,
    "text_config.kv_lora_rank": 16,
    "text_config.qk_nope_head_dim": 8,
    "text_config.qk_rope_head_dim": 8,
    "text_config.v_head_dim": 8,
    "text_config.vocab_size": 128,
    "text_config.max_position_embeddings": 4096 * 64,
    "text_config.pad_token_id": 1,
    "text_config.bos_token_id": 2,
    "text_config.eos_token_id": 3,
    "pad_token_id": 1,
    "bos_token_id": 2,
    "eos_token_id": 3,
    "vision_config.vt_hidden_size": 32,
    "vision_config.vt_num_hidden_layers": 1,
    "vision_config.vt_num_attention_heads": 2,
    "vision_config.vt_intermediate_size": 64,
    "vision_config.text_hidden_size": 64,
}


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> types.ModuleType:
    out = tmp_path_factory.mktemp("generated")
    files, _ = render_spec(SPEC, ("extraction",))
    write_all(files, out)
    path = out / "adapters" / "kimi_k25" / "extraction.py"
    module = import_path(path, "generated_kimi_k25_extraction")
    assert "kimi_adapter_core" not in path.read_text().replace("kimi_adapter_core/backends", "")
    return module


def kadapt_model(device: str) -> torch.nn.Module:
    """The model kadapt's backend extracts: applied spec, tiny config, cast like ``run`` casts."""
    with applied(SPEC, backend="extraction"):
        config = load_config(SPEC, backend="extraction", overrides=TINY)
        return load_model(SPEC, device=device, config=config)


def test_build_model_applies_bridges_and_gate(generated: types.ModuleType) -> None:
    model = generated.build_model(device="meta", overrides=TINY)
    text = generated.text_config(model.config)
    assert (text._attn_implementation, text._experts_implementation) == ("eager", "batched_mm")
    assert model.config.n_routed_experts == 4 and model.config.vision_config.hidden_size == 32
    assert model.config.vision_config.spatial_merge_size == 2
    bias = model.get_submodule("model.language_model.layers.1.mlp.gate").e_score_correction_bias
    assert bias.dtype == torch.float32 and model.lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="does not match this adapter"):
        generated.build_model(overrides={"model_type": "llama"})


def test_patches_are_gated_and_restored(generated: types.ModuleType) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    original = DeepseekV3Attention.__dict__["expand_kv"]
    model = generated.build_model(device="meta", overrides=TINY)
    attention = model.get_submodule("model.language_model.layers.0.self_attn")
    with generated.patches_applied():
        assert DeepseekV3Attention.__dict__["expand_kv"] is not original
        assert generated._owns_call((attention,)) and not generated._owns_call((object(),))
    assert DeepseekV3Attention.__dict__["expand_kv"] is original


def read_ir(path: Path) -> tuple[list[tuple], list[tuple]]:
    document = json.loads(path.read_text())

    def rows(entries: list[dict]) -> list[tuple]:
        return [(e["name"], list(e["shape"]), e["dtype"]) for e in entries]

    return rows(document["graph_inputs"]), rows(document["graph_outputs"])


def test_ir_interface_matches_kadapts_backend(generated: types.ModuleType, tmp_path: Path) -> None:
    model = generated.build_model(device="meta", overrides=TINY)
    text = generated.text_config(model.config)
    layers = text.num_hidden_layers
    with generated.patches_applied():
        prefill = torch_ir.extract_ir(
            generated.prefill_wrapper(model),
            generated.prefill_example_inputs(prefill_len=PREFILL),
            strict=False,
        )
        decode = torch_ir.extract_ir(
            generated.decode_wrapper(model),
            generated.decode_example_inputs(text, position=PREFILL, max_cache_len=CACHE),
            strict=False,
        )

    options = options_from_spec(SPEC, output_dir=tmp_path, prefill_len=PREFILL, max_cache_len=CACHE)
    with applied(SPEC, backend="extraction"):
        config = load_config(SPEC, backend="extraction", overrides=TINY)
        run(SPEC, load_model(SPEC, device="meta", config=config), options, echo=lambda _: None)

    for graph, ir in (("prefill", prefill), ("decode", decode)):
        kadapt_inputs, kadapt_outputs = read_ir(options.path(graph))
        names_in, names_out = generated.graph_names(graph, layers)
        ours_in = [(n, list(t.shape), t.dtype) for n, t in zip(names_in, ir.graph_inputs, strict=True)]
        ours_out = [(n, list(t.shape), t.dtype) for n, t in zip(names_out, ir.graph_outputs, strict=True)]
        assert ours_in == kadapt_inputs, graph
        assert ours_out == kadapt_outputs, graph
    kadapt_mapping = json.loads(options.path("kv_mapping").read_text())
    ours = generated.kv_mapping(text, prefill_len=PREFILL, max_cache_len=CACHE)
    assert ours["layers"] == kadapt_mapping["layers"]


def test_outputs_equal_kadapts_on_the_same_weights(generated: types.ModuleType) -> None:
    torch.manual_seed(0)
    reference = kadapt_model("cpu")
    cast_to_abi_dtype(
        [reference.get_submodule("model.language_model"), reference.lm_head],
        torch.bfloat16,
        keep_fp32_names(reference),
    )
    ours = generated.build_model(device="cpu", overrides=TINY)
    ours.load_state_dict(reference.state_dict())
    text = generated.text_config(ours.config)

    ids = torch.randint(4, 128, (1, PREFILL))
    _, mask, positions = generated.prefill_example_inputs("cpu", prefill_len=PREFILL)
    inputs = (ids, mask, positions)
    with torch.no_grad():
        with applied(SPEC, backend="extraction"):
            expected = runtime.PrefillWrapper.from_language_model(
                reference.get_submodule("model.language_model"), reference.lm_head, kv_layout="latent"
            )(*inputs)
        with generated.patches_applied():
            wrapper = generated.prefill_wrapper(ours)
            got = wrapper(*inputs)
            exported = torch.export.export(wrapper, inputs, strict=False).module()(*inputs)
    assert len(got) == 1 + 2 * text.num_hidden_layers
    for a, b, c in zip(expected, got, exported, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(c, b)

    # one decode step over the placed prefill cache, at the position after the prompt
    cache = generated.place_prefill_kv(got[1:], CACHE)
    step = generated.decode_example_inputs(text, "cpu", position=PREFILL, max_cache_len=CACHE)
    decode_inputs = (torch.tensor([[7]]), *step[1:4], *cache)
    with torch.no_grad():
        with applied(SPEC, backend="extraction"):
            expected = runtime.DecodeWrapper.from_language_model(
                reference.get_submodule("model.language_model"), reference.lm_head, kv_layout="latent"
            )(*decode_inputs)
        with generated.patches_applied():
            got = generated.decode_wrapper(ours)(*decode_inputs)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
