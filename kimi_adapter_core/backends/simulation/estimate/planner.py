"""Sizing a runtime does before it loads anything: KV cache, max length, weights, activations, vision cache.

Everything is arithmetic on the model's ``ModelStructure`` (``arch``) and the analytic parameter
inventory (``params``); no torch. The formulas follow what MAX's Kimi-K2.5 pipeline exposes
(``construct_kv_params``, ``calculate_max_seq_len``, ``estimate_weights_size``,
``estimate_activation_memory``, ``estimate_vision_cache_entry_bytes``), generalised to every
attention kind, and are spelled out in ``docs/cost_model.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ....errors import UsageError
from ....structure.model import Attention, ModelStructure
from ....vision.images import ImageBatch
from ....vision.images import vision_cache_entry_bytes as entry_bytes
from ..model.arch import Architecture, indexed_layer_ids
from ..model.inputs import ModelInputs
from ..model.parallel import Parallel, heads_per_rank, kv_elements_per_rank, kv_heads_per_rank
from ..model.params import ParamGroup
from ..model.quant import DTYPE_BYTES, Policy, sparse_fp8_latent_bytes
from ..tables.device import Device
from .compressed_sizing import CompressedKind, CompressedSizing
from .state_sizing import IndexKeySizing, LinearStateSizing


def activation_formula(s: ModelStructure) -> str:
    """The activation estimate of ``activation_bytes``, with the terms this model has."""
    attention = "H/tp*qk_head + KV/tp*(qk_head+v_head)" + (" + kv_lora+rope" if s.attention.is_mla else "")
    terms = [attention]
    if s.dense_layer_ids:
        terms.append("2*I/tp")
    if s.moe is not None and s.moe_layer_ids:
        terms.append("dp*top_k/ep*(hidden+3*I_moe/moe_tp)")
    if s.linear is not None:
        terms.append("(2*Hk*dk+2*Hv*dv+2*Hv)/tp")
    if s.indexer is not None:
        terms.append("idx_H*idx_dim + idx_dim + idx_H")
    return (
        f"T*2*(2*hidden + max({', '.join(terms)})) + T_logits*ceil(vocab/tp)*4   [T = tokens per rank per "
        "forward, KV/tp = KV heads per rank (>= 1), bf16 activations, fp32 logits]"
    )


@dataclass(frozen=True)
class KvSizing:
    """The KV cache of one token: per layer, whole model and per TP rank, with sliding-window caps;
    in a hybrid stack, over its attention layers, plus the linear layers' constant ``state``; in a DSA
    stack plus the indexer keys (``index``), which grow with the context; with compressed layers their
    entries and rings (``compressed``)."""

    dtype: str
    layout: str  # heads | latent | expanded (the attention kind's default: what serving runtimes cache)
    attention: Attention
    windows: tuple[int | None, ...]  # per attention layer: sliding window or None (full attention)
    tp: int
    state: LinearStateSizing | None = None  # the linear layers' per-request state (hybrid stacks)
    index: IndexKeySizing | None = None  # the DSA indexer keys (DeepSeek-V3.2)
    # per attention layer: its attention chunk (Llama-4's chunked layers) or None; () when none is chunked
    chunks: tuple[int | None, ...] = ()
    # per attention layer its own attention when the layers cache different KV shapes (MiMo-V2-Flash's
    # sliding layers, Gemma-4's full layers); () when every layer caches ``attention``'s
    layer_attentions: tuple[Attention, ...] = ()
    compressed: CompressedSizing | None = None  # DeepSeek-V4's hca and csa layers' entries and rings
    # a key that is also the value (DeepSeek-V4) counted once, as a serving runtime stores it (simulate);
    # False: both, as the ABI carries them (plan, which states the runtime's figure beside)
    value_once: bool = False

    @property
    def attentions(self) -> tuple[Attention, ...]:
        """Per attention layer the attention whose KV it caches."""
        return self.layer_attentions or (self.attention,) * self.layers

    def layer_bytes_per_token(self, *, per_rank: bool = False) -> tuple[int, ...]:
        """Per attention layer the bytes one token takes in it (whole model, or one TP rank's share)."""
        return tuple(self._bytes(a, self._elements(a, per_rank)) for a in self.attentions)

    def _elements(self, a: Attention, per_rank: bool) -> int:
        """Elements one token caches in a layer of attention ``a`` (whole model or one TP rank)."""
        tp = self.tp if per_rank else 1
        return kv_elements_per_rank(a, self.layout, tp, value_once=self.value_once)

    @property
    def sparse_fp8(self) -> bool:
        """A DSA stack's FP8 latent cache as serving runtimes store it: FlashMLA's sparse FP8 layout
        (vLLM's ``fp8_ds_mla``, which vLLM picks for any fp8 KV dtype on the sparse backend): per token
        the latent in FP8, one fp32 scale per 128 of it and the rope key in bf16 (V3.2: 656 B, not 576)."""
        return self.index is not None and self.dtype == "fp8" and self.layout == "latent"

    def _bytes(self, attention: Attention, elements: int) -> int:
        """Bytes of ``elements`` cached elements of one token in one layer (``sparse_fp8``: its layout)."""
        if not self.sparse_fp8 or attention.kv_lora_rank is None:
            return elements * self.bytes_per_elem
        return sparse_fp8_latent_bytes(attention.kv_lora_rank, elements - attention.kv_lora_rank)

    @property
    def bytes_per_elem(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def layers(self) -> int:
        return len(self.windows)

    @property
    def elems_per_token_layer(self) -> int:
        """Whole model, one layer: ``attention.kv_elements(layout)``."""
        return self.attention.kv_elements(self.layout)

    @property
    def bytes_per_token_layer(self) -> int:
        return self._bytes(self.attention, self.elems_per_token_layer)

    @property
    def bytes_per_token(self) -> int:
        """One token in every attention layer, whole model (a sliding layer caps only a long sequence)."""
        return sum(self.layer_bytes_per_token())

    @property
    def rank_bytes_per_token_layer(self) -> int:
        """One TP rank's share: heads split over TP, replicated past the KV heads (MLA latent: all)."""
        return self._bytes(self.attention, self._elements(self.attention, True))

    def layouts(self) -> dict[str, int]:
        """Bytes per token per layer of every layout the attention kind can cache in."""
        return {
            name: self._bytes(self.attention, self.attention.kv_elements(name))
            if name == self.layout
            else self.attention.kv_elements(name) * self.bytes_per_elem
            for name in self.attention.kv_layouts
        }

    def cached_token_layers(self, tokens: int) -> int:
        """Token-layers a sequence of ``tokens`` holds: a sliding layer keeps its last ``window`` only, a
        chunked layer at most ``chunk`` (a query needs ``p % chunk`` past keys: transformers' chunked
        cache layer keeps the last ``chunk - 1``, plus the new token)."""
        return sum(tokens if cap is None else min(tokens, cap) for cap in self.caps)

    @property
    def caps(self) -> tuple[int | None, ...]:
        """Per attention layer: the tokens it keeps at most (its window or chunk), or None (all)."""
        chunks = self.chunks or (None,) * len(self.windows)
        return tuple(window or chunk for window, chunk in zip(self.windows, chunks, strict=True))

    def state_bytes(self, *, per_rank: bool = True) -> int:
        """The linear layers' state of one request, whatever its length (0: no linear layers)."""
        return 0 if self.state is None else self.state.bytes_per_request(per_rank=per_rank)

    def kv_bytes(self, tokens: int, *, per_rank: bool = True) -> int:
        """The attention layers' KV cache of a sequence of ``tokens``."""
        per_layer = self.layer_bytes_per_token(per_rank=per_rank)
        kept = (tokens if cap is None else min(tokens, cap) for cap in self.caps)
        return sum(count * nbytes for count, nbytes in zip(kept, per_layer, strict=True))

    def index_bytes(self, tokens: int) -> int:
        """The DSA indexer keys of a sequence of ``tokens`` (0: no indexed layers); replicated over TP."""
        return 0 if self.index is None else self.index.bytes(tokens)

    def sequence_bytes(self, tokens: int, *, per_rank: bool = True) -> int:
        """Everything one sequence of ``tokens`` keeps: the KV cache plus any linear-attention state,
        any DSA indexer keys and any compressor's entries and ring."""
        kept = self.kv_bytes(tokens, per_rank=per_rank) + self.state_bytes(per_rank=per_rank)
        compressed = 0 if self.compressed is None else self.compressed.bytes(tokens)
        return kept + self.index_bytes(tokens) + compressed


@dataclass(frozen=True)
class WeightLine:
    """The part of a parameter group stored in one format (a group whose tensors all share one
    format - the usual case - is one line)."""

    group: ParamGroup
    format: str
    bytes_per_param: float
    params: int
    params_per_device: int

    @property
    def name(self) -> str:
        return self.group.name if self.params == self.group.count else f"{self.group.name} [{self.format}]"

    @property
    def total_bytes(self) -> float:
        return self.params * self.bytes_per_param

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
    vision_cache: float = 0.0  # image features of the DP group's images (``--images``)

    @property
    def used(self) -> float:
        return self.weights + self.kv_cache + self.activations + self.vision_cache

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
    images: ImageBatch | None = None  # images per sequence (``--images``), for the batch's vision cache

    @property
    def total_params(self) -> int:
        return sum(line.params for line in self.weights)

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: all but the routed experts it is not sent to."""
        return active_params(self.arch.structure, self.weights)

    @property
    def weight_bytes(self) -> float:
        return sum(line.total_bytes for line in self.weights)

    def weight_bytes_by_format(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in self.weights:
            out[line.format] = out.get(line.format, 0.0) + line.total_bytes
        return out


def active_params(s: ModelStructure, weights: tuple[WeightLine, ...]) -> int:
    routed = sum(line.params for line in weights if line.group.shard == "ep")
    total = sum(line.params for line in weights)
    if s.moe is None or not routed:
        return total
    return total - routed + routed * s.moe.top_k // s.moe.num_experts


def state_kinds(kv: KvSizing, tokens: int) -> dict[str, dict[str, Any]] | None:
    """Per state kind of a hybrid or DSA stack, what one request of ``tokens`` keeps on one device:
    the attention layers' KV cache (grows with the context unless every layer keeps a window or a
    chunk: DeepSeek-V4's), the linear layers' state (constant), the DSA indexer keys and compressed
    entries (grow with the context). None for a plain attention model (its KV cache is the only
    state)."""
    if kv.state is None and kv.index is None and kv.compressed is None:
        return None
    kinds: dict[str, dict[str, Any]] = {
        "attention_kv": {
            "layers": kv.layers,
            "grows_with_context": any(cap is None for cap in kv.caps),
            "bytes_per_request_per_device": kv.kv_bytes(tokens),
        }
    }
    if kv.state is not None:
        kinds["linear_attention"] = {
            "layers": kv.state.layers,
            "grows_with_context": False,
            "bytes_per_request_per_device": kv.state_bytes(),
        }
    if kv.index is not None:
        kinds["indexer_keys"] = {
            "layers": kv.index.layers,
            "grows_with_context": True,
            "bytes_per_request_per_device": kv.index_bytes(tokens),
        }
    if kv.compressed is not None:
        kinds["compressed_entries"] = {
            "layers": kv.compressed.layers,
            "grows_with_context": True,
            "bytes_per_request_per_device": kv.compressed.bytes(tokens),
        }
    return kinds


def kv_sizing(s: ModelStructure, tp: int, kv_dtype: str = "bf16", *, value_once: bool = False) -> KvSizing:
    if kv_dtype not in DTYPE_BYTES:
        raise UsageError(f"unknown KV cache dtype {kv_dtype!r} (known: {', '.join(DTYPE_BYTES)})")
    windows = tuple(s.layers[i].window for i in s.attention_layer_ids)
    chunks = tuple(s.layers[i].chunk for i in s.attention_layer_ids) if s.has_chunked_layers else ()
    state = None if s.linear is None else LinearStateSizing(s.linear, len(s.linear_layer_ids), tp)
    index = None if s.indexer is None else IndexKeySizing(s.indexer, len(indexed_layer_ids(s)))
    shaped = any(s.layers[i].attention_shape is not None for i in s.attention_layer_ids)
    layer_attentions = tuple(s.layer_attention(i) for i in s.attention_layer_ids) if shaped else ()
    layout = s.attention.default_kv_layout
    compressed = None
    if s.compressors:
        kinds = tuple(
            CompressedKind(kind, c, tuple(i for i, k in enumerate(s.layer_kinds) if k == kind))
            for kind, c in s.compressors.items()
        )
        compressed = CompressedSizing(kinds, DTYPE_BYTES[kv_dtype])
    return KvSizing(
        kv_dtype,
        layout,
        s.attention,
        windows,
        tp,
        state,
        index,
        chunks,
        layer_attentions,
        compressed,
        value_once,
    )


def max_seq_len(s: ModelStructure, requested: int | None) -> int:
    """Like MAX's ``upper_bounded_default``: the request, bounded by max_position_embeddings (a config
    that states none, a pure SSM stack's, bounds nothing: then the request is needed)."""
    if requested is None:
        if not s.max_positions:
            raise UsageError("the config states no max_position_embeddings: pass --seq-len")
        return s.max_positions
    if requested < 1:
        raise UsageError(f"--seq-len must be >= 1 (got {requested})")
    if s.max_positions and requested > s.max_positions:
        raise UsageError(
            f"--seq-len {requested} exceeds the model's max_position_embeddings {s.max_positions}"
        )
    return requested


def params_per_device(group: ParamGroup, params: int, s: ModelStructure, par: Parallel) -> int:
    """The share of ``params`` (whole tensors of ``group``) one device holds."""
    if group.shard == "tp":
        return params // par.tp
    if group.shard == "kv":  # by the KV heads of the group's own attention shape
        a = group.attention or s.attention
        return params // a.num_kv_heads * kv_heads_per_rank(a, par.tp)
    if group.shard == "ep":  # whole experts over EP, each's width over expert TP
        return params // par.moe_group
    if group.shard == "vocab":  # vocab-parallel: each TP rank holds ceil(vocab / tp) rows
        return math.ceil(s.vocab_size / par.tp) * (params // s.vocab_size)
    return params


def weight_lines(inputs: ModelInputs, par: Parallel) -> tuple[WeightLine, ...]:
    """One line per group and format: the policy decides each tensor's format by its checkpoint name."""
    return _lines(inputs.groups, inputs.arch.structure, par, inputs.policy)


def _lines(
    groups: tuple[ParamGroup, ...], s: ModelStructure, par: Parallel, policy: Policy
) -> tuple[WeightLine, ...]:
    lines = []
    for group in groups:
        by_format: dict[str, list] = {}
        for name, params in group.tensors():
            fmt = policy(group, name)
            entry = by_format.setdefault(fmt.label, [fmt, 0])
            entry[1] += params
        for fmt, params in by_format.values():
            lines.append(
                WeightLine(
                    group, fmt.label, fmt.bytes_per_param, params, params_per_device(group, params, s, par)
                )
            )
    return tuple(lines)


def activation_bytes(s: ModelStructure, par: Parallel, tokens: int, logits_tokens: int) -> float:
    """Peak transient activations of one forward on one rank (formula: ``activation_formula``)."""
    a = s.attention
    latent = a.kv_elements("latent") if a.is_mla else 0
    attention = (
        heads_per_rank(a, par.tp) * a.head_dim
        + kv_heads_per_rank(a, par.tp) * (a.head_dim + a.v_head_dim)
        + latent
    )
    dense = 2 * s.intermediate_size // par.tp
    moe = 0.0
    if s.moe is not None and s.moe_layer_ids:
        width = s.moe.expert_intermediate_size // par.moe_tp  # a rank's slice under expert TP
        moe = par.dp * s.moe.top_k / par.ep * (s.hidden_size + 3 * width)
    linear = 0
    if s.linear is not None:  # the in projections' outputs: q, k, v, the output gate z, b and a
        lin = s.linear
        heads = lin.num_value_heads
        width = 2 * lin.num_key_heads * lin.key_head_dim + 2 * heads * lin.value_head_dim + 2 * heads
        linear = width // par.tp
    index = 0
    if s.indexer is not None:  # the replicated indexer's q, k and head weights (every head on every rank)
        ix = s.indexer
        index = ix.n_heads * ix.head_dim + ix.head_dim + ix.n_heads
    return (
        tokens * 2 * (2 * s.hidden_size + max(attention, dense, moe, linear, index))
        + logits_tokens * math.ceil(s.vocab_size / par.tp) * 4
    )


def vision_cache_entry_bytes(arch: Architecture) -> int | None:
    """MAX's estimate: max tokens per image (pos grid / merge area) x text hidden x 2 bytes (bf16)."""
    return None if arch.vision is None else entry_bytes(arch.vision)


def memory(
    weights: tuple[WeightLine, ...],
    kv: KvSizing,
    sequences: int,
    tokens: int,
    activations: float,
    device: Device | None,
) -> Memory:
    """Per device: weights, the KV cache of ``sequences`` sequences of ``tokens`` tokens, activations."""
    return Memory(
        weights=sum(line.bytes_per_device for line in weights),
        kv_cache=float(sequences * kv.sequence_bytes(tokens)),
        activations=activations,
        capacity=device.memory_bytes if device else None,
    )


def make_plan(
    inputs: ModelInputs,
    par: Parallel,
    *,
    batch: int = 1,
    seq_len: int | None = None,
    prefill_chunk: int = 8192,
    kv_dtype: str = "bf16",
    device: Device | None = None,
    images: ImageBatch | None = None,
) -> Plan:
    """Size ``batch`` sequences of ``seq_len`` tokens (default: the max) on ``par``; with ``images``,
    each sequence also carries that many images, whose features the vision cache holds per device."""
    arch = inputs.arch
    s = arch.structure
    par.check(s)
    per_dp = par.split_batch(batch)
    length = max_seq_len(s, seq_len)
    if prefill_chunk < 1:
        raise UsageError(f"--prefill-chunk must be >= 1 (got {prefill_chunk})")
    kv = kv_sizing(s, par.tp, kv_dtype)
    weights = weight_lines(inputs, par)
    tokens = min(prefill_chunk, per_dp * length)  # the largest forward: one prefill chunk
    acts = activation_bytes(s, par, tokens, logits_tokens=per_dp)
    mem = memory(weights, kv, per_dp, length, acts, device)
    notes: list[str] = []
    if images is not None:
        mem = replace(mem, vision_cache=float(images.images(per_dp) * images.feature_bytes_per_image))
        notes = images.notes()
    return Plan(
        arch,
        par,
        batch,
        length,
        s.max_positions,
        prefill_chunk,
        kv,
        weights,
        mem,
        vision_cache_entry_bytes(arch),
        inputs.quant_label,
        device,
        (*inputs.notes, *notes, *mem.warnings(device)),
        images,
    )
