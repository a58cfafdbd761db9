"""A graph weight's type as both backends and the weight map spell it: shape and torch dtype name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int | str, ...]  # a str is a dynamic dimension's expression (``symbolic``)
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling torch_ir and safetensors use)."""
    return str(dtype).removeprefix("torch.")
