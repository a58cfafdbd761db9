"""The gated-DeltaNet kernels a serving runtime runs in a hybrid stack's linear-attention layers.

transformers' eager gated DeltaNet (``Qwen3NextGatedDeltaNet``, ``Qwen3_5GatedDeltaNet``) unrolls its
chunked scan in Python, one step per 64-token chunk, in float32: traced op by op it would price
hundreds of small kernels no runtime launches. vLLM, SGLang and TensorRT-LLM run four kernels
instead (FLA's ``causal_conv1d_fn`` + ``chunk_gated_delta_rule`` in prefill, ``causal_conv1d_update``
+ the fused recurrent update in decode), which is also what AIConfigurator measured
(``gdn_perf``). So the layer's module is swapped for ``RankGatedDeltaNet``, which adopts the
module's own projections, norm and output projection by name (traced like every other GEMM and
vector op: the in projections merge as serving runtimes load them) and records the convolution and
the scan as analytic ``linear_attention`` kernels (formulas in docs/cost_model.md):

- prefill, ``causal_conv1d_fn``: ``2 T C K`` FLOPs over ``T`` new tokens, ``C`` conv channels
  (q, k and v of this rank's heads) and kernel ``K``; it reads and writes the activations, reads
  the weights and the previous window (after a cached context) and writes the new window.
- prefill, ``chunk_gated_delta_rule`` (chunk ``L`` = 64): per token and value head
  ``6 L dk + 4 L dv`` FLOPs inside a chunk (the K Kᵀ block, the WY transform of k and v, the causal
  q Kᵀ block and its product with v) and ``6 dk dv`` against the state (w S, the state update
  Kᵀ v, q S); q, k, v, o and the float32 gates cross HBM once, the float32 state is read after a
  cached context and written once per request.
- decode, ``causal_conv1d_update``: the same FLOPs per token; the window read and written.
- decode, the fused recurrent update: ``7 dk dv`` FLOPs per token and value head (decay, kᵀ S, the
  rank-1 update, q S); the float32 state read and written once per request and step. Its time does
  not grow with the context, where an attention layer's KV read does.

Bound to a recorder and a deployment per trace (``bind``), like the other serving kernels.
``RankLinearMixer`` holds what every mixer kind shares (the conv, a scan's state traffic); the KDA
and Mamba2 kernels are in ``ssm_kernels``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from ....errors import KadaptError
from .deployment import Deployment
from .tracer import Recorder

CHUNK = 64  # FLA's chunk_gated_delta_rule block (transformers' torch_chunk_gated_delta_rule: 64 too)
STATE_BYTES = 4  # the recurrent state and the gates are float32 in every runtime's kernels
ACTIVATION_BYTES = 2  # bf16 q, k, v, o and conv window
KERNEL = "gated_delta_net"
# The chunked scan's FLOPs are priced at the fp32 peak, not the bf16 tensor-core one: its chunks run
# one after another per sequence and head (the state carries over), so a prefill keeps few SMs busy
# and FLA's kernel reaches about the fp32 roofline. AIConfigurator's measured SGLang 0.5.14 rows on
# H200 (gdn_perf, Qwen3-Next's TP8 shape: 2 key / 4 value heads x 128): 0.57 ms for 8 x 4,096 tokens
# and 0.13 ms for 1 x 4,096, where the fp32 roofline at the profile's efficiency gives 0.50 and 0.06
# ms and the bf16 one 0.03 and 0.004 ms.
SCAN_COMPUTE = "fp32"

# what the adopted module must have (both families' names); the in projections are fused (Qwen3-Next)
# or split (Qwen3.5)
FIELDS = ("conv1d", "norm", "out_proj", "A_log", "dt_bias")
SIZES = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel_size")
IN_PROJECTIONS = (("in_proj_qkvz", "in_proj_ba"), ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))


def is_gated_delta_net(module: nn.Module) -> bool:
    """Whether ``module`` is a gated-DeltaNet mixer this kernel can adopt (by its attribute names)."""
    return all(hasattr(module, name) for name in (*FIELDS, *SIZES)) and any(
        all(hasattr(module, name) for name in names) for names in IN_PROJECTIONS
    )


class RankLinearMixer(nn.Module):
    """What every linear-attention / SSM mixer's serving kernels share (gated DeltaNet here, KDA and
    Mamba2 in ``ssm_kernels``): bound to a recorder and a deployment per trace, a causal depthwise conv
    over ``channels`` x ``kernel`` on this rank, and a scan whose fixed-size state a decode step reads
    and writes once per request."""

    kernel: int

    def bind(self, rec: Recorder, dep: Deployment) -> None:
        """Record the next forward into ``rec`` at the shapes of ``dep``."""
        self.rec, self.dep = rec, dep

    @property
    def channels(self) -> int:
        """Conv channels on this rank."""
        raise NotImplementedError

    def _attrs(self, source: str, b: int, s: int, hidden: int) -> dict[str, Any]:
        """What the op carries for a cost model (the kernel's sizes on this rank)."""
        raise NotImplementedError

    def _record_conv(self, b: int, s: int, hidden: int) -> None:
        """The causal depthwise conv over the new tokens (with its SiLU); decode: the window update."""
        channels, kernel, tokens = self.channels, self.kernel, b * s
        window = b * channels * kernel * ACTIVATION_BYTES
        # prefill after a cached context reads the previous window; every step writes the new one
        previous = window if self.dep.decode or self.dep.context_len else 0
        nbytes = 2 * tokens * channels * ACTIVATION_BYTES + channels * kernel * ACTIVATION_BYTES
        source = "causal_conv1d_update" if self.dep.decode else "causal_conv1d_fn"
        self.rec.analytic(
            source,
            "linear_attention",
            flops=2 * tokens * channels * kernel,
            nbytes=nbytes + previous + window,
            compute="vector",
            shapes=f"B{b} q{s} C{channels} K{kernel}",
            attrs=self._attrs(source, b, s, hidden),
        )

    def _record_scan(
        self,
        source: str,
        compute: str,
        flops: float,
        io: float,
        state: float,
        shapes: str,
        attrs: dict[str, Any],
    ) -> None:
        """A scan kernel: ``io`` bytes of activations and gates, and the float32 ``state`` bytes of the
        batch read and written per decode step; a prefill writes it once (and reads it after a context)."""
        if self.dep.decode:
            nbytes = io + 2 * state  # read and write every request's state
        else:
            nbytes = io + state + (state if self.dep.context_len else 0)  # written; read after a context
        self.rec.analytic(
            source,
            "linear_attention",
            flops=flops,
            nbytes=nbytes,
            compute=compute,
            shapes=shapes,
            attrs=attrs,
        )


class Mamba1Scan(RankLinearMixer):
    """What a Mamba1 selective scan records, whether its channels form one scan (``ssm_kernels.
    RankMamba1``) or per-head scans (``mamba_heads_kernels.RankMamba1Heads``): x, z, dt and y in bf16 per
    channel, B and C (``state_size`` each) per group of channels, A and the state ``[channels,
    state_size]`` in float32; ``selective_scan_fn`` in prefill, ``selective_state_update`` in decode."""

    state_size: int
    bc_groups = 1  # the groups of channels that read their own B and C (one scan: one)

    def _scan_shapes(self, b: int, s: int) -> str:
        """The scan's shape label."""
        raise NotImplementedError

    def _attrs(self, source: str, b: int, s: int, hidden: int) -> dict[str, Any]:
        return {
            "kernel": "mamba1",
            "decode": self.dep.decode,
            "batch": b,
            "seq": s,
            "hidden": hidden,
            "conv": self.kernel,
            "channels": self.channels,
            "state_size": self.state_size,
        }

    def _record_selective_scan(self, b: int, s: int, hidden: int) -> None:
        i, n, tokens = self.channels, self.state_size, b * s
        io = tokens * (4 * i + 2 * n * self.bc_groups) * ACTIVATION_BYTES + i * n * STATE_BYTES
        source = "selective_state_update" if self.dep.decode else "selective_scan_fn"
        flops = tokens * i * (7 * n + 3)
        state = b * i * n * STATE_BYTES
        attrs = self._attrs(source, b, s, hidden)
        self._record_scan(source, "vector", flops, io, state, self._scan_shapes(b, s), attrs)


class RankGatedDeltaNet(RankLinearMixer):
    """A gated-DeltaNet mixer as serving runtimes run it, around the adopted module's projections
    (adopted, not patched: no class is modified). Called as transformers calls the mixer:
    ``(hidden_states, cache=None, attention_mask=None, **kwargs)`` -> the output hidden states."""

    def __init__(self, inner: nn.Module, rec: Recorder, dep: Deployment) -> None:
        super().__init__()
        if not is_gated_delta_net(inner):
            raise KadaptError(
                f"{type(inner).__name__} is not a gated DeltaNet kadapt can price: it needs "
                f"{', '.join((*FIELDS, *SIZES))} and the in projections of Qwen3-Next or Qwen3.5"
            )
        for name, child in inner.named_children():  # adopt the real projections, conv and norm by name
            setattr(self, name, child)
        for name, param in inner.named_parameters(recurse=False):  # A_log, dt_bias (the same tensors)
            setattr(self, name, param)
        self.projections = next(names for names in IN_PROJECTIONS if all(hasattr(inner, n) for n in names))
        self.key_heads, self.value_heads = int(inner.num_k_heads), int(inner.num_v_heads)
        self.key_dim, self.value_dim = int(inner.head_k_dim), int(inner.head_v_dim)
        self.kernel = int(inner.conv_kernel_size)
        self.bind(rec, dep)

    @property
    def channels(self) -> int:
        """Conv channels on this rank: q and k of the key heads, v of the value heads."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def forward(self, hidden_states: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        b, s, hidden = hidden_states.shape
        projected = [getattr(self, name)(hidden_states) for name in self.projections]
        value = self.value_heads * self.value_dim
        # the output gate z: the tail of the fused qkvz (in its per-key-head layout: same bytes), or in_proj_z
        gate = projected[0][..., -value:] if len(projected) == 2 else projected[1]
        self._record_conv(b, s, hidden)
        self._record_delta_rule(b, s, hidden)
        rows = (b * s * self.value_heads, self.value_dim)
        core = torch.empty(rows, dtype=hidden_states.dtype, device=hidden_states.device)
        normed = self.norm(core, gate.reshape(-1, self.value_dim))
        return self.out_proj(normed.reshape(b, s, value))

    def _attrs(self, source: str, b: int, s: int, hidden: int) -> dict[str, Any]:
        """What the measured cost model keys the kernel by (AIConfigurator's ``Gdn`` op)."""
        return {
            "kernel": KERNEL,
            "source_kernel": source,
            "decode": self.dep.decode,
            "batch": b,
            "seq": s,
            "hidden": hidden,
            "conv": self.kernel,
            "key_heads": self.key_heads,
            "key_dim": self.key_dim,
            "value_heads": self.value_heads,
            "value_dim": self.value_dim,
        }

    def _record_delta_rule(self, b: int, s: int, hidden: int) -> None:
        """The gated delta rule: the chunked scan in prefill, the recurrent update in decode."""
        hk, hv, dk, dv, tokens = self.key_heads, self.value_heads, self.key_dim, self.value_dim, b * s
        io = tokens * (2 * hk * dk + 2 * hv * dv) * ACTIVATION_BYTES + tokens * 2 * hv * STATE_BYTES
        if self.dep.decode:
            source, compute = "fused_sigmoid_gating_delta_rule_update", "vector"
            flops = tokens * hv * 7 * dk * dv
        else:
            source, compute = "chunk_gated_delta_rule", SCAN_COMPUTE
            flops = tokens * hv * (6 * CHUNK * dk + 4 * CHUNK * dv + 6 * dk * dv)
        state = b * hv * dk * dv * STATE_BYTES
        shapes = f"B{b} q{s} Hk{hk} Hv{hv} dk{dk} dv{dv}"
        self._record_scan(source, compute, flops, io, state, shapes, self._attrs(source, b, s, hidden))


class RankLinear(nn.Module):
    """An adopted ``nn.Linear`` as one TP rank runs it: column-parallel (``split="rows"``: 1/tp of the
    output rows and bias), row-parallel (``"columns"``: 1/tp of the input columns; the bias is added
    once) or replicated (``"none"``). The weight is sliced as a view, so the recorder charges it the
    format of the adopted weight."""

    def __init__(self, inner: nn.Module, tp: int, split: str) -> None:
        super().__init__()
        self.inner, self.tp, self.split = inner, tp, split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.inner.weight, self.inner.bias
        if self.split == "rows":
            weight = weight[: weight.shape[0] // self.tp]
            bias = None if bias is None else bias[: bias.shape[0] // self.tp]
        elif self.split == "columns":
            weight = weight[:, : weight.shape[1] // self.tp]
        return F.linear(x, weight, bias)
