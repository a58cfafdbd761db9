"""Hybrid stacks (issue 36): linear-attention layers carry a conv window and a recurrent state.

The wrappers take and return every state; each is compared with transformers' own ``DynamicCache`` (its
``LinearAttentionLayer``s) on a tiny random Qwen3-Next, contiguous and paged, over several decode
steps. The probe, the structure, the options and the state mapping say the same shapes, and what kadapt
cannot carry is refused before any export, with the reason and the place to fix it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache, Qwen3NextConfig, Qwen3NextForCausalLM

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction import options_from_spec
from kimi_adapter_core.backends.extraction.names import GraphNames, kv_names
from kimi_adapter_core.backends.extraction.options import bind_structure
from kimi_adapter_core.backends.extraction.runtime import abi
from kimi_adapter_core.errors import KadaptError, Refusal
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.derive import derive_structure, value_violations

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = json.loads((REPO / "specs" / "qwen3_next" / "config.json").read_text())
KINDS = ["linear", "linear", "linear", "attention"]
TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "max_position_embeddings": 256,
}


def tiny_model() -> Qwen3NextForCausalLM:
    config = Qwen3NextConfig(**TINY)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.2 if parameter.dim() > 1 else 0.5)
    return model


def reference_states(cache: DynamicCache, kinds: list[str]) -> list[torch.Tensor]:
    """transformers' cache in the ABI's order: a linear layer's conv and recurrent state whole, an
    attention layer's keys and values."""
    flat: list[torch.Tensor] = []
    for layer, kind in enumerate(kinds):
        if kind == "linear":
            flat += [cache.get_conv_state(layer).clone(), cache.get_recurrent_state(layer).clone()]
        else:
            flat += [cache.layers[layer].keys.clone(), cache.layers[layer].values.clone()]
    return flat


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_wrappers_carry_every_state_as_transformers_does(paged: bool) -> None:
    """Prefill and 6 decode steps of a 3 linear : 1 full stack, batch 2: logits and every state (the
    attention rows written so far) equal transformers' with its own DynamicCache."""
    model = tiny_model()
    keyword = upstream.cache_keyword(model.model.layers[0])
    wrapper = {"kv_layout": "heads", "cache_keyword": keyword, "layer_kinds": KINDS}
    prefill = abi.PrefillWrapper.from_language_model(model.model, model.lm_head, **wrapper)
    decode = abi.DecodeWrapper.from_language_model(model.model, model.lm_head, paged=paged, **wrapper)
    batch, length, capacity, block = 2, 9, 24, 4
    prompt = torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        reference = model(prompt, **{keyword: cache}, use_cache=True).logits
        _, mask, positions = abi.prefill_inputs(
            batch=batch, prefill_len=length, dtype=torch.float32, device="cpu"
        )
        logits, *present = prefill(prompt, mask, positions)
    assert (logits - reference).abs().max() <= 1e-5
    for ours, theirs in zip(present, reference_states(cache, KINDS), strict=True):
        assert ours.shape == theirs.shape and (ours - theirs).abs().max() <= 1e-5
    kv = ((TINY["num_key_value_heads"], TINY["head_dim"]),) * 2
    table: tuple[torch.Tensor, ...] = ()
    if paged:
        per_row = capacity // block
        order = torch.randperm(batch * per_row + per_row, generator=torch.Generator().manual_seed(3))
        block_table = order[: batch * per_row].view(batch, per_row)
        pools = abi.paged_shapes(kv, block, batch * per_row + per_row)
        states = abi.place_prefill_kv_paged(
            present, block_table, torch.full((batch,), length), [*pools], KINDS
        )
        table = (block_table,)
    else:
        states = abi.place_prefill_kv(present, capacity, KINDS)
    token = logits[:, -1:].argmax(-1)
    for step in range(6):
        position = length + step
        positions = torch.full((batch, 1), position)
        mask = abi.additive_causal_mask(positions, capacity, torch.float32)
        with torch.no_grad():
            reference = model(token, **{keyword: cache}, use_cache=True).logits
            logits, *states = decode(token, mask, positions, positions.view(-1), *table, *states)
        assert (logits - reference).abs().max() <= 1e-5, step
        expected = reference_states(cache, KINDS)
        for index, (ours, theirs) in enumerate(zip(states, expected, strict=True)):
            if KINDS[index // 2] == "attention":  # rows written so far, read back in logical order
                ours = abi.paged_view(ours, table[0]) if paged else ours
                ours = ours[:, :, : position + 1]
            assert (ours - theirs).abs().max() <= 1e-5, (step, index)
        token = logits[:, -1:].argmax(-1)


def test_the_probe_reads_each_linear_layers_states_and_refuses_them_as_attention() -> None:
    """The layers hand over a conv window [channels, kernel] in the model's dtype and a float32
    recurrent state; probed as attention (no kinds given), a linear layer is refused, named."""
    model = tiny_model().to(torch.bfloat16)
    upstream.forget()
    protocol = upstream.decoder_protocol(model.model, KINDS)
    channels = 2 * 2 * 8 + 4 * 8  # q and k over the key heads, v over the value heads
    assert protocol.linear_states == (((channels, 4), "bfloat16"), ((4, 8, 8), "float32"))
    assert protocol.kv_dims == ((2, 16), (2, 16))
    upstream.forget()
    with pytest.raises(upstream.LayersUnsupported) as refused:
        upstream.decoder_protocol(model.model)
    assert "Qwen3NextDecoderLayer" in str(refused.value)


def test_a_linear_layer_that_skips_its_recurrent_state_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model()
    mixer = type(model.model.layers[0].linear_attn)
    real = mixer.forward

    def forgetful(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("cache", None)
        kwargs.pop("cache_params", None)
        return real(self, hidden_states, None, **{k: v for k, v in kwargs.items() if k == "attention_mask"})

    monkeypatch.setattr(mixer, "forward", forgetful)
    upstream.forget()
    with pytest.raises(upstream.LayersUnsupported) as refused:
        upstream.decoder_protocol(model.model, KINDS)
    upstream.forget()
    assert refused.value.code == "cache-protocol"
    assert "update_conv_state" in refused.value.findings[0].expected
    assert "never calls it" in refused.value.findings[0].found


def test_the_structure_reads_the_published_config_and_its_object_alike() -> None:
    """Qwen3-Next-80B-A3B's published config.json states no layer_types: full_attention_interval 4 makes
    every 4th layer full attention, the others gated DeltaNet, as its config class builds them."""
    raw = derive_structure(PUBLISHED)
    built = derive_structure(Qwen3NextConfig(**PUBLISHED))
    assert raw.layer_kinds == built.layer_kinds == (("linear",) * 3 + ("attention",)) * 12
    assert raw.linear == built.linear
    assert raw.linear.conv_state.shape() == (2 * 16 * 128 + 32 * 128, 4)
    assert raw.linear.recurrent_state.shape() == (32, 128, 128)
    # per request, whatever the context: a bf16 conv window and a float32 state per linear layer
    assert raw.linear.state_bytes_per_request(2) == 8192 * 4 * 2 + 32 * 128 * 128 * 4
    assert "36/48 linear-attention layers (gated DeltaNet 16x128 key / 32x128 value heads, conv 4)" in (
        raw.describe()
    )
    assert raw.to_dict()["layers"][:2] == [
        {"layers": [0, 2], "attention": "linear", "window": None, "mlp": "moe"},
        {"layers": [3, 3], "attention": "full", "window": None, "mlp": "moe"},
    ]


def test_linear_layers_kadapt_cannot_size_are_refused_with_the_keys_it_needs() -> None:
    no_sizes = {k: v for k, v in PUBLISHED.items() if not k.startswith("linear_")}
    no_sizes["layer_types"] = ["linear_attention", "full_attention"] * 24
    with pytest.raises(Refusal) as refused:
        derive_structure(no_sizes)
    assert refused.value.code == "hybrid"
    assert "linear_num_key_heads" in refused.value.message and "gated-DeltaNet" in refused.value.message
    no_pattern = {k: v for k, v in PUBLISHED.items() if k != "full_attention_interval"}
    with pytest.raises(KadaptError, match="neither which layers they are"):
        derive_structure(no_pattern)
    uneven = {**PUBLISHED, "linear_num_value_heads": 33}
    assert any(
        v.key == "linear_num_value_heads" and "do not split into 16 key heads" in v.problem
        for v in value_violations(uneven, None, "text config", "config.json")[1]
    )


def hybrid_spec(tmp_path: Path, abi_text: str | None = None, **config: Any) -> Any:
    """The Qwen3-Next spec kadapt documents, on the published config (``config`` overrides keys)."""
    shutil.copytree(REPO / "specs" / "qwen3_next", tmp_path / "qwen3_next")
    (tmp_path / "qwen3_next" / "config.json").write_text(json.dumps({**PUBLISHED, **config}))
    text = SPEC.replace("ABI", abi_text or ABI)
    (tmp_path / "qwen3_next.yaml").write_text(text)
    return load_spec(tmp_path / "qwen3_next.yaml")


SPEC = """\
apiVersion: kadapt/v1
kind: AdapterSpec
metadata: {name: qwen3_next}
gate: {model_type: qwen3_next}
source: {config: qwen3_next/config.json}
config_bridges:
  - {id: X1, why: eager attention exports as plain ops, op: set, path: _attn_implementation,
     value: eager, backends: [extraction]}
  - {id: X2, why: batched_mm experts export with static shapes, op: set,
     path: _experts_implementation, value: batched_mm, backends: [extraction]}
module_paths: {language_model: model, language_layers: model.layers, lm_head: lm_head}
abi:
ABI"""
ABI = """\
  batch: 2
  prefill_len: 16
  max_cache_len: 64
  dtype: float32
  kv_cache: {kind: paged, block_size: 8}
  prefill:
    inputs: [input_ids, attention_mask, position_ids]
    outputs: [logits, "k.{layer}", "v.{layer}", "c.{layer}", "r.{layer}"]
  decode:
    inputs: [input_ids, attention_mask, position_ids, cache_position, "pk.{layer}", "pv.{layer}",
             "pc.{layer}", "pr.{layer}"]
    outputs: [logits, "k.{layer}", "v.{layer}", "c.{layer}", "r.{layer}"]
"""


def test_the_abi_must_name_the_linear_states_where_the_spec_gives_names(tmp_path: Path) -> None:
    attention_only = ABI.replace(', "c.{layer}", "r.{layer}"', "").replace(
        ',\n             "pc.{layer}", "pr.{layer}"', ""
    )
    spec = hybrid_spec(tmp_path, attention_only)
    options = options_from_spec(spec, output_dir=tmp_path / "out")
    with pytest.raises(KadaptError) as missing:
        bind_structure(options, derive_structure(PUBLISHED))
    assert "36 linear-attention layers" in missing.value.message
    assert '"<present conv {layer}>"' in missing.value.message
    assert missing.value.location == spec.locate("abi.prefill.outputs")


def test_a_dynamic_prompt_length_is_refused_for_linear_layers(tmp_path: Path) -> None:
    spec = hybrid_spec(tmp_path, ABI + "  dynamic: [prefill_len]\n")
    options = options_from_spec(spec, output_dir=tmp_path / "out")
    with pytest.raises(KadaptError) as refused:
        bind_structure(options, derive_structure(PUBLISHED))
    assert "64-token chunk" in refused.value.message
    assert refused.value.location == spec.locate("abi.dynamic")


def test_the_state_mapping_says_each_states_shape_dtype_and_rules() -> None:
    """A runtime can be written from the mapping alone: per linear layer its conv and recurrent state
    (float32 in a bf16 ABI), never paged, and no padding of a prefill row."""
    names = GraphNames(
        ("input_ids",), "pk{layer}", "pv{layer}", "logits", "k{layer}", "v{layer}",
        "pc{layer}", "pr{layer}", "c{layer}", "r{layer}",
    )  # fmt: skip
    mapping = abi.build_kv_mapping(
        ((2, 16), (2, 16)),
        kv_layout="heads",
        batch=3,
        prefill_len=8,
        max_cache_len=32,
        num_layers=4,
        dtype="bfloat16",
        names=kv_names(names, names),
        paged=abi.PagedKV(8, 16, "block_table"),
        kinds=KINDS,
        linear_states=(((64, 4), "bfloat16"), ((4, 8, 8), "float32")),
    )
    linear, attention = mapping["layers"][0], mapping["layers"][3]
    assert linear["kind"] == "linear" and attention["kind"] == "attention"
    assert linear["prefill_conv_output"] == {"name": "c0", "shape": [3, 64, 4], "dtype": "bfloat16"}
    assert linear["decode_recurrent_input"] == {"name": "pr0", "shape": [3, 4, 8, 8], "dtype": "float32"}
    assert attention["decode_key_input"]["shape"] == [16, 8, 2, 16]  # a paged pool
    contract = mapping["contract"]
    assert contract["padding"]["supported"] == "none"
    assert set(contract["linear_states"]) >= {"conv", "recurrent", "ragged", "paged", "joining_request"}
    assert "never paged" in contract["linear_states"]["paged"]


def verified(spec: Any, tmp_path: Path, **replace: Any) -> Any:
    from kimi_adapter_core.backends.extraction import verify

    options = options_from_spec(spec, output_dir=tmp_path / "out")
    options = dataclasses.replace(options, verify_dtypes=("float32",), **replace)
    return verify(spec, options, echo=lambda line: None)


def test_verify_proves_every_state_with_rows_joining_a_paged_batch(tmp_path: Path) -> None:
    """The tiny Qwen3-Next of the published config (two periods of 3 linear : 1 full, the second
    replicated), a prompt crossing the scan's 64-token chunk, batch 2 joining at different steps
    through a paged pool: logits, tokens and every returned state equal transformers'."""
    report = verified(hybrid_spec(tmp_path), tmp_path)
    checks = {check.name: check for check in report.checks}
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    assert (
        "6 linear layers, 2 attention layers, prefill + 24 decode steps" in checks["returned states"].detail
    )
    assert "2 rows joining at steps [0, 2], paged, blocks out of order" in checks["joining rows"].detail
    assert "equal to model.generate row by row" in checks["joining rows"].detail


def test_a_recurrent_state_carried_wrong_fails_verify_and_is_located(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exported graphs (not the reference) scale every recurrent state they return by 1.01: the
    logits may stay close for a while, the state check fails and names the first linear layer."""
    real = abi.StaticStateCache.update_recurrent_state

    def drifting(self: Any, recurrent_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        return real(self, recurrent_states * 1.01, layer_idx, *args, **kwargs)

    monkeypatch.setattr(abi.StaticStateCache, "update_recurrent_state", drifting)
    spec = hybrid_spec(
        tmp_path,
        ABI.replace("batch: 2", "batch: 1").replace(
            "kv_cache: {kind: paged, block_size: 8}", "kv_cache: {kind: contiguous}"
        ),
    )
    report = verified(spec, tmp_path, verify_decode_steps=4)
    failed = {check.name for check in report.checks if not check.passed}
    assert "returned states" in failed
    assert report.first_departure.startswith("prefill: layer 0 recurrent state departs first")


def test_the_torch_free_names_and_the_runtime_agree_on_every_layer_kinds_states() -> None:
    """``names`` (torch-free: options, validate) and the standalone runtime each say which states a
    layer kind carries and which of them are one row per request; they must say the same."""
    from kimi_adapter_core.backends.extraction import names

    assert names.LAYER_STATES == abi.LAYER_STATES
    assert names.FIXED_ROLES == abi.FIXED_ROLES
    assert names.COMPRESSED_ROLES == abi.COMPRESSED_ROLES
    assert set(abi.MIXER_ATTRIBUTES) == set(abi.LAYER_STATES)
