"""The rotary embedding a structure states: one for every layer, one per layer type, or one per label.

transformers 5 keeps ``rope_parameters`` per layer type for families whose sliding and full layers
rotate differently (Gemma-3, OLMo-3: ``{"full_attention": {...}, "sliding_attention": {...}}``).
DeepSeek-V4 keys them by labels that are not layer types (``{"main", "compress"}``): the model's forward
hands every layer ``{label: (cos, sin)}`` of each label and each attention picks its own (sliding layers
``main``; the compressed kinds and their compressors ``compress``). Read by ``rope_of``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PER_LAYER_TYPE = "per_layer_type"  # Rope.type when the config keeps one rope per layer type
BY_LABEL = "by_label"  # Rope.type when it keeps one per label, every layer handed all of them


@dataclass(frozen=True)
class Rope:
    """The rotary embedding: one for every layer, one per layer type (Gemma-3, OLMo-3, ...), or one per
    label (DeepSeek-V4).

    Per layer type or label, ``type`` is ``PER_LAYER_TYPE`` or ``BY_LABEL``, ``theta`` None and
    ``by_layer_type`` holds each layer type's (or label's) own rope (with its scaling ``factor``),
    sorted by name so a config object and its raw JSON describe it alike. A layer type whose entry is
    null has no rope (``none``).
    """

    type: str  # default | yarn | llama3 | ... (transformers' rope_type), PER_LAYER_TYPE or BY_LABEL
    theta: float | None
    factor: float | None = None  # scaling factor; stated per layer type only
    by_layer_type: tuple[tuple[str, Rope], ...] = ()

    def describe(self) -> str:
        """``rope yarn`` for one rope; per layer type each one's type, factor and theta:
        ``rope linear x8 theta 1e6 (full_attention), default theta 1e4 (sliding_attention)``; per label
        the same after ``by label``, every layer handed all of them."""
        if not self.by_layer_type:
            return f"rope {self.type}"
        each = ", ".join(f"{rope._kind_text()} ({name})" for name, rope in self.by_layer_type)
        return f"rope by label (every layer takes each): {each}" if self.type == BY_LABEL else f"rope {each}"

    def _kind_text(self) -> str:
        factor = f" x{_number(self.factor)}" if self.factor is not None else ""
        theta = f" theta {_number(self.theta)}" if self.theta is not None else ""
        return f"{self.type}{factor}{theta}"

    def to_dict(self) -> dict[str, Any]:
        """``{"type", "theta"}``, plus ``by_layer_type`` (layer type -> its type, theta and factor) or
        ``by_label`` (label -> the same) when there are several; a ``factor`` only where the config sets
        one."""
        if not self.by_layer_type:
            return {"type": self.type, "theta": self.theta}
        return {
            "type": self.type,
            "theta": self.theta,
            "by_label" if self.type == BY_LABEL else "by_layer_type": {
                name: {
                    "type": rope.type,
                    "theta": rope.theta,
                    **({} if rope.factor is None else {"factor": rope.factor}),
                }
                for name, rope in self.by_layer_type
            },
        }


def _number(value: float) -> str:
    """A rope number as people write it: ``8``, ``0.5``, ``1e4``, ``1.5e5`` (``:g`` says ``1e+06``)."""
    if abs(value) < 1e4:
        return f"{value:g}"
    mantissa, exponent = f"{value:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
