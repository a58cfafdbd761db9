"""How a sweep's report names the weights and the KV cache of each priced point.

A front row that says only ``checkpoint`` or ``W8A8`` hides what was priced: DeepSeek-V3's
checkpoint is FP8 with 128x128 block scales, and a sweep free to pick W8A8 beats it without saying
that nobody ships those weights. Each row therefore names the mode it priced, the format the
checkpoint ships (``shipped_label``: what the config's ``quantization_config`` stores, by the rule
``plan`` and ``simulate`` size with) and the KV-cache dtype. Separate from the report so that the
step sweep and the request search label rows alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.inputs import ModelInputs
from ..model.quant import is_text_linear


def shipped_label(inputs: ModelInputs) -> str:
    """The formats of the text model's linear weights under ``inputs``' policy, the largest share first:
    ``fp8/b128x128`` (DeepSeek-V3), ``int4/g32 routed_experts, bf16 other linear`` (Kimi-K2.5),
    ``bf16`` (Llama). Router, norms, embeddings and the head are left out: no mode re-formats them."""
    shares: dict[str, dict[str, int]] = {}  # format label -> group -> parameters
    for group in inputs.groups:
        if not is_text_linear(group):
            continue
        for name, params in group.tensors():
            by_group = shares.setdefault(inputs.policy(group, name).label, {})
            by_group[group.name] = by_group.get(group.name, 0) + params
    if not shares:
        return "native"
    ordered = sorted(shares.items(), key=lambda kv: -sum(kv[1].values()))
    if len(ordered) == 1:
        return ordered[0][0]
    named = [f"{label} {', '.join(groups)}" for label, groups in ordered[:-1]]
    return ", ".join([*named, f"{ordered[-1][0]} other linear"])


@dataclass(frozen=True)
class WeightModes:
    """The weight modes one sweep priced and the checkpoint's own format: what each row says."""

    shipped: str  # the checkpoint's formats (``shipped_label``)
    quants: tuple[str | None, ...]  # the modes priced (None: the checkpoint as shipped)
    declared: tuple[str, ...]  # the spec's priced quant_modes (what --quant all adds)
    formats: dict[str | None, str]  # mode -> its formats (``shipped_label`` of its inputs)

    def as_shipped(self, quant: str | None) -> bool:
        """``quant`` stores the weights as the checkpoint does (Llama's BF16 mode does)."""
        return self.formats[quant] == self.shipped

    @property
    def only_shipped(self) -> bool:
        """Only the checkpoint as shipped was priced (no other mode could be chosen)."""
        return self.quants == (None,)

    def label(self, quant: str | None) -> str:
        """A row's weights: the mode priced, the checkpoint's format marked as shipped."""
        return f"{self.shipped} (shipped)" if quant is None else quant

    def row(self, quant: str | None, kv_dtype: str) -> dict[str, object]:
        """The JSON fields every priced point carries about its weights and KV cache."""
        return {
            "quantization": quant or "checkpoint",
            "weights": self.label(quant),
            "weight_format": self.formats[quant],
            "weights_as_shipped": self.as_shipped(quant),
            "shipped_weights": self.shipped,
            "kv_dtype": kv_dtype,
        }

    def summary(self) -> str:
        """One line for the text report: what was priced and what else could have been."""
        if self.only_shipped:
            declared = ", ".join(self.declared)
            more = f"; --quant all also prices the spec's quant_modes ({declared})" if declared else ""
            return f"weights: the checkpoint as shipped ({self.shipped}){more}"
        modes = ", ".join("checkpoint" if q is None else q for q in self.quants)
        return f"weights: {modes} priced; the checkpoint ships {self.shipped}"
