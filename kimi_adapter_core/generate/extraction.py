"""The ``extraction`` target: a standalone module that builds the adapted model and its ABI wrappers.

``adapters/<name>/extraction.py`` imports without kadapt: the extraction runtime
(``backends/extraction/runtime/abi.py``) is embedded verbatim, the shipped config becomes a dict
literal, each config bridge a plain statement and each patch implementation its own source. What
cannot be carried that way (remote-code targets, patch kinds without a generated form) is refused
with the spec entry named, rather than generated half-working.

The module bakes in the model's structure as kadapt derives it (``structure/``): the attention kind,
the resolved KV layout (the spec's ``abi.kv_layout`` or the attention's default), the per-token KV
dims (each layer's own, ``LAYER_KV_DIMS``, where the layers cache different shapes: MiMo-V2-Flash,
Gemma-4) and every layer's sliding window, and for Llama-4's chunked-attention layers every layer's
attention chunk (``CHUNKS``), which its wrappers mask inside the graph as kadapt apply's do; for a
hybrid stack also each layer's kind and a linear layer's states (a conv window and a recurrent state;
lightning attention the recurrent state alone, LFM2's short convolution the conv window alone), which
its wrappers, example inputs, names and state mapping carry in the layer's place; for a DSA stack
(DeepSeek-V3.2) each layer's kind and the width of the indexer keys, which they carry after the
layer's key and value; for a stack with compressed layers (DeepSeek-V4's ``hca``,
``csa``) each layer's kind, each kind's compress rate and a csa layer's indexer key width, which they
carry as a compressor's ring and entries (a csa layer's indexer's after those) after the layer's key
and value. It also carries the config keys each of those facts is read from, so that
``kv_dims(config)``, ``windows(config)`` (and ``layer_kv_dims(config)``, ``chunks(config)``,
``layer_kinds(config)``, ``linear_states(config)``, ``index_dim(config)``, ``compress_rates(config)``)
follow a config built with overrides (a tiny model of the same family) the way kadapt's
``derive_structure`` would.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path, PurePosixPath
from typing import Any

from .. import __version__, upstream
from ..backends.extraction.ir import encoding
from ..backends.extraction.job.contact_points import stack_points
from ..backends.extraction.names import kv_names
from ..backends.extraction.options import abi_graph_names, spec_paged
from ..backends.extraction.runtime import abi as runtime
from ..backends.extraction.runtime import step, step_bind, symbolic
from ..backends.extraction.runtime.abi import COMPRESSED_KINDS
from ..backends.extraction.step_options import STEP_FIXED
from ..checkpoint import dtypes
from ..config.source import resolve_source
from ..errors import KadaptError
from ..patching import portable
from ..patching.impls import resolve_impl
from ..patching.portable import BUILDERS
from ..patching.targets import parse_target
from ..spec.model import Spec
from ..structure.compressor_of import LEGACY_RATIO_TYPES
from ..structure.kv_sharing import kv_sharing_rule
from ..structure.layer_shapes import LATENT_LAYER_FACTS, per_layer_attributes
from ..structure.linear_of import DERIVED, MIXERS
from ..structure.mixer import RECURRENT_AXES, VALUE_CONV_KINDS
from ..structure.model import ModelStructure
from ..structure.reader import fact_keys, mlp_block_types, outside_modelled, tables
from ..structure.shared_blocks import hybrid_layer_type
from . import abi as abi_tables
from .bridges import bridge_context
from .common import Rendered, cannot, gate_context, package_files, require, spec_identity
from .embed import EmbeddedCallables, split_module
from .environment import render
from .literals import py_literal
from .serving import serving_context

TARGET = "extraction"
# Patch kinds the generated module can carry (see templates/extraction/module.py.j2): each is built by
# kadapt's own builder of the kind (``patching.portable.BUILDERS``), embedded in the module.
GENERATED_KINDS = ("replace", "wrap")
# Structural facts the generated ``kv_dims`` (per KV layout) and ``windows`` read from a text config.
KV_FACTS = {
    "heads": ("num_heads", "num_kv_heads", "head_dim", "hidden_size"),
    "latent": ("kv_lora_rank", "qk_rope_head_dim"),
    "expanded": ("num_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
}
WINDOW_FACTS = (
    "num_layers",
    "sliding_window",
    "use_sliding_window",
    "layer_types",
    "max_window_layers",
    "sliding_window_pattern",
)
# What the generated ``layer_kinds`` reads from a hybrid stack's text config; ``linear_states`` reads
# the facts its mixer kind is sized by (``linear_of.MIXERS``, but for the sizes no key states).
HYBRID_FACTS = ("full_attention_interval",)
# The mixer sizes a scan over the values alone keeps (``linear_of.MIXERS`` also names its dt rank)
STATE_SIZES = ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel")
# What the generated ``kv_dims`` also reads where the values are narrower than the keys (MiMo-V2-Flash).
VALUE_FACTS = ("v_head_dim",)
# What the generated ``index_dim`` reads from a DSA stack's text config (the indexer keys' width).
INDEX_FACTS = ("index_head_dim", "indexer_types")  # indexer_types: which DSA layers score their own keys
# What the generated ``chunks`` reads from a stack with chunked-attention layers (Llama-4's rule).
CHUNK_FACTS = ("attention_chunk_size", "rope_layer_flags", "no_rope_interval")
# What the generated ``layer_kinds``, ``compress_rates`` and ``index_dim`` read from a stack with
# compressed layers (DeepSeek-V4: each kind's rate by layer type, or the legacy per-layer ratios; the csa
# layers' Lightning indexer's key width).
COMPRESSED_FACTS = ("compress_rates", "compress_ratios")
CSA_FACTS = ("index_head_dim",)


def _fail(spec: Spec, where: str, message: str) -> KadaptError:
    return cannot(spec, TARGET, message, where)


def _patches(spec: Spec, embedded: EmbeddedCallables) -> list[dict[str, Any]]:
    rows = []
    for patch in spec.patches:
        if TARGET not in patch.backends:
            continue
        if patch.is_remote:
            raise _fail(
                spec,
                patch.where,
                f"patch {patch.id} targets remote code, which a generated module cannot load",
            )
        if patch.kind not in GENERATED_KINDS:
            raise _fail(spec, patch.where, f"patch {patch.id}: kind {patch.kind!r} has no generated form yet")
        ref = parse_target(patch.target)
        impl_name = embedded.add(resolve_impl(patch.impl or ""), what=f"patch {patch.id} ({patch.impl})")
        builder = embedded.add(BUILDERS[patch.kind], what=f"patch kind {patch.kind}")
        rows.append(
            {
                "id": patch.id,
                "why": patch.why,
                "kind": patch.kind,
                "builder": builder,
                "options": dict(patch.options),
                "module": ref.module,
                "owner": ".".join(ref.owner_path),
                "attr": ref.attr,
                "impl": impl_name,
                "pin": tuple((pin.release, pin.signature, pin.source_sha256) for pin in patch.pins) or None,
            }
        )
    return rows


def _source_config(spec: Spec) -> dict[str, Any]:
    if spec.source.config is None:
        raise _fail(spec, "source", "the spec ships no config (source.config) to embed")
    return resolve_source(spec).raw


def repeated_literal(values: tuple[Any, ...]) -> str:
    """``(None,) * 32`` for a run of one value, else the tuple literal: short and exact."""
    if values and len(set(values)) == 1:
        return f"({py_literal(values[0])},) * {len(values)}"
    return py_literal(values)


def periodic_literal(values: tuple[Any, ...]) -> str:
    """``("linear", "linear", "linear", "attention") * 12`` for a repeated pattern (its shortest period),
    else ``repeated_literal``: short and exact."""
    for period in range(2, len(values) // 2 + 1):
        if len(values) % period == 0 and values == values[:period] * (len(values) // period):
            return f"{py_literal(values[:period])} * {len(values) // period}"
    return repeated_literal(values)


def fact_candidates(spec: Spec, facts: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Config keys of each fact in lookup order: kadapt's table, or the spec's ``architecture.fields``."""
    table = fact_keys()
    fields = dict((spec.architecture or {}).get("fields") or {})
    return {fact: (fields[fact],) if fact in fields else tuple(table.get(fact, [fact])) for fact in facts}


def structure_data(structure: ModelStructure) -> dict[str, Any]:
    """``structure.to_dict()`` without the attention fields its kind does not have (all None), the
    stack's and a layer's own (``attention_shape``) alike."""
    data = structure.to_dict()
    data["attention"] = {k: v for k, v in data["attention"].items() if v is not None}
    for run in data["layers"]:
        if "attention_shape" in run:
            run["attention_shape"] = {k: v for k, v in run["attention_shape"].items() if v is not None}
    return data


def kv_text(d: abi_tables.Dims) -> str:
    """What one layer caches per token, for the module's docstring: one shape, or each layer group's."""

    def shape(dims: abi_tables.KVDims) -> str:
        (key_heads, key_dim), (value_heads, value_dim) = dims
        return f"a key of {key_heads} x {key_dim} and a value of {value_heads} x {value_dim}"

    if d.layer_kv_dims is None:
        return f"per layer and token {shape(d.kv_dims)} (heads x width)"
    groups = ", ".join(
        f"{len(group.ids)} {'/'.join(group.spans)} layers {shape(group.dims)}" for group in d.kv_groups()
    )
    own = "per layer and token a key and value of the layer's own shape (``LAYER_KV_DIMS``, heads x width)"
    return f"{own}: {groups}"


def structure_context(spec: Spec, d: abi_tables.Dims) -> dict[str, Any]:
    """What the module bakes in about the text backbone, read from kadapt's structure of it."""
    linear = d.structure.linear
    # the mixer's sizes a config key states (a short convolution's one-wide heads are no key's); a scan
    # over the values alone (Mamba1, Zamba's multi-head Mamba1) keeps the state sizes its config class
    # computes, which the module computes alike (``_linear_size``), and the facts they come from
    value_conv = linear is not None and linear.kind in VALUE_CONV_KINDS and linear.kind != "short_conv"
    sizes = (
        {
            name: fact
            for name, fact in MIXERS[linear.kind].items()
            if (name in STATE_SIZES if value_conv else fact not in DERIVED)
        }
        if linear
        else {}
    )
    read = [f for fact in sizes.values() for f in DERIVED.get(fact, (fact,))]
    linear_facts = (*HYBRID_FACTS, *read) if d.hybrid else ()
    index_facts = INDEX_FACTS if d.index_dim is not None else ()
    compressors = d.structure.compressors
    # the config's layer types that are compressed layers -> their ABI kind (config_keys.yaml: hca, csa)
    compressed_types = {
        layer_type: span for layer_type, span in tables()["layer_types"].items() if span in COMPRESSED_KINDS
    }
    sparse = compressors.get("csa")
    compressed_facts = (*COMPRESSED_FACTS, *(CSA_FACTS if sparse else ())) if compressors else ()
    chunked = d.structure.has_chunked_layers
    chunk_facts = CHUNK_FACTS if chunked else ()
    attention = d.structure.attention
    narrow_values = d.kv_layout == "heads" and attention.v_head_dim != attention.head_dim
    value_facts = VALUE_FACTS if narrow_values else ()
    facts = tuple(
        dict.fromkeys(
            (
                *WINDOW_FACTS,
                *KV_FACTS[d.kv_layout],
                *value_facts,
                *linear_facts,
                *index_facts,
                *compressed_facts,
                *chunk_facts,
            )
        )
    )
    assert spec.abi is not None
    per_layer = d.layer_kv_dims
    return {
        "summary": d.structure.describe(),
        "data": structure_data(d.structure),
        "attention": d.structure.attention.kind,
        "is_mla": d.structure.attention.is_mla,
        "kv_layout": d.kv_layout,
        "kv_layout_source": "from abi.kv_layout"
        if spec.abi is not None and spec.abi.kv_layout
        else f"the default of {d.structure.attention.kind.upper()} attention",
        "mla_attention": d.mla_attention,
        "kv_dims": d.kv_dims,
        # values narrower than keys (MiMo-V2-Flash): kv_dims reads their width (v_head_dim)
        "narrow_values": narrow_values,
        # layers caching different KV shapes (MiMo-V2-Flash, Gemma-4): LAYER_KV_DIMS and layer_kv_dims(config)
        "per_layer": per_layer is not None,
        "layer_kv_dims": periodic_literal(per_layer) if per_layer is not None else None,
        "kv_text": kv_text(d),
        "layer_shape_rules": tables()["per_layer_attention"]["rules"].get(d.structure.model_type, {}),
        # a latent attention's layer may also have its own heads, latent rank and nope width
        "per_layer_attributes": {
            key: fact
            for key, fact in per_layer_attributes().items()
            if attention.is_mla or fact not in LATENT_LAYER_FACTS
        },
        "windows": repeated_literal(d.structure.windows),
        "sliding": d.structure.has_sliding_layers,
        # chunked-attention layers (Llama-4): CHUNKS and chunks(config), passed like the windows
        "chunked": chunked,
        "chunks": periodic_literal(d.structure.chunks) if chunked else None,
        "fact_keys": fact_candidates(spec, facts),
        # facts the family's code fixes whatever the config says (config_keys.yaml ``fixed``)
        "fixed_facts": tables()["fixed"].get(d.structure.model_type, {}),
        "hybrid": d.hybrid,
        "num_layers": d.num_layers,
        "linear_count": len(d.structure.linear_layer_ids),
        "layer_kinds": periodic_literal(d.layer_kinds),
        "linear_states": d.linear_states(spec.abi.dtype),
        # lightning attention (MiniMax): layers of kind "lightning" carrying a recurrent state alone
        "lightning": d.linear_kind == "lightning",
        "linear_kind": d.linear_kind,
        # short convolutions (LFM2): layers of kind "short_conv" carrying a conv window alone
        "short_conv": d.linear_kind == "short_conv",
        # the config's layer types that are linear layers (config_keys.yaml: linear_attention, conv, ...)
        "linear_types": tuple(kind for kind, span in tables()["layer_types"].items() if span == "linear"),
        # layers running attention and the linear mixer (Falcon-H1 side by side, Zamba's shared block then
        # the mixer): their config types (``shared_blocks.hybrid_layer_type``), and the type every layer
        # has where the config class fixes it (``uniform_layer_types``)
        "mixed": bool(d.structure.hybrid_layer_ids),
        "hybrid_count": len(d.structure.hybrid_layer_ids),
        "mixed_types": tuple(hybrid_layer_type(d.structure.model_type)),
        "uniform_type": tables()["uniform_layer_types"].get(d.structure.model_type),
        "linear_sizes": sizes,
        "value_conv": value_conv,
        "recurrent_axes": RECURRENT_AXES[linear.kind] if linear is not None else None,
        "indexed": d.index_dim is not None,
        # DSA layers whose rope the model computes from float32 embeddings (dots3): float32 graphs only
        "float32_rope": d.index_dim is not None
        and d.structure.model_type in upstream.FLOAT32_ROPE_MODEL_TYPES,
        # DSA layers beside attention ones (dots3's sliding layers): saved graphs are walked by LAYER_KINDS
        "indexed_mixed": d.index_dim is not None and "attention" in d.layer_kinds,
        "index_dim": d.index_dim,
        "indexer": d.structure.indexer,
        # layers that reuse an earlier layer's keys and values (Gemma-4's KV sharing): kind "shared", no
        # state; the config key that says how many last layers do
        "shared": bool(d.structure.shared_layer_ids),
        "kv_sharing_key": (kv_sharing_rule(d.structure.model_type) or {}).get("key"),
        # compressed layers (DeepSeek-V4's hca, csa): each kind's rate, the layer types (and the legacy
        # per-layer ratios) that name them, and a csa layer's indexer key width (INDEX_DIM)
        "compressed": bool(compressors),
        "compress_rates": {kind: compressor.rate for kind, compressor in compressors.items()},
        "compressed_types": compressed_types,
        "legacy_ratio_types": {
            ratio: compressed_types.get(layer_type, "attention")
            for ratio, layer_type in LEGACY_RATIO_TYPES.items()
        },
        "sparse_index_dim": sparse.indexer.head_dim if sparse is not None and sparse.indexer else None,
        # per-layer kinds the wrappers, names and mapping take (hybrid, DSA, KV-sharing or compressed stacks)
        "kinds": any((d.hybrid, d.index_dim is not None, d.structure.shared_layer_ids, compressors)),
        # blocks with no token mixer (Nemotron-H's mlp and moe blocks) and the layer types that name them
        "stateless": bool(d.structure.mixerless_layer_ids),
        "stateless_types": tuple(mlp_block_types()),
        "states_per_layer": 3 if d.index_dim is not None else 2,
    }


def render_extraction(spec: Spec) -> list[Rendered]:
    require(spec, TARGET, "abi", "module_paths")
    abi = spec.abi
    assert abi is not None
    if spec.environment:
        raise _fail(spec, "environment[0]", "environment shims have no generated form yet")
    for key in ("language_model", "lm_head"):
        if key not in spec.module_paths:
            raise _fail(spec, "module_paths", f"module_paths has no {key!r}, which the wrappers need")
    prefill, decode = abi_graph_names(spec)
    paged = spec_paged(spec)
    if paged is not None:  # the block table follows cache_position, as kadapt apply exports it
        decode = dataclasses.replace(decode, fixed_inputs=(*decode.fixed_inputs, paged.block_table))
    dims = abi_tables.dims(spec)
    structure = structure_context(spec, dims)
    runtime_module = split_module(Path(runtime.__file__))
    encoding_module = split_module(Path(encoding.__file__))
    upstream_module = split_module(Path(upstream.__file__))
    # the reference binder, which run_graph binds through; the module defines its own KadaptError
    binder_module = split_module(Path(symbolic.__file__), provided=frozenset({"KadaptError"}))
    # the packed step graph's wrapper (over the runtime's) and its binding (over the binder's)
    step_module = split_module(Path(step.__file__), provided=runtime_module.names)
    step_binder = split_module(Path(step_bind.__file__), provided=binder_module.names | {"KadaptError"})
    # the step graph's aux layers, and the MTP draft graph where the config has an MTP layer
    serving, mtp_module = serving_context(spec, TARGET, runtime_module.names)
    embedded = EmbeddedCallables(provided={upstream.__name__: upstream_module.names})
    patches = _patches(spec, embedded)
    # The backend's own dtype step, so a generated model holds the dtypes kadapt exports.
    cast = embedded.add(dtypes.cast_to_abi_dtype, what="extraction dtype cast")
    # kadapt's own pin check, so a generated module refuses drifted upstream code as apply does
    check_pin = embedded.add(portable.check_pin, what="patch pins")
    bodies = (runtime_module, step_module, encoding_module, upstream_module, binder_module, step_binder)
    bodies += (mtp_module,) if mtp_module is not None else ()
    shared = sorted(
        {
            name
            for i, one in enumerate(bodies)
            for other in bodies[i + 1 :]
            for name in one.definitions & other.definitions
        }
    )
    if shared:  # one would silently replace the other in the generated module
        raise KadaptError(
            "runtime.py, step.py, mtp.py, encoding.py, upstream.py, symbolic.py and step_bind.py must not "
            f"define the same names: {shared}"
        )
    whole = frozenset().union(*(module.names for module in bodies))
    clashes = sorted(whole & set(embedded.sources))
    if clashes:
        raise _fail(
            spec, "patches", f"patch implementations {clashes} clash with names of the extraction runtime"
        )
    if structure["float32_rope"] and abi.dtype != "float32":  # what ``kadapt apply`` refuses alike
        raise _fail(
            spec,
            "abi.dtype",
            f"{structure['data']['model_type']}'s forward computes its DSA layers' rotary embedding from "
            f"float32 embeddings, so in a {abi.dtype} model their indexer keys are float32 while the "
            "module's state mapping types every indexer key in abi.dtype; generate it in float32",
        )
    own_imports = {line for module in bodies for line in module.imports}
    backend = spec.backend_options(TARGET)
    context = {
        "spec": spec_identity(spec),
        "gate": gate_context(spec),
        "abi": {
            "config": abi.config,
            "batch": abi.batch,
            "prefill_len": abi.prefill_len,
            "max_cache_len": abi.max_cache_len,
            "dtype": abi.dtype,
            "prefill_inputs": list(abi.prefill.inputs),
            "prefill_outputs": list(abi.prefill.outputs),
            "decode_inputs": list(decode.inputs(0)) + [n for n in abi.decode.inputs if "{layer}" in n],
            "paged": None if paged is None else dataclasses.asdict(paged),
            "decode_outputs": list(abi.decode.outputs),
            "kv_names": kv_names(prefill, decode),
            # the packed step graph: its fixed inputs then the decode graph's pools, over blocks of
            # abi.kv_cache's size (a contiguous spec's cache is paged for it, as kadapt apply does)
            "step_inputs": [n.format(block_table=abi.kv_cache.block_table) for n in STEP_FIXED]
            + [n for n in abi.decode.inputs if "{layer}" in n],
            "step_block_size": abi.kv_cache.block_size,
            "step_block_table": abi.kv_cache.block_table,
        },
        "structure": structure,
        "outside_modelled": {
            key: (rule["site"], rule["op"], tuple(rule["neutral"]))
            for key, rule in outside_modelled().items()
        },
        "file_prefix": backend.get("file_prefix") or spec.name,
        "module_paths": {k: spec.module_paths[k] for k in ("language_model", "lm_head")},
        "stack_parts": dict(spec.stack_parts().stated),  # {}: transformers' usual names
        "source_config": _source_config(spec),
        "runtime": {
            "imports": list(dict.fromkeys(line for module in bodies for line in module.imports)),
            "body": runtime_module.body,
            "summary": runtime_module.summary,
            "source": runtime_module.source,
        },
        "encoding": {
            "body": encoding_module.body,
            "summary": encoding_module.summary,
            "source": encoding_module.source,
        },
        "binder": {"body": binder_module.body, "source": binder_module.source},
        "step": {"body": step_module.body, "source": step_module.source},
        "step_binder": {"body": step_binder.body, "source": step_binder.source},
        "serving": serving,
        "upstream": {
            "body": upstream_module.body,
            "summary": upstream_module.summary,
            "source": upstream_module.source,
            "points": stack_points(dims.structure),  # what kadapt's own run checks of the stack
            "transformers": upstream.TESTED_TRANSFORMERS,
            "torch": upstream.TESTED_TORCH,
            "kadapt": __version__,
        },
        "impl_imports": sorted(embedded.imports - own_imports),
        "impl_constants": dict(sorted(embedded.constants.items())),
        "impl_sources": list(embedded.sources.values()),
        "patches": patches,
        "patch_kinds": {row["kind"]: row["builder"] for row in patches},
        "cast": cast,
        "check_pin": check_pin,
        **bridge_context(spec, backend=TARGET, target=TARGET),
    }
    text = render("extraction/module.py.j2", context, spec_name=spec.name, target=TARGET)
    return [
        Rendered(PurePosixPath("adapters", spec.name, "extraction.py"), text),
        *package_files(spec, TARGET),
    ]
