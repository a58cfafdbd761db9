"""The model's own remote code: trust checks, class loading, and surviving re-imports.

Remote code is the model repository's Python, executed in this process. It runs only when the spec
allows it (``source.trust_remote_code: true``) *and* the user asked for it (``--trust-remote-code``);
hub code must come from a pinned commit (checked in ``config.source``).

transformers imports remote code through ``dynamic_module_utils.get_class_in_module`` and may
re-execute it (a forced reload, a changed file), which creates fresh class objects that know
nothing of our patches. While a spec with remote patches is applied, that function is hooked so
every (re)loaded module is handed to the active sessions, which patch its fresh classes too.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..config.source import ResolvedSource
from ..errors import KadaptError
from ..spec.model import Spec


def uses_remote_code(spec: Spec) -> bool:
    return spec.source.trust_remote_code or any(p.is_remote for p in spec.patches)


def check_allowed(spec: Spec, trust_remote_code: bool) -> None:
    """Refuse unless both the spec and the caller allow remote code; name what is missing."""
    missing = []
    if not spec.source.trust_remote_code:
        missing.append("the spec must set source.trust_remote_code: true")
    if not trust_remote_code:
        missing.append("the caller must pass --trust-remote-code (trust_remote_code=True)")
    if missing:
        raise KadaptError(
            f"spec {spec.name} runs the model's own remote code, which is refused: " + "; ".join(missing),
            location=spec.locate("source"),
        )


def load_remote_object(reference: str, source: ResolvedSource) -> Any:
    """``module_file.Name`` from the source's remote code (imports it: callers checked trust)."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    try:
        return get_class_from_dynamic_module(
            reference, source.location, revision=source.revision, local_files_only=not source.is_hub
        )
    except KadaptError:
        raise
    except (OSError, ImportError, AttributeError, SyntaxError) as exc:
        raise KadaptError(f"cannot load remote code {reference} from {source.describe()}: {exc}") from exc


_MODEL_AUTO_KEYS = ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModel")


def model_class(auto_map: dict[str, str], source: ResolvedSource) -> type:
    """The model class the repository's ``auto_map`` names (imports the remote code)."""
    for key in _MODEL_AUTO_KEYS:
        if key in auto_map:
            return load_remote_object(auto_map[key], source)
    raise KadaptError(f"the remote config's auto_map names no model class ({' / '.join(_MODEL_AUTO_KEYS)})")


def module_of(obj: Any) -> ModuleType:
    return sys.modules[obj.__module__]


def sibling(entry: ModuleType, stem: str) -> ModuleType:
    """Module ``stem`` of the package that holds ``entry``: the copy the model really uses.

    For a local directory transformers puts each entry module in its own hash-named package, so
    loading ``modeling_deepseek`` directly would give a *different* module object than the one
    ``modeling_kimi_k25`` imported relatively. Targets are therefore looked up next to the model.
    """
    package = entry.__name__.rpartition(".")[0]
    try:
        return importlib.import_module(f"{package}.{stem}")
    except ImportError as exc:
        raise KadaptError(
            f"remote module {stem!r} is not part of the model's code ({package}): {exc}"
        ) from exc


Listener = Callable[[ModuleType], None]
_listeners: list[Listener] = []
_saved_loader: list[Callable[..., Any]] = []  # the unhooked get_class_in_module while hooked


def add_listener(listener: Listener) -> None:
    """Show ``listener`` every remote module transformers (re)loads; hook on the first listener."""
    import transformers.dynamic_module_utils as dmu

    if not _listeners:
        _saved_loader.append(dmu.get_class_in_module)
        dmu.get_class_in_module = _make_import_hook(dmu.get_class_in_module)
    _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    """Stop showing modules to ``listener``; unhook when it was the last one."""
    import transformers.dynamic_module_utils as dmu

    if listener in _listeners:
        _listeners.remove(listener)
        if not _listeners:
            dmu.get_class_in_module = _saved_loader.pop()


def _make_import_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``get_class_in_module`` so each module it returns from is shown to the listeners."""

    def get_class_in_module(class_name: str, module_path: Any, **kwargs: Any) -> Any:
        obj = original(class_name, module_path, **kwargs)
        module = sys.modules.get(getattr(obj, "__module__", ""))
        if module is not None:
            for listener in list(_listeners):
                listener(module)
        return obj

    get_class_in_module.__wrapped__ = original  # type: ignore[attr-defined]
    return get_class_in_module
