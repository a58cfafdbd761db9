"""The parallel layout of a deployment and the divisibility rules it must satisfy.

Devices = TP x DP. Attention, dense MLP and shared experts are sharded TP-ways and replicated over DP
groups; routed experts are sharded EP-ways over the devices (EP must divide TP x DP); embeddings and
lm_head are vocab-parallel over TP. ``--batch`` is the global number of concurrent queries, split
evenly over the DP groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UsageError
from .arch import TextArch


@dataclass(frozen=True)
class Parallel:
    tp: int = 1
    dp: int = 1
    ep: int = 1

    @property
    def devices(self) -> int:
        return self.tp * self.dp

    def check(self, t: TextArch) -> None:
        """Raise ``UsageError`` naming the first size that does not divide."""
        for name, value in (("--tp", self.tp), ("--dp", self.dp), ("--ep", self.ep)):
            if value < 1:
                raise UsageError(f"{name} must be >= 1 (got {value})")
        rules = [
            (t.num_heads, self.tp, f"--tp {self.tp} does not divide the {t.num_heads} attention heads"),
            (t.intermediate, self.tp, f"--tp {self.tp} does not divide the dense MLP width {t.intermediate}"),
            (
                self.devices,
                self.ep,
                f"--ep {self.ep} does not divide the {self.devices} devices (tp {self.tp} x dp {self.dp})",
            ),
        ]
        if t.n_routed_experts:
            rules += [
                (
                    t.n_routed_experts,
                    self.ep,
                    f"--ep {self.ep} does not divide the {t.n_routed_experts} routed experts",
                ),
                (
                    t.moe_intermediate * t.n_shared_experts,
                    self.tp,
                    f"--tp {self.tp} does not divide the shared-expert width "
                    f"{t.moe_intermediate * t.n_shared_experts}",
                ),
            ]
        elif self.ep > 1:
            raise UsageError(f"--ep {self.ep} given but the model has no routed experts")
        for whole, part, message in rules:
            if whole % part:
                raise UsageError(message)

    def split_batch(self, batch: int) -> int:
        if batch < 1:
            raise UsageError(f"--batch must be >= 1 (got {batch})")
        if batch % self.dp:
            raise UsageError(f"--batch {batch} does not split evenly over --dp {self.dp} groups")
        return batch // self.dp
