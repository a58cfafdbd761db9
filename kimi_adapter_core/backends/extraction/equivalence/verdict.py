"""What a verify found: every check with its figures, and whether the saved files equal transformers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class VerifyReport:
    kv_layout: str
    tolerance: float  # float32: fraction of each row's largest |logit|
    mla_attention: str = "reexpand"
    attention_label: str = ""
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tokens_ir: list[list[int]] = field(default_factory=list)
    tokens_reference: list[list[int]] = field(default_factory=list)
    max_logit_diff: float = 0.0
    seconds: float = 0.0
    tolerance_ulps: float | None = None  # bfloat16/float16: ulps at each row's largest |logit| (if run)
    # where the replay first departs from transformers (graph, layer, output), found once a text
    # prompt's logits or tokens check failed; None on a pass
    first_departure: str | None = None

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(check.passed for check in self.checks)

    def add(self, name: str, passed: bool, detail: str) -> None:
        self.checks.append(Check(name, bool(passed), detail))

    def render(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        ulps = "" if self.tolerance_ulps is None else f", {self.tolerance_ulps:g} ulps in low precision"
        lines = [
            f"verify ({self.attention_label}, tolerance {self.tolerance:g} x |logit| in float32{ulps}): "
            f"{verdict} in {self.seconds:.1f} s"
        ]
        lines += [f"  [{'ok' if c.passed else 'FAIL'}] {c.name}: {c.detail}" for c in self.checks]
        if self.first_departure is not None:
            lines.append(f"  first departure: {self.first_departure}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "kv_layout": self.kv_layout,
            "mla_attention": self.mla_attention,
            "tolerance": self.tolerance,
            "tolerance_ulps": self.tolerance_ulps,
            "max_logit_diff": self.max_logit_diff,
            "tokens_ir": self.tokens_ir,
            "tokens_reference": self.tokens_reference,
            "checks": [dataclasses.asdict(c) for c in self.checks],
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
            **({"first_departure": self.first_departure} if self.first_departure is not None else {}),
        }
