"""Extraction backend: prefill/decode IR JSON + KV mapping for an applied spec (issue 4).

Importing this package does not import torch: ``options_from_spec`` checks sizes and the output
directory first, and ``run``/``verify`` import the heavy modules when called.

- ``runtime``: the self-contained ABI (wrappers, static KV cache, inputs, KV mapping) that
  ``kadapt generate`` embeds in standalone modules.
- ``export`` -> ``convert`` -> ``stitch`` -> ``irjson``/``write``: trace, convert to kadapt's graph,
  replicate layers, serialise; ``pipeline.run`` drives them; ``roundtrip.verify`` checks the saved files.
- ``cache_key`` -> ``cache``: ``kadapt apply`` restores a run whose every input was extracted before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .job.contact_points import check_upstream
from .options import ExtractionOptions, bind_structure, options_from_spec

if TYPE_CHECKING:
    from pathlib import Path

    from torch import nn

    from ...patching.session import Session
    from ...spec.model import Spec
    from .equivalence.verdict import VerifyReport
    from .job.summary import ExtractionSummary

__all__ = [
    "ExtractionOptions",
    "bind_structure",
    "check",
    "check_upstream",
    "options_from_spec",
    "run",
    "run_cached",
    "verify",
]


def run(
    spec: Spec, model: nn.Module, options: ExtractionOptions, *, echo: Callable[[str], Any]
) -> ExtractionSummary:
    """Extract ``model`` (the full applied model from ``load_model``) into ``options.output_dir``."""
    from .job.pipeline import run as run_pipeline

    return run_pipeline(spec, model, options, echo=echo)


def check(spec: Spec, model: nn.Module, options: ExtractionOptions, *, echo: Callable[[str], Any]) -> None:
    """Every check ``run`` makes before exporting, with nothing exported or written: a refusal is
    raised exactly where ``run`` would raise it."""
    from .job.pipeline import Clock, prepare

    prepare(spec, model, options, Clock(echo), check_whole=True)


def run_cached(
    spec: Spec,
    model: nn.Module,
    options: ExtractionOptions,
    *,
    session: Session,
    device: str,
    use_cache: bool,
    processes: int,
    echo: Callable[[str], Any],
) -> tuple[ExtractionSummary, dict[str, int]]:
    """``run`` through the extraction cache (``cache.py``), as ``kadapt apply`` runs it: the summary and
    each patch's reach count (restored with the files when the same inputs were extracted before)."""
    from .job.cache import ExtractionCache, default_root, extract_or_restore

    cache = ExtractionCache(default_root()) if use_cache else None
    return extract_or_restore(
        spec, model, options, session=session, device=device, cache=cache, processes=processes, echo=echo
    )


def verify(
    spec: Spec,
    options: ExtractionOptions,
    *,
    echo: Callable[[str], Any],
    processes: int = 1,
    keep_in: Path | None = None,
) -> VerifyReport:
    """Extract a tiny random model of the spec's architecture and check the saved IR against transformers
    (``processes`` 2: the tiny model's graphs traced in two forked children, as ``kadapt apply`` does;
    ``keep_in``: that extraction is an apply of the tiny model into this folder, see ``roundtrip``)."""
    from .equivalence.roundtrip import verify as run_verify

    return run_verify(spec, options, echo=echo, processes=processes, keep_in=keep_in)
