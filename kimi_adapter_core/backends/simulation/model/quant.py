"""Weight formats and the two policies that assign them: the checkpoint as shipped, or a --quant mode.

- ``checkpoint`` (the default): the storage of the checkpoint the config describes, by the
  extraction's own rule (``checkpoint_storage``), so plan/simulate size what extraction reads: the
  config's ``quantization_config`` decides - compressed-tensors pack-quantized (Kimi-K2.5: routed
  experts int4, group 32, bf16 scales, computed in bf16), block-scaled FP8 (DeepSeek-V3: every linear
  weight of the text model FP8 e4m3 with one fp32 scale per 128x128 block, computed at the FP8 peak),
  MXFP4 (gpt-oss: routed experts 4-bit e2m1 with one e8m0 scale per 32 weights, computed in bf16),
  DeepSeek-V4's ``expert_dtype: fp4`` (routed experts e2m1 with one ue8m0 scale per 32 inputs of a row,
  FP8 activations: the W4A8 kernel; its other linears FP8 with ue8m0 block scales) -
  and without one every tensor is in its native dtype. The spec's ``quantization`` schemes are claims:
  one the config contradicts is a located error, one beside a dense config a note. A scheme whose
  glob matches no tensor of the model is an error located at the scheme.
- a ``--quant`` mode (TensorCast's quantize-linear-action): every *linear* weight of the text model
  (attention projections, dense MLP, shared and routed experts) takes the mode's format; router,
  norms, embeddings, lm_head and the vision tower keep their native dtype. W4 modes reuse the group
  size and scale dtype of the spec's 4-bit scheme when it declares one (else group 128, bf16 scales).
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ....checkpoint.storage import (
    FP4_E2M1,
    FP8_BLOCK,
    MXFP4,
    MXFP4_BLOCK,
    PACK_QUANTIZED,
    CheckpointStorage,
    Storage,
    checkpoint_storage,
)
from ....config.quantization import backend_quantization_config
from ....errors import KadaptError, UsageError
from ....spec.model import QuantScheme, Spec
from ....structure.bounds import MAX_EXPERT_WEIGHTS
from .params import Naming, ParamGroup

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "int8": 1}

# DSA indexer keys as serving runtimes cache them: FP8 e4m3 with one fp32 scale per 128 channels, whatever
# --kv-dtype (DeepSeek's own inference code, vLLM's and SGLang's indexer caches: their scoring kernel,
# DeepGEMM's fp8 MQA logits, reads FP8 keys); transformers' reference keeps them in the model dtype
INDEX_KEY_DTYPE = "fp8"
INDEX_SCALE_BLOCK = 128
INDEX_SCALE_BYTES = 4
INDEX_REFERENCE_DTYPE = "bf16"


def fp8_scaled_bytes(channels: int) -> int:
    """Bytes of ``channels`` FP8 values with one fp32 scale per 128 of them: a cached DSA indexer key,
    and the latent part of FlashMLA's sparse FP8 KV layout (``sparse_fp8_latent_bytes``)."""
    scales = math.ceil(channels / INDEX_SCALE_BLOCK) * INDEX_SCALE_BYTES
    return channels * DTYPE_BYTES[INDEX_KEY_DTYPE] + scales


def sparse_fp8_latent_bytes(latent: int, rope: int) -> int:
    """Bytes of one token's DSA latent in FlashMLA's sparse FP8 layout (vLLM's ``fp8_ds_mla``, which vLLM
    picks for any fp8 KV dtype on the sparse backend): the latent in FP8 with an fp32 scale per 128 of it,
    the rope key in bf16 - 656 B for DeepSeek-V3.2's 512 + 64, not 576. The planner sizes the cache with
    it and the simulator's sparse attention reads it, so the two cannot disagree."""
    return fp8_scaled_bytes(latent) + rope * DTYPE_BYTES["bf16"]


def index_key_bytes(head_dim: int) -> int:
    """Bytes of one cached DSA indexer key: FP8 channels plus their fp32 block scales (132 for 128)."""
    return fp8_scaled_bytes(head_dim)


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
        bf16 | fp32 | fp8 (per-tensor) | fp8_block | int8 | w4a16 (int4 groups, Marlin-like) |
        w4a16_mxfp4 (MXFP4 weights, bf16 math: its own kernels, e.g. FlashInfer's TensorRT-LLM MXFP4
        MoE on Blackwell, which AIConfigurator measured apart from int4 group quantization) |
        w4a8_mxfp4 (e2m1 weights with a one-byte scale per 32 times MXFP8 activations: DeepSeek-V4's
        FP4 experts, the Blackwell kernel AIConfigurator measured as ``w4a8_mxfp4_mxfp8``) | w4a8
        (int4 weights, 8-bit activations: the ``--quant W4A8`` mode)."""
        if self.bits == 4:
            if self.compute in ("int8", "fp8"):
                return "w4a8_mxfp4" if self.label.startswith(FP4_LABEL) else "w4a8"
            return "w4a16_mxfp4" if self.label == MXFP4 else "w4a16"
        if self.compute == "fp8":
            return "fp8_block" if self.group_size else "fp8"
        return self.compute

    @property
    def eight_bit_activations(self) -> bool:
        """Matmuls take 8-bit activations (A8 modes, FP8 checkpoints): EP dispatch sends 1 B/elem."""
        return self.compute in ("int8", "fp8")


BF16 = WeightFormat("bf16", 16, 0, 0, "bf16")
FP32 = WeightFormat("fp32", 32, 0, 0, "fp32")
INT64 = WeightFormat("int64", 64, 0, 0, "fp32")  # an index table (DeepSeek-V4's tid2eid): never multiplied
NATIVE = {"bf16": BF16, "fp32": FP32, "int64": INT64}

# (weight bits, activation bits) of each mode TensorCast names.
MODES: dict[str, tuple[int, int]] = {"BF16": (16, 16), "W8A8": (8, 8), "W4A8": (4, 8), "W4A16": (4, 16)}

# (group, checkpoint name of one of its tensors) -> that tensor's format
Policy = Callable[[ParamGroup, str], WeightFormat]


def is_text_linear(group: ParamGroup) -> bool:
    return group.linear and not group.is_vision


def _scale_bytes(dtype: str) -> int:
    """Bytes of one scale of torch dtype name ``dtype`` (``bfloat16``, ``float32``, ``float8_e8m0fnu``)."""
    if dtype.startswith("float8"):
        return 1
    return DTYPE_BYTES.get(dtype.replace("bfloat16", "bf16").replace("float32", "fp32"), 2)


def scheme_format(scheme: QuantScheme) -> WeightFormat:
    return WeightFormat(
        f"int{scheme.bits}/g{scheme.group_size}",
        scheme.bits,
        scheme.group_size,
        _scale_bytes(scheme.scale_dtype),
        "bf16",
    )


# the label of an e2m1 (FP4) weight with block scales and FP8 activations (DeepSeek-V4's experts)
FP4_LABEL = "fp4"

# MXFP4 (OCP microscaling, gpt-oss): 4-bit e2m1 values, one e8m0 (1-byte) scale per 32; transformers
# quantizes only the routed experts (Mxfp4GptOssExperts). Hopper has no FP4 unit: computed in bf16.
MXFP4_FORMAT = WeightFormat(MXFP4, 4, MXFP4_BLOCK, 1, "bf16")


def storage_format(storage: Storage | None, shape: tuple[int, ...], native: WeightFormat) -> WeightFormat:
    """The format sizing prices for a tensor of ``shape`` stored as ``storage``, the extraction's storage
    block of it (None: stored as is, in its ``native`` dtype). Formats come from the storage block so
    that plan/simulate price exactly what the weight map says the checkpoint holds."""
    if storage is None:
        return native
    if storage["format"] == PACK_QUANTIZED:  # computed in bf16 (Marlin-like w4a16)
        bits, group = storage["bits"], storage["group_size"]
        scale = _scale_bytes(storage["tensors"]["scale"]["dtype"])
        return WeightFormat(f"int{bits}/g{group}", bits, group, scale, "bf16")
    if storage["format"] == FP8_BLOCK:  # a scale_inv per block, computed at the FP8 peak
        block = tuple(storage["block"])
        if block == shape:  # one scale for the whole tensor: negligible
            return WeightFormat("fp8", 8, 0, 0, "fp8")
        scale = _scale_bytes(storage["tensors"]["scale"]["dtype"])
        return WeightFormat("fp8/b" + "x".join(map(str, block)), 8, math.prod(block), scale, "fp8")
    if storage["format"] == FP4_E2M1:  # DeepSeek-V4's experts: FP8 activations times FP4 weights
        scale = _scale_bytes(storage["tensors"]["scale"]["dtype"])
        return WeightFormat(f"{FP4_LABEL}/g{storage['block']}", 4, storage["block"], scale, "fp8")
    assert storage["format"] == MXFP4, storage["format"]  # the last format checkpoint_storage describes
    return MXFP4_FORMAT


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


# The per-expert projections transformers stacks into each routed-experts tensor on load (its
# conversion mapping's MergeModulelist + Concatenate): one nn.Linear weight per expert, as
# compressed-tensors and FP8 checkpoints store them (MXFP4 stores the stacked tensor itself).
PER_EXPERT = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def expert_sources(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """``(checkpoint name, shape)`` of each per-expert tensor stacked into ``name`` (``[experts, out,
    in]``), ``out`` split evenly between the projections concatenated into it."""
    prefix, _, stacked = name.rpartition(".")
    parts = PER_EXPERT[stacked]
    experts, rows, cols = shape
    return [
        (f"{prefix}.{e}.{part}.weight", (rows // len(parts), cols)) for e in range(experts) for part in parts
    ]


def _check_expert_count(stored: CheckpointStorage, group: ParamGroup, shape: tuple[int, ...]) -> None:
    """The per-expert weights a quantized checkpoint stores are each checked (below): bounded, so that
    a config of a million experts is refused at once instead of planned for an hour."""
    experts = shape[0]
    weights = group.instances * experts * sum(len(parts) for parts in PER_EXPERT.values())
    if weights > MAX_EXPERT_WEIGHTS:
        raise KadaptError(
            f"the {stored.found_in} stores the routed experts as one weight per expert: "
            f"{group.instances} MoE layers x {experts} experts x 3 projections = {weights:,} weights, more "
            f"than kadapt checks (at most {MAX_EXPERT_WEIGHTS:,})"
        )


def checkpoint_storage_of(spec: Spec, raw: dict[str, Any], names: Naming) -> CheckpointStorage:
    """The storage of the checkpoint whose config is ``raw`` (the shipped config), by the extraction's
    own rule (``checkpoint_storage``), so that plan/simulate size what extraction would read of the
    config simulation's bridges leave (a bridge may drop ``quantization_config`` for extraction alone):
    the ``quantization_config`` decides, none means dense (as transformers loads it), and the spec's
    ``quantization`` schemes are claims - contradicting the config, a located error; beside a dense
    config, a note. Torch-free, like ``kadapt plan``."""
    qc, found_in = backend_quantization_config(spec, raw, "simulation")
    head = names.checkpoint(f"{names.lm_head}.weight").removesuffix(".weight")
    return checkpoint_storage(
        qc, found_in, spec.quantization, head=head, locate=lambda i: spec.locate(f"quantization[{i}]")
    )


def _stored_format(stored: CheckpointStorage, group: ParamGroup, name: str) -> WeightFormat:
    shape, native = group.shape_of(name), NATIVE[group.dtype]
    if group.name != "routed_experts":
        linear = group.linear or group.name == "lm_head"  # the head: an nn.Linear --quant modes leave alone
        return storage_format(stored.storage(name, shape, linear), shape, native)
    whole = stored.storage(name, shape, False)  # the stacked tensor, an nn.Parameter (MXFP4 reads it)
    if whole is not None:
        return storage_format(whole, shape, native)
    if stored.found_in is None and not stored.claims:  # a dense checkpoint: every expert as is
        return native
    _check_expert_count(stored, group, shape)
    # Every expert's storage is asked for (a config may leave one expert dense; a scheme's claim is
    # checked on each), but priced once per distinct storage: the experts of a tensor nearly always
    # share one, and pricing each of its hundreds of weights again was a fifth of a Kimi plan's time.
    distinct: list[tuple[Storage | None, tuple[int, ...]]] = []
    for source, part in expert_sources(name, shape):
        key = (stored.storage(source, part, True), part)
        if key not in distinct:
            distinct.append(key)
    formats = {storage_format(storage, part, native) for storage, part in distinct}
    if len(formats) > 1:  # the weight map refuses such a checkpoint too: one storage per stacked tensor
        labels = ", ".join(sorted(f.label for f in formats))
        raise KadaptError(
            f"the {stored.found_in} stores the experts of {name} in different formats ({labels})"
        )
    return formats.pop()


def checkpoint_policy(stored: CheckpointStorage) -> Policy:
    """Formats as the checkpoint stores them: each tensor's storage by ``stored`` (which also checks
    every spec scheme covering it), a routed-experts tensor by the storage of the stacked tensor
    (MXFP4) or else of its per-expert ``nn.Linear`` weights. Memoized by name: sweeps and traces ask
    again for every deployment, and a stacked tensor is one rule call per expert."""
    known: dict[str, WeightFormat] = {}

    def policy(group: ParamGroup, name: str) -> WeightFormat:
        if name not in known:
            known[name] = _stored_format(stored, group, name)
        return known[name]

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
    stored: CheckpointStorage,
) -> Policy:
    """``quant`` None → the checkpoint ``stored`` describes; otherwise it must be one the spec's
    simulation backend declares."""
    if quant is None:
        return checkpoint_policy(stored)
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
