"""The compressors a config gives its compressed layers (DeepSeek-V4's heavily compressed attention,
``hca``, and compressed sparse attention, ``csa``).

Which layers are compressed comes from ``derive``'s per-layer spans (``layer_types``, or the legacy
per-layer ``compress_ratios`` a published config.json holds: ``legacy_layer_types``); this reads each
kind's rate from ``compress_rates``, a mapping of layer type to rate, as ``DeepseekV4Config`` keeps it,
else from the ratio ``compress_ratios`` lists for that kind's layers (its entries are as wide as the
attention's one shared key/value head). A csa layer's compressor overlaps two windows and carries a
Lightning indexer sized by ``index_n_heads``/``index_head_dim``/``index_topk``. A compressed layer without
a rate (or a csa layer without its indexer's sizes) is attention kadapt cannot size, refused rather than
guessed. (``max_cache_len`` must be a multiple of every rate: the runtime's ``compressed_shapes``.)
"""

from __future__ import annotations

from typing import Any

from ..errors import Refusal
from .indexer_of import INDEX_FACTS
from .linear_of import Reader
from .model import Attention, Compressor, Indexer

# each compressed kind's layer type, whose rate ``compress_rates`` keys (DeepseekV4*Cache reads the same)
HCA_TYPE = "heavily_compressed_attention"
CSA_TYPE = "compressed_sparse_attention"
TYPES = {"hca": HCA_TYPE, "csa": CSA_TYPE}
# transformers' reading of a legacy per-layer ``compress_ratios`` entry (configuration_deepseek_v4's
# _COMPRESS_RATIO_TO_LAYER_TYPE): 0 slides, 4 is csa, 128 hca
LEGACY_RATIO_TYPES = {0: "sliding_attention", 4: CSA_TYPE, 128: HCA_TYPE}


def legacy_layer_types(read: Reader, num_layers: int) -> list[str] | None:
    """The layer types a legacy ``compress_ratios`` list gives (None: the config has none); a ratio
    transformers does not map is refused, located."""
    ratios = read.get("compress_ratios")
    if not isinstance(ratios, list):
        return None
    unknown = sorted({r for r in ratios[:num_layers] if r not in LEGACY_RATIO_TYPES}, key=str)
    if unknown:
        raise Refusal(
            "layer-types",
            f"{read.where}: compress_ratios holds {unknown}: transformers reads only "
            f"{sorted(LEGACY_RATIO_TYPES)} (sliding, compressed sparse, heavily compressed)",
            location=read.spec.locate("gate") if read.spec is not None else None,
        )
    return [LEGACY_RATIO_TYPES[r] for r in ratios[:num_layers]]


def compressor_of(
    read: Reader, spans: list[tuple[str, int | None]], attention: Attention, kind: str
) -> Compressor | None:
    """The compressor of the layers of ``kind`` (``hca`` or ``csa``; None when no layer is of it)."""
    if all(span != kind for span, _ in spans):
        return None
    layer_type = TYPES[kind]
    rate = _rate(read, layer_type)
    if kind == "hca":
        return Compressor(rate=rate, head_dim=attention.head_dim)
    missing = [key for key in INDEX_FACTS.values() if read.get(key) is None]
    if missing:
        raise Refusal(
            "layer-types",
            f"{read.where}: {layer_type} layers without {', '.join(missing)}: their Lightning indexer (its "
            "heads, key width and top-k) is sized by those keys",
            location=read.spec.locate("gate") if read.spec is not None else None,
        )
    indexer = Indexer(**{name: int(read.get(fact)) for name, fact in INDEX_FACTS.items()})
    return Compressor(rate=rate, head_dim=attention.head_dim, overlap=2, indexer=indexer)


def _rate(read: Reader, layer_type: str) -> int:
    """``compress_rates[layer_type]``, else the ratio the legacy ``compress_ratios`` lists for the layers
    it makes ``layer_type`` (transformers' defaults fill ``compress_rates`` with the same)."""
    rates: Any = read.get("compress_rates")
    rate = rates.get(layer_type) if isinstance(rates, dict) else None
    if rate is None and isinstance(read.get("compress_ratios"), list):
        listed = {r for r in read.get("compress_ratios") if LEGACY_RATIO_TYPES.get(r) == layer_type}
        rate = listed.pop() if len(listed) == 1 else None
    if not isinstance(rate, int) or isinstance(rate, bool) or rate < 1:
        raise Refusal(
            "layer-types",
            f"{read.where}: {layer_type} layers need compress_rates[{layer_type!r}], a positive int (the "
            f"tokens each compressed entry folds); found {rate!r}",
            location=read.spec.locate("gate") if read.spec is not None else None,
        )
    return rate
