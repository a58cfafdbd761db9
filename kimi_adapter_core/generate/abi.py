"""Graph ABI tables: every input and output of the prefill and decode graphs with shape and dtype.

Shapes follow from the spec's sizes and the model's structure (``structure/``), derived from the
shipped config after the extraction bridges exactly as ``kadapt apply`` derives it: the KV layout is
the spec's ``abi.kv_layout`` or the attention kind's default, the KV shapes come from the extraction
runtime's own ``kv_shapes`` over the structure's ``kv_dims``, the rest from the wrapper signatures
(checked against real exported graphs in the tests). Names come from
``backends.extraction.options`` so docs and exporter cannot disagree.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from ..backends.extraction.names import DECODE_FIXED, PREFILL_FIXED, GraphNames
from ..backends.extraction.options import abi_graph_names, spec_paged
from ..backends.extraction.runtime import abi as runtime
from ..config.bridges import apply_bridges
from ..config.source import resolve_source
from ..errors import Refusal
from ..patching.ledger import Ledger
from ..spec.model import Spec
from ..structure.kv_layout import resolve_kv_layout as options_resolve_kv_layout
from ..structure.model import ModelStructure
from ..structure.of_spec import structure_of_raw

INDEX_DTYPE = "int64"
KVDims = tuple[tuple[int, int], tuple[int, int]]


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

    def kv(self, batch: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Key and value shapes of one layer's cache, exactly as the extraction runtime builds them."""
        return runtime.kv_shapes(self.kv_dims, batch, length)


def bridged_config(spec: Spec) -> dict[str, Any]:
    """The spec's shipped root config mapping with the extraction bridges applied."""
    raw = copy.deepcopy(resolve_source(spec).raw)
    apply_bridges(spec, raw, backend="extraction", ledger=Ledger(spec.name, "extraction"))
    return raw


def structure(spec: Spec) -> ModelStructure:
    """The text backbone's structure, as the extraction backend sees it (extraction bridges applied).
    A hybrid stack is refused: the generated module does not carry linear-attention states yet."""
    found = structure_of_raw(spec, bridged_config(spec))
    if found.linear is not None:
        raise Refusal(
            "hybrid",
            f"{len(found.linear_layer_ids)} of the {found.num_layers} layers are linear attention: the "
            "generated extraction module does not carry their conv and recurrent states yet (kadapt apply "
            "does)",
            location=spec.locate("gate"),
        )
    return found


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
    return layout, abi.mla_attention if found.attention.is_mla else None


def dims(spec: Spec) -> Dims:
    """The ABI's structure and resolved KV layout for ``spec`` (which must have an ``abi``)."""
    found = structure(spec)
    layout, mla_attention = resolve_kv_layout(spec, found)
    return Dims(found, layout, mla_attention)


def _shape(*sizes: int) -> str:
    return "[" + ", ".join(str(s) for s in sizes) + "]"


def graph_tables(spec: Spec, d: Dims) -> tuple[GraphNames, GraphNames, list[dict[str, Any]]]:
    """Names of both graphs, and per graph ``{title, graph, tensors: [{role, name, shape, dtype}]}``."""
    abi = spec.abi
    assert abi is not None
    prefill, decode = abi_graph_names(spec)
    b, s, cap = abi.batch, abi.prefill_len, abi.max_cache_len
    paged = spec_paged(spec)

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

    def kv(
        direction: str, key: str, value: str, length: int, *, decode: bool = False
    ) -> list[dict[str, Any]]:
        key_shape, value_shape = d.kv(b, length)
        if decode and paged is not None:  # block pools
            key_shape, value_shape = runtime.paged_shapes(d.kv_dims, paged.block_size, paged.num_blocks)
        return [
            {"role": direction, "name": key, "shape": _shape(*key_shape), "dtype": abi.dtype},
            {"role": direction, "name": value, "shape": _shape(*value_shape), "dtype": abi.dtype},
        ]

    def logits(names: GraphNames, q: int) -> dict[str, Any]:
        return {"role": "output", "name": names.logits, "shape": _shape(b, q, d.vocab), "dtype": abi.dtype}

    tables = [
        {
            "title": "Prefill",
            "graph": "prefill",
            "tensors": [
                *fixed(prefill, s, s),
                logits(prefill, s),
                *kv("output", prefill.present_key, prefill.present_value, s),
            ],
        },
        {
            "title": "Decode",
            "graph": "decode",
            "tensors": [
                *fixed(decode, 1, cap),
                *kv("input", decode.past_key or "", decode.past_value or "", cap, decode=True),
                logits(decode, 1),
                *kv("output", decode.present_key, decode.present_value, cap, decode=True),
            ],
        },
    ]
    return prefill, decode, tables


def kv_bytes(d: Dims, layout: str, dtype: str) -> tuple[int, str]:
    """Cache bytes one token costs across all layers in ``layout``, and the formula that gives them."""
    (key_heads, key_dim), (value_heads, value_dim) = d.structure.attention.kv_dims(layout)
    width = DTYPE_BYTES[dtype]
    if key_heads == value_heads:
        per_layer = f"{key_heads} x ({key_dim} + {value_dim})"
    else:
        per_layer = f"({key_heads} x {key_dim} + {value_heads} x {value_dim})"
    formula = f"{d.num_layers} layers x {per_layer} x {width} B"
    return d.num_layers * d.structure.attention.kv_elements(layout) * width, formula


def kv_bytes_per_token(spec: Spec, d: Dims) -> tuple[int, str]:
    """Cache bytes one token costs across all layers in the ABI's layout, and the formula."""
    assert spec.abi is not None
    return kv_bytes(d, d.kv_layout, spec.abi.dtype)


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
