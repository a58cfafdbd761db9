"""The ``simulation`` target: a TensorCast ``ModelProfile`` module filled from the spec.

Each profile field is copied from exactly one spec entry (``PROFILE_FIELDS``); a field whose entry
the spec leaves out is left out too, so TensorCast's own default applies rather than a guess.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from ..spec.model import Spec
from .bridges import bridge_context
from .common import Rendered, cannot, gate_context, lookup, package_files, require, spec_identity
from .environment import render

TARGET = "simulation"

# ModelProfile field -> spec entry it is copied from (TensorCast msmodeling 0.2.0 field names).
PROFILE_FIELDS: tuple[tuple[str, str], ...] = (
    ("model_type", "backends.simulation.model_type"),
    ("moe_module_name", "moe.moe_class"),
    ("moe_num_experts_key", "moe.num_experts_key"),
    ("moe_gate_returns_raw_logits", "moe.routing.gate_returns_raw_logits"),
    ("moe_route_after_dp_transform", "moe.routing.route_after_dp_transform"),
    ("mtp_block_module_name", "backends.simulation.mtp_module_name"),
    ("mla_module_name", "mla.attention_class"),
    ("mla_field_names_override", "mla.field_renames"),
    ("language_module_path", "module_paths.language_model"),
    ("language_layers_path_str", "module_paths.language_layers"),
    ("visual_module_path", "module_paths.vision_tower"),
    ("visual_layers_module_path", "module_paths.vision_layers"),
    ("visual_layers_path_str", "module_paths.vision_layers"),
)


def _has(raw: dict[str, Any], dotted: str) -> bool:
    parent, _, key = dotted.rpartition(".")
    node = lookup(raw, parent) if parent else raw
    return isinstance(node, dict) and key in node


def profile_fields(spec: Spec) -> list[dict[str, Any]]:
    """``[{name, value, source}]`` in ModelProfile field order; ``model_type`` falls back to the gate."""
    fields = []
    for name, source in PROFILE_FIELDS:
        if name == "model_type" and not _has(spec.raw, source):
            source = "gate.model_type"
        if _has(spec.raw, source):
            fields.append({"name": name, "value": lookup(spec.raw, source), "source": source})
    return fields


def render_simulation(spec: Spec) -> list[Rendered]:
    require(spec, TARGET, "moe", "module_paths")
    patches = [p.id for p in spec.patches if TARGET in p.backends]
    carried_elsewhere = patches + [e.id for e in spec.environment]
    if carried_elsewhere:
        raise cannot(
            spec,
            TARGET,
            f"its simulation patches/shims ({', '.join(carried_elsewhere)}) cannot be carried by a "
            "TensorCast profile module yet (`kadapt apply --backend simulation` applies them in-process)",
        )
    fields = profile_fields(spec)
    context = {
        "spec": spec_identity(spec),
        "gate": gate_context(spec),
        "model_type": next(f["value"] for f in fields if f["name"] == "model_type"),
        "profile": fields,
        **bridge_context(spec, backend=TARGET, target=TARGET),
    }
    text = render("simulation/tensorcast_profile.py.j2", context, spec_name=spec.name, target=TARGET)
    return [
        Rendered(PurePosixPath("adapters", spec.name, "tensorcast_profile.py"), text),
        *package_files(spec, TARGET),
    ]
