"""The parallel layout of a deployment, the divisibility rules it must satisfy, and per-rank sizes.

Devices = TP x DP. Attention, dense MLP and shared experts are sharded TP-ways and replicated over DP
groups; routed experts are sharded EP-ways over the devices (EP must divide TP x DP), each whole on its
rank, or (expert TP, ``moe_tp`` > 1) EP-ways and each expert's intermediate width MoE-TP-ways, the
MoE group then spanning every device: MoE-TP x EP = TP x DP, AIConfigurator's rule for its
``moe_tp_size`` / ``moe_ep_size`` (vLLM's and SGLang's ``--tp`` without expert parallelism is
MoE-TP = TP; TensorRT-LLM's ``--ep_size`` below ``--tp_size`` is MoE-TP = TP / EP); embeddings and
lm_head are vocab-parallel over TP. Query heads split over TP; KV heads split too, and once TP
exceeds them each rank holds one KV head (replicated TP / KV-heads times, as vLLM does); MLA's
latent cache has no heads and is replicated on every TP rank. A hybrid stack's linear-attention
heads (key and value) split over TP too, which must divide them; a stack no layer of which attends
(Mamba) has no attention heads to divide. A refusal names the option and the config key the size was
read from. ``--batch`` is the global number of concurrent queries, split evenly over the DP groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ....errors import UsageError
from ....structure.linear_of import MIXERS
from ....structure.mixer import VALUE_CONV_KINDS
from ....structure.model import Attention, ModelStructure


@dataclass(frozen=True)
class Parallel:
    tp: int = 1
    dp: int = 1
    ep: int = 1
    moe_tp: int = 1  # expert TP: each rank holds 1/moe_tp of every local expert's intermediate width

    @property
    def devices(self) -> int:
        return self.tp * self.dp

    @property
    def moe_tp_label(self) -> str:
        """`` moe_tp=N`` for a report's layout line under expert TP (empty without: lines unchanged)."""
        return f" moe_tp={self.moe_tp}" if self.moe_tp > 1 else ""

    @property
    def moe_group(self) -> int:
        """Ranks sharing one set of routed experts' weights (EP x expert TP): each holds
        1 / ``moe_group`` of them and runs ``moe_tp / tp`` of a DP group's token-expert pairs."""
        return self.ep * self.moe_tp

    def check(self, s: ModelStructure) -> None:
        """Raise ``UsageError`` naming the first size that does not divide."""
        sizes = (("--tp", self.tp), ("--dp", self.dp), ("--ep", self.ep), ("--moe-tp", self.moe_tp))
        for name, value in sizes:
            if value < 1:
                raise UsageError(f"{name} must be >= 1 (got {value})")
        a, key = s.attention, _keys(s)
        # a stack no layer of which attends (Mamba, Falcon-Mamba) has a nominal attention of one head:
        # its mixers split by their own heads or channels (below), not by that head
        attends = bool(s.attention_layer_ids)
        rules = [
            (
                self.devices,
                self.ep,
                f"--ep {self.ep} does not divide the {self.devices} devices (tp {self.tp} x dp {self.dp})",
            ),
        ]
        if attends:
            heads = f"--tp {self.tp} does not divide the {a.num_heads} attention heads{key('num_heads')}"
            rules.insert(0, (a.num_heads, self.tp, heads))
            # then the query heads of layers with their own (dots3's sliding MLA layers), by each count's
            # first layer
            firsts: dict[int, int] = {}
            for layer in s.layers:
                if layer.attention_shape is not None:
                    firsts.setdefault(layer.attention_shape.num_heads, layer.index)
            rules[1:1] = [
                (
                    n,
                    self.tp,
                    f"--tp {self.tp} does not divide the {n} attention heads of layer {i} (its "
                    "per_layer_config)",
                )
                for n, i in firsts.items()
                if n != a.num_heads
            ]
        if s.dense_layer_ids:
            rules.append(
                (
                    s.intermediate_size,
                    self.tp,
                    f"--tp {self.tp} does not divide the dense MLP width {s.intermediate_size}"
                    f"{key('intermediate_size')}",
                )
            )
        if s.moe is not None and s.moe_layer_ids:
            if self.moe_tp > 1:
                self._check_expert_tp(s, key)
            rules.append(
                (
                    s.moe.num_experts,
                    self.ep,
                    f"--ep {self.ep} does not divide the {s.moe.num_experts} routed experts"
                    f"{key('num_experts')}",
                )
            )
            if s.moe.shared_intermediate_size:
                width = s.moe.shared_intermediate_size
                what = key("shared_expert_intermediate_size") or key("expert_intermediate_size")
                message = f"--tp {self.tp} does not divide the shared-expert width {width}{what}"
                rules.append((width, self.tp, message))
        elif self.ep > 1 or self.moe_tp > 1:
            given = f"--ep {self.ep}" if self.ep > 1 else f"--moe-tp {self.moe_tp}"
            raise UsageError(f"{given} given but the model has no routed experts")
        if s.linear is not None:  # a linear layer's heads split over TP like vLLM's (never replicated)
            facts = MIXERS.get(s.linear.kind, {})  # the fact each size is read from
            split = [(s.linear.num_value_heads, "value", facts.get("num_value_heads", ""))]
            if s.linear.kind not in VALUE_CONV_KINDS:  # else one nominal B/C group, whole on every rank
                split.insert(0, (s.linear.num_key_heads, "key", facts.get("num_key_heads", "")))
            for heads, what, fact in split:
                message = (
                    f"--tp {self.tp} does not divide the {heads} linear-attention {what} heads{key(fact)}"
                )
                rules.append((heads, self.tp, message))
        for whole, part, message in rules:
            if whole % part:
                raise UsageError(message)
        # the stack's KV heads, then those of layers with their own (Gemma-4's full layers, MiMo-V2-Flash's
        # sliding ones): TP divides each count or is a multiple of it
        kv_heads = [(a.num_kv_heads, key("num_kv_heads"))] if attends and not a.is_mla else []
        kv_heads += [
            (layer.attention_shape.num_kv_heads, f" of layer {layer.index}")
            for layer in s.layers
            if layer.attention_shape is not None and layer.attention_shape.num_kv_heads != a.num_kv_heads
        ]
        for kv, whose in kv_heads:
            if kv % self.tp and self.tp % kv:
                raise UsageError(
                    f"--tp {self.tp} neither divides the {kv} KV heads{whose} nor is a multiple of them "
                    "(KV heads are split over TP ranks, or replicated once TP exceeds them)"
                )

    def _check_expert_tp(self, s: ModelStructure, key: Callable[[str], str]) -> None:
        """Expert TP's own rules: MoE-TP x EP spans the TP x DP devices (AIConfigurator asserts it)
        and MoE-TP divides the expert width; a refusal lists the layouts that satisfy both."""
        assert s.moe is not None
        width, experts = s.moe.expert_intermediate_size, s.moe.num_experts
        valid = [
            f"--moe-tp {n} --ep {self.devices // n}"
            for n in range(2, self.devices + 1)
            if self.devices % n == 0 and width % n == 0 and experts % (self.devices // n) == 0
        ]
        choices = f"; valid at {self.devices} devices: {', '.join(valid)}" if valid else ""
        if width % self.moe_tp:
            raise UsageError(
                f"--moe-tp {self.moe_tp} does not divide the expert width {width}"
                f"{key('expert_intermediate_size')}{choices}"
            )
        if self.moe_tp * self.ep != self.devices:
            raise UsageError(
                f"--moe-tp {self.moe_tp} x --ep {self.ep} must equal the {self.devices} devices "
                f"(tp {self.tp} x dp {self.dp}): expert TP spans the MoE group over every device{choices}"
            )

    def split_batch(self, batch: int) -> int:
        if batch < 1:
            raise UsageError(f"--batch must be >= 1 (got {batch})")
        if batch % self.dp:
            raise UsageError(f"--batch {batch} does not split evenly over --dp {self.dp} groups")
        return batch // self.dp


def framework_moe_tp(s: ModelStructure, devices: int, ep: int) -> int:
    """The expert TP a framework runs when none is asked for: the devices ``ep`` leaves. vLLM's and
    SGLang's ``--tp`` without expert parallelism shard every expert's width over the TP group, and
    TensorRT-LLM's ``moe_tp_size`` defaults to ``tp_size // moe_ep_size``; none replicates whole experts
    on every device. 1 for a model without routed experts, where EP spans the devices or does not
    divide them, or where that size does not divide the expert width (the experts are then replicated,
    and ``simulate`` says so)."""
    if s.moe is None or not s.moe_layer_ids or ep >= devices or devices % ep:
        return 1
    size = devices // ep
    return size if s.moe.expert_intermediate_size % size == 0 else 1


def _keys(s: ModelStructure) -> Callable[[str], str]:
    """`` (config num_attention_heads)``: the config key a size was read from, for a refusal to name
    beside the option (empty for a fact the config states under no key: a nominal or derived size)."""

    def key(fact: str) -> str:
        name = s.keys.get(fact)
        return f" (config {name})" if name else ""

    return key


def heads_per_rank(a: Attention, tp: int) -> int:
    return a.num_heads // tp


def kv_heads_per_rank(a: Attention, tp: int) -> int:
    """KV heads one TP rank holds: split while TP <= KV heads, then one (replicated) per rank.

    MLA keeps ``num_kv_heads == num_heads`` (the expanded view), so this is heads / TP there."""
    return max(1, a.num_kv_heads // tp)


def kv_elements_per_rank(a: Attention, layout: str, tp: int, *, value_once: bool = False) -> int:
    """Elements one TP rank caches per token per layer in ``layout``: each cached head group is split
    like the heads (latent: one shared "head", replicated; heads: KV heads, replicated past TP = KV);
    ``value_once``: values that are the keys (``value_is_key``) counted once, as a runtime stores them."""
    (kh, kd), (vh, vd) = a.kv_dims(layout)
    return max(1, kh // tp) * kd + (0 if value_once and a.value_is_key else max(1, vh // tp) * vd)
