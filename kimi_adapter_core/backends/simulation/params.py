"""Analytic parameter inventory: every weight tensor family of the model, counted from the config.

Counting from the config (instead of instantiating the model) keeps ``kadapt plan`` torch-free and
instant. Each group carries what sizing needs: how it is sharded, its native dtype, whether it is a
linear weight a quantization mode may touch, and a representative checkpoint name (hub layout,
``language_model.model.layers.N...``) that the spec's ``quantization[].modules`` globs match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .arch import Architecture, TextArch, VisionArch

Shard = Literal["tp", "ep", "vocab", "replicated"]


@dataclass(frozen=True)
class ParamGroup:
    name: str  # short label for tables
    checkpoint_name: str  # representative hub-layout name, matched by quantization globs
    per_instance: int  # parameters in one instance (one layer / one expert set)
    instances: int  # how many instances the model holds (layers)
    shard: Shard
    dtype: str  # native dtype: bf16 | fp32
    linear: bool  # a linear weight that a --quant mode re-formats

    @property
    def count(self) -> int:
        return self.per_instance * self.instances


_LM = "language_model.model"


def _attention(t: TextArch) -> list[tuple[str, str, int, Shard, bool]]:
    """MLA projections. q_a/kv_a project to shared latents and are replicated under TP (as vLLM/SGLang
    do); q_b/kv_b are column-parallel and o_proj row-parallel, so they shard by heads."""
    h, heads = t.hidden, t.num_heads
    rows: list[tuple[str, str, int, Shard, bool]] = []
    if t.q_lora_rank:
        rows += [
            ("q_a_proj", "self_attn.q_a_proj.weight", h * t.q_lora_rank, "replicated", True),
            ("q_a_layernorm", "self_attn.q_a_layernorm.weight", t.q_lora_rank, "replicated", False),
            ("q_b_proj", "self_attn.q_b_proj.weight", t.q_lora_rank * heads * t.qk_head_dim, "tp", True),
        ]
    else:
        rows.append(("q_proj", "self_attn.q_proj.weight", h * heads * t.qk_head_dim, "tp", True))
    rows += [
        (
            "kv_a_proj_with_mqa",
            "self_attn.kv_a_proj_with_mqa.weight",
            h * t.kv_latent_dim,
            "replicated",
            True,
        ),
        ("kv_a_layernorm", "self_attn.kv_a_layernorm.weight", t.kv_lora_rank, "replicated", False),
        (
            "kv_b_proj",
            "self_attn.kv_b_proj.weight",
            t.kv_lora_rank * heads * (t.qk_nope_head_dim + t.v_head_dim),
            "tp",
            True,
        ),
        ("o_proj", "self_attn.o_proj.weight", heads * t.v_head_dim * h, "tp", True),
        ("layer_norms", "input_layernorm.weight", 2 * h, "replicated", False),
    ]
    return rows


def text_groups(t: TextArch) -> list[ParamGroup]:
    first_moe = t.n_dense_layers
    groups = [
        ParamGroup(
            "embed_tokens", f"{_LM}.embed_tokens.weight", t.vocab * t.hidden, 1, "vocab", "bf16", False
        ),
        ParamGroup("final_norm", f"{_LM}.norm.weight", t.hidden, 1, "replicated", "bf16", False),
    ]
    if not t.tie_word_embeddings:
        groups.append(
            ParamGroup(
                "lm_head", "language_model.lm_head.weight", t.vocab * t.hidden, 1, "vocab", "bf16", False
            )
        )
    for name, suffix, count, shard, linear in _attention(t):
        groups.append(
            ParamGroup(f"attn.{name}", f"{_LM}.layers.0.{suffix}", count, t.num_layers, shard, "bf16", linear)
        )
    if t.n_dense_layers:
        groups.append(
            ParamGroup(
                "dense_mlp",
                f"{_LM}.layers.0.mlp.gate_proj.weight",
                3 * t.hidden * t.intermediate,
                t.n_dense_layers,
                "tp",
                "bf16",
                True,
            )
        )
    if t.n_moe_layers:
        layer = f"{_LM}.layers.{first_moe}.mlp"
        n = t.n_moe_layers
        groups += [
            ParamGroup(
                "router",
                f"{layer}.gate.weight",
                t.n_routed_experts * t.hidden,
                n,
                "replicated",
                "bf16",
                False,
            ),
            ParamGroup(
                "router_bias",
                f"{layer}.gate.e_score_correction_bias",
                t.n_routed_experts,
                n,
                "replicated",
                "fp32",
                False,
            ),
            ParamGroup(
                "shared_experts",
                f"{layer}.shared_experts.gate_proj.weight",
                3 * t.hidden * t.moe_intermediate * t.n_shared_experts,
                n,
                "tp",
                "bf16",
                True,
            ),
            ParamGroup(
                "routed_experts",
                f"{layer}.experts.0.gate_proj.weight",
                3 * t.hidden * t.moe_intermediate * t.n_routed_experts,
                n,
                "ep",
                "bf16",
                True,
            ),
        ]
    return groups


def vision_groups(v: VisionArch) -> list[ParamGroup]:
    """MoonViT + patch-merger projector, replicated on every device (small next to the text model)."""
    h, i = v.hidden, v.intermediate
    per_layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h  # qkv+proj, fc1, fc2, 2 LayerNorms
    merged = v.mm_hidden * v.merge_h * v.merge_w
    return [
        ParamGroup(
            "vision.patch_embed",
            "vision_tower.patch_embed.proj.weight",
            v.in_channels * v.patch_size * v.patch_size * h + h,
            1,
            "replicated",
            "bf16",
            False,
        ),
        ParamGroup(
            "vision.pos_emb",
            "vision_tower.patch_embed.pos_emb.weight",
            v.pos_emb_height * v.pos_emb_width * h,
            1,
            "replicated",
            "bf16",
            False,
        ),
        ParamGroup(
            "vision.layers",
            "vision_tower.encoder.blocks.0.wqkv.weight",
            per_layer,
            v.num_layers,
            "replicated",
            "bf16",
            False,
        ),
        ParamGroup(
            "vision.final_norm",
            "vision_tower.encoder.final_layernorm.weight",
            2 * h,
            1,
            "replicated",
            "bf16",
            False,
        ),
        ParamGroup(
            "projector",
            "mm_projector.proj.0.weight",
            2 * v.mm_hidden + (merged * merged + merged) + (merged * v.text_hidden + v.text_hidden),
            1,
            "replicated",
            "bf16",
            False,
        ),
    ]


def param_groups(arch: Architecture) -> list[ParamGroup]:
    groups = text_groups(arch.text)
    if arch.vision is not None:
        groups += vision_groups(arch.vision)
    return groups
