"""Graph ABI tables: every input and output of the prefill and decode graphs with shape and dtype.

Shapes follow from the spec's sizes and the model's structure (``structure/``), derived from the
shipped config after the extraction bridges exactly as ``kadapt apply`` derives it: the KV layout is
the spec's ``abi.kv_layout`` or the attention kind's default, the KV shapes come from the extraction
runtime's own ``kv_shapes`` over the structure's ``kv_dims`` (each layer's own where the layers cache
different shapes: ``kv_groups``), the rest from the wrapper signatures
(checked against real exported graphs in the tests). Names come from
``backends.extraction.options`` so docs and exporter cannot disagree.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from ..backends.extraction.compressed_options import check_compressed
from ..backends.extraction.names import DECODE_FIXED, LAYER_STATES, PREFILL_FIXED, GraphNames
from ..backends.extraction.options import abi_graph_names, spec_paged
from ..backends.extraction.runtime import abi as runtime
from ..config.bridges import apply_bridges
from ..config.source import resolve_source
from ..errors import KadaptError, Refusal
from ..patching.ledger import Ledger
from ..spec.model import Spec
from ..structure.kv_layout import resolve_kv_layout as options_resolve_kv_layout
from ..structure.model import ModelStructure
from ..structure.of_spec import structure_of_raw
from ..structure.states import RecurrentState

INDEX_DTYPE = "int64"
KVDims = tuple[tuple[int, int], tuple[int, int]]
LinearStates = tuple[tuple[tuple[int, ...], str], ...]


@dataclass(frozen=True)
class KVGroup:
    """Attention layers that cache one KV shape: their ``dims``, their indices and, where the stack's
    layers cache different shapes, the spans they attend with (``full``, ``sliding``; empty otherwise)."""

    dims: KVDims
    ids: tuple[int, ...]
    spans: tuple[str, ...]

    def label(self, kind: str) -> str:
        """``attention`` for the one group of a stack, ``attention: 10 full`` for one of several."""
        return f"{kind}: {len(self.ids)} {'/'.join(self.spans)}" if self.spans else kind


@dataclass(frozen=True)
class Dims:
    """What the ABI depends on: the text backbone's structure and the KV layout resolved for it."""

    structure: ModelStructure
    kv_layout: str
    mla_attention: str | None  # None unless the attention is MLA

    @property
    def num_layers(self) -> int:
        return self.structure.num_layers

    @property
    def vocab(self) -> int:
        return self.structure.vocab_size

    @property
    def kv_dims(self) -> KVDims:
        """Per-token ``((key_heads, key_dim), (value_heads, value_dim))`` in ``kv_layout``."""
        return self.structure.attention.kv_dims(self.kv_layout)

    @property
    def attention_label(self) -> str:
        """``heads KV, GQA`` / ``latent KV, reexpand MLA``, as ``kadapt apply`` prints it."""
        if self.mla_attention is None:
            return f"{self.kv_layout} KV, {self.structure.attention.kind.upper()}"
        return f"{self.kv_layout} KV, {self.mla_attention} MLA"

    @property
    def layer_kv_dims(self) -> tuple[KVDims, ...] | None:
        """Per layer its KV dims when the attention layers cache different shapes (MiMo-V2-Flash's
        sliding layers twice the KV heads, Gemma-4's full layers wider heads), else None: ``kv_dims``."""
        return self.structure.layer_kv_dims(self.kv_layout)

    def kv_groups(self, kind: str | None = None) -> list[KVGroup]:
        """The layers of ``kind`` (None: every layer with a KV cache) grouped by the KV dims they cache, in
        order of their first layer: one group of every such layer unless the layers cache different shapes."""
        if kind is None:
            ids = list(self.structure.attention_layer_ids)
        else:
            ids = [i for i, layer_kind in enumerate(self.layer_kinds) if layer_kind == kind]
        per_layer = self.layer_kv_dims
        if per_layer is None:
            return [KVGroup(self.kv_dims, tuple(ids), ())] if ids else []
        by_dims: dict[KVDims, list[int]] = {}
        for i in ids:
            by_dims.setdefault(per_layer[i], []).append(i)
        return [
            KVGroup(dims, tuple(ids), tuple(dict.fromkeys(self.structure.layers[i].attention for i in ids)))
            for dims, ids in by_dims.items()
        ]

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's kind as the ABI carries its state (``runtime.LAYER_STATES``)."""
        return self.structure.layer_kinds

    @property
    def hybrid(self) -> bool:
        """True when some layers are linear attention (a conv window and a recurrent state, no KV)."""
        return self.structure.linear is not None

    @property
    def index_dim(self) -> int | None:
        """The width of the DSA indexer keys an ``indexed`` layer caches per token (None: no such layer)."""
        return self.structure.indexer.head_dim if self.structure.indexer is not None else None

    def index_key(self, batch: int, length: int) -> tuple[int, ...]:
        """Shape of one indexed layer's indexer keys: a one-head key ``[batch, 1, length, index_dim]``."""
        assert self.index_dim is not None
        return runtime.kv_shapes(self.index_dims, batch, length)[0]

    @property
    def index_dims(self) -> KVDims:
        """The indexer keys as the runtime sizes them: a one-head key (and unused value) of ``index_dim``."""
        assert self.index_dim is not None
        return ((1, self.index_dim),) * 2

    def linear_states(self, dtype: str) -> LinearStates | None:
        """Per request, ``((conv shape, dtype), (recurrent shape, dtype))`` of a linear layer with the
        model in ``dtype`` (the conv window follows it, the recurrent state keeps its own; a lightning
        layer's recurrent state alone, in ``dtype``; a short convolution's window alone), as the extraction
        runtime takes them; None without linear layers."""
        linear = self.structure.linear
        if linear is None:
            return None
        return tuple(
            (state.shape(), state.dtype_in(dtype) if isinstance(state, RecurrentState) else dtype)
            for _, state in linear.states
        )

    @property
    def linear_kind(self) -> str:
        """The ABI kind of the linear layers (``linear``; ``lightning``: a recurrent state alone;
        ``short_conv``: a conv window alone)."""
        return self.structure.linear.layer_kind if self.structure.linear is not None else "linear"


def bridged_config(spec: Spec) -> dict[str, Any]:
    """The spec's shipped root config mapping with the extraction bridges applied."""
    raw = copy.deepcopy(resolve_source(spec).raw)
    apply_bridges(spec, raw, backend="extraction", ledger=Ledger(spec.name, "extraction"))
    return raw


def structure(spec: Spec) -> ModelStructure:
    """The text backbone's structure, as the extraction backend sees it (extraction bridges applied);
    a hybrid stack's linear layers (``structure.linear``) carry their conv and recurrent states, DSA
    layers (``structure.indexer``) their indexer keys beside the KV cache, and attention layers (among
    them those reusing an indexed layer's top-k) their KV alone. A stack that mixes DSA layers with
    layers of another kind is refused: the generated module names a DSA stack's states by those two.
    Compressed layers (DeepSeek-V4's ``hca``, ``csa``: ``structure.compressors``) carry a compressor's ring
    and entries after their sliding KV, a csa layer its indexer's after those."""
    found = structure_of_raw(spec, bridged_config(spec))
    kinds = set(found.layer_kinds)
    if found.indexer is not None and not kinds <= {"indexed", "attention"}:
        others = sorted(kinds - {"indexed", "attention"})
        raise Refusal(
            "layer-types",
            f"{found.layer_kinds.count('indexed')} of the {found.num_layers} layers use DeepSeek sparse "
            f"attention and others are {', '.join(others)}: the generated extraction module names a DSA "
            "stack's states by indexed and attention layers only",
            location=spec.locate("gate"),
        )
    return found


def check_state_names(spec: Spec, found: ModelStructure) -> None:
    """The ABI names every state the layers return and no other: a linear layer's conv and recurrent
    state, a DSA layer's indexer keys, a compressed layer's ring and entries (``kadapt apply`` checks the
    same before it exports)."""
    prefill, _ = abi_graph_names(spec)
    where = spec.locate("abi.prefill.outputs")
    if found.compressors:  # the ring and entries in the second pair of templates: kadapt apply's checks
        assert spec.abi is not None
        check_compressed(
            found,
            names_state=prefill.has_linear_states,
            names_index=prefill.present_index_src is not None,
            max_cache_len=spec.abi.max_cache_len,
            dynamic=spec.abi.dynamic,
            names_where=where,
            dynamic_where=spec.locate("abi.dynamic"),
        )
        return
    for present, named, roles, what in (
        (found.linear is not None, prefill.has_linear_states, ("conv", "recurrent"), "linear-attention"),
        (found.indexer is not None, prefill.has_index_keys, ("index_key",), "DSA (indexed_attention)"),
    ):
        presents = ", ".join(f'"<present {role} {{layer}}>"' for role in roles)
        pasts = ", ".join(f'"<past {role} {{layer}}>"' for role in roles)
        if present and not named:
            raise KadaptError(
                f"the model's {what} layers return their {' and '.join(roles)} states: add {presents} to "
                f"abi.prefill.outputs and abi.decode.outputs and {pasts} to abi.decode.inputs",
                location=where,
            )
        if named and not present:
            raise KadaptError(
                f"the ABI names {' and '.join(roles)} states, but the model has no {what} layer: keep only "
                "the key and value templates",
                location=where,
            )


def resolve_kv_layout(spec: Spec, found: ModelStructure) -> tuple[str, str | None]:
    """``(kv_layout, mla_attention)`` for ``spec.abi`` on a model of structure ``found``, checked
    exactly as ``kadapt apply`` checks it; ``mla_attention`` is None for attention kinds other than MLA.
    """
    abi = spec.abi
    assert abi is not None
    layout = options_resolve_kv_layout(
        found.attention,
        abi.kv_layout,
        abi.mla_attention,
        layout_where=spec.locate("abi.kv_layout"),
        attention_where=spec.locate("abi.mla_attention" if "abi.mla_attention" in spec.positions else "abi"),
    )
    mla_attention = abi.mla_attention if found.attention.is_mla else None
    if found.indexer is not None and mla_attention == "absorbed":
        raise KadaptError(
            "mla_attention 'absorbed' replaces the attention's forward, which would drop the DSA indexer "
            "(its top-k selection): use reexpand for a model with indexed_attention layers",
            location=spec.locate("abi.mla_attention"),
        )
    return layout, mla_attention


def dims(spec: Spec) -> Dims:
    """The ABI's structure and resolved KV layout for ``spec`` (which must have an ``abi``)."""
    found = structure(spec)
    layout, mla_attention = resolve_kv_layout(spec, found)
    check_state_names(spec, found)
    return Dims(found, layout, mla_attention)


def _shape(*sizes: int) -> str:
    return "[" + ", ".join(str(s) for s in sizes) + "]"


def graph_tables(spec: Spec, d: Dims) -> tuple[GraphNames, GraphNames, list[dict[str, Any]]]:
    """Names of both graphs, and per graph ``{title, graph, tensors: [{role, name, shape, dtype}]}``.

    A per-layer row of a hybrid stack also says which ``layers`` kind it belongs to: attention layers
    carry the key and value, linear layers the conv window and recurrent state (never paged)."""
    abi = spec.abi
    assert abi is not None
    prefill, decode = abi_graph_names(spec)
    b, s, cap = abi.batch, abi.prefill_len, abi.max_cache_len
    paged = spec_paged(spec)
    linear = d.linear_states(abi.dtype)

    def fixed(names: GraphNames, q: int, keys: int) -> list[dict[str, Any]]:
        shapes = {
            "input_ids": (_shape(b, q), INDEX_DTYPE),
            "attention_mask": (_shape(b, 1, q, keys), abi.dtype),
            "position_ids": (_shape(b, q), INDEX_DTYPE),
            "cache_position": (_shape(b), INDEX_DTYPE),
        }
        roles = PREFILL_FIXED if names.past_key is None else DECODE_FIXED
        rows = [
            {"role": "input", "name": name, "shape": shapes[role][0], "dtype": shapes[role][1]}
            for role, name in zip(roles, names.fixed_inputs, strict=True)
        ]
        if names.past_key is not None and paged is not None:
            table = _shape(b, cap // paged.block_size)
            rows.append({"role": "input", "name": paged.block_table, "shape": table, "dtype": INDEX_DTYPE})
        return rows

    def states(
        direction: str, names: GraphNames, length: int, *, decode: bool = False
    ) -> list[dict[str, Any]]:
        """One row per state template of ``names`` in ``direction`` (past: inputs, present: outputs); the
        key and value once per KV shape the attention layers cache (``kv_groups``)."""

        def kv_shapes(dims: KVDims) -> dict[str, tuple[tuple[int, ...], str]]:
            key_shape, value_shape = runtime.kv_shapes(dims, b, length)
            if decode and paged is not None:  # block pools
                key_shape, value_shape = runtime.paged_shapes(dims, paged.block_size, paged.num_blocks)
            return {"key": (key_shape, abi.dtype), "value": (value_shape, abi.dtype)}

        shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        if linear is not None:
            shapes |= {
                role: ((b, *shape), dtype)
                for role, (shape, dtype) in zip(LAYER_STATES[d.linear_kind], linear, strict=True)
            }
        if d.index_dim is not None:  # a one-head key, placed and paged like the layer's key
            index_shape = d.index_key(b, length)
            if decode and paged is not None:
                index_shape = runtime.paged_shapes(d.index_dims, paged.block_size, paged.num_blocks)[0]
            shapes["index_key"] = (index_shape, abi.dtype)
        role_of = "input" if direction == "past" else "output"
        rows = []
        for kind in state_kinds(d):
            # a kind with a KV cache: its rows once per KV shape (a stack without such layers: the stack's)
            groups = (
                (d.kv_groups(kind) or [KVGroup(d.kv_dims, (), ())]) if "key" in LAYER_STATES[kind] else []
            )
            for group in groups or [None]:
                own = kv_shapes(group.dims) if group is not None else {}
                for role in LAYER_STATES[kind]:
                    shape, dtype = own.get(role) or shapes[role]
                    row = {
                        "role": role_of,
                        "name": names.template(direction, role) or "",
                        "shape": _shape(*shape),
                    }
                    if linear is not None or d.layer_kv_dims is not None or len(state_kinds(d)) > 1:
                        # the layers' states differ
                        row["layers"] = group.label(kind) if group is not None else kind
                    rows.append({**row, "dtype": dtype})
        return rows

    def logits(names: GraphNames, q: int) -> dict[str, Any]:
        return {"role": "output", "name": names.logits, "shape": _shape(b, q, d.vocab), "dtype": abi.dtype}

    tables = [
        {
            "title": "Prefill",
            "graph": "prefill",
            "tensors": [*fixed(prefill, s, s), logits(prefill, s), *states("present", prefill, s)],
        },
        {
            "title": "Decode",
            "graph": "decode",
            "tensors": [
                *fixed(decode, 1, cap),
                *states("past", decode, cap, decode=True),
                logits(decode, 1),
                *states("present", decode, cap, decode=True),
            ],
        },
    ]
    return prefill, decode, tables


def state_kinds(d: Dims) -> tuple[str, ...]:
    """The layer kinds whose state templates a graph table lists, in the ABI's template order."""
    if d.hybrid and "hybrid" in d.layer_kinds:  # Zamba2: hybrid layers, and attention ones if any
        return (*(("attention",) if "attention" in d.layer_kinds else ()), d.linear_kind, "hybrid")
    if d.hybrid:
        return ("attention", d.linear_kind)
    if d.index_dim is not None:  # DSA layers, and the attention layers beside them (dots3's sliding ones)
        return ("indexed", "attention") if "attention" in d.layer_kinds else ("indexed",)
    return ("attention",)


def index_key_bytes(d: Dims, dtype: str) -> tuple[int, str]:
    """Indexer-key bytes one token costs across the DSA layers, and the formula that gives them (0 and
    an empty formula without DSA layers)."""
    indexer = d.structure.indexer
    if indexer is None:
        return 0, ""
    layers, width = d.layer_kinds.count("indexed"), DTYPE_BYTES[dtype]
    formula = f"{layers} indexed layers x 1 x {indexer.head_dim} x {width} B"
    return layers * indexer.bytes_per_token(width), formula


def kv_bytes(d: Dims, dtype: str) -> tuple[int, str]:
    """Cache bytes one token costs across the attention layers, and the formula that gives them: a term
    per KV shape the layers cache (a hybrid stack's linear layers keep no KV cache: ``linear_state_rows``)."""
    width = DTYPE_BYTES[dtype]
    terms, total = [], 0
    for group in d.kv_groups():
        (key_heads, key_dim), (value_heads, value_dim) = group.dims
        if key_heads == value_heads:
            per_layer = f"{key_heads} x ({key_dim} + {value_dim})"
        else:
            per_layer = f"({key_heads} x {key_dim} + {value_heads} x {value_dim})"
        noun = "attention layers" if d.hybrid else "layers"
        spans = f"{'/'.join(group.spans)} " if group.spans else ""
        terms.append(f"{len(group.ids)} {spans}{noun} x {per_layer} x {width} B")
        total += len(group.ids) * (key_heads * key_dim + value_heads * value_dim) * width
    return total, " + ".join(terms)


def kv_bytes_per_token(spec: Spec, d: Dims) -> tuple[int, str]:
    """Cache bytes one token costs across all layers in the ABI's layout, and the formula."""
    assert spec.abi is not None
    return kv_bytes(d, spec.abi.dtype)


def linear_state_rows(d: Dims, dtype: str) -> list[dict[str, Any]]:
    """Per state of a linear layer: ``{state, shape, dtype, bytes}`` per request (``bytes`` for one
    layer); empty without linear layers."""
    linear = d.linear_states(dtype)
    if linear is None:
        return []
    return [
        {
            "state": role,
            "shape": _shape(*shape),
            "dtype": state_dtype,
            "bytes": math.prod(shape) * DTYPE_BYTES[state_dtype],
        }
        for role, (shape, state_dtype) in zip(LAYER_STATES[d.linear_kind], linear, strict=True)
    ]


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
