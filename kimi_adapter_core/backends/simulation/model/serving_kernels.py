"""The kernels a serving runtime runs, standing in for the eager Hugging Face code of a traced layer.

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
  ``[num_experts, ...]`` expert weights) is swapped for ``RoutedExperts``, priced analytically as
  grouped GEMMs over a balanced token split (each rank computes tokens*top_k/TP token-expert pairs),
  with the weight bytes of the experts actually touched, and the EP dispatch + combine around them
  when the EP group spans more than one TP group; the deployment's routing (uniform or power-law)
  scales it in ``cost.py``.

Each is bound to a recorder and a deployment per trace (``bind``), so one built model is traced
again at any shape. Separate from ``rank_model``, which finds the modules to replace and runs the
step: these are the pricing of one kernel each, and the sweep re-runs ``RoutedExperts`` on its own
per configuration (``search/scaling``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .... import upstream
from ....errors import KadaptError
from ....structure.model import ModelStructure
from .deployment import Deployment
from .parallel import heads_per_rank, kv_heads_per_rank
from .quant import DTYPE_BYTES, INDEX_KEY_DTYPE, WeightFormat, index_key_bytes
from .rank_config import LayerKind
from .tracer import Recorder

_HEAD_FACTS = ("num_heads", "num_kv_heads", "head_dim")


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


_INDEXER_PARTS = ("wq_b", "wk", "k_norm", "weights_proj")
_INDEXER_SIZES = ("n_heads", "head_dim", "index_topk")


def _indexer_sizes(inner: nn.Module, kind: LayerKind) -> tuple[int, int, int] | None:
    """(heads, head_dim, top-k) of the DSA indexer of an ``indexed`` layer's attention (transformers'
    ``DeepseekV32Indexer`` names, adopted as the module's ``indexer`` child); None in other layers."""
    if kind.mixer != "indexed":
        return None
    indexer = getattr(inner, "indexer", None)
    needed = (*_INDEXER_PARTS, *_INDEXER_SIZES)
    if indexer is None or any(not hasattr(indexer, n) for n in needed) or inner.q_lora_rank is None:
        raise KadaptError(
            f"layer {kind.index} is a DSA layer, but its attention {type(inner).__name__} has no indexer "
            f"simulate can price: it needs an `indexer` child with {', '.join(needed)} (transformers' "
            "DeepseekV32Indexer) fed by the MLA query residual (q_lora_rank)"
        )
    return int(indexer.n_heads), int(indexer.head_dim), int(indexer.index_topk)


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
        self.index = _indexer_sizes(inner, kind)  # (heads, head_dim, top-k) of a DSA layer, else None
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
        q_resid = None
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
            q = self.q_b_proj(q_resid)
        q = q.view(b, s, heads, nope + rope).transpose(1, 2)
        q_nope, q_rot = torch.split(q, [nope, rope], dim=-1)
        kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope)
        k_rot = k_rot.view(b, 1, s, rope)
        cos, sin = position_embeddings
        q_rot, k_rot = self.rotate(q_rot, k_rot, cos, sin)
        context = self.dep.context_len + s
        cache_write = b * s * (rank + rope) * self.kv_bytes
        if self.index is not None:  # DSA: the indexer picks each query's top-k keys, in both phases
            assert q_resid is not None  # ``_indexer_sizes`` refuses an indexer without the query residual
            self._index(hidden_states, q_resid, b, s, context)
            if self.dep.decode or not self._masked_mha_cheaper(b, s, context):
                out = self._absorbed(q_nope, q_rot, b, s, context, cache_write, topk=self.index[2])
            else:
                out = self._prefill(kv_nope, b, s, context, cache_write)
        elif self.dep.decode:
            out = self._absorbed(q_nope, q_rot, b, s, context, cache_write)
        else:
            out = self._prefill(kv_nope, b, s, context, cache_write)
        out = self.o_proj(out)
        self._note_module_gemms(first, b * s, hidden)
        return out, None

    def _dsa_attrs(self, scored: int, selected: int) -> dict[str, Any]:
        """What the measured cost model keys a DSA kernel by, beside the attention attributes: the
        sizes AIConfigurator's DSA architectures are told apart by, and the pairs scored / attended."""
        assert self.index is not None
        heads, dim, topk = self.index
        sizes = {"index_heads": heads, "index_dim": dim, "topk": topk}
        return sizes | {
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.rank,
            "scored": scored,
            "selected": selected,
        }

    def _masked_mha_cheaper(self, b: int, s: int, context: int) -> bool:
        """Whether a DSA prefill runs DeepSeek's masked MHA mode (the dense expanded prefill, the top-k
        as a mask) rather than sparse MQA over the latents: the mode of fewer FLOPs, as DeepSeek runs
        short prompts (and SGLang's DSA prefill picks dense below 2,048 tokens). A sparse pair costs
        ``2 (2 kv_lora + rope)`` FLOPs against the expanded form's ``2 (qk + v)``, so the sparse kernel
        wins once a query sees ~3.4x its top-k (DeepSeek-V3.2: from ~14k-token prompts)."""
        assert self.index is not None
        heads, nope, rope, v_dim, rank = self.heads, self.nope, self.rope, self.v_dim, self.rank
        past, topk = context - s, self.index[2]
        expand = 2 * b * context * rank * heads * (nope + v_dim)  # kv_b over cached + new latents
        dense = 2 * b * heads * attended_pairs(past, s, None) * (nope + rope + v_dim) + expand
        absorb = 2 * b * s * heads * rank * (nope + v_dim)  # W_UK into q, W_UV out of the latent output
        sparse = 2 * b * heads * attended_pairs(past, s, topk) * (2 * rank + rope) + absorb
        return dense <= sparse

    def _index(
        self, hidden_states: torch.Tensor, q_resid: torch.Tensor, b: int, s: int, context: int
    ) -> None:
        """The DSA indexer: its projections run as the model's own (traced: ``wq_b`` from the query
        residual, ``wk`` and its LayerNorm, ``weights_proj``), then the scoring of every visible key
        (DeepGEMM's fp8 MQA logits: ``sum_h w_h relu(q_h . k)``, FP8 on the tensor cores) and the
        top-k of each query's scores. Replicated over TP, as vLLM and SGLang run it: every rank scores
        all the indexer heads for its tokens."""
        assert self.index is not None
        heads, dim, topk = self.index
        indexer = self.indexer
        indexer.wq_b(q_resid)
        indexer.k_norm(indexer.wk(hidden_states))
        indexer.weights_proj(hidden_states)
        past, key = context - s, index_key_bytes(dim)
        scored = b * attended_pairs(past, s, None)  # (query, key) pairs: every visible key, causal
        selected = b * attended_pairs(past, s, topk)
        keys_read = b * context * key  # each sequence's keys once (its new queries share the read)
        attrs = _attention_attrs("dsa_indexer", self.dep, b, s, self.heads, keys_read) | self._dsa_attrs(
            scored, selected
        )
        queries = b * s * heads * (dim * DTYPE_BYTES[INDEX_KEY_DTYPE] + 4)  # FP8 q, an fp32 weight per head
        self.rec.analytic(
            "indexer_logits",
            "attention",
            flops=2 * scored * heads * dim + 3 * scored * heads,  # q.k, relu, x weight, sum over heads
            nbytes=keys_read + b * s * key + queries + scored * 4,  # keys, new keys written, fp32 logits
            compute=INDEX_KEY_DTYPE,
            shapes=f"B{b} Hi{heads}x{dim} q{s} ctx{context}",
            attrs=attrs,
        )
        self.rec.analytic(
            "indexer_topk",
            "attention",
            flops=scored,
            nbytes=scored * 4 + selected * 4,  # the logits read, the int32 indices written
            compute="vector",
            shapes=f"B{b} q{s} ctx{context} top{topk}",
            attrs=attrs | {"kernel": "dsa_topk"},
        )

    def _note_module_gemms(self, first: int, tokens: int, hidden: int) -> None:
        """Give the attention kernel the GEMMs of this call that SGLang's attention-DP MLA module runs
        around it (q_b / kv_b / o projections and the absorbed bmm, not the shared q_a + kv_a
        downscale): AIConfigurator measures that module whole, and the measured cost model prices
        the kernel as the module's row less these GEMMs, which it prices on their own. Each is
        ``(tag, n, k, kernel, batch, rows)``, ``rows`` saying whether its M is the new tokens or the
        whole context, so the description does not change with the batch (a sweep scales traces).
        Also the module's ``hidden`` size: a module measured whole (vLLM's) was measured at one."""
        ops = self.rec.ops[first:]
        # AIConfigurator's DSA module holds every GEMM of the attention (q_a / kv_a, the indexer's too)
        inside = (".q_proj", ".q_b_proj", ".kv_b_proj", ".o_proj") if self.index is None else ("",)
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
        self,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        b: int,
        s: int,
        context: int,
        cache_write: int,
        topk: int | None = None,
    ) -> torch.Tensor:
        """Decode: fold W_UK into q and W_UV into the output; attend over the 576-wide latent cache. A
        DSA layer (``topk``) runs this form in prefill too, over each query's top-k latents only."""
        heads, nope, v_dim, rank = self.heads, self.nope, self.v_dim, self.rank
        w = self.kv_b_proj.weight.view(heads, nope + v_dim, rank)
        q_h = q_nope.permute(1, 0, 2, 3).reshape(heads, b * s, nope)
        with self.rec.tagged("mla_bmm_pre"):
            q_latent = torch.bmm(q_h, w[:, :nope, :])  # [H, B*S, kv_lora]
        if topk is None:
            self._dense_latent(q_latent, q_rot, b, s, context, cache_write)
        else:
            self._sparse_latent(q_latent, q_rot, b, s, context, cache_write, topk)
        o_latent = q_latent.new_empty(heads, b * s, rank)
        with self.rec.tagged("mla_bmm_post"):
            out = torch.bmm(o_latent, w[:, nope:, :].transpose(1, 2))  # [H, B*S, v]
        return out.view(heads, b, s, v_dim).permute(1, 2, 0, 3).reshape(b, s, heads * v_dim)

    def _sparse_latent(
        self,
        q_latent: torch.Tensor,
        q_rot: torch.Tensor,
        b: int,
        s: int,
        context: int,
        cache_write: int,
        topk: int,
    ) -> None:
        """DSA's sparse MLA (FlashMLA's sparse kernels, decode and prefill alike): each query gathers
        only the ``min(topk, visible)`` latents its indexer picked, shared by the heads."""
        assert self.index is not None
        heads, rope, rank = self.heads, self.rope, self.rank
        past = context - s
        selected = b * attended_pairs(past, s, topk)  # (query, key) pairs, each query's top-k at most
        pairs = heads * selected
        # HBM reads: each query's gathered rows, but a sequence's cache at most once (a prefill's
        # queries gather the same rows again, from L2)
        kv_read = min(selected, b * context) * (rank + rope) * self.kv_bytes
        scored = b * attended_pairs(past, s, None)
        self.rec.analytic(
            "sparse_mla_decode" if self.dep.decode else "sparse_mla_prefill",
            "attention",
            flops=2 * pairs * (rank + rope) + 2 * pairs * rank,
            nbytes=kv_read
            + q_latent.numel() * 2
            + q_rot.numel() * 2
            + heads * b * s * rank * 2
            + cache_write
            + selected * 4,  # the int32 indices
            shapes=f"B{b} H{heads} q{s} ctx{context} top{topk}",
            attrs=_attention_attrs("dsa", self.dep, b, s, heads, kv_read)
            | self._dsa_attrs(scored, selected),
        )

    def _dense_latent(
        self, q_latent: torch.Tensor, q_rot: torch.Tensor, b: int, s: int, context: int, cache_write: int
    ) -> None:
        """FlashMLA's decode kernel over the whole (window-capped) latent cache."""
        heads, rope, rank = self.heads, self.rope, self.rank
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
