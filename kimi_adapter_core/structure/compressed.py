"""The sparse-attention parts of a stack's structure: DeepSeek sparse attention's indexer (DSA) and
DeepSeek-V4's compressors (``hca``, ``csa``). Apart from ``model`` (500-line rule), which re-exports
both as it did when they lived there."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Indexer:
    """DeepSeek sparse attention's indexer (DSA: DeepSeek-V3.2): ``n_heads`` query heads of ``head_dim``
    score every cached key of its own (one ``head_dim`` key per token, beside the layer's KV cache) and
    the attention then sees only each query's ``topk`` best keys."""

    n_heads: int
    head_dim: int
    topk: int

    def bytes_per_token(self, dtype_bytes: int) -> int:
        """The indexer keys one ``indexed`` layer caches per token (grows with the context, like KV)."""
        return self.head_dim * dtype_bytes

    def describe(self) -> str:
        return f"DSA indexer {self.n_heads}x{self.head_dim} top-{self.topk}"


@dataclass(frozen=True)
class Compressor:
    """DeepSeek-V4's compressor of its ``hca`` layers (heavily compressed attention) or ``csa`` layers
    (compressed sparse attention): each closed window of ``rate`` tokens becomes one KV entry of
    ``head_dim`` (a softmax-gated sum of the window's raw projections, normed and roped at the window's
    first position) that the layer attends over beside its sliding window; the open window's raw
    ``kv || gate`` projections wait in a ring. ``overlap`` 2 (csa): an entry mixes the previous window's
    first series with its own second, so the ring keeps two windows of projections twice as wide; its
    Lightning ``indexer`` compresses keys of its own the same way and picks each query's top-k entries."""

    rate: int
    head_dim: int
    overlap: int = 1
    indexer: Indexer | None = None  # csa's Lightning indexer (None: every closed entry is attended)

    def entry_bytes(self, dtype_bytes: int) -> int:
        """One window's entries (and its indexer's key): grows with the context, ``rate`` times slower."""
        index = self.indexer.head_dim if self.indexer is not None else 0
        return (self.head_dim + index) * dtype_bytes

    def ring_bytes(self, dtype_bytes: int) -> int:
        """The open windows' raw projections (the compressor's and its indexer's): constant per request,
        ``overlap x rate`` rows of ``kv || gate``, each ``overlap x width`` wide."""
        index = self.indexer.head_dim if self.indexer is not None else 0
        rows = self.overlap * self.rate
        return rows * 2 * self.overlap * (self.head_dim + index) * dtype_bytes

    def attended(self, closed: int) -> int:
        """The entries a query attends over when ``closed`` windows are closed (csa: its top-k)."""
        return closed if self.indexer is None else min(closed, self.indexer.topk)

    def describe(self) -> str:
        text = f"a compressor of every {self.rate} tokens into one {self.head_dim}-wide entry"
        if self.overlap > 1:
            text += f" over {self.overlap} overlapping windows"
        index = self.indexer
        if index is not None:
            text += f", a Lightning indexer {index.n_heads}x{index.head_dim} top-{index.topk}"
        return text
