"""Mamba1 selective-scan layers (Mamba, Falcon-Mamba, Jamba) as ``linear`` layers (issue 36): a conv
window ``[channels, conv_kernel]`` in the model dtype and a float32 recurrent state ``[channels,
state_size]``, sized from a state size without SSM heads; a pure Mamba stack has no attention layer
(a nominal attention sizes nothing, no MLP either). The wrappers equal transformers' own model and
``DynamicCache`` (logits and every state, prefill and several decode steps, float32 and bfloat16); a
state carried wrong fails verify; plan sizes the states and simulate prices the scan."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, DynamicCache, FalconMambaConfig, JambaConfig, MambaConfig

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction import options_from_spec, verify
from kimi_adapter_core.backends.extraction.runtime import abi as runtime
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import Refusal
from kimi_adapter_core.families.trial import buildable_config, module_paths, write_spec
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.derive import derive_structure

PROMPT, STEPS, CACHE = 7, 4, 16
SMALL = {"vocab_size": 96, "hidden_size": 32, "state_size": 8, "expand": 2, "conv_kernel": 4}
CONFIGS = {
    "mamba": lambda: MambaConfig(**SMALL, num_hidden_layers=2),
    "falcon_mamba": lambda: FalconMambaConfig(**SMALL, num_hidden_layers=2),
    "jamba": lambda: JambaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_expand=2,
        mamba_d_conv=4,
    ),
}  # fmt: skip
KINDS = {
    "mamba": ["linear", "linear"],
    "falcon_mamba": ["linear", "linear"],
    "jamba": ["linear", "attention"],
}
# where each stack keeps the parts the wrappers call by another name (a spec's module_paths)
BACKBONE = {"embeddings": "embeddings", "final_norm": "norm_f"}
PARTS = {"mamba": BACKBONE, "falcon_mamba": BACKBONE, "jamba": {"final_norm": "final_layernorm"}}


def test_a_state_size_without_heads_is_a_mamba1_scan_and_a_pure_stack_attends_nowhere() -> None:
    """state-spaces/mamba-130m-hf's published config: 24 Mamba1 blocks, no attention, no MLP."""
    raw = {
        "model_type": "mamba", "num_hidden_layers": 24, "hidden_size": 768, "vocab_size": 50280,
        "state_size": 16, "expand": 2, "conv_kernel": 4, "intermediate_size": 1536, "time_step_rank": 48,
    }  # fmt: skip
    found = derive_structure(raw)  # was refused: "a Mamba1 selective scan, whose state is one per channel"
    assert found.layer_kinds == ("linear",) * 24 and not found.attention_layer_ids
    assert {layer.mlp for layer in found.layers} == {"none"}
    linear = found.linear
    assert (linear.kind, linear.dt_rank, linear.state_names) == ("mamba1", 48, ("conv", "recurrent"))
    assert (linear.conv.shape(), linear.recurrent.shape()) == ((1536, 4), (1536, 16))
    assert linear.state_bytes_per_request(2) == 1536 * 4 * 2 + 1536 * 16 * 4  # bf16 window, fp32 state
    assert "24/24 linear-attention layers (Mamba1 selective scan 1536 channels, state 16, conv 4)" in (
        found.describe()
    )


def test_jambas_layout_and_experts_come_from_its_periods_and_zambas_is_not_guessed() -> None:
    raw = {
        "model_type": "jamba", "num_hidden_layers": 8, "hidden_size": 64, "vocab_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "num_experts": 4,
        "num_experts_per_tok": 2, "attn_layer_period": 4, "attn_layer_offset": 2, "expert_layer_period": 2,
        "expert_layer_offset": 1, "mamba_d_state": 16, "mamba_expand": 2, "mamba_d_conv": 4,
        "mamba_dt_rank": "auto",
    }  # fmt: skip
    found = derive_structure(raw)
    assert found.layer_kinds == ("linear", "linear", "attention", "linear") * 2
    assert [layer.mlp for layer in found.layers] == ["dense", "moe"] * 4
    assert (found.linear.kind, found.linear.dt_rank, found.linear.conv.shape()) == ("mamba1", 4, (128, 4))
    assert found.attention.describe() == "GQA 4 heads / 2 KV heads x 16"
    with pytest.raises(Refusal) as refused:  # Zamba's class builds its hybrid layers' list: not guessed
        derive_structure({**raw, "model_type": "zamba", "n_mamba_heads": 2})
    assert refused.value.code == "layer-types" and "layers_block_type" in refused.value.message


def _model(model_type: str, dtype: torch.dtype) -> torch.nn.Module:
    config = CONFIGS[model_type]()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # wide random weights, every norm and bias random too
        for parameter in model.parameters():
            parameter.normal_(std=0.3 if parameter.dim() > 1 else 0.5)
        for name, parameter in model.named_parameters():
            if name.endswith("A_log"):  # a decay that neither vanishes nor explodes
                parameter.uniform_(-1.0, 1.0)
    return model.to(dtype)


def _wrappers(model: torch.nn.Module, model_type: str) -> tuple[Any, Any]:
    stack = getattr(model, "backbone", None) or model.model
    common = {
        "kv_layout": "heads",
        "cache_keyword": upstream.cache_keyword(stack.layers[0]),
        "layer_kinds": KINDS[model_type],
        "parts": PARTS[model_type],
    }
    return (
        runtime.PrefillWrapper.from_language_model(stack, model.lm_head, **common),
        runtime.DecodeWrapper.from_language_model(stack, model.lm_head, **common),
    )


def _theirs(cache: DynamicCache, kinds: list[str]) -> list[torch.Tensor]:
    """transformers' cache in the ABI's order: a linear layer's conv window and recurrent state, an
    attention layer's keys and values."""
    flat: list[torch.Tensor] = []
    for layer, kind in enumerate(kinds):
        if kind == "linear":
            flat += [cache.get_conv_state(layer).clone(), cache.get_recurrent_state(layer).clone()]
        else:
            flat += [cache.layers[layer].keys.clone(), cache.layers[layer].values.clone()]
    return flat


def _close(ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal in bfloat16 (the same ops on the same values), within float noise in float32."""
    if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
        return False
    return torch.equal(ours, theirs) if dtype == torch.bfloat16 else bool((ours - theirs).abs().max() <= 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba", "jamba"])
def test_prefill_and_decode_equal_transformers_with_its_cache(model_type: str, dtype: torch.dtype) -> None:
    model, kinds = _model(model_type, dtype), KINDS[model_type]
    prefill, decode = _wrappers(model, model_type)
    prompt = torch.randint(3, 96, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    _, causal, positions = runtime.prefill_inputs(batch=1, prefill_len=PROMPT, dtype=dtype, device="cpu")
    with torch.no_grad():
        reference = model(input_ids=prompt, cache=cache, use_cache=True).logits
        logits, *present = prefill(prompt, causal, positions)
    assert (present[0].dtype, present[1].dtype) == (dtype, torch.float32)  # the window, the state
    assert present[0].shape == (1, 64, 4) and present[1].shape == (1, 64, 8)
    assert _close(logits.to(reference.dtype), reference, dtype)
    expected = _theirs(cache, kinds)
    assert all(_close(ours, theirs, dtype) for ours, theirs in zip(present, expected, strict=True))
    states = runtime.place_prefill_kv(present, CACHE, kinds)
    for step in range(STEPS):
        token, position = logits[:, -1:].argmax(-1), PROMPT + step
        positions = torch.full((1, 1), position)
        mask = runtime.additive_causal_mask(positions, CACHE, dtype)
        inputs, before = states, [state.clone() for state in states]
        with torch.no_grad():
            reference = model(input_ids=token, position_ids=positions, cache=cache, use_cache=True).logits
            logits, *states = decode(token, mask, positions, torch.tensor([position]), *inputs)
        assert all(torch.equal(a, b) for a, b in zip(inputs, before, strict=True))  # inputs untouched
        assert _close(logits.to(reference.dtype), reference, dtype), step
        theirs = _theirs(cache, kinds)
        for index, (ours, full) in enumerate(zip(states, theirs, strict=True)):
            if kinds[index // 2] == "attention":  # the KV rows written so far
                ours = ours[:, :, : position + 1]
            assert _close(ours, full, dtype), (step, index)
        assert not torch.equal(states[1], before[1])  # the step moved the recurrent state


def test_the_probe_and_the_mapping_carry_a_pure_ssm_stack_with_no_attention_layer() -> None:
    model = _model("mamba", torch.bfloat16)
    upstream.forget()
    protocol = upstream.decoder_protocol(model.backbone, KINDS["mamba"])
    upstream.forget()
    assert protocol.linear_states == (((64, 4), "bfloat16"), ((64, 8), "float32"))
    assert protocol.kv_dims is None  # no attention layer hands over a key
    assert upstream.check(("head_input_cast",))[0].ok
    from kimi_adapter_core.backends.extraction.names import GraphNames, kv_names

    names = GraphNames(
        ("input_ids",), "pk{layer}", "pv{layer}", "logits", "k{layer}", "v{layer}",
        "pc{layer}", "pr{layer}", "c{layer}", "r{layer}",
    )  # fmt: skip
    mapping = runtime.build_kv_mapping(
        ((1, 32), (1, 32)), kv_layout="heads", batch=2, prefill_len=8, max_cache_len=32, num_layers=2,
        dtype="bfloat16", names=kv_names(names, names), kinds=KINDS["mamba"],
        linear_states=protocol.linear_states,
    )  # fmt: skip
    assert [layer["kind"] for layer in mapping["layers"]] == ["linear", "linear"]
    assert not any("key" in role for layer in mapping["layers"] for role in layer)
    recurrent = {"name": "pr1", "shape": [2, 64, 8], "dtype": "float32"}
    assert mapping["layers"][1]["decode_recurrent_input"] == recurrent
    assert "zero state" in mapping["contract"]["linear_states"]["initial"]


def _spec(tmp_path: Path, model_type: str) -> Any:
    found = buildable_config(model_type)
    assert not isinstance(found, str)
    config, built = found
    return write_spec(tmp_path, model_type, config, module_paths(built))


def test_a_recurrent_state_carried_wrong_fails_verify(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exported graphs scale the recurrent state a prefill hands over by 1.01: the returned-states
    check fails and names the first Mamba1 layer."""
    real = runtime.StaticStateCache.update_recurrent_state

    def drifting(self: Any, recurrent_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        return real(self, recurrent_states * 1.01, layer_idx, *args, **kwargs)

    monkeypatch.setattr(runtime.StaticStateCache, "update_recurrent_state", drifting)
    spec = load_spec(_spec(tmp_path, "mamba"))
    options = options_from_spec(spec, output_dir=tmp_path / "out")
    options = dataclasses.replace(options, verify_dtypes=("float32",), verify_decode_steps=2)
    report = verify(spec, options, echo=lambda line: None)
    failed = {check.name for check in report.checks if not check.passed}
    assert "returned states" in failed
    assert report.first_departure.startswith("prefill: layer 0 recurrent state departs first")


def test_plan_sizes_the_mamba1_states_and_simulate_prices_the_scan(tmp_path: Path) -> None:
    path = _spec(tmp_path, "mamba")
    runner = CliRunner()
    planned = runner.invoke(cli, ["plan", str(path), "--seq-len", "64"])
    assert planned.exit_code == 0, planned.output
    assert "recurrent  [128x16] fp32" in planned.output and "conv       [128x4] bf16" in planned.output
    assert "mamba1.x_proj" in planned.output and "0 attention layers" in planned.output
    assert "no position limit stated" in planned.output and "max positions" not in planned.output
    simulated = runner.invoke(cli, ["simulate", str(path), "--device", "h200", "--query-len", "64"])
    assert simulated.exit_code == 0, simulated.output
    assert "selective_scan_fn" in simulated.output and "causal_conv1d_fn" in simulated.output
    decode = ["simulate", str(path), "--device", "h200", "--decode", "--context-len", "32"]
    decoded = runner.invoke(cli, decode)
    assert decoded.exit_code == 0, decoded.output
    assert "selective_state_update" in decoded.output
