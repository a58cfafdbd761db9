"""Catalogue of built-in implementations: name -> ("module:attribute", one-line summary).

Kept torch-free on purpose (vLLM-registry style lazy strings): validation reads the names,
``resolve`` imports the implementation only when a spec is applied. One line per builtin.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

BUILTINS: dict[str, tuple[str, str]] = {
    # name: ("module:attribute", "what it does")
    "mla_expand_kv_functional": (
        "kimi_adapter_core.builtins.mla:mla_expand_kv_functional",
        "MLA expand_kv without new_empty + copy_ into slices (torch.cat): a functional exported graph.",
    ),
    "is_torch_fx_available": (
        "kimi_adapter_core.builtins.environment:is_torch_fx_available",
        "Shim for transformers 4.x's is_torch_fx_available (removed in 5.x; remote code imports it).",
    ),
    "moe_zeros": (
        "kimi_adapter_core.builtins.moe_stubs:moe_zeros",
        "MoE forward/moe_infer stand-in returning zeros like the input (backend swaps the real MoE).",
    ),
    "moe_gate_uniform": (
        "kimi_adapter_core.builtins.moe_stubs:moe_gate_uniform",
        "Deterministic top-k gate: round-robin experts, weight 1/top_k; returns (topk_idx, topk_weight).",
    ),
    "patch_embed_flat_linear": (
        "kimi_adapter_core.builtins.vision:patch_embed_flat_linear",
        "Patch-embed wrap: flat [L, C*ph*pw] input as the equivalent linear projection + pos_emb.",
    ),
    "meta_merged_embeddings": (
        "kimi_adapter_core.builtins.vision:meta_merged_embeddings",
        "Meta stub for image-feature merging: an empty meta tensor shaped like inputs_embeds.",
    ),
    "llama4_rotary_cos_sin": (
        "kimi_adapter_core.builtins.llama4:llama4_rotary_cos_sin",
        "Llama-4 rotary forward: real (cos, sin) of upstream's angles instead of complex freqs_cis.",
    ),
    "llama4_attention_forward": (
        "kimi_adapter_core.builtins.llama4:llama4_attention_forward",
        "Llama-4 attention: interleaved-pair rope from (cos, sin) in real math; NoPE temperature per row.",
    ),
    "compact_delta_scan": (
        "kimi_adapter_core.builtins.delta_scan:compact_delta_scan",
        "Gated-DeltaNet forward (wrap): its chunked scan with a log-depth triangular inverse (not a loop).",
    ),
    "deepseek_v2_rotary_cos_sin": (
        "kimi_adapter_core.builtins.deepseek_v2:deepseek_v2_rotary_cos_sin",
        "DeepSeek-V2 rotary forward: real (cos, sin) of upstream's angles instead of complex freqs_cis.",
    ),
    "deepseek_v2_attention_forward": (
        "kimi_adapter_core.builtins.deepseek_v2:deepseek_v2_attention_forward",
        "DeepSeek-V2 MLA attention: interleaved-pair rope of q_pe and k_pe from (cos, sin) in real math.",
    ),
    "deepseek_v4_hca_compressor": (
        "kimi_adapter_core.builtins.deepseek_v4:deepseek_v4_hca_compressor",
        "DeepSeek-V4 HCA compressor (wrap): its window ring and entries in kadapt's static cache, per row.",
    ),
    "deepseek_v4_csa_compressor": (
        "kimi_adapter_core.builtins.deepseek_v4:deepseek_v4_csa_compressor",
        "DeepSeek-V4 CSA compressor (wrap): overlapping windows in the static cache; the indexer's picks.",
    ),
    "deepseek_v4_indexer": (
        "kimi_adapter_core.builtins.deepseek_v4:deepseek_v4_indexer",
        "DeepSeek-V4 Lightning indexer (wrap): its compressed keys in the static cache, a static top-k.",
    ),
    "falcon_split_heads_slices": (
        "kimi_adapter_core.builtins.falcon:falcon_split_heads_slices",
        "Falcon _split_heads: key/value heads by slices, not list indices (no lifted constant on meta).",
    ),
    "gpt_neo_attn": (
        "kimi_adapter_core.builtins.gpt_neo:gpt_neo_attn",
        "GPT-Neo attention scores: the ABI's mask (causal prefix, local window) in place of the bias buffer.",
    ),
    "mpt_attention_forward": (
        "kimi_adapter_core.builtins.mpt:mpt_attention_forward",
        "MPT attention: ALiBi bias sliced by the key length alone; the ABI's additive mask added.",
    ),
    "rotary_seq_len_as_int": (
        "kimi_adapter_core.builtins.rotary:rotary_seq_len_as_int",
        "Rotary-embedding wrap: a tensor seq_len becomes an int (meta: the full cached length).",
    ),
}


def resolve(name: str) -> Callable[..., Any]:
    """Import the implementation registered as ``name`` (KeyError lists nothing: callers report)."""
    module_name, _, attribute = BUILTINS[name][0].partition(":")
    return getattr(importlib.import_module(module_name), attribute)
