"""The KDA, Mamba2, Mamba1 and short-convolution kernels a serving runtime runs in a hybrid stack's
linear / SSM layers.

As for gated DeltaNet (``linear_kernels``), transformers' eager scans (a Python loop over chunks, or
a chunked einsum in float32) are not what an engine launches. vLLM and SGLang run, per layer:

- KDA (Kimi-Linear, Bailing-hybrid; FLA's kernels): ``causal_conv1d_fn`` over q, k and v, then
  ``chunk_kda`` in prefill; ``causal_conv1d_update`` and ``fused_recurrent_kda`` in decode. The
  delta rule of gated DeltaNet with one decay per key channel instead of one per head: the same
  FLOPs per token and head (chunk ``L`` = 64: ``6 L dk + 4 L dv + 6 dk dv`` in prefill, ``7 dk dv``
  in decode), and float32 gates ``dk`` wide per head.
- Mamba2 (Mamba2, Nemotron-H, Granite-4.0-H, Bamba; the ``mamba_ssm`` kernels):
  ``causal_conv1d_fn`` over x, B and C, then ``mamba_chunk_scan_combined`` (SSD) in prefill;
  ``causal_conv1d_update`` and ``selective_state_update`` in decode. SSD per token, with ``G`` B/C
  groups of the state size ``N`` and ``H`` heads of ``P``, chunk ``L`` (the config's chunk size):
  ``2 L N`` per group (C Bᵀ inside the chunk) and ``2 L P + 4 N P`` per head (its product with x, the
  chunk state Bᵀ x and C times the carried state); it runs on tensor cores (the chunks are batched
  matmuls, only the state passing is sequential). The decode update: ``5 P N`` per token and head
  (decay, dt B xᵀ, the sum and C S).
- Mamba1 (Mamba, Falcon-Mamba, Jamba; the ``mamba_ssm`` kernels): ``causal_conv1d_fn`` over x alone,
  ``x_proj`` to dt, B and C (row-parallel: the rank's channels in, all of dt/B/C out), ``dt_proj``, then
  ``selective_scan_fn`` in prefill; ``causal_conv1d_update`` and ``selective_state_update`` in decode.
  The scan has no heads: every channel of ``I`` keeps ``N`` states with its own decay, so per token
  ``7 I N`` (exp(dt A) and its product, dt B x, the sum, C S) plus the skip and gate, in float32 on
  the vector units (the scan is sequential in both phases: no chunked matmul form).
- Zamba's multi-head Mamba1: Mamba1's kernels per SSM head (``mamba_heads_kernels``).
- LFM2's gated short convolution (LFM2, LFM2-MoE, LFM3; vLLM's ``ShortConv``): ``in_proj`` to B, C and
  x (column-parallel), B * x, ``causal_conv1d_fn`` over it in prefill and ``causal_conv1d_update`` in
  decode, C times the result, ``out_proj`` (row-parallel). No scan: its only state is the conv window,
  which ``_record_conv`` reads and writes.
- Lightning attention (MiniMax-Text-01; vLLM's ``MiniMaxText01LinearAttention``): no conv. Prefill runs
  ``lightning_attention`` over blocks of ``L`` tokens (the config's ``block_size``, 256): per token and
  head ``4 L d`` inside its block (q Kᵀ, then its decayed product with V) and ``4 d²`` against the
  state (q times the carried Kᵀ V, the block's decayed Kᵀ V added to it), on tensor cores (the blocks
  are matmuls, only the state passing is sequential); decode runs ``linear_decode_forward_triton``:
  ``5 d²`` per token and head (decay, kᵀ v, the sum and q S) on the vector units. Its state
  ``[H, d, d]`` is in the model's dtype, as plan sizes it (``RecurrentState.dtype`` None).

Each decode step reads and writes every request's state once (a recurrent state in float32 but
lightning's, in the model's dtype as a conv window is); none of them grows with the context. The KDA,
Mamba2, Mamba1 and short-convolution mixers' modules are adopted by attribute name and kept whole (the
built model is not resized for these kinds): a TP engine's rank runs 1/tp of the heads, so the
projections run on their rank's slice of the weight (``RankLinear``, a view: the weight's format follows
it), the gated norms on their slice, and the analytic kernels at the rank's sizes. Lightning attention is
sized by the attention's heads, which ``rank_config`` resizes: its module is built per rank.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from ....errors import KadaptError
from .deployment import Deployment
from .linear_kernels import (
    ACTIVATION_BYTES,
    CHUNK,
    SCAN_COMPUTE,
    STATE_BYTES,
    Mamba1Scan,
    RankGatedDeltaNet,
    RankLinear,
    RankLinearMixer,
    is_gated_delta_net,
)
from .mamba_heads_kernels import RankMamba1Heads, is_mamba1_heads
from .tracer import Recorder

# What each kind's mixer must have (transformers 5.24's KimiLinearDeltaAttention /
# BailingHybridDeltaAttention; Mamba2Mixer, NemotronHMamba2Mixer, BambaMixer, GraniteMoeHybridMambaLayer)
KDA_FIELDS = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "o_norm", "o_proj")
KDA_SIZES = ("num_heads", "head_dim", "conv_kernel_size")
KDA_OUTPUT_GATES = (("g_a_proj", "g_b_proj"), ("g_proj",))  # Kimi: low rank; Bailing: full rank
MAMBA2_FIELDS = ("in_proj", "conv1d", "norm", "out_proj", "A_log", "dt_bias", "D")
MAMBA2_SIZES = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "conv_kernel_size", "chunk_size")
# MambaMixer, FalconMambaMixer, JambaMambaMixer
MAMBA1_FIELDS = ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj", "A_log", "D")
MAMBA1_SIZES = ("intermediate_size", "ssm_state_size", "time_step_rank", "conv_kernel_size")
# Lfm2ShortConv (LFM2-MoE's and LFM3's are its subclasses or copies)
SHORT_CONV_FIELDS = ("in_proj", "conv", "out_proj", "conv_kernel_size")
# MiniMaxLightningAttention
LIGHTNING_FIELDS = ("qkv_proj", "output_gate", "norm", "out_proj", "act_fn", "slope_rate")
LIGHTNING_SIZES = ("num_attention_heads", "head_dim", "block_size")


def _has(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(hasattr(module, name) for name in names)


def is_kda(module: nn.Module) -> bool:
    """Whether ``module`` is a KDA mixer (by its attribute names)."""
    return _has(module, (*KDA_FIELDS, *KDA_SIZES)) and any(_has(module, g) for g in KDA_OUTPUT_GATES)


def is_mamba2(module: nn.Module) -> bool:
    """Whether ``module`` is a Mamba2 mixer (by its attribute names)."""
    return _has(module, (*MAMBA2_FIELDS, *MAMBA2_SIZES))


def is_mamba1(module: nn.Module) -> bool:
    """Whether ``module`` is a Mamba1 mixer (by its attribute names)."""
    return _has(module, (*MAMBA1_FIELDS, *MAMBA1_SIZES))


def is_short_conv(module: nn.Module) -> bool:
    """Whether ``module`` is a gated short convolution (by its attribute names: a ``conv``, where the SSM
    mixers keep a ``conv1d``)."""
    return _has(module, SHORT_CONV_FIELDS) and isinstance(module.conv, nn.Conv1d)


def is_lightning(module: nn.Module) -> bool:
    """Whether ``module`` is a lightning-attention mixer (by its attribute names)."""
    return _has(module, (*LIGHTNING_FIELDS, *LIGHTNING_SIZES))


def _chain(linears: list[tuple[str, nn.Module]], tp: int, width: int) -> nn.Sequential:
    """A gate's projections in order, under their names (Kimi's low-rank pair, or one full-rank
    projection): those ``width`` wide (every head's channels) split by heads, a low-rank one
    replicated (vLLM builds it as a ``ReplicatedLinear``)."""
    split = {name: "rows" if m.out_features == width else "none" for name, m in linears}
    return nn.Sequential(OrderedDict((name, RankLinear(m, tp, split[name])) for name, m in linears))


class RankKDA(RankLinearMixer):
    """A KDA mixer (``self_attn`` of a Kimi-Linear / Bailing-hybrid linear layer) as serving runtimes
    run it at 1/tp of its heads. Called as transformers calls the mixer."""

    def __init__(self, inner: nn.Module, rec: Recorder, dep: Deployment, tp: int) -> None:
        super().__init__()
        if not is_kda(inner):
            raise KadaptError(
                f"{type(inner).__name__} is not a KDA mixer kadapt can price: it needs "
                f"{', '.join((*KDA_FIELDS, *KDA_SIZES))} and g_a_proj + g_b_proj or g_proj"
            )
        self.heads, self.head_dim = int(inner.num_heads) // tp, int(inner.head_dim)
        self.kernel, width = int(inner.conv_kernel_size), int(inner.num_heads) * int(inner.head_dim)
        for name in ("q_proj", "k_proj", "v_proj", "b_proj"):
            setattr(self, name, RankLinear(getattr(inner, name), tp, "rows"))
        forget = [(n, m) for n, m in inner.forget_gate.named_children() if isinstance(m, nn.Linear)]
        self.forget_gate = _chain(forget, tp, width)
        output = next(names for names in KDA_OUTPUT_GATES if _has(inner, names))
        self.output_gate = _chain([(n, getattr(inner, n)) for n in output], tp, width)
        self.o_norm = inner.o_norm  # per head: the rank runs it whole
        self.o_proj = RankLinear(inner.o_proj, tp, "columns")
        self.bind(rec, dep)

    @property
    def channels(self) -> int:
        """Conv channels on this rank: q, k and v of its heads."""
        return 3 * self.heads * self.head_dim

    def forward(self, hidden_states: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        b, s, hidden = hidden_states.shape
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(self, name)(hidden_states)
        self._record_conv(b, s, hidden)
        self.forget_gate(hidden_states)  # the decay's projections; its activation is fused in the scan
        self.b_proj(hidden_states)
        self._record_kda(b, s, hidden)
        gate = self.output_gate(hidden_states)
        rows = (b * s * self.heads, self.head_dim)
        core = torch.empty(rows, dtype=hidden_states.dtype, device=hidden_states.device)
        normed = self.o_norm(core, gate.reshape(rows))
        return self.o_proj(normed.reshape(b, s, self.heads * self.head_dim))

    def _attrs(self, source: str, b: int, s: int, hidden: int) -> dict[str, Any]:
        return {
            "kernel": "kda",
            "decode": self.dep.decode,
            "batch": b,
            "seq": s,
            "hidden": hidden,
            "conv": self.kernel,
            "heads": self.heads,
            "head_dim": self.head_dim,
        }

    def _record_kda(self, b: int, s: int, hidden: int) -> None:
        """FLA's ``chunk_kda`` in prefill, ``fused_recurrent_kda`` in decode: the delta rule's FLOPs,
        with q, k, v, o in bf16 and the per-channel decay g and beta in float32."""
        h, d, tokens = self.heads, self.head_dim, b * s
        io = tokens * 4 * h * d * ACTIVATION_BYTES + tokens * (h * d + h) * STATE_BYTES
        if self.dep.decode:
            source, compute, flops = "fused_recurrent_kda", "vector", tokens * h * 7 * d * d
        else:
            source, compute = "chunk_kda", SCAN_COMPUTE
            flops = tokens * h * (10 * CHUNK * d + 6 * d * d)
        state = b * h * d * d * STATE_BYTES
        shapes = f"B{b} q{s} H{h} d{d}"
        self._record_scan(source, compute, flops, io, state, shapes, self._attrs(source, b, s, hidden))


class RankGatedNorm(nn.Module):
    """Mamba2's gated RMSNorm (``norm(y, z)``: y times SiLU(z), normalized per group of channels) on
    the rank's channels: its groups are whole on a rank, so only the weight is sliced (a view). A mixer
    without the norm (Falcon-H1's ``mamba_rms_norm`` off: an ``Identity``, no weight) gates alone."""

    def __init__(self, inner: nn.Module, group_size: int) -> None:
        super().__init__()
        self.inner, self.group_size = inner, group_size

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        *prefix, width = y.shape
        x = y.float() * F.silu(z.float())
        if getattr(self.inner, "weight", None) is None:
            return x.to(y.dtype)
        grouped = x.view(*prefix, width // self.group_size, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.inner.weight[:width] * grouped.view(*prefix, width).to(y.dtype)


class RankMamba2(RankLinearMixer):
    """A Mamba2 mixer (``mixer`` of Mamba2 / Nemotron-H, ``mamba`` of Granite-4.0-H / Bamba / Falcon-H1,
    whose muP scales of the input and projections are elementwise and left out) as serving
    runtimes run it at 1/tp of its heads and B/C groups. Called as transformers calls the mixer."""

    def __init__(self, inner: nn.Module, rec: Recorder, dep: Deployment, tp: int) -> None:
        super().__init__()
        if not is_mamba2(inner):
            raise KadaptError(
                f"{type(inner).__name__} is not a Mamba2 mixer kadapt can price: it needs "
                f"{', '.join((*MAMBA2_FIELDS, *MAMBA2_SIZES))}"
            )
        self.heads, self.head_dim = int(inner.num_heads) // tp, int(inner.head_dim)
        self.groups, self.state_size = int(inner.n_groups) // tp, int(inner.ssm_state_size)
        self.kernel, self.chunk = int(inner.conv_kernel_size), int(inner.chunk_size)
        self.in_proj = RankLinear(inner.in_proj, tp, "rows")
        self.norm = RankGatedNorm(inner.norm, self.heads * self.head_dim // self.groups)
        self.out_proj = RankLinear(inner.out_proj, tp, "columns")
        self.bind(rec, dep)

    @property
    def channels(self) -> int:
        """Conv channels on this rank: x of its heads, B and C of its groups."""
        return self.heads * self.head_dim + 2 * self.groups * self.state_size

    def forward(self, hidden_states: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        b, s, hidden = hidden_states.shape
        inner = self.heads * self.head_dim
        projected = self.in_proj(hidden_states)  # z, x B C, dt
        self._record_conv(b, s, hidden)
        self._record_ssd(b, s, hidden)
        y = torch.empty(b, s, inner, dtype=hidden_states.dtype, device=hidden_states.device)
        return self.out_proj(self.norm(y, projected[..., :inner]))

    def _attrs(self, source: str, b: int, s: int, hidden: int) -> dict[str, Any]:
        return {
            "kernel": "mamba2",
            "decode": self.dep.decode,
            "batch": b,
            "seq": s,
            "hidden": hidden,
            "conv": self.kernel,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "groups": self.groups,
            "state_size": self.state_size,
            "chunk": self.chunk,
        }

    def _record_ssd(self, b: int, s: int, hidden: int) -> None:
        """``mamba_chunk_scan_combined`` in prefill, ``selective_state_update`` in decode: x, B, C and
        y in bf16, dt in float32, the state [H, P, N] in float32."""
        h, p, g, n, tokens = self.heads, self.head_dim, self.groups, self.state_size, b * s
        io = tokens * (2 * h * p + 2 * g * n) * ACTIVATION_BYTES + tokens * h * STATE_BYTES
        if self.dep.decode:
            source, compute, flops = "selective_state_update", "vector", tokens * h * 5 * p * n
        else:
            source, compute = "mamba_chunk_scan_combined", "bf16"
            flops = tokens * (2 * self.chunk * n * g + h * (2 * self.chunk * p + 4 * n * p))
        state = b * h * p * n * STATE_BYTES
        shapes = f"B{b} q{s} H{h} P{p} G{g} N{n} L{self.chunk}"
        self._record_scan(source, compute, flops, io, state, shapes, self._attrs(source, b, s, hidden))


class RankMamba1(Mamba1Scan):
    """A Mamba1 mixer (``mixer`` of Mamba / Falcon-Mamba, ``mamba`` of Jamba) as serving runtimes run it
    at 1/tp of its inner channels. Called as transformers calls the mixer."""

    def __init__(self, inner: nn.Module, rec: Recorder, dep: Deployment, tp: int) -> None:
        super().__init__()
        if not is_mamba1(inner):
            raise KadaptError(
                f"{type(inner).__name__} is not a Mamba1 mixer kadapt can price: it needs "
                f"{', '.join((*MAMBA1_FIELDS, *MAMBA1_SIZES))}"
            )
        self.inner_size, self.state_size = int(inner.intermediate_size) // tp, int(inner.ssm_state_size)
        self.kernel, self.rank = int(inner.conv_kernel_size), int(inner.time_step_rank)
        self.in_proj = RankLinear(inner.in_proj, tp, "rows")
        self.x_proj = RankLinear(inner.x_proj, tp, "columns")
        self.dt_proj = RankLinear(inner.dt_proj, tp, "rows")
        self.out_proj = RankLinear(inner.out_proj, tp, "columns")
        self.bind(rec, dep)

    @property
    def channels(self) -> int:
        """Conv channels on this rank: its x channels (B and C come after the conv)."""
        return self.inner_size

    def forward(self, hidden_states: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        b, s, hidden = hidden_states.shape
        self.in_proj(hidden_states)  # x and the gate z of the rank's channels
        self._record_conv(b, s, hidden)
        x = torch.empty(b, s, self.inner_size, dtype=hidden_states.dtype, device=hidden_states.device)
        self.dt_proj(self.x_proj(x)[..., : self.rank])  # dt, B, C; dt back to the rank's channels
        self._record_selective_scan(b, s, hidden)
        return self.out_proj(torch.empty_like(x))

    def _scan_shapes(self, b: int, s: int) -> str:
        return f"B{b} q{s} I{self.inner_size} N{self.state_size}"


class RankShortConv(RankLinearMixer):
    """A gated short convolution (``conv`` of an LFM2 / LFM2-MoE / LFM3 conv layer) as serving runtimes run
    it at 1/tp of its channels. Called as transformers calls the mixer."""

    def __init__(self, inner: nn.Module, rec: Recorder, dep: Deployment, tp: int) -> None:
        super().__init__()
        if not is_short_conv(inner):
            raise KadaptError(
                f"{type(inner).__name__} is not a gated short convolution kadapt can price: it needs "
                f"{', '.join(SHORT_CONV_FIELDS)}"
            )
        self.width, self.kernel = int(inner.out_proj.in_features) // tp, int(inner.conv_kernel_size)
        self.in_proj = RankLinear(inner.in_proj, tp, "rows")
        self.out_proj = RankLinear(inner.out_proj, tp, "columns")
        self.bind(rec, dep)

    @property
    def channels(self) -> int:
        """Conv channels on this rank: its slice of the hidden channels."""
        return self.width

    def forward(self, hidden_states: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        b, s, hidden = hidden_states.shape
        gate_b, gate_c, x = self.in_proj(hidden_states).chunk(3, dim=-1)  # the rank's B, C and x
        convolved = torch.empty_like(gate_b * x)  # the conv's output over B * x
        self._record_conv(b, s, hidden)
        return self.out_proj(gate_c * convolved)

    def _attrs(self, source: str, b: int, s: int, hidden: int) -> dict[str, Any]:
        return {
            "kernel": "short_conv",
            "decode": self.dep.decode,
            "batch": b,
            "seq": s,
            "hidden": hidden,
            "conv": self.kernel,
            "channels": self.width,
        }


class RankLightning(RankLinearMixer):
    """A lightning-attention mixer (``self_attn`` of a MiniMax linear layer) as vLLM runs it, around the
    adopted module's projections, norm and activation; built with the rank's heads already. Called as
    transformers calls the mixer, it returns ``(output, None)`` as the decoder layer unpacks it."""

    def __init__(self, inner: nn.Module, rec: Recorder, dep: Deployment) -> None:
        super().__init__()
        if not is_lightning(inner):
            raise KadaptError(
                f"{type(inner).__name__} is not a lightning-attention mixer kadapt can price: it needs "
                f"{', '.join((*LIGHTNING_FIELDS, *LIGHTNING_SIZES))}"
            )
        for name in ("qkv_proj", "output_gate", "norm", "out_proj", "act_fn"):
            setattr(self, name, getattr(inner, name))
        self.heads, self.head_dim = int(inner.num_attention_heads), int(inner.head_dim)
        self.block = int(inner.block_size)  # no conv window: the base class's conv is never recorded
        self.bind(rec, dep)

    def forward(self, hidden_states: torch.Tensor, *_: Any, **__: Any) -> tuple[torch.Tensor, None]:
        b, s, hidden = hidden_states.shape
        self.act_fn(self.qkv_proj(hidden_states))  # SiLU over q, k and v
        self._record_lightning(b, s, hidden)
        width = self.heads * self.head_dim
        core = torch.empty(b, s, width, dtype=hidden_states.dtype, device=hidden_states.device)
        gated = torch.sigmoid(self.output_gate(hidden_states)) * self.norm(core)
        return self.out_proj(gated), None

    def _attrs(self, source: str, b: int, s: int, hidden: int) -> dict[str, Any]:
        return {
            "kernel": "lightning",
            "decode": self.dep.decode,
            "batch": b,
            "seq": s,
            "hidden": hidden,
            "heads": self.heads,
            "head_dim": self.head_dim,
            "block": self.block,
        }

    def _record_lightning(self, b: int, s: int, hidden: int) -> None:
        """``lightning_attention`` in prefill, ``linear_decode_forward_triton`` in decode: q, k, v and o in
        bf16 (the per-head slopes are a few bytes), the state ``[H, d, d]`` in the model's dtype."""
        h, d, tokens = self.heads, self.head_dim, b * s
        io = tokens * 4 * h * d * ACTIVATION_BYTES
        if self.dep.decode:
            source, compute, flops = "linear_decode_forward_triton", "vector", tokens * h * 5 * d * d
        else:
            source, compute = "lightning_attention", "bf16"
            flops = tokens * h * (4 * self.block * d + 4 * d * d)
        state = b * h * d * d * ACTIVATION_BYTES
        shapes = f"B{b} q{s} H{h} d{d} L{self.block}"
        self._record_scan(source, compute, flops, io, state, shapes, self._attrs(source, b, s, hidden))


# the kinds in the order a module is tested (their attribute sets do not overlap)
KINDS = (
    ("gated DeltaNet", is_gated_delta_net),
    ("KDA", is_kda),
    ("Mamba2", is_mamba2),
    ("Mamba1", is_mamba1),
    ("multi-head Mamba1", is_mamba1_heads),
    ("short convolution", is_short_conv),
    ("lightning attention", is_lightning),
)
# the structure's mixer kinds these kernels price (every kind plan sizes)
SIMULATED_MIXERS = ("gated_delta_net", "kda", "mamba2", "mamba1", "mamba1_heads", "short_conv", "lightning")


def linear_mixers(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every linear-attention / SSM mixer of any kind inside a decoder layer."""
    return [(path, m) for path, m in layer.named_modules() if path and any(test(m) for _, test in KINDS)]


def rank_mixer(inner: nn.Module, rec: Recorder, dep: Deployment, tp: int) -> RankLinearMixer:
    """The serving kernels of one mixer found by ``linear_mixers``. A gated DeltaNet and a lightning
    attention are built per rank already (``rank_config`` resizes their heads); KDA, Mamba2 and Mamba1
    mixers are whole and run 1/tp of them, as is a short convolution."""
    if is_gated_delta_net(inner):
        return RankGatedDeltaNet(inner, rec, dep)
    if is_lightning(inner):
        return RankLightning(inner, rec, dep)
    if is_kda(inner):
        return RankKDA(inner, rec, dep, tp)
    if is_mamba1(inner):
        return RankMamba1(inner, rec, dep, tp)
    if is_mamba1_heads(inner):
        return RankMamba1Heads(inner, rec, dep, tp)
    if is_short_conv(inner):
        return RankShortConv(inner, rec, dep, tp)
    return RankMamba2(inner, rec, dep, tp)
