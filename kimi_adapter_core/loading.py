"""Public entry points: load a spec's config, apply the spec, build its model, find submodules.

``applied(spec)`` is the only way patches reach the process, and it always takes them back.
``load_model`` builds the model without weights (meta device by default) and claims its modules for
the spec, which is what turns the call-time gate on for that model and no other.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import KadaptError, Refusal
from .patching import gate, remote
from .patching.ledger import Ledger
from .patching.session import active_session, close_session, open_session
from .spec.loader import load_spec
from .spec.model import Spec

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig

    from .config.source import ResolvedSource

# Auto classes tried in order for a native config (remote code names its own in auto_map).
_AUTO_CLASSES = ("AutoModelForImageTextToText", "AutoModelForCausalLM", "AutoModel")


SpecRef = Spec | str | os.PathLike[str]  # a Spec, a spec file's path, or a shipped spec's name


def load_config(
    spec: SpecRef,
    *,
    backend: str = "extraction",
    overrides: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    ledger: Ledger | None = None,
    source_dir: str | Path | None = None,
    from_hub: bool = False,
) -> PreTrainedConfig:
    """The spec's config: source (``source_dir`` / hub if asked / shipped JSON), ``overrides``
    (dotted path -> value, before bridges: tiny models of the same architecture), the backend's
    bridges (recorded in ``ledger``), then the gate check."""
    from .config.load import load

    config, _ = load(
        load_spec(spec),
        backend=backend,
        overrides=overrides,
        trust_remote_code=trust_remote_code,
        ledger=ledger,
        source_dir=source_dir,
        from_hub=from_hub,
    )
    return config


@contextlib.contextmanager
def applied(
    spec: SpecRef,
    *,
    backend: str = "extraction",
    trust_remote_code: bool = False,
    source_dir: str | Path | None = None,
    from_hub: bool = False,
) -> Iterator[Ledger]:
    """Apply shims, bridges and patches for ``backend``; restore everything on exit."""
    spec = load_spec(spec)
    session = open_session(
        spec, backend, trust_remote_code=trust_remote_code, source_dir=source_dir, from_hub=from_hub
    )
    try:
        yield session.ledger
    finally:
        close_session(session)


def _model_class(config: Any, source: ResolvedSource | None, *, remote_code: bool) -> type:
    if remote_code:
        assert source is not None
        return remote.model_class(getattr(config, "auto_map", None) or {}, source)
    return model_class(config)


def model_class(config: Any) -> type:
    """The transformers class kadapt builds for ``config``: the first of ``_AUTO_CLASSES`` that maps it."""
    import transformers

    for name in _AUTO_CLASSES:
        mapping = getattr(transformers, name)._model_mapping
        if type(config) in mapping:
            return mapping[type(config)]
    raise KadaptError(f"transformers has no model class for {type(config).__name__}")


def load_model(
    spec: SpecRef,
    *,
    device: str = "meta",
    backend: str | None = None,
    config: PreTrainedConfig | None = None,
    dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    source_dir: str | Path | None = None,
    from_hub: bool = False,
) -> torch.nn.Module:
    """Build the full model with no weights and claim its modules for the spec's call-time gate.

    Inside ``applied(spec)`` the config (unless given) and the backend default to the session's;
    outside, the config is loaded for ``backend`` (default extraction) and nothing is patched.
    """
    import torch

    spec = load_spec(spec)
    session = active_session(spec)
    if session is not None:
        if backend is not None and backend != session.backend:
            raise KadaptError(f"spec {spec.name} is applied for backend {session.backend}, not {backend}")
        config = config if config is not None else session.config
        source = session.source
        trust_remote_code = trust_remote_code or session.trust_remote_code
    else:
        from .config.load import load

        loaded, source = load(
            spec,
            backend=backend or "extraction",
            trust_remote_code=trust_remote_code,
            source_dir=source_dir,
            from_hub=from_hub,
        )
        config = config if config is not None else loaded
    remote_code = remote.uses_remote_code(spec)
    if remote_code:
        remote.check_allowed(spec, trust_remote_code)
    cls = _model_class(config, source, remote_code=remote_code)
    kwargs = {} if dtype is None else {"dtype": getattr(torch, dtype) if isinstance(dtype, str) else dtype}
    with torch.device(device), gate.building(spec.name):
        try:
            model = cls._from_config(config, **kwargs)
        except Exception as exc:  # noqa: BLE001 - whatever the class raises, the user needs the cause
            detail = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            if device == "meta" and "meta" in str(exc):  # init code that reads tensor values
                raise Refusal(
                    "not-exportable",
                    f"{cls.__name__} does not build on the meta device ({detail}); kadapt builds models "
                    "without weights",
                ) from exc
            raise KadaptError(f"transformers cannot build {cls.__name__} from this config: {detail}") from exc
    gate.claim_model(model, spec.name)
    return model


def submodule(model: torch.nn.Module, spec: Spec, key: str) -> torch.nn.Module:
    """The module at ``spec.module_paths[key]``; unknown keys and broken paths say what exists."""
    if key not in spec.module_paths:
        known = ", ".join(sorted(spec.module_paths)) or "none"
        raise KadaptError(f"spec {spec.name} has no module_paths key {key!r}; valid keys: {known}")
    path = spec.module_paths[key]
    try:
        return model.get_submodule(path)
    except AttributeError as exc:
        location = spec.locate(f"module_paths.{key}")
        raise KadaptError(
            f"module_paths.{key} = {path!r} does not exist in {type(model).__name__}: {exc}",
            location=location,
        ) from exc
