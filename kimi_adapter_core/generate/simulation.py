"""The ``simulation`` target: a TensorCast ``ModelProfile`` module filled from the spec.

Each profile field is copied from exactly one spec entry (``PROFILE_FIELDS``); a field whose entry
the spec leaves out is left out too, so TensorCast's own default applies rather than a guess. A dense
model (no ``moe`` section) gets no MoE fields and a model without an ``mla`` section no MLA module:
the profile claims only the swaps the spec declares.

A spec with environment shims or simulation patches also gets the patch runtime
(``patching/portable.py``, embedded verbatim) plus its shims and patches as data, with each
implementation's own source embedded; ``hf_config_patch_method`` installs them behind the gate.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import KadaptError
from ..patching import portable
from ..patching.impls import resolve_impl
from ..patching.targets import parse_target
from ..spec.model import Spec
from .bridges import bridge_context
from .common import Rendered, cannot, gate_context, lookup, package_files, require, spec_identity
from .embed import EmbeddedCallables, split_module
from .environment import render

TARGET = "simulation"
# Patch kinds the embedded runtime installs (portable.BUILDERS + set_attribute).
GENERATED_KINDS = (*portable.BUILDERS, "set_attribute")
# Names the profile template itself defines at module level: embedded code must not rebind them.
TEMPLATE_NAMES = frozenset(
    {"MODEL_TYPE", "GATE_MODEL_TYPE", "GATE_SUB_CONFIGS", "PROFILE", "REGISTRY_MODULE", "SHIMS", "PATCHES"}
    | {"gate_matches", "hf_config_patch_method", "remove_patches", "installed_patches", "model_profile"}
    | {"register", "replace_builtin", "_registry", "_RUNTIME", "_MISSING", "_PATH_STEP", "_steps"}
    | {"_child", "_lookup", "_parent", "_assign", "_rename", "_copy", "_set_default", "_importable"}
)

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


def _embed(spec: Spec, embedded: EmbeddedCallables, impl: str, who: str, where: str) -> str:
    try:
        return embedded.add(resolve_impl(impl), what=f"{who} ({impl})")
    except KadaptError as exc:
        raise cannot(spec, TARGET, exc.message, where) from exc


def _shims(spec: Spec, embedded: EmbeddedCallables) -> list[dict[str, Any]]:
    rows = []
    for shim in spec.environment:
        module, _, attr = shim.target.partition(":")
        if shim.kind != "inject_symbol" or not module or not attr.isidentifier():
            raise cannot(
                spec, TARGET, f"environment {shim.id}: {shim.kind} {shim.target!r} has no generated form"
            )
        value = _embed(spec, embedded, shim.impl, f"environment {shim.id}", shim.where)
        rows.append({"id": shim.id, "why": shim.why, "module": module, "attr": attr, "value": value})
    return rows


def _patches(spec: Spec, embedded: EmbeddedCallables) -> list[dict[str, Any]]:
    rows = []
    for patch in spec.patches:
        if TARGET not in patch.backends:
            continue
        if patch.kind not in GENERATED_KINDS:
            raise cannot(
                spec, TARGET, f"patch {patch.id}: kind {patch.kind!r} has no generated form", patch.where
            )
        if patch.pin is not None:
            raise cannot(
                spec, TARGET, f"patch {patch.id}: pins are not checked by generated code yet", patch.where
            )
        ref = parse_target(patch.target)
        impl = _embed(spec, embedded, patch.impl, f"patch {patch.id}", patch.where) if patch.impl else None
        rows.append(
            {
                "id": patch.id,
                "why": patch.why,
                "kind": patch.kind,
                "module": ref.module,
                "owner": tuple(ref.owner_path),
                "attr": ref.attr,
                "remote": ref.remote,
                "impl": impl,
                "value": patch.value,
                "options": dict(sorted(patch.options.items())),
            }
        )
    return rows


def _runtime_context(spec: Spec) -> dict[str, Any]:
    """Shims, patches and the embedded runtime; ``None`` when the spec has nothing to install."""
    embedded = EmbeddedCallables()
    shims, patches = _shims(spec, embedded), _patches(spec, embedded)
    if not shims and not patches:
        return {"runtime": None}
    module = split_module(Path(portable.__file__))
    clashes = sorted((module.names | TEMPLATE_NAMES) & (set(embedded.sources) | set(embedded.constants)))
    if clashes:
        raise cannot(spec, TARGET, f"implementations {clashes} clash with names of the generated module")
    return {
        "runtime": {"imports": list(module.imports), "body": module.body, "summary": module.summary},
        "shims": shims,
        "patches": patches,
        "impl_imports": sorted(embedded.imports - set(module.imports)),
        "impl_constants": dict(sorted(embedded.constants.items())),
        "impl_sources": list(embedded.sources.values()),
    }


def render_simulation(spec: Spec) -> list[Rendered]:
    require(spec, TARGET, "module_paths")
    fields = profile_fields(spec)
    context = {
        "spec": spec_identity(spec),
        "gate": gate_context(spec),
        "model_type": next(f["value"] for f in fields if f["name"] == "model_type"),
        "profile": fields,
        **bridge_context(spec, backend=TARGET, target=TARGET),
        **_runtime_context(spec),
    }
    text = render("simulation/tensorcast_profile.py.j2", context, spec_name=spec.name, target=TARGET)
    return [
        Rendered(PurePosixPath("adapters", spec.name, "tensorcast_profile.py"), text),
        *package_files(spec, TARGET),
    ]
