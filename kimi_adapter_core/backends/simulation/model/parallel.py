"""The parallel layout of a deployment, the divisibility rules it must satisfy, and per-rank sizes.

Devices = TP x DP. Attention, dense MLP and shared experts are sharded TP-ways and replicated over DP
groups; routed experts are sharded EP-ways over the devices (EP must divide TP x DP); embeddings and
lm_head are vocab-parallel over TP. Query heads split over TP; KV heads split too, and once TP
exceeds them each rank holds one KV head (replicated TP / KV-heads times, as vLLM does); MLA's
latent cache has no heads and is replicated on every TP rank. A hybrid stack's linear-attention
heads (key and value) split over TP too, which must divide them. ``--batch`` is the global number of
concurrent queries, split evenly over the DP groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from ....errors import UsageError
from ....structure.mixer import VALUE_CONV_KINDS
from ....structure.model import Attention, ModelStructure


@dataclass(frozen=True)
class Parallel:
    tp: int = 1
    dp: int = 1
    ep: int = 1

    @property
    def devices(self) -> int:
        return self.tp * self.dp

    def check(self, s: ModelStructure) -> None:
        """Raise ``UsageError`` naming the first size that does not divide."""
        for name, value in (("--tp", self.tp), ("--dp", self.dp), ("--ep", self.ep)):
            if value < 1:
                raise UsageError(f"{name} must be >= 1 (got {value})")
        a = s.attention
        rules = [
            (a.num_heads, self.tp, f"--tp {self.tp} does not divide the {a.num_heads} attention heads"),
            (
                self.devices,
                self.ep,
                f"--ep {self.ep} does not divide the {self.devices} devices (tp {self.tp} x dp {self.dp})",
            ),
        ]
        if s.dense_layer_ids:
            rules.append(
                (
                    s.intermediate_size,
                    self.tp,
                    f"--tp {self.tp} does not divide the dense MLP width {s.intermediate_size}",
                )
            )
        if s.moe is not None and s.moe_layer_ids:
            rules.append(
                (
                    s.moe.num_experts,
                    self.ep,
                    f"--ep {self.ep} does not divide the {s.moe.num_experts} routed experts",
                )
            )
            if s.moe.shared_intermediate_size:
                width = s.moe.shared_intermediate_size
                rules.append(
                    (width, self.tp, f"--tp {self.tp} does not divide the shared-expert width {width}")
                )
        elif self.ep > 1:
            raise UsageError(f"--ep {self.ep} given but the model has no routed experts")
        if s.linear is not None:  # a linear layer's heads split over TP like vLLM's (never replicated)
            split = [(s.linear.num_value_heads, "value")]
            if s.linear.kind not in VALUE_CONV_KINDS:  # else one nominal B/C group, whole on every rank
                split.insert(0, (s.linear.num_key_heads, "key"))
            for heads, what in split:
                message = f"--tp {self.tp} does not divide the {heads} linear-attention {what} heads"
                rules.append((heads, self.tp, message))
        for whole, part, message in rules:
            if whole % part:
                raise UsageError(message)
        kv = a.num_kv_heads
        if not a.is_mla and kv % self.tp and self.tp % kv:
            raise UsageError(
                f"--tp {self.tp} neither divides the {kv} KV heads nor is a multiple of them "
                "(KV heads are split over TP ranks, or replicated once TP exceeds them)"
            )

    def split_batch(self, batch: int) -> int:
        if batch < 1:
            raise UsageError(f"--batch must be >= 1 (got {batch})")
        if batch % self.dp:
            raise UsageError(f"--batch {batch} does not split evenly over --dp {self.dp} groups")
        return batch // self.dp


def heads_per_rank(a: Attention, tp: int) -> int:
    return a.num_heads // tp


def kv_heads_per_rank(a: Attention, tp: int) -> int:
    """KV heads one TP rank holds: split while TP <= KV heads, then one (replicated) per rank.

    MLA keeps ``num_kv_heads == num_heads`` (the expanded view), so this is heads / TP there."""
    return max(1, a.num_kv_heads // tp)


def kv_elements_per_rank(a: Attention, layout: str, tp: int) -> int:
    """Elements one TP rank caches per token per layer in ``layout``: each cached head group is split
    like the heads (latent: one shared "head", replicated; heads: KV heads, replicated past TP = KV)."""
    (kh, kd), (vh, vd) = a.kv_dims(layout)
    return max(1, kh // tp) * kd + max(1, vh // tp) * vd
