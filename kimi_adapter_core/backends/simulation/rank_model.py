"""Build the per-rank text model through the spec on the meta device and trace one step of it.

Tracing all 61 layers of a 1T-parameter model for every ``simulate`` call is slow and pointless: the
layers of one kind are identical. So this builds the spec's own model - ``applied(spec)`` for backend
``simulation`` (shims, bridges, gated patches), ``load_config`` with the text sub-config resized to
ONE rank (heads / TP, dense and shared-expert widths / TP, vocab / TP, ``n_dense + 1`` layers), then
``load_model`` on meta - and takes from it what one step runs: the embedding, the rotary embedding,
one dense and one MoE decoder layer (``module_paths.language_layers``), the final norm and the lm_head.
They run at the deployment's shapes under a ``Recorder`` that tags each layer's ops with its layer
count. Three pieces are swapped, found by the class names the spec declares (``mla.attention_class``,
``moe.moe_class`` / ``gate_class`` / ``experts_class``), for the kernels a serving runtime runs instead
of the eager Hugging Face code:

- MLA attention core: decode uses the weight-absorbed form over the latent cache (FlashMLA-style);
  prefill expands the latent KV with ``kv_b_proj`` and runs a fused causal attention. The projections,
  norms and rope around it are the real modules, traced. This is the one family-specific piece: it
  reads DeepSeek-style MLA fields (``num_heads``, ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
  ``qk_rope_head_dim``, ``v_head_dim``) and the rope helpers of the attention class's own module.
- Routed experts: priced analytically as grouped GEMMs over a uniform token split (each rank computes
  batch*tokens*top_k/EP token-expert pairs), with the weight bytes of the experts actually touched.
- Collectives: 2 TP all-reduces per layer, EP dispatch + combine per MoE layer, vocab-parallel
  embedding all-reduce and logits all-gather.

The whole model is built, vision tower included (at its shipped size: ~0.1 s on meta), because that is
what ``load_model`` builds for the spec: the model class, remote code rules, the gate claim and
``module_paths`` then all work exactly as for ``kadapt apply``, with no second code path.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...errors import KadaptError
from ...loading import applied, load_config, load_model, submodule
from ...spec.model import Spec
from .arch import TextArch, read_config, text_key
from .deployment import Deployment
from .params import text_groups
from .quant import DTYPE_BYTES, NATIVE, Policy, WeightFormat
from .tracer import Recorder

BACKEND = "simulation"

# MLA fields the absorbed / expanded attention kernels read from the attention module (DeepSeek style)
_MLA_FIELDS = (
    "num_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)

# Text-config fields the traced modules take as built (bridges included) while the routed-expert
# kernel, the memory figures and ``kadapt plan`` take them from the raw config (``TextArch``).
_TRACED_SIZES = {
    "hidden_size": "hidden",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "num_experts_per_tok": "top_k",
    "first_k_dense_replace": "first_k_dense",
}


def rank_overrides(key: str | None, t: TextArch, dep: Deployment) -> dict[str, Any]:
    """Dotted overrides (applied before the spec's bridges) that resize the text sub-config to one rank:
    per-rank heads and widths; routed experts stay whole (the router is replicated; the experts
    themselves are priced analytically). Token ids are cleared: they lie outside the per-rank vocab."""
    tp = dep.parallel.tp
    sizes: dict[str, Any] = {
        "num_attention_heads": t.num_heads // tp,
        "num_key_value_heads": t.num_heads // tp,
        "intermediate_size": t.intermediate // tp,
        "moe_intermediate_size": max(1, t.moe_intermediate * t.n_shared_experts // tp),
        "n_shared_experts": 1,
        "num_hidden_layers": t.n_dense_layers + 1,
        "vocab_size": math.ceil(t.vocab / tp),
        "n_routed_experts": max(1, t.n_routed_experts),
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    prefix = f"{key}." if key else ""
    return {prefix + name: value for name, value in sizes.items()}


@dataclass(frozen=True)
class Declared:
    """The class names the spec declares for the modules the trace swaps or prices."""

    attention: str
    moe: str | None
    gate: str | None
    experts: str | None


def declared_classes(spec: Spec, t: TextArch) -> Declared:
    """Read (and require) the spec's ``mla`` / ``moe`` class names before anything is built."""

    def need(section: str, key: str) -> str:
        value = getattr(spec, section).get(key)
        if not value:
            raise KadaptError(
                f"spec {spec.name} has no {section}.{key}: simulate swaps the module of that class for "
                "its serving kernel and finds it by the class name the spec declares",
                location=spec.locate(section if getattr(spec, section) else "metadata"),
            )
        return str(value)

    attention = need("mla", "attention_class")
    if not t.n_moe_layers:
        return Declared(attention, None, None, None)
    return Declared(
        attention, need("moe", "moe_class"), need("moe", "gate_class"), need("moe", "experts_class")
    )


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


def _swap(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(root.get_submodule(parent), child, new)


class RankMLA(nn.Module):
    """MLA as serving runtimes run it, around the projections of the spec's attention module
    (adopted, not patched: no class is modified). Reads DeepSeek-style MLA fields."""

    def __init__(self, inner: nn.Module, rec: Recorder, dep: Deployment, kv_bytes: int) -> None:
        super().__init__()
        cls = type(inner).__name__
        missing = [f for f in _MLA_FIELDS if not hasattr(inner, f)]
        if missing:
            raise KadaptError(
                f"mla.attention_class {cls} has no {', '.join(missing)}: the simulated MLA kernels read "
                f"DeepSeek-style MLA fields ({', '.join(_MLA_FIELDS)})"
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
        q_rot, k_rot = self.rotate(q_rot, k_rot, cos, sin)
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
    """Stands in for the spec's ``moe.experts_class``: records EP dispatch, the grouped GEMMs, EP combine.

    Called as transformers' experts modules are: ``(hidden_states, top_k_index, top_k_weights)``."""

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


@dataclass
class RankParts:
    """What one step of the per-rank model runs, taken from the model built for the spec."""

    embed_tokens: nn.Module
    rotary: nn.Module
    dense_layer: nn.Module | None
    moe_layer: nn.Module | None
    norm: nn.Module
    lm_head: nn.Module
    eh_proj: nn.Module | None
    attention: list[nn.Module]  # the swapped attention modules (RankMLA), dense then MoE layer
    mlps: list[nn.Module]  # each traced layer's MLP / MoE block (they end in a TP all-reduce)

    def named(self) -> Iterator[tuple[str, nn.Module]]:
        """The parts under the names the op table uses (``dense_layer.self_attn.q_a_proj``, ...)."""
        for name in ("embed_tokens", "rotary", "dense_layer", "moe_layer", "norm", "lm_head", "eh_proj"):
            module = getattr(self, name)
            if module is not None:
                yield name, module


def _child(spec: Spec, lm: nn.Module, name: str) -> nn.Module:
    module = getattr(lm, name, None)
    if not isinstance(module, nn.Module):
        raise KadaptError(
            f"module_paths.language_model ({spec.module_paths['language_model']}) of spec {spec.name} has "
            f"no {name!r} submodule; simulate calls the text model's embed_tokens, rotary_emb and norm",
            location=spec.locate("module_paths.language_model"),
        )
    return module


def _check_sizes(spec: Spec, key: str | None, text: Any, overrides: dict[str, Any], t: TextArch) -> list[str]:
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
    for field, attr in _TRACED_SIZES.items():
        raw, got = getattr(t, attr), getattr(text, field, getattr(t, attr))
        if got != raw:
            notes.append(
                f"config bridges change {prefix}{field} from {raw} to {got}: the traced modules use {got}; "
                f"the routed-expert kernel, the memory figures and `kadapt plan` use the raw config's {raw}"
            )
    return notes


def build_rank(
    spec: Spec, t: TextArch, dep: Deployment, rec: Recorder, policy: Policy, names: Declared
) -> tuple[RankParts, list[str]]:
    """Build the per-rank model for ``spec`` on meta and swap in the serving kernels.

    Must run inside ``applied(spec, backend="simulation")`` (so bridges, shims and gated patches act).
    """
    key = text_key(spec, read_config(spec))
    overrides = rank_overrides(key, t, dep)
    config = load_config(spec, backend=BACKEND, overrides=overrides)
    notes = _check_sizes(spec, key, getattr(config, key) if key else config, overrides, t)
    model = load_model(spec, device="meta", config=config)
    lm = submodule(model, spec, "language_model")
    layers = submodule(model, spec, "language_layers")
    lm_head = (
        submodule(model, spec, "lm_head") if "lm_head" in spec.module_paths else model.get_output_embeddings()
    )
    if lm_head is None:
        raise KadaptError(f"spec {spec.name} has no module_paths.lm_head and its model no output embeddings")
    layers_path = spec.module_paths["language_layers"]
    dense = layers[0] if t.n_dense_layers else None
    moe = layers[t.n_dense_layers] if t.n_moe_layers else None
    parts = RankParts(
        lm.get_input_embeddings(),
        _child(spec, lm, "rotary_emb"),
        dense,
        moe,
        _child(spec, lm, "norm"),
        lm_head,
        nn.Linear(2 * t.hidden, t.hidden, bias=False) if dep.mtp else None,
        [],
        [],
    )
    for _, part in parts.named():
        part.to(torch.bfloat16)

    kv_bytes = DTYPE_BYTES[dep.kv_dtype]
    groups = {g.name: g for g in text_groups(t)}
    group_of: dict[int, str] = {}  # id(parameter) -> inventory group (for its weight format)
    for p in parts.embed_tokens.parameters():
        group_of[id(p)] = "embed_tokens"
    for p in parts.lm_head.parameters():
        group_of[id(p)] = "lm_head"
    mlp_slot = "mlp"
    if moe is not None:
        where = f"{layers_path}.{t.n_dense_layers}"
        assert names.moe and names.gate and names.experts
        blocks = _find(spec, moe, where, "moe", "moe_class", names.moe)
        mlp_slot = blocks[0][0]
        for _, block in blocks:
            for p in block.parameters():
                group_of[id(p)] = "shared_experts"  # all but the router and the (swapped) routed experts
            for _, gate in _find(spec, block, where, "moe", "gate_class", names.gate):
                gate.float()  # the fp32 router GEMM reads bf16 weights once
                for p in gate.parameters():
                    group_of[id(p)] = "router"
            experts = RoutedExperts(t, rec, dep, policy(groups["routed_experts"]))
            for path, _ in _find(spec, block, where, "moe", "experts_class", names.experts):
                _swap(block, path, experts)
        parts.mlps.append(moe.get_submodule(mlp_slot))
    if dense is not None:
        try:
            parts.mlps.insert(0, dense.get_submodule(mlp_slot))
        except AttributeError as exc:
            raise KadaptError(f"{layers_path}.0 has no {mlp_slot!r} MLP like the MoE layer's") from exc
        for p in parts.mlps[0].parameters():
            group_of[id(p)] = "dense_mlp"
    for index, layer in ((0, dense), (t.n_dense_layers, moe)):
        if layer is None:
            continue
        for path, inner in _find(
            spec, layer, f"{layers_path}.{index}", "mla", "attention_class", names.attention
        ):
            mla = RankMLA(inner, rec, dep, kv_bytes)
            _swap(layer, path, mla)
            parts.attention.append(mla)
            for child_name, child in mla.named_children():
                for p in child.parameters():
                    group_of[id(p)] = f"attn.{child_name}"

    for name, part in parts.named():
        for _, param in part.named_parameters(prefix=name):
            group = groups.get(group_of.get(id(param), ""))
            rec.mark_weight(param, policy(group) if group else NATIVE["bf16"])
    return parts, notes


def trace_rank(spec: Spec, t: TextArch, dep: Deployment, policy: Policy) -> tuple[Recorder, list[str]]:
    """Run one step of the per-rank model on meta; return the recorder holding every op and notes."""
    names = declared_classes(spec, t)
    rec = Recorder()
    par = dep.parallel
    with applied(spec, backend=BACKEND), torch.device("meta"):
        model, notes = build_rank(spec, t, dep, rec, policy, names)
        b, s = dep.batch_per_rank, dep.tokens_per_query
        input_ids = torch.zeros(b, s, dtype=torch.long)
        positions = torch.arange(dep.context_len, dep.context_len + s).unsqueeze(0).expand(b, s)
        for name, part in model.named():
            rec.hook(part, name)
        hidden_bytes = b * s * t.hidden * 2
        _all_reduce = {"collective": "all_reduce", "bytes": hidden_bytes, "group": par.tp}

        def tp_all_reduce(_module: nn.Module, _args: Any, _out: Any) -> None:
            rec.analytic("tp_all_reduce", "comm", comm=_all_reduce)

        if par.tp > 1:
            for module in (*model.attention, *model.mlps):
                module.register_forward_hook(tp_all_reduce)

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
            if dep.mtp and model.moe_layer is not None and model.eh_proj is not None:
                with rec.scope("mtp", dep.mtp):  # one DeepSeek-style MTP block per drafted token
                    draft_in = hidden[:, -1:, :]
                    draft = model.eh_proj(
                        torch.cat([draft_in, model.embed_tokens(input_ids[:, -1:])], dim=-1)
                    )
                    draft = model.moe_layer(
                        draft, position_embeddings=(cos_sin[0][:, -1:], cos_sin[1][:, -1:])
                    )
                    _logits(model, rec, model.norm(draft), par.tp, t.vocab)
    return rec, notes


def _logits(model: RankParts, rec: Recorder, hidden: torch.Tensor, tp: int, vocab: int) -> None:
    model.lm_head(hidden)
    if tp > 1:
        tokens = hidden.shape[0] * hidden.shape[1]
        rec.analytic(
            "tp_all_gather(logits)",
            "comm",
            comm={"collective": "all_gather", "bytes": tokens * vocab * 2, "group": tp},
        )
