"""The linear-attention / SSM mixer of a hybrid stack's ``linear`` layers: its kind, its sizes and the
fixed-size states (``states.py``) a layer of it keeps per request.

Apart from ``model.py`` (which holds it as ``ModelStructure.linear``) because the mixer kinds, their
state axes and their descriptions are one job of their own, and ``model.py`` stays under 500 lines.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .states import ConvState, RecurrentState

# Linear-attention / SSM mixers kadapt sizes (``linear_of.MIXERS`` reads each from its config keys), and
# the axes of each one's recurrent state per request (None: a short convolution keeps no such state).
# The geometry is one for all: a mixer reads ``key_heads`` x ``key_dim`` query/key features and
# ``value_heads`` x ``value_dim`` value features through one causal depthwise convolution; Mamba2's B/C
# groups are its key heads and its state size their width, the way SSD reads them as attention. Mamba1's
# selective scan is the same read with one B/C group and one-wide heads, one per inner channel: its state
# is ``[channels, state_size]``. LFM2's gated short convolution convolves the hidden channels (one-wide
# value heads) and keeps nothing else.
RECURRENT_AXES: dict[str, tuple[str, ...] | None] = {
    "gated_delta_net": ("value_heads", "key_dim", "value_dim"),
    "kda": ("value_heads", "key_dim", "value_dim"),
    "mamba2": ("value_heads", "value_dim", "key_dim"),
    "mamba1": ("value_heads", "key_dim"),
    "mamba1_heads": ("value_heads", "value_dim", "key_dim"),
    "short_conv": None,
    "lightning": ("value_heads", "key_dim", "value_dim"),
}
LINEAR_KINDS = tuple(RECURRENT_AXES)
# Mixers with no convolution window: MiniMax's lightning attention keeps only its recurrent state
# ``[heads, head_dim, head_dim]`` (``K^T V`` decayed per head), in its values' dtype (the ABI dtype).
CONV_FREE_KINDS = ("lightning",)
# The ABI layer kind (``runtime.LAYER_STATES``) of a linear layer, by mixer kind: ``linear`` carries a
# conv window and a recurrent state, ``lightning`` the recurrent state alone, ``short_conv`` the conv
# window alone.
LAYER_KIND_OF_MIXER = {"lightning": "lightning", "short_conv": "short_conv"}
# Mixers whose convolution sees the values alone: Mamba1 convolves its inner channels and projects B, C
# and dt from the convolved channels afterwards (``MambaMixer.x_proj``), so its window is ``[channels,
# conv_kernel]``; LFM2's short convolution its hidden channels (``Lfm2ShortConv.conv``, after gating
# them by B).
VALUE_CONV_KINDS = ("mamba1", "mamba1_heads", "short_conv")


@dataclass(frozen=True)
class LinearAttention:
    """The linear-attention / SSM mixer of a hybrid stack's ``linear`` layers: ``kind`` (``RECURRENT_AXES``)
    and the sizes its states follow from. Gated DeltaNet (Qwen3-Next, Qwen3.5) has query/key heads of
    ``key_head_dim`` and value heads of ``value_head_dim``; KDA (Kimi-Linear) as many of each; Mamba2
    ``num_key_heads`` B/C groups of ``key_head_dim`` (the SSM state size) and ``num_value_heads`` heads of
    ``value_head_dim``; Mamba1 one B/C group of ``key_head_dim`` and ``num_value_heads`` inner channels
    of width 1; a short convolution (LFM2) ``num_value_heads`` hidden channels of width 1; lightning
    attention (MiniMax) heads of ``value_head_dim`` with no conv, its prefill blocks ``block_size`` long.
    What it keeps per request is fixed-size: the conv window over all of them and the recurrent state
    (``states.py``; a short convolution the window alone, lightning attention the recurrent state alone)."""

    kind: str  # LINEAR_KINDS
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 0  # 0: no conv window (CONV_FREE_KINDS)
    dt_rank: int | None = None  # Mamba1's dt projection rank (plan sizes x_proj/dt_proj by it); None: others
    # lightning attention's prefill block (plan sizes its decay buffers by it); None: others
    block_size: int | None = None
    # a Mamba2 mixer's gated RMS norm over its inner width (False: Falcon-H1's mamba_rms_norm off, which
    # gates by silu(z) alone and has no norm weight)
    gated_norm: bool = True

    @property
    def conv(self) -> ConvState | None:
        """The conv window: its channels are the projected queries and keys and the values (Mamba1: the
        values alone, ``VALUE_CONV_KINDS``; None: a mixer without one, ``CONV_FREE_KINDS``)."""
        if self.kind in CONV_FREE_KINDS:
            return None
        channels = self.num_value_heads * self.value_head_dim
        if self.kind not in VALUE_CONV_KINDS:
            channels += 2 * self.num_key_heads * self.key_head_dim
        return ConvState(channels, self.conv_kernel)

    @property
    def recurrent(self) -> RecurrentState | None:
        """The recurrent state in the kind's axis order (None: a short convolution keeps none)."""
        axes = RECURRENT_AXES[self.kind]
        if axes is None:
            return None
        sizes = {
            "value_heads": self.num_value_heads,
            "key_dim": self.key_head_dim,
            "value_dim": self.value_head_dim,
        }
        dims = tuple(sizes[axis] for axis in axes)
        return RecurrentState(dims, None) if self.kind in CONV_FREE_KINDS else RecurrentState(dims)

    @property
    def conv_state(self) -> ConvState:
        """The conv window of a mixer that keeps one (all but ``CONV_FREE_KINDS``)."""
        conv = self.conv
        if conv is None:
            raise ValueError(f"a {self.kind} mixer keeps no conv window")
        return conv

    @property
    def layer_kind(self) -> str:
        """The ABI layer kind of this mixer's layers (``LAYER_KIND_OF_MIXER``, else ``linear``)."""
        return LAYER_KIND_OF_MIXER.get(self.kind, "linear")

    @property
    def recurrent_state(self) -> RecurrentState:
        """The recurrent state of a mixer that keeps one (all but a short convolution)."""
        recurrent = self.recurrent
        if recurrent is None:
            raise ValueError(f"a {self.kind} mixer keeps no recurrent state")
        return recurrent

    @property
    def state_names(self) -> tuple[str, ...]:
        """The states a layer of this mixer carries, in ABI order: ``conv`` (but for a mixer without a
        window) and, but for a short convolution, ``recurrent``."""
        return tuple(name for name, _ in self.states)

    @property
    def states(self) -> tuple[tuple[str, ConvState | RecurrentState], ...]:
        """``(name, state)`` of each state a layer of this mixer carries, in ABI order."""
        both = (("conv", self.conv), ("recurrent", self.recurrent))
        return tuple((name, state) for name, state in both if state is not None)

    def state_bytes_per_request(self, abi_dtype_bytes: int) -> int:
        """Bytes one linear layer keeps per request, whatever the context length."""
        return sum(state.bytes_per_request(abi_dtype_bytes) for _, state in self.states)

    def describe(self) -> str:
        return MIXER_TEXT[self.kind].format(**asdict(self))


# How ``describe`` names each mixer, from its sizes
MIXER_TEXT = {
    "gated_delta_net": "gated DeltaNet {num_key_heads}x{key_head_dim} key / "
    "{num_value_heads}x{value_head_dim} value heads, conv {conv_kernel}",
    "kda": "KDA {num_value_heads}x{value_head_dim} heads, conv {conv_kernel}",
    "mamba2": "Mamba2 SSM {num_value_heads}x{value_head_dim} heads, state {key_head_dim}, {num_key_heads} "
    "groups, conv {conv_kernel}",
    "mamba1": "Mamba1 selective scan {num_value_heads} channels, state {key_head_dim}, conv {conv_kernel}",
    "mamba1_heads": "multi-head Mamba1 selective scan {num_value_heads}x{value_head_dim} channels, state "
    "{key_head_dim}, conv {conv_kernel}",
    "short_conv": "gated short convolution {num_value_heads} channels, conv {conv_kernel}",
    "lightning": "lightning attention {num_value_heads}x{value_head_dim} heads, block {block_size}, no conv",
}
