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

``bind_ir`` is also the guard every execution of a saved graph goes through, static or dynamic: before
the executor sees anything it checks each input against the IR's own declaration (``graph_inputs``:
name, shape with integers or symbols, dtype), so a prompt longer than a static ``prefill_len``, a wrong
batch, rank or dtype, or a cache tensor of the wrong shape is one ``KadaptError`` naming the input, the
expected and the received shape. The one rule no declaration states is the multimodal prefill's: its
``input_ids`` must hold exactly one placeholder token per image feature row (the graph gathers row k to
the k-th placeholder and cannot count them). The loaded IR carries no metadata, so a runtime passes
``Placeholders.from_document`` of the KV mapping's ``merged_prefill`` section (or of the IR metadata's
``multimodal`` block), and the ranges of its ``dynamic`` block (``ranges_from``).

Nor does a declaration state which positions a graph may take, and there the graph fails silently: a
decode row at a position past the cache finds no slot, and the contiguous cache's per-row write
(``write_rows``) drops its token without an error. So the binder reads the position inputs' values (one
min and max each) and refuses a row outside ``0..max_cache_len-1``, naming the input, row, position and
limit, on every graph that writes a cache: a decode or step graph always, its limit read from its own
declaration (see ``position_inputs``), a prefill whenever the runtime passes the cache it fills.
``check_values=False`` skips every check that reads values (positions, ``values``, placeholders), for a
runtime that checks them itself: on an accelerator each read is a device sync.

Everything here reads files a user may have edited or downloaded, so each reader is bounded and fails as
one ``KadaptError`` before execution: an expression is at most ``MAX_EXPRESSION_CHARS`` characters,
nested at most ``MAX_EXPRESSION_DEPTH`` deep, uses only the grammar above, never divides by zero and
never holds a value beyond ``MAX_VALUE`` (torch sizes are int64); a range is two integers with
``1 <= min <= max <= MAX_DIM``, for a symbol of ``SYMBOLS``.
"""

from __future__ import annotations

import ast
import copy
import operator
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ....errors import KadaptError

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
_DIVISIONS = (ast.FloorDiv, ast.Mod)

MAX_EXPRESSION_CHARS = 4096  # the writer's longest expressions are a few dozen characters
MAX_EXPRESSION_DEPTH = 64  # nesting of operators, calls and attribute lists
MAX_VALUE = 2**63 - 1  # |value| of any constant or intermediate result: torch sizes are int64
MAX_DIM = 2**31 - 1  # largest size a dynamic dimension's range may allow
# why a position outside the cache is refused (the contiguous write would drop the token silently)
POSITION_RULE = (
    ": a position must be a slot of the cache (max_cache_len {limit}); past it the token has no slot and "
    "its write would be dropped"
)


class DimRange(NamedTuple):
    """The sizes one symbol may take, both ends included. (Named tuples, not dataclasses, here: a
    generated module embeds this file, and a dataclass needs its module in ``sys.modules``, which a
    module imported by path is not.)"""

    min: int
    max: int


def evaluate(text: str, sizes: Mapping[str, int], *, where: str = "") -> int:
    """The integer value of expression ``text`` with ``sizes`` bound (no ``eval``: a tiny AST walk).

    Any text that is not the grammar of the module docstring within its bounds is a ``KadaptError``
    naming ``where`` (the graph, node and attribute holding it) and the expression."""

    def refuse(why: str) -> KadaptError:
        return KadaptError(f"{_located(where)}symbolic size {_shown(text)} {why}")

    def bounded(value: int) -> int:
        if abs(value) > MAX_VALUE:
            raise refuse(f"reaches a value beyond the int64 bound (magnitude at most {MAX_VALUE})")
        return value

    def walk(node: ast.AST, depth: int) -> int:
        if depth > MAX_EXPRESSION_DEPTH:
            raise refuse(f"is nested deeper than {MAX_EXPRESSION_DEPTH} levels")
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return bounded(node.value)
        if isinstance(node, ast.Name):
            if node.id not in sizes:
                raise refuse(f"uses {node.id!r}, which is not bound")
            return bounded(sizes[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left, depth + 1), walk(node.right, depth + 1)
            if isinstance(node.op, _DIVISIONS) and right == 0:
                raise refuse(f"divides by zero ({_fragment(node)})")
            return bounded(_BINARY[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand, depth + 1)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _CALLS
            and node.args
            and not node.keywords
        ):
            return _CALLS[node.func.id](walk(arg, depth + 1) for arg in node.args)
        raise refuse(f"is not integer arithmetic: {_fragment(node)} is not allowed")

    if not isinstance(text, str):
        raise refuse(f"must be a string, got {type(text).__name__}")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise refuse(f"is {len(text)} characters long, more than {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise refuse(f"is not an expression: {exc.msg}") from exc
    except (ValueError, RecursionError, MemoryError) as exc:  # NUL bytes, nesting the parser gives up on
        raise refuse(f"cannot be parsed ({type(exc).__name__})") from exc
    return walk(tree.body, 0)


def _fragment(node: ast.AST) -> str:
    """The source text of ``node`` for a message (its kind when it is too deep to print)."""
    try:
        return _shown(ast.unparse(node))
    except RecursionError:
        return f"<{type(node).__name__}>"


def _shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error message must stay readable (a value too
    deep or too large to print is shown by its type)."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # nested past the recursion limit; an int past 4300 digits
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def substitute(value: Any, sizes: Mapping[str, int], *, where: str = "", depth: int = 0) -> Any:
    """``value`` (an attribute, possibly a list) with every ``{"expr": ...}`` replaced by its integer."""
    _check_depth(depth, where)
    if isinstance(value, dict) and set(value) == {EXPR}:
        return evaluate(value[EXPR], sizes, where=where)
    if isinstance(value, list):
        return [substitute(item, sizes, where=where, depth=depth + 1) for item in value]
    return value


def is_symbolic(value: Any, *, where: str = "", depth: int = 0) -> bool:
    """Whether ``value`` holds an ``{"expr": ...}`` (lists nested deeper than the bound are refused)."""
    _check_depth(depth, where)
    if isinstance(value, dict):
        return set(value) == {EXPR}
    if isinstance(value, list):
        return any(is_symbolic(item, where=where, depth=depth + 1) for item in value)
    return False


def _check_depth(depth: int, where: str) -> None:
    """Attribute lists nest a level or two; a deeper one is a tampered file, refused before recursing."""
    if depth > MAX_EXPRESSION_DEPTH:
        raise KadaptError(f"{_located(where)}attribute nested deeper than {MAX_EXPRESSION_DEPTH}")


def _located(where: str) -> str:
    """The prefix of a message about something at ``where`` (nothing when unknown)."""
    return f"{where}: " if where else ""


class Placeholders(NamedTuple):
    """The multimodal prefill's placeholder rule: the token ids (the graph's first input, the ABI's
    ``input_ids`` role) hold exactly as many ``token_id`` tokens, over the whole ``[batch, prefill_len]``,
    as the ``features_input`` tensor has rows."""

    token_id: int
    features_input: str

    @classmethod
    def from_document(cls, section: Mapping[str, Any]) -> Placeholders:
        """From the KV mapping's ``merged_prefill`` section (``image_features.input``) or the multimodal
        IR's ``metadata.multimodal`` block (``feature_input``); both state ``placeholder_token_id``."""
        where = "multimodal placeholder rule"
        features = "image_features.input" if _is_mapping_with(section, "image_features") else "feature_input"
        return cls(_field(section, "placeholder_token_id", int, where), _field(section, features, str, where))


def _is_mapping_with(document: Any, key: str) -> bool:
    return isinstance(document, Mapping) and key in document


def _field(document: Any, path: str, kind: type[int] | type[str], where: str) -> Any:
    """``document``'s value at dotted ``path``, which must be a ``kind`` (an int that is no bool): a
    file kadapt wrote and someone edited is refused naming the key, never a ``KeyError``."""
    value = document
    for key in path.split("."):
        if not _is_mapping_with(value, key):
            raise KadaptError(f"{where}: {path} is missing")
        value = value[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        wanted = "an integer" if kind is int else "a string"
        raise KadaptError(f"{where}: {path} must be {wanted}, got {_shown(value)}")
    return value


def _dims(shape: Sequence[int | str]) -> str:
    return "[" + ", ".join(str(dim) for dim in shape) + "]"


def _dtype_name(dtype: Any) -> str:
    """``torch.int64`` / numpy's ``int64`` -> ``"int64"``, the IR's spelling (no torch import needed)."""
    return str(dtype).removeprefix("torch.")


def _refused(
    graph: str, name: str, declared: Sequence[int | str], shape: Sequence[int], why: str
) -> KadaptError:
    """The one error for an input of the wrong shape: graph, input, expected and received shape, why."""
    return KadaptError(f"{graph} input {name}: expected shape {_dims(declared)}, got {_dims(shape)}: {why}")


def bind_sizes(
    inputs: Sequence[tuple[str, Sequence[int | str]]],
    shapes: Sequence[Sequence[int]],
    ranges: Mapping[str, DimRange],
    *,
    graph: str,
) -> dict[str, int]:
    """Each symbol's size, read from the graph inputs' real ``shapes`` and checked before execution.

    ``inputs`` are ``(name, declared shape)`` pairs; a declared dimension is an integer (must match)
    or a symbol (bound on first sight, must agree afterwards and lie in its range). Every refusal names
    the input, its expected and its received shape.
    """
    if len(shapes) != len(inputs):
        names = ", ".join(name for name, _ in inputs)
        raise KadaptError(f"{graph} graph takes {len(inputs)} inputs ({names}), got {len(shapes)}")
    sizes: dict[str, int] = {}
    for (name, declared), shape in zip(inputs, shapes, strict=True):
        if len(declared) != len(shape):
            raise _refused(graph, name, declared, shape, f"must have {len(declared)} dims, got {len(shape)}")
        for dim, (want, got) in enumerate(zip(declared, shape, strict=True)):
            if not isinstance(want, (int, str)):
                raise _refused(graph, name, declared, shape, f"dim {dim} is declared as {_shown(want)}")
            if isinstance(want, int):
                if want != got:
                    raise _refused(
                        graph, name, declared, shape, f"dim {dim} must be {want} (static), got {got}"
                    )
                continue
            if want not in sizes:
                if want not in ranges:
                    raise _refused(graph, name, declared, shape, f"dim {dim} is {want!r}, which has no range")
                allowed = ranges[want]
                if not allowed.min <= got <= allowed.max:
                    why = (
                        f"dim {dim} ({want}) is {got}, outside the graph's range {allowed.min}..{allowed.max}"
                    )
                    raise _refused(graph, name, declared, shape, why)
                sizes[want] = got
            elif sizes[want] != got:
                why = f"dim {dim} ({want}) is {got}, but another input has {want} = {sizes[want]}"
                raise _refused(graph, name, declared, shape, why)
    return sizes


def check_inputs(
    ir: Any,
    inputs: Sequence[Any],
    ranges: Mapping[str, DimRange],
    *,
    graph: str,
    placeholders: Placeholders | None = None,
    values: Mapping[str, tuple[int, int]] | None = None,
    max_cache_len: int | None = None,
    check_values: bool = True,
) -> dict[str, int]:
    """Refuse ``inputs`` (tensors: ``.shape``, ``.dtype``) the loaded ``torch_ir`` IR ``ir`` was not made
    for, before execution; return each symbol's size.

    Checked: the input count, each input's rank and static dimensions, each symbol's range and
    agreement across inputs (``bind_sizes``), each dtype against the declaration; then, unless
    ``check_values`` is False, the rows' positions against the cache (``position_inputs``; a prefill's
    only with ``max_cache_len``), with ``placeholders`` the multimodal prefill's placeholder count
    against the feature rows, and with ``values`` (``{input name: (low, high)}``, see
    ``decode_value_ranges``) the values of index inputs.
    """
    sizes = bind_sizes(
        [(meta.name, tuple(meta.shape)) for meta in ir.graph_inputs],
        [tuple(tensor.shape) for tensor in inputs],
        ranges,
        graph=graph,
    )
    for meta, tensor in zip(ir.graph_inputs, inputs, strict=True):
        got = _dtype_name(tensor.dtype)
        if meta.dtype and got != meta.dtype:
            raise KadaptError(
                f"{graph} input {meta.name}: expected {meta.dtype} {_dims(meta.shape)}, got {got} "
                f"{_dims(tensor.shape)}: dtype must be {meta.dtype}"
            )
    if not check_values:
        return sizes
    indices, limit = position_inputs(ir, graph=graph)
    limit = limit if limit is not None else max_cache_len
    if limit is not None:
        for index in indices:
            meta = ir.graph_inputs[index]
            _check_rows(graph, meta.name, inputs[index], 0, limit - 1, POSITION_RULE.format(limit=limit))
    if placeholders is not None:
        _check_placeholders(ir, inputs, placeholders, graph=graph)
    for meta, tensor in zip(ir.graph_inputs, inputs, strict=True):
        if values and meta.name in values:
            low, high = values[meta.name]
            _check_rows(graph, meta.name, tensor, low, high)
    return sizes


def position_inputs(ir: Any, *, graph: str) -> tuple[list[int], int | None]:
    """The indices of ``ir``'s position inputs by ABI role, and the cache length its own declaration
    states (None when it states none).

    A text graph's first input is the token ids ``[batch, length]`` and its first 4-dim input the
    attention mask ``[batch, 1, query_len, key_len]``; ``position_ids`` follows the mask. A decode graph
    then takes ``cache_position`` ``[batch]`` (one dim), and its mask spans the whole cache, so the mask's
    key length is ``max_cache_len`` (paged too: the mask is over logical positions). The step graph
    (packed ``[T]`` ids, then ``positions``) holds its block table's blocks of its pools' block size.
    A graph of any other form (vision) has no positions."""
    declared = [tuple(meta.shape) for meta in ir.graph_inputs]
    skip = int(len(declared) > 6 and len(declared[0]) == 2 and len(declared[1]) == 1)  # MTP: hidden first
    if declared and len(declared[skip]) == 1 and len(declared) > 5 + skip:  # the packed step (or MTP) graph:
        table, pool = declared[3 + skip], declared[5 + skip]  # block_table [rows, blocks], pool [blocks, ..]
        known = len(table) == 2 and len(pool) == 4 and all(type(n) is int for n in (table[1], pool[1]))
        return [1 + skip], table[1] * pool[1] if known else None
    if not declared or len(declared[0]) != 2:
        return [], None
    mask = next((index for index, shape in enumerate(declared) if len(shape) == 4), None)
    if mask is None or mask + 1 >= len(declared):
        return [], None
    if mask + 2 >= len(declared) or len(declared[mask + 2]) != 1:
        return [mask + 1], None
    key_len = declared[mask][3]
    if not isinstance(key_len, int) or isinstance(key_len, bool) or key_len < 1:
        meta = ir.graph_inputs[mask]
        raise KadaptError(
            f"{graph} input {meta.name}: declared {_dims(meta.shape)}, but a decode graph's mask spans the "
            f"cache: its key length must be max_cache_len, a positive integer, got {_shown(key_len)}"
        )
    return [mask + 1, mask + 2], key_len


def _check_rows(graph: str, name: str, tensor: Any, low: int, high: int, why: str = "") -> None:
    """Refuse ``tensor`` unless every value lies in ``low..high``, naming the first row (dim 0) that
    does not and its value, then ``why``: one min and one max when all is well."""
    if not tensor.numel() or (low <= int(tensor.min()) and int(tensor.max()) <= high):
        return
    if not len(tensor.shape):  # a scalar: one row
        tensor = tensor.reshape(1)
    for row in range(tensor.shape[0]):
        least, most = int(tensor[row].min()), int(tensor[row].max())
        if least < low or most > high:
            value = least if least < low else most
            raise KadaptError(f"{graph} input {name}: row {row} holds {value}, outside {low}..{high}{why}")


def decode_value_ranges(ir: Any, mapping: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """What the decode graph's index inputs may hold, by the KV mapping: ``position_ids`` and
    ``cache_position`` (inputs 2 and 3 by ABI role) a position ``0..max_cache_len-1``, a paged block
    table (input 4) a block ``0..num_blocks-1``. Outside, the graph would not fail: the per-row write
    finds no slot and drops the token, a block index reads past the pool."""
    names = [meta.name for meta in ir.graph_inputs]
    if len(names) < 4:
        raise KadaptError(f"decode graph has {len(names)} inputs; its ABI has at least 4")
    where = "KV mapping"
    last = _field(mapping, "max_cache_len", int, where) - 1
    ranges = {names[2]: (0, last), names[3]: (0, last)}
    if not _is_mapping_with(mapping, "contract") or not isinstance(mapping["contract"], Mapping):
        raise KadaptError(f"{where}: contract must be a mapping")
    if mapping["contract"].get("paged") is not None:
        table = _field(mapping, "contract.paged.block_table.input", str, where)
        ranges[table] = (0, _field(mapping, "contract.paged.num_blocks", int, where) - 1)
    return ranges


def _check_placeholders(ir: Any, inputs: Sequence[Any], placeholders: Placeholders, *, graph: str) -> None:
    """The placeholder count of the token ids (first input) must equal the feature input's rows."""
    names = [meta.name for meta in ir.graph_inputs]
    if placeholders.features_input not in names:
        raise KadaptError(
            f"{graph} graph has no input {placeholders.features_input!r} for the image features "
            f"(inputs: {', '.join(names)})"
        )
    ids, features = inputs[0], inputs[names.index(placeholders.features_input)]
    count, rows = int((ids == placeholders.token_id).sum()), int(features.shape[0])
    if count != rows:
        raise KadaptError(
            f"{graph} input {names[0]} {_dims(ids.shape)} has {count} image placeholder tokens "
            f"(id {placeholders.token_id}) but {placeholders.features_input} {_dims(features.shape)} has "
            f"{rows} rows; they must be equal (row k replaces the k-th placeholder)"
        )


def bind_ir(
    ir: Any,
    inputs: Sequence[Any],
    ranges: Mapping[str, DimRange],
    *,
    graph: str,
    placeholders: Placeholders | None = None,
    values: Mapping[str, tuple[int, int]] | None = None,
    max_cache_len: int | None = None,
    check_values: bool = True,
) -> Any:
    """The loaded ``torch_ir`` IR, ready to execute on ``inputs``: checked first (``check_inputs``: a
    ``KadaptError`` here, before execution, for any input the graph was not made for), then a copy with
    every symbol replaced by its size.

    Only nodes with symbolic attributes are copied; a static IR comes back unchanged. Call it on every
    execution, not once per shape: dtypes, positions and placeholder counts differ between calls of one
    shape. ``max_cache_len``: the cache a prefill's outputs are placed in (a decode graph states its own);
    ``check_values=False`` binds on shapes and dtypes alone (see the module docstring).
    """
    sizes = check_inputs(
        ir,
        inputs,
        ranges,
        graph=graph,
        placeholders=placeholders,
        values=values,
        max_cache_len=max_cache_len,
        check_values=check_values,
    )
    if not sizes:
        return ir
    bound = copy.copy(ir)
    bound.nodes = [_bound_node(node, sizes, graph) for node in ir.nodes]
    return bound


def _bound_node(node: Any, sizes: Mapping[str, int], graph: str) -> Any:
    """``node`` itself when no attribute is symbolic, else a copy with every expression evaluated; a
    failure names the graph, the node and the attribute."""
    if not isinstance(node.attrs, Mapping):
        raise KadaptError(f"{graph} node {_shown(node.name)}: attrs must be a mapping")
    where = {key: f"{graph} node {_shown(node.name)} attribute {_shown(key)}" for key in node.attrs}
    if not any(is_symbolic(value, where=where[key]) for key, value in node.attrs.items()):
        return node
    attrs = {key: substitute(value, sizes, where=where[key]) for key, value in node.attrs.items()}
    return _with_attrs(node, attrs)


def _with_attrs(node: Any, attrs: dict[str, Any]) -> Any:
    fresh = copy.copy(node)
    fresh.attrs = attrs
    return fresh


def ranges_from(document: Mapping[str, Any] | None) -> dict[str, DimRange]:
    """The ``dynamic`` block of a KV mapping or IR metadata (``{"prefill_len": [1, 64]}``) as ranges:
    each a symbol of ``SYMBOLS`` with two integers ``1 <= min <= max <= MAX_DIM``."""
    if document is None:
        return {}
    if not isinstance(document, Mapping):
        raise KadaptError(f"dynamic: must map each size to [min, max], got {_shown(document)}")
    return {name: _range(name, bounds) for name, bounds in document.items()}


def _range(name: Any, bounds: Any) -> DimRange:
    """One entry of a ``dynamic`` block, checked (see ``ranges_from``)."""
    if name not in SYMBOLS:
        raise KadaptError(f"dynamic: {_shown(name)} is not a dynamic size; valid: {', '.join(SYMBOLS)}")
    if (
        not isinstance(bounds, (list, tuple))
        or len(bounds) != 2
        or not all(type(end) is int for end in bounds)
        or not 1 <= bounds[0] <= bounds[1] <= MAX_DIM
    ):
        raise KadaptError(
            f"dynamic.{name}: expected [min, max], integers with 1 <= min <= max <= {MAX_DIM}, "
            f"got {_shown(bounds)}"
        )
    return DimRange(bounds[0], bounds[1])
