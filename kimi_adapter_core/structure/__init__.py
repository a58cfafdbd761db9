"""The one typed description of a decoder model that every backend and command reads.

``derive`` builds a ``model.ModelStructure`` (attention kind and KV dims, per-layer token mixers,
windows and MLP kinds, MoE, RoPE via ``rope_of``, a hybrid stack's linear attention via ``linear_of``) from a
transformers config object or the raw JSON, by the keys in ``config_keys.yaml``, each value checked
by ``bounds``; ``states`` sizes what a linear-attention layer keeps per request; ``kv_layout`` says
which KV layouts that attention can hold; ``layer_pattern`` finds a per-layer pattern's period and
shortens a stack to it; ``of_spec`` reads a spec's config. Torch-free.
"""
