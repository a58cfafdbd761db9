"""A small config of a model type, from transformers' own defaults.

``tiny_config(model_type)`` builds the default config, shrinks its text backbone (hidden 64, 4 heads,
2 KV heads, 4 experts, small MLA ranks, one whole period of its layer pattern up to 8 layers, every
per-layer list cut to the layers kept) and its other sub-configs, repairs the defaults some configs
leave unbuildable (``head_dim`` or the KV heads left ``None``), and returns it as the dict a
``config.json`` holds. Sizes only: every kind the defaults choose (attention, MoE, windows, routing,
scaling) stays as transformers ships it, but for multipliers a family's defaults leave at 1
(``SCALES``: Falcon-H1's), which the tiny model sets apart so that a factor missed shows in verify.
"""

from __future__ import annotations

import math
from typing import Any

from ..structure.layer_pattern import pattern_period, shorten_layers
from ..structure.layer_shapes import LATENT_LAYER_FACTS, per_layer_attributes, tiny_latent_layers
from ..structure.shared_blocks import class_derived_keys, shared_blocks_rule

MAX_LAYERS = 8
# config key -> tiny value, set where the default config has the key with a value
TEXT_SIZES: dict[str, Any] = {
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "intermediate_size": 128,
    "intermediate_size_mlp": 128,
    "ffn_dim": 128,
    "ffn_hidden_size": 128,  # Falcon's MLP width
    # OPT's token embedding width: the hidden size, as every OPT but 350m keeps it (one that differs
    # projects in and out of the stack: refused, ``check_projections``)
    "word_embed_proj_dim": 64,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "n_shared_experts": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 8,
    "o_lora_rank": 16,  # DeepSeek-V4's grouped low-rank output projection (o_groups groups of this rank)
    "attention_chunk_size": 8,
    "floor_scale": 4,  # Llama-4's NoPE temperature tuning scales positions from floor_scale - 1 on
    "n_group": 1,
    "topk_group": 1,
    "hidden_size_per_layer_input": 8,  # Gemma-4's per-layer embeddings: one [vocab, layers x 8] table
    "vocab_size_per_layer_input": 128,
    "adapter_rank": 8,  # Zamba2's per-layer LoRA adapters on its shared blocks
}
# defaults some configs leave None although their model needs a value (set where the key exists)
REPAIRS: dict[str, Any] = {
    "head_dim": 16,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
}
# A linear-attention / SSM mixer's sizes, set together when the default config has every key and none
# of the second (its config class checks they agree: Mamba2's heads x head width = expand x hidden).
# Small chunks make the verify prompt cross the chunked scan's chunk boundary.
MIXER_SIZES: tuple[tuple[dict[str, Any], tuple[str, ...]], ...] = (
    # Mamba2 (its SSM heads are num_heads, the attention heads a shrunk verify model keeps: 4 x 16 = 64)
    ({"state_size": 16, "num_heads": 4, "head_dim": 16, "expand": 1, "n_groups": 2, "chunk_size": 16}, ()),
    # Nemotron-H
    ({"ssm_state_size": 16, "mamba_num_heads": 4, "mamba_head_dim": 8, "n_groups": 2, "chunk_size": 16}, ()),
    # Granite-4.0-H, Bamba: heads x width = mamba_expand x hidden (Falcon-H1 sizes its own: mamba_d_ssm)
    (
        {
            "mamba_d_state": 16,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_expand": 1,
            "mamba_n_groups": 2,
            "mamba_chunk_size": 16,
        },
        ("mamba_d_ssm",),
    ),  # fmt: skip
    # Zamba2 (its head width is derived: mamba_expand x hidden / n_mamba_heads)
    ({"mamba_d_state": 16, "n_mamba_heads": 4, "mamba_expand": 1, "mamba_ngroups": 2, "chunk_size": 16}, ()),
    # Falcon-H1: its inner width stated (mamba_d_ssm = heads x head width)
    (
        {
            "mamba_d_ssm": 64,
            "mamba_d_state": 16,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_n_groups": 2,
            "mamba_chunk_size": 16,
        },
        (),
    ),  # fmt: skip
    # KDA (Kimi-Linear, Bailing-hybrid)
    ({"linear_num_heads": 2, "linear_head_dim": 8}, ()),
)
# Granite-4.0-H's and Bamba's defaults are all Mamba2 layers, which transformers cannot run with a cache
# (its get_seq_length needs an attention layer); their published configs interleave attention. The tiny
# stack of such a default keeps its second layer attention, through whichever key its class reads.
ATTENTION_LAYOUT = {"layer_types": ["linear_attention", "full_attention"], "attn_layer_indices": [1]}
# LFM2's default is all attention layers (``full_attn_idxs`` every layer) and LFM2-MoE's has no layer list
# at all (its model does not build); their published configs interleave gated short convolutions. The
# tiny stack of a default with a short-convolution kernel (``conv_L_cache``) and no ``conv`` layer starts
# with one, then attends.
SHORT_CONV_LAYOUT = {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]}
# Scales whose defaults are 1, where a model applies them (Falcon-H1's muP multipliers around and inside
# its layers), by model_type: each set to a value of its own, so that verify's logits and states catch
# a factor the wrappers or the layers drop
SCALES: dict[str, dict[str, Any]] = {
    "falcon_h1": {
        "embedding_multiplier": 1.5,
        "lm_head_multiplier": 0.75,
        "key_multiplier": 0.6,
        "attention_in_multiplier": 1.3,
        "attention_out_multiplier": 0.8,
        "ssm_in_multiplier": 1.2,
        "ssm_out_multiplier": 0.7,
        "mlp_multipliers": [1.1, 0.9],
        "ssm_multipliers": [0.5, 1.4, 0.9, 1.1, 0.8],
    },
}
# token ids must lie inside the tiny vocabulary
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
OTHER_SIZES: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 128,
    "projection_dim": 32,
    # dots3's encoder adapters: their input is the encoder's width, their output the text model's
    "adapter_in_dim": 32,
    "adapter_input_size": 32,
    "adapter_out_dim": TEXT_SIZES["hidden_size"],
}
# ints that say how many layers come first with a dense MLP (DeepSeek's, LFM2-MoE's)
FIRST_DENSE_KEYS = ("first_k_dense_replace", "num_dense_layers")
# ints that say "every n-th layer": the tiny stack keeps one whole such period
PERIOD_KEYS = (
    "sliding_window_pattern",
    "decoder_sparse_step",
    "interleave_moe_layer_step",
    "no_rope_layer_interval",
    "attn_layer_period",
    "full_attention_interval",
)


# per-layer lists without a period whose every kind the tiny stack keeps, up to its first layer (HY-V4's
# indexer_types: full layers first, then ones that reuse their top-k)
FIRST_OF_EACH_KEYS = ("indexer_types",)
# layer types the tiny stack keeps up to the first layer of, where the config lists them (DeepSeek-V4's
# compressed kinds: its default list opens with two hca layers before the first csa one)
FIRST_OF_EACH_TYPES = ("heavily_compressed_attention", "compressed_sparse_attention")


def _layers(config: Any) -> int:
    total = int(config.num_hidden_layers)
    keep = 2
    types = _get(config, "layer_types")
    if isinstance(types, (list, tuple)) and len(types) == total:
        keep = max(keep, pattern_period(types, MAX_LAYERS))
    for key in PERIOD_KEYS:
        value = _get(config, key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            keep = max(keep, value)
    if isinstance(types, (list, tuple)):
        firsts = [types.index(kind) + 1 for kind in FIRST_OF_EACH_TYPES if kind in types]
        keep = max(keep, *firsts) if firsts else keep
    for key in FIRST_OF_EACH_KEYS:
        kinds = _get(config, key)
        if isinstance(kinds, (list, tuple)) and len(kinds) == total:
            keep = max(keep, *(kinds.index(kind) + 1 for kind in set(kinds)))
    return min(keep, MAX_LAYERS, total)


def _get(config: Any, key: str) -> Any:
    """``config.key`` or None; per-layer configs (Gemma-4) refuse global reads of per-layer keys."""
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError and the like
        return None


def _set(config: Any, key: str, value: Any) -> None:
    try:
        setattr(config, key, value)
    except Exception:  # noqa: BLE001 - a config that validates the key keeps its default
        pass


def _shrink_text(config: Any) -> None:
    for key, value in REPAIRS.items():
        if key in vars(config) and _get(config, key) is None:
            _set(config, key, value)
    total = _get(config, "num_hidden_layers")
    if isinstance(total, int):
        keep = _layers(config)
        for key, value in shorten_layers(config.to_dict(), total, keep).items():  # per-layer lists
            _set(config, key, value)
        for key, value in config.to_dict().items():  # lists of layer indices keep one of their kind
            if "layer" in key and isinstance(value, list) and value and len(value) != total:
                if all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < total for i in value):
                    kept = [i for i in value if i < keep]
                    _set(config, key, kept or [keep - 1])
        _set(config, "num_hidden_layers", keep)
        for key in FIRST_DENSE_KEYS:  # one dense layer, so the tiny stack keeps an MoE one
            first_dense = _get(config, key)
            if isinstance(first_dense, int) and first_dense > 1:
                _set(config, key, 1)
    for key, value in TEXT_SIZES.items():
        if _get(config, key) is not None:
            _set(config, key, value)
    _shrink_rotary_dim(config)
    if _get(config, "kv_lora_rank") is not None:  # MLA: one KV head per query head, head_dim is the rope part
        _set(config, "num_key_value_heads", TEXT_SIZES["num_attention_heads"])
        if _get(config, "head_dim") is not None:
            _set(config, "head_dim", TEXT_SIZES["qk_rope_head_dim"])
    for key, value in TOKEN_IDS.items():
        if isinstance(_get(config, key), int):
            _set(config, key, value)
    types = _get(config, "layer_types")
    all_mamba = isinstance(types, list) and set(types) == {"linear_attention"}
    if _get(config, "mamba_d_state") is not None and all_mamba:
        for key, value in ATTENTION_LAYOUT.items():
            if key in vars(config):
                _set(config, key, value[: len(types)])
    if _get(config, "conv_L_cache") is not None and "conv" not in (types or ()):
        _short_conv_layout(config)
    for sizes, unless in MIXER_SIZES:
        if all(_get(config, key) is not None for key in sizes) and not any(_get(config, k) for k in unless):
            for key, value in sizes.items():
                _set(config, key, value)


def _shrink_rotary_dim(config: Any) -> None:
    """Half the tiny head width for a ``rotary_dim`` of the default heads wider than it (GPT-J's and
    CodeGen's 64 against heads of 16): the model could not build its rotary tables otherwise, and half
    keeps a part of each head unrotated, as the defaults do."""
    rotary, heads = _get(config, "rotary_dim"), _get(config, "num_attention_heads") or _get(config, "n_head")
    width = _get(config, "head_dim") or (
        (_get(config, "hidden_size") or _get(config, "n_embd") or 0) // heads if heads else None
    )
    if isinstance(rotary, int) and isinstance(width, int) and rotary > width:
        _set(config, "rotary_dim", width // 2)


def _short_conv_layout(config: Any) -> None:
    """``SHORT_CONV_LAYOUT`` on a config of a short-convolution family whose default has no conv layer:
    its ``layer_types`` as long as the tiny stack (attention after the conv layer), its ``full_attn_idxs``
    where the class keeps one."""
    layers = int(_get(config, "num_hidden_layers") or 0)
    types = SHORT_CONV_LAYOUT["layer_types"]
    _set(config, "layer_types", (types + types[-1:] * layers)[:layers])
    if "full_attn_idxs" in vars(config):
        _set(config, "full_attn_idxs", SHORT_CONV_LAYOUT["full_attn_idxs"])


def tiny_config(model_type: str) -> dict[str, Any]:
    """transformers' default config of ``model_type``, small, as a ``config.json`` dict."""
    from transformers import CONFIG_MAPPING, PreTrainedConfig

    config = CONFIG_MAPPING[model_type]()
    text = config.get_text_config(decoder=True)
    cuts: dict[str, dict[str, Any]] = {}  # a heterogeneous sub-config's per-layer lists and overrides
    for name, sub in list(vars(config).items()):  # not getattr: a per-layer attribute raises (Gemma-4)
        if isinstance(sub, PreTrainedConfig) and sub is not text:
            total = _get(sub, "num_hidden_layers")
            if isinstance(total, int) and getattr(sub, "is_heterogeneous", False):  # dots3's vision tower
                keep = min(total, OTHER_SIZES["num_hidden_layers"])
                cuts[name] = shorten_layers(sub.to_dict(), total, keep)  # cut as its stack is
            for key, value in OTHER_SIZES.items():
                if _get(sub, key) is not None:
                    _set(sub, key, value)
    _shrink_text(text)
    _shared_block_layout(text, model_type)
    for key, value in SCALES.get(model_type, {}).items():
        _set(text, key, value)
    derived = class_derived_keys(model_type)  # Zamba's and Zamba2's: computed again from the small sizes
    if text is config and derived:
        config = _rederived(config, derived)
    raw = config.to_dict()
    for name, cut in cuts.items():
        if isinstance(raw.get(name), dict):
            raw[name].update(cut)
    raw["model_type"] = model_type
    section = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    for key in [k for k, v in section.items() if _non_finite(v)]:
        del section[key]  # JSON has no infinity (Mamba2's time_step_limit [0, inf]): the class default stays
    layers = _get(text, "num_hidden_layers")
    if "num_hidden_layers" not in section and isinstance(layers, int):
        section["num_hidden_layers"] = layers  # a property of Nemotron-H's class; published JSON states it
    _drop_layers_beyond(raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw)
    _tiny_latent_layers(section)
    return raw


def _shared_block_layout(config: Any, model_type: str) -> None:
    """A shared-block stack (Zamba, Zamba2) keeps a mixer layer and a hybrid layer once more than it has
    blocks, so that a block serves two hybrid layers (transformers cannot tie Zamba's one block with a
    single hybrid layer); other stacks are left as they are."""
    rule = shared_blocks_rule(model_type)
    types = _get(config, "layer_types")
    if rule is None or not isinstance(types, list):
        return
    count = rule["count"] if isinstance(rule["count"], int) else _get(config, rule["count"])
    mixer = next((t for t in types if t != rule["layer_type"]), None)
    pair = [t for t in (mixer, rule["layer_type"]) if t is not None]
    layout = pair * (int(count) + 1)
    _set(config, "layer_types", layout[: max(MAX_LAYERS, len(pair) * 2)])
    _set(config, "num_hidden_layers", len(_get(config, "layer_types")))


def _rederived(config: Any, derived: tuple[str, ...]) -> Any:
    """``config`` built again from its shrunk values without ``derived``, so its class derives those
    from the small sizes (setting attributes does not run ``__post_init__`` again, and a derived key
    passed back in would override what the class computes)."""
    values = {key: value for key, value in config.to_dict().items() if key not in derived}
    return type(config)(**values)


def _tiny_latent_layers(section: dict[str, Any]) -> None:
    """A stack whose multi-head latent attention differs per layer (dots3's sliding layers): its config
    object refuses global reads of the overridden attributes, so ``_shrink_text`` left them; the stack's
    latent sizes and each kept layer's are made tiny here, on the JSON
    (``layer_shapes.tiny_latent_layers``)."""
    listed = section.get("per_layer_config")
    if not isinstance(listed, dict) or not listed or section.get("kv_lora_rank") is None:
        return
    key_of = {fact: key for key, fact in per_layer_attributes().items()}
    stack = {fact: section[key_of[fact]] for fact in LATENT_LAYER_FACTS}
    tiny = {fact: TEXT_SIZES[key_of[fact]] for fact in LATENT_LAYER_FACTS}
    tiny["qk_rope_head_dim"] = TEXT_SIZES["qk_rope_head_dim"]
    section.update({key_of[fact]: tiny[fact] for fact in LATENT_LAYER_FACTS})
    if key_of["num_kv_heads"] in section:  # MLA: one KV head per query head
        section[key_of["num_kv_heads"]] = tiny["num_heads"]
    layers = int(section.get("num_hidden_layers") or 0)
    section["per_layer_config"] = tiny_latent_layers(listed, stack, tiny, layers, "head_dim" in section)


def _non_finite(value: Any) -> bool:
    """A float or a list holding one that is infinite or NaN."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(v, float) and not math.isfinite(v) for v in values)


def _drop_layers_beyond(text: dict[str, Any]) -> None:
    """Per-layer overrides (``per_layer_config``) of layers the tiny stack no longer has."""
    overrides = text.get("per_layer_config")
    layers = text.get("num_hidden_layers")
    if isinstance(overrides, dict) and isinstance(layers, int):
        text["per_layer_config"] = {k: v for k, v in overrides.items() if int(k) < layers}
