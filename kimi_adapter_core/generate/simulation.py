"""The ``simulation`` target: a TensorCast ``ModelProfile`` module filled from the spec.

Each profile field is copied from exactly one spec entry (``PROFILE_FIELDS``); a field whose entry
the spec leaves out is left out too, so TensorCast's own default applies rather than a guess. A dense
model (no ``moe`` section) gets no MoE fields and a model without an ``mla`` section no MLA module:
the profile claims only the swaps the spec declares.

Module paths are the exception: a spec's ``module_paths`` are rooted at the model kadapt builds
(``loading.load_model``: the first of transformers' image-text-to-text / causal-LM / base auto
classes that knows the config), while TensorCast builds ``AutoModel`` (its
``AutoModelConfigLoader.try_to_load_model``, ``AutoModelForCausalLM`` only when that fails). For a
native config that is the base model kadapt's model holds at ``base_model_prefix``, so the profile
gets each path re-rooted there (``PATH_FIELDS``; ``model.language_model.layers`` becomes
``language_model.layers``). Remote code names its classes in ``auto_map``; both build the class
``auto_map`` names, or the target cannot be generated.

A spec with environment shims or simulation patches also gets the patch runtime
(``patching/portable.py``, embedded verbatim) plus its shims and patches as data, with each
implementation's own source embedded; ``hf_config_patch_method`` installs them behind the gate.

A spec with a vision tower (``module_paths.vision_layers``) also gets the vision path TensorCast's
image inputs need: its image sizing for the profile's model_type (TensorCast's fallback is another
family's rule, in a module that imports torchvision) and a TensorCast attention instance for each
vision layer's ``attn`` (TensorCast tags only Qwen-VL's ``blocks.*.attn``).

Every profile checks itself, loudly, where TensorCast cannot swallow it: the transformers range of
``requires.transformers``, and -- once TensorCast has built the model -- the class it built, every
module path, and every field each declared MLA/MoE swap needs (``TENSORCAST_MLA_FIELDS``,
``TENSORCAST_MOE_FIELDS``); after TensorCast's swaps it checks they all happened.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from ..config.source import resolve_source
from ..errors import KadaptError
from ..patching import portable
from ..patching.impls import resolve_impl
from ..patching.remote import uses_remote_code
from ..patching.targets import parse_target
from ..spec.model import Spec
from .bridges import bridge_context
from .common import Rendered, cannot, gate_context, lookup, package_files, require, spec_identity
from .embed import EmbeddedCallables, split_module
from .environment import render
from .tensorcast_coverage import TARGET, refuse_unpriced_layers

# Patch kinds the embedded runtime installs (portable.BUILDERS + set_attribute).
GENERATED_KINDS = (*portable.BUILDERS, "set_attribute")
# Names the profile template itself defines at module level: embedded code must not rebind them.
TEMPLATE_NAMES = frozenset(
    {"MODEL_TYPE", "GATE_MODEL_TYPE", "GATE_SUB_CONFIGS", "PROFILE", "REGISTRY_MODULE", "SHIMS", "PATCHES"}
    | {"gate_matches", "hf_config_patch_method", "remove_patches", "installed_patches", "model_profile"}
    | {"register", "replace_builtin", "_registry", "_RUNTIME", "_MISSING", "_PATH_STEP", "_steps"}
    | {"_child", "_lookup", "_parent", "_assign", "_rename", "_copy", "_set_default", "_importable"}
    | {
        "MODULE_PATHS",
        "REQUIRES",
        "TENSORCAST_BUILDS",
        "KADAPT_BUILDS",
        "SWAPS",
        "BRIDGE",
        "ATTENTION_MODULE",
    }
    | {"ProfileError", "check_environment", "check_model", "patch_method", "verify_swaps", "main"}
    | {"_STATE", "_expected_class", "_fields_of", "_modules_of", "_experts_layout", "_experts_count"}
    | {"_problems_text", "_load_text_generate", "_bridge_kwargs", "_neutral_rope", "_pad_or_trim"}
    | {"_attention_class", "_ATTENTION_CLASS", "_apply_spec", "_check_experts", "ADAPTER", "_readable"}
    | {"IMAGE_SIZING", "IMAGE_SIZING_ARGS", "VISION_ATTENTION", "image_size", "_SIZING"}
    | {"install_image_sizing", "remove_image_sizing", "tag_vision_attention"}
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
    ("moe_field_names_override", "moe.field_renames"),
)
# ModelProfile path field -> module_paths key it is re-rooted from (at the class TensorCast builds).
PATH_FIELDS: tuple[tuple[str, str], ...] = (
    ("language_module_path", "language_model"),
    ("language_layers_path_str", "language_layers"),
    ("visual_module_path", "vision_tower"),
    ("visual_layers_module_path", "vision_layers"),
    ("visual_layers_path_str", "vision_layers"),
)
# TensorCast's MlaFieldNames / MoEFieldNames (msmodeling 0.2.0, tensor_cast/model_config.py):
# field -> required. A swap whose module lacks a required field is skipped with only a PatchReport
# entry; optional ones (``Optional[str]`` there) may be absent. ``q_proj`` or all three of
# ``q_a_proj``/``q_b_proj``/``q_a_layernorm`` must be named (MlaFieldNames.__post_init__).
TENSORCAST_MLA_FIELDS: dict[str, bool] = {
    "config": True,
    "layer_idx": True,
    "num_heads": True,
    "q_lora_rank": True,
    "qk_nope_head_dim": True,
    "qk_rope_head_dim": True,
    "qk_head_dim": True,
    "kv_lora_rank": True,
    "v_head_dim": True,
    "q_proj": False,
    "q_a_proj": False,
    "q_b_proj": False,
    "kv_a_proj_with_mqa": True,
    "kv_b_proj": False,
    "o_proj": True,
    "q_a_layernorm": False,
    "kv_a_layernorm": True,
}
TENSORCAST_MOE_FIELDS: dict[str, bool] = {
    "gate": True,
    "experts": True,
    "shared_experts": False,
    "shared_experts_gate": False,
    "top_k": False,
    "norm_topk_prob": False,
}
# How routed experts hold their weights (backends.simulation.experts_layout) -> TensorCast's
# custom_expert_module_type: its default (MoeExpertMLP) splits stacked [num_experts, ...] weights
# into per-expert modules and fails on a per-expert ModuleList, which must be left alone (None).
EXPERTS_LAYOUTS = ("stacked", "per_expert")
# What TensorCast's default per-expert adapter (MoeExpertMLP, msmodeling 0.2.0) reads from stacked
# experts: gate_up_proj [num_experts, 2 * intermediate, hidden] (gate rows first), down_proj
# [num_experts, hidden, intermediate]. Experts laid out otherwise are declared ``experts_layout: other``.
TENSORCAST_EXPERT_ADAPTER_FIELDS = ("hidden_dim", "intermediate_dim", "act_fn", "gate_up_proj", "down_proj")
# auto_map keys, in the order TensorCast tries them (AutoModel, then AutoModelForCausalLM).
TENSORCAST_AUTO_KEYS = ("AutoModel", "AutoModelForCausalLM")


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


# -- which class TensorCast builds, and where kadapt's module paths sit in it ------------------------


def _remote_roots(spec: Spec) -> dict[str, Any]:
    from ..patching.remote import _MODEL_AUTO_KEYS

    try:
        raw = resolve_source(spec).raw
    except KadaptError as exc:
        raise cannot(spec, TARGET, exc.message, "source") from exc
    auto_map = raw.get("auto_map") or {}
    ours = next((auto_map[k] for k in _MODEL_AUTO_KEYS if k in auto_map), None)
    theirs = next((auto_map[k] for k in TENSORCAST_AUTO_KEYS if k in auto_map), None)
    if ours is None or theirs is None:
        raise cannot(spec, TARGET, "the remote config's auto_map names no model class", "source")
    if ours != theirs:
        raise cannot(
            spec,
            TARGET,
            f"TensorCast builds auto_map's {theirs} and kadapt's module_paths are rooted at {ours}",
            "module_paths",
        )
    name = ours.rpartition(".")[2]
    return {"tensorcast": name, "kadapt": name, "prefix": "", "remote": True}


def _native_roots(spec: Spec) -> dict[str, Any]:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ..loading import _AUTO_CLASSES

    model_type = spec.gate.model_type
    try:
        raw = resolve_source(spec).raw
        model_type = raw.get("model_type") or model_type
    except KadaptError:
        pass
    if model_type not in CONFIG_MAPPING:
        raise cannot(
            spec, TARGET, f"transformers {transformers.__version__} has no model_type {model_type!r}"
        )
    config_class = CONFIG_MAPPING[model_type]

    def mapped(auto_name: str) -> type | None:
        mapping = getattr(transformers, auto_name)._model_mapping
        return mapping[config_class] if config_class in mapping else None

    ours = next((c for c in map(mapped, _AUTO_CLASSES) if c is not None), None)
    theirs = mapped("AutoModel") or mapped("AutoModelForCausalLM")
    if ours is None or theirs is None:
        raise cannot(spec, TARGET, f"transformers has no model class for {config_class.__name__}")
    prefix = "" if ours is theirs else ours.base_model_prefix
    return {"tensorcast": theirs.__name__, "kadapt": ours.__name__, "prefix": prefix, "remote": False}


def tensorcast_roots(spec: Spec) -> dict[str, Any]:
    """``{tensorcast, kadapt, prefix, remote}``: the class TensorCast builds, the one kadapt builds
    and the attribute path of the former inside the latter (``""`` when they are the same)."""
    return _remote_roots(spec) if uses_remote_code(spec) else _native_roots(spec)


def rebase(path: str, prefix: str) -> str | None:
    """``path`` (rooted at kadapt's model) seen from the submodule at ``prefix``; None outside it."""
    if not prefix:
        return path
    if path == prefix:
        return ""
    return path[len(prefix) + 1 :] if path.startswith(prefix + ".") else None


def path_fields(spec: Spec, roots: dict[str, Any]) -> list[dict[str, Any]]:
    """``[{name, value, source}]`` for the ModelProfile path fields, re-rooted at TensorCast's model.

    A language model that *is* TensorCast's root gets no ``language_module_path`` (TensorCast reads
    an empty path as "no separate language model", its text-only default).
    """
    fields = []
    for name, key in PATH_FIELDS:
        if key not in spec.module_paths:
            continue
        path = spec.module_paths[key]
        value = rebase(path, roots["prefix"])
        if value is None:
            raise cannot(
                spec,
                TARGET,
                f"module_paths.{key} = {path!r} is outside {roots['prefix']!r}, the {roots['tensorcast']} "
                f"that TensorCast builds",
                f"module_paths.{key}",
            )
        if not value and name == "language_module_path":
            continue
        if not value:
            raise cannot(
                spec,
                TARGET,
                f"module_paths.{key} = {path!r} is the whole {roots['tensorcast']}, not a submodule",
                f"module_paths.{key}",
            )
        source = f"module_paths.{key}" + (f", under {roots['prefix']}" if roots["prefix"] else "")
        fields.append({"name": name, "value": value, "source": source})
    return fields


# -- the declared swaps ------------------------------------------------------------------------------


def _swap(fields: dict[str, bool], renames: dict[str, str]) -> dict[str, Any]:
    return {
        "fields": {name: renames.get(name, name) for name in fields},
        "optional": sorted(n for n, required in fields.items() if not required),
        "renamed": sorted(renames),
    }


def swaps_context(spec: Spec) -> dict[str, dict[str, Any]]:
    """The swaps the spec declares, keyed by TensorCast's pass name (its ``PatchReport.pass_name``):
    class, TensorCast's config attribute, field -> attribute, optional fields, renamed fields."""
    swaps: dict[str, dict[str, Any]] = {}
    if spec.mla:
        renames = dict(spec.mla.get("field_renames") or {})
        unknown = sorted(set(renames) - set(TENSORCAST_MLA_FIELDS))
        if unknown:
            raise cannot(
                spec, TARGET, f"mla.field_renames names {unknown}, which TensorCast has no field for", "mla"
            )
        swaps["MLA"] = {
            "module": spec.mla["attention_class"],
            "tensorcast_config": "mla_config",
            **_swap(TENSORCAST_MLA_FIELDS, renames),
        }
    if spec.moe:
        moe_renames = dict(spec.moe.get("field_renames") or {})
        unknown = sorted(set(moe_renames) - set(TENSORCAST_MOE_FIELDS))
        if unknown:
            raise cannot(
                spec, TARGET, f"moe.field_renames names {unknown}, which TensorCast has no field for", "moe"
            )
        layout = spec.backend_options(TARGET).get("experts_layout", "stacked")
        if layout == "other":
            raise cannot(
                spec,
                TARGET,
                "backends.simulation.experts_layout is 'other': TensorCast's per-expert adapter "
                f"(MoeExpertMLP: {', '.join(TENSORCAST_EXPERT_ADAPTER_FIELDS)}) cannot read these experts",
                "backends.simulation.experts_layout",
            )
        if layout not in EXPERTS_LAYOUTS:  # the schema refuses it first
            raise cannot(spec, TARGET, f"experts_layout {layout!r} is none of {EXPERTS_LAYOUTS}")
        swaps["MoE"] = {
            "module": spec.moe["moe_class"],
            "tensorcast_config": "moe_config",
            **_swap(TENSORCAST_MOE_FIELDS, moe_renames),
            "experts_layout": layout,
            "num_experts_key": spec.moe["num_experts_key"],
        }
    return swaps


def _bridge_context(spec: Spec, roots: dict[str, Any]) -> dict[str, Any] | None:
    """What TensorCast's MLA module must do for a model whose own code calls attention its way.

    Derived from the spec's simulation patches: an ``adapt_return`` on the MLA class's ``forward``
    says how many values the model's decoder unpacks (TensorCast's MLA returns two), and a ``wrap``
    of the built class's ``forward`` that stashes extra kwargs says where the kwargs TensorCast
    passes to the model (``attention_meta``, ``kv_cache_by_layers``, ...) end up. Such a model's
    decoder also passes no rotary ``position_embeddings``; the bridge supplies them.
    """
    if not spec.mla:
        return None
    arity, stash = None, None
    for patch in spec.patches:
        if TARGET not in patch.backends:
            continue
        ref = parse_target(patch.target)
        if ref.attr != "forward" or len(ref.owner_path) != 1:
            continue
        owner = ref.owner_path[0]
        if patch.kind == "adapt_return" and owner == spec.mla["attention_class"]:
            arity = patch.options.get("arity")
        if patch.kind == "wrap" and owner == roots["tensorcast"] and patch.options.get("stash_extra_as"):
            stash = patch.options["stash_extra_as"]
    if arity is None and stash is None:
        return None
    return {"arity": arity, "stash": stash}


# -- shims and patches -------------------------------------------------------------------------------


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
                "pin": tuple((pin.release, pin.signature, pin.source_sha256) for pin in patch.pins) or None,
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
    refuse_unpriced_layers(spec)
    fields = profile_fields(spec)
    roots = tensorcast_roots(spec)
    paths = path_fields(spec, roots)
    requires = {k: v for k, v in spec.requires.items() if k == "transformers"}
    context = {
        "spec": spec_identity(spec),
        "gate": gate_context(spec),
        "model_type": next(f["value"] for f in fields if f["name"] == "model_type"),
        "profile": fields,
        "paths": paths,
        "roots": roots,
        "requires": requires,
        "swaps": swaps_context(spec),
        "bridge": _bridge_context(spec, roots),
        "vision": any(f["name"] == "visual_layers_module_path" for f in paths),
        **bridge_context(spec, backend=TARGET, target=TARGET),
        **_runtime_context(spec),
    }
    text = render("simulation/tensorcast_profile.py.j2", context, spec_name=spec.name, target=TARGET)
    return [
        Rendered(PurePosixPath("adapters", spec.name, "tensorcast_profile.py"), text),
        *package_files(spec, TARGET),
    ]
