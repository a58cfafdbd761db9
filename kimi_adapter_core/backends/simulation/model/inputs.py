"""What both commands read from a spec: the model's structure, its parameter inventory and the weight policy.

Shared by ``kadapt plan`` and ``kadapt simulate`` so that both size the same model the same way.
Plan works from the raw hub JSON (``spec.source.config``) through ``structure_of_raw``, not
``loading.load_config``: the config bridges of shipped specs rename vision fields (both spellings
are accepted) or add root-level copies the structure does not read, so they cannot change a size -
and the raw path needs no torch. ``simulate`` sizes the deployment from these too, but builds the
model it traces through the spec (``rank_model``: ``applied`` + ``load_config`` + ``load_model``),
bridges and patches included, and reports a bridge that changes a traced size.
"""

from __future__ import annotations

from dataclasses import dataclass

from ....spec.model import Spec
from .arch import Architecture, architecture, read_config
from .census import departure_note
from .params import Naming, ParamGroup, naming, param_groups
from .quant import Policy, check_schemes, checkpoint_storage_of, resolve_policy


@dataclass(frozen=True)
class ModelInputs:
    arch: Architecture
    naming: Naming
    groups: tuple[ParamGroup, ...]  # the parameter inventory, with checkpoint names
    policy: Policy
    quant_label: str  # "checkpoint" or the --quant mode
    notes: tuple[str, ...] = ()  # things sizing could not honour (printed as warnings)

    def group_of(self) -> dict[str, ParamGroup]:
        """Checkpoint name -> its parameter group."""
        return {name: group for group in self.groups for name, _ in group.tensors()}


def model_inputs(spec: Spec, quant: str | None) -> ModelInputs:
    raw = read_config(spec)
    arch = architecture(spec, raw)
    names = naming(spec)
    groups = tuple(param_groups(arch, names))
    check_schemes(spec, groups)
    stored = checkpoint_storage_of(spec, raw, names)
    declared = list(spec.backend_options("simulation").get("quant_modes") or [])
    policy = resolve_policy(quant, declared, spec.quantization, stored)
    notes = () if quant else stored.notes  # why a scheme does not size the checkpoint a --quant mode replaces
    departure = departure_note(arch.model_type, spec.path)
    if departure is not None:
        notes = (*notes, departure)
    return ModelInputs(arch, names, groups, policy, quant.upper() if quant else "checkpoint", notes)
