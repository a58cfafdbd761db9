"""DeepSeek-V2 attention for export: its complex rope in real arithmetic.

transformers' DeepSeek-V2 rotary embedding returns complex ``freqs_cis = polar(1, angles)`` (times the
rope's ``attention_scaling``) instead of ``(cos, sin)``, and its attention rotates the rope part of the
queries and of the shared key (``q_pe``, ``k_pe``: ``qk_rope_head_dim`` wide) as interleaved pairs with
``view_as_complex`` (``apply_rotary_emb``). kadapt's probes and wrappers pass ``(cos, sin)``, and complex
tensors in the graphs burden every executor that is not torch, so the stack was refused
(``rotary-form``). The two builtins below are upstream's code with exactly that changed, the arithmetic
of Llama-4's builtins (``builtins/llama4.py``; a generated module embeds a builtin with its own module's
names only, so each module keeps its copy):

- ``deepseek_v2_rotary_cos_sin`` gives ``(cos, sin)`` ``[B, Q, qk_rope_head_dim / 2]`` of the same
  angles, each times ``attention_scaling``;
- ``deepseek_v2_attention_forward`` rotates ``q_pe`` and ``k_pe`` pair by pair from them in float32
  (``a cos - b sin, a sin + b cos``: the complex multiply written out, bit-identical given the same
  cos/sin; ``torch.cos``/``torch.sin`` are within a float32 ulp of ``polar``'s).
  Everything else is upstream's, in its order, so the MLA machinery sees what it sees in DeepSeek-V3:
  the latents (``kv_a_layernorm``'d ``k_nope`` ``[B, 1, S, kv_lora_rank]`` and the rope'd ``k_pe``
  ``[B, 1, S, qk_rope_head_dim]``) go to ``cache.update`` (the ``latent`` layout caches them as they
  are), then ``self.expand_kv`` re-expands what the cache returns, looked up on the instance so that the
  ``expanded`` layout's cache can route it. The key's rope part stays interleaved as upstream leaves it,
  so the cached ``k_pe`` is upstream's.
"""

from __future__ import annotations

from typing import Any

import torch

# rope types whose frequencies ``dynamic_rope_update`` recomputes from the positions' values (upstream's
# forward carries that decorator): not a static graph, and not reproduced here
_DYNAMIC_ROPE = ("dynamic", "longrope")


def deepseek_v2_rotary_cos_sin(
    self: Any, x: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``replace`` impl for ``DeepseekV2RotaryEmbedding.forward``: ``(cos, sin)``
    ``[B, Q, qk_rope_head_dim / 2]`` of upstream's angles ``position * inv_freq``, each times
    ``attention_scaling`` (upstream multiplies ``polar(1, angles)`` by it), instead of the complex
    ``freqs_cis``."""
    if any(kind in str(self.rope_type) for kind in _DYNAMIC_ROPE):
        raise ValueError(
            f"deepseek_v2_rotary_cos_sin: rope_type {self.rope_type!r} recomputes its frequencies from the "
            "positions' values (dynamic_rope_update), which a static graph cannot; static rope types only"
        )
    angles = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    return torch.cos(angles) * self.attention_scaling, torch.sin(angles) * self.attention_scaling


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, heads, Q, rope]`` with each interleaved pair ``(x[2i], x[2i+1])`` rotated by angle ``i``
    (``cos``/``sin`` ``[B, 1, Q, rope / 2]``): upstream's ``apply_rotary_emb`` in real arithmetic, in
    float32, then back to ``x``'s dtype (the rotated pairs stay interleaved, as upstream leaves them)."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(3).type_as(x)


def deepseek_v2_attention_forward(
    self: Any,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``replace`` impl for ``DeepseekV2Attention.forward``: upstream's MLA attention with the rope part
    of the queries and of the shared key rotated from ``(cos, sin)`` (``deepseek_v2_rotary_cos_sin``) in
    real arithmetic. transformers 5.23 hands the cache over as ``past_key_values`` (and its ``update``
    takes no ``kwargs=``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import eager_attention_forward

    legacy = kwargs.pop("past_key_values", None)
    cache = cache if cache is not None else legacy
    update_extra = {} if legacy is not None else {"kwargs": kwargs}
    batch_size, seq_length = hidden_states.shape[:-1]
    query_shape = (batch_size, seq_length, -1, self.qk_head_dim)

    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(query_shape).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

    compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
    kv_nope, k_pe = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    k_nope = self.kv_a_layernorm(kv_nope).view(batch_size, 1, seq_length, self.kv_lora_rank)
    k_pe = k_pe.view(batch_size, 1, seq_length, self.qk_rope_head_dim)

    # [B, Q, rope / 2] -> [B, 1, Q, rope / 2]: every head (and the one shared key) rotates alike
    cos, sin = (t.to(q_pe.device)[:, None] for t in position_embeddings)
    q_pe, k_pe = _rotate_pairs(q_pe, cos, sin), _rotate_pairs(k_pe, cos, sin)

    if cache is not None:  # the latents are cached compressed, as upstream caches them
        k_nope, k_pe = cache.update(k_nope, k_pe, self.layer_idx, **update_extra)

    query_states = torch.cat((q_nope, q_pe), dim=-1)
    key_states, value_states = self.expand_kv(k_nope, k_pe)

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
    attn_output = attn_output.reshape(batch_size, seq_length, -1).contiguous()
    return self.o_proj(attn_output), attn_weights
