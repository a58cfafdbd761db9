"""The DSA indexer a config describes (DeepSeek sparse attention: DeepSeek-V3.2, GLM-5, HY-V4).

Which layers are ``indexed`` comes from ``derive``'s per-layer spans (``layer_types``
``indexed_attention``); this reads the indexer's sizes. An indexed layer without them is attention
kadapt cannot size, refused rather than guessed. A config's ``indexer_types`` may make an indexed layer
``shared``: it has no indexer of its own and attends over the top-k the last earlier ``full`` one chose
(the model's forward hands it on: the runtime's ``CARRIED_INPUTS``); ``topk_sources`` says which.
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
    return Indexer(**{name: int(read.require(fact)) for name, fact in INDEX_FACTS.items()})


def topk_sources(read: Reader, spans: list[tuple[str, int | None]]) -> tuple[int | None, ...]:
    """Per layer, the earlier indexed layer whose top-k it reuses (``indexer_types`` other than ``full``:
    GLM-5's and HY-V4's ``shared``), else None (it scores its own indexer keys, or is not indexed)."""
    kinds = read.get("indexer_types") or ()
    sources: list[int | None] = []
    last_full: int | None = None
    for index, (span, _) in enumerate(spans):
        kind = kinds[index] if index < len(kinds) else "full"
        if span != "indexed" or kind == "full":
            last_full = index if span == "indexed" else last_full
            sources.append(None)
            continue
        if kind != "shared" or last_full is None:
            found = "no earlier full indexer layer" if kind == "shared" else f"{kind!r}"
            raise Refusal(
                "layer-types",
                f"{read.where}: indexer_types makes layer {index} {kind!r}: kadapt models 'full' indexer "
                f"layers and 'shared' ones that reuse the top-k of the last earlier full one; found {found}",
                location=read.spec.locate("gate") if read.spec is not None else None,
            )
        sources.append(last_full)
    return tuple(sources)
