"""MiniMax's lightning attention as a ``lightning`` layer (issue 36): a linear mixer whose layers carry
one state, the recurrent ``[heads, head_dim, head_dim]`` in the model dtype, sized from the attention's
own heads; kadapt's static cache answers ``MiniMaxCache``'s ``get_linear_cache``/``set_linear_cache``,
and the prefill and decode wrappers equal transformers' model with its own ``MiniMaxCache`` (logits and
every state), float32 and bfloat16; the family matrix row is adapted (export + verify)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, MiniMaxConfig
from transformers.models.minimax.modeling_minimax import MiniMaxCache

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction.runtime import abi as runtime
from kimi_adapter_core.backends.simulation.model.params import Naming, text_groups
from kimi_adapter_core.cli import cli
from kimi_adapter_core.families.trial import write_spec
from kimi_adapter_core.structure.derive import derive_structure

REPO = Path(__file__).resolve().parents[1]
PATHS = {"language_model": "model", "language_layers": "model.layers", "lm_head": "lm_head"}

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
    assert linear.block_size == 256  # what sizes its decay buffers
    described = "7/8 linear-attention layers (lightning attention 4x16 heads, block 256, no conv)"
    assert described in found.describe()


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


def same(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Bit-identical in bfloat16; in float32 within 1e-6 of the largest |value| (the static graph's
    matmuls may block differently from the dynamic cache's on another CPU: one machine gave equal bits,
    another a last-place difference in the decode logits)."""
    if ours.dtype == torch.bfloat16:
        return torch.equal(ours, theirs)
    bound = 1e-6 * max(1.0, float(theirs.abs().max()))
    return ours.shape == theirs.shape and float((ours - theirs).abs().max()) <= bound


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
    keyword = upstream.cache_keyword(model)  # the model's cache argument (5.23: past_key_values)
    with torch.no_grad():
        reference = model(input_ids=prompt, position_ids=positions, **{keyword: cache}, use_cache=True).logits
        logits, *present = prefill(prompt, causal, positions)
    assert present[0].dtype == dtype and present[0].shape == (1, 4, 8, 8)
    assert same(logits, reference)
    assert all(same(ours, theirs) for ours, theirs in zip(present, _theirs(cache), strict=True))
    states = runtime.place_prefill_kv(present, CACHE, ["lightning", "attention"])
    for step in range(STEPS):
        token, position = logits[:, -1:].argmax(-1), PROMPT + step
        positions = torch.full((1, 1), position)
        mask = runtime.additive_causal_mask(positions, CACHE, dtype)
        inputs, before = states, [state.clone() for state in states]
        with torch.no_grad():
            step = model(input_ids=token, position_ids=positions, **{keyword: cache}, use_cache=True)
            reference = step.logits
            logits, *states = decode(token, mask, positions, torch.tensor([position]), *inputs)
        assert all(torch.equal(a, b) for a, b in zip(inputs, before, strict=True))  # inputs untouched
        assert same(logits, reference)
        theirs = _theirs(cache)
        assert same(states[0], theirs[0])  # the recurrent state after the step
        assert not torch.equal(states[0], before[0])  # the step moved it
        for ours, full in zip(states[1:], theirs[1:], strict=True):  # the KV rows written so far
            assert same(ours[:, :, : position + 1], full)


def test_plan_names_every_tensor_and_decay_buffer_transformers_builds() -> None:
    """plan's inventory is the model's state dict, name by name: the projections, the norm and the decay
    buffers MiniMaxLightningAttention computes from its heads and block (persistent: in the state dict)."""
    config = _config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    theirs = {name: t.numel() for name, t in model.state_dict().items()}
    groups = text_groups(derive_structure(config.to_dict()), Naming("model", "model.layers", "lm_head", ()))
    mine = {name: params for group in groups for name, params in group.tensors()}
    assert mine == theirs
    assert mine["model.layers.0.self_attn.diagonal_decay"] == 4 * 4 * 4  # [1, heads, block, block]
    assert mine["model.layers.0.self_attn.query_decay"] == 4 * 4


def test_the_shipped_minimax_text_01_plan_counts_the_published_size() -> None:
    """456B parameters, as MiniMax-Text-01's card says: the 456,089,655,296 transformers builds from the
    shipped config on meta, plus 70 lightning layers' decay buffers (64 heads, block 256)."""
    weights = _cli("plan", REPO / "specs" / "minimax_text_01.yaml", "--format", "json")["weights"]
    buffers = 70 * 64 * (1 + 2 * 256 + 256 * 256)
    (decay,) = [g for g in weights["groups"] if g["name"] == "lightning.decay"]
    assert decay["params"] == buffers
    assert weights["total_params"] == 456_089_655_296 + buffers


# 3 lightning layers and one attention layer; 16 heads of 128 (8 per rank at TP 2), blocks of 256
MEDIUM = {
    "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "num_local_experts": 4,
    "num_experts_per_tok": 2, "block_size": 256, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "max_position_embeddings": 131072,
}  # fmt: skip
HEADS, D, BATCH = 8, 128, 8


@pytest.fixture(scope="module")
def medium(tmp_path_factory: pytest.TempPathFactory) -> Path:
    raw = MiniMaxConfig(**MEDIUM).to_dict()
    return write_spec(tmp_path_factory.mktemp("minimax"), "minimax", raw, PATHS)


def _cli(*args: object) -> dict[str, Any]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    return json.loads(result.stdout)


def _simulate(spec: Path, *args: object) -> dict[str, Any]:
    return _cli("simulate", spec, "--device", "h200", "--tp", 2, "--batch", BATCH, "--format", "json", *args)


def _ops(sim: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [op for op in sim["ops"] if op["op"] == name]


def test_lightning_decode_is_its_recurrent_update_constant_in_the_context(medium: Path) -> None:
    short, long = (_simulate(medium, "--decode", "--context-len", n) for n in (1024, 65536))
    (update,) = _ops(long, "linear_decode_forward_triton")
    assert (update["count"], update["module"]) == (3, "linear_moe_layer.self_attn")
    # 5 d^2 per token and head; q, k, v, o and the bf16 state [8, 128, 128] read and written per request
    assert update["flops"] == 3 * BATCH * HEADS * 5 * D * D
    assert update["bytes"] == 3 * (BATCH * 4 * HEADS * D * 2 + 2 * BATCH * HEADS * D * D * 2)
    assert _ops(short, "linear_decode_forward_triton")[0]["time_s"] == update["time_s"] > 0
    attention = [sum(op["time_s"] for op in _ops(sim, "attention_decode")) for sim in (short, long)]
    assert attention[1] > 8 * attention[0]
    assert not _ops(long, "causal_conv1d_update")  # no conv window
    assert long["states"]["linear_attention"]["layers"] == 3


def test_lightning_prefill_scans_blocks_linearly_in_the_tokens(medium: Path) -> None:
    short, long = (_simulate(medium, "--query-len", n) for n in (1024, 4096))
    (scan,) = _ops(short, "lightning_attention")
    (scan4,) = _ops(long, "lightning_attention")
    # per token and head: 4 L d inside its block of L = 256, 4 d^2 against the carried state
    assert scan["flops"] == 3 * BATCH * 1024 * HEADS * (4 * 256 * D + 4 * D * D)
    assert scan4["flops"] == 4 * scan["flops"] and 3.5 < scan4["time_s"] / scan["time_s"] <= 4.0
    assert not _ops(long, "causal_conv1d_fn")
    flash = [sum(op["time_s"] for op in _ops(sim, "flash_attention_prefill")) for sim in (short, long)]
    assert flash[1] > 5 * flash[0]  # attention's prefill grows faster than its tokens
