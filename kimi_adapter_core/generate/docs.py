"""The ``docs`` target: ``docs/specs/<name>.md``, the spec explained as tables and a flowchart.

Every table is derived from the spec (and, for the structure and the ABI, from its shipped config
through ``structure/``, as ``kadapt apply`` derives it): the document cannot drift from what
``kadapt apply`` does because both read the same entries.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from ..backends.extraction.names import GraphNames
from ..spec.model import Spec
from ..structure.model import ModelStructure
from ..structure.of_spec import structure_of_raw, text_config_key
from . import abi as abi_tables
from .bridges import bridge_context
from .common import Rendered, gate_context, spec_identity
from .environment import render
from .markdown import EMPTY, ESCAPES, comment_text, md_code, md_paragraph, md_text, mermaid_label

TARGET = "docs"


def _bridge_rows(spec: Spec) -> list[dict[str, Any]]:
    rows = bridge_context(spec, backend=None, target=TARGET)["bridges"]
    for row in rows:
        if row["dest"] is not None:
            fallback = f" (fallback {md_code(repr(row['fallback']))})" if row["has_fallback"] else ""
            row["target_text"] = f"{md_code(row['dest'])}{fallback}"
        else:
            row["target_text"] = md_code(repr(row["value"]))
        when = row["when"]
        tests = []
        if "equals" in when:
            tests.append(f"is {when['equals']!r}")
        if "unless_importable" in when:
            tests.append(f"{when['unless_importable']} not importable")
        if "if_importable" in when:
            tests.append(f"{when['if_importable']} importable")
        row["condition"] = " and ".join(tests)
    return rows


def _patch_rows(spec: Spec) -> list[dict[str, Any]]:
    rows = []
    for patch in spec.patches:
        if patch.kind == "set_attribute":
            impl_text = md_code(repr(patch.value))
        else:
            impl_text = md_code(patch.impl) if patch.impl else EMPTY
        if patch.options:
            options = sorted(patch.options.items())
            impl_text += " " + ", ".join(f"{md_text(k)}={md_code(repr(v))}" for k, v in options)
        rows.append(
            {
                "id": patch.id,
                "target": patch.target,
                "kind": patch.kind,
                "impl_text": impl_text,
                "backends": list(patch.backends),
                "why": patch.why,
            }
        )
    return rows


def _node(node_id: str, *lines: str) -> dict[str, str]:
    """A flowchart node whose label shows ``lines`` (each escaped, one under the other)."""
    return {"id": node_id, "label": "<br/>".join(mermaid_label(line) for line in lines)}


# What a linear layer of each ABI kind carries per request, in the flowchart and the state mapping.
FIXED_STATES = {
    "linear": "conv and recurrent states",
    "lightning": "recurrent states",
    "short_conv": "conv windows",
}
STATE_PHRASE = {
    "linear": "its conv window and recurrent state",
    "lightning": "its recurrent state",
    "short_conv": "its conv window",
}


def _flow(spec: Spec, files: dict[str, str], d: abi_tables.Dims) -> dict[str, Any]:
    """Mermaid flowchart of the extraction path: source, bridges, patches, model, wrappers, files."""
    assert spec.abi is not None
    abi = spec.abi
    source = spec.raw.get("source") or {}
    hub = source.get("hub")
    origin = source.get("config") or (f"{hub['repo']}@{hub['revision']}" if hub else "config.json")
    bridges = [b.id for b in spec.config_bridges if "extraction" in b.backends]
    patches = [p for p in spec.patches if "extraction" in p.backends]
    where = f" (sub-config {abi.config})" if abi.config else ""
    masks = ["sliding-window masks in-graph"] if d.structure.has_sliding_layers else []
    linear = [f"{FIXED_STATES[d.linear_kind]} per row"] if d.hybrid else []
    linear += ["DSA indexer keys beside it"] if d.index_dim is not None else []
    nodes = [
        _node("SRC", f"Config {origin}", f"gate: model_type {spec.gate.model_type}"),
        _node("BR", "Config bridges", ", ".join(bridges) or "none"),
        *(
            _node(f"P{i}", f"Patch {p.id}: {p.kind}", p.target.rpartition(":")[2])
            for i, p in enumerate(patches)
        ),
        _node("M", f"Build model on meta, {abi.dtype}", f"text backbone{where}"),
        _node("PW", "Prefill wrapper", f"batch {abi.batch}, {abi.prefill_len} tokens", *masks),
        _node(
            "DW", "Decode wrapper", f"static {d.kv_layout} KV cache of {abi.max_cache_len}", *linear, *masks
        ),
        _node("PI", "Prefill IR", files["prefill"]),
        _node("DI", "Decode IR", files["decode"]),
        _node("KV", "KV mapping", files["kv_mapping"]),
    ]
    chain = ["SRC", "BR", *(f"P{i}" for i in range(len(patches))), "M"]
    edges = [" --> ".join(chain), "M --> PW --> PI", "M --> DW --> DI", "PI --> KV", "DI --> KV"]
    return {"nodes": nodes, "edges": edges}


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,} B"


# What each KV layout caches, per layer and token (see backends/extraction/runtime/abi.py).
KV_LAYOUT_TEXT = {
    "heads": "key and value per KV head after rope, as the attention passes them to `Cache.update`",
    "latent": "the compressed cache: the normalised latent (key) and the rope'd key shared by all heads "
    "(value); the attention expands it each step",
    "expanded": "key and value per head, the output of `expand_kv`; nothing is re-expanded",
}


def _flat_facts(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every non-None leaf of ``data``, nested mappings spelled out at any depth
    (``rope.by_layer_type.full_attention.theta``)."""
    facts: list[tuple[str, Any]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            facts += _flat_facts(value, f"{prefix}{key}.")
        elif value is not None:
            facts.append((f"{prefix}{key}", value))
    return facts


def _structure_context(
    spec: Spec, found: ModelStructure, d: abi_tables.Dims | None, text_key: str | None
) -> dict[str, Any]:
    """The structure as a fact table, per-layer runs, and the KV layouts its attention can have."""
    data = found.to_dict()
    runs = data.pop("layers")
    facts = _flat_facts(data)
    attention = found.attention
    layouts = []
    for layout in attention.kv_layouts:
        notes = []
        if layout == attention.default_kv_layout:
            notes.append(f"default for {attention.kind.upper()}")
        if d is not None and layout == d.kv_layout:
            notes.append("the ABI's")
        # a row per KV shape the attention layers cache (one, unless the layers differ)
        groups = abi_tables.Dims(found, layout, None).kv_groups()
        for group in groups or [abi_tables.KVGroup(attention.kv_dims(layout), (), ())]:
            (key_heads, key_dim), (value_heads, value_dim) = group.dims
            layouts.append(
                {
                    "layout": layout,
                    "layers": f"{len(group.ids)} {'/'.join(group.spans)}" if group.spans else None,
                    "key": f"{key_heads} x {key_dim}",
                    "value": f"{value_heads} x {value_dim}",
                    "elements": f"{key_heads * key_dim + value_heads * value_dim:,}",
                    "notes": ", ".join(notes),
                    "what": KV_LAYOUT_TEXT[layout],
                }
            )
    return {
        "summary": found.describe(),
        "config_label": md_code(text_key) if text_key else "root config",
        "facts": facts,
        "layers": [
            {
                "range": str(first) if first == last else f"{first} .. {last}",
                "attention": run["attention"],
                "window": run["window"],
                # a KV-sharing layer names the layer whose keys and values it reads; a wider MLP its width
                "kv": f"layer {run['kv_source']}'s" if "kv_source" in run else "own",
                "mlp": run["mlp"] + (f" {run['mlp_width']}" if "mlp_width" in run else ""),
            }
            for run in runs
            for first, last in [run["layers"]]
        ],
        "kv_sharing": any("kv_source" in run for run in runs),
        "kv_layouts": layouts,
        "kv_layers": any(row["layers"] for row in layouts),  # the layers cache different KV shapes
    }


def _abi_context(spec: Spec, d: abi_tables.Dims | None) -> dict[str, Any] | None:
    abi = spec.abi
    if abi is None or d is None:
        return None
    prefill, decode, graphs = abi_tables.graph_tables(spec, d)
    prefix = spec.backend_options("extraction").get("file_prefix") or spec.name
    files = {
        "prefill": f"{prefix}_prefill_ir.json",
        "decode": f"{prefix}_decode_ir.json",
        "kv_mapping": f"{prefix}_kv_mapping.json",
    }
    for graph in graphs:
        graph["file"] = files[graph["graph"]]
    per_token, formula = abi_tables.kv_bytes_per_token(spec, d)
    plain = not d.hybrid and d.index_dim is None
    return {
        # a graph table's layers column: which layers a state row is of, where the layers' states differ
        "by_layers": any("layers" in t for graph in graphs for t in graph["tensors"]),
        # the KV mapping's rows per KV shape, where the attention layers cache different ones
        "kv_rows": _per_token_rows(spec, d, prefill, decode, "attention")
        if plain and d.layer_kv_dims is not None
        else None,
        "hybrid": _hybrid_context(spec, d, prefill, decode) if d.hybrid else None,
        "indexed": _indexed_context(spec, d, prefill, decode) if d.index_dim is not None else None,
        "config_label": md_code(abi.config) if abi.config else "root config",
        "num_layers": d.num_layers,
        # KV-sharing layers (Gemma-4) carry no state: the mapping's entries for them name their source
        "shared_layers": len(d.structure.shared_layer_ids),
        "batch": abi.batch,
        "prefill_len": abi.prefill_len,
        "max_cache_len": abi.max_cache_len,
        "kv_layout": d.kv_layout,
        "attention_label": d.attention_label,
        "windows": sorted({w for w in d.structure.windows if w is not None}),
        "graphs": graphs,
        "files": files,
        "kv": {
            "file": files["kv_mapping"],
            "prefill_key": prefill.present_key,
            "prefill_value": prefill.present_value,
            "past_key": decode.past_key,
            "past_value": decode.past_value,
            "present_key": decode.present_key,
            "present_value": decode.present_value,
            "per_token": f"{per_token:,} B",
            "formula": formula,
            "total": _size(per_token * abi.max_cache_len * abi.batch),
        },
    }


def _layer_list(ids: tuple[int, ...]) -> str:
    """``3, 7, 11, ..., 47`` for an evenly spaced run of more than four layers; ``0-4, 6-10, ..., 54-58`` for
    more than four runs of consecutive layers repeating at one step (Gemma-4's sliding layers); else
    every index."""
    steps = {b - a for a, b in zip(ids, ids[1:], strict=False)}
    if len(ids) > 4 and len(steps) == 1:
        return f"{ids[0]}, {ids[1]}, {ids[2]}, ..., {ids[-1]}"
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    lengths = {len(run) for run in runs}
    starts = {b[0] - a[0] for a, b in zip(runs, runs[1:], strict=False)}
    if len(runs) > 4 and len(starts) == 1 and len(lengths) == 1 and len(runs[0]) > 1:
        spans = [f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs]
        return f"{spans[0]}, {spans[1]}, ..., {spans[-1]}"
    return ", ".join(map(str, ids))


def _state_names(prefill: GraphNames, decode: GraphNames, role: str) -> list[str | None]:
    """The name templates of state ``role``: prefill output, decode input, decode output."""
    return [
        prefill.template("present", role),
        decode.template("past", role),
        decode.template("present", role),
    ]


def _per_token_rows(
    spec: Spec, d: abi_tables.Dims, prefill: GraphNames, decode: GraphNames, kind: str
) -> list[dict[str, Any]]:
    """The rows of the states that grow with the context, of the layers of ``kind``: the key and value
    (and a DSA layer's indexer keys, one head), each with its bytes per token of one layer; once per KV
    shape where the layers cache different ones (``kv_groups``)."""
    abi = spec.abi
    assert abi is not None
    width = abi_tables.DTYPE_BYTES[abi.dtype]
    rows = []
    for group in d.kv_groups(kind):
        (key_heads, key_dim), (value_heads, value_dim) = group.dims
        states = [("key", key_heads, key_dim), ("value", value_heads, value_dim)]
        if kind == "indexed":
            states.append(("index_key", 1, d.index_dim))
        spans = f" ({'/'.join(group.spans)})" if group.spans else ""
        rows += [
            {
                "kind": kind,
                "layers": f"{len(group.ids)}: {_layer_list(group.ids)}{spans}",
                "state": role,
                "names": _state_names(prefill, decode, role),
                "shape": f"{heads} x {dim} per token",
                "dtype": abi.dtype,
                "bytes": f"{heads * dim * width:,} B per token",
            }
            for role, heads, dim in states
        ]
    return rows


def _indexed_context(
    spec: Spec, d: abi_tables.Dims, prefill: GraphNames, decode: GraphNames
) -> dict[str, Any]:
    """A DSA stack's states: the KV cache and the indexer keys of each indexed layer (names, shape, dtype
    and bytes per token), and the indexer keys' total at the ABI's sizes."""
    abi = spec.abi
    assert abi is not None and d.structure.indexer is not None
    per_token, formula = abi_tables.index_key_bytes(d, abi.dtype)
    mixed = "attention" in d.layer_kinds  # attention layers beside the DSA ones (dots3's sliding layers)
    rows = _per_token_rows(spec, d, prefill, decode, "indexed")
    return {
        "rows": rows + (_per_token_rows(spec, d, prefill, decode, "attention") if mixed else []),
        "mixed": mixed,
        "topk": d.structure.indexer.topk,
        "per_token": f"{per_token:,} B",
        "formula": formula,
        "total": _size(per_token * abi.max_cache_len * abi.batch),
    }


def _hybrid_context(
    spec: Spec, d: abi_tables.Dims, prefill: GraphNames, decode: GraphNames
) -> dict[str, Any]:
    """A hybrid stack's states by layer kind: names, shape, dtype and bytes of each (per token for a KV
    cache, per request for a linear layer's), and the totals at the ABI's sizes."""
    abi = spec.abi
    assert abi is not None
    attention_ids, linear_ids = d.structure.attention_layer_ids, d.structure.linear_layer_ids
    # hybrid layers attend and keep the mixer's states: Falcon-H1's every layer (side by side), Zamba's
    # every few beside its linear ones (a shared block, then the mixer)
    hybrid = len(d.structure.hybrid_layer_ids)
    mixed = bool(hybrid) and hybrid == len(linear_ids)  # no linear layer without attention (Falcon-H1)
    rows = _per_token_rows(spec, d, prefill, decode, "hybrid" if hybrid else "attention")
    states = abi_tables.linear_state_rows(d, abi.dtype)
    rows += [
        {
            "kind": "hybrid" if mixed else "linear and hybrid" if hybrid else "linear",
            "layers": f"{'the same' if mixed else 'all' if hybrid else 'the other'} {len(linear_ids)}",
            "state": row["state"],
            "names": _state_names(prefill, decode, row["state"]),
            "shape": f"{row['shape']} per request",
            "dtype": row["dtype"],
            "bytes": f"{row['bytes']:,} B per request",
        }
        for row in states
    ]
    per_request = len(linear_ids) * sum(row["bytes"] for row in states)
    parts = " + ".join(f"{row['shape']} x {abi_tables.DTYPE_BYTES[row['dtype']]} B" for row in states)
    return {
        "rows": rows,
        "states": STATE_PHRASE[d.linear_kind],
        "mixed": mixed,
        "linear_layers": len(linear_ids) - hybrid,
        "hybrid_layers": hybrid,
        "attention_layers": len(attention_ids),
        "per_request": f"{per_request:,} B",
        "formula": f"{len(linear_ids)} linear layers x ({parts})",
        "total": _size(per_request * abi.batch),
    }


def render_docs(spec: Spec) -> list[Rendered]:
    raw = spec.raw
    source = raw.get("source") or {}
    hub = source.get("hub")
    bridged = abi_tables.bridged_config(spec)
    found = structure_of_raw(spec, bridged)
    text_key = text_config_key(spec, isinstance(bridged.get("text_config"), dict))
    d = None
    if spec.abi is not None:
        layout, mla_attention = abi_tables.resolve_kv_layout(spec, found)
        d = abi_tables.Dims(found, layout, mla_attention)
    abi = _abi_context(spec, d)
    identity = spec_identity(spec)
    context = {
        "spec": {
            **identity,
            "file": comment_text(identity["file"]),
            "model": md_text(identity["model"]),
            "description": md_paragraph(identity["description"]),
        },
        "gate": gate_context(spec),
        "source": {
            "config": source.get("config"),
            "hub": f"{hub['repo']}@{hub['revision']}" if hub else None,
            "trust_remote_code": bool(source.get("trust_remote_code", False)),
        },
        "requires": dict(sorted(spec.requires.items())),
        "environment": [vars(e) for e in spec.environment],
        "bridges": _bridge_rows(spec),
        "patches": _patch_rows(spec),
        "module_paths": spec.module_paths,
        "mla": {
            "attention_class": spec.mla["attention_class"],
            "field_renames": spec.mla.get("field_renames") or {},
        }
        if spec.mla
        else None,
        "moe": _moe_rows(spec.moe),
        "quantization": [vars(q) for q in spec.quantization],
        "structure": _structure_context(spec, found, d, text_key),
        "abi": abi,
        "flow": _flow(spec, abi["files"], d) if abi and d else None,
        "backends": _backend_rows(spec),
    }
    text = render("docs/spec.md.j2", {**context, **ESCAPES}, spec_name=spec.name, target=TARGET)
    return [Rendered(PurePosixPath("docs", "specs", f"{spec.name}.md"), text)]


def _moe_rows(moe: dict[str, Any]) -> dict[str, Any]:
    """MoE entries flattened for one table (``routing.*`` spelled out)."""
    rows = {k: v for k, v in moe.items() if k != "routing"}
    rows |= {f"routing.{k}": v for k, v in (moe.get("routing") or {}).items()}
    return rows


def _backend_rows(spec: Spec) -> dict[str, dict[str, Any]]:
    """Backend options as ``backend -> option -> value``; weight renames spelled ``from -> to``."""
    rows: dict[str, dict[str, Any]] = {}
    for backend in sorted(spec.backends):
        options = dict(spec.backends[backend])
        renames = options.pop("weight_renames", None)
        flat = {k: v for k, v in options.items() if not isinstance(v, dict)}
        for key, value in options.items():
            if isinstance(value, dict):
                flat |= {f"{key}.{k}": v for k, v in value.items()}
        if renames:
            flat["weight_renames"] = [f"{r['from']} -> {r['to']}" for r in renames]
        rows[backend] = flat
    return rows
