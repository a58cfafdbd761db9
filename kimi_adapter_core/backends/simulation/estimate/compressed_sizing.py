"""What DeepSeek-V4's compressed (``hca``) layers keep per request besides their sliding window.

Each such layer's sliding K=V window is sized with the other attention layers (``KvSizing``'s windows);
its compressor adds one entry of ``head_dim`` every ``rate`` tokens (``floor(T / rate)`` entries: grows
with the context, ``rate`` times slower than a KV cache) and the open window's raw ``kv || gate``
projections (``rate x 2 x head_dim``: constant per request; transformers keeps ``T mod rate`` of them,
kadapt's static ring all ``rate``). The compressor has one head, shared by every query head, so every TP
rank keeps all of it (replicated, as the K=V head is).
"""

from __future__ import annotations

from dataclasses import dataclass

from ....structure.model import Compressor


@dataclass(frozen=True)
class CompressedSizing:
    """The compressed layers' entries and rings, in the KV cache's dtype (``bytes_per_elem``)."""

    compressor: Compressor
    layers: int
    bytes_per_elem: int

    def entry_bytes(self, tokens: int) -> int:
        """The entries of a sequence of ``tokens`` across the compressed layers (every TP rank)."""
        entries = tokens // self.compressor.rate
        return self.layers * entries * self.compressor.entry_bytes(self.bytes_per_elem)

    def ring_bytes(self) -> int:
        """The open windows' raw projections of one request across the compressed layers (constant)."""
        return self.layers * self.compressor.ring_bytes(self.bytes_per_elem)

    def bytes(self, tokens: int) -> int:
        """Everything the compressors of one sequence of ``tokens`` keep."""
        return self.entry_bytes(tokens) + self.ring_bytes()

    def describe(self, tokens: int) -> str:
        c = self.compressor
        return (
            f"{self.layers} compressed layers x (floor({tokens}/{c.rate}) entries x {c.head_dim} + ring "
            f"{c.rate} x 2 x {c.head_dim}) x {self.bytes_per_elem} B"
        )
