"""Turn a bridged raw config mapping into the transformers config object, behind the spec's gate.

The class comes from transformers' own registry (``CONFIG_MAPPING[model_type]``) or, for remote
code, from the repository's ``auto_map.AutoConfig``. Private fields (``_attn_implementation``,
``_experts_implementation``) are dropped by config constructors, so every path a bridge wrote is
re-applied to the built object when the object does not already hold that value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import KadaptError
from ..spec.model import Spec
from . import paths
from .paths import MISSING
from .source import ResolvedSource

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def check_root_gate(spec: Spec, raw: dict[str, Any]) -> None:
    """Cheap gate check on the raw mapping, before any config code (possibly remote) runs."""
    found = raw.get("model_type")
    if found != spec.gate.model_type:
        raise KadaptError(
            f"config model_type {found!r} does not match the gate of spec {spec.name} "
            f"(gate.model_type: {spec.gate.model_type!r})",
            location=spec.locate("gate"),
        )


def check_gate(spec: Spec, config: Any) -> None:
    """The built config (and each gated sub-config) must have a model_type the spec accepts."""
    check_root_gate(spec, {"model_type": getattr(config, "model_type", None)})
    for name, accepted in spec.gate.sub_configs.items():
        sub = getattr(config, name, None)
        found = sub.get("model_type") if isinstance(sub, dict) else getattr(sub, "model_type", None)
        if found not in accepted:
            raise KadaptError(
                f"config {name}.model_type {found!r} does not match the gate of spec {spec.name} "
                f"(gate.sub_configs.{name}: {', '.join(accepted)})",
                location=spec.locate("gate"),
            )


def config_class(raw: dict[str, Any], source: ResolvedSource, *, remote: bool) -> type[PreTrainedConfig]:
    if remote:
        from ..patching.remote import load_remote_object

        reference = (raw.get("auto_map") or {}).get("AutoConfig")
        if not reference:
            raise KadaptError(
                f"config.json at {source.describe()} has no auto_map.AutoConfig for remote code"
            )
        return load_remote_object(reference, source)
    from transformers import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise KadaptError(
            f"model_type {model_type!r} is not known to this transformers; running the model's own code "
            "needs source.trust_remote_code: true in the spec and --trust-remote-code"
        )
    return CONFIG_MAPPING[model_type]


def build_config(cls: type[PreTrainedConfig], raw: dict[str, Any], written: list[str]) -> PreTrainedConfig:
    try:
        config = cls.from_dict(raw)
    except Exception as exc:  # noqa: BLE001 - config classes validate with their own error types
        detail = " ".join(str(exc).split())
        raise KadaptError(f"{cls.__name__} rejects the bridged config: {detail}") from exc
    for path in written:
        value = paths.get(raw, path)
        if value is not MISSING and paths.get(config, path) != value:
            try:
                paths.set_(config, path, value)
            except (TypeError, ValueError, AttributeError) as exc:
                raise KadaptError(f"cannot set {path} = {value!r} on {cls.__name__}: {exc}") from exc
    return config
