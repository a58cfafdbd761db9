"""The transformers contact points an extraction relies on, probed before any export."""

from __future__ import annotations

from ..options import ExtractionOptions


def check_upstream(options: ExtractionOptions) -> None:
    """Probe every transformers contact point this extraction relies on (``upstream.ContactPointMoved``
    names what moved); ``run`` probes the model's own decoder layers after it is built."""
    from .... import upstream

    points = (*upstream.EXPORT_POINTS, "loading_converters")
    if options.vision is not None:
        points = (*points, "vision_grid_helpers")
    linear = options.structure.linear if options.structure is not None else None
    if linear is not None:
        points = (*points, upstream.STATE_POINTS[linear.layer_kind])
        if linear.kind in upstream.HEAD_CAST_MIXERS:
            points = (*points, "head_input_cast")
    if options.structure is not None and options.structure.indexer is not None:
        points = (*points, "indexer_cache")
    upstream.check(points)
