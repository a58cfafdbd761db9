"""LFM2's gated short convolutions (LFM2, LFM2-MoE, LFM3) as ``short_conv`` layers (issue 36): one conv
window ``[hidden, conv_L_cache]`` in the model dtype per request and no recurrent state, read and written
through the conv half of transformers' linear-attention cache API. The wrappers equal transformers' own
model and ``DynamicCache`` (logits and every window, prefill and several decode steps, float32 and
bfloat16, rows prefilled apart and decoded together at their own positions); verify passes with rows
joining a paged batch, and fails when a window is carried wrong; plan sizes the window and counts the
mixer's tensors; simulate prices the convolution."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction import options_from_spec, verify
from kimi_adapter_core.backends.extraction.names import GraphNames, kv_names
from kimi_adapter_core.backends.extraction.runtime import abi as runtime
from kimi_adapter_core.cli import cli
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import buildable_config, module_paths, write_spec
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.derive import derive_structure

STEPS, CACHE = 3, 24


def test_the_published_lfm2_config_sizes_one_window_per_conv_layer() -> None:
    """LiquidAI/LFM2-1.2B's config: 16 layers, 10 gated short convolutions of kernel 3 over 2048
    channels, the MLP width adjusted from 12288 as ``Lfm2MLP`` does (2/3, rounded up to 256)."""
    attention = [2, 5, 8, 10, 12, 14]
    raw = {
        "model_type": "lfm2", "num_hidden_layers": 16, "hidden_size": 2048, "vocab_size": 65536,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 12288,
        "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
        "conv_L_cache": 3, "max_position_embeddings": 128000, "rope_theta": 1000000.0,
        "layer_types": ["full_attention" if i in attention else "conv" for i in range(16)],
    }  # fmt: skip
    found = derive_structure(raw)  # was refused: "config sets conv_L_cache ... keeps another state"
    assert found.layer_kinds == tuple("attention" if i in attention else "short_conv" for i in range(16))
    linear = found.linear
    assert (linear.kind, linear.state_names, linear.recurrent) == ("short_conv", ("conv",), None)
    assert linear.conv.shape() == (2048, 3)
    assert linear.state_bytes_per_request(2) == 2048 * 3 * 2  # the bf16 window alone
    assert found.intermediate_size == 8192
    assert "10/16 linear-attention layers (gated short convolution 2048 channels, conv 3)" in found.describe()


def _model(model_type: str, dtype: torch.dtype) -> torch.nn.Module:
    """The family matrix's tiny model of ``model_type`` (a conv layer, then attention), wide random
    weights and every norm random too."""
    config = AutoConfig.for_model(**tiny_config(model_type))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.3 if parameter.dim() > 1 else 0.5)
    return model.to(dtype)


def _kinds(model: torch.nn.Module) -> list[str]:
    return list(derive_structure(model.config.to_dict()).layer_kinds)


def _wrappers(model: torch.nn.Module) -> tuple[Any, Any]:
    stack = model.model
    common = {
        "kv_layout": "heads",
        "cache_keyword": upstream.cache_keyword(stack.layers[0]),
        "layer_kinds": _kinds(model),
        # where the stack keeps its final norm (embedding_norm) and rope (LFM2-MoE: pos_emb), as a spec says
        "parts": {k: v for k, v in module_paths(model).items() if k in ("final_norm", "rotary_embedding")},
        "windows": [getattr(model.config, "sliding_window", None) if t == "sliding_attention" else None
                    for t in model.config.layer_types],
        "rope_layer_types": upstream.rope_layer_types(stack),
    }  # fmt: skip
    return (
        runtime.PrefillWrapper.from_language_model(stack, model.lm_head, **common),
        runtime.DecodeWrapper.from_language_model(stack, model.lm_head, **common),
    )


def _theirs(cache: DynamicCache, kinds: list[str]) -> list[torch.Tensor]:
    """transformers' cache in the ABI's order: a conv layer's window, an attention layer's keys and
    values."""
    flat: list[torch.Tensor] = []
    for layer, kind in enumerate(kinds):
        if kind == "short_conv":
            assert cache.get_recurrent_state(layer) is None  # transformers keeps no other state
            flat.append(cache.get_conv_state(layer).clone())
        else:
            flat += [cache.layers[layer].keys.clone(), cache.layers[layer].values.clone()]
    return flat


def _close(ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal in bfloat16 (the same ops on the same values), within float noise in float32."""
    if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
        return False
    return torch.equal(ours, theirs) if dtype == torch.bfloat16 else bool((ours - theirs).abs().max() <= 1e-4)


def _prefill_row(model: Any, prefill: Any, prompt: torch.Tensor, dtype: torch.dtype) -> tuple[Any, ...]:
    """One row prefilled by the wrapper and by transformers: (our logits, our states, their cache)."""
    kinds, length = _kinds(model), prompt.shape[1]
    cache = DynamicCache(config=model.config)
    _, causal, positions = runtime.prefill_inputs(batch=1, prefill_len=length, dtype=dtype, device="cpu")
    with torch.no_grad():
        reference = model(input_ids=prompt, **{upstream.cache_keyword(model): cache}, use_cache=True).logits
        logits, *present = prefill(prompt, causal, positions)
    assert _close(logits.to(reference.dtype), reference, dtype)
    for ours, theirs in zip(present, _theirs(cache, kinds), strict=True):  # a sliding layer keeps its last
        assert _close(ours[:, :, length - theirs.shape[2] :] if ours.dim() == 4 else ours, theirs, dtype)
    return logits, runtime.place_prefill_kv(present, CACHE, kinds), cache


# every family in float32; LFM2 in bfloat16 too (bit-identical: the same ops on the same values)
CASES = [
    ("lfm2", torch.float32), ("lfm2", torch.bfloat16), ("lfm2_moe", torch.float32), ("lfm3", torch.float32),
]  # fmt: skip


@pytest.mark.parametrize(("model_type", "dtype"), CASES, ids=["lfm2-fp32", "lfm2-bf16", "lfm2_moe", "lfm3"])
def test_rows_prefilled_apart_decode_together_equal_to_transformers(
    model_type: str, dtype: torch.dtype
) -> None:
    """Two prompts of different lengths (one shorter than LFM3's kernel of 7) are prefilled apart, as the
    contract says, then decode in one batch at their own positions; each row equals transformers' model
    run on that row alone with its own ``DynamicCache``, every window and KV row included."""
    model = _model(model_type, dtype)
    kinds = _kinds(model)
    assert "short_conv" in kinds and "attention" in kinds
    prefill, decode = _wrappers(model)
    lengths = (9, 2)
    prompts = [torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    rows = [_prefill_row(model, prefill, prompt, dtype) for prompt in prompts]
    assert rows[0][1][0].shape == (1, 64, model.config.conv_L_cache)  # the first layer's window
    states = [torch.cat(parts) for parts in zip(*(row[1] for row in rows), strict=True)]
    tokens = torch.cat([row[0][:, -1:].argmax(-1) for row in rows])
    for step in range(STEPS):
        positions = torch.tensor([[n + step] for n in lengths])
        mask = runtime.additive_causal_mask(positions, CACHE, dtype)
        inputs, before = states, [state.clone() for state in states]
        with torch.no_grad():
            logits, *states = decode(tokens, mask, positions, positions.view(-1), *inputs)
        assert all(torch.equal(a, b) for a, b in zip(inputs, before, strict=True))  # inputs untouched
        for row, (_, _, cache) in enumerate(rows):
            with torch.no_grad():
                reference = model(
                    input_ids=tokens[row : row + 1], position_ids=positions[row : row + 1],
                    **{upstream.cache_keyword(model): cache}, use_cache=True,
                ).logits  # fmt: skip
            assert _close(logits[row : row + 1].to(reference.dtype), reference, dtype), (step, row)
            theirs, index = _theirs(cache, kinds), 0
            for kind in kinds:
                if kind == "short_conv":
                    assert _close(states[index][row : row + 1], theirs[index], dtype), (step, row, index)
                    index += 1
                    continue
                written = lengths[row] + step + 1  # the KV rows written so far (a sliding layer's last)
                for offset in range(2):
                    kept = theirs[index + offset].shape[2]
                    ours = states[index + offset][row : row + 1, :, written - kept : written]
                    assert _close(ours, theirs[index + offset], dtype), (step, row, index + offset)
                index += 2
        first = kinds.index("short_conv")
        assert not torch.equal(states[first], before[first])  # the step shifted the window
        tokens = logits[:, -1:].argmax(-1)


def test_the_probe_reads_one_window_and_the_mapping_carries_it_alone() -> None:
    model = _model("lfm2", torch.bfloat16)
    upstream.forget()
    protocol = upstream.decoder_protocol(model.model, _kinds(model))
    upstream.forget()
    assert protocol.linear_states == (((64, 3), "bfloat16"),)  # the window, no recurrent state
    assert protocol.kv_dims == ((2, 16), (2, 16))
    assert upstream.check(("short_conv_cache",))[0].ok
    names = GraphNames(
        ("input_ids",), "pk{layer}", "pv{layer}", "logits", "k{layer}", "v{layer}",
        "pc{layer}", "pr{layer}", "c{layer}", "r{layer}",
    )  # fmt: skip
    mapping = runtime.build_kv_mapping(
        protocol.kv_dims, kv_layout="heads", batch=2, prefill_len=8, max_cache_len=32, num_layers=2,
        dtype="bfloat16", names=kv_names(names, names), kinds=_kinds(model),
        linear_states=protocol.linear_states, paged=runtime.PagedKV(8, 16, "block_table"),
    )  # fmt: skip
    conv, attention = mapping["layers"]
    assert conv["kind"] == "short_conv" and not any("recurrent" in role or "key" in role for role in conv)
    window = {"name": "pc0", "shape": [2, 64, 3], "dtype": "bfloat16"}  # one row per request, never paged
    assert conv["decode_conv_input"] == window and conv["prefill_conv_output"]["name"] == "c0"
    assert attention["decode_key_input"]["shape"][0] == 16  # the attention layer's block pool
    states = mapping["contract"]["linear_states"]
    assert set(states) - set(runtime.LINEAR_STATE_RULES) == {"conv"}
    assert "no recurrent state" in states["conv"]["holds"] and "never paged" in states["paged"]
    assert "write its prefill outputs into that row" in states["joining_request"]
    assert "nothing to clear" in states["finished_request"]
    assert mapping["contract"]["padding"]["supported"] == "none"


def _spec(tmp_path: Path, model_type: str, abi: tuple[str, str] = ("", "")) -> Path:
    found = buildable_config(model_type)
    assert not isinstance(found, str)
    config, built = found
    path = write_spec(tmp_path, model_type, config, module_paths(built))
    path.write_text(path.read_text().replace(*abi))
    return path


# rows joining a running batch, the attention layers' KV in a paged block pool
PAGED = ("  batch: 1\n", "  batch: 2\n  kv_cache: {kind: paged, block_size: 8}\n")


def test_verify_passes_with_rows_joining_a_paged_batch(tmp_path: Path) -> None:
    spec = load_spec(_spec(tmp_path, "lfm2", PAGED))
    options = options_from_spec(spec, output_dir=tmp_path / "out")
    options = dataclasses.replace(options, verify_dtypes=("float32",), verify_decode_steps=3)
    report = verify(spec, options, echo=lambda line: None)
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    names = {check.name for check in report.checks}
    assert "returned states" in names and any("join" in name for name in names), names


def test_a_window_carried_wrong_fails_verify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exported graphs scale the window a step hands over by 1.01: the returned-states check fails
    and names the conv layer's conv state."""
    real = runtime.StaticStateCache.update_conv_state

    def drifting(self: Any, conv_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        full = real(self, conv_states, layer_idx, *args, **kwargs)
        slot = self._slot[layer_idx]
        self.present[slot]["conv"] = self.present[slot]["conv"] * 1.01
        return full

    monkeypatch.setattr(runtime.StaticStateCache, "update_conv_state", drifting)
    spec = load_spec(_spec(tmp_path, "lfm2"))
    options = options_from_spec(spec, output_dir=tmp_path / "out")
    options = dataclasses.replace(options, verify_dtypes=("float32",), verify_decode_steps=2)
    report = verify(spec, options, echo=lambda line: None)
    assert "returned states" in {check.name for check in report.checks if not check.passed}
    assert report.first_departure.startswith("prefill: layer 0 conv state departs first")


def test_plan_sizes_the_window_and_simulate_prices_the_convolution(tmp_path: Path) -> None:
    path = _spec(tmp_path, "lfm2")
    runner = CliRunner()
    planned = runner.invoke(cli, ["plan", str(path), "--seq-len", "64"])
    assert planned.exit_code == 0, planned.output
    assert "conv       [64x3] bf16" in planned.output and "recurrent" not in planned.output
    assert "short_conv.in_proj" in planned.output and "gated short convolution 64 channels" in planned.output
    for phase in (["--query-len", "64"], ["--decode", "--context-len", "32"]):
        command = ["simulate", str(path), "--device", "h200", "--tp", "2", *phase, "--format", "json"]
        simulated = runner.invoke(cli, command)
        assert simulated.exit_code == 0, simulated.output
        ops = {(op["module"], op["op"]): op for op in json.loads(simulated.stdout)["ops"]}
        kernel = "causal_conv1d_update" if "--decode" in phase else "causal_conv1d_fn"
        conv = ops[("linear_dense_layer.conv", kernel)]
        assert conv["source"] == "roofline" and conv["flops"] > 0
        # the rank's in_proj: B, C and x of its half of the 64 channels, over the phase's tokens
        tokens = 64 if "--query-len" in phase else 1
        assert ops[("linear_dense_layer.conv.in_proj", "mm")]["flops"] == 2 * tokens * 64 * 3 * 32
        # the rank's MLP: half the adjusted width (128 -> 2/3 -> 85, rounded up to 256), adjusted once
        # (adjusting the per-rank 128 again gave 256 columns a rank)
        for layer in ("linear_dense_layer", "dense_layer"):
            assert ops[(f"{layer}.feed_forward.w2", "mm")]["flops"] == 2 * tokens * 64 * (256 // 2)
