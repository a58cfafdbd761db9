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

Fn = Callable[..., Any]


def build_replace(patch: Patch, original: Fn, impl: Fn | None) -> Fn:
    if impl is None:
        raise KadaptError(f"patch {patch.id}: kind replace needs an impl")
    return impl


def build_wrap(patch: Patch, original: Fn, impl: Fn | None) -> Fn:
    allow = patch.options.get("allow_kwargs")
    allowed = set(allow) if allow is not None else None
    renames: dict[str, str] = dict(patch.options.get("rename_kwargs") or {})
    stash = patch.options.get("stash_extra_as")

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        for old, new in renames.items():
            if old in kwargs and new not in kwargs:
                kwargs[new] = kwargs.pop(old)
        extra: dict[str, Any] = {}
        if allowed is not None:
            extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in allowed}
        if stash:
            setattr(self, stash, extra)
        if impl is not None:
            return impl(original, self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return wrapped


def pad_or_trim(result: Any, arity: int) -> tuple[Any, ...]:
    values = tuple(result) if isinstance(result, tuple) else (result,)
    return values[:arity] + (None,) * (arity - len(values))


def build_adapt_return(patch: Patch, original: Fn, impl: Fn | None) -> Fn:
    arity = patch.options.get("arity")
    if not isinstance(arity, int) or arity < 1:
        raise KadaptError(f"patch {patch.id}: kind adapt_return needs options.arity (a positive integer)")

    def adapted(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        return pad_or_trim(original(*args, **kwargs), arity)

    return adapted


def _tensors(values: Any) -> list[Any]:
    import torch

    return [v for v in values if isinstance(v, torch.Tensor)]


def build_meta_stub(patch: Patch, original: Fn, impl: Fn | None) -> Fn:
    def stub(*args: Any, **kwargs: Any) -> Any:
        tensors = _tensors((*args, *kwargs.values()))
        if not any(t.device.type == "meta" for t in tensors):
            return original(*args, **kwargs)
        if impl is not None:
            return impl(*args, **kwargs)
        import torch

        return torch.empty(tensors[0].shape, dtype=tensors[0].dtype, device="meta")

    return stub


BUILDERS: dict[str, Callable[[Patch, Fn, Fn | None], Fn]] = {
    "replace": build_replace,
    "wrap": build_wrap,
    "adapt_return": build_adapt_return,
    "meta_stub": build_meta_stub,
}
CALLABLE_KINDS = tuple(BUILDERS)
ATTRIBUTE_KINDS = ("set_attribute",)
