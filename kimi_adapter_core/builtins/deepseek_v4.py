"""DeepSeek-V4's compressors for export: static-shape state kept by kadapt's cache, per row.

transformers' compressors (``DeepseekV4HCACompressor``, ``DeepseekV4CSACompressor`` and its
``DeepseekV4Indexer``) keep their state in ``DeepseekV4HCACache``/``DeepseekV4CSACache``: a buffer of the
raw projections that grows to ``T mod rate`` tokens (``torch.cat``), a Python-int ``entry_count``, a list
of entries that grows by one every ``rate`` tokens, the previous window's first series (CSA's overlap),
and they branch on ``chunk_kv.shape[1] > 0`` and ``seq_len == 1``. None of that has a static shape, and
one ``entry_count`` serves the whole batch. The builtins below are upstream's pooling with the state
moved to kadapt's static cache (its ``compressed_window``/``write_compressed`` protocol, contact point
``compressor_cache``); each is a ``wrap``, so upstream's forward still runs on any other cache (the
reference runs):

- the raw ``kv_proj || gate_proj`` of the current window's tokens (CSA: the previous window's too) live
  in a ring of ``rate`` (CSA: ``2 x rate``) slots, slot ``p % ring``; the entries in
  ``max_cache_len / rate`` slots (slot ``w``: window ``w``);
- decode pools the ring on every step and writes the entry only for the rows whose token closes a
  window (``(p + 1) % rate == 0``), at slot ``(p + 1) // rate - 1``;
- hca: every query sees entry ``w`` iff ``w < (p + 1) // rate`` (upstream's prefill block bias; in decode
  upstream attends over every entry it has, which are exactly those);
- csa: the indexer scores every slot, hides those not closed (``-inf``), takes the top
  ``min(index_topk, slots)`` and marks a pick of a hidden slot ``-1``, as upstream does over the entries
  it has (the same valid picks, up to exact ties, whose tie-break no rule defines); the attention sees
  the picked entries only.

The forwards of transformers 5.23 and 5.24 differ only in the cache parameter's name (5.23:
``past_key_values``; 5.24: ``cache``, behind a ``deprecate_kwarg``; the spec pins both sources), which
the builtins take by position or under either name, and in their modules' dtypes: 5.24 builds
``position_bias`` and ``kv_norm`` in float32, 5.23 in the model's dtype, and both releases' loaders keep
them float32 (``_keep_in_fp32_modules_strict``), so for a loaded checkpoint both forwards compute the
same; the builtins read every dtype off the module, as upstream's forward does.

The pooling itself is upstream's, line for line: ``softmax(gate + position_bias)`` over the window (CSA:
the previous window's first series and its own second, window 0's previous one at weight 0) in
float32, cast to the projections' dtype, the weighted sum, ``kv_norm``, then the compress rope at the
window's first position through the module's own rotary embedding and ``apply_rotary_pos_emb``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def deepseek_v4_hca_compressor(
    original: Any,
    self: Any,
    hidden_states: torch.Tensor,
    q_residual: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any = None,
    layer_idx: int = 0,
    *,
    past_key_values: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``wrap`` impl for ``DeepseekV4HCACompressor.forward``: with kadapt's static cache, every compressed
    entry slot ``[B, 1, slots, head_dim]`` and the additive bias ``[B, 1, Q, slots]`` that hides those
    not yet closed for each query (upstream returns the entries it has and, in decode, no bias); with
    any other cache (transformers' own, in the reference runs) upstream's forward as it is."""
    cache = _cache(cache, past_key_values)
    if not hasattr(cache, "compressed_window"):
        return original(self, hidden_states, q_residual, position_ids, cache, layer_idx)
    compressed = _compress(self, hidden_states, cache, layer_idx, "comp")
    hidden = torch.arange(compressed.shape[2], device=position_ids.device).view(1, 1, 1, -1) >= _closed(
        position_ids, self.compress_rate
    ).unsqueeze(1).unsqueeze(-1)
    return compressed, _bias(hidden, compressed.dtype)


def deepseek_v4_csa_compressor(
    original: Any,
    self: Any,
    hidden_states: torch.Tensor,
    q_residual: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any = None,
    layer_idx: int = 0,
    *,
    past_key_values: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``wrap`` impl for ``DeepseekV4CSACompressor.forward``: with kadapt's static cache, every entry slot
    (each the previous window's first series and its own second, pooled over ``2 x rate`` rows) and the
    bias that shows each query only the entries its indexer picked (``deepseek_v4_indexer``: ``-1``
    marks an invalid pick, as upstream's); with any other cache upstream's forward as it is."""
    cache = _cache(cache, past_key_values)
    if not hasattr(cache, "compressed_window"):
        return original(self, hidden_states, q_residual, position_ids, cache, layer_idx)
    compressed = _compress(self, hidden_states, cache, layer_idx, "comp")
    picks = self.indexer(hidden_states, q_residual, position_ids, cache, layer_idx)  # [B, Q, k]
    slots = torch.arange(compressed.shape[2], device=picks.device)
    chosen = ((picks.unsqueeze(-1) == slots) & (picks >= 0).unsqueeze(-1)).any(dim=-2)  # [B, Q, slots]
    return compressed, _bias(~chosen.unsqueeze(1), compressed.dtype)


def deepseek_v4_indexer(
    original: Any,
    self: Any,
    hidden_states: torch.Tensor,
    q_residual: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any = None,
    layer_idx: int = 0,
    *,
    past_key_values: Any = None,
) -> torch.Tensor:
    """``wrap`` impl for ``DeepseekV4Indexer.forward``: with kadapt's static cache, its own compressor's
    entries (series ``index``) scored by every query, the entries not closed for it at ``-inf``, and the
    top ``min(index_topk, slots)`` picks, a pick of an entry not closed ``-1`` (upstream's top-k over
    the entries it has: the same valid picks, in another order, whose order nothing reads); with any
    other cache upstream's forward as it is."""
    cache = _cache(cache, past_key_values)
    if not hasattr(cache, "compressed_window"):
        return original(self, hidden_states, q_residual, position_ids, cache, layer_idx)
    batch, length, _ = hidden_states.shape
    keys = _compress(self, hidden_states, cache, layer_idx, "index").squeeze(1)  # [B, slots, dim]
    rotate = sys.modules[type(self).__module__].apply_rotary_pos_emb
    cos, sin = self.rotary_emb(hidden_states, position_ids=position_ids, layer_type=self.rope_layer_type)
    q = self.q_b_proj(q_residual).view(batch, length, -1, self.head_dim).transpose(1, 2)
    q = rotate(q, cos, sin).transpose(1, 2)
    scores = self.scorer(q, keys, hidden_states)  # [B, Q, slots]
    closed = _closed(position_ids, self.compress_rate).unsqueeze(-1)  # [B, Q, 1]
    future = torch.arange(keys.shape[1], device=keys.device).view(1, 1, -1) >= closed
    picks = (
        scores.masked_fill(future, float("-inf")).topk(min(self.index_topk, keys.shape[1]), dim=-1).indices
    )
    return torch.where(picks >= closed, torch.full_like(picks, -1), picks)


def _cache(cache: Any, past_key_values: Any) -> Any:
    """The cache the caller handed over: transformers 5.24 names the forwards' fourth parameter ``cache``,
    5.23 ``past_key_values`` (the attention passes it by position on both; upstream's forward, called
    back by position, takes it under either name)."""
    return cache if cache is not None else past_key_values


def _compress(
    module: Any, hidden_states: torch.Tensor, cache: Any, layer_idx: int, series: str
) -> torch.Tensor:
    """Upstream's pooling of the windows the static cache hands over (``compressed_window``), written back
    (``write_compressed``): every entry slot ``[B, 1, slots, head_dim]``. An overlapping compressor (csa
    and its indexer: projections of ``2 x head_dim``) mixes the previous window's first series with its
    own window's second over ``2 x rate`` rows, as upstream lays them out."""
    rate, width = module.compress_rate, module.head_dim
    kv, gate = module.kv_proj(hidden_states), module.gate_proj(hidden_states)
    windows = cache.compressed_window(layer_idx, kv, gate, rate, series)
    chunk_kv, chunk_gate = windows.kv, windows.gate + module.position_bias
    if windows.prior_kv is not None:  # [previous window's first series | this window's second]
        prior_gate = windows.prior_gate + module.position_bias
        chunk_kv = torch.cat([windows.prior_kv[..., :width], chunk_kv[..., width:]], dim=2)
        chunk_gate = torch.cat([prior_gate[..., :width], chunk_gate[..., width:]], dim=2)
    pooled = (chunk_kv * chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype)).sum(dim=2)
    entries = module.kv_norm(pooled)
    cos, sin = module.rotary_emb(entries, position_ids=windows.start, layer_type=module.rope_layer_type)
    rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb
    entries = rotate(entries.unsqueeze(1), cos, sin).squeeze(1)
    return cache.write_compressed(layer_idx, entries, rate, series)


def _closed(position_ids: torch.Tensor, rate: int) -> torch.Tensor:
    """Per query the windows closed by its position ``p``: ``(p + 1) // rate`` (entries ``w`` below it)."""
    return torch.div(position_ids + 1, rate, rounding_mode="floor")


def _bias(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive bias: 0 where visible, the dtype's minimum where ``hidden``."""
    zeros = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    return zeros.masked_fill(hidden, torch.finfo(dtype).min)
