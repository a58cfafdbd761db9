"""Exported program -> kadapt ``Graph``: operands in schema order, attributes the executor can replay.

The conversion is written against torch_ir's executor contract, which rebuilds each call from the
op schema: tensor-typed arguments are taken from the node's inputs in order, everything else from
``attrs`` by argument name, and it stops at the first positional argument missing from ``attrs``.
So a skipped positional default is written out when a later positional argument is present, tensor
lists carry ``_tensor_list_sizes``/``_tensor_list_none_masks``, and a call the executor would
rebuild wrongly (a scalar or ``None`` in a tensor slot before a real tensor) is refused here rather
than discovered as wrong numbers later.

``getitem`` nodes disappear: consumers point at output ``i`` of the multi-output node directly.
``_assert_tensor_metadata`` checks and dtype-preserving ``_to_copy``/``alias`` nodes disappear too.

With dynamic dimensions (``abi.dynamic``), nodes that compute sizes (``sym_size``, ``operator.mul`` on
sizes) disappear as well: each size they produce is written where it is used, as an expression over
the ABI's symbols (``symbolic``), and symbolic tensor dimensions as the expression text.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import sympy
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from ....checkpoint.tensors import TensorType, dtype_name
from ....errors import KadaptError
from ..names import GraphNames, Kinds, state_roles
from ..runtime.symbolic import EXPR
from .encoding import MEMORY_FORMAT_CODES, encode
from .graph import CONSTANT, INPUT, NODE, WEIGHT, Graph, GraphInput, GraphOutput, Node, Ref

_MISSING = object()
_DROPPED = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
}
_IDENTITY_IF_SAME_DTYPE = {torch.ops.aten._to_copy.default, torch.ops.aten.alias.default}
# The dtypes torch_ir's ``load_ir`` restores a JSON constant in; it reads any other (bfloat16) as float32.
# A constant of another floating dtype (Falcon-H1's ``mup_vector`` in a bf16 model) is stored as float32,
# exactly, and cast back by a node of its own, so the saved graph computes in the model's dtype.
JSON_CONSTANT_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.int32, torch.int64, torch.int8, torch.bool,
)  # fmt: skip


def _arg_class(arg: torch.Argument) -> str:
    text = str(arg.type)
    if text == "Tensor":
        return "tensor"
    if text == "Optional[Tensor]":
        return "optional"
    if text in ("List[Tensor]", "List[Optional[Tensor]]"):
        return "list"
    return "other"


class Symbols:
    """Writes the exported program's size symbols (``s43``) as the ABI's names (``batch``)."""

    def __init__(self, names: Mapping[sympy.Symbol, str]) -> None:
        self.names = dict(names)

    def text(self, expr: sympy.Expr) -> str:
        """``expr`` as a Python integer expression over the ABI's symbol names (``symbolic.evaluate``)."""
        from torch.utils._sympy.functions import CleanDiv, FloorDiv, Max, Min, Mod, PythonMod

        def paren(arg: sympy.Expr) -> str:
            text = self.text(arg)
            return f"({text})" if isinstance(arg, (sympy.Add, sympy.Mul)) else text

        if isinstance(expr, sympy.Integer):
            return str(int(expr))
        if isinstance(expr, sympy.Symbol):
            if expr not in self.names:
                raise KadaptError(
                    f"size {expr} depends on no dynamic ABI dimension (data-dependent?); "
                    f"known: {', '.join(self.names.values()) or 'none'}"
                )
            return self.names[expr]
        if isinstance(expr, sympy.Add):
            return " + ".join(self.text(term) for term in expr.as_ordered_terms())
        if isinstance(expr, sympy.Mul):
            return "*".join(
                f"({self.text(factor)})" if isinstance(factor, sympy.Add) else self.text(factor)
                for factor in expr.as_ordered_factors()
            )
        if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) > 0:
            return "*".join([paren(expr.base)] * int(expr.exp))
        if isinstance(expr, (FloorDiv, CleanDiv)):
            return f"{paren(expr.args[0])}//{paren(expr.args[1])}"
        if isinstance(expr, (Mod, PythonMod)):
            return f"{paren(expr.args[0])}%{paren(expr.args[1])}"
        if isinstance(expr, (Max, Min)):
            name = "max" if isinstance(expr, Max) else "min"
            return f"{name}({', '.join(self.text(arg) for arg in expr.args)})"
        raise KadaptError(f"size expression {expr} ({type(expr).__name__}) cannot be written to the IR")

    def dim(self, size: int | torch.SymInt) -> int | str:
        """A tensor dimension: its integer, or the text of its expression."""
        if isinstance(size, torch.SymInt):
            expr = size.node.expr
            return int(expr) if isinstance(expr, sympy.Integer) else self.text(expr)
        return int(size)

    def value(self, value: Any) -> Any:
        """A size argument (a ``SymInt`` node's value or an int) as an IR attribute."""
        size = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
        if isinstance(size, torch.SymInt):
            written = self.dim(size)
            return written if isinstance(written, int) else {EXPR: written}
        if isinstance(size, int) and not isinstance(size, bool):
            return size
        raise KadaptError(f"argument {value} is not a size ({type(size).__name__}); the IR cannot express it")

    def types(self, value: Any) -> list[TensorType]:
        values = value if isinstance(value, (list, tuple)) else [value]
        return [
            TensorType(tuple(self.dim(d) for d in v.shape), dtype_name(v.dtype))
            for v in values
            if isinstance(v, torch.Tensor)
        ]


STATIC = Symbols({})


def _computes_size(fx_node: torch.fx.Node) -> bool:
    """A node whose result is a size (``sym_size``, arithmetic on sizes), not a tensor."""
    return isinstance(fx_node.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat))


def symbol_names(program: ExportedProgram, dims: Mapping[str, Mapping[int, str]]) -> dict[sympy.Symbol, str]:
    """Which exported symbol each dynamic ABI dimension became: ``dims`` gives, per user input name,
    ``{dim: abi_symbol}``; the placeholder's fake shape at that dim holds the symbol."""
    names: dict[sympy.Symbol, str] = {}
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    user_inputs = [
        spec.arg.name for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT
    ]
    for position, input_dims in dims.items():
        shape = placeholders[user_inputs[int(position)]].meta["val"].shape
        for dim, abi_name in input_dims.items():
            size = shape[dim]
            if not isinstance(size, torch.SymInt) or not isinstance(size.node.expr, sympy.Symbol):
                raise KadaptError(
                    f"the model does not allow a dynamic {abi_name}: export made input {position} "
                    f"dim {dim} {size}"
                )
            if names.get(size.node.expr, abi_name) != abi_name:
                raise KadaptError(
                    f"export tied {abi_name} to {names[size.node.expr]}: the model needs them equal"
                )
            names[size.node.expr] = abi_name
    return names


def _scope(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return str(path)


class _Converter:
    def __init__(self, env: dict[str, Ref], device: str, symbols: Symbols) -> None:
        self.env = env
        self.device = device
        self.symbols = symbols

    def ref(self, value: torch.fx.Node) -> Ref:
        return self.env[value.name]

    def encode(self, node: torch.fx.Node, value: Any) -> Any:
        try:
            return encode(value, device=self.device)
        except TypeError as exc:
            raise KadaptError(f"{node.target} in {_scope(node) or 'the wrapper'}: {exc}") from exc

    def operands(self, node: torch.fx.Node, schema: torch.FunctionSchema) -> tuple[list[Ref], dict[str, Any]]:
        inputs: list[Ref] = []
        attrs: dict[str, Any] = {}
        pending: list[torch.Argument] = []  # positional non-tensor args left at their default so far
        ambiguous: str | None = None  # why a later tensor operand would be mis-assigned by the executor
        sizes: list[int] = []
        masks: list[list[bool]] = []

        def add_input(value: torch.fx.Node) -> None:
            if ambiguous:
                raise KadaptError(
                    f"{node.target}: {ambiguous} before a tensor operand; the IR cannot express it"
                )
            inputs.append(self.ref(value))

        for position, arg in enumerate(schema.arguments):
            if not arg.kwarg_only and position < len(node.args):
                value = node.args[position]
            else:
                value = node.kwargs.get(arg.name, _MISSING)
            kind = _arg_class(arg)
            if kind in ("tensor", "optional") and isinstance(value, torch.fx.Node) and _computes_size(value):
                # a size used as a scalar operand (``mul.Tensor(x, size)``): written as its expression
                attrs[arg.name] = self.symbols.value(value)
                ambiguous = f"scalar {arg.name}"
            elif kind == "tensor":
                if isinstance(value, torch.fx.Node):
                    add_input(value)
                elif value is not _MISSING:
                    attrs[arg.name] = self.encode(node, value)
                    ambiguous = f"scalar {arg.name}"
            elif kind == "optional":
                if isinstance(value, torch.fx.Node):
                    add_input(value)
                else:
                    ambiguous = ambiguous or f"absent optional {arg.name}"
            elif kind == "list":
                items = list(value) if value is not _MISSING else []
                for item in items:
                    if item is not None:
                        add_input(item)
                sizes.append(sum(item is not None for item in items))
                if any(item is None for item in items):
                    masks.append([item is None for item in items])
            elif value is _MISSING:
                if not arg.kwarg_only:
                    pending.append(arg)
            else:
                if not arg.kwarg_only:
                    for skipped in pending:
                        attrs[skipped.name] = self.encode(node, skipped.default_value)
                    pending.clear()
                if isinstance(value, torch.fx.Node):
                    attrs[arg.name] = self.symbols.value(value)
                elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.fx.Node) for v in value):
                    attrs[arg.name] = [self.symbols.value(v) for v in value]
                else:
                    attrs[arg.name] = self.encode(node, value)
        if sizes:
            attrs["_tensor_list_sizes"] = sizes
        if masks:
            attrs["_tensor_list_none_masks"] = masks
        return inputs, attrs


def convert(
    program: ExportedProgram,
    *,
    kind: str,
    names: GraphNames,
    kinds: Kinds,
    param_path: Callable[[str], str],
    constant_value: Callable[[str], torch.Tensor],
    device: str,
    symbols: Symbols = STATIC,
) -> Graph:
    """Convert a functional (decomposed) exported program of a prefill/decode wrapper.

    ``param_path`` maps the wrapper's parameter names to the model's; ``constant_value`` gives the
    real value of a non-persistent buffer (meta programs carry none); ``symbols`` names the dynamic
    dimensions (``symbol_names``), if any; ``kinds`` the traced layers' kinds (a count: all attention),
    which say each state input's and output's layer and role.
    """
    signature = program.graph_signature
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    env: dict[str, Ref] = {}
    input_names = names.inputs(kinds)
    roles = state_roles(kinds)
    n_fixed = len(names.fixed_inputs)
    inputs: list[GraphInput] = []
    weights: dict[str, TensorType] = {}
    constants: dict[str, torch.Tensor] = {}
    nodes: list[Node] = []
    for spec in signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT:
            position = len(inputs)
            if position >= len(input_names):
                raise KadaptError(f"{kind} graph has more inputs than its ABI names ({len(input_names)})")
            (tensor_type,) = symbols.types(placeholders[name].meta["val"])
            extra = position - n_fixed
            layer, role = (None, "fixed") if extra < 0 else roles[extra]
            inputs.append(GraphInput(input_names[position], tensor_type, role, layer))
            env[name] = Ref(INPUT, position)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and spec.persistent is not False:
            path = param_path(spec.target)
            (weights[path],) = symbols.types(placeholders[name].meta["val"])
            env[name] = Ref(WEIGHT, path)
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            path = param_path(spec.target)
            value = constant_value(spec.target)
            env[name] = Ref(CONSTANT, path)
            if value.dtype in JSON_CONSTANT_DTYPES or not value.is_floating_point():
                constants[path] = value
                continue
            constants[path] = value.float()  # a JSON reader restores float32: cast back in the graph
            (cast_type,) = symbols.types(placeholders[name].meta["val"])
            scope = spec.target.rpartition(".")[0]
            attrs = {"dtype": encode(value.dtype, device=device)}
            nodes.append(
                Node(len(nodes), "aten._to_copy.default", scope, [env[name]], [cast_type], (), attrs)
            )
            env[name] = Ref(NODE, len(nodes) - 1)
        else:
            raise KadaptError(f"{kind} graph has an input of kind {spec.kind.name} ({name}); not supported")
    if len(inputs) != len(input_names):
        raise KadaptError(f"{kind} graph has {len(inputs)} inputs, its ABI names {len(input_names)}")

    converter = _Converter(env, device, symbols)
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    # a value the graph returns more than once (DeepSeek-V4's key and value: ``update(kv, kv)``) gets a
    # copy per extra output, placed right after it: among its layer's nodes, as stitching needs them
    repeats = Counter(value.name for value in output_node.args[0])
    copies: dict[str, list[Ref]] = {}

    def copy_if_repeated(name: str) -> None:
        if repeats[name] > 1 and env[name].kind == NODE:
            copies[name] = [_own_copy(env[name], nodes) for _ in range(repeats[name] - 1)]

    for fx_node in program.graph.nodes:
        if fx_node.op != "call_function" or _computes_size(fx_node):
            continue
        target = fx_node.target
        if target is operator.getitem:
            source = env[fx_node.args[0].name]
            env[fx_node.name] = Ref(NODE, source.key, int(fx_node.args[1]))
            copy_if_repeated(fx_node.name)
            continue
        if target in _DROPPED:
            continue
        if not isinstance(target, torch._ops.OpOverload):
            raise KadaptError(
                f"{kind} graph calls {target} ({fx_node.name}), which has no ATen schema: "
                "higher-order and Python ops cannot be written to the IR"
            )
        if target.namespace != "aten":
            raise KadaptError(
                f"{kind} graph calls custom op {target} in {_scope(fx_node) or 'the wrapper'}: IR executors "
                "only run ATen ops (a MoE experts implementation that falls back to a custom kernel?)"
            )
        if target._schema.is_mutable:
            raise KadaptError(
                f"{kind} graph is not functional: {target} in {_scope(fx_node) or 'the wrapper'}"
            )
        operands, attrs = converter.operands(fx_node, target._schema)
        outputs = symbols.types(fx_node.meta["val"])
        source = _operand_type(operands[0] if operands else None, nodes, inputs, weights)
        if _is_identity(fx_node, attrs, outputs, source):
            env[fx_node.name] = operands[0]
        else:
            returns = target._schema.returns
            labels = (
                tuple(r.name for r in returns) if len(returns) > 1 and all(r.name for r in returns) else ()
            )
            node = Node(len(nodes), str(target), _scope(fx_node), operands, outputs, labels, attrs)
            nodes.append(node)
            env[fx_node.name] = Ref(NODE, node.id)
        copy_if_repeated(fx_node.name)

    output_names = names.outputs(kinds)
    outputs: list[GraphOutput] = []
    for spec, value in zip(signature.output_specs, output_node.args[0], strict=True):
        if spec.kind != OutputKind.USER_OUTPUT:
            raise KadaptError(
                f"{kind} graph writes {spec.target} ({spec.kind.name}); the forward must not mutate state"
            )
        position = len(outputs)
        heads = ["logits", *(["hidden"] if names.hidden else []), *(["aux"] if names.aux else [])]
        layer, role = (None, heads[position]) if position < len(heads) else roles[position - len(heads)]
        ref = env[value.name]
        if any(output.ref == ref for output in outputs) and copies.get(value.name):
            ref = copies[value.name].pop(0)
        outputs.append(GraphOutput(output_names[position], ref, role, layer))
    graph = Graph(kind, inputs, outputs, nodes, weights, constants)
    prune(graph)
    check_functional(graph)
    return graph


def _own_copy(ref: Ref, nodes: list[Node]) -> Ref:
    """A copy of ``ref`` for a second ABI output of one value, in its node's scope, so every output has a
    node, and a name, of its own."""
    source = nodes[ref.key]
    copy = Node(len(nodes), "aten.clone.default", source.scope, [ref], [source.outputs[ref.index]], (), {})
    nodes.append(copy)
    return Ref(NODE, copy.id)


def _is_identity(
    fx_node: torch.fx.Node, attrs: dict[str, Any], outputs: list[TensorType], source: TensorType | None
) -> bool:
    """A copy that changes nothing in a functional graph: same-dtype ``_to_copy``/``alias``, or a
    ``clone`` of an already contiguous tensor (``dropout`` in eval mode leaves those behind)."""
    if source is None or len(outputs) != 1 or source != outputs[0]:
        return False
    if fx_node.target in _IDENTITY_IF_SAME_DTYPE:
        return set(attrs) <= {"dtype"}
    if fx_node.target is torch.ops.aten.clone.default:
        value = fx_node.args[0].meta.get("val")
        same_layout = attrs.get("memory_format", MEMORY_FORMAT_CODES[torch.preserve_format]) in (
            MEMORY_FORMAT_CODES[torch.preserve_format],
            MEMORY_FORMAT_CODES[torch.contiguous_format],
        )
        return (
            isinstance(value, torch.Tensor)
            and value.is_contiguous()
            and same_layout
            and set(attrs) <= {"memory_format"}
        )
    return False


def _operand_type(
    ref: Ref | None, nodes: list[Node], inputs: list[GraphInput], weights: dict[str, TensorType]
) -> TensorType | None:
    if ref is None:
        return None
    if ref.kind == NODE:
        return nodes[ref.key].outputs[ref.index]
    if ref.kind == INPUT:
        return inputs[ref.key].type
    if ref.kind == WEIGHT:
        return weights[ref.key]
    return None


def prune(graph: Graph) -> None:
    """Drop nodes, weights and constants no graph output depends on."""
    live: set[int] = set()
    by_id = {node.id: node for node in graph.nodes}
    stack = [o.ref.key for o in graph.outputs if o.ref.kind == NODE]
    while stack:
        key = stack.pop()
        if key in live:
            continue
        live.add(key)
        stack += [r.key for r in by_id[key].inputs if r.kind == NODE]
    graph.nodes = [node for node in graph.nodes if node.id in live]
    used = {(r.kind, r.key) for node in graph.nodes for r in node.inputs}
    graph.weights = {path: t for path, t in graph.weights.items() if (WEIGHT, path) in used}
    graph.constants = {path: t for path, t in graph.constants.items() if (CONSTANT, path) in used}


def check_functional(graph: Graph) -> None:
    """Refuse in-place ops (``*_``) and ``copy_``: every value must be written exactly once."""
    for node in graph.nodes:
        packet = node.op.split(".")[1]
        if packet.endswith("_") and not packet.endswith("__"):
            raise KadaptError(
                f"{graph.kind} graph is not functional: {node.op} in {node.scope or 'the wrapper'}"
            )
