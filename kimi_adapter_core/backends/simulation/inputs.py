"""What both commands read from a spec: the architecture, the raw text config and the weight policy.

Shared by ``kadapt plan`` and ``kadapt simulate`` so that both size the same model the same way.
Plan works from the raw hub JSON (``spec.source.config``), not ``loading.load_config``: the config
bridges only rename vision fields (both spellings are accepted) and add root-level copies the
planner does not read, so they cannot change a size - and the raw path needs no torch. ``simulate``
sizes the deployment from these too, but builds the model it traces through the spec
(``rank_model``: ``applied`` + ``load_config`` + ``load_model``), bridges and patches included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...spec.model import Spec
from .arch import Architecture, architecture, read_config, text_key
from .quant import Policy, resolve_policy


@dataclass(frozen=True)
class ModelInputs:
    arch: Architecture
    text_config: dict[str, Any]
    policy: Policy
    quant_label: str  # "checkpoint" or the --quant mode


def model_inputs(spec: Spec, quant: str | None) -> ModelInputs:
    raw = read_config(spec)
    key = text_key(spec, raw)
    arch = architecture(raw, key)
    declared = list(spec.backend_options("simulation").get("quant_modes") or [])
    policy = resolve_policy(quant, declared, spec.quantization)
    text_cfg = raw[key] if key else raw
    return ModelInputs(arch, text_cfg, policy, quant.upper() if quant else "checkpoint")
