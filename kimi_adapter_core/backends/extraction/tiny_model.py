"""A tiny random-weight copy of the spec's model: what both checks of equivalence build.

The pre-export whole-model check (``job/whole_model.py``) and ``--verify`` (``equivalence/roundtrip.py``)
compare the wrappers with transformers on the same small model: every size shrunk through the config
key the model's structure read it from (so any family shrinks the same way), and every tensor that
transformers initialises to one constant (biases, norm scales) made random, so that a graph dropping
one of them cannot still equal the reference."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...spec.model import Spec
from ...structure.kv_sharing import kv_sharing_rule
from ...structure.layer_pattern import pattern_period, shorten_layers
from ...structure.layer_shapes import LATENT_LAYER_FACTS, tiny_latent_layers
from ...structure.model import ModelStructure
from ...structure.of_spec import structure_of_raw, text_config_key
from ...structure.shared_blocks import class_derived_keys, shared_blocks_rule
from .options import ExtractionOptions

# Sizes of the tiny text backbone, by structural fact: each is written to whichever config key the
# model's structure read that fact from (``ModelStructure.keys``), so any family shrinks the same way.
TINY_FACTS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "dense_intermediate_size": 128,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_layers": 3,
    "first_dense_layers": 1,
    "num_experts": 8,
    "top_k": 2,
    "expert_groups": 1,
    "top_k_groups": 1,
    "num_shared_experts": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "vocab_size": 128,
    "num_heads": 4,
    "head_dim": 16,
    # shorter than the verify prompt, so sliding-window masks decide the result
    "sliding_window": 4,
    # chunked attention (Llama-4): the verify's prompt and decode cross several chunk boundaries
    "attention_chunk_size": 4,
    # gated DeltaNet: value heads grouped 2 per key head, as the published configs do
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    # KDA: as many key as value heads, one width for both
    "kda_num_heads": 4,
    "kda_head_dim": 8,
    # Mamba2: 2 B/C groups of a small state (its heads and their width stay: Mamba2's and Bamba's configs
    # check them against hidden_size x expand, which families state differently)
    "mamba_groups": 2,
    "mamba_state_size": 16,
    # lightning attention (MiniMax): prefill blocks shorter than the verify prompt, so it spans several
    # blocks and a partial one (each block carries the state into the next)
    "lightning_block_size": 16,
    # DSA: fewer keys than a verify context holds, so the indexer's top-k selection decides the result.
    # As many indexer heads as GLM-5 publishes: a key's score is sum over heads of weight x relu(q.k), so a
    # query whose few head weights are all negative ranks every key with all-negative dot products equal
    # at 0, and which tied key top-k keeps has no defined answer (with 8 heads GLM-5's 200-step verify met
    # such a tie at decode step 80; with 32 the chance is ~2^-32 a query)
    "index_n_heads": 32,
    "index_head_dim": 16,
    "index_topk": 4,
    # DeepSeek-V4's compressors: windows of 4 tokens, so the verify's prompt closes some and its decode
    # closes several more (each a compressed entry written at its slot)
    "compress_rates": {"heavily_compressed_attention": 4, "compressed_sparse_attention": 4},
}


# With group-limited routing (DeepSeek's n_group/topk_group), the tiny router keeps groups: 4 groups of
# 2 experts, the top 2 groups chosen, so the group mask decides which experts can win.
TINY_EXPERT_GROUPS = {"expert_groups": 4, "top_k_groups": 2}


# The tiny stack holds at least one whole period of the layer pattern (sliding/full), up to this many.
TINY_MAX_LAYERS = 8


# KV heads of the tiny model keep the attention kind: 4 of 4 (MHA, MLA), 2 of 4 (GQA), 1 (MQA).
TINY_KV_HEADS = {"mha": 4, "mla": 4, "gqa": 2, "mqa": 1}


# Random weights at the default 0.02 give near-uniform logits whose argmax float noise could flip;
# wider weights make greedy tokens a meaningful comparison.
TINY_INITIALIZER_RANGE = 0.2


# Other sub-models (a vision tower) are built but not extracted: only make them small.
TINY_OTHER = {
    "hidden_size": 32,
    "vt_hidden_size": 32,
    "mm_hidden_size": 32,
    "num_hidden_layers": 1,
    "vt_num_hidden_layers": 1,
    "num_attention_heads": 2,
    "vt_num_attention_heads": 2,
    "intermediate_size": 64,
    "vt_intermediate_size": 64,
    "text_hidden_size": TINY_FACTS["hidden_size"],
    # dots3's encoder adapters: their input is the encoder's width, their output the text model's
    "adapter_in_dim": 32,
    "adapter_input_size": 32,
    "adapter_out_dim": TINY_FACTS["hidden_size"],
}


# Root-config sizes of a vision-language model's projector, set when the spec exports the vision graph:
# the projector's input width lives on the root config (Kimi_K25Config.projection_hidden_size, absent
# from the shipped config, default 1152) and must match the tiny encoder's.
TINY_PROJECTOR = {"projection_hidden_size": TINY_OTHER["vt_hidden_size"]}


TINY_VISION_LAYERS = 3


VISION_LAYER_KEYS = (".num_hidden_layers", ".vt_num_hidden_layers")


TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "media_placeholder_token_id": 3}


# Attention settings that only act at long positions, set where the text config has them: Llama-4's NoPE
# layers scale their queries by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1, exactly 1 below
# floor_scale - 1 (8191 in published configs); at 4 the verify's positions are scaled (a wrong scale fails).
TINY_LONG_CONTEXT = {"floor_scale": 4}


def tiny_layer_count(structure: ModelStructure) -> int:
    """Layers of the tiny stack: ``TINY_FACTS["num_layers"]``, or one whole period of the model's
    sliding/full pattern when that is longer (a 5:1 pattern needs 6 layers to have a full one), or,
    for a pattern with no short period, enough layers to hold every kind once (at most
    ``TINY_MAX_LAYERS``); never more than the model has. A hybrid stack gets two periods (3 linear : 1
    full makes 8 layers), so its second period is replicated from the first and the check covers it."""
    period = pattern_period([(layer.attention, layer.window) for layer in structure.layers], TINY_MAX_LAYERS)
    if structure.linear is not None:
        period *= 2
    return min(max(TINY_FACTS["num_layers"], min(period, TINY_MAX_LAYERS)), structure.num_layers)


def _shared_tail(structure: ModelStructure, section: dict[str, Any], layers: int) -> dict[str, Any]:
    """A KV-sharing stack's tiny layers (Gemma-4): the tiny stack of ``layers`` computes its own keys and
    values, then a tail of one sharing layer per layer type the model's tail holds, in the order of their
    last occurrence (so the tail ends as the model does: Gemma-4's last layer is full attention); each
    reads the last earlier tiny layer of its type, which the tiny stack must have (else nothing is
    added and the tiny model keeps no sharing layer, which the check then refuses to call proven)."""
    rule = kv_sharing_rule(structure.model_type)
    types = section.get("layer_types")
    if rule is None or not structure.shared_layer_ids or not isinstance(types, list):
        return {}
    tail = [types[i] for i in structure.shared_layer_ids]
    order = sorted(set(tail), key=lambda t: max(i for i, u in enumerate(tail) if u == t))
    if not set(order) <= set(types[:layers]):
        return {}
    return {
        "layer_types": [*types[:layers], *order],
        structure.keys["num_layers"]: layers + len(order),
        rule["key"]: len(order),
    }


# A shared-block stack (Zamba2): SSM heads that split the tiny mixer's channels, small adapters, and
# (``_shared_block_layout``) a mixer layer and a hybrid layer repeated once more than there are blocks, so
# that a block serves two hybrid layers, each with its own adapters, and the mixer layers run between.
TINY_SHARED_BLOCKS = {"mamba_num_heads": 4, "adapter_rank": 8}


def _shared_block_layout(structure: ModelStructure, section: dict[str, Any]) -> dict[str, Any]:
    """A shared-block stack's tiny layers: ``[mixer, hybrid] x (count + 1)`` in the config's own layer
    type names (hybrid layers alone when the model has no mixer layer), its SSM heads and adapter rank
    small; ``{}`` for other stacks."""
    blocks, key = structure.shared_blocks, structure.keys.get("layer_types")
    types = section.get(key) if key else None
    rule = shared_blocks_rule(structure.model_type)
    if blocks is None or rule is None or not isinstance(types, list):
        return {}
    by_span = {layer.attention: types[layer.index] for layer in reversed(structure.layers)}
    pair = [by_span[span] for span in ("linear", "hybrid") if span in by_span]
    repeats = min(blocks.count + 1, TINY_MAX_LAYERS // len(pair))
    sizes = {structure.keys["mamba_num_heads"]: TINY_SHARED_BLOCKS["mamba_num_heads"]}
    if isinstance(rule["adapter_rank"], str):  # a config key (else the family's fixed rank: Zamba's none)
        sizes[rule["adapter_rank"]] = TINY_SHARED_BLOCKS["adapter_rank"]
    return {**sizes, key: pair * repeats, structure.keys["num_layers"]: len(pair) * repeats}


def _class_derived(model_type: str, section: dict[str, Any], tiny: dict[str, Any]) -> dict[str, Any]:
    """The keys ``model_type``'s config class derives from the others (``shared_blocks`` ``derived``:
    Zamba2's attention and SSM head widths, its hybrid layer list) as it derives them from the tiny
    sizes: a stale value in the section would override the class's own."""
    keys = class_derived_keys(model_type)
    if not keys:
        return {}
    from transformers import CONFIG_MAPPING

    values = {k: v for k, v in {**section, **tiny}.items() if k not in keys and k != "model_type"}
    built = CONFIG_MAPPING[model_type](**values)
    return {key: getattr(built, key) for key in keys if key in section}


def _tiny_latent_layers(structure: ModelStructure, section: dict[str, Any], layers: int) -> dict[str, Any]:
    """The kept layers' ``per_layer_config`` of a stack whose multi-head latent attention differs per
    layer (dots3's sliding layers), tiny too (``layer_shapes.tiny_latent_layers``)."""
    listed = section.get("per_layer_config")
    if not structure.attention.is_mla or not isinstance(listed, dict):
        return {}
    stack = {fact: getattr(structure.attention, fact) for fact in LATENT_LAYER_FACTS}
    return {"per_layer_config": tiny_latent_layers(listed, stack, TINY_FACTS, layers, "head_dim" in section)}


def _tiny_text(structure: ModelStructure, section: dict[str, Any]) -> dict[str, Any]:
    """Overrides of the text config that keep ``structure``'s kinds at tiny sizes: the attention kind,
    a whole period of the sliding/full pattern, dense and MoE layers, the router's expert groups."""
    tiny = {structure.keys[fact]: value for fact, value in TINY_FACTS.items() if fact in structure.keys}
    if "num_kv_heads" in structure.keys:
        tiny[structure.keys["num_kv_heads"]] = TINY_KV_HEADS[structure.attention.kind]
    layers = tiny_layer_count(structure)
    tiny[structure.keys["num_layers"]] = layers
    tiny.update(shorten_layers(section, structure.num_layers, layers))
    tiny.update(_shared_tail(structure, section, layers))
    tiny.update(_shared_block_layout(structure, section))
    tiny.update(_tiny_latent_layers(structure, section, layers))
    if "max_window_layers" in structure.keys and structure.has_sliding_layers:
        tiny[structure.keys["max_window_layers"]] = 1  # layers from 1 on slide: full and sliding both present
    if structure.moe is not None and structure.moe.expert_groups > 1:
        tiny.update({structure.keys[f]: v for f, v in TINY_EXPERT_GROUPS.items() if f in structure.keys})
    tiny.update({key: value for key, value in TINY_LONG_CONTEXT.items() if key in section})
    tiny["initializer_range"] = TINY_INITIALIZER_RANGE
    return {**tiny, **_class_derived(structure.model_type, section, tiny)}


def tiny_overrides(spec: Spec, options: ExtractionOptions) -> dict[str, Any]:
    """Dotted config overrides that shrink the spec's model; the spec's own ``config_overrides`` win."""
    from ...config.source import resolve_source

    raw = resolve_source(spec).raw
    text_key = text_config_key(spec, isinstance(raw.get("text_config"), dict))
    structure = structure_of_raw(spec, raw)
    overrides: dict[str, Any] = {}
    for key, section in [(None, raw), *((k, v) for k, v in raw.items() if isinstance(v, dict))]:
        prefix = f"{key}." if key else ""
        if key == text_key:
            sizes = _tiny_text(structure, section)
        else:
            sizes = {name: value for name, value in TINY_OTHER.items() if key and name in section}
            total = section.get("num_hidden_layers")
            if "num_hidden_layers" in sizes and "per_layer_config" in section and isinstance(total, int):
                # a heterogeneous tower (dots3's vision MoE schedule): its per-layer lists cut as its stack
                sizes.update(shorten_layers(section, total, min(total, sizes["num_hidden_layers"])))
        sizes.update({name: value for name, value in TOKEN_IDS.items() if name in section})
        overrides.update({prefix + name: value for name, value in sizes.items()})
    if options.vision is not None:
        overrides.update(TINY_PROJECTOR)
        # an exported vision encoder gets 3 layers, so the check runs a stitched one (2 traced, 1 copied)
        for name in list(overrides):
            section = name.partition(".")[0]
            if name.endswith(VISION_LAYER_KEYS) and "." in name and section != text_key:
                overrides[name] = TINY_VISION_LAYERS
    overrides.update(options.verify_overrides)
    return overrides


# Relative spread given to every tensor transformers initialises to one constant value.
CONSTANT_SPREAD = 0.1


# Integer buffers that hold indices, by name -> the attribute of their module that bounds them: DeepSeek-V4's
# hash router's ``tid2eid`` [vocab, top_k] (each token's experts; transformers' init leaves it all zeros)
INDEX_TABLES = {"tid2eid": "num_experts"}


def randomize_constants(model: nn.Module) -> list[str]:
    """Give every parameter and persistent buffer that holds one constant value (biases and the MoE
    router's correction bias at 0, norm weights at 1) random values around it; return their names.

    transformers' init leaves them constant, so a graph that dropped a bias or a norm scale would still
    equal the reference: with them random, ``--verify`` is a proof for every weight, not only the
    matrices. Non-persistent buffers (rotary frequencies) are computed, not loaded, and stay as built.
    An index table (``INDEX_TABLES``) left constant gets random valid indices instead.
    """
    generator = torch.Generator().manual_seed(1)
    changed = []
    with torch.no_grad():
        for module_name, module in model.named_modules():
            tensors = list(module.named_parameters(recurse=False)) + [
                (n, b)
                for n, b in module.named_buffers(recurse=False)
                if n not in module._non_persistent_buffers_set
            ]
            for name, tensor in tensors:
                bound = getattr(module, INDEX_TABLES.get(name, ""), None)
                if isinstance(bound, int) and tensor.dim() == 2 and tensor.min() == tensor.max():
                    # rows of distinct indices below ``bound``: every token routed its own way
                    picks = torch.rand(tensor.shape[0], bound, generator=generator).argsort(dim=-1)
                    tensor.copy_(picks[:, : tensor.shape[1]].to(tensor.dtype))
                    changed.append(f"{module_name}.{name}" if module_name else name)
                    continue
                if not tensor.is_floating_point() or tensor.numel() < 2 or tensor.min() != tensor.max():
                    continue
                value = float(tensor.flatten()[0])
                noise = torch.randn(tensor.shape, generator=generator).to(tensor.dtype) * CONSTANT_SPREAD
                tensor.copy_(noise if value == 0 else value * (1 + noise))
                changed.append(f"{module_name}.{name}" if module_name else name)
            padding = getattr(module, "padding_idx", None)
            if isinstance(module, nn.Embedding) and padding is not None:
                # the padding token's row starts at zero: a tiny model that generates that token would
                # feed zeros on, and a DSA indexer would score every key 0 (a tie topk breaks any way)
                row = module.weight[padding]
                row.copy_(torch.randn(row.shape, generator=generator).to(row.dtype) * module.weight.std())
                changed.append(f"{module_name}.weight[{padding}]")
    return changed


def random_mtp(model: nn.Module) -> nn.Module:
    """transformers' ``MtpModel`` of the tiny CPU ``model`` (``abi.step.mtp``), every weight of its layer
    drawn: its own init leaves the routed experts and the router uninitialised (a checkpoint always
    supplies them), and the norms and the router's correction bias constant (``randomize_constants``)."""
    from .runtime.mtp import mtp_model

    drafts = mtp_model(model)
    with torch.no_grad():
        for parameter in drafts.layers.parameters():
            parameter.normal_(0.0, model.config.get_text_config().initializer_range)
    randomize_constants(drafts.layers)
    return drafts
