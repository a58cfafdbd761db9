"""Load a spec's model config: source -> overrides -> bridges -> config object -> gate."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..patching.ledger import Ledger
from ..patching.remote import check_allowed, uses_remote_code
from ..spec.model import Spec
from ..structure.of_spec import refuse_unmodelled_in_raw
from . import paths
from .bridges import apply_bridges
from .build import build_config, check_gate, check_root_gate, config_class
from .source import ResolvedSource, resolve_source

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def load(
    spec: Spec,
    *,
    backend: str,
    overrides: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    ledger: Ledger | None = None,
    source_dir: str | Path | None = None,
    from_hub: bool = False,
) -> tuple[PreTrainedConfig, ResolvedSource]:
    """The bridged, gate-checked config object and the source it came from."""
    remote = uses_remote_code(spec)
    if remote:
        check_allowed(spec, trust_remote_code)
    source = resolve_source(spec, source_dir=source_dir, from_hub=from_hub)
    raw = source.raw
    for path, value in (overrides or {}).items():
        paths.set_(raw, path, copy.deepcopy(value))
    check_root_gate(spec, raw)
    written = apply_bridges(spec, raw, backend=backend, ledger=ledger or Ledger(spec.name, backend))
    refuse_unmodelled_in_raw(spec, raw)  # before a config class validates (or chokes on) what kadapt refuses
    config = build_config(config_class(raw, source, remote=remote), raw, written)
    check_gate(spec, config)
    return config, source
