"""MiniMax's lightning attention as a ``lightning`` layer (issue 36): a linear mixer whose layers carry
one state, the recurrent ``[heads, head_dim, head_dim]`` in the model dtype, sized from the attention's
own heads; kadapt's static cache answers ``MiniMaxCache``'s ``get_linear_cache``/``set_linear_cache``,
and the prefill and decode wrappers equal transformers' model with its own ``MiniMaxCache`` (logits and
every state), float32 and bfloat16; the family matrix row is adapted (export + verify)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, MiniMaxConfig
from transformers.models.minimax.modeling_minimax import MiniMaxCache

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction.runtime import abi as runtime
from kimi_adapter_core.cli import cli
from kimi_adapter_core.families.trial import buildable_config, module_paths, write_spec
from kimi_adapter_core.structure.derive import derive_structure

ALPHA = 3.5565588200778455  # MiniMax-Text-01's residual factor of every sublayer
LAYER_TYPES = ["linear_attention", "full_attention"]
PROMPT, STEPS, CACHE = 11, 4, 24  # the prompt spans two whole 4-token blocks and a partial one


def _config(**overrides: object) -> MiniMaxConfig:
    sizes = {
        "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4,
        "num_experts_per_tok": 2, "block_size": 4, "layer_types": LAYER_TYPES, "initializer_range": 0.2,
        "full_attn_alpha_factor": ALPHA, "linear_attn_alpha_factor": ALPHA, "mlp_alpha_factor": ALPHA,
        "max_position_embeddings": 64,
    }  # fmt: skip
    config = MiniMaxConfig(**{**sizes, **overrides})
    config._attn_implementation = "eager"
    return config


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config()).to(dtype).eval()


def test_the_config_sizes_one_recurrent_state_in_the_model_dtype_and_is_no_longer_refused() -> None:
    raw = {
        "model_type": "minimax", "num_hidden_layers": 8, "hidden_size": 64, "vocab_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "block_size": 256,
        "num_local_experts": 4, "num_experts_per_tok": 2, "linear_attn_alpha_factor": ALPHA,
        "layer_types": ["linear_attention"] * 7 + ["full_attention"],
    }  # fmt: skip
    found = derive_structure(raw)  # linear_attn_alpha_factor was a "hybrid" refusal
    assert found.layer_kinds == ("lightning",) * 7 + ("attention",)
    linear = found.linear
    assert (linear.kind, linear.state_names, linear.conv) == ("lightning", ("recurrent",), None)
    assert linear.recurrent.shape() == (4, 16, 16)  # head_dim unstated: hidden / heads
    assert linear.recurrent.dtype_in("bfloat16") == "bfloat16"
    assert linear.state_bytes_per_request(2) == 4 * 16 * 16 * 2
    assert "7/8 linear-attention layers (lightning attention 4x16 heads, no conv)" in found.describe()


def test_the_probe_reads_the_lightning_state_and_the_contact_point_holds() -> None:
    upstream.check(("lightning_attention_cache",))
    model = _model(torch.bfloat16)
    protocol = upstream.decoder_protocol(model.model, ["lightning", "attention"])
    assert protocol.linear_states == (((4, 8, 8), "bfloat16"),)
    assert protocol.kv_dims == ((2, 8), (2, 8))


def _wrappers(model: torch.nn.Module) -> tuple[runtime.PrefillWrapper, runtime.DecodeWrapper]:
    common = {
        "kv_layout": "heads",
        "cache_keyword": upstream.cache_keyword(model.model.layers[0]),
        "layer_kinds": ["lightning", "attention"],
    }
    return (
        runtime.PrefillWrapper.from_language_model(model.model, model.lm_head, **common),
        runtime.DecodeWrapper.from_language_model(model.model, model.lm_head, **common),
    )


def _theirs(cache: MiniMaxCache) -> list[torch.Tensor]:
    """What transformers' cache holds, in the ABI's order: layer 0's state, layer 1's key and value."""
    return [cache.get_linear_cache(0), cache.layers[1].keys, cache.layers[1].values]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_and_decode_equal_transformers_with_its_minimax_cache(dtype: torch.dtype) -> None:
    model = _model(dtype)
    prefill, decode = _wrappers(model)
    prompt = torch.randint(3, 96, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = MiniMaxCache()
    _, causal, positions = runtime.prefill_inputs(batch=1, prefill_len=PROMPT, dtype=dtype, device="cpu")
    with torch.no_grad():
        reference = model(input_ids=prompt, position_ids=positions, cache=cache, use_cache=True).logits
        logits, *present = prefill(prompt, causal, positions)
    assert present[0].dtype == dtype and present[0].shape == (1, 4, 8, 8)
    assert torch.equal(logits, reference)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(present, _theirs(cache), strict=True))
    states = runtime.place_prefill_kv(present, CACHE, ["lightning", "attention"])
    for step in range(STEPS):
        token, position = logits[:, -1:].argmax(-1), PROMPT + step
        positions = torch.full((1, 1), position)
        mask = runtime.additive_causal_mask(positions, CACHE, dtype)
        inputs, before = states, [state.clone() for state in states]
        with torch.no_grad():
            reference = model(input_ids=token, position_ids=positions, cache=cache, use_cache=True).logits
            logits, *states = decode(token, mask, positions, torch.tensor([position]), *inputs)
        assert all(torch.equal(a, b) for a, b in zip(inputs, before, strict=True))  # inputs untouched
        assert torch.equal(logits, reference)
        theirs = _theirs(cache)
        assert torch.equal(states[0], theirs[0])  # the recurrent state after the step
        assert not torch.equal(states[0], before[0])  # the step moved it
        for ours, full in zip(states[1:], theirs[1:], strict=True):  # the KV rows written so far
            assert torch.equal(ours[:, :, : position + 1], full)


def test_simulate_refuses_a_lightning_stack_it_cannot_price(tmp_path: Path) -> None:
    """plan sizes a lightning stack; simulate has no serving kernel for its scan and says so (the family
    matrix's row, docs/families.md, proves apply and verify)."""
    found = buildable_config("minimax")
    assert not isinstance(found, str)
    config, built = found
    path = write_spec(tmp_path, "minimax", config, module_paths(built))
    runner = CliRunner()
    assert runner.invoke(cli, ["plan", str(path), "--seq-len", "64"]).exit_code == 0
    result = runner.invoke(cli, ["simulate", str(path), "--device", "h200", "--query-len", "64"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "refused (hybrid)" in result.output and "no serving kernel simulate can price" in result.output
