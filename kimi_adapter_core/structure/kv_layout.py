"""Which KV layout a model's attention holds: the one the spec asks for, or the attention's default.

Torch-free and below every backend: ``kadapt validate`` checks a spec's ``abi.kv_layout`` with it, the
extraction backend binds its options with it and ``kadapt generate`` renders layouts with it."""

from __future__ import annotations

from ..errors import KadaptError
from .model import Attention


def resolve_kv_layout(
    attention: Attention,
    kv_layout: str | None,
    mla_attention: str,
    *,
    layout_where: str | None = None,
    attention_where: str | None = None,
) -> str:
    """The KV layout for a model with ``attention``: ``kv_layout`` or the attention kind's default.

    A layout the attention cannot have (``latent`` on a GQA model), a non-default ``mla_attention`` on a
    model without MLA, or ``absorbed`` off the latent layout is a ``KadaptError`` located at the spec
    entry that asked for it. Torch-free: ``kadapt generate`` resolves layouts with it too.
    """
    layout = kv_layout or attention.default_kv_layout
    if layout not in attention.kv_layouts:
        raise KadaptError(
            f"kv_layout {layout!r} does not fit this model's {attention.kind.upper()} attention "
            f"({attention.describe()}); valid: {', '.join(attention.kv_layouts)}",
            location=layout_where,
        )
    if mla_attention != "reexpand" and not attention.is_mla:
        raise KadaptError(
            f"mla_attention {mla_attention!r} needs MLA attention; this model has {attention.describe()}",
            location=attention_where,
        )
    if mla_attention == "absorbed" and layout != "latent":
        raise KadaptError(
            f"mla_attention 'absorbed' needs kv_layout 'latent', got {layout!r}", location=attention_where
        )
    return layout
