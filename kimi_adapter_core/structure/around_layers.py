"""What a model's forward computes around its decoder layers, as the structure states it.

Math on what enters the first layer and on the logits (``OutsideOp``), the per-layer inputs a stack
computes once per call for every layer (``PerLayerInputs``: Gemma-4's PLE) and the residual streams
it keeps between its layers (``ResidualStreams``: hyper-connections). The ABI wrappers reproduce each;
``derive`` reads them from the config; ``model.ModelStructure`` holds them.
"""

from __future__ import annotations

from dataclasses import dataclass

OUTSIDE_SITES = ("embeddings", "logits")
OUTSIDE_OPS = ("mul", "div", "softcap")


@dataclass(frozen=True)
class OutsideOp:
    """Math a family does outside its decoder layers, which the ABI wrappers reproduce.

    ``embeddings``: applied to what enters the first decoder layer; ``logits``: after the LM head.
    ``softcap`` is ``tanh(x / value) * value``.
    """

    site: str
    op: str
    value: float
    key: str  # the config key it comes from

    def describe(self) -> str:
        text = {
            "mul": f"x {self.value:g}",
            "div": f"/ {self.value:g}",
            "softcap": f"soft-capped at {self.value:g}",
        }
        return f"{self.site} {text[self.op]} ({self.key})"


@dataclass(frozen=True)
class PerLayerInputs:
    """Per-layer embeddings (Gemma-4's PLE): every decoder layer takes an input of ``width`` of its own,
    computed once per call from a ``[vocab, layers x width]`` token table and a projection of the input
    embeddings; each layer gates, projects and adds it after its MLP."""

    width: int
    vocab: int

    def describe(self) -> str:
        return f"per-layer embeddings {self.width} wide (vocab {self.vocab})"


@dataclass(frozen=True)
class ResidualStreams:
    """Hyper-connections (HY-V4, DeepSeek-V4): ``count`` residual streams between the decoder layers,
    copies of the input embeddings, that each layer's attention and MLP connection collapses into one
    input (``pre``) and writes back to (``post``) with weights computed from the streams, merged by the
    stack's head before the final norm. ``comb``: each connection also mixes the streams among
    themselves (DeepSeek-V4's Sinkhorn-normalised ``count x count`` matrix); HY-V4's does not."""

    count: int
    comb: bool

    @property
    def mixes(self) -> int:
        """The weights one connection computes per token: pre and post per stream, plus the comb matrix."""
        return 2 * self.count + (self.count * self.count if self.comb else 0)

    @property
    def scales(self) -> int:
        """One scale per kind of weight a connection computes (pre, post, and comb where it has one)."""
        return 3 if self.comb else 2

    def describe(self) -> str:
        mixing = ", mixed by Sinkhorn" if self.comb else ""
        return f"{self.count} residual streams (hyper-connections{mixing})"
