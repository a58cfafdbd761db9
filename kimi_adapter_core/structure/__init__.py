"""The one typed description of a decoder model that every backend and command reads.

``derive`` builds a ``model.ModelStructure`` (attention kind and KV dims, per-layer windows and MLP
kinds, MoE, RoPE) from a transformers config object or the raw JSON, by the keys in
``config_keys.yaml``; ``kv_layout`` says which KV layouts that attention can hold. Torch-free.
"""
