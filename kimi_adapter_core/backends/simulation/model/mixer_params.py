"""The tensors of one linear-attention / SSM layer, per mixer kind, under the model's own names.

Split from ``params.py`` (the whole inventory), which reads ``LINEAR_TENSORS`` for a hybrid stack's
linear layers; ``PRICED_MIXERS`` are the kinds plan can size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from ....structure.model import ModelStructure

# tp: split over tensor-parallel ranks (by heads or width); kv: split by KV heads, which are
# replicated once TP exceeds them; ep: routed experts over expert-parallel ranks; vocab:
# vocab-parallel rows (ceil(vocab/tp) per rank); replicated: every device holds all of it.
Shard = Literal["tp", "kv", "ep", "vocab", "replicated"]
Tensors = Sequence[tuple[str, tuple[int, ...]]]  # (name inside one layer, shape)


_FUSED_IN_PROJ = ("qwen3_next",)


def _gated_delta_net(s: ModelStructure) -> list[tuple[str, Tensors, Shard, bool]]:
    """Tensors of a gated-DeltaNet layer's ``linear_attn`` under the model's own names (transformers
    5.24 ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``). Under TP every tensor is split by
    heads as vLLM shards it (in projections column-parallel, the depthwise conv by channel, the
    per-head decay ``A_log`` and ``dt_bias`` by value head, ``out_proj`` row-parallel), except the
    gated norm's weight, one value head wide and replicated."""
    lin, h = s.linear, s.hidden_size
    assert lin is not None
    key, value = lin.num_key_heads * lin.key_head_dim, lin.num_value_heads * lin.value_head_dim
    heads = lin.num_value_heads
    if s.model_type in _FUSED_IN_PROJ:
        in_proj: Tensors = [
            ("linear_attn.in_proj_qkvz.weight", (2 * key + 2 * value, h)),
            ("linear_attn.in_proj_ba.weight", (2 * heads, h)),
        ]
    else:
        in_proj = [
            ("linear_attn.in_proj_qkv.weight", (2 * key + value, h)),
            ("linear_attn.in_proj_z.weight", (value, h)),
            ("linear_attn.in_proj_b.weight", (heads, h)),
            ("linear_attn.in_proj_a.weight", (heads, h)),
        ]
    decay: Tensors = [("linear_attn.dt_bias", (heads,)), ("linear_attn.A_log", (heads,))]
    conv = lin.conv_state
    return [
        ("in_proj", in_proj, "tp", True),
        ("conv1d", [("linear_attn.conv1d.weight", (conv.channels, 1, conv.kernel))], "tp", False),
        ("decay", decay, "tp", False),
        ("norm", [("linear_attn.norm.weight", (lin.value_head_dim,))], "replicated", False),
        ("out_proj", [("linear_attn.out_proj.weight", (h, value))], "tp", True),
    ]


# KDA families whose decay and output gate are low-rank pairs (f_a_proj -> f_b_proj, g_a_proj -> g_b_proj,
# ``A_log`` [1, 1, H, 1]); the others (Bailing-hybrid) project them at full rank (f_proj, g_proj; A_log [H])
_LOW_RANK_KDA_GATES = ("kimi_linear",)


def _kda(s: ModelStructure) -> list[tuple[str, Tensors, Shard, bool]]:
    """Tensors of a KDA layer's ``self_attn`` under the model's own names (transformers 5.24
    ``KimiLinearDeltaAttention`` / ``BailingHybridDeltaAttention``): q, k, v and the per-head beta
    projections, the q/k/v depthwise conv (no bias), the per-channel decay (its projections, ``dt_bias``
    one per channel, ``A_log`` one per head), the output gate, the per-head gated norm and ``o_proj``.
    Split over TP by heads as vLLM shards them, except the low-rank halves (``f_a_proj``, ``g_a_proj``:
    ``ReplicatedLinear``) and the norm, one head wide."""
    lin, h = s.linear, s.hidden_size
    assert lin is not None
    heads, d = lin.num_value_heads, lin.value_head_dim
    width = heads * d
    proj: Tensors = [(f"self_attn.{n}_proj.weight", (width, h)) for n in "qkv"]
    proj.append(("self_attn.b_proj.weight", (heads, h)))
    if s.model_type in _LOW_RANK_KDA_GATES:
        low_rank: Tensors = [
            ("self_attn.forget_gate.f_a_proj.weight", (d, h)),
            ("self_attn.g_a_proj.weight", (d, h)),
        ]
        gates: Tensors = [
            ("self_attn.forget_gate.f_b_proj.weight", (width, d)),
            ("self_attn.g_b_proj.weight", (width, d)),
        ]
        a_log: tuple[int, ...] = (1, 1, heads, 1)
    else:
        low_rank = []
        gates = [("self_attn.forget_gate.f_proj.weight", (width, h)), ("self_attn.g_proj.weight", (width, h))]
        a_log = (heads,)
    decay: Tensors = [("self_attn.forget_gate.dt_bias", (width,)), ("self_attn.forget_gate.A_log", a_log)]
    conv = lin.conv_state
    rows: list[tuple[str, Tensors, Shard, bool]] = [
        ("proj", proj, "tp", True),
        ("conv1d", [("self_attn.conv1d.weight", (conv.channels, 1, conv.kernel))], "tp", False),
        ("gates", gates, "tp", True),
        ("decay", decay, "tp", False),
        ("o_norm", [("self_attn.o_norm.weight", (d,))], "replicated", False),
        ("o_proj", [("self_attn.o_proj.weight", (h, width))], "tp", True),
    ]
    if low_rank:
        rows.append(("gates_low_rank", low_rank, "replicated", True))
    return rows


# Mamba2 families whose decoder layer calls its mixer ``mamba`` (the others, Mamba2 and Nemotron-H: ``mixer``)
_MAMBA_ATTRIBUTE = ("granitemoehybrid", "bamba", "zamba2", "falcon_h1")


def _mamba2(s: ModelStructure) -> list[tuple[str, Tensors, Shard, bool]]:
    """Tensors of a Mamba2 layer's mixer under the model's own names (transformers 5.24 ``Mamba2Mixer``,
    ``NemotronHMamba2Mixer``, ``BambaMixer``, ``GraniteMoeHybridMambaLayer``): ``in_proj`` to z, x, B, C
    and dt (I + I + 2 G N + H rows, I = H P), the depthwise conv over x, B and C with its bias (every
    family's default), ``dt_bias``, ``A_log`` and ``D`` per head, the gated norm over I (where the config
    keeps one: Falcon-H1's ``mamba_rms_norm``, ``LinearAttention.gated_norm``) and ``out_proj``.
    All split over TP by heads and groups as vLLM's ``MambaMixer2`` shards them (the norm too: its
    groups are whole on a rank). Projection biases (off in every shipped config) are not counted."""
    lin, h = s.linear, s.hidden_size
    assert lin is not None
    inner = lin.num_value_heads * lin.value_head_dim
    conv, heads = lin.conv_state, lin.num_value_heads
    mixer = "mamba" if s.model_type in _MAMBA_ATTRIBUTE else "mixer"
    conv_tensors: Tensors = [
        (f"{mixer}.conv1d.weight", (conv.channels, 1, conv.kernel)),
        (f"{mixer}.conv1d.bias", (conv.channels,)),
    ]
    rows: list[tuple[str, Tensors, Shard, bool]] = [
        ("in_proj", [(f"{mixer}.in_proj.weight", (inner + conv.channels + heads, h))], "tp", True),
        ("conv1d", conv_tensors, "tp", False),
        ("decay", [(f"{mixer}.{n}", (heads,)) for n in ("dt_bias", "A_log", "D")], "tp", False),
        ("norm", [(f"{mixer}.norm.weight", (inner,))], "tp", False),
        ("out_proj", [(f"{mixer}.out_proj.weight", (h, inner))], "tp", True),
    ]
    return [row for row in rows if row[0] != "norm" or lin.gated_norm]


# Mamba1 families whose decoder layer calls its mixer ``mamba`` (Mamba and Falcon-Mamba: ``mixer``), and
# those whose dt/B/C norms carry weights (Falcon-Mamba's are weightless buffers)
_MAMBA1_ATTRIBUTE = ("jamba",)
_MAMBA1_NORMED = ("jamba",)


def _mamba1(s: ModelStructure) -> list[tuple[str, Tensors, Shard, bool]]:
    """Tensors of a Mamba1 layer's mixer under the model's own names (transformers 5.24 ``MambaMixer``,
    ``FalconMambaMixer``, ``JambaMambaMixer``): ``in_proj`` to x and the gate (2 I rows), the depthwise
    conv over x with its bias, ``x_proj`` to dt (rank R), B and C (N each), ``dt_proj`` back to I with its
    bias, ``A_log`` ``[I, N]`` and ``D`` per channel, ``out_proj``; Jamba's dt/B/C RMS norms. Split over TP
    by channels as vLLM's ``MambaMixer`` shards them (``x_proj`` row-parallel, its small output whole)."""
    lin, h = s.linear, s.hidden_size
    assert lin is not None and lin.dt_rank is not None
    conv, state, rank = lin.conv_state, lin.key_head_dim, lin.dt_rank
    inner = conv.channels
    mixer = "mamba" if s.model_type in _MAMBA1_ATTRIBUTE else "mixer"
    conv_tensors: Tensors = [
        (f"{mixer}.conv1d.weight", (inner, 1, conv.kernel)),
        (f"{mixer}.conv1d.bias", (inner,)),
    ]
    dt: Tensors = [(f"{mixer}.dt_proj.weight", (inner, rank)), (f"{mixer}.dt_proj.bias", (inner,))]
    decay: Tensors = [(f"{mixer}.A_log", (inner, state)), (f"{mixer}.D", (inner,))]
    rows: list[tuple[str, Tensors, Shard, bool]] = [
        ("in_proj", [(f"{mixer}.in_proj.weight", (2 * inner, h))], "tp", True),
        ("conv1d", conv_tensors, "tp", False),
        ("x_proj", [(f"{mixer}.x_proj.weight", (rank + 2 * state, inner))], "tp", True),
        ("dt_proj", dt, "tp", True),
        ("decay", decay, "tp", False),
        ("out_proj", [(f"{mixer}.out_proj.weight", (h, inner))], "tp", True),
    ]
    if s.model_type in _MAMBA1_NORMED:
        widths = (("dt", rank), ("b", state), ("c", state))
        norms = [(f"{mixer}.{n}_layernorm.weight", (w,)) for n, w in widths]
        rows.append(("norms", norms, "replicated", False))
    return rows


def _mamba1_heads(s: ModelStructure) -> list[tuple[str, Tensors, Shard, bool]]:
    """Tensors of a multi-head Mamba1 mixer under the model's own names (transformers 5.24
    ``ZambaMambaMixer``, at ``mamba``): ``in_proj`` to x and the gate (2 I rows), the depthwise conv over x
    with its bias, per head ``x_proj_weight`` to dt (rank R), B and C and ``dt_proj_weight`` back to the
    head's channels with its bias, ``A_log`` ``[heads, P, N]`` and ``D``, ``out_proj``. Split over TP by
    heads (each head's scan is whole on a rank)."""
    lin, h = s.linear, s.hidden_size
    assert lin is not None and lin.dt_rank is not None
    heads, width, state, rank = lin.num_value_heads, lin.value_head_dim, lin.key_head_dim, lin.dt_rank
    inner, kernel = heads * width, lin.conv_state.kernel
    conv_tensors: Tensors = [("mamba.conv1d.weight", (inner, 1, kernel)), ("mamba.conv1d.bias", (inner,))]
    projections: Tensors = [
        ("mamba.x_proj_weight", (heads, rank + 2 * state, width)),
        ("mamba.dt_proj_weight", (heads, width, rank)),
        ("mamba.dt_proj_bias", (heads, width)),
    ]
    decay: Tensors = [("mamba.A_log", (heads, width, state)), ("mamba.D", (heads, width))]
    return [
        ("in_proj", [("mamba.in_proj.weight", (2 * inner, h))], "tp", True),
        ("conv1d", conv_tensors, "tp", False),
        ("head_proj", projections, "tp", False),
        ("decay", decay, "tp", False),
        ("out_proj", [("mamba.out_proj.weight", (h, inner))], "tp", True),
    ]


def _lightning(s: ModelStructure) -> list[tuple[str, Tensors, Shard, bool]]:
    """Tensors of a lightning-attention layer's ``self_attn`` under the model's own names (transformers
    5.24 ``MiniMaxLightningAttention``): the fused q/k/v projection, the sigmoid output gate, the RMS
    norm over every head and ``out_proj``; no conv, no bias. Its decay rates are persistent buffers the
    class computes from the heads and the prefill block ``L`` (the slope per head, the query and key
    decay ``[H, L, 1]`` inside a block, the causal ``[1, H, L, L]`` decay between its tokens): they are
    in the model's state dict, so plan counts them (MiniMax-Text-01: 4.2 M per layer, 0.07% of the
    model). Split over TP by heads as vLLM's ``MiniMaxText01LinearAttention`` shards them, its norm too."""
    lin, h = s.linear, s.hidden_size
    assert lin is not None and lin.block_size is not None
    heads, block = lin.num_value_heads, lin.block_size
    width = heads * lin.value_head_dim
    decay: Tensors = [
        ("self_attn.slope_rate", (heads, 1, 1)),
        ("self_attn.query_decay", (heads, block, 1)),
        ("self_attn.key_decay", (heads, block, 1)),
        ("self_attn.diagonal_decay", (1, heads, block, block)),
    ]
    return [
        ("qkv_proj", [("self_attn.qkv_proj.weight", (3 * width, h))], "tp", True),
        ("output_gate", [("self_attn.output_gate.weight", (width, h))], "tp", True),
        ("norm", [("self_attn.norm.weight", (width,))], "tp", False),
        ("decay", decay, "tp", False),
        ("out_proj", [("self_attn.out_proj.weight", (h, width))], "tp", True),
    ]


def _short_conv(s: ModelStructure) -> list[tuple[str, Tensors, Shard, bool]]:
    """Tensors of a gated short convolution's ``conv`` under the model's own names (transformers 5.24
    ``Lfm2ShortConv``): ``in_proj`` to B, C and x (3 hidden rows), the depthwise ``conv`` over B * x and
    ``out_proj``; no bias (``conv_bias`` false in every published config). Split over TP by channels as
    vLLM's ``ShortConv`` shards them (``in_proj`` column-parallel, ``out_proj`` row-parallel)."""
    lin, h = s.linear, s.hidden_size
    assert lin is not None
    conv = lin.conv_state
    return [
        ("in_proj", [("conv.in_proj.weight", (3 * conv.channels, h))], "tp", True),
        ("conv", [("conv.conv.weight", (conv.channels, 1, conv.kernel))], "tp", False),
        ("out_proj", [("conv.out_proj.weight", (h, conv.channels))], "tp", True),
    ]


# Per linear-attention kind: the tensors of one linear layer, and the prefix of their group names
LINEAR_TENSORS = {
    "gated_delta_net": (_gated_delta_net, "linear_attn"),
    "kda": (_kda, "kda"),
    "mamba2": (_mamba2, "mamba2"),
    "mamba1": (_mamba1, "mamba1"),
    "mamba1_heads": (_mamba1_heads, "mamba1_heads"),
    "short_conv": (_short_conv, "short_conv"),
    "lightning": (_lightning, "lightning"),
}
PRICED_MIXERS = tuple(LINEAR_TENSORS)
