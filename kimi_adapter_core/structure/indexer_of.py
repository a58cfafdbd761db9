"""The DSA indexer a config describes (DeepSeek sparse attention: DeepSeek-V3.2, GLM-5).

Which layers are ``indexed`` comes from ``derive``'s per-layer spans (``layer_types``
``indexed_attention``); this reads the indexer's sizes. An indexed layer without them is attention
kadapt cannot size, refused rather than guessed.
"""

from __future__ import annotations

from ..errors import Refusal
from .linear_of import Reader
from .model import Indexer

INDEX_FACTS = {"n_heads": "index_n_heads", "head_dim": "index_head_dim", "topk": "index_topk"}


def indexer_of(read: Reader, spans: list[tuple[str, int | None]]) -> Indexer | None:
    """The indexed layers' indexer (None when no layer is indexed)."""
    if all(span != "indexed" for span, _ in spans):
        return None
    missing = [key for key in INDEX_FACTS.values() if read.get(key) is None]
    if missing:
        raise Refusal(
            "layer-types",
            f"{read.where}: indexed_attention layers without {', '.join(missing)}: kadapt models DeepSeek "
            "sparse attention's indexer (its keys and top-k sized by those keys)",
            location=read.spec.locate("gate") if read.spec is not None else None,
        )
    shared = [i for i, kind in enumerate(read.get("indexer_types") or ()) if kind != "full"]
    if shared:
        raise Refusal(
            "layer-types",
            f"{read.where}: indexer_types makes layer {shared[0]} (and {len(shared) - 1} more) "
            f"{read.get('indexer_types')[shared[0]]!r}: it attends to the previous layer's top-k without an "
            "indexer of its own, and kadapt's state contract, plan and simulate describe every indexed "
            "layer as scoring its own indexer keys",
            location=read.spec.locate("gate") if read.spec is not None else None,
        )
    return Indexer(**{name: int(read.require(fact)) for name, fact in INDEX_FACTS.items()})
