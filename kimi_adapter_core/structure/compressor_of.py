"""The compressor a config gives its compressed layers (DeepSeek-V4's heavily compressed attention).

Which layers are ``hca`` comes from ``derive``'s per-layer spans (``layer_types``
``heavily_compressed_attention``); this reads the compressor's rate from ``compress_rates``, a mapping of
layer type to rate, as ``DeepseekV4Config`` keeps it (its entries are as wide as the attention's one
shared key/value head). A compressed layer without a rate is attention kadapt cannot size, refused rather
than guessed. (``max_cache_len`` must be a multiple of the rate: the runtime's ``compressed_shapes``.)
"""

from __future__ import annotations

from typing import Any

from ..errors import Refusal
from .linear_of import Reader
from .model import Attention, Compressor

# the layer type whose rate ``compress_rates`` keys (DeepseekV4HCACache reads the same entry)
HCA_TYPE = "heavily_compressed_attention"


def compressor_of(
    read: Reader, spans: list[tuple[str, int | None]], attention: Attention
) -> Compressor | None:
    """The ``hca`` layers' compressor (None when no layer is compressed)."""
    if all(span != "hca" for span, _ in spans):
        return None
    rates: Any = read.get("compress_rates")
    rate = rates.get(HCA_TYPE) if isinstance(rates, dict) else None
    if not isinstance(rate, int) or isinstance(rate, bool) or rate < 1:
        raise Refusal(
            "layer-types",
            f"{read.where}: {HCA_TYPE} layers need compress_rates[{HCA_TYPE!r}], a positive int (the "
            f"tokens each compressed entry folds); found {rate!r}",
            location=read.spec.locate("gate") if read.spec is not None else None,
        )
    return Compressor(rate=rate, head_dim=attention.head_dim)
