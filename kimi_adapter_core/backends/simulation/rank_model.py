"""Build the per-rank text model through the spec on the meta device and trace one step of it.

Tracing every layer of a huge model for every ``simulate`` call is slow and pointless: the layers
of one kind are identical. So this builds the spec's own model - ``applied(spec)`` for backend
``simulation`` (shims, bridges, gated patches), ``load_config`` with the text sub-config resized to
ONE rank, then ``load_model`` on meta - and takes from it what one step runs: the embedding, the
rotary embedding, the first decoder layer of each MLP kind in the model (dense and/or MoE, from the
``ModelStructure``; ``module_paths.language_layers``), the final norm and the lm_head. They run at
the deployment's shapes under a ``Recorder`` that tags each layer's ops with the number of layers
of its kind. The per-rank sizes are written under the config keys the structure read each fact
from (``structure.keys``), so no family's key names are assumed.

The kernels a serving runtime runs replace the eager Hugging Face code in three places:

- Attention core. MHA/GQA/MQA: the model's own attention module runs (its projections, q/k norms,
  rope) and calls transformers' attention interface, which is pointed at ``AttentionKernel``: a
  fused attention priced analytically over the deployment's KV cache (``num_heads`` queries over
  ``num_kv_heads`` cached keys, each sliding layer capped at its window). MLA: the module of the
  spec's ``mla.attention_class`` is swapped for ``RankMLA`` - decode uses the weight-absorbed form
  over the latent cache (FlashMLA-style), prefill expands the latent KV with ``kv_b_proj`` and runs
  a fused causal attention. It reads DeepSeek-style MLA fields (``num_heads``, ``q_lora_rank``,
  ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``) and the rope helpers
  of the attention class's own module.
- Routed experts: the experts module (``moe.experts_class``, else the module holding the stacked
  ``[num_experts, ...]`` expert weights) is priced analytically as grouped GEMMs over a balanced
  token split (each rank computes tokens*top_k/TP token-expert pairs), with the weight bytes of the
  experts actually touched; the deployment's routing (uniform or power-law) scales it in ``cost.py``.
- Collectives: 2 TP all-reduces per layer, EP dispatch + combine per MoE layer when the EP group
  spans more than one TP group, vocab-parallel embedding all-reduce and logits all-gather.

``RankModel`` keeps the built model: what a step changes (recorder, deployment, weight formats) is
bound per trace, so a sweep builds it once per TP size and traces it at every shape and weight mode.

The whole model is built, a vision tower included (at its shipped size: ~0.1 s on meta), because
that is what ``load_model`` builds for the spec: the model class, remote code rules, the gate claim
and ``module_paths`` then all work exactly as for ``kadapt apply``, with no second code path.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ... import upstream
from ...errors import KadaptError
from ...loading import applied, load_config, load_model, submodule
from ...spec.model import Spec
from ...structure.derive import text_config_key
from ...structure.model import ModelStructure
from ..extraction.weights import cast_to_abi_dtype
from .arch import read_config
from .deployment import Deployment
from .inputs import ModelInputs
from .parallel import Parallel, heads_per_rank, kv_heads_per_rank
from .quant import DTYPE_BYTES, NATIVE, WeightFormat
from .tracer import Recorder

BACKEND = "simulation"
ATTENTION_IMPLEMENTATION = "kadapt_simulation"  # registered with transformers while a trace runs


# Structural facts the traced modules take from the built (bridged) config while the routed-expert
# kernel, the memory figures and ``kadapt plan`` take them from the raw config (the structure).
_TRACED_FACTS = (
    "hidden_size",
    "head_dim",
    "v_head_dim",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "intermediate_size",
    "expert_intermediate_size",
    "num_experts",
    "top_k",
    "first_dense_layers",
    "dense_layer_list",
    "moe_layer_step",
    "sliding_window",
)
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
_HEAD_FACTS = ("num_heads", "num_kv_heads", "head_dim")


@dataclass(frozen=True)
class LayerKind:
    """The decoder layers of one MLP kind, traced once (at the first of them)."""

    kind: str  # dense | moe
    layers: tuple[int, ...]  # indices in the full model
    windows: tuple[int | None, ...]  # each one's sliding window (None: full attention)

    @property
    def index(self) -> int:
        return self.layers[0]

    @property
    def name(self) -> str:
        return f"{self.kind}_layer"


def layer_kinds(s: ModelStructure) -> list[LayerKind]:
    """One entry per MLP kind present, in the order their first layers appear."""
    kinds: dict[str, list[int]] = {}
    for layer in s.layers:
        kinds.setdefault(layer.mlp, []).append(layer.index)
    return [
        LayerKind(kind, tuple(ids), tuple(s.layers[i].window for i in ids))
        for kind, ids in sorted(kinds.items(), key=lambda item: item[1][0])
    ]


def built_layers(s: ModelStructure) -> int:
    """Layers the per-rank model keeps: up to the first layer of the last kind to appear."""
    return max(kind.index for kind in layer_kinds(s)) + 1


def rank_overrides(
    key: str | None, s: ModelStructure, dep: Deployment, text: Mapping[str, Any]
) -> dict[str, Any]:
    """Dotted overrides (applied before the spec's bridges) that resize the text sub-config to one rank,
    written under the keys the structure read each fact from: per-rank query and KV heads (an explicit
    head width, which would otherwise follow hidden / heads), dense and shared-expert widths / TP,
    vocab / TP, and the layers up to the first of each kind. Routed experts stay whole (the router is
    replicated; the experts themselves are priced analytically). Token ids are cleared: they lie
    outside the per-rank vocab."""
    tp, a, k = dep.parallel.tp, s.attention, s.keys
    layers = built_layers(s)
    sizes: dict[str, Any] = {
        k["num_heads"]: heads_per_rank(a, tp),
        k["num_layers"]: layers,
        k["vocab_size"]: math.ceil(s.vocab_size / tp),
    }
    if "num_kv_heads" in k:
        sizes[k["num_kv_heads"]] = kv_heads_per_rank(a, tp)
    if not a.is_mla:
        sizes[k.get("head_dim", "head_dim")] = a.head_dim
    if s.dense_layer_ids and "intermediate_size" in k:
        sizes[k["intermediate_size"]] = s.intermediate_size // tp
    moe = s.moe
    if moe is not None and moe.shared_intermediate_size:
        if "shared_expert_intermediate_size" in k:  # one shared expert of its own width
            sizes[k["shared_expert_intermediate_size"]] = moe.shared_intermediate_size // tp
        else:  # n shared experts of the routed width: one of the per-rank total width
            sizes[k.get("num_shared_experts", "n_shared_experts")] = 1
            width_key = k.get("expert_intermediate_size") or k["intermediate_size"]
            sizes[width_key] = max(1, moe.shared_intermediate_size // tp)
    if "layer_types" in k and isinstance(text.get(k["layer_types"]), list):
        sizes[k["layer_types"]] = list(text[k["layer_types"]][:layers])
    sizes.update({name: None for name in _TOKEN_IDS if name in text})
    prefix = f"{key}." if key else ""
    return {prefix + name: value for name, value in sizes.items()}


def _find(
    spec: Spec, root: nn.Module, where: str, section: str, key: str, name: str
) -> list[tuple[str, nn.Module]]:
    """Every module under ``root`` whose class is named ``name`` (non-empty, or a located error)."""
    found = [(path, m) for path, m in root.named_modules() if path and type(m).__name__ == name]
    if not found:
        seen = ", ".join(sorted({type(m).__name__ for m in root.modules()}))
        raise KadaptError(
            f"{section}.{key} = {name!r} matches no module in {where} of the model built for spec "
            f"{spec.name}; the classes there are: {seen}",
            location=spec.locate(f"{section}.{key}"),
        )
    return found


def _stacked_experts(root: nn.Module, experts: int) -> list[tuple[str, nn.Module]]:
    """Modules holding stacked expert weights (``[num_experts, out, in]`` parameters of their own)."""
    return [
        (path, m)
        for path, m in root.named_modules()
        if path and any(p.dim() == 3 and p.shape[0] == experts for p in m.parameters(recurse=False))
    ]


def _swap(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def attended_pairs(past: int, new: int, window: int | None) -> int:
    """Query-key pairs of ``new`` causal queries after ``past`` cached tokens, each query seeing at
    most ``window`` keys (itself included)."""
    uncapped = new if window is None else max(0, min(new, window - past))
    pairs = uncapped * past + uncapped * (uncapped + 1) // 2
    return pairs + (new - uncapped) * (window or 0)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _attention_attrs(
    kind: str, dep: Deployment, b: int, s: int, heads: int, kv_read: float
) -> dict[str, Any]:
    """What the efficiency tables and the measured cost model key an attention kernel by."""
    return {
        "kernel": kind,
        "decode": dep.decode,
        "batch": b,
        "seq": s,
        "past": dep.context_len,
        "heads": heads,
        "kv_bytes": kv_read,
        "kv_dtype": dep.kv_dtype,
        "attention_dp": dep.parallel.dp,  # AIConfigurator prices attention-DP MLA as a whole module
    }


class AttentionKernel:
    """Fused attention of MHA/GQA/MQA layers, priced analytically (FlashAttention / FlashDecoding
    style); registered as a transformers attention implementation while the trace runs.

    Each call is one layer of the kind it stands for; the price is the mean over those layers (their
    sliding windows differ), and the recorder multiplies it by their count. Decode: every one of the
    ``s`` new queries reads the whole (window-capped) cache; prefill: causal pairs, K/V read once."""

    def __init__(
        self, rec: Recorder, dep: Deployment, s: ModelStructure, kinds: dict[int, LayerKind]
    ) -> None:
        self.rec, self.dep, self.s = rec, dep, s
        self.kinds = kinds  # id(module inside a traced layer) -> its layer kind
        self.kv_bytes = DTYPE_BYTES[dep.kv_dtype]
        self.called: set[str] = set()

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **_: Any,
    ) -> tuple[torch.Tensor, None]:
        b, heads, s, hd = query.shape
        kv, vd = key.shape[1], value.shape[-1]
        kind = self.kinds.get(id(module))
        if kind is None:
            raise KadaptError(f"attention of {type(module).__name__} ran outside the traced decoder layers")
        self._check(kind, heads, kv, hd, vd)
        self.called.add(kind.name)
        kvb, past = self.kv_bytes, self.dep.context_len
        per_token = kv * (hd + vd) * kvb  # one token of this rank's cache
        write = b * s * per_token
        if self.dep.decode:
            reads = [min(past + s, w or past + s) for w in kind.windows]
            pairs = _mean([b * heads * s * r for r in reads])
            kv_read = _mean([b * r * per_token for r in reads])
            nbytes = kv_read + 2 * b * s * heads * (hd + vd) + write
            name = "attention_decode"
        else:
            pairs = _mean([b * heads * attended_pairs(past, s, w) for w in kind.windows])
            keys = _mean([min(past, w or past) + s for w in kind.windows])
            kv_read = b * keys * per_token
            nbytes = 2 * b * s * heads * (hd + vd) + kv_read + write
            name = "flash_attention_prefill"
        window = max((w or 0) for w in kind.windows)
        self.rec.analytic(
            name,
            "attention",
            flops=2 * pairs * hd + 2 * pairs * vd,
            nbytes=nbytes,
            shapes=f"B{b} H{heads} KV{kv} q{s} ctx{past + s}",
            attrs=_attention_attrs("gqa", self.dep, b, s, heads, kv_read)
            | {"kv_heads": kv, "head_dim": hd, "window": window},
        )
        return query.new_empty(b, s, heads, vd), None

    def _check(self, kind: LayerKind, heads: int, kv: int, hd: int, vd: int) -> None:
        a, tp = self.s.attention, self.dep.parallel.tp
        want = (heads_per_rank(a, tp), kv_heads_per_rank(a, tp), a.head_dim, a.v_head_dim)
        if (heads, kv, hd, vd) != want:
            raise KadaptError(
                f"the per-rank attention of layer {kind.index} runs {heads} query / {kv} KV heads of "
                f"{hd}/{vd} dims, not the {want[0]} / {want[1]} x {want[2]}/{want[3]} that TP {tp} gives: "
                "its config class did not take the per-rank sizes kadapt wrote under the structure's keys "
                f"({', '.join(sorted(self.s.keys.get(f, f) for f in _HEAD_FACTS))})"
            )


class RankMLA(nn.Module):
    """MLA as serving runtimes run it, around the projections of the spec's attention module
    (adopted, not patched: no class is modified). Reads DeepSeek-style MLA fields."""

    def __init__(self, inner: nn.Module, rec: Recorder, dep: Deployment, kind: LayerKind) -> None:
        super().__init__()
        cls = type(inner).__name__
        missing = [f for f in upstream.MLA_FIELDS if not hasattr(inner, f)]
        if missing:
            raise KadaptError(
                f"mla.attention_class {cls} has no {', '.join(missing)}: the simulated MLA kernels read "
                f"DeepSeek-style MLA fields ({', '.join(upstream.MLA_FIELDS)})"
            )
        for name, child in inner.named_children():  # adopt the real projections and norms by name
            setattr(self, name, child)
        interleave = bool(getattr(getattr(inner, "config", None), "rope_interleave", False))
        rotate = "apply_rotary_pos_emb_interleave" if interleave else "apply_rotary_pos_emb"
        self.rotate = getattr(inspect.getmodule(type(inner)), rotate, None)  # the class's own rope helper
        if self.rotate is None:
            raise KadaptError(f"the module defining mla.attention_class {cls} has no {rotate}()")
        self.adopted = type(inner)  # the spec's attention class, whose projections this module runs
        self.q_lora_rank = inner.q_lora_rank
        self.heads, self.nope, self.rope = inner.num_heads, inner.qk_nope_head_dim, inner.qk_rope_head_dim
        self.v_dim, self.rank = inner.v_head_dim, inner.kv_lora_rank
        self.kind = kind
        self.bind(rec, dep)

    def bind(self, rec: Recorder, dep: Deployment) -> None:
        """Record the next forward into ``rec`` at the shapes of ``dep`` (a built model is traced again)."""
        self.rec, self.dep = rec, dep

    @property
    def kv_bytes(self) -> float:
        return DTYPE_BYTES[self.dep.kv_dtype]

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, None]:
        b, s, hidden = hidden_states.shape
        heads, nope, rope, rank = self.heads, self.nope, self.rope, self.rank
        first = len(self.rec.ops)
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
        q_rot, k_rot = self.rotate(q_rot, k_rot, cos, sin)
        context = self.dep.context_len + s
        cache_write = b * s * (rank + rope) * self.kv_bytes
        if self.dep.decode:
            out = self._absorbed(q_nope, q_rot, b, s, context, cache_write)
        else:
            out = self._prefill(kv_nope, b, s, context, cache_write)
        out = self.o_proj(out)
        self._note_module_gemms(first, b * s, hidden)
        return out, None

    def _note_module_gemms(self, first: int, tokens: int, hidden: int) -> None:
        """Give the attention kernel the GEMMs of this call that SGLang's attention-DP MLA module runs
        around it (q_b / kv_b / o projections and the absorbed bmm, not the shared q_a + kv_a
        downscale): AIConfigurator measures that module whole, and the measured cost model prices
        the kernel as the module's row less these GEMMs, which it prices on their own. Each is
        ``(tag, n, k, kernel, batch, rows)``, ``rows`` saying whether its M is the new tokens or the
        whole context, so the description does not change with the batch (a sweep scales traces).
        Also the module's ``hidden`` size: a module measured whole (vLLM's) was measured at one."""
        ops = self.rec.ops[first:]
        inside = (".q_proj", ".q_b_proj", ".kv_b_proj", ".o_proj")
        gemms = tuple(
            (
                str(op.attrs.get("tag", "proj")),
                int(op.attrs["n"]),
                int(op.attrs["k"]),
                str(op.attrs["kernel"]),
                int(op.attrs.get("batch", 1)),
                "new" if int(op.attrs["m"]) == tokens else "context",
            )
            for op in ops
            if op.kind == "matmul"
            and "m" in op.attrs
            and (op.module.endswith(inside) or str(op.attrs.get("tag", "")).startswith("mla_bmm"))
        )
        for op in ops:
            if op.kind == "attention":
                op.attrs["module_gemms"] = gemms
                op.attrs["hidden"] = hidden

    def _absorbed(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, b: int, s: int, context: int, cache_write: int
    ) -> torch.Tensor:
        """Decode: fold W_UK into q and W_UV into the output; attend over the 576-wide latent cache."""
        heads, nope, rope, v_dim, rank = self.heads, self.nope, self.rope, self.v_dim, self.rank
        w = self.kv_b_proj.weight.view(heads, nope + v_dim, rank)
        q_h = q_nope.permute(1, 0, 2, 3).reshape(heads, b * s, nope)
        with self.rec.tagged("mla_bmm_pre"):
            q_latent = torch.bmm(q_h, w[:, :nope, :])  # [H, B*S, kv_lora]
        reads = [min(context, w or context) for w in self.kind.windows]
        pairs = _mean([b * heads * s * r for r in reads])
        kv_read = _mean([b * r * (rank + rope) * self.kv_bytes for r in reads])
        self.rec.analytic(
            "mla_decode_attention",
            "attention",
            flops=2 * pairs * (rank + rope) + 2 * pairs * rank,
            nbytes=kv_read
            + q_latent.numel() * 2
            + q_rot.numel() * 2
            + heads * b * s * rank * 2
            + cache_write,
            shapes=f"B{b} H{heads} q{s} ctx{context}",
            attrs=_attention_attrs("mla", self.dep, b, s, heads, kv_read),
        )
        o_latent = q_latent.new_empty(heads, b * s, rank)
        with self.rec.tagged("mla_bmm_post"):
            out = torch.bmm(o_latent, w[:, nope:, :].transpose(1, 2))  # [H, B*S, v]
        return out.view(heads, b, s, v_dim).permute(1, 2, 0, 3).reshape(b, s, heads * v_dim)

    def _prefill(self, kv_nope: torch.Tensor, b: int, s: int, context: int, cache_write: int) -> torch.Tensor:
        """Prefill: expand cached + new latents to per-head K/V, then one fused causal attention."""
        heads, qk, v_dim, rank = self.heads, self.nope + self.rope, self.v_dim, self.rank
        latent = kv_nope.new_empty(b, context, rank)  # cache + new tokens; the read is charged to kv_b_proj
        self.kv_b_proj(latent)
        past = context - s
        pairs = _mean([b * heads * attended_pairs(past, s, w) for w in self.kind.windows])
        keys = _mean([min(past, w or past) + s for w in self.kind.windows])
        kv_read = 2 * b * keys * heads * (qk + v_dim)
        self.rec.analytic(
            "flash_attention_prefill",
            "attention",
            flops=2 * pairs * qk + 2 * pairs * v_dim,
            nbytes=2 * (b * s * heads * qk + b * s * heads * v_dim) + kv_read + cache_write,
            shapes=f"B{b} H{heads} q{s} ctx{context}",
            attrs=_attention_attrs("mla", self.dep, b, s, heads, kv_read),
        )
        return kv_nope.new_empty(b, s, heads * v_dim)


class RoutedExperts(nn.Module):
    """Stands in for the model's routed-experts module: records EP dispatch, the grouped GEMMs, EP combine.

    Called as transformers' experts modules are: ``(hidden_states, top_k_index, top_k_weights)``,
    hidden states flattened to ``[tokens, hidden]``.

    Work per rank: every device runs experts, so each computes ``tokens * top_k / tp`` token-expert
    pairs on average (the DP groups' tokens spread over all devices; TP ranks of a group share
    theirs). Layout: when the EP group fits inside a TP group (``ep <= tp``), every rank already
    holds all of its group's tokens after the attention all-reduce, runs them through its local
    experts and the MLP all-reduce sums the partial outputs - TensorRT-LLM's (and SGLang's/vLLM's
    non-DeepEP) layout, with no dispatch or combine. Otherwise tokens travel by all-to-all
    (DeepEP-style, see ``cost.py``)."""

    def __init__(self, s: ModelStructure, rec: Recorder, dep: Deployment, fmt: WeightFormat) -> None:
        super().__init__()
        assert s.moe is not None
        self.s = s
        self.bind(rec, dep, fmt)

    def bind(self, rec: Recorder, dep: Deployment, fmt: WeightFormat) -> None:
        """Record the next call into ``rec`` at the shapes of ``dep``, the experts stored in ``fmt``."""
        self.rec, self.dep, self.fmt = rec, dep, fmt

    def forward(self, hidden_states: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        moe, hidden, par = self.s.moe, self.s.hidden_size, self.dep.parallel
        assert moe is not None
        tokens = hidden_states.shape[0]  # this rank's attention-side tokens
        pairs = tokens * moe.top_k / par.tp  # balanced split of every token-expert pair over the devices
        local = moe.num_experts // par.ep
        touched = local * (1 - (1 - 1 / local) ** pairs)  # expected experts hit by uniform routing
        width = moe.expert_intermediate_size
        per_expert = 3 * hidden * width
        all_to_all = par.ep > par.tp
        sent = tokens / par.tp  # tokens each rank sends (TP ranks of a group split their shared tokens)
        dispatch_bytes = 1 if self.fmt.eight_bit_activations else 2  # 8-bit activations are dispatched
        comm = {
            "collective": "all_to_all",
            "group": par.ep,
            "tokens": sent,
            "top_k": moe.top_k,
            "hidden": hidden,
            "experts": moe.num_experts,
            # decode runs DeepEP's low-latency kernels (SGLang / TensorRT-LLM wide EP), prefill its
            # normal ones: they move different bytes at different fixed costs (cost.py)
            "low_latency": self.dep.decode,
        }
        if all_to_all:
            self.rec.analytic(
                "ep_dispatch(all_to_all)",
                "comm",
                comm=comm
                | {
                    "bytes": sent * moe.top_k * hidden * dispatch_bytes,
                    "token_bytes": hidden * dispatch_bytes,
                },
            )
        self.rec.analytic(
            "grouped_gemm(routed_experts)",
            "experts",
            flops=2 * pairs * per_expert,
            nbytes=touched * per_expert * self.fmt.bytes_per_param + pairs * (2 * hidden + 3 * width) * 2,
            compute=self.fmt.compute,
            shapes=f"pairs{pairs:.0f} experts{local} hit{touched:.1f}",
            attrs={
                "kernel": self.fmt.kernel,
                "pairs": pairs,
                "pairs_per_expert": pairs / local,
                "routing": self.dep.routing,
                "tokens": pairs * par.ep / moe.top_k,  # AIConfigurator's num_tokens for this rank's share
                # the layout as AIConfigurator's attention-DP graphs key it: tokens per attention-DP
                # rank (what one DP group runs attention on), the attention-DP size, and whether the
                # tokens reach the experts by all-to-all (its large-EP graph) or not
                "rank_tokens": tokens,
                "attention_dp": par.dp,
                "all_to_all": all_to_all,
                "hidden": hidden,
                "width": width,
                "top_k": moe.top_k,
                "experts": moe.num_experts,
                "ep": par.ep,
            },
        )
        if all_to_all:
            self.rec.analytic(
                "ep_combine(all_to_all)",
                "comm",
                comm=comm | {"bytes": sent * moe.top_k * hidden * 2, "token_bytes": hidden * 2},
            )
        return hidden_states


@dataclass
class TracedLayer:
    kind: LayerKind
    module: nn.Module
    rope_type: str | None = None  # its layer type, for a rotary embedding that takes one (Gemma-3)


@dataclass
class RankParts:
    """What one step of the per-rank model runs, taken from the model built for the spec."""

    embed_tokens: nn.Module
    rotary: nn.Module
    layers: list[TracedLayer]  # the first layer of each kind, in model order
    norm: nn.Module
    lm_head: nn.Module
    eh_proj: nn.Module | None
    attention: list[RankMLA] = field(default_factory=list)  # the swapped MLA modules
    experts: list[RoutedExperts] = field(default_factory=list)  # the swapped routed experts
    configs: list[Any] = field(default_factory=list)  # configs of the traced layers' attention
    names: dict[int, str] = field(default_factory=dict)  # id(parameter) -> its name in the built model

    def layer(self, kind: str) -> nn.Module | None:
        return next((t.module for t in self.layers if t.kind.kind == kind), None)

    def named(self) -> Iterator[tuple[str, nn.Module]]:
        """The parts under the names the op table uses (``moe_layer.self_attn.q_a_proj``, ...)."""
        yield "embed_tokens", self.embed_tokens
        yield "rotary", self.rotary
        for traced in self.layers:
            yield traced.kind.name, traced.module
        yield "norm", self.norm
        yield "lm_head", self.lm_head
        if self.eh_proj is not None:
            yield "eh_proj", self.eh_proj

    def bind(self, rec: Recorder, dep: Deployment, inputs: ModelInputs) -> None:
        """Point the swapped serving kernels at ``rec`` and ``dep`` and tag every weight with the format
        ``inputs`` gives its checkpoint name (the weight mode): the next forward records one step of
        ``dep`` in that mode. Nothing of the built model changes, so it can be bound again."""
        if self.experts:
            routed = next(g for g in inputs.groups if g.name == "routed_experts")
            fmt = inputs.policy(routed, routed.checkpoint_name)
            for experts in self.experts:
                experts.bind(rec, dep, fmt)
        for mla in self.attention:
            mla.bind(rec, dep)
        group_of = inputs.group_of()
        for _, part in self.named():
            for param in part.parameters():
                checkpoint = inputs.naming.checkpoint(self.names.get(id(param), ""))
                group = group_of.get(checkpoint)
                rec.mark_weight(param, inputs.policy(group, checkpoint) if group else NATIVE["bf16"])


def _child(spec: Spec, lm: nn.Module, name: str) -> nn.Module:
    module = getattr(lm, name, None)
    if not isinstance(module, nn.Module):
        raise KadaptError(
            f"module_paths.language_model ({spec.module_paths['language_model']}) of spec {spec.name} has "
            f"no {name!r} submodule; simulate calls the text model's embed_tokens, rotary_emb and norm",
            location=spec.locate("module_paths.language_model"),
        )
    return module


def _check_sizes(
    spec: Spec,
    key: str | None,
    text: Any,
    raw_text: Mapping[str, Any],
    overrides: dict[str, Any],
    s: ModelStructure,
) -> list[str]:
    """A bridge may not undo a per-rank size; one that changes a traced size is reported."""
    for path, wanted in overrides.items():
        got = getattr(text, path.rpartition(".")[2], wanted)
        if wanted is not None and got != wanted:
            raise KadaptError(
                f"a config bridge for backend {BACKEND} sets {path} = {got!r} over the per-rank value "
                f"{wanted!r} simulate derives from the deployment",
                location=spec.locate("config_bridges"),
            )
    notes = []
    prefix = f"{key}." if key else ""
    resized = {path.rpartition(".")[2] for path in overrides}
    for fact in _TRACED_FACTS:
        name = s.keys.get(fact)
        if name is None or name in resized or name not in raw_text:
            continue
        raw, got = raw_text[name], getattr(text, name, raw_text[name])
        if got != raw:
            notes.append(
                f"config bridges change {prefix}{name} from {raw} to {got}: the traced modules use {got}; "
                f"the routed-expert kernel, the memory figures and `kadapt plan` use the raw config's {raw}"
            )
    return notes


def _experts_of(spec: Spec, layer: nn.Module, where: str, s: ModelStructure) -> list[tuple[nn.Module, str]]:
    """(parent, path) of every routed-experts module in an MoE layer: inside the spec's
    ``moe.moe_class`` blocks, of class ``moe.experts_class`` when the spec names one, else the
    modules holding the stacked ``[num_experts, ...]`` expert weights."""
    assert s.moe is not None
    moe = spec.moe or {}
    roots = (
        _find(spec, layer, where, "moe", "moe_class", moe["moe_class"])
        if moe.get("moe_class")
        else [("", layer)]
    )
    found: list[tuple[nn.Module, str]] = []
    for _, root in roots:
        if moe.get("experts_class"):
            matches = _find(spec, root, where, "moe", "experts_class", moe["experts_class"])
        else:
            matches = _stacked_experts(root, s.moe.num_experts)
            if not matches:
                lists = [
                    type(m).__name__
                    for m in root.modules()
                    if isinstance(m, nn.ModuleList) and len(m) == s.moe.num_experts
                ]
                detail = " (its experts are a per-expert module list)" if lists else ""
                raise KadaptError(
                    f"no module in {where} of the model built for spec {spec.name} holds the "
                    f"{s.moe.num_experts} routed experts as stacked weights{detail}; simulate prices an "
                    "experts module called as transformers' (hidden_states, top_k_index, top_k_weights): "
                    "name its class under moe.experts_class",
                    location=spec.locate("moe" if spec.moe else "metadata"),
                )
        found += [(root, path) for path, _ in matches]
    return found


def _build(spec: Spec, inputs: ModelInputs, dep: Deployment) -> tuple[RankParts, list[str]]:
    """Build the per-rank model for ``spec`` at ``dep``'s TP size (with an MTP block if it drafts) on
    meta and swap in the serving kernels (bound to nothing yet: ``RankParts.bind``). Must run inside
    ``applied(spec, backend="simulation")``."""
    s = inputs.arch.structure
    raw = read_config(spec)
    key = text_config_key(spec, isinstance(raw.get("text_config"), dict))
    raw_text = raw[key] if key else raw
    overrides = rank_overrides(key, s, dep, raw_text)
    config = load_config(spec, backend=BACKEND, overrides=overrides)
    notes = _check_sizes(spec, key, getattr(config, key) if key else config, raw_text, overrides, s)
    model = load_model(spec, device="meta", config=config)
    lm = submodule(model, spec, "language_model")
    layers = submodule(model, spec, "language_layers")
    lm_head = submodule(model, spec, "lm_head")
    layers_path = spec.module_paths["language_layers"]
    kinds = layer_kinds(s)
    rope_types = upstream.rope_layer_types(lm)
    parts = RankParts(
        lm.get_input_embeddings(),
        _child(spec, lm, "rotary_emb"),
        [TracedLayer(kind, layers[kind.index], rope_types and rope_types[kind.index]) for kind in kinds],
        _child(spec, lm, "norm"),
        lm_head,
        nn.Linear(2 * s.hidden_size, s.hidden_size, bias=False) if dep.mtp else None,
    )
    # bf16 as a checkpoint loads: fp32 where transformers keeps it (the router's correction bias);
    # computed buffers (rotary inv_freq) keep their dtype
    cast_to_abi_dtype(model, [part for _, part in parts.named()], torch.bfloat16)
    parts.names = {id(t): n for n, t in model.named_parameters()}  # before any swap: the model's own names

    unbound = Recorder()  # every swapped kernel is bound to the trace's recorder before it runs
    for traced in parts.layers:
        where = f"{layers_path}.{traced.kind.index}"
        if traced.kind.kind == "moe":
            experts = RoutedExperts(s, unbound, _UNBOUND, NATIVE["bf16"])
            for root, path in _experts_of(spec, traced.module, where, s):
                _swap(root, path, experts)
            parts.experts.append(experts)
        if s.attention.is_mla:
            attention_class = (spec.mla or {}).get("attention_class")
            if not attention_class:
                raise KadaptError(
                    f"spec {spec.name} has no mla.attention_class: simulate swaps the MLA attention module "
                    "for its serving kernel and finds it by the class name the spec declares",
                    location=spec.locate("mla" if spec.mla else "metadata"),
                )
            for path, inner in _find(spec, traced.module, where, "mla", "attention_class", attention_class):
                mla = RankMLA(inner, unbound, _UNBOUND, traced.kind)
                _swap(traced.module, path, mla)
                parts.attention.append(mla)
        else:
            configs = {id(m.config): m.config for m in traced.module.modules() if hasattr(m, "config")}
            parts.configs += [c for c in configs.values() if hasattr(c, "_attn_implementation")]
    return parts, notes


_UNBOUND = Deployment(Parallel(), 1, 1, 0, True)  # placeholder shapes until a trace binds its own


def build_rank(
    spec: Spec, inputs: ModelInputs, dep: Deployment, rec: Recorder
) -> tuple[RankParts, list[str]]:
    """Build the per-rank model for ``spec`` on meta, swap in the serving kernels and bind them to
    ``rec`` and ``dep``. Must run inside ``applied(spec, backend="simulation")``."""
    parts, notes = _build(spec, inputs, dep)
    parts.bind(rec, dep, inputs)
    return parts, notes


class RankModel:
    """The per-rank model of ``spec`` at one TP size, built once and traced at any batch, context,
    phase and weight mode (a sweep traces it dozens of times; building is about half of a trace).

    What a step changes is bound per trace (``RankParts.bind``: the recorder, the deployment, the
    weight formats) and the hooks a trace registers are removed after it, so a trace on a reused
    model records exactly what a trace on a fresh one does (``tests/test_sweep.py``)."""

    def __init__(self, spec: Spec, inputs: ModelInputs, dep: Deployment) -> None:
        self.spec, self.tp, self.mtp = spec, dep.parallel.tp, bool(dep.mtp)
        self.s = inputs.arch.structure
        with applied(spec, backend=BACKEND), torch.device("meta"):
            self.parts, self.notes = _build(spec, inputs, dep)

    def serves(self, dep: Deployment) -> bool:
        return dep.parallel.tp == self.tp and bool(dep.mtp) == self.mtp

    def trace(self, inputs: ModelInputs, dep: Deployment) -> Recorder:
        """Run one step of ``dep`` with the weights in ``inputs``' formats; the recorder holds every op."""
        if not self.serves(dep):
            raise KadaptError(f"the per-rank model for TP {self.tp} cannot trace TP {dep.parallel.tp}")
        s, model, rec, par = self.s, self.parts, Recorder(), dep.parallel
        with applied(self.spec, backend=BACKEND), torch.device("meta"):
            model.bind(rec, dep, inputs)
            b, q = dep.batch_per_rank, dep.tokens_per_query
            input_ids = torch.zeros(b, q, dtype=torch.long)
            positions = torch.arange(dep.context_len, dep.context_len + q).unsqueeze(0).expand(b, q)
            hidden_bytes = b * q * s.hidden_size * 2
            _all_reduce = {"collective": "all_reduce", "bytes": hidden_bytes, "group": par.tp}

            def tp_all_reduces(_module: nn.Module, _args: Any, _out: Any) -> None:
                for _ in range(2):  # after the attention's o_proj and after the MLP's down projection
                    rec.analytic("tp_all_reduce", "comm", comm=_all_reduce)

            handles = []
            if par.tp > 1:  # registered before the recorder's hooks: recorded under the layer's name
                handles += [t.module.register_forward_hook(tp_all_reduces) for t in model.layers]
            for name, part in model.named():
                handles += rec.hook(part, name)
            kinds = {id(m): t.kind for t in model.layers for m in t.module.modules()}
            kernel = AttentionKernel(rec, dep, s, kinds)
            try:
                with (
                    upstream.attention_kernel(ATTENTION_IMPLEMENTATION, kernel, model.configs),
                    rec,
                    torch.no_grad(),
                ):
                    _step(model, rec, dep, s, input_ids, positions, _all_reduce)
            finally:
                for handle in handles:
                    handle.remove()
        if not s.attention.is_mla:
            missed = [t.kind.name for t in model.layers if t.kind.name not in kernel.called]
            if missed:
                raise KadaptError(
                    f"the attention of {', '.join(missed)} never called transformers' attention interface "
                    f"(config._attn_implementation); simulate prices {s.attention.kind.upper()} attention "
                    "through it and cannot price this model's attention"
                )
        return rec


def _step(
    model: RankParts,
    rec: Recorder,
    dep: Deployment,
    s: ModelStructure,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    all_reduce: dict[str, Any],
) -> None:
    """One step: embedding, the traced layers (each standing for its kind), the last norm and logits,
    and the MTP drafts."""
    par, vocab = dep.parallel, s.vocab_size
    hidden = model.embed_tokens(input_ids)
    if par.tp > 1:
        rec.analytic("tp_all_reduce(vocab_parallel_embedding)", "comm", comm=all_reduce)
    # one (cos, sin) per rotary kind the traced layers use (Gemma-3: local and global frequencies)
    rope = {
        t: model.rotary(hidden, positions, *([t] if t else []))
        for t in dict.fromkeys(traced.rope_type for traced in model.layers)
    }
    for traced in model.layers:
        with rec.scope(traced.kind.kind, len(traced.kind.layers)):
            hidden = traced.module(hidden, position_embeddings=rope[traced.rope_type])
    last = model.norm(hidden if dep.decode else hidden[:, -1:, :])  # prefill: last token's logits
    _logits(model, rec, last, par.tp, vocab)
    if dep.mtp and model.eh_proj is not None:
        block = model.layers[-1].module  # the kind of the model's last layer
        with rec.scope("mtp", dep.mtp):  # one DeepSeek-style MTP block per drafted token
            draft_in = hidden[:, -1:, :]
            draft = model.eh_proj(torch.cat([draft_in, model.embed_tokens(input_ids[:, -1:])], dim=-1))
            cos, sin = rope[model.layers[-1].rope_type]
            draft = block(draft, position_embeddings=(cos[:, -1:], sin[:, -1:]))
            _logits(model, rec, model.norm(draft), par.tp, vocab)


def trace_rank(spec: Spec, inputs: ModelInputs, dep: Deployment) -> tuple[Recorder, list[str]]:
    """Build the per-rank model and run one step of it on meta; the recorder holds every op."""
    with applied(spec, backend=BACKEND):  # one session for the build and the trace
        model = RankModel(spec, inputs, dep)
        return model.trace(inputs, dep), list(model.notes)


def _logits(model: RankParts, rec: Recorder, hidden: torch.Tensor, tp: int, vocab: int) -> None:
    model.lm_head(hidden)
    if tp > 1:
        tokens = hidden.shape[0] * hidden.shape[1]
        rec.analytic(
            "tp_all_gather(logits)",
            "comm",
            comm={"collective": "all_gather", "bytes": tokens * vocab * 2, "group": tp},
        )
