"""Which spec entries run for which backend.

Entries list the backends they serve (the spec model fills in every backend when an entry names
none). ``none`` means "apply the spec and build the model, run no backend": only entries that serve
every backend, i.e. are not backend-specific, run for it.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..spec.model import BACKENDS

CHOICES = (*BACKENDS, "none")


def applies_to(entry_backends: Iterable[str], backend: str) -> bool:
    served = set(entry_backends)
    return backend in served or (backend == "none" and served >= set(BACKENDS))
