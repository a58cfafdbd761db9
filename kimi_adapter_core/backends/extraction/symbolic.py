"""Dynamic dimensions in the IR: how a symbolic size is written, checked and bound to a real one.

A graph exported with dynamic dimensions (``abi.dynamic``) has sizes that are not numbers: the
prompt length of a prefill graph, the batch. The IR names them after the ABI (``batch``,
``prefill_len``) and writes

- a symbolic dimension of a tensor shape as the expression text (``"prefill_len"``,
  ``"2*batch*prefill_len"``),
- a symbolic operator argument (the size list of a ``view``, the end of an ``arange``) as
  ``{"expr": "<text>"}``, so it can never be mistaken for a string attribute,

where ``<text>`` is a Python integer expression over the symbols: integers, names, ``+ - * // %``,
parentheses, ``max(a, b)``, ``min(a, b)``. A runtime binds each symbol from the shape of the graph
input that carries it (``input_ids`` dim 1 is ``prefill_len``), checks it against its range and
substitutes: that is all ``bind`` does. Torch-free: this module is the reference a runtime can copy.
"""

from __future__ import annotations

import ast
import copy
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import KadaptError

EXPR = "expr"  # key of a symbolic operator argument: {"expr": "2*batch*prefill_len"}

# ABI size -> symbol name in the IR; the order is the order dims are reported in.
SYMBOLS = ("batch", "prefill_len")

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CALLS = {"max": max, "min": min}


@dataclass(frozen=True)
class DimRange:
    """The sizes one symbol may take, both ends included."""

    min: int
    max: int


def evaluate(text: str, sizes: Mapping[str, int]) -> int:
    """The integer value of expression ``text`` with ``sizes`` bound (no ``eval``: a tiny AST walk)."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in sizes:
                raise KadaptError(f"symbolic size {text!r} uses {node.id!r}, which is not bound")
            return sizes[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _CALLS
            and node.args
            and not node.keywords
        ):
            return _CALLS[node.func.id](walk(arg) for arg in node.args)
        raise KadaptError(f"symbolic size {text!r}: {ast.dump(node)} is not integer arithmetic")

    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise KadaptError(f"symbolic size {text!r} is not an expression: {exc.msg}") from exc
    return walk(tree.body)


def substitute(value: Any, sizes: Mapping[str, int]) -> Any:
    """``value`` (an attribute, possibly a list) with every ``{"expr": ...}`` replaced by its integer."""
    if isinstance(value, dict) and set(value) == {EXPR}:
        return evaluate(value[EXPR], sizes)
    if isinstance(value, list):
        return [substitute(item, sizes) for item in value]
    return value


def is_symbolic(value: Any) -> bool:
    if isinstance(value, dict):
        return set(value) == {EXPR}
    if isinstance(value, list):
        return any(is_symbolic(item) for item in value)
    return False


def bind_sizes(
    inputs: Sequence[tuple[str, Sequence[int | str]]],
    shapes: Sequence[Sequence[int]],
    ranges: Mapping[str, DimRange],
    *,
    graph: str,
) -> dict[str, int]:
    """Each symbol's size, read from the graph inputs' real ``shapes`` and checked before execution.

    ``inputs`` are ``(name, declared shape)`` pairs; a declared dimension is an integer (must match)
    or a symbol (bound on first sight, must agree afterwards and lie in its range).
    """
    if len(shapes) != len(inputs):
        raise KadaptError(f"{graph} graph takes {len(inputs)} inputs, got {len(shapes)}")
    sizes: dict[str, int] = {}
    for (name, declared), shape in zip(inputs, shapes, strict=True):
        if len(declared) != len(shape):
            raise KadaptError(
                f"{graph} input {name} must have {len(declared)} dims {list(declared)}, got {list(shape)}"
            )
        for dim, (want, got) in enumerate(zip(declared, shape, strict=True)):
            if isinstance(want, int):
                if want != got:
                    raise KadaptError(
                        f"{graph} input {name} dim {dim} must be {want} (static), got {got}: "
                        f"shape {list(shape)}, expected {list(declared)}"
                    )
                continue
            if want not in sizes:
                if want not in ranges:
                    raise KadaptError(f"{graph} input {name} dim {dim} is {want!r}, which has no range")
                allowed = ranges[want]
                if not allowed.min <= got <= allowed.max:
                    raise KadaptError(
                        f"{graph} input {name} dim {dim} ({want}) is {got}, outside the graph's range "
                        f"{allowed.min}..{allowed.max}"
                    )
                sizes[want] = got
            elif sizes[want] != got:
                raise KadaptError(
                    f"{graph} input {name} dim {dim} ({want}) is {got}, but another input has "
                    f"{want} = {sizes[want]}"
                )
    return sizes


def bind_ir(ir: Any, shapes: Sequence[Sequence[int]], ranges: Mapping[str, DimRange], *, graph: str) -> Any:
    """A copy of the loaded ``torch_ir`` IR with every symbol replaced by its size for these input
    ``shapes`` (an out-of-range or inconsistent input is a ``KadaptError`` here, before execution).

    Only nodes with symbolic attributes are copied; a static IR comes back unchanged.
    """
    declared = [(meta.name, tuple(meta.shape)) for meta in ir.graph_inputs]
    sizes = bind_sizes(declared, shapes, ranges, graph=graph)
    if not sizes:
        return ir
    bound = copy.copy(ir)
    bound.nodes = [
        node
        if not any(is_symbolic(v) for v in node.attrs.values())
        else _with_attrs(node, {key: substitute(value, sizes) for key, value in node.attrs.items()})
        for node in ir.nodes
    ]
    return bound


def _with_attrs(node: Any, attrs: dict[str, Any]) -> Any:
    fresh = copy.copy(node)
    fresh.attrs = attrs
    return fresh


def ranges_from(document: Mapping[str, Any]) -> dict[str, DimRange]:
    """The ``dynamic`` block of a KV mapping or IR metadata (``{"prefill_len": [1, 64]}``) as ranges."""
    return {name: DimRange(int(low), int(high)) for name, (low, high) in (document or {}).items()}
