"""Weight formats and the two policies that assign them: the checkpoint as shipped, or a --quant mode.

- ``checkpoint`` (the default): the spec's ``quantization`` schemes as declared (Kimi-K2.5: routed
  experts int4, group 32, bf16 scales, computed in bf16), every other tensor in its native dtype.
- a ``--quant`` mode (TensorCast's quantize-linear-action): every *linear* weight of the text model
  (MLA projections, dense MLP, shared and routed experts) takes the mode's format; router, norms,
  embeddings, lm_head and the vision tower keep their native dtype. W4 modes reuse the group size and
  scale dtype of the spec's 4-bit scheme when it declares one (else group 128, bf16 scales).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...errors import KadaptError
from ...spec.model import QuantScheme
from .params import ParamGroup

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class WeightFormat:
    """How one weight is stored and which unit multiplies it."""

    label: str
    bits: int
    group_size: int  # 0: no group scales
    scale_bytes: int
    compute: str  # peak-table key the matmul runs at: bf16 | int8 | fp32

    @property
    def bytes_per_param(self) -> float:
        scales = self.scale_bytes / self.group_size if self.group_size else 0.0
        return self.bits / 8 + scales


BF16 = WeightFormat("bf16", 16, 0, 0, "bf16")
FP32 = WeightFormat("fp32", 32, 0, 0, "fp32")
NATIVE = {"bf16": BF16, "fp32": FP32}

# (weight bits, activation bits) of each mode TensorCast names.
MODES: dict[str, tuple[int, int]] = {"BF16": (16, 16), "W8A8": (8, 8), "W4A8": (4, 8), "W4A16": (4, 16)}

Policy = Callable[[ParamGroup], WeightFormat]


def scheme_format(scheme: QuantScheme) -> WeightFormat:
    return WeightFormat(
        f"int{scheme.bits}/g{scheme.group_size}",
        scheme.bits,
        scheme.group_size,
        DTYPE_BYTES.get(scheme.scale_dtype.replace("bfloat16", "bf16").replace("float32", "fp32"), 2),
        "bf16",
    )


def mode_format(mode: str, schemes: Sequence[QuantScheme]) -> WeightFormat:
    w_bits, a_bits = MODES[mode]
    compute = "int8" if a_bits == 8 else "bf16"
    if w_bits == 16:
        return BF16
    if w_bits == 8:
        return WeightFormat(f"int8 ({mode})", 8, 0, 0, compute)
    four = next((s for s in schemes if s.bits == 4), None)
    group, scale = (four.group_size, scheme_format(four).scale_bytes) if four else (128, 2)
    return WeightFormat(f"int4/g{group} ({mode})", 4, group, scale, compute)


def checkpoint_policy(schemes: Sequence[QuantScheme]) -> Policy:
    """Formats as shipped: a group whose checkpoint name matches a scheme's glob takes that scheme."""

    def policy(group: ParamGroup) -> WeightFormat:
        for scheme in schemes:
            if fnmatch.fnmatchcase(group.checkpoint_name, scheme.modules):
                return scheme_format(scheme)
        return NATIVE[group.dtype]

    return policy


def mode_policy(mode: str, schemes: Sequence[QuantScheme]) -> Policy:
    fmt = mode_format(mode, schemes)

    def policy(group: ParamGroup) -> WeightFormat:
        is_text_linear = group.linear and not group.name.startswith(("vision", "projector"))
        return fmt if is_text_linear else NATIVE[group.dtype]

    return policy


def resolve_policy(quant: str | None, declared: Sequence[str], schemes: Sequence[QuantScheme]) -> Policy:
    """``quant`` None → the checkpoint; otherwise it must be one the spec's simulation backend declares."""
    if quant is None:
        return checkpoint_policy(schemes)
    mode = quant.upper()
    known = [m.upper() for m in declared]
    if mode not in known:
        raise KadaptError(
            f"quantization {quant!r} is not declared by this spec "
            f"(backends.simulation.quant_modes: {', '.join(declared) or 'none'})"
        )
    if mode not in MODES:
        raise KadaptError(
            f"quantization {quant!r} is declared by the spec but kadapt cannot price it "
            f"(supported: {', '.join(MODES)})"
        )
    return mode_policy(mode, schemes)
