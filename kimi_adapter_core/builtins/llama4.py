"""Llama-4 text attention for export: real rotary arithmetic and per-row attention temperature.

transformers' Llama-4 rotates queries and keys with complex numbers (``freqs_cis = polar(1, angles)``,
``view_as_complex`` of interleaved pairs, a complex multiply, ``view_as_real``). That exports, but
leaves complex tensors in the graphs, a burden for every executor that is not torch. And its NoPE
layers scale the queries by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` with ``p`` taken
from ``cache.get_seq_length()``: one past length for the whole batch, viewed ``[1, Q, 1, 1]``, which
fails for a batch whose rows decode at different positions. The two builtins below are upstream's
code with exactly those two things changed:

- ``llama4_rotary_cos_sin`` gives ``(cos, sin)`` ``[B, Q, head_dim / 2]`` of the same angles (times the
  rope's ``attention_scaling``, as upstream scales ``freqs_cis``), the form kadapt's wrappers pass on;
- ``llama4_attention_forward`` rotates each interleaved pair ``(x[2i], x[2i+1])`` by angle ``i`` in
  float32 (``a cos - b sin, a sin + b cos``: the complex multiply written out, bit-identical given the
  same cos/sin) and takes each row's own positions for the temperature.

``torch.cos``/``torch.sin`` differ from ``polar``'s by at most one float32 ulp (a few percent of the
entries), so float32 logits differ from upstream's by ~1e-7; bfloat16 runs measured bit-identical.
"""

from __future__ import annotations

from typing import Any

import torch

# rope types whose frequencies ``dynamic_rope_update`` recomputes from the positions' values (upstream's
# forward carries that decorator): not a static graph, and not reproduced here
_DYNAMIC_ROPE = ("dynamic", "longrope")


def llama4_rotary_cos_sin(
    self: Any, x: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``replace`` impl for ``Llama4TextRotaryEmbedding.forward``: ``(cos, sin)`` ``[B, Q, head_dim / 2]``
    of upstream's angles ``position * inv_freq``, each times ``attention_scaling`` (upstream multiplies
    ``polar(1, angles)`` by it), instead of the complex ``freqs_cis``."""
    if any(kind in str(self.rope_type) for kind in _DYNAMIC_ROPE):
        raise ValueError(
            f"llama4_rotary_cos_sin: rope_type {self.rope_type!r} recomputes its frequencies from the "
            "positions' values (dynamic_rope_update), which a static graph cannot; static rope types only"
        )
    angles = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    return torch.cos(angles) * self.attention_scaling, torch.sin(angles) * self.attention_scaling


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, Q, heads, head_dim]`` with each interleaved pair ``(x[2i], x[2i+1])`` rotated by angle
    ``i`` (``cos``/``sin`` ``[B, Q, head_dim / 2]``): upstream's ``apply_rotary_emb`` in real arithmetic,
    in float32, then back to ``x``'s dtype."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(3).type_as(x)


def _temperature_scales(self: Any, hidden_states: torch.Tensor, cache: Any) -> torch.Tensor:
    """The NoPE layers' query scale ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` per row and
    query, ``[B or 1, Q, 1, 1]``. ``cache.get_seq_length`` is an int for transformers' caches (one past
    length for the batch) and a ``[B]`` tensor for kadapt's static cache in decode (each row's own
    position), so rows at different positions get their own scale."""
    past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
    offsets = torch.arange(hidden_states.shape[1], device=hidden_states.device)
    if isinstance(past, torch.Tensor):
        positions = past.view(-1, 1).to(offsets.device) + offsets
    else:
        positions = (offsets + past).view(1, -1)
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
    return scales.view(positions.shape[0], positions.shape[1], 1, 1)


def llama4_attention_forward(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``replace`` impl for ``Llama4TextAttention.forward``: upstream's attention with ``(cos, sin)``
    rotary embeddings (``llama4_rotary_cos_sin``) rotated in real arithmetic and the NoPE layers'
    temperature taken per row. transformers 5.23 hands the cache over as ``past_key_values`` (and its
    ``update`` takes no ``kwargs=``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama4.modeling_llama4 import eager_attention_forward

    legacy = kwargs.pop("past_key_values", None)
    cache = cache if cache is not None else legacy
    update_extra = {} if legacy is not None else {"kwargs": kwargs}
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_proj(hidden_states).view(hidden_shape)
    key_states = self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if self.use_rope:
        cos, sin = (t.to(query_states.device) for t in position_embeddings)
        query_states, key_states = _rotate_pairs(query_states, cos, sin), _rotate_pairs(key_states, cos, sin)
    if hasattr(self, "qk_norm"):
        query_states = self.qk_norm(query_states)
        key_states = self.qk_norm(key_states)
    if self.attn_temperature_tuning and not self.use_rope:
        scales = _temperature_scales(self, hidden_states, cache)
        query_states = (query_states * scales).to(query_states.dtype)
    query_states = query_states.transpose(1, 2)
    key_states = key_states.transpose(1, 2)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, **update_extra)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )
    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights
