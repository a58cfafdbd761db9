"""The transformers contact points an extraction relies on, probed before any export."""

from __future__ import annotations

from ..options import ExtractionOptions


def check_upstream(options: ExtractionOptions) -> None:
    """Probe every transformers contact point this extraction relies on (``upstream.ContactPointMoved``
    names what moved); ``run`` probes the model's own decoder layers after it is built."""
    from .... import upstream

    points = (*upstream.EXPORT_POINTS, "loading_converters")
    upstream.check((*points, "vision_grid_helpers") if options.vision is not None else points)
