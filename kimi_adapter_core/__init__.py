"""kadapt's engine: declarative adapter specs applied to Hugging Face models.

Public API (imported lazily so that ``import kimi_adapter_core`` stays torch-free):

- ``load_spec(path_or_name) -> Spec``: a spec file, or a shipped spec by name (``"kimi_k25"``)
- ``applied(spec, ...)``: context manager that applies a spec and restores everything on exit
- ``load_model(spec, device="meta", ...)``: build the adapted model (no weights)
- ``load_config(spec, ...)``: the spec's transformers config, bridges applied
- ``derive_structure(config, spec=None) -> ModelStructure``: the model's typed structure

Every function taking a ``spec`` accepts a ``Spec``, a path or a shipped spec's name.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load_spec": "kimi_adapter_core.spec:load_spec",
    "Spec": "kimi_adapter_core.spec:Spec",
    "applied": "kimi_adapter_core.loading:applied",
    "load_model": "kimi_adapter_core.loading:load_model",
    "load_config": "kimi_adapter_core.loading:load_config",
    "derive_structure": "kimi_adapter_core.structure.derive:derive_structure",
    "ModelStructure": "kimi_adapter_core.structure.model:ModelStructure",
    "KadaptError": "kimi_adapter_core.errors:KadaptError",
}

__all__ = ["__version__", *_LAZY]


def __dir__() -> list[str]:
    return sorted(__all__)


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'kimi_adapter_core' has no attribute {name!r}")
    import importlib

    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)
