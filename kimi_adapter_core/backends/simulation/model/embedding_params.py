"""The stack's tensors around its token embedding that a spec names: learned absolute position embeddings
(``module_paths.position_embeddings``: GPT-2's ``wpe``, OPT's ``embed_positions``) and a norm over the
embeddings (``module_paths.embedding_norm``: BLOOM's ``word_embeddings_layernorm``). Apart from
``params.py`` (500-line rule), which turns each into a replicated parameter group: every rank embeds
its own tokens' positions."""

from __future__ import annotations

from ....structure.model import ModelStructure
from ....structure.reader import tables


def embedding_tensors(
    s: ModelStructure, language_model: str, position_embeddings: str | None, embedding_norm: str | None
) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(role, model path, shape)`` of the learned position table ``[max_positions, hidden]`` and the
    embedding norm's weight ``[hidden]``, each where the spec names it. OPT's, BioGPT's and TrOCR's tables
    keep 2 rows more (their ``offset``), which no config states: within the census' tolerance. A family
    whose positions a module computes (``config_keys.yaml`` ``computed_positions``: XGLM) has no table."""
    computed = s.model_type in tables()["computed_positions"]
    named = (
        ("position_embeddings", None if computed else position_embeddings, (s.max_positions, s.hidden_size)),
        ("embedding_norm", embedding_norm, (s.hidden_size,)),
    )
    return [
        (role, f"{language_model}.{path}.weight", shape) for role, path, shape in named if path is not None
    ]
