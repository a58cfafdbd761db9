"""The rotary embedding a structure states: one for every layer, one per layer type, or one per label.

transformers 5 keeps ``rope_parameters`` per layer type for families whose sliding and full layers
rotate differently (Gemma-3, OLMo-3: ``{"full_attention": {...}, "sliding_attention": {...}}``).
DeepSeek-V4 keys them by labels that are not layer types (``{"main", "compress"}``): the model's forward
hands every layer ``{label: (cos, sin)}`` of each label and each attention picks its own (sliding layers
``main``; the compressed kinds and their compressors ``compress``). Read by ``rope_of``.

Besides its type, a rope states what changes the positions it encodes, so that a plan or a simulation
reads as the model computes: the scaling ``factor`` and the context it was trained on
(``original_max_position_embeddings``: yarn, llama3), the share of each head it rotates
(``partial_rotary_factor``: 0.25 for Qwen3-Next, Qwen3.5 and Gemma-4's full layers) and the layers that
have no rope at all (Llama-4's NoPE layers).
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
    ``by_layer_type`` holds each layer type's (or label's) own rope, sorted by name so a config object
    and its raw JSON describe it alike. A layer type whose entry is null has no rope (``none``).
    ``factor``, ``original_positions`` and ``partial`` are None where the config leaves them out (no
    scaling, the whole head rotates); ``nope_layers`` are the layers that apply no rope at all.
    """

    type: str  # default | yarn | llama3 | ... (transformers' rope_type), PER_LAYER_TYPE or BY_LABEL
    theta: float | None
    factor: float | None = None  # scaling factor
    by_layer_type: tuple[tuple[str, Rope], ...] = ()
    original_positions: int | None = None  # the context the scaling stretches (yarn, llama3, longrope)
    partial: float | None = None  # the share of each head's width that rotates, below 1
    nope_layers: tuple[int, ...] = ()  # layers without rope (Llama-4's every 4th)

    def describe(self, num_layers: int | None = None) -> str:
        """``rope yarn x64 from 4096 positions`` (or ``rope default partial 0.25``) for one rope, its
        theta left to the JSON; per layer type each one's type, scaling and theta:
        ``rope linear x8 theta 1e6 (full_attention), default theta 1e4 (sliding_attention)``; per label
        the same after ``by label``, every layer handed all of them. NoPE layers follow, counted out of
        ``num_layers``: ``12/48 layers without rope [3, 7, ...]``."""
        if not self.by_layer_type:
            text = f"rope {self._kind_text(theta=False)}"
        else:
            each = ", ".join(f"{rope._kind_text()} ({name})" for name, rope in self.by_layer_type)
            text = (
                f"rope by label (every layer takes each): {each}" if self.type == BY_LABEL else f"rope {each}"
            )
        if self.nope_layers:
            count = f"{len(self.nope_layers)}/{num_layers}" if num_layers else f"{len(self.nope_layers)}"
            text += f", {count} layers without rope {list(self.nope_layers)}"
        return text

    def _kind_text(self, *, theta: bool = True) -> str:
        factor = f" x{_number(self.factor)}" if self.factor is not None else ""
        original = f" from {self.original_positions} positions" if self.original_positions is not None else ""
        partial = f" partial {_number(self.partial)}" if self.partial is not None else ""
        stated = f" theta {_number(self.theta)}" if theta and self.theta is not None else ""
        return f"{self.type}{factor}{original}{partial}{stated}"

    def to_dict(self) -> dict[str, Any]:
        """``{"type", "theta"}``, plus ``by_layer_type`` (layer type -> its type, theta and scaling) or
        ``by_label`` (label -> the same) when there are several; ``factor``,
        ``original_max_position_embeddings``, ``partial_rotary_factor`` and ``nope_layers`` only where
        the config sets them (a plain rope's document is as it was)."""
        data = {"type": self.type, "theta": self.theta}
        if not self.by_layer_type:
            data.update(self._scaling())
        else:
            data["by_label" if self.type == BY_LABEL else "by_layer_type"] = {
                name: {"type": rope.type, "theta": rope.theta, **rope._scaling()}
                for name, rope in self.by_layer_type
            }
        if self.nope_layers:
            data["nope_layers"] = list(self.nope_layers)
        return data

    def _scaling(self) -> dict[str, Any]:
        stated = {
            "factor": self.factor,
            "original_max_position_embeddings": self.original_positions,
            "partial_rotary_factor": self.partial,
        }
        return {key: value for key, value in stated.items() if value is not None}


def _number(value: float) -> str:
    """A rope number as people write it: ``8``, ``0.5``, ``1e4``, ``1.5e5`` (``:g`` says ``1e+06``)."""
    if abs(value) < 1e4:
        return f"{value:g}"
    mantissa, exponent = f"{value:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
