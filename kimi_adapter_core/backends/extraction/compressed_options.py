"""The ABI checks of a stack with compressed-attention layers (DeepSeek-V4's ``hca``): the graphs name
their ring and entries, the cache holds whole windows, and the prompt length is static. Apart from
``options.py`` (500-line rule), which calls ``check_compressed`` when it binds the structure."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from ...errors import KadaptError
from ...structure.model import ModelStructure


def check_compressed(
    structure: ModelStructure,
    *,
    names_state: bool,
    max_cache_len: int,
    dynamic: Collection[str],
    names_where: Any,
    dynamic_where: Any,
) -> bool:
    """Whether the stack has compressed layers, after refusing, located, an ABI whose names carry no
    second state pair (``names_state``: the ring and the entries), a ``max_cache_len`` that is not a
    multiple of their rate and a dynamic ``prefill_len``."""
    compressor = structure.compressor
    compressed = compressor is not None
    if compressed and not names_state:
        raise KadaptError(
            f"the model has {structure.layer_kinds.count('hca')} compressed (hca) layers, whose compressor "
            'ring and entries the graphs return: add "<present comp_src {layer}>", "<present comp {layer}>" '
            'to abi.prefill.outputs and abi.decode.outputs, and "<past comp_src {layer}>", "<past comp '
            '{layer}>" to abi.decode.inputs',
            location=names_where,
        )
    if compressor is not None and max_cache_len % compressor.rate:
        raise KadaptError(
            f"abi.max_cache_len {max_cache_len} is not a multiple of the compressed layers' rate "
            f"{compressor.rate}: their entries take max_cache_len / rate slots; use a multiple of it",
            location=names_where,
        )
    if compressed and "prefill_len" in dynamic:
        raise KadaptError(
            "dynamic prefill_len cannot be exported for a stack with compressed (hca) layers: the prompt's "
            "closed windows (prefill_len // rate entries) and the ring's placement are read from its length; "
            "export a static prefill_len (one prefill graph per length you serve)",
            location=dynamic_where,
        )
    return compressed
