"""Hyper-connections: residual streams a config keeps between its decoder layers (HY-V4, DeepSeek-V4).

A config with ``hc_mult = n > 1`` makes the model's forward copy the input embeddings into ``n`` streams,
each layer collapse and write back to them itself, and the stack's ``hc_head`` merge them before the
final norm. The wrappers reproduce the copy and the merge (the runtime's ``ResidualStreams``); what the
connections hold (with or without DeepSeek-V4's stream-mixing ``comb`` matrix) is family code, kept as
data by model type (``config_keys.yaml`` ``residual_streams``), so plan sizes them. A family that sets
the key and is not in the table is refused: its connections' weights are not known.
"""

from __future__ import annotations

from ..errors import Refusal
from .around_layers import ResidualStreams
from .reader import MISSING, Reader, locate, tables

# where the stack keeps the head that merges the streams (transformers 5.24: HY-V4, DeepSeek-V4)
STREAM_HEAD = "hc_head"


def residual_streams_of(read: Reader) -> ResidualStreams | None:
    """The stack's residual streams (None: one, the config sets no stream count above 1)."""
    rules = tables()["residual_streams"]
    key = rules["key"]
    count = read.raw(key)
    if count in (MISSING, None, 1):
        return None
    model_type = read.raw("model_type")
    family = rules["families"].get(model_type)
    if family is None or isinstance(count, bool) or not isinstance(count, int) or count < 1:
        found = f"model type {model_type!r}" if family is None else f"{count!r}"
        raise Refusal(
            "outside-layers",
            f"{read.where}: {key} = {count!r} keeps that many residual streams between the decoder layers "
            "(hyper-connections), and kadapt knows the connections' weights of "
            f"{', '.join(sorted(rules['families']))} and a positive integer count; found {found}",
            location=locate(read.spec, "gate"),
        )
    return ResidualStreams(count=count, comb=bool(family["comb"]))
