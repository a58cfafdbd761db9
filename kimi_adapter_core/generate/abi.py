"""Graph ABI tables: every input and output of the prefill and decode graphs with shape and dtype.

Shapes follow from the spec's sizes and the text config after the extraction bridges: KV shapes
from the extraction runtime's own ``kv_shapes``, the rest from the wrapper signatures (checked
against real exported graphs in the tests). Names come from ``backends.extraction.options`` so
docs and exporter cannot disagree.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ..backends.extraction import runtime
from ..backends.extraction.options import DECODE_FIXED, PREFILL_FIXED, GraphNames, abi_graph_names
from ..config.bridges import apply_bridges
from ..config.source import resolve_source
from ..errors import KadaptError
from ..patching.ledger import Ledger
from ..spec.model import Spec

INDEX_DTYPE = "int64"


@dataclass(frozen=True)
class Dims:
    """The text-backbone sizes the ABI depends on, plus the config as attributes for ``kv_shapes``."""

    num_layers: int
    vocab: int
    config: SimpleNamespace

    def kv(self, layout: str, batch: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Key and value shapes of one layer's cache, exactly as the extraction runtime builds them."""
        try:
            return runtime.kv_shapes(self.config, layout, batch, length)
        except AttributeError as exc:
            raise KadaptError(f"kv_layout {layout} needs an MLA text config: {exc}") from exc


def text_config(spec: Spec) -> dict[str, Any]:
    """The ABI's (sub-)config mapping from the spec's shipped config, extraction bridges applied."""
    raw = copy.deepcopy(resolve_source(spec).raw)
    apply_bridges(spec, raw, backend="extraction", ledger=Ledger(spec.name, "extraction"))
    if spec.abi is not None and spec.abi.config:
        sub = raw.get(spec.abi.config)
        if not isinstance(sub, dict):
            raise KadaptError(f"abi.config {spec.abi.config!r} is not a sub-config of the spec's config")
        return sub
    return raw


def dims(config: dict[str, Any]) -> Dims:
    missing = [k for k in ("num_hidden_layers", "vocab_size") if not isinstance(config.get(k), int)]
    if missing:
        raise KadaptError(f"the ABI config has no {', '.join(missing)}")
    return Dims(config["num_hidden_layers"], config["vocab_size"], SimpleNamespace(**config))


def _shape(*sizes: int) -> str:
    return "[" + ", ".join(str(s) for s in sizes) + "]"


def graph_tables(spec: Spec, d: Dims) -> tuple[GraphNames, GraphNames, list[dict[str, Any]]]:
    """Names of both graphs, and per graph ``{title, graph, tensors: [{role, name, shape, dtype}]}``."""
    abi = spec.abi
    assert abi is not None
    prefill, decode = abi_graph_names(spec)
    b, s, cap = abi.batch, abi.prefill_len, abi.max_cache_len

    def fixed(names: GraphNames, q: int, keys: int) -> list[dict[str, Any]]:
        shapes = {
            "input_ids": (_shape(b, q), INDEX_DTYPE),
            "attention_mask": (_shape(b, 1, q, keys), abi.dtype),
            "position_ids": (_shape(b, q), INDEX_DTYPE),
            "cache_position": (_shape(q), INDEX_DTYPE),
        }
        roles = PREFILL_FIXED if names.past_key is None else DECODE_FIXED
        return [
            {"role": "input", "name": name, "shape": shapes[role][0], "dtype": shapes[role][1]}
            for role, name in zip(roles, names.fixed_inputs, strict=True)
        ]

    def kv(direction: str, key: str, value: str, length: int) -> list[dict[str, Any]]:
        key_shape, value_shape = d.kv(abi.kv_layout, b, length)
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
                *kv("input", decode.past_key or "", decode.past_value or "", cap),
                logits(decode, 1),
                *kv("output", decode.present_key, decode.present_value, cap),
            ],
        },
    ]
    return prefill, decode, tables


def kv_bytes_per_token(spec: Spec, d: Dims) -> tuple[int, str]:
    """Cache bytes one token costs across all layers, and the formula that gives them."""
    assert spec.abi is not None
    key_shape, value_shape = d.kv(spec.abi.kv_layout, 1, 1)
    heads, key_w, value_w = key_shape[1], key_shape[3], value_shape[3]
    width = _DTYPE_BYTES[spec.abi.dtype]
    formula = f"{d.num_layers} layers x {heads} x ({key_w} + {value_w}) x {width} B"
    return d.num_layers * heads * (key_w + value_w) * width, formula


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
