"""The kernels a serving runtime runs, standing in for the eager Hugging Face code of a traced layer.

- Attention core. MHA/GQA/MQA: the model's own attention module runs (its projections, q/k norms,
  rope) and calls transformers' attention interface, which is pointed at ``AttentionKernel``: a
  fused attention priced analytically over the deployment's KV cache (``num_heads`` queries over
  ``num_kv_heads`` cached keys, each sliding layer capped at its window; a compressed layer,
  DeepSeek-V4's hca, also over its compressor's entries, one per closed window of ``rate`` tokens, a csa
  layer over the top-k of them its Lightning indexer picks, the indexer priced beside it).
  MLA: the module of the spec's ``mla.attention_class`` is swapped for ``RankMLA`` - decode uses the
  weight-absorbed form over the latent cache (FlashMLA-style), prefill expands the latent KV with
  ``kv_b_proj`` and runs a fused causal attention. It reads DeepSeek-style MLA fields (``num_heads``,
  ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``) and
  the rope helpers of the attention class's own module.
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

from typing import Any

import torch
from torch import nn

from ....errors import KadaptError
from ....structure.model import Compressor, ModelStructure
from .deployment import Deployment
from .parallel import heads_per_rank, kv_heads_per_rank
from .quant import DTYPE_BYTES, WeightFormat
from .rank_config import LayerKind
from .tracer import Recorder

_HEAD_FACTS = ("num_heads", "num_kv_heads", "head_dim")


def attended_pairs(past: int, new: int, window: int | None) -> int:
    """Query-key pairs of ``new`` causal queries after ``past`` cached tokens, each query seeing at
    most ``window`` keys (itself included)."""
    uncapped = new if window is None else max(0, min(new, window - past))
    pairs = uncapped * past + uncapped * (uncapped + 1) // 2
    return pairs + (new - uncapped) * (window or 0)


def chunked_pairs(past: int, new: int, chunk: int) -> int:
    """Query-key pairs of ``new`` queries after ``past`` tokens in chunked attention: the query at ``p``
    sees ``p % chunk + 1`` keys, the keys of its own chunk up to itself."""

    def upto(n: int) -> int:  # pairs of the queries at positions 0..n-1
        whole, rest = divmod(n, chunk)
        return whole * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2

    return upto(past + new) - upto(past)


def visible_keys(context: int, window: int | None, chunk: int | None) -> int:
    """Keys the newest of ``context`` tokens attends to (itself included): every one, the last ``window``,
    or in chunked attention its own chunk's ``p % chunk + 1``."""
    if chunk is not None:
        return (context - 1) % chunk + 1
    return min(context, window or context)


def prefill_pairs(past: int, new: int, window: int | None, chunk: int | None) -> int:
    """Query-key pairs of ``new`` causal queries after ``past`` tokens, by the layer's span."""
    return chunked_pairs(past, new, chunk) if chunk is not None else attended_pairs(past, new, window)


def prefill_keys(past: int, new: int, window: int | None, chunk: int | None) -> int:
    """Keys ``new`` queries after ``past`` tokens read at least once: the window-capped past, or the past
    of the first query's chunk (chunked attention), plus the new tokens."""
    kept = past % chunk if chunk is not None else min(past, window or past)
    return kept + new


def entry_pairs(past: int, new: int, rate: int, cap: int | None = None) -> int:
    """Query-entry pairs of ``new`` queries after ``past`` tokens over a compressor's entries (DeepSeek-V4's
    hca and csa layers): the query at ``p`` sees the ``(p + 1) // rate`` windows closed by then, a csa
    query at most ``cap`` of them (its indexer's top-k)."""

    def upto(n: int) -> int:  # sum of (q // rate) for q in 1..n
        whole, rest = divmod(n, rate)
        return rate * whole * (whole - 1) // 2 + whole * (rest + 1)

    def capped(n: int) -> int:  # sum of min(q // rate, cap) for q in 1..n
        if cap is None:
            return upto(n)
        below = cap * rate - 1  # q // rate < cap for q <= below
        return upto(min(n, below)) + cap * max(0, n - below)

    return capped(past + new) - capped(past)


def mean_of(values: list[float]) -> float:
    return sum(values) / len(values)


def attention_attrs(kind: str, dep: Deployment, b: int, s: int, heads: int, kv_read: float) -> dict[str, Any]:
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
        # the layout: AIConfigurator prices cross-node wide-EP MLA (attention DP, ``ep > tp``, EP
        # wider than a node) as a whole module
        "attention_dp": dep.parallel.dp,
        "ep": dep.parallel.ep,
        "tp": dep.parallel.tp,
        # expert TP across DP groups gathers the tokens: no all-to-all, whatever EP and TP are
        **({"all_to_all": False} if dep.parallel.moe_tp > 1 and dep.parallel.dp > 1 else {}),
    }


def price_csa_indexer(
    rec: Recorder, c: Compressor, b: int, s: int, past: int, key_bytes: int, decode: bool
) -> None:
    """A csa layer's Lightning indexer, priced from its formula (roofline: no measured kernel): every
    query scores each entry closed for it (``sum_h w_h relu(q_h . k)`` over ``n_heads`` heads of
    ``head_dim``) and keeps its top-k; replicated over TP like the compressor (one shared key head). Its
    projections and compressor run as the model's own (traced)."""
    assert c.indexer is not None
    heads, dim, topk = c.indexer.n_heads, c.indexer.head_dim, c.indexer.topk
    closed = (past + s) // c.rate
    scored = b * (s * closed if decode else entry_pairs(past, s, c.rate))  # (query, entry) pairs
    keys_read = b * closed * dim * key_bytes
    shapes = f"B{b} Hi{heads}x{dim} q{s} entries{closed} top{topk}"
    rec.analytic(
        "csa_indexer_logits",
        "attention",
        flops=2 * scored * heads * dim + 3 * scored * heads,  # q.k, relu, x weight, sum over heads
        nbytes=keys_read + b * s * heads * dim * key_bytes + scored * 4,  # keys, queries, fp32 logits
        shapes=shapes,
        attrs={"csa_indexer": "logits", "top_k": topk},
    )
    rec.analytic(
        "csa_indexer_topk",
        "attention",
        flops=scored,
        nbytes=scored * 4 + b * s * min(topk, closed) * 4,  # the logits read, the int32 picks written
        compute="vector",
        shapes=shapes,
        attrs={"csa_indexer": "topk", "top_k": topk},
    )


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
        # one token of this rank's cache (the key alone where the values are the keys: DeepSeek-V4)
        per_token = kv * (hd + (0 if kind.attention(self.s).value_is_key else vd)) * kvb
        write = b * s * per_token
        # a compressed layer also attends over its compressor's entries, one per closed window (a csa
        # layer over the top-k its indexer picks of them, priced beside it: ``price_csa_indexer``)
        compressor = self.s.compressors.get(kind.mixer)
        rate = compressor.rate if compressor is not None else None
        cap = compressor.indexer.topk if compressor is not None and compressor.indexer is not None else None
        if compressor is not None and compressor.indexer is not None:
            price_csa_indexer(self.rec, compressor, b, s, past, self.kv_bytes, self.dep.decode)
        if self.dep.decode:
            entries = compressor.attended((past + s) // rate) if compressor is not None and rate else 0
            reads = [visible_keys(past + s, w, c) + entries for w, c in kind.spans]
            pairs = mean_of([b * heads * s * r for r in reads])
            kv_read = mean_of([b * r * per_token for r in reads])
            nbytes = kv_read + 2 * b * s * heads * (hd + vd) + write
            name = "attention_decode"
        else:
            entries, entry_reads = (entry_pairs(past, s, rate, cap), (past + s) // rate) if rate else (0, 0)
            pairs = mean_of([b * heads * (prefill_pairs(past, s, w, c) + entries) for w, c in kind.spans])
            keys = mean_of([prefill_keys(past, s, w, c) + entry_reads for w, c in kind.spans])
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
            attrs=attention_attrs("gqa", self.dep, b, s, heads, kv_read)
            | {"kv_heads": kv, "head_dim": hd, "window": window},
        )
        return query.new_empty(b, s, heads, vd), None

    def _check(self, kind: LayerKind, heads: int, kv: int, hd: int, vd: int) -> None:
        a, tp = kind.attention(self.s), self.dep.parallel.tp
        want = (heads_per_rank(a, tp), kv_heads_per_rank(a, tp), a.head_dim, a.v_head_dim)
        if (heads, kv, hd, vd) != want:
            raise KadaptError(
                f"the per-rank attention of layer {kind.index} runs {heads} query / {kv} KV heads of "
                f"{hd}/{vd} dims, not the {want[0]} / {want[1]} x {want[2]}/{want[3]} that TP {tp} gives: "
                "its config class did not take the per-rank sizes kadapt wrote under the structure's keys "
                f"({', '.join(sorted(self.s.keys.get(f, f) for f in _HEAD_FACTS))})"
            )


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
    (DeepEP-style, see ``cost.py``).

    Expert TP (``moe_tp`` > 1): each rank holds ``1 / moe_tp`` of every local expert's intermediate
    width and runs every pair routed to its ``experts / ep`` experts (``tokens * top_k * moe_tp / tp``:
    the same FLOPs, the weights read ``moe_tp`` times narrower); its partial outputs are summed by the
    TP all-reduce after the MoE block where the MoE group is one TP group (``dp == 1``), else the DP
    groups' tokens are all-gathered before the experts and the partial outputs reduce-scattered back
    (SGLang's DP attention over TP-sharded experts, AIConfigurator's ``MoeDispatch`` at ``moe_tp``)."""

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
        # balanced split of every token-expert pair over the devices (EP only), or over the EP group
        # (expert TP: the moe_tp ranks sharing an expert each run all of its pairs, on their slice)
        pairs = tokens * moe.top_k * par.moe_tp / par.tp
        local = moe.num_experts // par.ep
        touched = local * (1 - (1 - 1 / local) ** pairs)  # expected experts hit by uniform routing
        width = moe.expert_intermediate_size // par.moe_tp  # this rank's slice of an expert's width
        per_expert = 3 * hidden * width
        gathered = par.moe_tp > 1 and par.dp > 1  # expert TP across DP groups: all-gather, reduce-scatter
        all_to_all = par.ep > par.tp and not gathered
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
            # the layout as the measured cost model keys it (AIConfigurator's fused graph inside a
            # node dispatches each attention-DP rank's tokens)
            "attention_dp": par.dp,
            "rank_tokens": tokens,
        }
        if gathered:  # every DP group's tokens reach every rank, one TP group's share from each
            comm |= {"ep": par.ep, "moe_tp": par.moe_tp, "group": par.dp}
            everyone = par.dp * tokens * hidden
            self.rec.analytic(
                "ep_dispatch(all_gather)",
                "comm",
                comm=comm | {"collective": "all_gather", "bytes": everyone * dispatch_bytes},
            )
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
                "decode": self.dep.decode,
                "hidden": hidden,
                "width": width,
                "top_k": moe.top_k,
                "experts": moe.num_experts,
                "ep": par.ep,
                **({"moe_tp": par.moe_tp} if par.moe_tp > 1 else {}),
            },
        )
        if gathered:
            self.rec.analytic(
                "ep_combine(reduce_scatter)",
                "comm",
                comm=comm | {"collective": "reduce_scatter", "bytes": everyone * 2},
            )
        if all_to_all:
            self.rec.analytic(
                "ep_combine(all_to_all)",
                "comm",
                comm=comm | {"bytes": sent * moe.top_k * hidden * 2, "token_bytes": hidden * 2},
            )
        return hidden_states
