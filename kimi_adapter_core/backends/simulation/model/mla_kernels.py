"""The simulated MLA attention of one rank: DeepSeek's latent attention and, for DSA layers, its indexer.

``RankMLA`` stands in for the model's MLA attention while a rank is traced: it runs the attention's
own projections and rope helper around kadapt's analytic attention kernels (dense, or sparse over
the indexer's top-k keys after the indexer's projections, scoring and top-k)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .... import upstream
from ....errors import KadaptError
from .deployment import Deployment
from .quant import DTYPE_BYTES, INDEX_KEY_DTYPE, index_key_bytes, sparse_fp8_latent_bytes
from .rank_config import LayerKind
from .serving_kernels import attended_pairs, attention_attrs, mean_of
from .tracer import Recorder

_INDEXER_PARTS = ("wq_b", "wk", "k_norm", "weights_proj")


_INDEXER_SIZES = ("n_heads", "head_dim", "index_topk")


def _indexer_sizes(inner: nn.Module, kind: LayerKind) -> tuple[int, int, int] | None:
    """(heads, head_dim, top-k) of the DSA indexer of an ``indexed`` layer's attention (transformers'
    ``DeepseekV32Indexer`` names, adopted as the module's ``indexer`` child); a layer that reuses an
    earlier one's top-k (``topk_reuse``: it has no indexer) the config's sizes of that indexer; None in
    other layers."""
    if kind.mixer == "topk_reuse":
        config = getattr(inner, "config", None)
        sizes = [getattr(config, key, None) for key in ("index_n_heads", "index_head_dim", "index_topk")]
        if any(not isinstance(size, int) for size in sizes):
            raise KadaptError(
                f"layer {kind.index} attends over an earlier layer's DSA top-k, but its attention "
                f"{type(inner).__name__}'s config states no index_n_heads, index_head_dim and index_topk"
            )
        return sizes[0], sizes[1], sizes[2]
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
        # the class's own rope helper: the interleaved one where the config says so (DeepSeek's
        # rope_interleave) or where the module defines no other (GLM-5 always interleaves)
        interleave = bool(getattr(getattr(inner, "config", None), "rope_interleave", False))
        helpers = ("apply_rotary_pos_emb_interleave", "apply_rotary_pos_emb")
        module = inspect.getmodule(type(inner))
        found = [name for name in (helpers if interleave else helpers[::-1]) if hasattr(module, name)]
        # none: a NoPE MLA (Kimi-Linear), which must then be given no position embeddings
        self.rotate = getattr(module, found[0]) if found else None
        self.missing_rope = (
            f"the module defining mla.attention_class {cls} has none of {', '.join(helpers)}()"
        )
        self.adopted = type(inner)  # the spec's attention class, whose projections this module runs
        # GLM-5's attention also returns its top-k, which its decoder layer hands on to the next layer
        self.returns_topk = "prev_topk_indices" in inspect.signature(type(inner).forward).parameters
        self.q_lora_rank = inner.q_lora_rank
        self.heads, self.nope, self.rope = inner.num_heads, inner.qk_nope_head_dim, inner.qk_rope_head_dim
        self.v_dim, self.rank = inner.v_head_dim, inner.kv_lora_rank
        self.kind = kind
        self.index = _indexer_sizes(inner, kind)  # (heads, head_dim, top-k) of a DSA layer, else None
        # whether it scores its own indexer keys (a layer reusing an earlier one's top-k does not)
        self.scores = kind.mixer == "indexed"
        self.bind(rec, dep)

    def bind(self, rec: Recorder, dep: Deployment) -> None:
        """Record the next forward into ``rec`` at the shapes of ``dep`` (a built model is traced again)."""
        self.rec, self.dep = rec, dep

    @property
    def kv_bytes(self) -> float:
        return DTYPE_BYTES[self.dep.kv_dtype]

    @property
    def latent_token_bytes(self) -> float:
        """Bytes of one token's cached latent + rope key in this layer: a DSA layer's FP8 cache is
        FlashMLA's sparse FP8 layout (what the planner sizes), any other the KV dtype's elements."""
        if self.index is not None and self.dep.kv_dtype == INDEX_KEY_DTYPE:
            return sparse_fp8_latent_bytes(self.rank, self.rope)
        return (self.rank + self.rope) * self.kv_bytes

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
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
        if position_embeddings is not None:  # None: a NoPE stack, the rope dims stay as projected
            if self.rotate is None:
                raise KadaptError(self.missing_rope)
            cos, sin = position_embeddings
            q_rot, k_rot = self.rotate(q_rot, k_rot, cos, sin)
        context = self.dep.context_len + s
        cache_write = b * s * self.latent_token_bytes
        if self.index is not None:  # DSA: the indexer picks each query's top-k keys, in both phases
            if self.scores:
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
        if self.returns_topk:  # the selection's shape: the decoder layer only hands it on
            topk = self.index[2] if self.index is not None else 1
            return out, None, hidden_states.new_empty((b, s, topk), dtype=torch.int32)
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
        attrs = attention_attrs("dsa_indexer", self.dep, b, s, self.heads, keys_read) | self._dsa_attrs(
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
        kv_read = min(selected, b * context) * self.latent_token_bytes
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
            attrs=attention_attrs("dsa", self.dep, b, s, heads, kv_read) | self._dsa_attrs(scored, selected),
        )

    def _dense_latent(
        self, q_latent: torch.Tensor, q_rot: torch.Tensor, b: int, s: int, context: int, cache_write: int
    ) -> None:
        """FlashMLA's decode kernel over the whole (window-capped) latent cache."""
        heads, rope, rank = self.heads, self.rope, self.rank
        reads = [min(context, w or context) for w in self.kind.windows]
        pairs = mean_of([b * heads * s * r for r in reads])
        kv_read = mean_of([b * r * self.latent_token_bytes for r in reads])
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
            attrs=attention_attrs("mla", self.dep, b, s, heads, kv_read),
        )

    def _prefill(self, kv_nope: torch.Tensor, b: int, s: int, context: int, cache_write: int) -> torch.Tensor:
        """Prefill: expand cached + new latents to per-head K/V, then one fused causal attention."""
        heads, qk, v_dim, rank = self.heads, self.nope + self.rope, self.v_dim, self.rank
        latent = kv_nope.new_empty(b, context, rank)  # cache + new tokens; the read is charged to kv_b_proj
        self.kv_b_proj(latent)
        past = context - s
        pairs = mean_of([b * heads * attended_pairs(past, s, w) for w in self.kind.windows])
        keys = mean_of([min(past, w or past) + s for w in self.kind.windows])
        kv_read = 2 * b * keys * heads * (qk + v_dim)
        self.rec.analytic(
            "flash_attention_prefill",
            "attention",
            flops=2 * pairs * qk + 2 * pairs * v_dim,
            nbytes=2 * (b * s * heads * qk + b * s * heads * v_dim) + kv_read + cache_write,
            shapes=f"B{b} H{heads} q{s} ctx{context}",
            attrs=attention_attrs("mla", self.dep, b, s, heads, kv_read),
        )
        return kv_nope.new_empty(b, s, heads * v_dim)
