"""Prefill/decode ABI of a transformers decoder stack (any family: MHA/GQA/MQA/MLA, dense or MoE).

This module is self-contained on purpose (stdlib + torch only): ``kadapt generate`` embeds its source
verbatim in a standalone module that other tools import and hand to ``torch.export`` or
``torch_ir.extract_ir``. Both wrappers take positional tensors and return a flat tuple.

Why one module: it is embedded as one body into every generated extraction module, which imports
without kadapt; split, the generated modules would have to stitch several bodies back together in
the right order and keep their names from clashing, for no reader's gain. Its concern is one: the
ABI a runtime calls (wrappers, caches, masks, inputs and the KV mapping that describes them).

- ``PrefillWrapper(input_ids, attention_mask, position_ids)``
  -> ``(logits, present.0.key, present.0.value, ...)``
- ``DecodeWrapper(input_ids, attention_mask, position_ids, cache_position, past.0.key, past.0.value, ...)``
  -> ``(logits, present.0.key, present.0.value, ...)``, each present = past with row ``b``'s new
  token written at slot ``cache_position[b]`` (``write_rows``, functional, so one decode graph serves
  every position < max_cache_len and rows at different positions: rope comes from ``position_ids``,
  the mask is an input). With ``paged=True`` a ``block_table`` follows ``cache_position`` and each
  past/present is a block pool shared by the rows (``paged_write``/``paged_view``).
- ``MultimodalPrefillWrapper(input_ids, image_features, attention_mask, position_ids)``
  -> the prefill's outputs, for a prompt whose image placeholder tokens take the image features
  (``merge_image_features``: row k replaces the k-th placeholder, as transformers' ``masked_scatter``).

Math some families do outside their decoder layers is reproduced as data: ``embedding_ops`` on what
enters the first layer (Granite's ``embedding_multiplier``), ``logit_ops`` after the LM head (Cohere's
``logit_scale``, Granite's ``logits_scaling``, Gemma-2's final soft-capping), each ``(op, value)`` with
op ``mul``, ``div`` or ``softcap`` (``tanh(x / value) * value``), see ``apply_ops``.

The attention mask is the caller's additive float mask ``[B, 1, Q, K]`` (0 = attend, dtype-min =
masked), see ``additive_causal_mask``; cache slot ``k`` holds the token at position ``k``. Layers
with a sliding window additionally mask keys at or beyond ``window`` positions behind the query
(``k <= position - window``), and chunked layers (Llama-4) keys before the query's chunk
(``k < position - position % chunk``), inside the graph, so one mask input serves every layer. The wrappers
call the decoder layers themselves instead of the model's ``forward``: that skips transformers' mask
construction (which would rebuild a mask from a cache object), its DynamicCache and output-capturing
hooks, and lets an exporter trace any prefix of the layer stack (kadapt exports one layer per kind
and replicates it).

KV layouts (``kv_dims`` gives ``((key_heads, key_dim), (value_heads, value_dim))`` per token):
- ``heads`` (MHA/GQA/MQA): what the attention passes to ``Cache.update``, key and value
  ``[B, kv_heads, S, head_dim]`` after rope, per layer.
- ``latent`` (MLA): the compressed cache as transformers keeps it, key ``[B, 1, S, kv_lora_rank]`` and
  value ``[B, 1, S, qk_rope_head_dim]`` (the rope'd shared key); attention re-expands it each step.
- ``expanded`` (MLA): per-head key ``[B, H, S, qk_nope + qk_rope]`` and value ``[B, H, S, v_head_dim]``,
  i.e. the output of ``expand_kv`` (kv_b_proj + rope'd key broadcast per head) is what is cached.

MLA attention (``latent`` layout only):
- ``reexpand`` (default): the upstream attention, ``kv_b_proj`` re-expands the whole cache every step.
- ``absorbed``: ``kv_b_proj`` is absorbed into the query and the output (DeepSeek/FlashMLA style):
  scores ``(q_nope W_uk) kv_nope^T + q_rot k_rot^T``, output ``(probs kv_nope) W_uv^T``, so the cache
  is never expanded. Same math, same cache and presents; see ``absorbed_mla_forward``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

KV_LAYOUTS = ("heads", "latent", "expanded")
KVDims = tuple[tuple[int, int], tuple[int, int]]  # ((key_heads, key_dim), (value_heads, value_dim))
MLA_ATTENTIONS = ("reexpand", "absorbed")


def check_mla_attention(kv_layout: str, mla_attention: str) -> None:
    """``absorbed`` attends over the latent cache, so it needs ``kv_layout`` ``latent``."""
    if mla_attention not in MLA_ATTENTIONS:
        raise ValueError(f"unknown mla_attention {mla_attention!r}; valid: {', '.join(MLA_ATTENTIONS)}")
    if mla_attention == "absorbed" and kv_layout != "latent":
        raise ValueError(
            f"mla_attention 'absorbed' attends over the latent cache and needs kv_layout 'latent', "
            f"got kv_layout {kv_layout!r}"
        )


def _rope_helper(attn: nn.Module) -> Any:
    """The rope function the attention's own module uses (honouring ``config.rope_interleave``)."""
    module = sys.modules.get(type(attn).__module__)
    name = "apply_rotary_pos_emb_interleave" if attn.config.rope_interleave else "apply_rotary_pos_emb"
    helper = getattr(module, name, None)
    if helper is None:
        raise RuntimeError(f"absorbed MLA: {type(attn).__module__} has no {name}")
    return helper


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, Q, rope]`` with each interleaved pair ``(x[2i], x[2i+1])`` rotated by angle ``i``
    (``cos``/``sin`` ``[B, Q, rope / 2]``): a rope written with complex numbers (DeepSeek-V2's
    ``apply_rotary_emb``), given as ``(cos, sin)`` by its builtins, in real arithmetic, in float32, then
    back to ``x``'s dtype; the pairs stay interleaved, as in the cache the attention's own forward fills."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None], sin[:, None]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(3).type_as(x)


def absorbed_mla_forward(
    attn: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    *,
    cache_keyword: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``DeepseekV3Attention.forward`` with ``kv_b_proj`` absorbed (eager math, no dropout).

    The layer hands the cache over under ``cache_keyword`` (what ``upstream.probe_decoder_layers``
    found the layers take: ``past_key_values`` up to transformers 5.23, ``cache`` since 5.24).
    Projections, the latent split, ``kv_a_layernorm``, rope (the module's own helper, or, given one angle
    per interleaved pair, DeepSeek-V2's complex rope in real arithmetic) and the cache write are
    upstream's; then, with ``W = kv_b_proj.weight.view(H, qk_nope + v, r)`` split into ``W_uk``
    ``[H, qk_nope, r]`` and ``W_uv`` ``[H, v, r]``: ``q_lat = q_nope W_uk`` ``[B, H, Q, r]``, scores
    ``(q_lat kv_nope^T + q_rot k_rot^T) * scaling + mask``, softmax in fp32 cast back,
    ``out = (probs kv_nope) W_uv^T``.
    The cache (``[B, 1, S, r]``, ``[B, 1, S, rope]``) is read as is: no per-head keys or values.
    """
    batch_size, seq_length = hidden_states.shape[:-1]
    heads, nope, rope, v_dim = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    rank = attn.kv_lora_rank

    if attn.q_lora_rank is None:
        q_states = attn.q_proj(hidden_states)
    else:
        q_states = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
    q_states = q_states.view(batch_size, seq_length, -1, attn.qk_head_dim).transpose(1, 2)
    q_nope, q_rot = torch.split(q_states, [nope, rope], dim=-1)

    compressed_kv = attn.kv_a_proj_with_mqa(hidden_states)
    kv_nope, k_rot = torch.split(compressed_kv, [rank, rope], dim=-1)
    kv_nope = attn.kv_a_layernorm(kv_nope)
    kv_nope = kv_nope.view(batch_size, 1, seq_length, rank)
    k_rot = k_rot.view(batch_size, 1, seq_length, rope)

    cos, sin = position_embeddings
    if cos.shape[-1] * 2 == rope:  # one angle per interleaved pair: a complex rope as (cos, sin)
        q_rot, k_rot = _rotate_interleaved(q_rot, cos, sin), _rotate_interleaved(k_rot, cos, sin)
    else:
        q_rot, k_rot = _rope_helper(attn)(q_rot, k_rot, cos, sin)

    cache = kwargs.get(cache_keyword)
    if cache is not None:
        kv_nope, k_rot = cache.update(kv_nope, k_rot, attn.layer_idx)

    weight = attn.kv_b_proj.weight.view(heads, nope + v_dim, rank)
    w_uk, w_uv = torch.split(weight, [nope, v_dim], dim=1)  # [H, nope, r], [H, v, r]
    q_lat = torch.matmul(q_nope, w_uk)  # [B, H, Q, r]
    scores = torch.matmul(q_lat, kv_nope.transpose(2, 3)) + torch.matmul(q_rot, k_rot.transpose(2, 3))
    scores = scores * attn.scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q_states.dtype)
    out_lat = torch.matmul(probs, kv_nope)  # [B, H, Q, r]
    attn_output = torch.matmul(out_lat, w_uv.transpose(1, 2))  # [B, H, Q, v]
    attn_output = attn_output.transpose(1, 2).reshape(batch_size, seq_length, heads * v_dim).contiguous()
    return attn.o_proj(attn_output), None


@contextlib.contextmanager
def absorbing_mla(layers: Sequence[nn.Module], mla_attention: str, cache_keyword: str) -> Iterator[None]:
    """For ``absorbed``, shadow each layer's ``self_attn.forward`` with ``absorbed_mla_forward``.

    Like ``StaticStateCache.routing_expand_kv``: an instance attribute, only inside this block.
    """
    if mla_attention != "absorbed":
        yield
        return
    attentions = [layer.self_attn for layer in layers if getattr(layer, "self_attn", None) is not None]
    for attn in attentions:
        attn.__dict__["forward"] = functools.partial(absorbed_mla_forward, attn, cache_keyword=cache_keyword)
    try:
        yield
    finally:
        for attn in attentions:
            attn.__dict__.pop("forward", None)


OpList = Sequence[tuple[str, float]]
# The rope a decoder layer is handed (``upstream.rope_layer_types``): its layer type's (a str), none
# (None), or a dict of every label's (a tuple of labels: DeepSeek-V4's ``{"main", "compress"}``)
RopeKey = str | tuple[str, ...] | None


def apply_ops(tensor: torch.Tensor, ops: OpList) -> torch.Tensor:
    """``tensor`` through ``ops`` in order, as the model's own forward applies them."""
    for op, value in ops:
        if op == "mul":
            tensor = tensor * value
        elif op == "div":
            tensor = tensor / value
        elif op == "softcap":
            tensor = torch.tanh(tensor / value) * value
        else:
            raise ValueError(f"unknown op {op!r}; valid: mul, div, softcap")
    return tensor


def kv_shapes(
    kv_dims: KVDims, batch: int | str, length: int | str
) -> tuple[tuple[int | str, ...], tuple[int | str, ...]]:
    """Shapes of one layer's cached key and value for ``length`` positions (a str: a dynamic size)."""
    (key_heads, key_dim), (value_heads, value_dim) = kv_dims
    return (batch, key_heads, length, key_dim), (batch, value_heads, length, value_dim)


def layer_dims(kv_dims: KVDims, layer_kv_dims: Sequence[KVDims] | None, layer: int) -> KVDims:
    """Layer ``layer``'s KV dims: its own when the stack's layers cache different shapes (``layer_kv_dims``,
    one per layer: MiMo-V2-Flash's sliding layers have more KV heads), else the stack's ``kv_dims``."""
    return kv_dims if layer_kv_dims is None else layer_kv_dims[layer]


def additive_causal_mask(query_positions: torch.Tensor, key_length: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, Q, K]`` mask for ``query_positions`` ``[B, Q]``: key ``k`` visible iff ``k <= position``."""
    keys = torch.arange(key_length, device=query_positions.device)
    allowed = keys.view(1, 1, 1, key_length) <= query_positions.unsqueeze(1).unsqueeze(-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=query_positions.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


def sliding_window_mask(
    attention_mask: torch.Tensor, position_ids: torch.Tensor, window: int
) -> torch.Tensor:
    """``attention_mask`` with keys ``window`` or more positions behind each query masked too.

    transformers' sliding-window overlay: key ``k`` visible to the query at ``p`` iff ``p - k < window``.
    """
    keys = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    too_old = keys.view(1, 1, 1, -1) <= (position_ids - window).unsqueeze(1).unsqueeze(-1)
    return attention_mask.masked_fill(too_old, torch.finfo(attention_mask.dtype).min)


def chunked_window_mask(attention_mask: torch.Tensor, position_ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """``attention_mask`` with keys before each query's chunk masked too (chunked attention: Llama-4).

    transformers' chunked overlay: key ``k`` visible to the query at ``p`` iff ``k // chunk == p //
    chunk`` (and ``k <= p``, the caller's mask), i.e. masked iff ``k < p - p % chunk``: a causal window
    of ``p % chunk + 1`` keys that depends on the query, unlike a sliding window of the same size.
    """
    keys = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    chunk_start = position_ids - torch.remainder(position_ids, chunk)
    before = keys.view(1, 1, 1, -1) < chunk_start.unsqueeze(1).unsqueeze(-1)
    return attention_mask.masked_fill(before, torch.finfo(attention_mask.dtype).min)


def write_rows(cache: torch.Tensor, new: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
    """``cache`` ``[B, heads, S, dim]`` with row ``b``'s new token ``new[b]`` ``[heads, 1, dim]`` at slot
    ``cache_position[b]``: rows at different positions in one step (continuous batching).

    Written as ``where(slot == position)`` rather than a scatter: plain elementwise ATen ops that any
    executor runs, for a static or a dynamic batch.
    """
    slots = torch.arange(cache.shape[2], device=cache.device).view(1, 1, -1, 1)
    return torch.where(slots == cache_position.view(-1, 1, 1, 1), new, cache)


def paged_slots(cache_position: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Physical slot of each row's token (the paged slot rule):
    ``block_table[b, p // block_size] * block_size + p % block_size``."""
    blocks = block_table.gather(1, torch.div(cache_position, block_size, rounding_mode="floor").view(-1, 1))
    return blocks.view(-1) * block_size + torch.remainder(cache_position, block_size)


def paged_write(
    pool: torch.Tensor, new: torch.Tensor, cache_position: torch.Tensor, block_table: torch.Tensor
) -> torch.Tensor:
    """``pool`` ``[num_blocks, block_size, heads, dim]`` with row ``b``'s new token (``new`` ``[B, heads,
    1, dim]``) written at its physical slot (``paged_slots``); functional ``index_copy`` on the pool
    viewed as ``[num_blocks * block_size, heads, dim]``."""
    num_blocks, block_size, heads, dim = pool.shape
    slots = paged_slots(cache_position, block_table, block_size)
    flat = pool.reshape(num_blocks * block_size, heads, dim).index_copy(0, slots, new.squeeze(2))
    return flat.view(num_blocks, block_size, heads, dim)


def paged_view(pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The logical cache ``[B, heads, blocks * block_size, dim]`` of each row: its blocks from ``pool``
    in ``block_table`` order, so logical slot ``k`` is position ``k`` and the mask rule is unchanged."""
    _, block_size, heads, dim = pool.shape
    batch, blocks = block_table.shape
    rows = pool.index_select(0, block_table.reshape(-1))  # [B * blocks, block_size, heads, dim]
    return rows.view(batch, blocks * block_size, heads, dim).transpose(1, 2)


# The state tensors each layer kind carries, in ABI order (``past.{layer}.{name}`` / ``present...``).
#  attention: the KV cache (``kv_layout`` says what key and value hold);
#  linear:    a linear-attention / SSM mixer's short-convolution window and recurrent state, the two
#             states transformers' ``LinearAttentionLayer`` keeps (``conv_states``/``recurrent_states``).
#  lightning: MiniMax's lightning attention: its recurrent state alone (``K^T V`` decayed per head,
#             transformers' ``MiniMaxCache.linear_cache``), no conv window.
#  short_conv: LFM2's gated short convolution: its conv window alone (transformers keeps it in a
#             ``LinearAttentionLayer`` whose recurrent state stays empty), no recurrent state.
#  indexed:   full attention with DeepSeek sparse attention's indexer: the KV cache, plus the indexer's
#             own keys ``[B, 1, S, index_head_dim]`` (one head), cached, written and paged like a key.
#  none:      a block with no token mixer (an MLP alone: Nemotron-H's mlp and moe blocks, transformers'
#             DummyLayer): no state, and the wrappers hand it neither a mask nor the cache.
#  shared:    attention over the keys and values an earlier layer of the same call computed (Gemma-4's
#             KV sharing: the producer hands them over in ``shared_kv_states``): no state of its own;
#             it takes its span's mask, and the cache it never touches.
#  hybrid:    full attention and a linear mixer in one layer, their states addressed by one ``layer_idx``:
#             side by side on one input (Falcon-H1; transformers' ``LinearAttentionAndFullAttentionLayer``)
#             or one after the other (Zamba's and Zamba2's hybrid layers: a shared transformer block, then
#             their own Mamba mixer): the attention's KV cache, then the mixer's conv window and recurrent
#             state; it takes the attention mask (its mixer's padding mask stays None, as the model's
#             forward leaves it without padding, which such stacks never have).
#  hca:       DeepSeek-V4's heavily compressed attention: a sliding window of K=V (key, value, as
#             attention) beside a compressor that turns every closed window of ``rate`` tokens into one
#             entry: ``comp_src`` ``[B, 1, rate, 2 * head_dim]`` the ring of the raw ``kv_proj ||
#             gate_proj`` of the current window's tokens (slot ``p % rate``), ``comp`` ``[B, 1,
#             max_cache_len / rate, head_dim]`` the entries (slot ``w``: window ``w``), written by the
#             ``deepseek_v4_hca_compressor`` builtin through ``compressed_window``/``write_compressed``.
LAYER_STATES = {
    "attention": ("key", "value"),
    "linear": ("conv", "recurrent"),
    "lightning": ("recurrent",),
    "short_conv": ("conv",),
    "indexed": ("key", "value", "index_key"),
    "none": (),
    "shared": (),
    "hybrid": ("key", "value", "conv", "recurrent"),
    "hca": ("key", "value", "comp_src", "comp"),
    "csa": ("key", "value", "comp_src", "comp", "index_src", "index_comp"),
}


def per_layer_states(states: Sequence[torch.Tensor], kinds: Sequence[str]) -> list[tuple[torch.Tensor, ...]]:
    """Split a graph's flat state inputs into one tuple per layer, in ``LAYER_STATES`` order.

    Graph inputs are flat (an exported graph takes tensors, not nested tuples); every wrapper that
    takes states splits them by the same rule, so it lives here once.
    """
    counts = [len(LAYER_STATES[kind]) for kind in kinds]
    if len(states) != sum(counts):
        raise ValueError(f"expected {sum(counts)} past state tensors, got {len(states)}")
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [tuple(states[start : start + n]) for start, n in zip(starts, counts, strict=True)]


# States of one fixed size per request (no sequence dimension): never placed by position, never paged.
# A compressor's ring (``comp_src``, ``index_src``) is one: the prefill returns it already placed.
FIXED_ROLES = ("conv", "recurrent", "comp_src", "index_src")
# Compressed entries: per request (never paged), slot ``w`` holds window ``w``, ``max_cache_len / rate``
# slots; placed from the prefill's ``floor(prefill_len / rate)`` entries like a key (``place_compressed``).
COMPRESSED_ROLES = ("comp", "index_comp")
# A compressor's series: its ring and its entries (a CSA layer's indexer runs one of its own)
COMPRESSED_SERIES = {"comp": ("comp_src", "comp"), "index": ("index_src", "index_comp")}
# Layer kinds with a compressor, by the windows their ring holds (csa: the previous one too): their ring
# is placed from the prompt's length, so their stack's prompts are never padded either (the contract's
# padding).
LAYER_RINGS = {"hca": 1, "csa": 2}
COMPRESSED_KINDS = tuple(LAYER_RINGS)
# Layer kinds whose states are all fixed-size per request (the contract's ``linear_states`` rules): they
# take every token they are given, so the wrappers hand them no mask.
LINEAR_LAYER_KINDS = ("linear", "lightning", "short_conv")
# Layer kinds that keep fixed-size states (a linear mixer's, alone or beside attention: ``hybrid``), whose
# state takes every token of a prompt: their stack's prompts are never padded (the contract's padding).
UNPADDED_KINDS = (*LINEAR_LAYER_KINDS, "hybrid")
# Where a decoder layer keeps its token mixer, by layer kind (the mixer carries ``layer_idx``): attention
# in ``self_attn`` or, in a stack of one-sublayer blocks (Nemotron-H), ``mixer``, or under an older name
# (GPT-J, CodeGen: ``attn``; GPT-NeoX: ``attention``; Falcon: ``self_attention``); gated DeltaNet in
# ``linear_attn``, Mamba2 in ``mixer`` (Mamba2, Nemotron-H) or ``mamba`` (Granite-4.0-H, Bamba), KDA in
# ``self_attn`` (Kimi-Linear, Bailing-hybrid), a short convolution in ``conv`` (LFM2, LFM3). A block with no
# mixer (``none``) has none to look up (``layer_index``); a hybrid layer's attention and linear mixer
# share one index, read from the mixer: ``mamba`` beside its ``self_attn`` (Falcon-H1) or inside its mixer
# sublayer (Zamba, Zamba2: ``mamba_decoder.mamba``, whose shared block's attention has no index of its own
# and caches under the index the layer hands it).
MIXER_ATTRIBUTES = {
    "attention": ("self_attn", "mixer", "attn", "attention", "self_attention"),
    "linear": ("linear_attn", "mixer", "mamba", "conv", "self_attn"),
    "lightning": ("self_attn",),
    "short_conv": ("conv",),
    "indexed": ("self_attn",),
    "none": (),
    "shared": ("self_attn",),
    "hybrid": ("mamba", "mamba_decoder.mamba"),
    "hca": ("self_attn",),
    "csa": ("self_attn",),
}
# Layer kinds that keep no state: the wrappers hand them neither a mask nor the cache.
STATELESS_KINDS = ("none",)


# Layer inputs the wrappers hand from one decoder layer to the next, as the model's forward does: a layer
# that returns ``(hidden_states, *extra)`` gives ``extra`` to the next layer under these names, in order,
# where that layer's forward takes them (GLM-5's DSA layers return their top-k for a layer that reuses
# it: ``prev_topk_indices``).
CARRIED_INPUTS = ("prev_topk_indices",)


# Layer inputs the model's forward builds once per call and hands to every decoder layer that takes
# them: Gemma-4's ``shared_kv_states`` (a dict its KV-storing layers fill with the keys and values they
# attend over, for the KV-shared layers after them; transformers' KVSharingDict is a dict), fresh per
# call, and ``per_layer_input`` (``PerLayerInputs``: each layer's slice of the per-layer embeddings, or
# None where the config has none, as the model's forward passes it), ``alibi`` / ``position_bias``
# (BLOOM's and MPT's ALiBi biases: ``AlibiBias``; None where the stack has none, Falcon's rotary configs),
# DeepSeek-V4's ``input_ids`` (the call's token ids: its hash-routed MoE layers pick their experts
# by ``tid2eid[input_ids]``; contact point ``layer_input_ids``) and Beam's ``attention_scaling`` (its
# NoPE layers' query scale from the positions, ``AttentionScaling``; None for a layer with rope).
STACK_INPUTS = (
    "shared_kv_states", "per_layer_input", "original_hidden_states", "layer_idx", "alibi", "position_bias",
    "input_ids", "attention_scaling",
)  # fmt: skip
# Zamba's and Zamba2's layers also take ``original_hidden_states`` (what entered the first layer, which
# their hybrid layers' shared blocks read beside their hidden states) and ``layer_idx`` (the index their
# shared attention caches under); and they take the attention mask as ``causal_mask`` (``CAUSAL_MASK_INPUT``),
# their ``attention_mask`` being the mixer's padding mask, which a linear layer is never given.
CAUSAL_MASK_INPUT = "causal_mask"


def carried_inputs(layer: nn.Module) -> tuple[str, ...]:
    """The ``CARRIED_INPUTS`` and ``STACK_INPUTS`` a decoder layer's forward takes."""
    parameters = inspect.signature(layer.forward).parameters
    return tuple(name for name in (*CARRIED_INPUTS, *STACK_INPUTS) if name in parameters)


def run_layer(
    layer: nn.Module, hidden_states: torch.Tensor, carried: dict[str, Any], **kwargs: Any
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One decoder layer over ``hidden_states`` with what the previous layer handed on and the stack's
    per-call inputs (the names it takes of ``carried``); returns its hidden states and what it hands to
    the next layer."""
    takes = {name: carried.get(name) for name in carried_inputs(layer)}
    if CAUSAL_MASK_INPUT in inspect.signature(layer.forward).parameters:
        kwargs = {**kwargs, CAUSAL_MASK_INPUT: kwargs.get("attention_mask"), "attention_mask": None}
    out = layer(hidden_states, **takes, **kwargs)
    if isinstance(out, tuple):
        return out[0], dict(zip(CARRIED_INPUTS, out[1:], strict=False))
    return out, {}


class PerLayerInputs(nn.Module):
    """Per-layer embeddings (Gemma-4's PLE): an input of its own for every decoder layer, computed once
    per call from the token ids and the input embeddings ``[B, Q, layers, width]``.

    Runs the language model's own ``get_per_layer_inputs`` / ``project_per_layer_inputs`` (contact point
    ``per_layer_inputs``) on this holder of the parts and scales they read, so the graph holds the same
    tensors as the model (the weights keep their names) without the whole language model inside."""

    PARTS = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
    SCALARS = ("hidden_size_per_layer_input", "per_layer_model_projection_scale", "per_layer_input_scale")

    def __init__(self, language_model: nn.Module) -> None:
        super().__init__()
        for name in self.PARTS:
            setattr(self, name, getattr(language_model, name))
        for name in self.SCALARS:
            setattr(self, name, getattr(language_model, name))
        self.config = language_model.config
        self.source = type(language_model)

    @classmethod
    def of(cls, language_model: nn.Module) -> PerLayerInputs | None:
        """The stack's per-layer inputs; None where its config gives the layers none."""
        if not getattr(language_model.config, "hidden_size_per_layer_input", None):
            return None
        return cls(language_model)

    def forward(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        token_part = self.source.get_per_layer_inputs(self, input_ids, inputs_embeds)
        return self.source.project_per_layer_inputs(self, inputs_embeds, token_part)


class ResidualStreams(nn.Module):
    """Hyper-connections (HY-V4, DeepSeek-V4): the model's forward keeps ``hc_mult`` residual streams
    between its decoder layers, each a copy of the input embeddings (``[B, Q, hidden]`` becomes ``[B, Q,
    streams, hidden]``), and merges them with its ``hc_head`` before the final norm; the layers mix the
    streams themselves. Holds that head, so the graph keeps its weights under the stack's name."""

    HEAD = "hc_head"

    def __init__(self, head: nn.Module, count: int) -> None:
        super().__init__()
        self.head = head
        self.count = count

    @classmethod
    def of(cls, language_model: nn.Module) -> ResidualStreams | None:
        """The stack's residual streams; None where its config keeps one (no ``hc_mult`` above 1)."""
        count = getattr(language_model.config, "hc_mult", None) or 1
        if count == 1:
            return None
        return cls(getattr(language_model, cls.HEAD), count)

    def expand(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """What enters the first layer: the embeddings copied into every stream."""
        return hidden_states.unsqueeze(2).expand(-1, -1, self.count, -1).contiguous()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """What enters the final norm: the streams merged by the stack's head."""
        return self.head(hidden_states)


class CompressorWindows(NamedTuple):
    """The windows a compressor pools (``StaticStateCache.compressed_window``): the raw projections
    ``kv``/``gate`` ``[B, W, rate, dim]`` of each window, its first position ``start`` ``[B, W]`` (the
    entry's rope position) and, for an overlapping compressor (csa), the previous window's
    ``prior_kv``/``prior_gate`` (``-inf`` gates where there is none: window 0)."""

    kv: torch.Tensor
    gate: torch.Tensor
    start: torch.Tensor
    prior_kv: torch.Tensor | None = None
    prior_gate: torch.Tensor | None = None


def layer_index(layer: nn.Module, kind: str, position: int, attention: str | None = None) -> int:
    """The index a layer's states are addressed by: its mixer's ``layer_idx`` (an attention's may be
    ``layer_id``: ``INDEX_ATTRIBUTES``); a block with no mixer keeps no state, so its own ``layer_idx``
    or, without one, its ``position`` in the stack (a prefix of it). ``attention``: ``mixer_of``'s."""
    if kind in STATELESS_KINDS:
        return getattr(layer, "layer_idx", position)
    return index_of(mixer_of(layer, kind, attention))


# The attribute a mixer keeps the index it caches under in: ``layer_idx``, or GPT-Neo's attention's
# ``layer_id`` (upstream's ``INDEX_ATTRIBUTES``)
INDEX_ATTRIBUTES = ("layer_idx", "layer_id")


def index_of(mixer: nn.Module | None) -> Any:
    """The index ``mixer`` caches under (``INDEX_ATTRIBUTES``; None: it keeps none)."""
    return next((i for i in (getattr(mixer, n, None) for n in INDEX_ATTRIBUTES) if i is not None), None)


def mixer_of(layer: nn.Module, kind: str, attention: str | None = None) -> nn.Module:
    """The layer's token mixer of ``kind`` (its index addresses the cache). ``attention``: where an
    attention layer keeps it, relative to the layer (a spec's ``module_paths.layer_attention``: GPT-Neo's
    ``attn.attention``), instead of ``MIXER_ATTRIBUTES``' names."""
    paths = (attention,) if attention is not None and kind == "attention" else MIXER_ATTRIBUTES[kind]
    for path in paths:
        mixer: Any = layer
        for name in path.split("."):
            mixer = getattr(mixer, name, None)
        if mixer is not None:
            return mixer
    raise ValueError(f"{type(layer).__name__} has no {kind} mixer (looked for {', '.join(paths)})")


class StaticStateCache:
    """Duck-typed stand-in for transformers' ``Cache`` that keeps every state a graph value.

    Prefill (``past is None``) records what each layer writes as its ``present``. Decode reads the
    caller's ``past`` tensors and writes out of place, so every state stays a graph input/output and
    nothing is lifted to a constant or mutated behind the graph. Two protocols, by layer kind:

    - attention layers call ``update`` (``transformers.cache_utils.Cache.update``, upstream's
      ``cache_update`` contact point) with the new key/value states;
    - linear-attention / SSM layers call ``get_conv_state``/``update_conv_state`` and
      ``get_recurrent_state``/``update_recurrent_state`` (``Cache``'s linear-attention API, upstream's
      ``linear_attention_cache`` contact point); LFM2's short convolution only the conv half of it
      (upstream's ``short_conv_cache``): ``get_conv_state`` None in prefill, the past window in decode;
    - MiniMax's lightning attention calls ``get_linear_cache``/``set_linear_cache`` (``MiniMaxCache``'s
      API, upstream's ``lightning_attention_cache`` contact point): None in prefill (the layer scans its
      prompt in blocks from zeros), the past state in decode (its token-by-token recurrence);
    - a DSA indexer calls ``update_indexer`` with its new keys ``[B, S, index_head_dim]`` (upstream's
      ``indexer_cache`` contact point): cached as a one-head key, it returns every slot's keys.

    ``is_recording_past`` answers True, which sends a linear layer's single-token decode down its
    out-of-place path (``update_conv_state`` returns the window plus the new token and the layer
    convolves it) instead of ``causal_conv1d_update``, which would write the conv state in place. Not
    every mixer asks or updates: a Mamba2 decode writes its recurrent state in place
    (``selective_state_update``), a KDA decode its conv window. So ``get_*_state`` hands out a clone of
    the past state and records that clone as the layer's present; an ``update_*`` replaces it. The
    graph never mutates an input, and every present is returned.

    Anything else the layers read does not exist here, so a layer that needs more fails at trace time.
    """

    def __init__(
        self,
        kv_layout: str,
        layer_ids: Sequence[int],
        past: Sequence[tuple[torch.Tensor, ...]] | None = None,
        cache_position: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        kinds: Sequence[str] | None = None,
    ) -> None:
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"unknown kv_layout {kv_layout!r}; valid: {', '.join(KV_LAYOUTS)}")
        self.kv_layout = kv_layout
        self._slot = {layer_id: slot for slot, layer_id in enumerate(layer_ids)}
        self.kinds = list(kinds) if kinds is not None else ["attention"] * len(self._slot)
        self._past = past
        self._cache_position = cache_position
        self._block_table = block_table
        self.present: list[dict[str, torch.Tensor]] = [{} for _ in self._slot]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Called by the attention with the new key/value states (MLA: the latents kv_nope, k_rot).

        Extra arguments (5.23: none; 5.24: ``kwargs=`` the attention's own kwargs) carry nothing the
        static cache needs: positions come from ``cache_position``, given at construction."""
        if self.kv_layout == "expanded":  # the latents pass through; expand_kv caches per-head K/V
            return key_states, value_states
        return self._write(self._slot[layer_idx], key_states, value_states)

    def expand_kv(
        self, attn: nn.Module, kv_nope: torch.Tensor, k_rot: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """``expanded`` layout: expand only the new tokens, write them, attend over the whole cache."""
        key_states, value_states = type(attn).expand_kv(attn, kv_nope, k_rot)
        return self._write(self._slot[attn.layer_idx], key_states, value_states)

    def _write(self, slot: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill: the new KV is the present. Decode: write each row's token at its own position.

        Contiguous: row ``b``'s token goes to slot ``cache_position[b]`` of row ``b``; the present is
        the whole updated cache. Paged: it goes to offset ``p % block_size`` of physical block
        ``block_table[b, p // block_size]`` of the shared pool; the present is the updated pool and
        the attention reads the row's blocks gathered in logical order (``paged_write``/``paged_view``).

        A layer whose one KV head is both key and value (DeepSeek-V4: ``update(kv, kv)``) keeps both
        states (the IR gives the prefill's second output of one tensor a copy of its own).
        """
        return self._write_one(slot, "key", key), self._write_one(slot, "value", value)

    def _write_one(self, slot: int, role: str, new: torch.Tensor) -> torch.Tensor:
        """One growing state (``[B, heads, Q, dim]``) of a layer: its present, and what attention reads."""
        if self._past is None:
            self.present[slot][role] = new
            return new
        assert self._cache_position is not None
        past = self._past[slot][LAYER_STATES[self.kinds[slot]].index(role)]
        if self._block_table is None:
            self.present[slot][role] = written = write_rows(past, new, self._cache_position)
            return written
        self.present[slot][role] = pool = paged_write(past, new, self._cache_position, self._block_table)
        return paged_view(pool, self._block_table)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int, **kwargs: Any) -> torch.Tensor:
        """``Cache.update_indexer``: the indexer's new keys ``[B, S, dim]`` written like a one-head key;
        returns every slot's keys ``[B, slots, dim]`` (unwritten slots are masked by the indexer)."""
        keys = self._write_one(self._slot[layer_idx], "index_key", indexer_key_states.unsqueeze(1))
        return keys.squeeze(1)

    def compressed_window(
        self, layer_idx: int, kv: torch.Tensor, gate: torch.Tensor, rate: int, series: str = "comp"
    ) -> CompressorWindows:
        """A compressor's windows to pool (``CompressorWindows``), from the new raw projections
        ``kv``/``gate`` ``[B, Q, dim]`` (the ``compressed_window``/``write_compressed`` protocol, contact
        point ``compressor_cache``; the ``deepseek_v4_*`` builtins call it). ``series`` names the states:
        ``comp`` (``comp_src``, ``comp``) or a CSA layer's indexer, ``index`` (``index_src``,
        ``index_comp``). The ring holds one window of ``rate`` raw ``kv || gate`` rows (hca) or two
        (csa: an entry mixes the previous window's first half with its own second half), slot
        ``p % ring``.

        Prefill: the prompt's ``floor(Q / rate)`` closed windows (static: the prompt is never padded),
        and the ring as its present, slot ``j`` holding position ``j + ring * floor((Q - 1 - j) /
        ring)`` (the last position ``= j mod ring``), zeros where that is negative. Decode: the ring with
        each row's token written at slot ``p % ring``, as one window, window ``w = (p + 1) // rate - 1``
        (the one the token closes when ``(p + 1) % rate == 0``, else an entry ``write_compressed``
        drops): slot order is position order within a window."""
        slot, source = self._slot[layer_idx], COMPRESSED_SERIES[series][0]
        overlap = LAYER_RINGS[self.kinds[slot]]
        ring_len = rate * overlap
        new = torch.cat([kv, gate], dim=-1).unsqueeze(1)  # [B, 1, Q, 2 * dim]
        dim, batch, length = kv.shape[-1], kv.shape[0], kv.shape[1]
        offsets = torch.arange(rate, device=kv.device)
        if self._past is None:
            slots = torch.arange(ring_len, device=kv.device)
            last = slots + ring_len * torch.div(length - 1 - slots, ring_len, rounding_mode="floor")
            ring = new.index_select(2, last.clamp(min=0)) * (last >= 0).view(1, 1, -1, 1).to(new.dtype)
            self.present[slot][source] = ring
            count = length // rate
            chunk = new[:, 0, : count * rate].view(batch, count, rate, 2 * dim)
            windows = torch.arange(count, device=kv.device).unsqueeze(0).expand(batch, -1)
            prior = torch.cat([torch.zeros_like(chunk[:, :1]), chunk[:, :-1]], dim=1) if count else chunk
        else:
            assert self._cache_position is not None
            past = self._past_state(layer_idx, source)
            assert past is not None
            position = self._cache_position
            ring = write_rows(past, new.to(past.dtype), torch.remainder(position, ring_len))
            self.present[slot][source] = ring
            windows = (torch.div(position + 1, rate, rounding_mode="floor") - 1).clamp(min=0).view(-1, 1)
            rows = ring[:, 0]  # [B, ring, 2 * dim]

            def window(index: torch.Tensor) -> torch.Tensor:  # the ring's rows of window ``index`` [B, 1]
                taken = torch.remainder(index, overlap) * rate + offsets.view(1, -1)
                return rows.gather(1, taken.unsqueeze(-1).expand(-1, -1, 2 * dim)).unsqueeze(1)

            chunk, prior = window(windows), window(windows - 1)
        start = windows * rate
        if overlap == 1:
            return CompressorWindows(chunk[..., :dim], chunk[..., dim:], start)
        missing = (windows < 1).view(*windows.shape, 1, 1)  # window 0 has no previous one: weight 0
        prior_gate = prior[..., dim:].masked_fill(missing, float("-inf"))
        return CompressorWindows(chunk[..., :dim], chunk[..., dim:], start, prior[..., :dim], prior_gate)

    def write_compressed(
        self, layer_idx: int, entries: torch.Tensor, rate: int, series: str = "comp"
    ) -> torch.Tensor:
        """The layer's compressed entries of ``series`` after ``entries`` ``[B, W, dim]`` (one per
        window ``compressed_window`` gave): prefill, the prompt's as the present ``[B, 1, W, dim]``;
        decode, the entry written at slot ``(p + 1) // rate - 1`` of each row whose token closed its
        window (``(p + 1) % rate == 0``), the other rows' entries unchanged. Returns every slot ``[B, 1,
        slots, dim]``; the caller masks slot ``w`` unless ``w < (p + 1) // rate``."""
        slot, role = self._slot[layer_idx], COMPRESSED_SERIES[series][1]
        entries = entries.unsqueeze(1)
        if self._past is None:
            self.present[slot][role] = entries
            return entries
        assert self._cache_position is not None
        past = self._past_state(layer_idx, role)
        assert past is not None
        closed = torch.div(self._cache_position + 1, rate, rounding_mode="floor")
        closing = torch.remainder(self._cache_position + 1, rate) == 0
        target = torch.where(closing, closed - 1, torch.full_like(closed, -1))  # -1: no slot
        self.present[slot][role] = written = write_rows(past, entries.to(past.dtype), target)
        return written

    def _past_state(self, layer_idx: int, name: str) -> torch.Tensor | None:
        if self._past is None:
            return None
        slot = self._slot[layer_idx]
        return self._past[slot][LAYER_STATES[self.kinds[slot]].index(name)]

    def _owned_state(self, layer_idx: int, name: str) -> torch.Tensor | None:
        """A clone of the layer's past ``name`` state, recorded as its present: a layer that writes it in
        place writes its present, never the graph input (None in prefill: no previous state)."""
        past = self._past_state(layer_idx, name)
        if past is None:
            return None
        self.present[self._slot[layer_idx]][name] = owned = past.clone()
        return owned

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The layer's convolution window ``[B, channels, kernel]`` (None in prefill: no previous state)."""
        return self._owned_state(layer_idx, "conv")

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The layer's recurrent state (None in prefill: the layer starts from zeros)."""
        return self._owned_state(layer_idx, "recurrent")

    def is_recording_past(self, layer_idx: int) -> bool:
        """True: keeps a single-token decode on the layer's out-of-place convolution path."""
        return True

    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        """Tokens cached before this call's: ``0`` in prefill (an ABI prefill starts at position 0), in
        decode each row's ``cache_position`` as a ``[B]`` tensor (rows at different positions; a paged
        cache counts logical positions too).

        Unlike transformers' ``Cache.get_seq_length`` (one int for the batch), decode returns a tensor:
        only code written for it may read it (Llama-4's temperature tuning through the
        ``llama4_attention_forward`` builtin); other code that computes a Python int from it fails at
        export rather than tracing one row's length for every row."""
        return 0 if self._past is None or self._cache_position is None else self._cache_position

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """``LinearAttentionLayer.update_conv_state`` without mutation: the new inputs ``[B, C, Q]``
        behind the previous window (prefill: behind zeros, when Q is shorter than the kernel); the
        present window is the last ``kernel`` columns; the layer convolves what is returned."""
        slot = self._slot[layer_idx]
        past = self._past_state(layer_idx, "conv")
        if past is None:
            kernel = kwargs.get("conv_kernel_size") or conv_states.shape[-1]
            missing = kernel - conv_states.shape[-1]
            full = nn.functional.pad(conv_states, (missing, 0)) if missing > 0 else conv_states
        else:
            kernel = past.shape[-1]
            full = torch.cat([past, conv_states.to(past.dtype)], dim=-1)
        self.present[slot]["conv"] = full[..., -kernel:]
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """The layer's state after the new tokens becomes the present."""
        self.present[self._slot[layer_idx]]["recurrent"] = recurrent_states
        return recurrent_states

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        """``MiniMaxCache.get_linear_cache``: a lightning layer's recurrent state ``[B, heads, head_dim,
        head_dim]`` (None in prefill: the layer takes its from-scratch block path)."""
        return self._owned_state(layer_idx, "recurrent")

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        """``MiniMaxCache.set_linear_cache``: the state after the new tokens becomes the present."""
        self.present[self._slot[layer_idx]]["recurrent"] = linear_cache

    @contextlib.contextmanager
    def routing_expand_kv(self, layers: Sequence[nn.Module]) -> Iterator[None]:
        """For ``expanded``, point each layer's ``self_attn.expand_kv`` at this cache while tracing.

        The upstream attention calls ``update`` (latents) and then ``self.expand_kv`` on what it got
        back; caching the expanded K/V means the expansion itself must write the cache. The instance
        attribute shadows the (possibly patched) class method only inside this block.
        """
        if self.kv_layout != "expanded":
            yield
            return
        attentions = [layer.self_attn for layer in layers if getattr(layer, "self_attn", None) is not None]
        for attn in attentions:
            attn.__dict__["expand_kv"] = functools.partial(self.expand_kv, attn)
        try:
            yield
        finally:
            for attn in attentions:
                attn.__dict__.pop("expand_kv", None)

    def flat_present(self) -> list[torch.Tensor]:
        """Every layer's states in ABI order (``LAYER_STATES`` of its kind)."""
        flat: list[torch.Tensor] = []
        for slot, (kind, written) in enumerate(zip(self.kinds, self.present, strict=True)):
            names = LAYER_STATES[kind]
            missing = [name for name in names if name not in written]
            if missing:
                raise RuntimeError(
                    f"decoder layer in slot {slot} never wrote its {' and '.join(missing)} state"
                )
            flat += [written[name] for name in names]
        return flat


# The parts of a decoder stack the wrappers call, by role, where transformers' decoder models keep them
# (relative to the stack); a spec's ``module_paths.embeddings`` / ``final_norm`` / ``rotary_embedding``
# name others, and its ``module_paths.language_layers`` the layer list (GPT-J, Falcon: ``h``). Learned
# absolute position embeddings have no usual name (GPT-2: ``wpe``; OPT: ``embed_positions``): a stack has
# them where ``module_paths.position_embeddings`` names them (``add_learned_positions``), and so does a
# norm over the embeddings before the first layer (BLOOM's ``word_embeddings_layernorm``):
# ``module_paths.embedding_norm``.
STACK_PARTS: dict[str, str | None] = {
    "layers": "layers",
    "embeddings": "embed_tokens",
    "final_norm": "norm",
    "rotary_embedding": "rotary_emb",
    "position_embeddings": None,
    "embedding_norm": None,
}


# Where each decoder layer keeps its attention, relative to the layer (``module_paths.layer_attention``,
# carried with the stack's parts; absent: ``MIXER_ATTRIBUTES``' names): not a part of the stack itself
LAYER_ATTENTION = "layer_attention"


class PositionTable(nn.Module):
    """A stack's absolute position embeddings kept as a buffer, not a module (CTRL's ``pos_encoding``,
    sinusoidal ``[n_positions, hidden]``): its rows at each token's position, as the model's forward
    indexes it (``pos_encoding[position_ids, :]``). Holds the stack's own tensor."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.table[position_ids]


def stack_part(
    language_model: nn.Module, role: str, parts: Mapping[str, str | None] | None = None
) -> nn.Module | None:
    """The stack's ``role`` part at the path ``parts`` names (else ``STACK_PARTS``'); None for a rotary
    embedding the stack does not have and ``parts`` does not name (NoPE, SSM stacks), for a part
    without a usual name (learned position embeddings, an embedding norm) ``parts`` does not name, and
    for a part ``parts`` says the stack has none of (None: TrOCR's final norm). Position embeddings a
    stack keeps as a buffer come as a ``PositionTable``."""
    parts = parts or {}
    path = parts.get(role, STACK_PARTS[role])
    if path is None:
        return None
    try:
        return language_model.get_submodule(path)
    except AttributeError:
        if role == "rotary_embedding" and role not in parts:
            return None
        if role == "position_embeddings":
            try:
                return PositionTable(language_model.get_buffer(path))
            except AttributeError:
                pass
        raise


def add_learned_positions(
    hidden_states: torch.Tensor, table: nn.Module | None, position_ids: torch.Tensor
) -> torch.Tensor:
    """``hidden_states`` ``[B, Q, hidden]`` plus each token's learned absolute position embedding, looked
    up at its row's own ``position_ids`` ``[B, Q]`` in ``table`` (None: the stack has none), as GPT-2's
    ``wpe(position_ids)``. OPT's, BioGPT's and TrOCR's tables keep their first ``offset`` (2) rows
    unused: their forwards look up ``position_ids + self.offset`` (contact point ``learned_positions``),
    which this does through the ``nn.Embedding`` lookup itself, since each of their forwards takes the
    positions another way (the 2-D mask, a cache length). A module that computes the embeddings from
    the positions (XGLM's sinusoidal table, ``forward(position_ids, cache_length=0)``; contact point
    ``sinusoidal_positions``; CTRL's buffer as a ``PositionTable``) is called with them."""
    if table is None:
        return hidden_states
    if not isinstance(table, nn.Embedding):
        return hidden_states + table(position_ids)
    offset = getattr(table, "offset", 0)
    embeddings = nn.Embedding.forward(table, position_ids + offset)  # type: ignore[arg-type]
    return hidden_states + embeddings


class AlibiBias(nn.Module):
    """ALiBi biases the model's forward builds once per call with a builder of the stack's own and hands
    every layer (contact point ``alibi_bias``): BLOOM's ``build_alibi_tensor(attention_mask, heads,
    dtype)`` as ``alibi`` ``[B * heads, 1, K]``, the slope times the visible keys before each key, from
    its 2-D mask; MPT's ``build_mpt_alibi_tensor(heads, max_seq_len)`` as ``position_bias`` ``[heads, 1,
    max_seq_len]``, the slope times each key's distance to the last (float32), from the config alone.

    BLOOM's 2-D mask is what the ABI's 4-D mask says each row's last query sees (its prompt, or its cache
    up to its own position): a key's bias counts the visible keys before it, as the model's cumsum
    does, and a hidden key's bias is masked anyway. Plain elementwise ops, so it exports.

    Falcon with ``alibi: true`` builds BLOOM's bias with a function of its modelling module
    (``build_alibi_tensor``, the stack has no such method) and its forward also folds it into the mask
    it hands every layer (``FOLDING_STACKS``): each visible entry becomes the bias over ``sqrt(head_dim)``
    (a hidden one stays the dtype's minimum), beside the bias itself as ``alibi`` (``fold``)."""

    BUILDERS = {"build_alibi_tensor": "alibi", "build_mpt_alibi_tensor": "position_bias"}
    # stacks whose forward builds the bias with the modelling module's ``build_alibi_tensor`` when their
    # config's ``alibi`` is true, and folds it into the layers' mask
    FOLDING_STACKS = ("FalconModel",)

    def __init__(
        self, builder: Any, keyword: str, num_heads: int, length: int | None, fold: float | None = None
    ) -> None:
        super().__init__()
        self.builder = builder  # the stack's bound builder
        self.keyword = keyword  # the layer input it is handed as (a STACK_INPUTS name)
        self.num_heads = num_heads
        self.length = length  # MPT's: the config's max_seq_len
        self.fold = fold  # Falcon's 1 / sqrt(head_dim): the bias folded into the mask (None: not)

    @classmethod
    def of(cls, language_model: nn.Module) -> AlibiBias | None:
        """The stack's ALiBi bias; None where it has no ``BUILDERS`` method (nor, a ``FOLDING_STACKS``
        one whose config turns ALiBi on, its module's builder)."""
        config = language_model.config
        for method, keyword in cls.BUILDERS.items():
            builder = getattr(language_model, method, None)
            if builder is not None:
                return cls(builder, keyword, config.num_attention_heads, getattr(config, "max_seq_len", None))
        module = inspect.getmodule(type(language_model))
        builder = getattr(module, "build_alibi_tensor", None)
        if (
            type(language_model).__name__ in cls.FOLDING_STACKS
            and getattr(config, "alibi", False)
            and builder
        ):
            heads = config.num_attention_heads
            return cls(builder, "alibi", heads, None, fold=(config.hidden_size // heads) ** -0.5)
        return None

    def folded(self, mask: torch.Tensor | None, bias: torch.Tensor) -> torch.Tensor | None:
        """``mask`` ``[B, 1, Q, K]`` (additive) with ``bias`` ``[B * heads, 1, K]`` folded in as Falcon's
        forward does: ``[B, heads, Q, K]``, each visible entry the bias times ``fold``; unchanged where
        nothing folds."""
        if self.fold is None or mask is None:
            return mask
        heads = bias.reshape(mask.shape[0], self.num_heads, 1, bias.shape[-1]) * self.fold
        return heads.masked_fill(mask < -1, torch.finfo(mask.dtype).min)

    def forward(self, attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.keyword == "position_bias":
            return self.builder(self.num_heads, self.length, device=attention_mask.device)
        visible = (attention_mask[:, 0, -1, :] == 0).to(torch.long)  # [B, K]: the last query's keys
        return self.builder(visible, self.num_heads, dtype)


class AttentionScaling(nn.Module):
    """A query scale the model's forward computes once per call from the positions and hands every layer
    of a type it gives no rotary embedding (Beam's NoPE full-attention layers, whose ``rope_parameters``
    entry is None: ``compute_attention_scaling(position_ids)`` of its modelling module, ``[B, 1, Q, 1]``;
    contact point ``attention_scaling``); layers with rope get None, as the forward hands them."""

    BUILDER = "compute_attention_scaling"  # the modelling module's function

    def __init__(self, builder: Any) -> None:
        super().__init__()
        self.builder = builder

    @classmethod
    def of(cls, language_model: nn.Module) -> AttentionScaling | None:
        """The stack's query scaling; None where its modelling module has no ``BUILDER``."""
        builder = getattr(inspect.getmodule(type(language_model)), cls.BUILDER, None)
        return cls(builder) if builder is not None else None

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.builder(position_ids)


def stack_layers(language_model: nn.Module, parts: Mapping[str, str | None] | None = None) -> list[nn.Module]:
    """The stack's decoder layers (at ``parts``' ``layers`` path), as many as its config counts."""
    layers = stack_part(language_model, "layers", parts)
    return list(layers)[: language_model.config.num_hidden_layers]  # type: ignore[call-overload]


class ProbedStack(NamedTuple):
    """A stack as ``upstream``'s layer probes read it, with its parts where a spec names them."""

    layers: Any
    config: Any
    rotary_emb: nn.Module | None
    layer_attention: str | None = None  # where a layer keeps its attention (None: the usual names)


def probed_stack(language_model: nn.Module, parts: Mapping[str, str | None] | None = None) -> Any:
    """The stack as ``upstream``'s layer probes read it (``layers``, ``config``, ``rotary_emb``): the
    language model itself, or a view of it with the layer list and rotary embedding where ``parts``
    names them, and where a layer keeps its attention (``LAYER_ATTENTION``)."""
    parts = parts or {}
    if not {"layers", "rotary_embedding", LAYER_ATTENTION} & parts.keys():
        return language_model
    return ProbedStack(
        stack_part(language_model, "layers", parts),
        language_model.config,
        stack_part(language_model, "rotary_embedding", parts),
        parts.get(LAYER_ATTENTION),
    )


class _TextStack(nn.Module):
    """Embedding, a run of decoder layers, final norm and LM head, called layer by layer."""

    def __init__(
        self,
        embed_tokens: nn.Module,
        layers: Sequence[nn.Module],
        norm: nn.Module | None,
        rotary_emb: nn.Module | None,
        lm_head: nn.Module,
        *,
        kv_layout: str,
        cache_keyword: str,
        mla_attention: str = "reexpand",
        windows: Sequence[int | None] | None = None,
        embedding_ops: OpList = (),
        logit_ops: OpList = (),
        rope_layer_types: Sequence[RopeKey] | None = None,
        layer_kinds: Sequence[str] | None = None,
        chunks: Sequence[int | None] | None = None,
        per_layer_inputs: PerLayerInputs | None = None,
        streams: ResidualStreams | None = None,
        position_embeddings: nn.Module | None = None,
        embedding_norm: nn.Module | None = None,
        alibi: AlibiBias | None = None,
        layer_attention: str | None = None,
        attention_scaling: AttentionScaling | None = None,
    ) -> None:
        super().__init__()
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"unknown kv_layout {kv_layout!r}; valid: {', '.join(KV_LAYOUTS)}")
        check_mla_attention(kv_layout, mla_attention)
        self.embed_tokens = embed_tokens
        # registered in the order the graph first uses them (the one-trace export lists buffers by
        # registration, the two-call one by use: the IR's constants must not depend on which ran)
        self.per_layer_inputs = per_layer_inputs
        self.position_embeddings = position_embeddings  # learned absolute positions (None: none)
        self.embedding_norm = embedding_norm  # a norm over the embeddings (None: none)
        self.alibi = alibi  # ALiBi biases handed to every layer (None: none)
        self.attention_scaling = attention_scaling  # the NoPE layers' query scale (None: none)
        self.layers = nn.ModuleList(layers)
        self.streams = streams
        self.norm = norm
        self.rotary_emb = rotary_emb
        self.lm_head = lm_head
        self.kv_layout = kv_layout
        self.cache_keyword = cache_keyword
        self.mla_attention = mla_attention
        self.embedding_ops = tuple(embedding_ops)
        self.logit_ops = tuple(logit_ops)
        # each traced layer's kind (LAYER_STATES), by its position in the stack; None: all attention
        self.kinds = [
            layer_kinds[i] if layer_kinds is not None else "attention" for i in range(len(self.layers))
        ]
        unknown = sorted(set(self.kinds) - set(LAYER_STATES))
        if unknown:
            raise ValueError(f"unknown layer kind {unknown[0]!r}; valid: {', '.join(LAYER_STATES)}")
        self.layer_ids = [
            layer_index(layer, kind, position, layer_attention)
            for position, (layer, kind) in enumerate(zip(self.layers, self.kinds, strict=True))
        ]
        # sliding window of each traced layer (None: full attention), by the layer's own index
        windows = list(windows) if windows is not None else []
        self.windows = [windows[i] if i < len(windows) else None for i in self.layer_ids]
        # attention chunk of each traced layer (None: not chunked), by the layer's own index
        chunks = list(chunks) if chunks is not None else []
        self.chunks = [chunks[i] if i < len(chunks) else None for i in self.layer_ids]
        # per traced layer, the layer type a per-type rotary embedding (Gemma-3) takes; None: one for all
        self.rope_layer_types = (
            [rope_layer_types[i] for i in self.layer_ids] if rope_layer_types is not None else None
        )

    @classmethod
    def from_language_model(
        cls,
        language_model: nn.Module,
        lm_head: nn.Module,
        *,
        kv_layout: str,
        cache_keyword: str,
        num_layers: int | None = None,
        mla_attention: str = "reexpand",
        windows: Sequence[int | None] | None = None,
        embedding_ops: OpList = (),
        logit_ops: OpList = (),
        rope_layer_types: Sequence[RopeKey] | None = None,
        layer_kinds: Sequence[str] | None = None,
        parts: Mapping[str, str | None] | None = None,
        chunks: Sequence[int | None] | None = None,
        **extra: Any,
    ) -> _TextStack:
        """Wrap a transformers decoder model (``embed_tokens``/``layers``/``norm``/``rotary_emb``, or the
        paths ``parts`` gives by role: ``STACK_PARTS``).

        ``cache_keyword`` is the keyword the decoder layers take the cache under (``past_key_values`` or
        ``cache``: ``upstream.probe_decoder_layers`` finds it); ``num_layers`` keeps only the first
        layers (a representative prefix for replication);
        ``windows`` gives each layer's sliding window (None: full attention), indexed by layer;
        ``embedding_ops``/``logit_ops`` are the family's math outside the layers (``apply_ops``);
        ``rope_layer_types`` each layer's type for a rotary embedding that takes one (``rotary_emb(x,
        position_ids, layer_type)``: Gemma-3, OLMo-3), indexed by layer;
        ``layer_kinds`` each layer's kind (``LAYER_STATES``: ``attention`` or ``linear``), indexed by layer;
        ``parts`` where the stack keeps a part under another name (``{"final_norm": "norm_f"}``);
        ``chunks`` each layer's attention chunk (None: not chunked), indexed by layer;
        ``extra`` goes to the wrapper's constructor (``image_token_id`` of ``MultimodalPrefillWrapper``).
        The stack's per-layer embeddings (``PerLayerInputs``) and residual streams (``ResidualStreams``),
        where its config has them, come along.
        """
        layers = stack_layers(language_model, parts)
        if num_layers is not None:
            layers = layers[:num_layers]
        return cls(
            stack_part(language_model, "embeddings", parts),
            layers,
            stack_part(language_model, "final_norm", parts),
            stack_part(language_model, "rotary_embedding", parts),  # None: a stack without rope
            lm_head,
            kv_layout=kv_layout,
            cache_keyword=cache_keyword,
            mla_attention=mla_attention,
            windows=windows,
            embedding_ops=embedding_ops,
            logit_ops=logit_ops,
            rope_layer_types=rope_layer_types,
            layer_kinds=layer_kinds,
            chunks=chunks,
            per_layer_inputs=PerLayerInputs.of(language_model),
            streams=ResidualStreams.of(language_model),
            position_embeddings=stack_part(language_model, "position_embeddings", parts),
            embedding_norm=stack_part(language_model, "embedding_norm", parts),
            alibi=AlibiBias.of(language_model),
            layer_attention=(parts or {}).get(LAYER_ATTENTION),
            attention_scaling=AttentionScaling.of(language_model),
            **extra,
        )

    def _run(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: StaticStateCache,
    ) -> tuple[torch.Tensor, ...]:
        embeds = self.embed_tokens(input_ids)
        per_layer = self.per_layer_inputs(input_ids, embeds) if self.per_layer_inputs is not None else None
        return self._stack(embeds, attention_mask, position_ids, cache, per_layer, input_ids)

    def _stack(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: StaticStateCache,
        per_layer: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The layers, final norm and LM head over input embeddings ``hidden_states`` ``[B, Q, hidden]``
        (``per_layer``: the per-layer embeddings ``[B, Q, layers, width]``, indexed by layer;
        ``input_ids``: the call's token ids, for layers that take them)."""
        hidden_states = apply_ops(hidden_states, self.embedding_ops)
        hidden_states = add_learned_positions(hidden_states, self.position_embeddings, position_ids)
        if self.embedding_norm is not None:
            hidden_states = self.embedding_norm(hidden_states)
        # ALiBi biases under the input name the layers take them as (``alibi``, ``position_bias``)
        biases: dict[str, torch.Tensor] = {}
        if self.alibi is not None:
            biases[self.alibi.keyword] = self.alibi(attention_mask, hidden_states.dtype)
        if self.rotary_emb is None:  # no rope: positions reach the layers only through the mask and cache
            position_embeddings: list[Any] = [None] * len(self.layers)
        elif self.rope_layer_types is None:
            position_embeddings = [self.rotary_emb(hidden_states, position_ids)] * len(self.layers)
        else:
            # a layer type the embedding keeps no frequencies for (None: LFM3's conv layers) takes none;
            # a layer given rope labels (a tuple: DeepSeek-V4) takes {label: (cos, sin)} of every label
            ropes = {
                t: self.rotary_emb(hidden_states, position_ids, t)
                for t in dict.fromkeys(flat_rope_keys(self.rope_layer_types))
            }
            position_embeddings = [
                {label: ropes[label] for label in t} if isinstance(t, tuple) else ropes.get(t)  # type: ignore[index]
                for t in self.rope_layer_types
            ]
        # the query scale of the layers given no rope (Beam's NoPE layers); the others take None
        scaling = self.attention_scaling(position_ids) if self.attention_scaling is not None else None
        scalings = [scaling if embeddings is None else None for embeddings in position_embeddings]
        # one mask per span (a sliding window, ("chunk", size) or None: full), in first-use order
        # (deterministic graphs); a linear layer's state takes every token it is given: no mask (the
        # contract refuses padding); a block with no mixer neither
        unmasked = (*LINEAR_LAYER_KINDS, *STATELESS_KINDS)
        spans = [
            window if chunk is None else ("chunk", chunk)
            for window, chunk in zip(self.windows, self.chunks, strict=True)
        ]
        attending = [span for span, kind in zip(spans, self.kinds, strict=True) if kind not in unmasked]
        masks = {span: layer_mask(attention_mask, position_ids, span) for span in dict.fromkeys(attending)}
        layer_masks = [
            masks[span] if kind not in unmasked else None
            for span, kind in zip(spans, self.kinds, strict=True)
        ]
        if self.alibi is not None and self.alibi.fold is not None:  # Falcon's: folded into the mask too
            folded = {id(m): self.alibi.folded(m, biases["alibi"]) for m in layer_masks}
            layer_masks = [folded[id(m)] for m in layer_masks]
        if self.streams is not None:  # after the rope, which the model computes from the embeddings
            hidden_states = self.streams.expand(hidden_states)
        with (
            cache.routing_expand_kv(self.layers),
            absorbing_mla(self.layers, self.mla_attention, self.cache_keyword),
        ):
            carried: dict[str, Any] = {}
            shared_kv_states: dict[str, Any] = {}  # STACK_INPUTS: one per call
            first_input = hidden_states
            for position, (layer, mask, embeddings, scaled, kind, index) in enumerate(
                zip(
                    self.layers,
                    layer_masks,
                    position_embeddings,
                    scalings,
                    self.kinds,
                    self.layer_ids,
                    strict=True,
                )
            ):
                per_layer_input = per_layer[:, :, index, :] if per_layer is not None else None
                hidden_states, carried = run_layer(
                    layer,
                    hidden_states,
                    {
                        **carried,
                        "shared_kv_states": shared_kv_states,
                        "per_layer_input": per_layer_input,
                        "original_hidden_states": first_input,
                        "layer_idx": index,
                        "input_ids": input_ids,
                        "attention_scaling": scaled,
                        **biases,
                    },
                    attention_mask=mask,
                    position_ids=position_ids,
                    use_cache=True,
                    position_embeddings=embeddings,
                    **{self.cache_keyword: cache if kind not in STATELESS_KINDS else None},
                )
                self.layer_output(position, hidden_states)
        if self.streams is not None:
            hidden_states = self.streams(hidden_states)
        rows = self.head_rows(hidden_states)
        normed = self.norm(rows) if self.norm is not None else rows  # None: post-norm
        final = in_head_dtype(normed, self.lm_head)
        logits = apply_ops(self.lm_head(final), self.logit_ops)
        return (*self.head_outputs(logits, normed), *cache.flat_present())

    def layer_output(self, position: int, hidden_states: torch.Tensor) -> None:
        """What decoder layer ``position`` of the stack handed on: nothing keeps it here; the packed step
        graph keeps the layers an EAGLE-3 draft reads (``step.StepWrapper``'s ``aux_layers``)."""

    def head_rows(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The final hidden states the LM head turns into logits: all of them here; the packed step
        graph (``step.StepWrapper``) keeps only the tokens the engine asks logits for."""
        return hidden_states

    def head_outputs(self, logits: torch.Tensor, normed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What the graph returns before the states: the logits here; a step graph feeding an MTP draft
        also the final (normed) hidden states of those rows, which the MTP module reads."""
        return (logits,)


def flat_rope_keys(rope_layer_types: Sequence[RopeKey]) -> list[str]:
    """Every rope a stack computes, in first-use order: the layer types, and the labels of a layer given
    all of them (a tuple); a layer given none (None) adds nothing."""
    keys: list[str] = []
    for t in rope_layer_types:
        keys += list(t) if isinstance(t, tuple) else [t] if t is not None else []
    return keys


def in_head_dtype(hidden_states: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
    """The final hidden states in the LM head's dtype, as Mamba's and Falcon-Mamba's CausalLM cast them
    (``residual_in_fp32`` keeps their residual stream, and so the final norm's output, in float32 in a
    bfloat16 model). Elsewhere they already are: nothing is traced."""
    weight = getattr(lm_head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dtype != hidden_states.dtype:
        return hidden_states.to(weight.dtype)
    return hidden_states


def layer_mask(
    attention_mask: torch.Tensor, position_ids: torch.Tensor, span: int | tuple[str, int] | None
) -> torch.Tensor:
    """The mask of a layer whose span is ``span``: full attention (None) takes the caller's mask, a
    sliding window (an int) ``sliding_window_mask``, a chunk (``("chunk", size)``) ``chunked_window_mask``."""
    if span is None:
        return attention_mask
    if isinstance(span, tuple):
        return chunked_window_mask(attention_mask, position_ids, span[1])
    return sliding_window_mask(attention_mask, position_ids, span)


class PrefillWrapper(_TextStack):
    """Prompt pass: ``(input_ids, attention_mask, position_ids)`` -> ``(logits, key0, value0, ...)``."""

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        cache = StaticStateCache(self.kv_layout, self.layer_ids, kinds=self.kinds)
        return self._run(input_ids, attention_mask, position_ids, cache)


def merge_image_features(
    embed_tokens: nn.Module, input_ids: torch.Tensor, image_features: torch.Tensor, image_token_id: int
) -> torch.Tensor:
    """Input embeddings ``[B, Q, hidden]`` with image feature row ``k`` at the ``k``-th placeholder token.

    transformers' ``Kimi_K25Model.forward`` semantics: placeholder ids are embedded as token 0, the
    features are cast to the embedding dtype, and ``masked_scatter`` puts them at the placeholders in
    row-major order over ``[B, Q]`` (all rows of the batch share one feature tensor). Written as a
    gather instead (``order`` counts the placeholders before each token), so the graph is static and
    executable by plain ATen executors. The caller must pass exactly as many placeholders as feature
    rows (``check_image_placeholders``): fewer leave rows unused, more index past the features.
    """
    placeholders = input_ids == image_token_id
    embeds = embed_tokens(input_ids.masked_fill(placeholders, 0))
    order = placeholders.flatten().to(torch.long).cumsum(0) - 1  # placeholder k has order k
    rows = image_features.to(embeds.dtype).index_select(0, order.clamp(min=0))
    return torch.where(placeholders.unsqueeze(-1), rows.view(embeds.shape), embeds)


def check_image_placeholders(input_ids: torch.Tensor, image_token_id: int, feature_rows: int) -> None:
    """Refuse a prompt whose placeholder count differs from the feature rows (the graph cannot check)."""
    count = int((input_ids == image_token_id).sum())
    if count != feature_rows:
        raise ValueError(
            f"the prompt has {count} image placeholder tokens (id {image_token_id}) but the image features "
            f"have {feature_rows} rows; they must be equal"
        )


class MultimodalPrefillWrapper(_TextStack):
    """Prompt pass with images: ``(input_ids, image_features, attention_mask, position_ids)`` ->
    ``(logits, key0, value0, ...)``; the embeddings come from ``merge_image_features``, the rest is
    the prefill's, so its KV continues into the decode graph exactly like the text prefill's."""

    def __init__(self, *args: Any, image_token_id: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.per_layer_inputs is not None:  # they are computed from the token ids, not the features
            raise ValueError("a merged image prefill of a stack with per-layer embeddings is not supported")
        self.image_token_id = image_token_id

    def forward(
        self,
        input_ids: torch.Tensor,
        image_features: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        cache = StaticStateCache(self.kv_layout, self.layer_ids, kinds=self.kinds)
        hidden_states = merge_image_features(
            self.embed_tokens, input_ids, image_features, self.image_token_id
        )
        return self._stack(hidden_states, attention_mask, position_ids, cache, input_ids=input_ids)


class DecodeWrapper(_TextStack):
    """One token per row over a static cache: inputs end with ``past key0, value0, ...``, outputs the
    updated ones. ``cache_position`` ``[B]`` is each row's own position (rows may be at different
    positions: continuous batching).

    ``paged=True``: after ``cache_position`` comes ``block_table`` ``[B, max_cache_len / block_size]``
    (int64, physical block of each row's logical block) and each past tensor is a shared block pool
    ``[num_blocks, block_size, heads, dim]`` (vLLM's layout); the outputs are the updated pools.
    """

    def __init__(self, *args: Any, paged: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.paged = paged

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache_position: torch.Tensor,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        block_table, past_states = (tensors[0], tensors[1:]) if self.paged else (None, tensors)
        past = per_layer_states(past_states, self.kinds)
        cache = StaticStateCache(
            self.kv_layout, self.layer_ids, past, cache_position, block_table, kinds=self.kinds
        )
        return self._run(input_ids, attention_mask, position_ids, cache)


def prefill_inputs(
    *, batch: int, prefill_len: int, dtype: torch.dtype, device: str | torch.device = "meta"
) -> tuple[torch.Tensor, ...]:
    """Example prefill inputs (token ids 0; real positions and causal mask)."""
    positions = torch.arange(prefill_len, device=device).unsqueeze(0).repeat(batch, 1)
    input_ids = torch.zeros(batch, prefill_len, dtype=torch.long, device=device)
    return input_ids, additive_causal_mask(positions, prefill_len, dtype), positions


def multimodal_prefill_inputs(
    *,
    batch: int,
    prefill_len: int,
    feature_rows: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "meta",
) -> tuple[torch.Tensor, ...]:
    """Example multimodal prefill inputs: the prefill's, with zero image features after the token ids."""
    input_ids, mask, positions = prefill_inputs(
        batch=batch, prefill_len=prefill_len, dtype=dtype, device=device
    )
    features = torch.zeros(feature_rows, hidden_size, dtype=dtype, device=device)
    return input_ids, features, mask, positions


# Per request, the shape (without the batch) and dtype name of each state of a linear layer in its kind's
# ABI order (conv and recurrent; a lightning layer's recurrent alone, a short convolution's conv alone), as
# ``upstream.LayerProtocol.linear_states`` observed them.
LinearStates = tuple[tuple[tuple[int, ...], str], ...]


def linear_state_zeros(
    linear_states: LinearStates, batch: int, device: str | torch.device
) -> list[torch.Tensor]:
    """A linear layer's states (conv and recurrent; lightning: recurrent; short_conv: conv) for ``batch``
    rows before any token: zeros."""
    return [
        torch.zeros((batch, *shape), dtype=getattr(torch, dtype), device=device)
        for shape, dtype in linear_states
    ]


def decode_inputs(
    kv_dims: KVDims,
    *,
    batch: int,
    position: int,
    max_cache_len: int,
    num_layers: int,
    dtype: torch.dtype,
    device: str | torch.device = "meta",
    paged: tuple[int, int] | None = None,
    kinds: Sequence[str] | None = None,
    linear_states: LinearStates | None = None,
    index_dim: int | None = None,
    layer_kv_dims: Sequence[KVDims] | None = None,
    compress_rates: Mapping[str, int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Example decode inputs for the token at ``position`` in every row, with zeroed caches.

    ``paged`` ``(block_size, num_blocks)``: a block table giving row ``b`` blocks ``b * blocks ...``
    and zeroed pools ``[num_blocks, block_size, heads, dim]`` instead of per-row caches. ``kinds``
    gives each layer's kind (None: all attention); a ``linear`` layer takes its zeroed
    ``linear_states`` per row instead (never paged); an ``indexed`` layer also its indexer keys, a
    one-head cache of ``index_dim``. ``layer_kv_dims``: each layer's own KV dims when they differ per
    layer (None: ``kv_dims`` for every layer). ``compress_rates``: a compressed layer kind's rate
    (``{"hca": 128}``): its ring and entries per row after its KV (``compressed_shapes``).
    """
    positions = torch.full((batch, 1), position, dtype=torch.long, device=device)
    index_dims: KVDims = ((1, index_dim or 1),) * 2  # the indexer keys: one head

    index_shape = decode_kv_shapes(index_dims, batch, max_cache_len, paged)[0]
    table: tuple[torch.Tensor, ...] = ()
    if paged is not None:
        blocks = max_cache_len // paged[0]
        table = (torch.arange(batch * blocks, device=device).remainder(paged[1]).view(batch, blocks),)
    past: list[torch.Tensor] = []
    for layer, kind in enumerate(kinds if kinds is not None else ["attention"] * num_layers):
        if not LAYER_STATES[kind]:  # no state (an MLP alone, a KV-sharing layer): nothing to pass
            continue
        if kind in LINEAR_LAYER_KINDS:
            assert linear_states is not None, "a linear layer needs its linear_states"
            past += linear_state_zeros(linear_states, batch, device)
            continue
        dims = layer_dims(kv_dims, layer_kv_dims, layer)
        key_shape, value_shape = decode_kv_shapes(dims, batch, max_cache_len, paged)
        past += [
            torch.zeros(key_shape, dtype=dtype, device=device),
            torch.zeros(value_shape, dtype=dtype, device=device),
        ]
        if kind == "indexed":
            assert index_dim is not None, "an indexed layer needs its index_dim"
            past.append(torch.zeros(index_shape, dtype=dtype, device=device))
        if kind == "hybrid":  # the mixer's states after the attention's KV
            assert linear_states is not None, "a hybrid layer needs its linear_states"
            past += linear_state_zeros(linear_states, batch, device)
        if kind in COMPRESSED_KINDS:
            assert compress_rates is not None, f"a {kind} layer needs its compress rate"
            rate, windows = compress_rates[kind], LAYER_RINGS[kind]
            shapes = compressed_shapes(dims[0][1], rate, batch, max_cache_len, windows)
            if kind == "csa":  # its indexer's own series
                assert index_dim is not None, "a csa layer needs its indexer's index_dim"
                shapes += compressed_shapes(index_dim, rate, batch, max_cache_len, windows)
            past += [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
    return (
        torch.zeros(batch, 1, dtype=torch.long, device=device),
        additive_causal_mask(positions, max_cache_len, dtype),
        positions,
        torch.full((batch,), position, dtype=torch.long, device=device),
        *table,
        *past,
    )


def paged_shapes(
    kv_dims: KVDims, block_size: int, num_blocks: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of one layer's key and value block pools: ``[num_blocks, block_size, heads, dim]``."""
    (key_heads, key_dim), (value_heads, value_dim) = kv_dims
    return (num_blocks, block_size, key_heads, key_dim), (num_blocks, block_size, value_heads, value_dim)


def compressed_shapes(
    head_dim: int, rate: int, batch: int | str, max_cache_len: int, windows: int = 1
) -> tuple[tuple[int | str, ...], tuple[int | str, ...]]:
    """Decode shapes of a compressor's ring ``[B, 1, windows x rate, 2 x windows x head_dim]`` (its raw
    ``kv || gate``, each ``windows x head_dim`` wide: csa's two series) and entries ``[B, 1, max_cache_len
    / rate, head_dim]`` (per request: never paged)."""
    if max_cache_len % rate:
        raise ValueError(f"max_cache_len {max_cache_len} is not a multiple of the compress rate {rate}")
    return (batch, 1, windows * rate, 2 * windows * head_dim), (batch, 1, max_cache_len // rate, head_dim)


def decode_kv_shapes(
    kv_dims: KVDims, batch: int | str, max_cache_len: int, paged: tuple[int, int] | None
) -> tuple[tuple[int | str, ...], tuple[int | str, ...]]:
    """Shapes of one layer's decode key and value: the contiguous cache for ``max_cache_len`` positions,
    or with ``paged`` ``(block_size, num_blocks)`` its block pools (``paged_shapes``)."""
    if paged is None:
        return kv_shapes(kv_dims, batch, max_cache_len)
    return paged_shapes(kv_dims, *paged)


def place_prefill_kv(
    present: Sequence[torch.Tensor], max_cache_len: int, kinds: Sequence[str] | None = None
) -> list[torch.Tensor]:
    """Decode cache from prefill outputs: ``zeros.index_copy(2, arange(prefill_len), present)``; a
    linear layer's states (``kinds``, None: all attention) are the decode inputs as they are."""
    placed: list[torch.Tensor] = []
    owners = flat_state_kinds(kinds, len(present))
    for tensor, role, kind in zip(present, flat_state_roles(kinds, len(present)), owners, strict=True):
        if role in FIXED_ROLES:
            placed.append(tensor)
            continue
        if role in COMPRESSED_ROLES:  # after its ring, which gives the rate
            placed.append(place_compressed(tensor, max_cache_len, compressor_rate(placed[-1], kind)))
            continue
        shape = (*tensor.shape[:2], max_cache_len, *tensor.shape[3:])
        positions = torch.arange(tensor.shape[2], device=tensor.device)
        placed.append(
            torch.zeros(shape, dtype=tensor.dtype, device=tensor.device).index_copy(2, positions, tensor)
        )
    return placed


def place_compressed(entries: torch.Tensor, max_cache_len: int, rate: int) -> torch.Tensor:
    """A compressor's decode entries ``[B, 1, max_cache_len / rate, dim]`` from the prefill's ``[B, 1, W,
    dim]``: slot ``w`` takes window ``w``'s entry, the rest zeros (masked until written)."""
    shape = (*entries.shape[:2], max_cache_len // rate, *entries.shape[3:])
    slots = torch.arange(entries.shape[2], device=entries.device)
    return torch.zeros(shape, dtype=entries.dtype, device=entries.device).index_copy(2, slots, entries)


def compressor_rate(ring: torch.Tensor, kind: str) -> int:
    """A compressor's rate from its ring ``[B, 1, ring, 2 * dim]``, which holds ``LAYER_RINGS[kind]``
    windows (the entries after it are placed and read by it)."""
    return ring.shape[2] // LAYER_RINGS[kind]


def flat_state_kinds(kinds: Sequence[str] | None, count: int) -> list[str]:
    """The layer kind each flat state tensor belongs to (None: ``count`` tensors of attention layers)."""
    if kinds is None:
        return ["attention"] * count
    return [kind for kind in kinds for _ in LAYER_STATES[kind]]


def flat_state_roles(kinds: Sequence[str] | None, count: int) -> list[str]:
    """The role of each flat state tensor (``key``, ``conv``, ``index_key``, ...), from each layer's
    kind (None: ``count`` tensors of attention layers)."""
    if kinds is None:
        return [LAYER_STATES["attention"][i % 2] for i in range(count)]
    return [role for kind in kinds for role in LAYER_STATES[kind]]


def place_prefill_kv_paged(
    present: Sequence[torch.Tensor],
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    pool_shapes: Sequence[Sequence[int]],
    kinds: Sequence[str] | None = None,
) -> list[torch.Tensor]:
    """Decode block pools from prefill outputs (``kv_cache: paged``): row ``b``'s positions
    ``0..lengths[b]-1`` written to their slots by the slot rule, the rest of each pool zeros.
    ``pool_shapes`` gives the pool of each state that grows with the context, in order (keys, values,
    indexer keys); a linear layer's states (``kinds``) stay per row.

    Pad positions are not written: their slots may be in blocks another row owns."""
    pools = []
    growing_shapes = iter(pool_shapes)
    owners = flat_state_kinds(kinds, len(present))
    for tensor, role, kind in zip(present, flat_state_roles(kinds, len(present)), owners, strict=True):
        if role in FIXED_ROLES:
            pools.append(tensor)
            continue
        if role in COMPRESSED_ROLES:  # per request, never paged (after its ring, which gives the rate)
            capacity = block_table.shape[1] * pool_shapes[0][1]
            pools.append(place_compressed(tensor, capacity, compressor_rate(pools[-1], kind)))
            continue
        shape = next(growing_shapes)
        num_blocks, block_size, heads, dim = shape
        flat = torch.zeros(num_blocks * block_size, heads, dim, dtype=tensor.dtype, device=tensor.device)
        for row in range(tensor.shape[0]):
            positions = torch.arange(int(lengths[row]), device=tensor.device)
            slots = paged_slots(positions, block_table[row : row + 1].expand(len(positions), -1), block_size)
            flat = flat.index_copy(0, slots, tensor[row, :, : len(positions)].transpose(0, 1))
        pools.append(flat.view(num_blocks, block_size, heads, dim))
    return pools


# What each layout's cached tensors hold (the KV mapping's contract says it, so a runtime needs no code).
KV_CONTENTS = {
    "heads": (
        "keys after rope, per KV head: [batch, kv_heads, slot, head_dim] (what the attention passes "
        "to Cache.update; query heads share them in groups of heads / kv_heads)",
        "values per KV head: [batch, kv_heads, slot, head_dim]",
    ),
    "latent": (
        "MLA's normalised compressed KV (kv_a_layernorm of the kv_lora_rank part of kv_a_proj_with_mqa): "
        "[batch, 1, slot, kv_lora_rank]; attention re-expands it with kv_b_proj",
        "MLA's shared rope'd key (the qk_rope_head_dim part of kv_a_proj_with_mqa, after rope): "
        "[batch, 1, slot, qk_rope_head_dim]",
    ),
    "expanded": (
        "MLA keys per head, [k_nope from kv_b_proj | rope'd shared key]: [batch, heads, slot, qk_head_dim]",
        "MLA values per head from kv_b_proj: [batch, heads, slot, v_head_dim]",
    ),
}


# What a runtime does with a linear-attention / SSM layer's fixed-size states (the state mapping's
# contract says it, so a runtime needs no code). vLLM keeps one such slot per request beside its paged
# attention blocks; here a row of the batch is that slot.
LINEAR_STATE_CONTENTS = {
    "conv": "the layer's causal depthwise convolution window: the inputs of the last kernel tokens, "
    "[batch, channels, kernel], the newest in the last column (zeros before the prompt's first token)",
    "recurrent": "the layer's linear-attention / SSM recurrent state after the last token, [batch, ...], "
    "in its own dtype (the reference kernels keep it in float32 whatever the ABI dtype)",
}
LIGHTNING_STATE_CONTENTS = (
    "a lightning-attention layer's recurrent state after the last token: per head the decayed sum of "
    "k^T v, [batch, heads, head_dim, head_dim], in the ABI dtype (transformers keeps it in the values' "
    "dtype); there is no conv window"
)
SHORT_CONV_STATE_CONTENTS = (
    "a gated short convolution's window (LFM2's conv layers): the B-gated inputs B * x of the last "
    "kernel tokens, [batch, hidden, kernel] in the ABI dtype, the newest in the last column (zeros "
    "before the prompt's first token); the prefill writes its prompt's last kernel columns, each decode "
    "step shifts the window left by one and writes its token's last; there is no recurrent state"
)
INDEX_KEY_CONTENTS = (
    "the DSA indexer's keys (k_norm(wk(x)) with rope on its first qk_rope_head_dim dims), one head: "
    "[batch, 1, slot, index_head_dim]; every query scores all visible slots with them and attends to its "
    "top index_topk keys only. Placed, written, masked and paged exactly like the layer's key"
)
LINEAR_STATE_RULES = {
    "initial": "no input: a request's prefill starts from zero state and returns the state after its prompt",
    "prefill_to_decode": "the prefill output is the decode input as it is (same shape, no placement, no "
    "sequence dimension)",
    "decode_update": "each decode step returns every row's state after its token; the outputs replace the "
    "inputs",
    "ragged": "rows are independent and no position enters these states, so rows may decode at different "
    "positions in one step. A prefill row's state takes every token it is given, pads included: prompts "
    "of different lengths are prefilled in separate calls (batch 1, or one call per length), never padded",
    "paged": "never paged: with kv_cache paged the attention layers use the block pools and these states "
    "stay one row per request ([batch, ...]), the request's slot",
    "finished_request": "its row is free: nothing to clear, the next request's prefill output replaces it",
    "joining_request": "a new request takes a free row: write its prefill outputs into that row; the other "
    "rows are untouched",
}


# What a runtime does with a compressed (``hca``) layer's compressor states (the state mapping's contract
# says it, so a runtime needs no code): the ring of the open window and the closed windows' entries.
COMPRESSED_STATE_RULES = {
    "comp_src": "the compressor's ring: the raw projections kv_proj(x) || gate_proj(x) of the latest "
    "position p = j mod rate in slot j, [batch, 1, rate, 2 * head_dim] in the ABI dtype (zeros before the "
    "prompt's first token); per request, never paged",
    "comp": "the compressed entries: slot w holds window w (positions w*rate..w*rate+rate-1) folded into "
    "one key/value entry (kv_norm of the softmax(gate + position_bias)-weighted sum, roped at w*rate), "
    "[batch, 1, max_cache_len / rate, head_dim]; per request, never paged",
    "prefill_to_decode": "comp_src: the prefill output is the decode input as it is (the prefill places "
    "slot j from position j + rate * floor((prefill_len - 1 - j) / rate), zeros where negative); comp: "
    "the prefill returns the prompt's floor(prefill_len / rate) entries [batch, 1, n, head_dim], copied "
    "to slots 0..n-1 of zeros of the decode shape",
    "decode_update": "each step writes row b's token into ring slot p_b % rate; when (p_b + 1) % rate == 0 "
    "the ring holds window (p_b + 1) / rate - 1 in position order and its entry is written to that slot; "
    "the outputs replace the inputs",
    "visibility": "the query at position p attends over its sliding window and entry slots w < (p + 1) // "
    "rate; the graph masks the others itself (no mask input covers the entries)",
    "ragged": "the ring is placed from the prompt's own length, so a prompt is never padded: prefill "
    "prompts of different lengths in separate calls; rows then decode together, each at its own position",
    "finished_request": "its row is free: nothing to clear, the next request's prefill output replaces it",
    "joining_request": "a new request takes a free row: write its ring and placed entries into that row",
    "capacity": "max_cache_len must be a multiple of every compressed layer's rate",
}


# What a csa layer (DeepSeek-V4's compressed sparse attention) keeps besides an hca layer's states, and
# how (``contract.compressed.sparse`` when the stack has one): overlapping windows and the indexer.
COMPRESSED_SPARSE_RULES = {
    "overlap": "a csa layer's ring holds two windows (ring = 2 * rate slots, slot p % (2 * rate)) of "
    "projections twice as wide, [batch, 1, 2 * rate, 4 * head_dim] (kv || gate, each two series): entry w "
    "pools window w - 1's first series with window w's second (window 0's previous one weighs 0); the "
    "prefill places slot j from position j + 2 * rate * floor((prefill_len - 1 - j) / (2 * rate))",
    "index_src": "its Lightning indexer's ring, as comp_src with the indexer's key width index_dim: [batch, "
    "1, 2 * rate, 4 * index_dim]; per request, never paged",
    "index_comp": "its indexer's compressed keys, as comp with index_dim: [batch, 1, max_cache_len / rate, "
    "index_dim], written in the same step as comp; per request, never paged",
    "top_k": "the query at position p scores every index_comp slot (sum over the indexer's heads of "
    "weight * relu(q . key)), hides slots w >= (p + 1) // rate and attends over its sliding window and the "
    "comp entries of its top min(index_topk, max_cache_len / rate) scores that are visible; the graph "
    "does it itself",
}


STATELESS_RULE = (
    "a layer of kind none is a block with no token mixer (an MLP alone): it keeps no state, so the graphs "
    "take and return nothing for it and a runtime carries nothing"
)


SHARED_RULE = (
    "a layer of kind shared attends with its own queries over the keys and values that the layer its "
    "entry names (kv_source, an earlier layer of the same layer type) computed in the same call: in prefill "
    "the prompt's, in decode that layer's whole updated cache (contiguous or its paged view) under this "
    "layer's own mask (its window); it caches nothing, so the graphs take and return nothing for it, and "
    "a runtime carries, pages, places and frees nothing for it (its source's cache serves both)"
)


HYBRID_RULE = (
    "a layer of kind hybrid runs full attention and a linear mixer, side by side on one input (Falcon-H1) "
    "or a shared transformer block and then its own mixer (Zamba, Zamba2): its entry carries the attention's "
    "key and value (placed, written, masked and paged as any attention layer's) and the mixer's conv and "
    "recurrent states (contract.linear_states: one row per request, never paged), in that order; the "
    "stack's prompts are never padded (padding.supported none)"
)


DYNAMIC_RULE = (
    "a dimension written as a name instead of a number is that dynamic size: bind each name from the "
    "graph input that carries it (input_ids dim 0 is batch, dim 1 is prefill_len), refuse a size outside "
    'its range before executing, and replace every operator attribute {"expr": text} by the value of '
    "text, a Python integer expression (integers, names, + - * // %, parentheses, max(), min())"
)


class PagedKV(NamedTuple):
    """``abi.kv_cache: paged``: the decode cache is a pool of fixed-size blocks shared by all rows."""

    block_size: int
    num_blocks: int
    block_table: str  # the decode graph's block-table input

    def contract(self, max_cache_len: int, batch: int | str, per_layer: bool = False) -> dict[str, Any]:
        blocks = max_cache_len // self.block_size
        sizes = "layers[i].cache's heads and dim" if per_layer else "the cache's heads and dim above"
        return {
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "blocks_per_row": blocks,
            "pool": "each decode KV input/output of a layer is a pool [num_blocks, block_size, heads, dim] "
            f"shared by every row ({sizes}); the outputs replace the inputs",
            "block_table": {
                "input": self.block_table,
                "shape": [batch, blocks],
                "dtype": "int64",
                "rule": "block_table[b, j] is the pool block holding row b's positions "
                f"j*{self.block_size}..(j+1)*{self.block_size}-1; blocks may be in any order; a block a row "
                "writes is that row's alone, a full block of a prefix common to several rows may be read by "
                "all of them (sharing); entries for blocks a row has not reached yet may name any block "
                "(the mask hides them). A row with no request still writes its token: give it a scratch "
                "block",
            },
            "sharing": "prefix reuse: rows whose prompts start with the same whole blocks may point at "
            "one copy of those blocks (full, read-only); the block holding a row's next position must be "
            "its own, so a shared partial last block is copied first (copy-on-write). The binder checks "
            "it on request (bind_step's check_ownership)",
            "pool_dims": {"block": 0, "offset": 1, "heads": 2, "dim": 3},
            "slot_rule": f"position p of row b is offset p % {self.block_size} of block "
            f"block_table[b, p // {self.block_size}]; the mask is the contiguous layout's, over logical "
            f"positions 0..{max_cache_len - 1}",
            "prefill_to_decode": "the prefill graph's KV outputs stay [batch, heads, prefill_len, dim]: "
            "write row b's positions 0..n_b-1 (its real tokens only) to their slots by the slot rule",
            "initial": "a pool starts as zeros (any finite values: masked slots are multiplied by 0)",
        }


PER_LAYER_KV_RULE = (
    "the attention layers cache different KV heads or head widths: each attention layer's entry states "
    "its own (layers[i].cache.key/value: heads, dim), and its tensors' shapes are those"
)

CHUNKED_MASK_RULE = (
    "chunked layers (attention_chunks) also hide k < p - p % chunk: a query sees only the keys of its own "
    "chunk of positions; the graph adds that itself from position_ids. Every slot is still kept (the "
    "caches are full length): right after a chunk boundary the query sees its own key only"
)


def kv_contract(
    kv_dims: KVDims,
    *,
    kv_layout: str,
    max_cache_len: int,
    dynamic: dict[str, tuple[int, int]] | None = None,
    paged: PagedKV | None = None,
    batch: int = 1,
    linear: bool = False,
    index_dim: int | None = None,
    stateless: bool = False,
    shared: bool = False,
    chunked: bool = False,
    lightning: bool = False,
    short_conv: bool = False,
    per_layer: bool = False,
    hybrid: bool = False,
    compressed: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Everything a runtime needs besides the graphs: cache semantics, masks, positions, capacity,
    with ``dynamic`` sizes (``{"prefill_len": (1, 64)}``) how to bind them, with ``paged`` the
    block pool and block table (``batch`` rows, or the dynamic ``batch``), and with ``linear`` (the
    stack has linear-attention / SSM layers) what their fixed-size states hold and the rules for them;
    with ``index_dim`` (DSA layers) what the indexer keys hold; with ``stateless`` (blocks with no mixer)
    that they carry nothing; with ``shared`` (KV-sharing layers) what they read and that they carry
    nothing; with ``chunked`` (chunked-attention layers) the chunk rule of the mask;
    with ``lightning`` (MiniMax's lightning layers) what their one recurrent state holds, same rules;
    with ``short_conv`` (LFM2's short convolutions) what their one conv window holds, same rules;
    with ``per_layer`` (the layers cache different KV shapes) the heads and widths move to each layer's
    entry (``layers[i].cache``) and ``cache.per_layer`` says so; with ``hybrid`` (layers that attend and
    run a linear mixer: Falcon-H1 side by side, Zamba and Zamba2 one after the other) that such a layer
    carries both (``linear`` is set too); with ``compressed`` (a compressed layer kind's rate:
    DeepSeek-V4's ``hca``, ``csa``) what its ring and entries hold and the rules for them (no padding
    either; a csa layer's overlapping windows and indexer: ``compressed.sparse``).

    Version 3: ``cache_position`` is ``[batch]`` (one position per row) and the optional paged cache;
    version 2 graphs took one ``[1]`` position for the whole batch."""
    key, value = KV_CONTENTS[kv_layout]
    (key_heads, key_dim), (value_heads, value_dim) = kv_dims
    dynamic = dynamic or {}
    padding = (
        "a shorter prompt of n < prefill_len tokens is padded after its end with any token id; "
        "its mask hides the pad slots (columns n..prefill_len-1); the first decode token is at "
        "position n and overwrites slot n. Each row of a batch is padded on its own: rows of "
        "lengths n_0, n_1, ... each hide their own pad slots and decode from their own length "
        "(ragged batches; a row may also join later, its cache rows placed from its own prefill). "
        "Left padding is not supported: positions would no longer equal slots."
    )
    if "prefill_len" in dynamic:
        low, high = dynamic["prefill_len"]
        padding = (
            f"none needed: the prefill graph takes any prompt length n in {low}..{high} (prefill_len = n). "
            "Prompts of different lengths in one batch are right padded to the longest: " + padding
        )
    contract: dict[str, Any] = {
        "version": 3,
        "cache": {
            "key": {"holds": key, "heads": key_heads, "dim": key_dim},
            "value": {"holds": value, "heads": value_heads, "dim": value_dim},
            "slot_rule": "cache slot k (dim 2) holds the token at position k",
        },
        "positions": {
            "position_ids": "int64 [batch, query_len]: the positions of the query tokens (rope)",
            "cache_position": "int64 [batch] (decode only): each row's position, the slot its new token "
            "is written to; rows are independent and may be at different positions in one step",
            "rule": "position_ids must equal the slots the tokens occupy: prefill 0..prefill_len-1, "
            "row b's decode token at position p_b uses position_ids[b] = [p_b] and cache_position[b] = p_b",
        },
        "mask": {
            "input": "attention_mask",
            "shape": "[batch, 1, query_len, key_len] (prefill: key_len = prefill_len; decode: max_cache_len)",
            "dtype": "the ABI dtype",
            "visible": 0.0,
            "hidden": "finfo(dtype).min",
            "rule": "key slot k is visible to the query at position p iff k <= p "
            "and slot k holds a real token",
            "sliding_windows": "layers with a window also hide k <= p - window; the graph adds that itself "
            "from position_ids, the caller passes one causal mask for every layer",
            **({"chunked_attention": CHUNKED_MASK_RULE} if chunked else {}),
        },
        "padding": (
            {"supported": "right", "rule": padding}
            if not (linear or lightning or short_conv or compressed)
            else {
                "supported": "none",
                "rule": "the linear layers' states take every token of a prefill row, so a prompt is never "
                "padded: prefill prompts of different lengths in separate calls (see linear_states.ragged); "
                "rows then decode together, each at its own position",
            }
            if not compressed
            else {
                "supported": "none",
                "rule": "a compressed layer's ring is placed from the prompt's length (compressed.ragged), "
                "so a prompt is never padded: prefill prompts of different lengths in separate calls; rows "
                "then decode together, each at its own position",
            }
        ),
        "capacity": {
            "max_position": max_cache_len - 1,
            "rule": f"positions 0..{max_cache_len - 1}; a token at position >= max_cache_len has no slot "
            "and must not be decoded",
        },
    }
    if dynamic:
        contract["dynamic"] = {
            "sizes": {name: list(bounds) for name, bounds in dynamic.items()},
            "rule": DYNAMIC_RULE,
        }
    if per_layer:
        contract["cache"]["key"] = {"holds": key}
        contract["cache"]["value"] = {"holds": value}
        contract["cache"]["per_layer"] = PER_LAYER_KV_RULE
    if index_dim is not None:
        contract["cache"]["index_key"] = {"holds": INDEX_KEY_CONTENTS, "heads": 1, "dim": index_dim}
    if stateless:
        contract["stateless_layers"] = STATELESS_RULE
    if shared:
        contract["shared_layers"] = SHARED_RULE
    if hybrid:
        contract["hybrid_layers"] = HYBRID_RULE
    if linear:
        contract["linear_states"] = {
            "conv": {"holds": LINEAR_STATE_CONTENTS["conv"]},
            "recurrent": {"holds": LINEAR_STATE_CONTENTS["recurrent"]},
            **LINEAR_STATE_RULES,
        }
    if lightning:
        contract["linear_states"] = {"recurrent": {"holds": LIGHTNING_STATE_CONTENTS}, **LINEAR_STATE_RULES}
    if short_conv:
        contract["linear_states"] = {"conv": {"holds": SHORT_CONV_STATE_CONTENTS}, **LINEAR_STATE_RULES}
    if compressed:
        contract["compressed"] = {"rates": dict(compressed), **COMPRESSED_STATE_RULES}
        if "csa" in compressed:
            contract["compressed"]["sparse"] = COMPRESSED_SPARSE_RULES
    if paged is not None:
        contract["paged"] = paged.contract(max_cache_len, "batch" if "batch" in dynamic else batch, per_layer)
        contract["cache"]["slot_rule"] += (
            " in the prefill outputs and in each row's logical cache; the decode pools are addressed by "
            "contract.paged.slot_rule"
        )
    return contract


def build_kv_mapping(
    kv_dims: KVDims,
    *,
    kv_layout: str,
    batch: int,
    prefill_len: int,
    max_cache_len: int,
    num_layers: int,
    dtype: str,
    names: dict[str, str],
    mla_attention: str = "reexpand",
    dynamic: dict[str, tuple[int, int]] | None = None,
    paged: PagedKV | None = None,
    kinds: Sequence[str] | None = None,
    linear_states: LinearStates | None = None,
    index_dim: int | None = None,
    chunked: bool = False,
    layer_kv_dims: Sequence[KVDims] | None = None,
    kv_sources: Sequence[int | None] | None = None,
    compress_rates: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """How prefill KV outputs become decode KV inputs, layer by layer.

    ``names`` maps ``prefill_key``/``prefill_value``/``decode_key_in``/``decode_value_in``/
    ``decode_key_out``/``decode_value_out`` to name templates containing ``{layer}``.
    ``mla_attention`` is recorded only when it is not the default ``reexpand`` (the cache is the same).
    ``dynamic`` sizes (``{"batch": (1, 8)}``) appear in shapes by name, with their ranges.
    ``paged``: the decode KV tensors are block pools (``kv_cache: paged``), the contract says how.
    ``kinds`` gives each layer's kind (None: all attention); a ``linear`` layer's entry names its conv
    and recurrent states (``names`` ``prefill_conv``/``decode_conv_in``/... templates) with the shapes
    and dtypes of ``linear_states``, and the contract says how a runtime carries them; an ``indexed``
    layer's entry adds its indexer keys (``prefill_index_key``/...: a one-head key of ``index_dim``).
    ``chunked``: the stack has chunked-attention layers, and the contract's mask states their rule.
    ``layer_kv_dims``: each layer's own KV dims when they differ per layer; each attention entry then
    states its heads and widths (``cache``), which the contract's ``cache`` no longer does.
    ``kv_sources``: per layer the earlier layer whose keys and values a ``shared`` layer attends over
    (its entry names it, ``kv_source``; the contract states the rule).
    ``compress_rates``: a compressed layer kind's rate (``{"hca": rate, "csa": rate}``); an ``hca`` layer's
    entry adds its ring and entries (the second pair of templates, ``names`` ``prefill_conv``/...:
    ``SECOND_PAIR``), a ``csa`` layer's also its indexer's (``prefill_index_src``/..., ``index_dim`` wide).
    """
    dynamic = dynamic or {}
    batch_dim: int | str = "batch" if "batch" in dynamic else batch
    length_dim: int | str = "prefill_len" if "prefill_len" in dynamic else prefill_len

    pool = None if paged is None else (paged.block_size, paged.num_blocks)

    def tensor(role: str, layer: int, shape: tuple[int | str, ...], kind: str = dtype) -> dict[str, Any]:
        return {"name": names[role].format(layer=layer), "shape": list(shape), "dtype": kind}

    kinds = list(kinds) if kinds is not None else ["attention"] * num_layers
    hybrid = any(kind != "attention" for kind in kinds)
    index_dims: KVDims = ((1, index_dim or 1),) * 2
    prefill_index = kv_shapes(index_dims, batch_dim, length_dim)[0]
    decode_index = decode_kv_shapes(index_dims, batch_dim, max_cache_len, pool)[0]
    layers: list[dict[str, Any]] = []
    for layer, kind in enumerate(kinds):
        if kind in STATELESS_KINDS:  # no state to carry: the entry says so
            layers.append({"layer": layer, "kind": kind})
            continue
        if kind == "shared":  # attends over its source's keys and values of the same call
            source = kv_sources[layer] if kv_sources is not None else None
            layers.append({"layer": layer, "kind": kind, "kv_source": source})
            continue
        fixed: dict[str, Any] = {}  # a linear or hybrid layer's fixed-size states, in ABI order
        if kind in UNPADDED_KINDS:
            assert linear_states is not None, f"a {kind} layer needs its linear_states"
            roles = [role for role in LAYER_STATES[kind] if role in FIXED_ROLES]
            for state, (shape, state_dtype) in zip(roles, linear_states, strict=True):
                full = (batch_dim, *shape)
                for role, key in (
                    ("prefill_{}", "prefill_{}_output"),
                    ("decode_{}_in", "decode_{}_input"),
                    ("decode_{}_out", "decode_{}_output"),
                ):
                    fixed[key.format(state)] = tensor(role.format(state), layer, full, state_dtype)
        if kind in LINEAR_LAYER_KINDS:
            layers.append({"layer": layer, "kind": kind, **fixed})
            continue
        dims = layer_dims(kv_dims, layer_kv_dims, layer)
        prefill_shapes = kv_shapes(dims, batch_dim, length_dim)
        decoded = decode_kv_shapes(dims, batch_dim, max_cache_len, pool)
        (key_heads, key_dim), (value_heads, value_dim) = dims
        layers.append(
            {
                "layer": layer,
                **({"kind": kind} if hybrid else {}),
                **(
                    {
                        "cache": {
                            "key": {"heads": key_heads, "dim": key_dim},
                            "value": {"heads": value_heads, "dim": value_dim},
                        }
                    }
                    if layer_kv_dims is not None
                    else {}
                ),
                "prefill_key_output": tensor("prefill_key", layer, prefill_shapes[0]),
                "prefill_value_output": tensor("prefill_value", layer, prefill_shapes[1]),
                "decode_key_input": tensor("decode_key_in", layer, decoded[0]),
                "decode_value_input": tensor("decode_value_in", layer, decoded[1]),
                "decode_key_output": tensor("decode_key_out", layer, decoded[0]),
                "decode_value_output": tensor("decode_value_out", layer, decoded[1]),
                **(
                    {
                        "prefill_index_key_output": tensor("prefill_index_key", layer, prefill_index),
                        "decode_index_key_input": tensor("decode_index_key_in", layer, decode_index),
                        "decode_index_key_output": tensor("decode_index_key_out", layer, decode_index),
                    }
                    if kind == "indexed"
                    else {}
                ),
                **fixed,
                **(
                    _compressed_entry(
                        tensor,
                        layer,
                        (dims[0][1], index_dim or 1) if kind == "csa" else (dims[0][1],),
                        compress_rates[kind],
                        batch_dim,
                        length_dim,
                        max_cache_len,
                    )
                    if kind in COMPRESSED_KINDS and compress_rates is not None
                    else {}
                ),
            }
        )
    attention = {} if mla_attention == "reexpand" else {"mla_attention": mla_attention}
    return {
        "kv_layout": kv_layout,
        **attention,
        "contract": kv_contract(
            kv_dims,
            kv_layout=kv_layout,
            max_cache_len=max_cache_len,
            dynamic=dynamic,
            paged=paged,
            batch=batch,
            linear="linear" in kinds or "hybrid" in kinds,
            lightning="lightning" in kinds,
            short_conv="short_conv" in kinds,
            index_dim=index_dim if "indexed" in kinds else None,
            stateless=any(kind in STATELESS_KINDS for kind in kinds),
            shared="shared" in kinds,
            hybrid="hybrid" in kinds,
            chunked=chunked,
            per_layer=layer_kv_dims is not None,
            compressed={k: v for k, v in (compress_rates or {}).items() if k in kinds} or None,
        ),
        "kv_cache": "contiguous" if paged is None else "paged",
        "batch": batch,
        "prefill_len": prefill_len,
        **({"dynamic": {name: list(bounds) for name, bounds in dynamic.items()}} if dynamic else {}),
        "max_cache_len": max_cache_len,
        "num_layers": num_layers,
        "dtype": dtype,
        "sequence_dim": 2,  # of the prefill outputs and the contiguous decode caches (pools: pool_dims)
        "prefill_to_decode": (
            {
                "op": "index_copy",
                "dim": 2,
                "positions": [0, length_dim],
                "into": "zeros of the decode input shape",
            }
            if paged is None
            else {"op": "paged_write", "rule": "see contract.paged.prefill_to_decode"}
        ),
        "decode_update": (
            {
                "op": "write_rows",
                "dim": 2,
                "index": "cache_position",
                "rule": "row b's new token at slot cache_position[b] of row b",
                "outputs_replace_inputs": True,
            }
            if paged is None
            else {
                "op": "paged_write",
                "index": "cache_position",
                "rule": "see contract.paged.slot_rule",
                "outputs_replace_inputs": True,
            }
        ),
        "layers": layers,
    }


def _compressed_entry(
    tensor: Any,
    layer: int,
    widths: tuple[int, ...],
    rate: int,
    batch: int | str,
    length: int | str,
    max_cache_len: int,
) -> dict[str, Any]:
    """A compressed layer's rings and entries in its mapping entry (``contract.compressed``): its
    compressor's (``widths[0]``, named by the ABI's second pair of templates: ``prefill_conv``/... hold
    them, as a stack has linear layers or compressed ones) and, for a csa layer (``widths[1]``: its
    indexer's key width), its indexer's (``prefill_index_src``/...). A csa ring holds two windows."""
    windows = len(widths)  # LAYER_RINGS: hca one window, csa (with its indexer) two
    out: dict[str, Any] = {"compress_rate": rate}
    series = (
        ("comp_src", "conv", "comp", "recurrent"),
        ("index_src", "index_src", "index_comp", "index_comp"),
    )
    for width, (ring_state, ring_template, entry_state, entry_template) in zip(widths, series, strict=False):
        ring, entries = compressed_shapes(width, rate, batch, max_cache_len, windows)
        prompt = (batch, 1, length if isinstance(length, str) else length // rate, width)
        for state, template, prefill_shape, decode_shape in (
            (ring_state, ring_template, ring, ring),
            (entry_state, entry_template, prompt, entries),
        ):
            out[f"prefill_{state}_output"] = tensor(f"prefill_{template}", layer, prefill_shape)
            out[f"decode_{state}_input"] = tensor(f"decode_{template}_in", layer, decode_shape)
            out[f"decode_{state}_output"] = tensor(f"decode_{template}_out", layer, decode_shape)
    return out


MERGED_PREFILL_RULE = (
    "the multimodal prefill replaces the text prefill for a prompt with images: its input_ids hold one "
    "placeholder token (placeholder_token_id) per image feature row, and the placeholder count must equal "
    "the feature rows (the graph cannot check it: fewer leave rows unused, more index past them); row k "
    "of the features replaces the k-th placeholder in row-major order over [batch, prefill_len]. "
    "Placeholders take ordinary consecutive position_ids; mask, positions and right padding (with any "
    "token id but the placeholder) are the text prefill's. The KV outputs continue into the decode graph "
    "exactly like the text prefill's (prefill_to_decode)."
)


def build_merged_prefill_mapping(
    kv_dims: KVDims,
    *,
    graph: str,
    inputs: Sequence[str],
    batch: int,
    prefill_len: int,
    num_layers: int,
    dtype: str,
    names: dict[str, str],
    feature_input: str,
    feature_shape: Sequence[int],
    placeholder_token_id: int,
    features_from: dict[str, Any] | None = None,
    dynamic: dict[str, tuple[int, int]] | None = None,
    layer_kv_dims: Sequence[KVDims] | None = None,
) -> dict[str, Any]:
    """The KV mapping's ``merged_prefill`` section: the multimodal prefill graph and how its KV feeds decode.

    ``names`` maps ``prefill_key``/``prefill_value`` (this graph's outputs) and ``decode_key_in``/
    ``decode_value_in`` to ``{layer}`` templates; ``dynamic`` sizes appear in shapes by name.
    """
    dynamic = dynamic or {}
    batch_dim: int | str = "batch" if "batch" in dynamic else batch
    length_dim: int | str = "prefill_len" if "prefill_len" in dynamic else prefill_len

    def tensor(role: str, layer: int, index: int) -> dict[str, Any]:
        shape = kv_shapes(layer_dims(kv_dims, layer_kv_dims, layer), batch_dim, length_dim)[index]
        return {"name": names[role].format(layer=layer), "shape": list(shape), "dtype": dtype}

    return {
        "graph": graph,
        "inputs": list(inputs),
        "batch": batch,
        "prefill_len": prefill_len,
        **({"dynamic": {name: list(bounds) for name, bounds in dynamic.items()}} if dynamic else {}),
        "image_features": {
            "input": feature_input,
            "shape": list(feature_shape),
            "dtype": dtype,
            **({"from": features_from} if features_from else {}),
        },
        "placeholder_token_id": placeholder_token_id,
        "rule": MERGED_PREFILL_RULE,
        "prefill_to_decode": {
            "op": "index_copy",
            "dim": 2,
            "positions": [0, length_dim],
            "into": "zeros of the decode input shape",
        },
        "layers": [
            {
                "layer": layer,
                "prefill_key_output": tensor("prefill_key", layer, 0),
                "prefill_value_output": tensor("prefill_value", layer, 1),
                "decode_key_input": names["decode_key_in"].format(layer=layer),
                "decode_value_input": names["decode_value_in"].format(layer=layer),
            }
            for layer in range(num_layers)
        ],
    }
