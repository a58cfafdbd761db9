"""Backends that consume an applied spec: ``extraction`` (prefill/decode IR) and ``simulation``.

Kept import-free so that the CLI can name a backend without importing torch.
"""
