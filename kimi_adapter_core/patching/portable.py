"""The patch runtime that works without kadapt: patch-kind behaviours, shims, per-call gating.

One source for two clients. kadapt's own engine builds every patch's behaviour with ``BUILDERS``
(``patching/kinds.py``), and ``kadapt generate`` embeds this module verbatim in
``adapters/<spec>/tensorcast_profile.py``, where ``PatchRuntime`` installs shims and patches for
TensorCast. So it imports only the standard library (torch and transformers lazily, when a patch
needs them) and never kadapt. The patch kinds:

- ``replace``: ``impl(self, *args, **kwargs)`` instead of the original.
- ``wrap``: ``rename_kwargs``, then only ``allow_kwargs`` are passed on (when given), the rest are
  stored on the instance as ``stash_extra_as`` (reset every call), then ``impl(original, self, ...)``
  or the original itself.
- ``adapt_return``: the returned tuple padded with ``None`` / trimmed to ``options["arity"]``.
- ``meta_stub``: on meta-device inputs ``impl(self, ...)`` or an empty meta tensor shaped like the
  first tensor argument; real inputs run the original.
- ``set_attribute``: a descriptor giving ``value`` to owned instances (``only_if_missing``: left
  alone when the class already has the attribute).

A patch with a pin (the signature and source sha256 of the upstream function it was written against,
``pin_drift``; one per transformers release it was reviewed against, when several) is checked before it
is installed: upstream code matching none of them is refused, never patched.

Every patched attribute becomes a dispatcher that decides on each call: the receiver (``self``)
is owned when its own ``config`` passes the gate, or when it was built inside a model whose root
config passes it (``PreTrainedModel.post_init`` is hooked to claim such models). Anything else runs
the original. Installing twice patches once (dispatchers are marked with the spec and patch id);
``PatchRuntime.remove`` puts every original back, newest first, even when one restore fails.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import sys
import textwrap
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# auto_map keys whose class is the model TensorCast builds: remote targets live next to its module.
AUTO_MODEL_KEYS = ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModel")
POST_INIT_TARGET = ("transformers.modeling_utils", ("PreTrainedModel",), "post_init")


def signature_of(func: Callable[..., Any]) -> str:
    """The pinned form of ``func``'s signature."""
    return str(inspect.signature(func))


def source_sha256(func: Callable[..., Any]) -> str:
    """sha256 of ``func``'s dedented source (OSError/TypeError when it has none)."""
    return hashlib.sha256(textwrap.dedent(inspect.getsource(func)).encode("utf-8")).hexdigest()


def pin_drift(
    func: Callable[..., Any], signature: str | None, sha256: str | None
) -> list[tuple[str, str, str]]:
    """``(field, pinned, found)`` for each pinned field (None: not pinned) ``func`` no longer matches."""
    drifted = []
    if signature is not None and (found := signature_of(func)) != signature:
        drifted.append(("signature", signature, found))
    if sha256 is not None and (found := source_sha256(func)) != sha256:
        drifted.append(("source_sha256", sha256, found))
    return drifted


def check_pin(
    patch_id: str,
    target: str,
    func: Callable[..., Any],
    pin: Sequence[tuple[str | None, str | None, str | None]],
) -> None:
    """Refuse to patch ``func`` unless it matches one of the sources in ``pin``: ``(release, signature,
    source sha256)`` each, release None in the one-source form (a field None: not pinned)."""
    drifts = [(release, pin_drift(func, signature, sha256)) for release, signature, sha256 in pin]
    if all(drifted for _, drifted in drifts):
        found = "; ".join(
            f"{field} pinned {then}{f' for {release}' if release else ''}, found {now}"
            for release, drifted in drifts
            for field, then, now in drifted
        )
        raise RuntimeError(
            f"patch {patch_id}: upstream drift: {target} no longer matches its pin ({found}); review the "
            "patch against the new upstream code and regenerate with `kadapt pin --write`"
        )


class Shim:
    """``module.attr = value`` when ``module`` lacks ``attr`` (kind ``inject_symbol``)."""

    def __init__(self, id: str, module: str, attr: str, value: Any) -> None:
        self.id, self.module, self.attr, self.value = id, module, attr, value

    def __repr__(self) -> str:
        return f"Shim({self.id!r}, {self.module}:{self.attr})"


class ClassPatch:
    """One patch: ``module:Owner.attr``, or ``remote:<file stem>:Owner.attr`` in the model's code.

    (Plain classes, not dataclasses: the generated module may be executed without being registered
    in ``sys.modules``, which dataclasses need under ``from __future__ import annotations``.)
    """

    def __init__(
        self,
        id: str,
        kind: str,
        module: str,
        owner: tuple[str, ...],
        attr: str,
        *,
        remote: bool = False,
        impl: Callable[..., Any] | None = None,
        value: Any = None,
        options: Mapping[str, Any] | None = None,
        pin: tuple[tuple[str | None, str | None, str | None], ...] | None = None,
    ) -> None:
        self.id, self.kind, self.module, self.owner, self.attr = id, kind, module, tuple(owner), attr
        self.remote, self.impl, self.value = remote, impl, value
        self.options: Mapping[str, Any] = dict(options or {})
        # the sources of the upstream function it was reviewed against, (release, signature,
        # source_sha256) each, checked before patching: it patches only a function matching one
        self.pin = pin

    @property
    def target(self) -> str:
        prefix = "remote:" if self.remote else ""
        return f"{prefix}{self.module}:{'.'.join((*self.owner, self.attr))}"

    def __repr__(self) -> str:
        return f"ClassPatch({self.id!r}, {self.kind}, {self.target})"


# -- patch kinds: each returns the patched behaviour, taking the original's arguments ----------------

# (A behaviour is a ``Callable[..., Any]``, spelled out: ``kadapt generate`` embeds the builders in
# generated modules, which carry the names a function reads, and a typing alias is none it can write.)


def build_replace(
    patch_id: str, options: Mapping[str, Any], impl: Callable[..., Any] | None, original: Callable[..., Any]
) -> Callable[..., Any]:
    if impl is None:
        raise ValueError(f"patch {patch_id}: kind replace needs an impl")
    return impl


def build_wrap(
    patch_id: str, options: Mapping[str, Any], impl: Callable[..., Any] | None, original: Callable[..., Any]
) -> Callable[..., Any]:
    allow = options.get("allow_kwargs")
    allowed = set(allow) if allow is not None else None
    renames = dict(options.get("rename_kwargs") or {})
    stash = options.get("stash_extra_as")

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


def build_adapt_return(
    patch_id: str, options: Mapping[str, Any], impl: Callable[..., Any] | None, original: Callable[..., Any]
) -> Callable[..., Any]:
    arity = options.get("arity")
    if not isinstance(arity, int) or arity < 1:
        raise ValueError(f"patch {patch_id}: kind adapt_return needs options.arity (a positive integer)")

    def adapted(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        return pad_or_trim(original(*args, **kwargs), arity)

    return adapted


def build_meta_stub(
    patch_id: str, options: Mapping[str, Any], impl: Callable[..., Any] | None, original: Callable[..., Any]
) -> Callable[..., Any]:
    def stub(*args: Any, **kwargs: Any) -> Any:
        import torch

        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        if not any(t.device.type == "meta" for t in tensors):
            return original(*args, **kwargs)
        if impl is not None:
            return impl(*args, **kwargs)
        return torch.empty(tensors[0].shape, dtype=tensors[0].dtype, device="meta")

    return stub


# kind -> builder(patch_id, options, impl, original) returning the patched behaviour
BUILDERS: dict[str, Callable[..., Callable[..., Any]]] = {
    "replace": build_replace,
    "wrap": build_wrap,
    "adapt_return": build_adapt_return,
    "meta_stub": build_meta_stub,
}


_ABSENT = object()  # "the class had no such attribute"


class GatedAttribute:
    """Non-data descriptor: ``value`` on owned instances, the class's previous attribute elsewhere."""

    def __init__(
        self, marker: tuple[str, str], owns: Callable[[Any], bool], name: str, value: Any, old: Any
    ) -> None:
        self.marker = marker
        self.owns = owns
        self.name = name
        self.value = value
        self.old = old  # the previous class attribute as stored, or _ABSENT

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is not None and self.owns(instance):
            return self.value
        if self.old is _ABSENT:
            if instance is None:
                return self
            raise AttributeError(f"{type(instance).__name__!r} object has no attribute {self.name!r}")
        if hasattr(self.old, "__get__"):
            return self.old.__get__(instance, owner)
        return self.old


class _Undo:
    """How to take one change back: restore ``old`` on ``owner.attr``, or delete the attribute."""

    def __init__(self, label: str, owner: Any, attr: str, old: Any, had_own: bool) -> None:
        self.label, self.owner, self.attr, self.old, self.had_own = label, owner, attr, old, had_own

    def __call__(self) -> None:
        if self.had_own:
            setattr(self.owner, self.attr, self.old)
        elif self.attr in vars(self.owner):
            delattr(self.owner, self.attr)


class PatchRuntime:
    """The shims and patches of one spec, installed on demand and removable as a whole."""

    def __init__(
        self,
        name: str,
        config_matches: Callable[[Any], bool],
        shims: Sequence[Shim],
        patches: Sequence[ClassPatch],
    ) -> None:
        self.name = name
        self.config_matches = config_matches
        self.shims = tuple(shims)
        self.patches = tuple(patches)
        self._lock = threading.RLock()
        self._undo: list[_Undo] = []
        self._claimed: weakref.WeakSet[Any] = weakref.WeakSet()

    # -- the per-call gate ---------------------------------------------------------------------------

    def owns(self, receiver: Any) -> bool:
        """True when ``receiver`` belongs to a model of the spec's gate (checked on every call)."""
        try:
            if receiver in self._claimed:
                return True
        except TypeError:  # not weak-referenceable: never built inside a claimed model
            pass
        try:
            config = getattr(receiver, "config", None)
        except Exception:  # noqa: BLE001 - an odd receiver is simply not ours
            return False
        return config is not None and self.config_matches(config)

    def claim(self, model: Any) -> None:
        """Mark ``model`` and every submodule as owned (what the ``post_init`` hook does)."""
        for module in model.modules():
            self._claimed.add(module)

    # -- installing ----------------------------------------------------------------------------------

    def install(self, hf_config: Any, model_id: str | None) -> list[str]:
        """Install what is not installed yet; return the ids installed by this call.

        All targets are resolved before any class changes (shims first: remote code may need them
        to import); if installing fails half-way, this call's changes are taken back.
        """
        with self._lock:
            start = len(self._undo)
            done: list[str] = []
            try:
                for shim in self.shims:
                    module = importlib.import_module(shim.module)
                    if not hasattr(module, shim.attr):
                        setattr(module, shim.attr, shim.value)
                        self._undo.append(_Undo(shim.id, module, shim.attr, None, False))
                        done.append(shim.id)
                resolved = [(patch, self._owner(patch, hf_config, model_id)) for patch in self.patches]
                if resolved:
                    self._install_claim_hook()
                for patch, owner in resolved:
                    if self._install_patch(patch, owner):
                        done.append(patch.id)
            except BaseException:
                self._undo_from(start)
                raise
            return done

    def _owner(self, patch: ClassPatch, hf_config: Any, model_id: str | None) -> Any:
        if patch.remote:
            module = self._remote_module(patch, hf_config, model_id)
        else:
            module = importlib.import_module(patch.module)
        owner = module
        for name in patch.owner:
            if not hasattr(owner, name):
                raise AttributeError(f"patch {patch.id}: {patch.target}: {owner.__name__} has no {name!r}")
            owner = getattr(owner, name)
        return owner

    def _remote_module(self, patch: ClassPatch, hf_config: Any, model_id: str | None) -> Any:
        """The remote module the model itself imports: a sibling of its ``auto_map`` entry.

        For a local directory transformers gives every entry module its own hash-named package,
        so loading ``<stem>.<Class>`` directly could yield a copy the model never uses.
        """
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        if model_id is None:
            raise ValueError(f"patch {patch.id}: {patch.target} needs the model id to load remote code")
        auto_map = getattr(hf_config, "auto_map", None)
        if auto_map is None and isinstance(hf_config, Mapping):
            auto_map = hf_config.get("auto_map")
        entry = next((auto_map[k] for k in AUTO_MODEL_KEYS if k in (auto_map or {})), None)
        if entry is not None:
            model_class = get_class_from_dynamic_module(entry, model_id)
            package = model_class.__module__.rpartition(".")[0]
            return importlib.import_module(f"{package}.{patch.module}")
        found = get_class_from_dynamic_module(f"{patch.module}.{patch.owner[0]}", model_id)
        return sys.modules[found.__module__]

    def _install_patch(self, patch: ClassPatch, owner: Any) -> bool:
        marker = (self.name, patch.id)
        try:
            stored = inspect.getattr_static(owner, patch.attr)
        except AttributeError:
            stored = _ABSENT
        func = getattr(stored, "__func__", stored)
        if getattr(func, "__tensorcast_patch__", None) == marker or getattr(stored, "marker", None) == marker:
            return False  # installed by an earlier call
        had_own = patch.attr in vars(owner)
        if patch.kind == "set_attribute":
            if patch.options.get("only_if_missing") and stored is not _ABSENT:
                return False
            new: Any = GatedAttribute(marker, self.owns, patch.attr, patch.value, stored)
        else:
            if stored is _ABSENT or not callable(func):
                raise TypeError(f"patch {patch.id}: {patch.target} is not a function")
            if patch.pin is not None:
                check_pin(patch.id, patch.target, func, patch.pin)
            dispatcher = self._gated(
                marker, func, BUILDERS[patch.kind](patch.id, patch.options, patch.impl, func)
            )
            is_wrapped_method = isinstance(stored, (staticmethod, classmethod))
            new = type(stored)(dispatcher) if is_wrapped_method else dispatcher
        setattr(owner, patch.attr, new)
        self._undo.append(_Undo(patch.id, owner, patch.attr, stored, had_own))
        return True

    def _gated(
        self, marker: tuple[str, str], original: Callable[..., Any], patched: Callable[..., Any]
    ) -> Callable[..., Any]:
        owns = self.owns

        @functools.wraps(original)
        def dispatcher(*args: Any, **kwargs: Any) -> Any:
            if args and owns(args[0]):
                return patched(*args, **kwargs)
            return original(*args, **kwargs)

        dispatcher.__tensorcast_patch__ = marker  # type: ignore[attr-defined]
        return dispatcher

    def _install_claim_hook(self) -> None:
        """Hook ``PreTrainedModel.post_init``: a model whose root config passes the gate is claimed."""
        module_name, owner_path, attr = POST_INIT_TARGET
        owner = getattr(importlib.import_module(module_name), owner_path[0])
        marker = (self.name, "claim")
        stored = inspect.getattr_static(owner, attr)
        if getattr(stored, "__tensorcast_patch__", None) == marker:
            return
        claim, matches = self.claim, self.config_matches

        @functools.wraps(stored)
        def post_init(model: Any, *args: Any, **kwargs: Any) -> Any:
            result = stored(model, *args, **kwargs)
            config = getattr(model, "config", None)
            if config is not None and matches(config):
                claim(model)
            return result

        post_init.__tensorcast_patch__ = marker  # type: ignore[attr-defined]
        setattr(owner, attr, post_init)
        self._undo.append(_Undo("claim", owner, attr, stored, attr in vars(owner)))

    # -- removing ------------------------------------------------------------------------------------

    def installed(self) -> list[str]:
        """Ids of the shims and patches currently installed, in installation order."""
        return [undo.label for undo in self._undo]

    def remove(self) -> list[str]:
        """Restore every original, newest first; keep going past failures, then raise the first."""
        with self._lock:
            labels = self.installed()
            self._undo_from(0)
            return labels

    def _undo_from(self, start: int) -> None:
        first: BaseException | None = None
        while len(self._undo) > start:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as exc:  # noqa: BLE001 - restore the rest before reporting
                first = first or exc
        if first is not None:
            raise first
