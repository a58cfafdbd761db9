"""Render a spec's targets to memory: every file formatted and checked before anything is written.

A template error, a spec that lacks what a target needs or generated Python that does not compile
stops here, with nothing on disk changed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from pathlib import PurePosixPath

from ..errors import KadaptError
from ..spec.model import Spec
from .common import NotExpressible, Rendered
from .pyformat import format_python

TARGETS = ("extraction", "simulation", "docs")
ALL = "all"

# target -> "module:function" rendering it (imported on use: extraction needs torch, the others not)
_RENDERERS = {
    "extraction": "kimi_adapter_core.generate.extraction:render_extraction",
    "simulation": "kimi_adapter_core.generate.simulation:render_simulation",
    "docs": "kimi_adapter_core.generate.docs:render_docs",
}


def _renderer(target: str) -> Callable[[Spec], list[Rendered]]:
    module, _, name = _RENDERERS[target].partition(":")
    return getattr(importlib.import_module(module), name)


def expand_targets(target: str) -> tuple[str, ...]:
    if target == ALL:
        return TARGETS
    if target not in TARGETS:
        raise KadaptError(f"unknown target {target!r}; choose one of: {', '.join((*TARGETS, ALL))}")
    return (target,)


def render_spec(
    spec: Spec, targets: Iterable[str], *, skip_inexpressible: bool = False
) -> tuple[list[Rendered], list[str]]:
    """All files of ``targets`` for ``spec``, sorted by path, plus notes on targets skipped.

    With ``skip_inexpressible`` (``--target all``) a target the spec cannot produce is skipped and
    noted; otherwise that is an error like any other.
    """
    files: dict[PurePosixPath, str] = {}
    notes: list[str] = []
    for target in targets:
        try:
            rendered = _renderer(target)(spec)
        except NotExpressible as exc:
            if not skip_inexpressible:
                raise
            notes.append(exc.note)
            continue
        for item in rendered:
            text = format_python(item.text, str(item.path)) if item.path.suffix == ".py" else item.text
            if files.setdefault(item.path, text) != text:
                raise KadaptError(f"targets of spec '{spec.name}' render {item.path} differently")
    return [Rendered(path, files[path]) for path in sorted(files)], notes
