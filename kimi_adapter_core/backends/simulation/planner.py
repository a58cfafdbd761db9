"""Sizing a runtime does before it loads anything: KV cache, max length, weights, activations, vision cache.

Everything is arithmetic on the normalized architecture (``arch``) and the analytic parameter
inventory (``params``); no torch. The formulas follow what MAX's Kimi-K2.5 pipeline exposes
(``construct_kv_params``, ``calculate_max_seq_len``, ``estimate_weights_size``,
``estimate_activation_memory``, ``estimate_vision_cache_entry_bytes``) and are spelled out in
``docs/cost_model.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...errors import UsageError
from .arch import Architecture, TextArch
from .device import Device
from .parallel import Parallel
from .params import ParamGroup, param_groups
from .quant import DTYPE_BYTES, Policy

ACTIVATION_FORMULA = (
    "T*2*(2*hidden + max(H/tp*(2*qk_head+v_head) + kv_lora+rope, 2*I/tp, dp*top_k/ep*(hidden+3*I_moe)))"
    " + T_logits*ceil(vocab/tp)*4   [T = tokens per rank per forward, bf16 activations, fp32 logits]"
)


@dataclass(frozen=True)
class KvSizing:
    dtype: str
    layers: int
    latent_elems: int  # kv_lora_rank + qk_rope_head_dim
    expanded_elems: int  # H * (qk_nope + qk_rope + v_head)
    latent_bytes_per_token_layer: int
    expanded_bytes_per_token_layer: int

    @property
    def ratio(self) -> float:
        return self.expanded_bytes_per_token_layer / self.latent_bytes_per_token_layer

    @property
    def bytes_per_token(self) -> int:
        """Latent cache bytes for one token across all layers (MLA's cache is replicated over TP)."""
        return self.latent_bytes_per_token_layer * self.layers


@dataclass(frozen=True)
class WeightLine:
    group: ParamGroup
    format: str
    bytes_per_param: float
    params_per_device: int

    @property
    def total_bytes(self) -> float:
        return self.group.count * self.bytes_per_param

    @property
    def bytes_per_device(self) -> float:
        return self.params_per_device * self.bytes_per_param


@dataclass(frozen=True)
class Memory:
    """Per-device memory: what a deployment needs and what is left of the device."""

    weights: float
    kv_cache: float
    activations: float
    capacity: float | None

    @property
    def used(self) -> float:
        return self.weights + self.kv_cache + self.activations

    @property
    def free(self) -> float | None:
        return None if self.capacity is None else self.capacity - self.used

    def warnings(self, device: Device | None) -> list[str]:
        if device is None or self.free is None or self.free >= 0:
            return []
        return [
            f"memory does not fit: needs {self.used / 1e9:.1f} GB per device, "
            f"{device.name} has {self.capacity / 1e9:.1f} GB ({-self.free / 1e9:.1f} GB short)"
        ]


@dataclass(frozen=True)
class Plan:
    arch: Architecture
    parallel: Parallel
    batch: int
    seq_len: int
    max_seq_len: int
    prefill_chunk: int
    kv: KvSizing
    weights: tuple[WeightLine, ...]
    memory: Memory
    vision_cache_entry_bytes: int | None
    quant: str
    device: Device | None
    warnings: tuple[str, ...] = field(default=())

    @property
    def total_params(self) -> int:
        return sum(line.group.count for line in self.weights)

    @property
    def weight_bytes(self) -> float:
        return sum(line.total_bytes for line in self.weights)

    def weight_bytes_by_format(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in self.weights:
            out[line.format] = out.get(line.format, 0.0) + line.total_bytes
        return out


def kv_sizing(t: TextArch, kv_dtype: str = "bf16") -> KvSizing:
    if kv_dtype not in DTYPE_BYTES:
        raise UsageError(f"unknown KV cache dtype {kv_dtype!r} (known: {', '.join(DTYPE_BYTES)})")
    size = DTYPE_BYTES[kv_dtype]
    return KvSizing(
        kv_dtype,
        t.num_layers,
        t.kv_latent_dim,
        t.kv_expanded_dim,
        t.kv_latent_dim * size,
        t.kv_expanded_dim * size,
    )


def max_seq_len(t: TextArch, requested: int | None) -> int:
    """Like MAX's ``upper_bounded_default``: the request, bounded by max_position_embeddings."""
    if requested is None:
        return t.max_positions
    if requested < 1:
        raise UsageError(f"--seq-len must be >= 1 (got {requested})")
    if requested > t.max_positions:
        raise UsageError(
            f"--seq-len {requested} exceeds the model's max_position_embeddings {t.max_positions}"
        )
    return requested


def params_per_device(group: ParamGroup, t: TextArch, par: Parallel) -> int:
    if group.shard == "tp":
        return group.count // par.tp
    if group.shard == "ep":
        return group.count // par.ep
    if group.shard == "vocab":  # vocab-parallel: each TP rank holds ceil(vocab / tp) rows
        return math.ceil(t.vocab / par.tp) * (group.count // t.vocab)
    return group.count


def weight_lines(arch: Architecture, par: Parallel, policy: Policy) -> tuple[WeightLine, ...]:
    lines = []
    for group in param_groups(arch):
        fmt = policy(group)
        lines.append(
            WeightLine(group, fmt.label, fmt.bytes_per_param, params_per_device(group, arch.text, par))
        )
    return tuple(lines)


def activation_bytes(t: TextArch, par: Parallel, tokens: int, logits_tokens: int) -> float:
    """Peak transient activations of one forward on one rank (formula: ``ACTIVATION_FORMULA``)."""
    heads = t.num_heads // par.tp
    attention = heads * (2 * t.qk_head_dim + t.v_head_dim) + t.kv_latent_dim
    dense = 2 * t.intermediate // par.tp
    moe = par.dp * t.top_k / par.ep * (t.hidden + 3 * t.moe_intermediate) if t.n_moe_layers else 0
    return (
        tokens * 2 * (2 * t.hidden + max(attention, dense, moe))
        + logits_tokens * math.ceil(t.vocab / par.tp) * 4
    )


def vision_cache_entry_bytes(arch: Architecture) -> int | None:
    """MAX's estimate: max tokens per image (pos grid / merge area) x text hidden x 2 bytes (bf16)."""
    v = arch.vision
    if v is None:
        return None
    return v.pos_emb_height * v.pos_emb_width // (v.merge_h * v.merge_w) * v.text_hidden * 2


def memory(
    weights: tuple[WeightLine, ...], kv: KvSizing, kv_tokens: int, activations: float, device: Device | None
) -> Memory:
    return Memory(
        weights=sum(line.bytes_per_device for line in weights),
        kv_cache=float(kv_tokens * kv.bytes_per_token),
        activations=activations,
        capacity=device.memory_bytes if device else None,
    )


def make_plan(
    arch: Architecture,
    par: Parallel,
    policy: Policy,
    quant_label: str,
    *,
    batch: int = 1,
    seq_len: int | None = None,
    prefill_chunk: int = 8192,
    kv_dtype: str = "bf16",
    device: Device | None = None,
) -> Plan:
    """Size ``batch`` sequences of ``seq_len`` tokens (default: the max) on ``par``."""
    t = arch.text
    par.check(t)
    per_dp = par.split_batch(batch)
    length = max_seq_len(t, seq_len)
    if prefill_chunk < 1:
        raise UsageError(f"--prefill-chunk must be >= 1 (got {prefill_chunk})")
    kv = kv_sizing(t, kv_dtype)
    weights = weight_lines(arch, par, policy)
    tokens = min(prefill_chunk, per_dp * length)  # the largest forward: one prefill chunk
    acts = activation_bytes(t, par, tokens, logits_tokens=per_dp)
    mem = memory(weights, kv, per_dp * length, acts, device)
    return Plan(
        arch,
        par,
        batch,
        length,
        t.max_positions,
        prefill_chunk,
        kv,
        weights,
        mem,
        vision_cache_entry_bytes(arch),
        quant_label,
        device,
        tuple(mem.warnings(device)),
    )
