"""What both commands read from a spec: the architecture, the raw text config and the weight policy.

Shared by ``kadapt plan`` and ``kadapt simulate`` so that both size the same model the same way.
Plan works from the raw hub JSON (``spec.source.config``), not ``loading.load_config``: the config
bridges only rename vision fields (both spellings are accepted) and add root-level copies the
planner does not read, so they cannot change a size - and the raw path needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...spec.model import Spec
from .arch import Architecture, architecture, read_config
from .quant import Policy, resolve_policy


@dataclass(frozen=True)
class ModelInputs:
    arch: Architecture
    text_config: dict[str, Any]
    policy: Policy
    quant_label: str  # "checkpoint" or the --quant mode


def model_inputs(spec: Spec, quant: str | None) -> ModelInputs:
    raw = read_config(spec)
    text_key = spec.abi.config if spec.abi else "text_config"
    arch = architecture(raw, text_key)
    declared = list(spec.backend_options("simulation").get("quant_modes") or [])
    policy = resolve_policy(quant, declared, spec.quantization)
    text_cfg = raw[text_key] if text_key else raw
    return ModelInputs(arch, text_cfg, policy, quant.upper() if quant else "checkpoint")
