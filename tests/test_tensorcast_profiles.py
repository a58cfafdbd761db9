"""Every generated TensorCast profile against the model TensorCast really builds — no TensorCast needed.

TensorCast (``tensor_cast``, Ascend/msmodeling) loads a model directory's config with
``AutoConfig.from_pretrained`` (the ``config.json`` itself when the directory holds no
``configuration_*.py``; a ``kimi_k25`` config once more with ``trust_remote_code=True``), calls the
profile's ``hf_config_patch_method(config, model_id)``, then builds ``AutoModel.from_config`` on the
meta device (``AutoModelForCausalLM`` only if that raises; see its ``AutoModelConfigLoader``). These
tests do the same with transformers alone, for every shipped spec, and check every module path and
every MLA/MoE field each committed profile names against that model, independently of the profile's
own ``check_model`` (which must agree, and must catch the mistakes the first profiles shipped with).

``kimi_k25_remote`` runs on a stand-in for the hub repository's remote code written here
(``write_hub_model``): ``tests/fixtures/remote_kimi.py``'s model has the hub's traits but a plain
attention, and TensorCast's MLA swap needs the hub's MLA fields (``q_head_dim``, ``q_a_proj``, ...).
``test_tensorcast_real.py`` runs the same profiles in a real TensorCast checkout.
"""

from __future__ import annotations

import copy
import json
import operator
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.modules import import_path
from fixtures.remote_kimi import CONFIGURATION
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.generate.simulation import (
    PATH_FIELDS,
    TENSORCAST_EXPERT_ADAPTER_FIELDS,
    TENSORCAST_MLA_FIELDS,
    TENSORCAST_MOE_FIELDS,
)
from kimi_adapter_core.generate.tensorcast_coverage import refuse_unpriced_layers
from kimi_adapter_core.resolve import _short_model_overrides
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.of_spec import structure_of_raw

REPO = Path(__file__).resolve().parents[1]


# shipped specs declaring experts TensorCast's per-expert adapter cannot read (no profile)
OTHER_EXPERTS = sorted(
    p
    for p in (REPO / "specs").glob("*.yaml")
    if load_spec(p).backend_options("simulation").get("experts_layout") == "other"
)


def _has_profile(spec_path: Path) -> bool:
    """Whether ``generate`` renders a TensorCast profile for a shipped spec: not for experts TensorCast's
    per-expert adapter cannot read, nor for layers only its builtin profiles price (linear attention, DSA)."""
    if spec_path in OTHER_EXPERTS:
        return False
    try:
        refuse_unpriced_layers(load_spec(spec_path))
    except KadaptError:
        return False
    return True


SPECS = sorted(p for p in (REPO / "specs").glob("*.yaml") if _has_profile(p))
VISION_LAYERS = 2  # vision blocks kept in the shortened Kimi models


# -- a stand-in for moonshotai/Kimi-K2.5's remote code (modeling_deepseek.py + modeling_kimi_k25.py) --

HUB_DEEPSEEK = '''
import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import is_torch_fx_available

if is_torch_fx_available():
    import torch.fx  # noqa: F401  (upstream wraps helpers for fx tracing)


class DeepseekV3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)


class DeepseekV3RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000.0):
        super().__init__()
        self.dim, self.max_position_embeddings, self.base = dim, max_position_embeddings, base
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(min(max_position_embeddings, 4096))

    def _set_cos_sin_cache(self, seq_len, device=None, dtype=None):
        self.max_seq_len_cached = seq_len
        t = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
        emb = torch.cat((torch.outer(t, self.inv_freq),) * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:  # an int only: upstream compares with Python ints
            self._set_cos_sin_cache(seq_len)
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class DeepseekV3MLP(nn.Module):
    def __init__(self, config, hidden_size=None, intermediate_size=None):
        super().__init__()
        self.hidden_size = hidden_size or config.hidden_size
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.n_routed_experts = config.n_routed_experts
        self.routed_scaling_factor = config.routed_scaling_factor
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(self.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(self.n_routed_experts))

    def forward(self, hidden_states):
        logits = F.linear(hidden_states.reshape(-1, hidden_states.shape[-1]).float(), self.weight.float())
        scores = logits.sigmoid()
        topk_idx = torch.multinomial(scores, self.top_k)  # sampling: not deterministic, not traceable
        return topk_idx, scores.gather(1, topk_idx)


class DeepseekV3MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_experts_per_tok = config.num_experts_per_tok
        self.experts = nn.ModuleList(
            [DeepseekV3MLP(config, intermediate_size=config.moe_intermediate_size)
             for _ in range(config.n_routed_experts)]
        )
        self.gate = MoEGate(config)
        self.shared_experts = DeepseekV3MLP(
            config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts
        )

    def forward(self, hidden_states):
        identity, orig_shape = hidden_states, hidden_states.shape
        topk_idx, topk_weight = self.gate(hidden_states)
        flat = hidden_states.view(-1, hidden_states.shape[-1])
        y = self.moe_infer(flat, topk_idx, topk_weight).view(*orig_shape)
        return y + self.shared_experts(identity)

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        cnts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0).cpu().numpy()  # data-dependent dispatch
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        outputs, start = [], 0
        for i, num_tokens in enumerate(tokens_per_expert):
            end = start + int(num_tokens)
            if num_tokens:
                outputs.append(self.experts[i](sorted_tokens[start:end]))
            start = end
        outs = torch.cat(outputs, dim=0) if outputs else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        weighted = new_x.view(*topk_ids.shape, -1).type(topk_weight.dtype) * topk_weight.unsqueeze(-1)
        return weighted.sum(dim=1).type(new_x.dtype)


class DeepseekV3Attention(nn.Module):
    """Multi-head latent attention, laid out and named as upstream (q_head_dim, not qk_head_dim)."""

    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.max_position_embeddings = config.max_position_embeddings
        self.rope_theta = config.rope_theta
        self.q_lora_rank = config.q_lora_rank
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.v_head_dim = config.v_head_dim
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.q_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.is_causal = True
        self.q_a_proj = nn.Linear(self.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_layernorm = DeepseekV3RMSNorm(config.q_lora_rank)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            self.hidden_size, config.kv_lora_rank + config.qk_rope_head_dim, bias=False
        )
        self.kv_a_layernorm = DeepseekV3RMSNorm(config.kv_lora_rank)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, self.hidden_size, bias=False)
        self.rotary_emb = DeepseekV3RotaryEmbedding(
            self.qk_rope_head_dim, self.max_position_embeddings, self.rope_theta
        )
        self.softmax_scale = self.q_head_dim ** (-0.5)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, **kwargs):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(bsz, q_len, self.num_heads, self.q_head_dim).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        compressed_kv, k_pe = torch.split(
            self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        k_pe = k_pe.view(bsz, q_len, 1, self.qk_rope_head_dim).transpose(1, 2)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed_kv))
        kv = kv.view(bsz, q_len, self.num_heads, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, value_states = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        cos, sin = self.rotary_emb(value_states, seq_len=q_len)
        q_pe, k_pe = apply_rotary_pos_emb(q_pe, k_pe, cos, sin, position_ids)
        query = torch.cat([q_nope, q_pe], dim=-1)
        key = torch.cat([k_nope, k_pe.expand(-1, self.num_heads, -1, -1)], dim=-1)
        out = F.scaled_dot_product_attention(
            query, key, value_states, is_causal=True, scale=self.softmax_scale
        )
        out = self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, self.num_heads * self.v_head_dim))
        return out, None, past_key_value


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = DeepseekV3Attention(config, layer_idx)
        moe = layer_idx >= config.first_k_dense_replace
        self.mlp = DeepseekV3MoE(config) if moe else DeepseekV3MLP(config)
        self.input_layernorm = DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, **kwargs):
        residual = hidden_states
        hidden_states, self_attn_weights, present_key_value = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
            position_ids=position_ids, past_key_value=past_key_value, output_attentions=output_attentions,
            use_cache=use_cache, **kwargs,
        )
        hidden_states = residual + hidden_states
        return (hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)),)


class DeepseekV3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [DeepseekV3DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)[None]
        hidden_states = inputs_embeds
        for layer in self.layers:  # upstream passes no rotary embeddings: attention computes its own
            hidden_states = layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids)[0]
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states))


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = DeepseekV3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            inputs_embeds=inputs_embeds).last_hidden_state
        logits = self.lm_head(hidden)
        return CausalLMOutputWithPast(logits=logits) if return_dict is not False else (logits,)
'''

HUB_KIMI = """
import torch
from torch import nn
from transformers.modeling_utils import PreTrainedModel

from .configuration_kimi_k25 import KimiK25Config
from .modeling_deepseek import DeepseekV3ForCausalLM


class Learnable2DInterpPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x, grid_thws):
        return x + self.weight


class MoonVision3dPatchEmbed(nn.Module):
    def __init__(self, out_dim, in_dim=3, patch_size=14):
        super().__init__()
        self.proj = nn.Conv2d(in_dim, out_dim, kernel_size=patch_size, stride=patch_size)
        self.pos_emb = Learnable2DInterpPosEmb(out_dim)

    def forward(self, x, grid_thws):
        x = self.proj(x).view(x.size(0), -1)
        return self.pos_emb(x, grid_thws)


class MoonViTEncoderLayer(nn.Module):
    def __init__(self, hidden_dim, mlp_dim):
        super().__init__()
        self.norm0 = nn.LayerNorm(hidden_dim)
        self.mlp = nn.Sequential(nn.Linear(hidden_dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, hidden_dim))

    def forward(self, hidden_states, deterministic):
        return hidden_states + self.mlp(self.norm0(hidden_states))


class MoonViT3dEncoder(nn.Module):
    def __init__(self, hidden_dim, num_layers, mlp_dim):
        super().__init__()
        self.blocks = nn.ModuleList([MoonViTEncoderLayer(hidden_dim, mlp_dim) for _ in range(num_layers)])
        self.final_layernorm = nn.LayerNorm(hidden_dim)

    def forward(self, hidden_states, grid_thws):
        for block in self.blocks:
            hidden_states = block(hidden_states, self.use_deterministic_attn)  # set by nobody upstream
        return self.final_layernorm(hidden_states)


class MoonViT3dPretrainedModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.patch_embed = MoonVision3dPatchEmbed(config.vt_hidden_size, 3, config.patch_size)
        self.encoder = MoonViT3dEncoder(
            config.vt_hidden_size, config.vt_num_hidden_layers, config.vt_intermediate_size
        )

    def forward(self, pixel_values, grid_thws):
        return self.encoder(self.patch_embed(pixel_values, grid_thws), grid_thws)


class KimiK25PreTrainedModel(PreTrainedModel):
    config_class = KimiK25Config
    base_model_prefix = "model"

    def _init_weights(self, module):
        pass


class KimiK25ForConditionalGeneration(KimiK25PreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.vision_tower = MoonViT3dPretrainedModel(config.vision_config)
        self.mm_projector = nn.Linear(config.vision_config.vt_hidden_size, config.text_config.hidden_size)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def _merge_input_ids_with_image_features(self, image_features, inputs_embeds, input_ids, attention_mask):
        batch_idx, pos_idx = torch.nonzero(input_ids == self.config.media_placeholder_token_id, as_tuple=True)
        merged = inputs_embeds.clone()
        merged[batch_idx, pos_idx] = image_features.to(merged.dtype)
        return merged

    def forward(self, input_ids=None, pixel_values=None, grid_thws=None, attention_mask=None,
                position_ids=None, past_key_values=None, inputs_embeds=None, labels=None, use_cache=None,
                output_attentions=None, output_hidden_states=None, return_dict=None):
        if inputs_embeds is None:
            inputs_embeds = self.language_model.get_input_embeddings()(input_ids)
        if pixel_values is not None:
            image_features = self.mm_projector(self.vision_tower(pixel_values, grid_thws))
            inputs_embeds = self._merge_input_ids_with_image_features(
                image_features, inputs_embeds, input_ids, attention_mask
            )
        return self.language_model(attention_mask=attention_mask, position_ids=position_ids,
                                   inputs_embeds=inputs_embeds, return_dict=return_dict)
"""


def write_hub_model(directory: Path, config: dict[str, Any]) -> Path:
    """A directory shaped like the hub repository: ``config`` (with ``auto_map``) and its code."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (directory / "configuration_kimi_k25.py").write_text(CONFIGURATION.lstrip(), encoding="utf-8")
    (directory / "modeling_deepseek.py").write_text(HUB_DEEPSEEK.lstrip(), encoding="utf-8")
    (directory / "modeling_kimi_k25.py").write_text(HUB_KIMI.lstrip(), encoding="utf-8")
    return directory


# -- the model directory TensorCast is pointed at, and what it builds from it ------------------------


def _set(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *head, last = dotted.split(".")
    node = raw
    for key in head:
        node = node[key]
    node[last] = value


def short_config(spec_name: str, *, experts: int | None = None) -> dict[str, Any]:
    """The spec's shipped config, shortened as ``kadapt validate --resolve`` does (one dense and
    one MoE layer at least), vision towers to ``VISION_LAYERS`` blocks, experts to ``experts``."""
    spec = load_spec(REPO / "specs" / f"{spec_name}.yaml")
    raw = json.loads(spec.source.config.read_text(encoding="utf-8"))
    for dotted, value in _short_model_overrides(spec).items():
        _set(raw, dotted, value)
    vision = raw.get("vision_config")
    if isinstance(vision, dict) and "vt_num_hidden_layers" in vision:
        vision["vt_num_hidden_layers"] = VISION_LAYERS
    if experts is not None and spec.moe:
        structure = structure_of_raw(spec, raw)
        text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
        text[structure.keys["num_experts"]] = experts
        for key in ("n_group", "topk_group"):  # DeepSeek's group-limited routing: groups must divide
            if key in text:
                text[key] = 1
    raw.pop("quantization_config", None)  # TensorCast would quantize: not what these tests are about
    return raw


def write_model_dir(spec_name: str, directory: Path, *, experts: int | None = None) -> Path:
    """A directory TensorCast takes as MODEL_ID: ``config.json`` alone, or the hub-like remote code."""
    spec = load_spec(REPO / "specs" / f"{spec_name}.yaml")
    raw = short_config(spec_name, experts=experts)
    if spec.source.trust_remote_code:
        return write_hub_model(directory, raw)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw, indent=2), encoding="utf-8")
    return directory


def tensorcast_config(model_dir: Path) -> Any:
    """``AutoModelConfigLoader.load_config`` for a local directory, as TensorCast does it."""
    has_code = any(p.name.startswith("configuration") and p.suffix == ".py" for p in model_dir.iterdir())
    source = str(model_dir if has_code else model_dir / "config.json")
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=False)
    except Exception:  # noqa: BLE001 - TensorCast falls back exactly like this
        return AutoConfig.from_pretrained(source, trust_remote_code=True)
    if getattr(config, "model_type", None) == "kimi_k25":
        config = AutoConfig.from_pretrained(source, trust_remote_code=True)
    return config


def tensorcast_build(config: Any, *, remote: bool) -> Any:
    """``AutoModelConfigLoader.try_to_load_model``: AutoModel, else AutoModelForCausalLM; on meta."""
    with torch.device("meta"):
        try:
            return AutoModel.from_config(config, trust_remote_code=remote)
        except Exception:  # noqa: BLE001 - TensorCast's own fallback
            return AutoModelForCausalLM.from_config(config, trust_remote_code=remote)


def load_profile(spec_name: str) -> Any:
    return import_path(REPO / "adapters" / spec_name / "tensorcast_profile.py", f"tc_profile_{spec_name}")


class Built:
    """One spec's profile, the config TensorCast patched with it and the model TensorCast builds."""

    def __init__(self, spec_name: str, directory: Path) -> None:
        self.spec = load_spec(REPO / "specs" / f"{spec_name}.yaml")
        self.dir = write_model_dir(spec_name, directory)
        self.profile = load_profile(spec_name)
        self.config = tensorcast_config(self.dir)
        assert self.profile.hf_config_patch_method(self.config, str(self.dir)) is self.config
        self.model = tensorcast_build(self.config, remote=self.spec.source.trust_remote_code)

    def close(self) -> None:
        if hasattr(self.profile, "remove_patches"):
            self.profile.remove_patches()


@pytest.fixture(scope="module", params=[p.stem for p in SPECS])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    item = Built(request.param, tmp_path_factory.mktemp(request.param) / "model")
    try:
        yield item
    finally:
        item.close()


# -- an independent check: what TensorCast reads, read the way TensorCast reads it -------------------


def text_config(config: Any) -> Any:
    return config.get_text_config()


def independent_problems(fields: dict[str, Any], model: Any, config: Any) -> list[str]:
    """Every ModelProfile path and MLA/MoE field in ``fields`` (the kwargs a profile hands TensorCast)
    that ``model`` does not satisfy, found with ``operator.attrgetter`` / ``hasattr`` as TensorCast
    does, from kadapt's table of TensorCast's field names (not the profile's copy of it)."""
    problems = []
    for name in ("language_module_path", "visual_module_path"):
        if fields.get(name):
            try:
                operator.attrgetter(fields[name])(model)
            except AttributeError as exc:
                problems.append(f"{name} {fields[name]!r}: {exc}")
    layers = fields.get("language_layers_path_str") or "layers"  # TensorCast's default
    try:
        text_layers = operator.attrgetter(layers)(model)
    except AttributeError as exc:
        return [*problems, f"language_layers_path_str {layers!r}: {exc}"]
    if len(text_layers) != text_config(config).num_hidden_layers:
        problems.append(
            f"{layers} holds {len(text_layers)} layers, the config {text_config(config).num_hidden_layers}"
        )
    for name in ("visual_layers_module_path", "visual_layers_path_str"):
        if fields.get(name):
            try:
                blocks = operator.attrgetter(fields[name])(model)
            except AttributeError as exc:
                problems.append(f"{name} {fields[name]!r}: {exc}")
                continue
            if len(blocks) != VISION_LAYERS:
                problems.append(f"{name} {fields[name]!r} holds {len(blocks)} blocks")
    if fields.get("mla_module_name"):
        renames = fields.get("mla_field_names_override") or {}
        attention = [layer.self_attn for layer in text_layers]
        if {type(a).__name__ for a in attention} != {fields["mla_module_name"]}:
            problems.append(f"attention classes {sorted({type(a).__name__ for a in attention})}")
        for field, required in TENSORCAST_MLA_FIELDS.items():
            attr = renames.get(field, field)
            if (required or field in renames) and not all(hasattr(a, attr) for a in attention):
                problems.append(f"MLA field {field} -> {attr!r} missing")
    if fields.get("moe_module_name"):
        moe = [m for m in model.modules() if type(m).__name__ == fields["moe_module_name"]]
        mlp_kinds = [type(layer.mlp).__name__ for layer in text_layers]
        if not moe or len(moe) != mlp_kinds.count(fields["moe_module_name"]):
            problems.append(f"MoE class {fields['moe_module_name']} in layers: {mlp_kinds}")
        moe_renames = fields.get("moe_field_names_override") or {}
        for field, required in TENSORCAST_MOE_FIELDS.items():
            attr = moe_renames.get(field, field)
            if (required or field in moe_renames) and not all(hasattr(m, attr) for m in moe):
                problems.append(f"MoE field {field} -> {attr!r} missing")
        key = fields.get("moe_num_experts_key", "num_experts")
        count = operator.attrgetter(".".join([key] if isinstance(key, str) else key))(config)
        per_expert = fields.get("custom_expert_module_type", "default") is None
        for m in moe:
            experts = m.experts
            if per_expert != isinstance(experts, torch.nn.ModuleList):
                problems.append(
                    f"experts {type(experts).__name__} with custom_expert_module_type per_expert={per_expert}"
                )
            stacked = [p for p in experts.parameters(recurse=False) if p.dim() == 3]
            held = len(experts) if per_expert else (stacked[0].shape[0] if stacked else None)
            if held != count:
                problems.append(f"{key} = {count}, experts hold {held}")
            if not per_expert:
                problems += [
                    f"stacked experts {type(experts).__name__} lack {field}, which TensorCast's per-expert "
                    "adapter reads"
                    for field in adapter_fields_missing(experts)
                ]
    return problems


def adapter_fields_missing(experts: Any) -> list[str]:
    """What TensorCast's per-expert adapter (MoeExpertMLP) reads and ``experts`` lacks, with the shapes
    it assumes: gate_up_proj [E, 2 * intermediate_dim, hidden_dim], down_proj [E, hidden_dim,
    intermediate_dim]."""
    missing = [field for field in TENSORCAST_EXPERT_ADAPTER_FIELDS if not hasattr(experts, field)]
    if missing:
        return missing
    hidden, inner = experts.hidden_dim, experts.intermediate_dim
    shapes = {"gate_up_proj": (2 * inner, hidden), "down_proj": (hidden, inner)}
    return [
        f"{name} shaped [E, {a}, {b}]"
        for name, (a, b) in shapes.items()
        if tuple(getattr(experts, name).shape[1:]) != (a, b)
    ]


def profile_kwargs(profile: Any) -> dict[str, Any]:
    """What ``model_profile()`` hands TensorCast's ModelProfile, read from the module's data."""
    kwargs = {**profile.PROFILE, **profile.MODULE_PATHS}
    if "MoE" in profile.SWAPS and profile.SWAPS["MoE"]["experts_layout"] == "per_expert":
        kwargs["custom_expert_module_type"] = None
    return kwargs


# -- the tests ------------------------------------------------------------------------------------------


def test_tensorcast_builds_the_class_the_profile_is_rooted_at(built: Built) -> None:
    assert type(built.model).__name__ == built.profile.TENSORCAST_BUILDS
    paths = {name for name, _ in PATH_FIELDS}
    assert not paths & set(built.profile.PROFILE), "path fields come from MODULE_PATHS, re-rooted"
    for name, value in built.profile.MODULE_PATHS.items():
        assert name in paths and value, name


def test_every_module_path_and_swap_field_fits_the_built_model(built: Built) -> None:
    assert independent_problems(profile_kwargs(built.profile), built.model, built.config) == []
    assert built.profile.check_model(built.model) == []


def test_profile_paths_are_the_spec_paths_seen_from_tensorcasts_model(built: Built) -> None:
    """Each re-rooted path is the spec's path inside the model kadapt builds, minus the prefix
    that leads from kadapt's model to TensorCast's (the very same submodule, not a look-alike)."""
    spec = built.spec
    if spec.source.trust_remote_code:
        kadapt_root = built.model  # auto_map names one class for both
    else:
        with torch.device("meta"):
            from kimi_adapter_core.loading import _model_class

            kadapt_root = _model_class(built.config, None, remote_code=False)._from_config(built.config)
        assert type(kadapt_root).__name__ == built.profile.KADAPT_BUILDS
    for name, key in PATH_FIELDS:
        if name not in built.profile.MODULE_PATHS:
            continue
        ours = operator.attrgetter(spec.module_paths[key])(kadapt_root)
        theirs = operator.attrgetter(built.profile.MODULE_PATHS[name])(built.model)
        assert type(ours) is type(theirs)
        assert [n for n, _ in ours.named_modules()] == [n for n, _ in theirs.named_modules()], name


def test_the_first_kimi_profile_is_caught(tmp_path: Path) -> None:
    """The profile kadapt first generated for kimi_k25 (paths rooted at the wrong class, the remote
    spec's field renames) fails both checks, naming what TensorCast would have tripped on."""
    item = Built("kimi_k25", tmp_path / "model")
    try:
        old = {
            **profile_kwargs(item.profile),
            "language_module_path": "model.language_model",
            "language_layers_path_str": "model.language_model.layers",
            "visual_module_path": "model.vision_tower",
            "visual_layers_path_str": "model.vision_tower.layers",
            "visual_layers_module_path": "model.vision_tower.layers",
            "mla_field_names_override": {"q_proj": "q_a_proj", "qk_head_dim": "q_head_dim"},
        }
        found = independent_problems(old, item.model, item.config)
        assert any("'Kimi_K25Model' object has no attribute 'model'" in p for p in found), found
        fixed_paths = {**old, **item.profile.MODULE_PATHS}
        assert independent_problems(fixed_paths, item.model, item.config) == [
            "MLA field qk_head_dim -> 'q_head_dim' missing"
        ]

        profile = item.profile
        profile.MODULE_PATHS["language_layers_path_str"] = "model.language_model.layers"
        profile.SWAPS["MLA"]["fields"]["qk_head_dim"] = "q_head_dim"
        profile.SWAPS["MLA"]["renamed"].append("qk_head_dim")
        try:
            problems = profile.check_model(item.model)
        finally:
            del profile.SWAPS["MLA"]["renamed"][-1]
            profile.SWAPS["MLA"]["fields"]["qk_head_dim"] = "qk_head_dim"
            profile.MODULE_PATHS["language_layers_path_str"] = "language_model.layers"
        assert len(problems) == 2, problems
        assert "'model.language_model.layers' does not resolve in the Kimi_K25Model" in problems[0]
        lacks = "a DeepseekV3Attention, lacks q_head_dim (its qk_head_dim)"
        assert f"language_model.layers.0.self_attn (and 1 more), {lacks}" in problems[1]
        assert profile.check_model(item.model) == []
    finally:
        item.close()  # the profile's simulation patches (P11, P5) are installed while built


def test_remote_profile_needs_per_expert_experts_and_the_hub_field_names(tmp_path: Path) -> None:
    """The remote spec's experts are a per-expert ModuleList (TensorCast's default expert adapter
    would fail on it), and its attention is named the hub's way (q_head_dim, no qk_head_dim)."""
    item = Built("kimi_k25_remote", tmp_path / "model")
    try:
        kwargs = profile_kwargs(item.profile)
        assert kwargs["custom_expert_module_type"] is None
        assert kwargs["mla_field_names_override"] == {"q_proj": "q_a_proj", "qk_head_dim": "q_head_dim"}
        as_stacked = {**kwargs}
        del as_stacked["custom_expert_module_type"]
        assert any(
            "with custom_expert_module_type per_expert=False" in p
            for p in independent_problems(as_stacked, item.model, item.config)
        )
        native_names = {**kwargs, "mla_field_names_override": {}}
        assert independent_problems(native_names, item.model, item.config) == [
            "MLA field qk_head_dim -> 'qk_head_dim' missing"
        ]
        assert item.profile.BRIDGE == {"arity": 3, "stash": "_extra_forward_kwargs"}
    finally:
        item.close()


def test_remote_stand_in_carries_the_hub_traits(tmp_path: Path) -> None:
    """The stand-in behaves like the hub code the spec's patches were written for: without the
    profile it cannot even import (P1), its gate samples (P8); with them its forward runs on CPU."""
    directory = write_hub_model(tmp_path / "hub", short_config("kimi_k25_remote", experts=4))
    config = json.loads((directory / "config.json").read_text())
    config["text_config"].update(
        hidden_size=64,
        q_lora_rank=32,
        kv_lora_rank=16,
        num_attention_heads=2,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        vocab_size=96,
        intermediate_size=64,
        moe_intermediate_size=16,
        max_position_embeddings=64,
    )
    (directory / "config.json").write_text(json.dumps(config))
    hub = AutoConfig.from_pretrained(str(directory), trust_remote_code=True)
    profile = load_profile("kimi_k25_remote")
    try:
        profile.hf_config_patch_method(hub, str(directory))
        model = AutoModel.from_config(hub, trust_remote_code=True).eval()
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[1, 2, 3]]), image_grid_thw=None, attention_meta="kept")
        assert out.logits.shape == (1, 3, 96) and model._extra_forward_kwargs == {"attention_meta": "kept"}
        assert profile.check_model(model) == []
    finally:
        profile.remove_patches()


def test_shipped_profiles_name_only_fields_tensorcast_has() -> None:
    for spec_path in SPECS:
        profile = load_profile(spec_path.stem)
        for label, table in (("MLA", TENSORCAST_MLA_FIELDS), ("MoE", TENSORCAST_MOE_FIELDS)):
            if label in profile.SWAPS:
                swap = profile.SWAPS[label]
                assert set(swap["fields"]) == set(table), spec_path.stem
                assert set(swap["optional"]) == {n for n, req in table.items() if not req}


def test_transformers_outside_the_spec_range_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorCast pins transformers 5.13.1; the profiles are written against >=5.23: under the pin
    the profile raised nothing and priced decode at 851 ms. Now every entry point refuses."""
    profile = load_profile("kimi_k25")
    profile.check_environment()  # the version these tests run
    # the module import finds now (building some models re-registers transformers in sys.modules)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.13.1")
    with pytest.raises(
        profile.ProfileError, match=r"generated for transformers >=5.23,<6 .* found transformers 5.13.1"
    ):
        profile.check_environment()
    with pytest.raises(profile.ProfileError, match="found transformers 5.13.1"):
        profile.main(["/nowhere"])
    raw = short_config("kimi_k25")
    with pytest.raises(profile.ProfileError):
        profile.hf_config_patch_method(raw, None)
    assert isinstance(profile._STATE[id(raw)][1], profile.ProfileError)  # kept for patch_method


def test_config_patch_failures_are_kept_for_patch_method_and_raised_there(tmp_path: Path) -> None:
    """TensorCast logs and forgets what ``hf_config_patch_method`` raises; ``patch_method`` (called
    with TensorCast's model once it is built, and not guarded) raises it again with its cause."""
    profile = load_profile("kimi_k25")
    config = copy.deepcopy(short_config("kimi_k25"))
    config["auto_map"] = {"AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"}  # remote code
    try:
        with pytest.raises(
            profile.ProfileError, match="TensorCast will build KimiK25ForConditionalGeneration"
        ):
            profile.hf_config_patch_method(config, str(tmp_path))
    finally:
        profile.remove_patches()  # installed before the class check failed
    model = TensorCastModelView(config, None)
    with pytest.raises(profile.ProfileError, match="failed before TensorCast built the model") as caught:
        profile.patch_method(model)
    assert isinstance(caught.value.__cause__, profile.ProfileError)
    never = short_config("kimi_k25")
    with pytest.raises(profile.ProfileError, match="never ran on this config"):
        profile.patch_method(TensorCastModelView(never, None))
    other_gate = {**short_config("kimi_k25"), "text_config": {"model_type": "llama"}}
    with pytest.raises(profile.ProfileError, match="fails its gate"):
        profile.patch_method(TensorCastModelView(other_gate, None))


class TensorCastModelView:
    """What ``patch_method`` reads of TensorCast's ``TransformerModel`` (``hf_config``, ``unwrap()``,
    ``model_config.*_config.field_names``, ``load_weights``); not a registry, not a simulator."""

    def __init__(self, hf_config: Any, hf_model: Any) -> None:
        self.hf_config, self._hf_model, self.model_config = hf_config, hf_model, None
        self.loaded = False

    def unwrap(self) -> Any:
        return self._hf_model

    def load_weights(self) -> None:
        self.loaded = True


def field_names(swap: dict[str, Any]) -> Any:
    """A dataclass shaped like TensorCast's MlaFieldNames/MoEFieldNames, from the profile's table."""
    import dataclasses

    optional = set(swap["optional"])
    specs = [
        (n, str | None if n in optional else str, dataclasses.field(default=a))
        for n, a in swap["fields"].items()
    ]
    return dataclasses.make_dataclass("FieldNames", specs)()


def test_patch_method_checks_the_built_model_then_chains_the_swap_check(tmp_path: Path) -> None:
    item = Built("qwen3_moe", tmp_path / "model")
    profile, view = item.profile, TensorCastModelView(item.config, item.model)
    with pytest.raises(profile.ProfileError, match="TensorCast has no moe_config for 'qwen3_moe'"):
        profile.patch_method(view)  # TensorCast made no MoE config: this profile is not the one in use
    moe = profile.SWAPS["MoE"]
    view.model_config = types.SimpleNamespace(moe_config=types.SimpleNamespace(field_names=field_names(moe)))
    profile.patch_method(view)
    with pytest.raises(profile.ProfileError, match="TensorCast made no MoE pass"):
        view.load_weights()  # TensorCast calls it right after its swaps; none were reported
    assert not view.loaded

    report = types.SimpleNamespace(  # the fields of TensorCast's PatchReport that verify_swaps reads
        pass_name="MoE",
        matched_modules=["layers.0.mlp"],
        replaced_modules=[],
        skipped_modules=[
            types.SimpleNamespace(
                module_name="layers.0.mlp",
                module_type=moe["module"],
                reason="missing_required_fields",
                missing_fields=("gate",),
            )
        ],
    )
    view.patch_reports = [report]
    assert profile.verify_swaps(view) == [
        "MoE: TensorCast replaced no Qwen3MoeSparseMoeBlock module",
        "MoE: TensorCast skipped layers.0.mlp (Qwen3MoeSparseMoeBlock): missing_required_fields gate",
    ]
    report.replaced_modules, report.skipped_modules = ["layers.0.mlp"], []
    view.load_weights()
    assert view.loaded


# -- the vision path: what TensorCast's image inputs meet in the model --------------------------------


def test_image_size_pads_each_side_to_whole_merged_patches() -> None:
    """TensorCast asks the profile for the size an image is patchified at (``install_image_sizing``
    routes its ``resize_image`` there): the processor's padding, never a rescale; only profiles of
    specs with a vision tower have it."""
    for spec_path in SPECS:
        profile = load_profile(spec_path.stem)
        has_vision = "vision_layers" in load_spec(spec_path).module_paths
        assert hasattr(profile, "image_size") == has_vision, spec_path.stem
        assert hasattr(profile, "tag_vision_attention") == has_vision, spec_path.stem
    size = load_profile("kimi_k25").image_size
    assert size(448, 448, 14, 2) == (448, 448)  # 32x32 patches, 256 image tokens
    assert size(460, 300, 14, 2) == (476, 308)  # Qwen2-VL's smart_resize would round 460 down to 448
    assert (
        size(1, 1, 14, 2) == (28, 28) and size(29, 56, 14, 2) == (56, 56) and size(30, 30, 16, 1) == (32, 32)
    )


def tiny_kimi_dir(directory: Path) -> Path:
    """A config-only ``kimi_k25`` model directory, small enough to run on CPU with real values."""
    raw = short_config("kimi_k25", experts=4)
    raw.update(projection_hidden_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    raw["vision_config"].update(vt_hidden_size=32, vt_intermediate_size=64, vt_num_attention_heads=2)
    raw["text_config"].update(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        vocab_size=256,
        pad_token_id=0,
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    return directory


def test_native_vision_path_takes_tensorcasts_flat_patches(tmp_path: Path) -> None:
    """TensorCast feeds ``pixel_values`` as flat ``[patches, channels*patch*patch]`` rows with
    ``image_grid_thw``; transformers' Kimi_K25VisionPatchEmbed convolves 4-D patches and
    ``get_placeholder_mask`` counts image tokens with ``.item()``, which meta tensors cannot answer.
    With the profile's simulation patches the flat rows give what the 4-D patches give (P11: the
    convolution as the equal linear map) and the merge check passes on meta (P5); without them both
    fail as they failed inside TensorCast."""
    model_dir = tiny_kimi_dir(tmp_path / "tiny")
    config = tensorcast_config(model_dir)
    profile = load_profile("kimi_k25")
    try:
        profile.hf_config_patch_method(config, str(model_dir))
        assert {"P11", "P5"} <= set(profile.installed_patches())
        torch.manual_seed(0)
        model = AutoModel.from_config(config).eval()  # TensorCast's class, on CPU with real values
        patch = config.vision_config.patch_size
        grid = torch.tensor([[1, 8, 6]])  # one 112x84 image: 8x6 patches, 12 image tokens
        flat = torch.randn(48, 3 * patch * patch)
        with torch.no_grad():
            from_flat = model.get_image_features(flat, grid).pooler_output
            from_patches = model.get_image_features(flat.view(48, 3, patch, patch), grid).pooler_output
        assert [tuple(f.shape) for f in from_flat] == [(12, config.text_config.hidden_size)]
        torch.testing.assert_close(from_flat[0], from_patches[0], rtol=1e-5, atol=1e-5)

        hidden = config.text_config.hidden_size
        ids = torch.empty(1, 128 + 12, dtype=torch.long, device="meta")
        embeds = torch.empty(1, 128 + 12, hidden, device="meta")
        features = torch.empty(12, hidden, device="meta")
        image_mask, _ = model.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=features)
        assert tuple(embeds.masked_scatter(image_mask, features).shape) == (1, 140, hidden)

        assert {"P11", "P5"} <= set(profile.remove_patches())
        with pytest.raises(RuntimeError, match="Expected 3D .* or 4D .* input to conv2d"):
            model.get_image_features(flat, grid)
        with pytest.raises(RuntimeError, match="meta tensors"):
            model.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=features)
    finally:
        profile.remove_patches()


@pytest.mark.parametrize("spec_path", OTHER_EXPERTS, ids=lambda p: p.stem)
def test_experts_declared_other_are_ones_tensorcasts_adapter_cannot_read(
    spec_path: Path, tmp_path: Path
) -> None:
    """``experts_layout: other`` (no TensorCast profile) is a claim about the built model: checked here."""
    spec = load_spec(spec_path)
    config = AutoConfig.from_pretrained(write_model_dir(spec_path.stem, tmp_path / "model", experts=4))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = [m.experts for m in model.modules() if type(m).__name__ == spec.moe["moe_class"]]
    assert experts and all(adapter_fields_missing(e) for e in experts)
