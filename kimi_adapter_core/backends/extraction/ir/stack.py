"""The decoder stack kadapt exports, and the checks it must pass before anything is traced.

``Backbone`` is the spec's model seen through its module paths (the language model, its parts, the LM
head); the checks refuse, with the stack-layout reason and the spec line, a stack whose layers the
prefill/decode wrappers cannot call the way the model's own forward does (arguments the model computes
once, a mixer that does not know its index), and a model whose experts cannot export. Split from
``export.py``, which traces what passes them.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .... import upstream
from ....errors import KadaptError, Refusal
from ....spec.model import LAYER_ATTENTION, LAYERS, STACK_PARTS, StackParts
from ..runtime import abi as runtime


@dataclass(frozen=True)
class Backbone:
    """The text backbone inside the full model, as the spec's module_paths name it."""

    model: nn.Module
    language_model: nn.Module
    lm_head: nn.Module
    parts: StackParts = StackParts()  # where the stack keeps its embedding, final norm, rotary embedding

    @property
    def config(self) -> Any:
        return self.language_model.config

    @property
    def layers(self) -> list[nn.Module]:
        """The decoder layers, at ``module_paths.language_layers`` (``parts``' ``layers``)."""
        return runtime.stack_layers(self.language_model, self.parts.stated)

    @property
    def device(self) -> torch.device:
        return next(self.language_model.parameters()).device


# what a decoder layer's forward may take: the wrappers pass the first five (and the cache under its
# keyword), what one layer hands the next and the stack's per-call inputs; any other named input is
# something the model's forward computes and the wrappers do not. ``transformer_hidden_states``: what
# Zamba2's hybrid layer hands its own mixer sublayer; the model's forward never passes it to a layer of
# the stack (a mixer layer alone leaves it None, as the wrappers do)
# the keywords a layer takes the cache under (``upstream.probe_decoder_layers`` finds which)
CACHE_INPUTS = frozenset({"cache", "layer_past", "past_key_values", "past_key_value"})
LAYER_INPUTS = frozenset(
    {"self", "hidden_states", "attention_mask", "position_ids", "position_embeddings", "use_cache",
     "cache_position", "output_attentions", "kwargs", runtime.CAUSAL_MASK_INPUT,
     "transformer_hidden_states"}
) | CACHE_INPUTS | frozenset(runtime.CARRIED_INPUTS) | frozenset(runtime.STACK_INPUTS)  # fmt: skip
# a decoder layer's cross-attention inputs (GPT-2, GPTBigCode, TrOCR, XGLM): the causal LM's forward hands
# them None unless the caller gives encoder states, which a text prompt never does; the wrappers leave
# them at their default, None, and the layer skips its cross-attention
ENCODER_INPUTS = frozenset({"encoder_hidden_states", "encoder_attention_mask"})
# inputs a layer of a stack whose prompts are never padded (a linear mixer's state takes every token) may
# take and the wrappers leave at their default, None, which is what the model's forward passes without
# padding: Falcon-H1's mixer padding mask (``create_recurrent_attention_mask``)
UNPADDED_INPUTS = frozenset({"mamba_attention_mask"})
# the NoPE layers' query scale (Beam's): the wrappers compute it with the stack's modelling module's
# ``compute_attention_scaling`` (``runtime.AttentionScaling``); a stack without that function computes
# it some other way
SCALING_INPUT = "attention_scaling"
# child module class names of a decoder layer that mixes tokens without attention
NON_ATTENTION = ("Mamba", "Mixer", "Linear", "Conv", "Recurrent", "DeltaNet", "Rwkv", "Lstm")


def check_parts(backbone: Backbone) -> None:
    """Refuse (``stack-layout``) a stack without a part where ``backbone.parts`` says it is (the layer
    list at ``module_paths.language_layers``, the embedding, final norm and rotary embedding)."""
    stack, parts = backbone.language_model, backbone.parts
    for key in (LAYERS, *STACK_PARTS):
        try:
            runtime.stack_part(stack, key, parts.stated)
        except AttributeError:
            raise Refusal("stack-layout", parts.missing(stack, key), location=parts.where(key)) from None


# names of a stack's direct child that holds position embeddings added to the token embeddings (GPT-2's
# ``wpe``, OPT's ``embed_positions``, OpenAI-GPT's ``positions_embed``)
POSITION_NAMES = ("wpe", "pos")
POSITIONS_KEY = "position_embeddings"  # the module_paths key (and StackParts role) that names them


def check_positions(backbone: Backbone) -> None:
    """Refuse (``stack-layout``) a stack whose positions reach the layers other than through a rotary
    embedding, learned absolute position embeddings the spec names (``module_paths.position_embeddings``,
    which the wrappers add to the token embeddings), the mask and the cache: a learned table the spec
    does not name (an ``nn.Embedding`` child named ``POSITION_NAMES``), a named part that is no table
    (sinusoidal positions) and ALiBi biases added to the attention scores (``alibi_of``)."""
    stack, parts = backbone.language_model, backbone.parts
    token = runtime.stack_part(stack, "embeddings", parts.stated)
    named = runtime.stack_part(stack, POSITIONS_KEY, parts.stated)
    if named is not None and not isinstance(named, nn.Embedding) and not computes_positions(named):
        params = ", ".join(list(inspect.signature(type(named).forward).parameters)[1:])
        raise Refusal(
            "stack-layout",
            f"module_paths.{POSITIONS_KEY} names {parts.path(POSITIONS_KEY)}, a {type(named).__name__} whose "
            f"forward takes ({params}): the wrappers add absolute position embeddings to the token "
            "embeddings, a table (nn.Embedding) looked up at each row's positions or a module computing "
            "them from the positions alone (forward(position_ids): XGLM's sinusoidal table); a bias on "
            "the attention scores of each query and key is neither",
            location=parts.where(POSITIONS_KEY),
        )
    for name, child in stack.named_children():
        learned = isinstance(child, nn.Embedding) and child is not token and child is not named
        if learned and any(word in name.lower() for word in POSITION_NAMES):
            raise Refusal(
                "stack-layout",
                f"{type(stack).__name__} adds learned absolute position embeddings ({name}: "
                f"{type(child).__name__} of {child.num_embeddings} positions) to the token embeddings, "
                f"which the spec does not name: set module_paths.{POSITIONS_KEY}: {name} (relative to "
                "module_paths.language_model) and the prefill/decode wrappers add them at each row's "
                "positions",
                location=parts.where(POSITIONS_KEY),
            )
    alibi = alibi_of(stack)
    if alibi is not None and runtime.AlibiBias.of(stack) is None:
        raise Refusal(
            "stack-layout",
            f"{type(stack).__name__} adds ALiBi biases to the attention scores ({alibi}) other than through "
            "a builder of its own whose result every layer takes as alibi or position_bias (BLOOM's "
            "build_alibi_tensor, MPT's build_mpt_alibi_tensor), the ALiBi the prefill/decode wrappers "
            "build (runtime.AlibiBias: Falcon's too, folded into the mask as its forward does)",
        )


def computes_positions(module: nn.Module) -> bool:
    """Whether ``module`` computes position embeddings from the positions alone: its forward's first
    input is ``position_ids`` and any other has a default (XGLM's sinusoidal table)."""
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    return (
        bool(params)
        and params[0].name == "position_ids"
        and all(p.default is not p.empty or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params[1:])
    )


def alibi_of(stack: nn.Module) -> str | None:
    """Where ``stack`` says it uses ALiBi (None: it does not): its config's ``alibi`` flag (Falcon),
    ``attn_config.alibi`` (MPT), else an ALiBi builder in its modelling module that no flag turns off
    (BLOOM's ``build_alibi_tensor``)."""
    config = stack.config
    attn_config = getattr(config, "attn_config", None)
    for where, holder in (("config.alibi", config), ("config.attn_config.alibi", attn_config)):
        flag = holder.get("alibi") if isinstance(holder, dict) else getattr(holder, "alibi", None)
        if isinstance(flag, bool):
            return where if flag else None
    module = inspect.getmodule(type(stack))
    builders = sorted(  # the builder first (BLOOM's build_alibi_tensor, not its _get_alibi_slopes)
        (n for n, v in vars(module).items() if "alibi" in n.lower() and inspect.isfunction(v)),
        key=lambda n: not n.startswith("build"),
    )
    return f"{module.__name__}.{builders[0]}" if module is not None and builders else None


def check_per_layer_inputs(stack: nn.Module) -> None:
    """Refuse (``per-layer-inputs``) a config with per-layer embeddings whose stack lacks the parts and
    methods ``runtime.PerLayerInputs`` computes them with (contact point ``per_layer_inputs``)."""
    if not getattr(stack.config, "hidden_size_per_layer_input", None):
        return
    names = (*runtime.PerLayerInputs.PARTS, *runtime.PerLayerInputs.SCALARS)
    missing = [
        n for n in (*names, "get_per_layer_inputs", "project_per_layer_inputs") if not hasattr(stack, n)
    ]
    if missing:
        raise Refusal(
            "per-layer-inputs",
            f"{type(stack).__name__} has per-layer embeddings by its config (hidden_size_per_layer_input "
            f"{stack.config.hidden_size_per_layer_input}) but no {', '.join(missing)}: the wrappers compute "
            "them with the stack's own get_per_layer_inputs / project_per_layer_inputs",
        )


def check_stack(backbone: Backbone, kinds: Sequence[str] | None = None) -> None:
    """Refuse a stack the wrappers cannot drive: parts missing (``check_parts``), positions they do not
    hand the layers (``check_positions``: GPT-2's learned positions, BLOOM's ALiBi), per-layer
    embeddings it cannot compute (``check_per_layer_inputs``), or a layer without the mixer of its kind
    (``kinds``; None: all attention; ``runtime.MIXER_ATTRIBUTES``) that knows its ``layer_idx``
    (``hybrid`` when it mixes tokens another way)."""
    check_parts(backbone)
    check_positions(backbone)
    stack = backbone.language_model
    check_per_layer_inputs(stack)
    # a query scale only a stack whose modelling module computes it is handed (runtime.AttentionScaling)
    unscaled = frozenset() if runtime.AttentionScaling.of(stack) is not None else {SCALING_INPUT}
    passed = _stack_forward_source(stack)
    for index, layer in enumerate(backbone.layers):
        params = inspect.signature(inspect.unwrap(type(layer).forward)).parameters
        unpadded = kinds is not None and kinds[index] in runtime.UNPADDED_KINDS
        allowed = (LAYER_INPUTS | ENCODER_INPUTS | (UNPADDED_INPUTS if unpadded else frozenset())) - unscaled
        # the first input is the hidden states, handed positionally whatever the layer calls it (CTRL:
        # x); an input with a default the stack's forward never names is left at it, as that forward
        # leaves it (Moshi's codebook_idx, which only its depth decoder hands its layers)
        hidden = next(iter(list(params)[1:2]), None)
        extra = [
            n
            for n, p in params.items()
            if n not in allowed
            and n != hidden
            and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
            and (p.default is p.empty or re.search(rf"\b{n}\b", passed))
        ]
        stateful = kinds is None or kinds[index] not in runtime.STATELESS_KINDS
        keyword = any(p.kind == p.VAR_KEYWORD for p in params.values())
        if stateful and not extra and not keyword and not CACHE_INPUTS & params.keys():
            takes = ", ".join(list(params)[1:])
            raise Refusal(
                "stack-layout",
                f"{type(layer).__name__}.forward (layer {index}) takes no cache ({takes}): its attention "
                f"keeps no keys and values between calls, and {type(stack).__name__}'s forward reruns "
                "every earlier token at each step; the ABI's decode step reads each layer's keys and "
                "values from the cache that layer writes, and no spec field makes a layer write one",
            )
        if extra:
            raise Refusal(
                "stack-layout",
                f"{type(layer).__name__}.forward (layer {index}) takes {', '.join(extra)}, which "
                f"{type(stack).__name__}'s forward computes and the prefill/decode wrappers do not",
            )
        if kinds is not None and kinds[index] in runtime.STATELESS_KINDS:
            continue  # no mixer, no state: nothing is addressed by its index
        if kinds is not None and kinds[index] in runtime.UNPADDED_KINDS:
            # a linear layer's mixer; a hybrid layer's linear mixer, then its attention below (all
            # addressed by the index)
            kind = kinds[index]
            names = runtime.MIXER_ATTRIBUTES[kind]
            try:
                mixer: nn.Module | None = runtime.mixer_of(layer, kind)
            except ValueError:
                mixer = None
            if getattr(mixer, "layer_idx", None) != index:
                raise Refusal(
                    "hybrid",
                    f"{type(layer).__name__} (layer {index}) is a {kind} layer by the config, but has no "
                    f"mixer ({', '.join(names)}) whose layer_idx is {index}: kadapt addresses its states by "
                    "that index",
                )
            if kind != "hybrid" or "layer_idx" in params:
                # no attention beside it, or one that caches under the index the wrappers hand the layer
                # (Zamba's and Zamba2's shared block: STACK_INPUTS layer_idx)
                continue
        attention = _attention(layer, index, backbone.parts)
        if attention is not None and runtime.index_of(attention) == index:
            continue
        others = [type(m).__name__ for _, m in layer.named_children()]
        hybrid = [n for n in others if any(word in n for word in NON_ATTENTION)]
        if hybrid:
            raise Refusal(
                "hybrid",
                f"{type(layer).__name__} (layer {index}) mixes tokens with {', '.join(hybrid)}, which the "
                "config does not describe as a linear-attention layer kadapt can size: its state is not a "
                "KV cache",
            )
        path = backbone.parts.stated.get(LAYER_ATTENTION)
        names = path or " / ".join(runtime.MIXER_ATTRIBUTES["attention"])
        found = (
            f"no attention at {names}"
            if attention is None
            else f"at {names} a {type(attention).__name__} whose layer index "
            f"({' / '.join(runtime.INDEX_ATTRIBUTES)}) is {runtime.index_of(attention)}"
        )
        raise Refusal(
            "stack-layout",
            f"{type(layer).__name__} (layer {index}) has {found} (children: {', '.join(others)}); the KV "
            f"cache is addressed by each attention's layer index: set module_paths.{LAYER_ATTENTION} to the "
            "attention inside a layer (relative to it) that caches under its own index",
            location=backbone.parts.where(LAYER_ATTENTION),
        )


def _stack_forward_source(stack: nn.Module) -> str:
    """The source of the stack's forward ("" where it has none to read): which inputs it hands its layers."""
    try:
        return inspect.getsource(inspect.unwrap(type(stack).forward))
    except (OSError, TypeError):
        return ""


def _attention(layer: nn.Module, index: int, parts: StackParts) -> nn.Module | None:
    """The attention of decoder layer ``index`` where ``parts`` says (or the usual names); None if it has
    none there. Refuses a layer that keeps several attentions in a list, each caching under an index of
    its own (LongCat-Flash: ``self_attn[0]``, ``self_attn[1]`` at ``2 i`` and ``2 i + 1``): it writes as
    many KV entries as it has attentions, and kadapt's cache holds one per decoder layer."""
    try:
        attention: nn.Module | None = runtime.mixer_of(layer, "attention", parts.stated.get(LAYER_ATTENTION))
    except ValueError:
        return None
    if isinstance(attention, nn.ModuleList):
        indices = [runtime.index_of(m) for m in attention]
        if len(attention) > 1 and all(isinstance(i, int) for i in indices):
            raise Refusal(
                "stack-layout",
                f"{type(layer).__name__} (layer {index}) runs {len(attention)} attentions in turn (a "
                f"ModuleList of {type(attention[0]).__name__}), caching under indices "
                f"{', '.join(map(str, indices))}: each decoder layer writes {len(attention)} KV cache "
                "entries, and the ABI's cache holds one per decoder layer (its k.{layer} / v.{layer} "
                "states); no spec field gives a layer more than one",
            )
    return attention


def probed_stack(language_model: nn.Module, parts: StackParts) -> Any:
    """The stack as upstream's probes read it: its ``layers`` and ``rotary_emb`` where the spec names them."""
    return runtime.probed_stack(language_model, parts.stated)


def check_exportable(backbone: Backbone) -> None:
    """Refuse MoE layers whose experts implementation cannot be exported (data-dependent loops)."""
    has_experts = any(upstream.is_experts_module(m) for m in backbone.language_model.modules())
    implementation = getattr(backbone.config, "_experts_implementation", None)
    if has_experts and implementation in (None, "eager"):
        raise KadaptError(
            f"the MoE experts use the {implementation or 'default eager'} implementation, which loops over "
            "nonzero() expert hits and cannot be exported with static shapes; set "
            "text_config._experts_implementation to batched_mm in the spec's config_bridges"
        )
