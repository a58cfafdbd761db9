"""Weight formats and the two policies that assign them: the checkpoint as shipped, or a --quant mode.

- ``checkpoint`` (the default): the spec's ``quantization`` schemes as declared, matched against
  each tensor's checkpoint name (Kimi-K2.5: routed experts int4, group 32, bf16 scales, computed in
  bf16); then the config's own ``quantization_config`` when it is a block-scaled FP8 checkpoint
  (DeepSeek-V3: every linear weight of the text model FP8 e4m3 with one fp32 scale per 128x128
  block, computed at the FP8 peak), or MXFP4 (gpt-oss: routed experts 4-bit e2m1 with one e8m0
  scale per 32 weights, computed in bf16); every other tensor in its native dtype. A scheme whose glob
  matches no tensor of the model is an error located at the scheme.
- a ``--quant`` mode (TensorCast's quantize-linear-action): every *linear* weight of the text model
  (attention projections, dense MLP, shared and routed experts) takes the mode's format; router,
  norms, embeddings, lm_head and the vision tower keep their native dtype. W4 modes reuse the group
  size and scale dtype of the spec's 4-bit scheme when it declares one (else group 128, bf16 scales).
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import KadaptError, UsageError
from ...spec.model import QuantScheme, Spec
from ..extraction.checkpoint_storage import not_converted
from .params import ParamGroup

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class WeightFormat:
    """How one weight is stored and which unit multiplies it."""

    label: str
    bits: int
    group_size: int  # weights per scale (0: no scales)
    scale_bytes: int
    compute: str  # peak-table key the matmul runs at: bf16 | fp8 | int8 | fp32

    @property
    def bytes_per_param(self) -> float:
        scales = self.scale_bytes / self.group_size if self.group_size else 0.0
        return self.bits / 8 + scales

    @property
    def kernel(self) -> str:
        """The kernel family a matmul on this weight runs (the key of the efficiency tables):
        bf16 | fp32 | fp8 (per-tensor) | fp8_block | int8 | w4a16 (Marlin-like) | w4a8."""
        if self.bits == 4:
            return "w4a8" if self.compute in ("int8", "fp8") else "w4a16"
        if self.compute == "fp8":
            return "fp8_block" if self.group_size else "fp8"
        return self.compute

    @property
    def eight_bit_activations(self) -> bool:
        """Matmuls take 8-bit activations (A8 modes, FP8 checkpoints): EP dispatch sends 1 B/elem."""
        return self.compute in ("int8", "fp8")


BF16 = WeightFormat("bf16", 16, 0, 0, "bf16")
FP32 = WeightFormat("fp32", 32, 0, 0, "fp32")
NATIVE = {"bf16": BF16, "fp32": FP32}

# (weight bits, activation bits) of each mode TensorCast names.
MODES: dict[str, tuple[int, int]] = {"BF16": (16, 16), "W8A8": (8, 8), "W4A8": (4, 8), "W4A16": (4, 16)}

# (group, checkpoint name of one of its tensors) -> that tensor's format
Policy = Callable[[ParamGroup, str], WeightFormat]


def is_text_linear(group: ParamGroup) -> bool:
    return group.linear and not group.name.startswith(("vision", "projector"))


def scheme_format(scheme: QuantScheme) -> WeightFormat:
    return WeightFormat(
        f"int{scheme.bits}/g{scheme.group_size}",
        scheme.bits,
        scheme.group_size,
        DTYPE_BYTES.get(scheme.scale_dtype.replace("bfloat16", "bf16").replace("float32", "fp32"), 2),
        "bf16",
    )


@dataclass(frozen=True)
class ConfigQuant:
    """The checkpoint format a config's ``quantization_config`` declares for the text linear weights."""

    format: WeightFormat
    skip: tuple[str, ...]  # modules_to_not_convert, matched as transformers matches them
    groups: tuple[str, ...] | None = None  # the only parameter groups it covers (None: every text linear)

    def applies(self, group: ParamGroup, name: str) -> bool:
        if self.groups is not None and group.name not in self.groups:
            return False
        module = name.rpartition(".")[0]  # the checkpoint name of the module holding the tensor
        return is_text_linear(group) and not not_converted(module, self.skip)


# MXFP4 (OCP microscaling, gpt-oss): 4-bit e2m1 values, one e8m0 (1-byte) scale per 32; transformers
# quantizes only the routed experts (Mxfp4GptOssExperts). Hopper has no FP4 unit: computed in bf16.
MXFP4 = WeightFormat("mxfp4", 4, 32, 1, "bf16")


def config_quantization(raw: Mapping[str, Any]) -> tuple[ConfigQuant | None, list[str]]:
    """The root config's ``quantization_config``: FP8 (optionally block-scaled) is priced; any other
    method is reported in the returned notes and the weights are sized without it."""
    qc = raw.get("quantization_config")
    if not isinstance(qc, Mapping):
        return None, []
    method = str(qc.get("quant_method", ""))
    skip = tuple(str(m) for m in qc.get("modules_to_not_convert") or ())
    if method == "mxfp4":
        return ConfigQuant(MXFP4, skip, groups=("routed_experts",)), []
    if method != "fp8":
        return None, [
            f"config quantization_config.quant_method {method!r} is not priced; weights are sized from "
            "the spec's quantization schemes (or native dtypes) instead"
        ]
    block = qc.get("weight_block_size")
    if block:
        scale_group, label = math.prod(int(b) for b in block), "fp8/b" + "x".join(str(int(b)) for b in block)
    else:
        scale_group, label = 0, "fp8"  # one scale per tensor: negligible
    fmt = WeightFormat(label, 8, scale_group, 4 if scale_group else 0, "fp8")  # fp32 scale_inv per block
    return ConfigQuant(fmt, skip), []


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


def checkpoint_policy(schemes: Sequence[QuantScheme], config_quant: ConfigQuant | None = None) -> Policy:
    """Formats as shipped: a tensor whose checkpoint name matches a scheme's glob takes that scheme,
    else the config's FP8 format when it covers the tensor, else its native dtype."""

    def policy(group: ParamGroup, name: str) -> WeightFormat:
        for scheme in schemes:
            if fnmatch.fnmatchcase(name, scheme.modules):
                return scheme_format(scheme)
        if config_quant is not None and config_quant.applies(group, name):
            return config_quant.format
        return NATIVE[group.dtype]

    return policy


def mode_policy(mode: str, schemes: Sequence[QuantScheme]) -> Policy:
    fmt = mode_format(mode, schemes)

    def policy(group: ParamGroup, _name: str) -> WeightFormat:
        return fmt if is_text_linear(group) else NATIVE[group.dtype]

    return policy


def resolve_policy(
    quant: str | None,
    declared: Sequence[str],
    schemes: Sequence[QuantScheme],
    config_quant: ConfigQuant | None = None,
) -> Policy:
    """``quant`` None → the checkpoint; otherwise it must be one the spec's simulation backend declares."""
    if quant is None:
        return checkpoint_policy(schemes, config_quant)
    mode = quant.upper()
    known = [m.upper() for m in declared]
    if mode not in known:  # a bad option value, like an unknown --device or --tp 3 on 64 heads
        raise UsageError(
            f"quantization {quant!r} is not declared by this spec "
            f"(backends.simulation.quant_modes: {', '.join(declared) or 'none'})"
        )
    if mode not in MODES:
        raise KadaptError(
            f"quantization {quant!r} is declared by the spec but kadapt cannot price it "
            f"(supported: {', '.join(MODES)})"
        )
    return mode_policy(mode, schemes)


def check_schemes(spec: Spec, groups: Sequence[ParamGroup]) -> None:
    """Every ``quantization[]`` glob must match at least one tensor of the inventory: a glob that
    matches nothing would silently size the checkpoint wrong (located error, with real names)."""
    names = [name for group in groups for name, _ in group.tensors()]
    for index, scheme in enumerate(spec.quantization):
        if any(fnmatch.fnmatchcase(name, scheme.modules) for name in names):
            continue
        distinct = list(dict.fromkeys(names))
        close = difflib.get_close_matches(scheme.modules, distinct, n=4, cutoff=0.0)
        raise KadaptError(
            f"quantization[{index}] ({scheme.id}) modules {scheme.modules!r} matches no parameter of "
            f"{spec.name}'s model; its checkpoint names look like: {', '.join(close)}",
            location=spec.locate(f"quantization[{index}]"),
        )
