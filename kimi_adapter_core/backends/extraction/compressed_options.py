"""The ABI checks of a stack with compressed-attention layers (DeepSeek-V4's ``hca`` and ``csa``): the
graphs name their rings and entries (a csa layer's indexer's too), the cache holds whole windows, and
the prompt length is static. Apart from
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
    names_index: bool,
    max_cache_len: int,
    dynamic: Collection[str],
    names_where: Any,
    dynamic_where: Any,
) -> bool:
    """Whether the stack has compressed layers, after refusing, located, an ABI whose names carry no
    second state pair (``names_state``: the ring and the entries) or, with csa layers, no indexer pair
    (``names_index``: its ring and entries; without csa layers, one that does), a ``max_cache_len`` that
    is not a multiple of every rate and a dynamic ``prefill_len``."""
    compressors = structure.compressors
    counts = ", ".join(f"{structure.layer_kinds.count(kind)} {kind}" for kind in compressors)
    if compressors and not names_state:
        raise KadaptError(
            f"the model has compressed layers ({counts}), whose compressor ring and entries the graphs "
            'return: add "<present comp_src {layer}>", "<present comp {layer}>" to abi.prefill.outputs and '
            'abi.decode.outputs, and "<past comp_src {layer}>", "<past comp {layer}>" to abi.decode.inputs',
            location=names_where,
        )
    if ("csa" in compressors) != names_index:
        raise KadaptError(
            f"the model's compressed sparse (csa) layers ({counts}) return their indexer's ring and "
            'entries too: add "<present index_src {layer}>", "<present index_comp {layer}>" after the '
            'compressor\'s to abi.prefill.outputs and abi.decode.outputs, and "<past index_src {layer}>", '
            '"<past index_comp {layer}>" to abi.decode.inputs'
            if "csa" in compressors
            else "the ABI names index_src and index_comp states, but the model has no compressed sparse "
            "(csa) layer: drop them",
            location=names_where,
        )
    for kind, compressor in compressors.items():
        if max_cache_len % compressor.rate:
            raise KadaptError(
                f"abi.max_cache_len {max_cache_len} is not a multiple of the compressed layers' rate "
                f"{compressor.rate} ({kind}): their entries take max_cache_len / rate slots; use a multiple "
                "of every rate",
                location=names_where,
            )
    if compressors and "prefill_len" in dynamic:
        raise KadaptError(
            f"dynamic prefill_len cannot be exported for a stack with compressed layers ({counts}): the "
            "prompt's closed windows (prefill_len // rate entries) and the ring's placement are read from "
            "its length; export a static prefill_len (one prefill graph per length you serve)",
            location=dynamic_where,
        )
    return bool(compressors)
