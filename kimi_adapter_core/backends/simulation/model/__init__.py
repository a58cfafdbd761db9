"""The per-rank model."""
