"""Build the per-rank text model on the meta device and trace one step of it.

Tracing all 61 layers of a 1T-parameter model for every ``simulate`` call is slow and pointless: the
layers of one kind are identical. So this builds transformers' own DeepSeek-V3 modules sized for ONE
rank (heads / TP, dense and shared-expert widths / TP, vocab / TP) - one dense decoder layer, one MoE
decoder layer, the embedding, final norm and lm_head - runs them at the deployment's shapes under a
``Recorder`` and tags each layer's ops with its layer count. Three pieces are swapped for the kernels a
serving runtime runs instead of the eager Hugging Face code:

- MLA attention core: decode uses the weight-absorbed form over the latent cache (FlashMLA-style);
  prefill expands the latent KV with ``kv_b_proj`` and runs a fused causal attention. The projections,
  norms and rope around it are the real modules, traced.
- Routed experts: priced analytically as grouped GEMMs over a uniform token split (each rank computes
  batch*tokens*top_k/EP token-expert pairs), with the weight bytes of the experts actually touched.
- Collectives: 2 TP all-reduces per layer, EP dispatch + combine per MoE layer, vocab-parallel
  embedding all-reduce and logits all-gather.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

from .arch import TextArch
from .deployment import Deployment
from .params import ParamGroup, text_groups
from .quant import DTYPE_BYTES, NATIVE, Policy, WeightFormat
from .tracer import Recorder

# keys that describe the checkpoint, not the shapes (token ids are outside the per-rank vocab slice)
_NOT_SIZING = ("architectures", "model_type", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id")


def rank_config(text_cfg: dict[str, Any], t: TextArch, dep: Deployment) -> DeepseekV3Config:
    """The text config resized to one rank: per-rank heads and widths; routed experts stay whole
    (the router is replicated; the experts themselves are priced analytically)."""
    tp = dep.parallel.tp
    cfg = {k: v for k, v in text_cfg.items() if k not in _NOT_SIZING}
    cfg.update(
        num_attention_heads=t.num_heads // tp,
        num_key_value_heads=t.num_heads // tp,
        intermediate_size=t.intermediate // tp,
        moe_intermediate_size=max(1, t.moe_intermediate * t.n_shared_experts // tp),
        n_shared_experts=1,
        num_hidden_layers=t.n_dense_layers + 1,
        vocab_size=math.ceil(t.vocab / tp),
        n_routed_experts=max(1, t.n_routed_experts),
    )
    return DeepseekV3Config(**cfg)


class RankMLA(nn.Module):
    """MLA as serving runtimes run it, around the projections of a freshly built ``DeepseekV3Attention``
    (adopted, not patched: no class is modified)."""

    def __init__(self, inner: DeepseekV3Attention, rec: Recorder, dep: Deployment, kv_bytes: int) -> None:
        super().__init__()
        for name, child in inner.named_children():  # adopt the real projections and norms by name
            setattr(self, name, child)
        self.q_lora_rank, self.rope_interleave = inner.q_lora_rank, inner.config.rope_interleave
        self.heads, self.nope, self.rope = inner.num_heads, inner.qk_nope_head_dim, inner.qk_rope_head_dim
        self.v_dim, self.rank = inner.v_head_dim, inner.kv_lora_rank
        self.rec, self.dep, self.kv_bytes = rec, dep, kv_bytes

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, None]:
        b, s, _h = hidden_states.shape
        heads, nope, rope, rank = self.heads, self.nope, self.rope, self.rank
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(b, s, heads, nope + rope).transpose(1, 2)
        q_nope, q_rot = torch.split(q, [nope, rope], dim=-1)
        kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope)
        k_rot = k_rot.view(b, 1, s, rope)
        cos, sin = position_embeddings
        rotate = apply_rotary_pos_emb_interleave if self.rope_interleave else apply_rotary_pos_emb
        q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
        context = self.dep.context_len + s
        cache_write = b * s * (rank + rope) * self.kv_bytes
        if self.dep.decode:
            out = self._absorbed(q_nope, q_rot, b, s, context, cache_write)
        else:
            out = self._prefill(kv_nope, b, s, context, cache_write)
        return self.o_proj(out), None

    def _absorbed(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, b: int, s: int, context: int, cache_write: int
    ) -> torch.Tensor:
        """Decode: fold W_UK into q and W_UV into the output; attend over the 576-wide latent cache."""
        heads, nope, rope, v_dim, rank = self.heads, self.nope, self.rope, self.v_dim, self.rank
        w = self.kv_b_proj.weight.view(heads, nope + v_dim, rank)
        q_h = q_nope.permute(1, 0, 2, 3).reshape(heads, b * s, nope)
        q_latent = torch.bmm(q_h, w[:, :nope, :])  # [H, B*S, kv_lora]
        pairs = b * heads * s * context
        self.rec.analytic(
            "mla_decode_attention",
            "attention",
            flops=2 * pairs * (rank + rope) + 2 * pairs * rank,
            nbytes=b * context * (rank + rope) * self.kv_bytes
            + q_latent.numel() * 2
            + q_rot.numel() * 2
            + heads * b * s * rank * 2
            + cache_write,
            shapes=f"B{b} H{heads} q{s} ctx{context}",
        )
        o_latent = q_latent.new_empty(heads, b * s, rank)
        out = torch.bmm(o_latent, w[:, nope:, :].transpose(1, 2))  # [H, B*S, v]
        return out.view(heads, b, s, v_dim).permute(1, 2, 0, 3).reshape(b, s, heads * v_dim)

    def _prefill(self, kv_nope: torch.Tensor, b: int, s: int, context: int, cache_write: int) -> torch.Tensor:
        """Prefill: expand cached + new latents to per-head K/V, then one fused causal attention."""
        heads, qk, v_dim, rank = self.heads, self.nope + self.rope, self.v_dim, self.rank
        latent = kv_nope.new_empty(b, context, rank)  # cache + new tokens; the read is charged to kv_b_proj
        self.kv_b_proj(latent)
        pairs = b * heads * (s * (context - s) + s * (s + 1) // 2)  # causal query-key pairs
        self.rec.analytic(
            "flash_attention_prefill",
            "attention",
            flops=2 * pairs * qk + 2 * pairs * v_dim,
            nbytes=2 * (b * s * heads * qk + b * context * heads * (qk + v_dim) + b * s * heads * v_dim)
            + cache_write,
            shapes=f"B{b} H{heads} q{s} ctx{context}",
        )
        return kv_nope.new_empty(b, s, heads * v_dim)


class RoutedExperts(nn.Module):
    """Stands in for ``DeepseekV3Experts``: records EP dispatch, the grouped GEMMs, EP combine."""

    def __init__(self, t: TextArch, rec: Recorder, dep: Deployment, fmt: WeightFormat) -> None:
        super().__init__()
        self.t, self.rec, self.dep, self.fmt = t, rec, dep, fmt

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        t, par = self.t, self.dep.parallel
        tokens = hidden_states.shape[0]  # this rank's attention-side tokens
        pairs = tokens * par.dp * t.top_k / par.ep  # uniform split of every token-expert pair
        local = t.n_routed_experts // par.ep
        touched = local * (1 - (1 - 1 / local) ** pairs)  # expected experts hit by uniform routing
        per_expert = 3 * t.hidden * t.moe_intermediate
        sent = tokens / par.tp * t.top_k * t.hidden  # payload; cost.py splits it by destination
        dispatch_bytes = 1 if self.fmt.compute == "int8" else 2  # A8 modes dispatch quantized tokens
        if par.ep > 1:
            self.rec.analytic(
                "ep_dispatch(all_to_all)",
                "comm",
                comm={"collective": "all_to_all", "bytes": sent * dispatch_bytes, "group": par.ep},
            )
        self.rec.analytic(
            "grouped_gemm(routed_experts)",
            "experts",
            flops=2 * pairs * per_expert,
            nbytes=touched * per_expert * self.fmt.bytes_per_param
            + pairs * (2 * t.hidden + 3 * t.moe_intermediate) * 2,
            compute=self.fmt.compute,
            shapes=f"pairs{pairs:.0f} experts{local} hit{touched:.1f}",
        )
        if par.ep > 1:
            self.rec.analytic(
                "ep_combine(all_to_all)",
                "comm",
                comm={"collective": "all_to_all", "bytes": sent * 2, "group": par.ep},
            )
        return hidden_states


def _group_for(name: str, groups: dict[str, ParamGroup]) -> ParamGroup | None:
    """The inventory group a per-rank parameter belongs to (for its weight format)."""
    parts = name.split(".")
    if "self_attn" in parts:
        return groups.get("attn." + parts[parts.index("self_attn") + 1])
    if "shared_experts" in parts:
        return groups.get("shared_experts")
    if "gate" in parts:
        return groups.get("router")
    if "mlp" in parts:
        return groups.get("dense_mlp")
    return groups.get({"embed_tokens": "embed_tokens", "lm_head": "lm_head"}.get(parts[0], ""))


class RankModel(nn.Module):
    """Embedding, one dense layer, one MoE layer, final norm, lm_head, and an MTP eh_proj - per rank."""

    def __init__(
        self, cfg: DeepseekV3Config, t: TextArch, dep: Deployment, rec: Recorder, policy: Policy
    ) -> None:
        super().__init__()
        kv_bytes = DTYPE_BYTES[dep.kv_dtype]
        groups = {g.name: g for g in text_groups(t)}
        self.embed_tokens = nn.Embedding(cfg.vocab_size, t.hidden)
        self.rotary = DeepseekV3RotaryEmbedding(cfg)
        self.dense_layer = DeepseekV3DecoderLayer(cfg, 0) if t.n_dense_layers else None
        self.moe_layer = DeepseekV3DecoderLayer(cfg, t.n_dense_layers) if t.n_moe_layers else None
        self.norm = DeepseekV3RMSNorm(t.hidden, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(t.hidden, cfg.vocab_size, bias=False)
        self.eh_proj = nn.Linear(2 * t.hidden, t.hidden, bias=False) if dep.mtp else None
        self.to(torch.bfloat16)
        for layer in (self.dense_layer, self.moe_layer):
            if layer is not None:
                layer.self_attn = RankMLA(layer.self_attn, rec, dep, kv_bytes)
        if self.moe_layer is not None:
            gate = self.moe_layer.mlp.gate
            gate.weight = nn.Parameter(gate.weight.float())  # the fp32 router GEMM reads bf16 weights once
            gate.e_score_correction_bias = gate.e_score_correction_bias.float()
            self.moe_layer.mlp.experts = RoutedExperts(t, rec, dep, policy(groups["routed_experts"]))
        for name, param in self.named_parameters():
            group = _group_for(name, groups)
            rec.mark_weight(param, policy(group) if group else NATIVE["bf16"])


def trace_rank(text_cfg: dict[str, Any], t: TextArch, dep: Deployment, policy: Policy) -> Recorder:
    """Run one step of the per-rank model on meta and return the recorder holding every op."""
    rec = Recorder()
    par = dep.parallel
    with torch.device("meta"):
        model = RankModel(rank_config(text_cfg, t, dep), t, dep, rec, policy)
        b, s = dep.batch_per_rank, dep.tokens_per_query
        input_ids = torch.zeros(b, s, dtype=torch.long)
        positions = torch.arange(dep.context_len, dep.context_len + s).unsqueeze(0).expand(b, s)
    rec.hook(model)
    hidden_bytes = b * s * t.hidden * 2
    _all_reduce = {"collective": "all_reduce", "bytes": hidden_bytes, "group": par.tp}

    def tp_all_reduce(_module: nn.Module, _args: Any, _out: Any) -> None:
        rec.analytic("tp_all_reduce", "comm", comm=_all_reduce)

    if par.tp > 1:
        for layer in (model.dense_layer, model.moe_layer):
            if layer is not None:
                layer.self_attn.register_forward_hook(tp_all_reduce)
                layer.mlp.register_forward_hook(tp_all_reduce)

    with rec, torch.no_grad():
        hidden = model.embed_tokens(input_ids)
        if par.tp > 1:
            rec.analytic("tp_all_reduce(vocab_parallel_embedding)", "comm", comm=_all_reduce)
        cos_sin = model.rotary(hidden, positions)
        for layer, scope, repeat in (
            (model.dense_layer, "dense", t.n_dense_layers),
            (model.moe_layer, "moe", t.n_moe_layers),
        ):
            if layer is not None:
                with rec.scope(scope, repeat):
                    hidden = layer(hidden, position_embeddings=cos_sin)
        last = model.norm(
            hidden if dep.decode else hidden[:, -1:, :]
        )  # prefill needs logits of the last token only
        _logits(model, rec, last, par.tp, t.vocab)
        if dep.mtp and model.moe_layer is not None:
            with rec.scope("mtp", dep.mtp):  # one DeepSeek-style MTP block per drafted token
                draft_in = hidden[:, -1:, :]
                draft = model.eh_proj(torch.cat([draft_in, model.embed_tokens(input_ids[:, -1:])], dim=-1))
                draft = model.moe_layer(draft, position_embeddings=(cos_sin[0][:, -1:], cos_sin[1][:, -1:]))
                _logits(model, rec, model.norm(draft), par.tp, t.vocab)
    return rec


def _logits(model: RankModel, rec: Recorder, hidden: torch.Tensor, tp: int, vocab: int) -> None:
    model.lm_head(hidden)
    if tp > 1:
        tokens = hidden.shape[0] * hidden.shape[1]
        rec.analytic(
            "tp_all_gather(logits)",
            "comm",
            comm={"collective": "all_gather", "bytes": tokens * vocab * 2, "group": tp},
        )
