"""Hyper-connection tensors under transformers' names (5.24 ``HYV4HyperConnection``,
``DeepseekV4HyperConnection``): each layer's attention and MLP connection (``attn_hc``, ``ffn_hc``)
projects the flattened streams to its mixes with ``fn`` and biases and scales them; the stack's
``hc_head`` merges the streams. All float32 (``_keep_in_fp32_modules_strict``), replicated: every rank
mixes the whole hidden state of every stream. Apart from ``params.py`` (500-line rule), which turns
them into parameter groups."""

from __future__ import annotations

from ....structure.model import ModelStructure

Shape = tuple[int, ...]


def _streams(s: ModelStructure) -> tuple[int, int, int, int]:
    """(streams, mixes, scales, flattened width) of a streamed stack."""
    streams = s.residual_streams
    assert streams is not None
    return streams.count, streams.mixes, streams.scales, s.hidden_size * streams.count


def stream_connections(s: ModelStructure) -> list[tuple[str, Shape]]:
    """Each layer's connection tensors, relative to the layer: ``fn`` ``[mixes, streams x hidden]``,
    ``base`` ``[mixes]`` and ``scale`` ``[scales]`` for its attention and its MLP."""
    _, mixes, scales, flat = _streams(s)
    shapes = (("fn", (mixes, flat)), ("base", (mixes,)), ("scale", (scales,)))
    return [(f"{hc}.{name}", shape) for hc in ("attn_hc", "ffn_hc") for name, shape in shapes]


def stream_head_shapes(s: ModelStructure) -> tuple[Shape, Shape, Shape]:
    """The head's ``hc_fn`` ``[streams, streams x hidden]``, ``hc_base`` ``[streams]``, ``hc_scale``
    ``[1]``."""
    count, _, _, flat = _streams(s)
    return (count, flat), (count,), (1,)
