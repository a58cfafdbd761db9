"""What a decoder layer hands the next one, and stacks whose layers share more than hidden states (issue 36).

GLM-5's DSA layers return their top-k beside the hidden states, for a ``shared`` indexer layer after them
that reuses it; the wrappers hand it on as ``GlmMoeDsaModel.forward`` does (``runtime.run_layer``). A
tiny GLM-5 goes through the family matrix's export + verify. HY-V4 keeps ``hc_mult`` residual streams
between its layers (hyper-connections): the wrappers copy the embeddings into them and merge them with the
stack's own head (``runtime.ResidualStreams``). A ``shared`` indexer layer (no indexer keys of its own)
attends over the top-k of the last earlier ``full`` one (``Layer.topk_source``). Refused before any work,
located: a shared layer before any full one, and streams of a family whose connections' weights kadapt
does not know.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from kimi_adapter_core.backends.extraction.runtime import abi as runtime
from kimi_adapter_core.backends.extraction.runtime.abi import additive_causal_mask, carried_inputs, run_layer
from kimi_adapter_core.backends.simulation.model.arch import indexed_layer_ids
from kimi_adapter_core.errors import Refusal
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import ADAPTED, buildable_config, run_trial
from kimi_adapter_core.structure.around_layers import ResidualStreams
from kimi_adapter_core.structure.derive import derive_structure

TINY_GLM = dict(
    hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=4,
    index_head_dim=16, index_topk=3, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    intermediate_size=64, first_k_dense_replace=1, vocab_size=128,
)  # fmt: skip


def test_a_tiny_glm_5_is_adapted_and_verified() -> None:
    row = run_trial("glm_moe_dsa")
    assert (row.outcome, row.code) == (ADAPTED, ""), row.detail
    assert "verify max |diff|" in row.detail


def test_run_layer_hands_the_top_k_on_as_the_models_forward_does() -> None:
    """Layers 1 and 2 reuse layer 0's top-k: run through ``run_layer`` they give transformers' logits,
    and without the hand-over a shared layer has nothing to attend with."""
    config = GlmMoeDsaConfig(**TINY_GLM, indexer_types=["full", "shared", "shared"])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(config).eval()
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(9).unsqueeze(0)
    mask = additive_causal_mask(positions, 9, torch.float32)
    stack = model.model
    assert [carried_inputs(layer) for layer in stack.layers] == [("prev_topk_indices",)] * 3
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        hidden = stack.embed_tokens(ids)
        embeddings = stack.rotary_emb(hidden, positions)
        carried: dict = {}
        for layer in stack.layers:
            hidden, carried = run_layer(
                layer, hidden, carried, attention_mask=mask, position_ids=positions,
                position_embeddings=embeddings,
            )  # fmt: skip
            assert carried["prev_topk_indices"].shape == (1, 9, 3)
        got = model.lm_head(stack.norm(hidden))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="require top-k indices"):
            run_layer(stack.layers[1], hidden, {}, attention_mask=mask, position_embeddings=embeddings)


def test_a_shared_indexer_layer_reuses_the_last_full_ones_top_k() -> None:
    """A ``shared`` indexer layer keeps a KV cache alone (ABI kind ``attention``) and names the layer whose
    top-k it attends over; plan and simulate give it no indexer."""
    config = GlmMoeDsaConfig(**TINY_GLM, indexer_types=["full", "shared", "full"])
    structure = derive_structure(config)
    assert [layer.topk_source for layer in structure.layers] == [None, 0, None]
    assert structure.layer_kinds == ("indexed", "attention", "indexed")
    assert indexed_layer_ids(structure) == (0, 2)
    assert "(1/3 layers reuse an earlier layer's top-k)" in structure.describe()
    assert {"layers": [1, 1], "attention": "indexed", "window": None, "mlp": "moe", "topk_source": 0} in (
        structure.to_dict()["layers"]
    )


@pytest.mark.parametrize(
    ("kinds", "found"),
    [(["shared", "full", "full"], "no earlier full indexer layer"), (["full", "odd", "full"], "'odd'")],
)
def test_an_indexer_layer_kadapt_cannot_place_is_refused_at_the_config(kinds: list[str], found: str) -> None:
    config = GlmMoeDsaConfig(**TINY_GLM, indexer_types=kinds)
    with pytest.raises(Refusal) as refused:
        derive_structure(config)
    assert refused.value.code == "layer-types"
    assert found in refused.value.message


def test_hyper_connections_are_read_from_the_config() -> None:
    config = AutoConfig.for_model(**tiny_config("hy_v4"))
    assert config.hc_mult > 1
    structure = derive_structure(config)
    assert structure.residual_streams == ResidualStreams(count=config.hc_mult, comb=False)
    assert f"{config.hc_mult} residual streams (hyper-connections)" in structure.describe()
    assert structure.to_dict()["residual_streams"] == {"count": config.hc_mult, "comb": False}
    assert "residual_streams" not in derive_structure(GlmMoeDsaConfig(**TINY_GLM)).to_dict()


def test_hyper_connections_of_an_unknown_family_are_refused_at_the_config() -> None:
    """A stream count on a family whose connections' weights kadapt does not know is refused, named."""
    config = GlmMoeDsaConfig(**TINY_GLM)
    config.hc_mult = 2
    with pytest.raises(Refusal) as refused:
        derive_structure(config)
    assert refused.value.code == "outside-layers"
    assert "hc_mult = 2" in refused.value.message
    assert "deepseek_v4, hy_v4" in refused.value.message
    assert "'glm_moe_dsa'" in refused.value.message


@pytest.mark.compat
def test_a_tiny_hy_v4_with_residual_streams_is_adapted_verified_and_planned_exactly() -> None:
    """HY-V4 keeps ``hc_mult`` residual streams between its layers: the wrappers copy the embeddings into
    them and merge them with the stack's ``hc_head`` (``runtime.ResidualStreams``), and its third layer
    attends over the second's top-k; export + verify equal transformers, and plan's inventory
    (connections, head, the attention's output gate, no indexer in the reusing layer) is the model's."""
    config, _ = buildable_config("hy_v4")
    assert config["indexer_types"] == ["full", "full", "shared"]  # the tiny stack keeps a top-k reuser
    row = run_trial("hy_v4")
    assert (row.outcome, row.code) == (ADAPTED, ""), row.detail
    assert "verify max |diff|" in row.detail
    assert row.plan == "exact", row.plan


def test_the_streams_are_what_the_models_forward_keeps() -> None:
    """``ResidualStreams`` over HY-V4's layers gives transformers' logits; with one stream the layers
    refuse to run (they mix hc_mult streams), so a stack without the streams cannot pass for one."""
    config = AutoConfig.for_model(**tiny_config("hy_v4"))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(7).unsqueeze(0)
    mask = additive_causal_mask(positions, 7, torch.float32)
    stack = model.model
    streams = runtime.ResidualStreams.of(stack)
    assert streams is not None and streams.count == config.hc_mult
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        embeds = stack.embed_tokens(ids)
        embeddings = stack.rotary_emb(embeds, positions)
        hidden, carried = streams.expand(embeds), {}
        for layer in stack.layers:
            hidden, carried = run_layer(
                layer, hidden, carried, attention_mask=mask, position_ids=positions,
                position_embeddings=embeddings,
            )  # fmt: skip
        got = model.lm_head(stack.norm(streams(hidden)))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        with pytest.raises(RuntimeError):
            run_layer(stack.layers[0], embeds, {}, attention_mask=mask, position_embeddings=embeddings)
