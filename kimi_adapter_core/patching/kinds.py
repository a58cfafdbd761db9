"""What each patch kind does to the original callable.

Every builder returns the *patched behaviour* as a plain function taking the same arguments as the
original (``self`` first). The gate decides per call whether it or the original runs, so nothing
here needs to know about gating, restoring or other models.

- ``replace``: the impl, with the original's signature: ``impl(self, *args, **kwargs)``.
- ``wrap``: renames kwargs (``rename_kwargs``), keeps only ``allow_kwargs`` (when given), stores the
  rest on the instance as ``stash_extra_as`` (a dict, reset on every call so nothing leaks between
  calls), then calls ``impl(original, self, *args, **kwargs)`` or the original.
- ``adapt_return``: pads with ``None`` / trims the returned tuple to ``options.arity`` values.
- ``meta_stub``: on meta-device inputs, returns ``impl(self, ...)`` (which knows the output shape)
  or else an empty meta tensor shaped like the first tensor argument; real inputs run the original.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import KadaptError
from ..spec.model import Patch
from .portable import BUILDERS

Fn = Callable[..., Any]


def build(patch: Patch, original: Fn, impl: Fn | None) -> Fn:
    """The patched behaviour of a callable ``patch`` (``replace``/``wrap``/``adapt_return``/``meta_stub``).

    The behaviours themselves live in ``portable`` so that generated modules run the very same code.
    """
    try:
        return BUILDERS[patch.kind](patch.id, patch.options, impl, original)
    except ValueError as exc:
        raise KadaptError(str(exc)) from exc


CALLABLE_KINDS = tuple(BUILDERS)
ATTRIBUTE_KINDS = ("set_attribute",)
