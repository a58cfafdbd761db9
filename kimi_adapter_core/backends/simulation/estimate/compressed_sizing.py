"""What DeepSeek-V4's compressed layers (``hca``, ``csa``) keep per request besides their sliding window.

Each such layer's sliding K=V window is sized with the other attention layers (``KvSizing``'s windows);
its compressor adds one entry of ``head_dim`` every ``rate`` tokens (``floor(T / rate)`` entries: grows
with the context, ``rate`` times slower than a KV cache) and the open window's raw ``kv || gate``
projections (``rate x 2 x head_dim``: constant per request; transformers keeps ``T mod rate`` of them,
kadapt's static ring all ``rate``). A csa layer's compressor overlaps two windows (a ring of ``2 x rate``
rows of twice the width) and its Lightning indexer keeps compressed keys of its own the same way
(``floor(T / rate)`` keys of ``index_head_dim``: the indexer cache grows with the context too). The
compressors have one head, shared by every query head, so every TP rank keeps all of it (replicated, as
the K=V head is).
"""

from __future__ import annotations

from dataclasses import dataclass

from ....structure.model import Compressor


@dataclass(frozen=True)
class CompressedKind:
    """The layers of one compressed kind and their compressor."""

    kind: str  # hca | csa
    compressor: Compressor
    layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class CompressedSizing:
    """The compressed layers' entries and rings, in the KV cache's dtype (``bytes_per_elem``)."""

    kinds: tuple[CompressedKind, ...]
    bytes_per_elem: int

    @property
    def layers(self) -> int:
        return sum(len(k.layer_ids) for k in self.kinds)

    def entry_bytes(self, tokens: int) -> int:
        """The entries (and csa indexer keys) of a sequence of ``tokens`` across the compressed layers."""
        return sum(
            len(k.layer_ids) * (tokens // k.compressor.rate) * k.compressor.entry_bytes(self.bytes_per_elem)
            for k in self.kinds
        )

    def ring_bytes(self) -> int:
        """The open windows' raw projections of one request across the compressed layers (constant)."""
        return sum(len(k.layer_ids) * k.compressor.ring_bytes(self.bytes_per_elem) for k in self.kinds)

    def bytes(self, tokens: int) -> int:
        """Everything the compressors of one sequence of ``tokens`` keep."""
        return self.entry_bytes(tokens) + self.ring_bytes()

    def describe(self, tokens: int) -> str:
        parts = []
        for k in self.kinds:
            c = k.compressor
            width = f"({c.head_dim} + indexer {c.indexer.head_dim})" if c.indexer is not None else c.head_dim
            rows = c.overlap * c.rate
            parts.append(
                f"{len(k.layer_ids)} {k.kind} layers x (floor({tokens}/{c.rate}) entries x {width} + ring "
                f"{rows} x 2 x {c.overlap} x {width})"
            )
        return f"({' + '.join(parts)}) x {self.bytes_per_elem} B"
