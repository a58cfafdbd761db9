"""Trace one ABI wrapper with ``torch.export`` and turn it into a functional kadapt ``Graph``.

``run_decompositions({})`` is what makes the program functional (in-place ``scatter_``/``div_`` of
the router become out-of-place ops, mutations of fresh tensors disappear) without decomposing
``linear``/``softmax`` into more, smaller nodes; on a tested torch the same program is traced in one
pass (``one_pass_export``). Export runs under ``no_grad`` so the rotary
embedding's ``@torch.no_grad`` adds no ``set_grad_enabled`` higher-order op.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.export import ExportedProgram

from .... import upstream
from ....errors import KadaptError
from ..names import COMPRESSED_ROLES, FIXED_ROLES, GraphNames
from ..options import MERGED, ExtractionOptions
from ..runtime import abi as runtime
from ..runtime import step as runtime_step
from ..step_options import STEP
from .convert import Symbols, convert, symbol_names
from .graph import Graph
from .stack import Backbone, probed_stack
from .stitch import Plan, through


def graph_names(kind: str, options: ExtractionOptions) -> GraphNames:
    """ABI names of the ``kind`` graph: ``prefill``, ``decode``, ``prefill_mm`` or ``step``."""
    if kind == STEP:
        assert options.step is not None
        return options.step.names
    if kind == MERGED:
        assert options.merged_prefill is not None
        return options.merged_prefill.names
    return options.prefill_names if kind == "prefill" else options.decode_names


def wrapper_for(kind: str, backbone: Backbone, options: ExtractionOptions, num_layers: int) -> nn.Module:
    classes = {
        "prefill": runtime.PrefillWrapper,
        "decode": runtime.DecodeWrapper,
        STEP: runtime_step.StepWrapper,
    }
    extra: dict[str, Any] = {}
    if kind == MERGED:
        merged = options.merged_prefill
        assert merged is not None and merged.image_token_id is not None, "bind_merged_prefill first"
        classes[kind] = runtime.MultimodalPrefillWrapper
        extra["image_token_id"] = merged.image_token_id
    if kind == "decode" and options.paged is not None:
        extra["paged"] = True
    if kind == STEP and options.step is not None and options.step.mtp is not None:
        extra["hidden_states"] = True  # the MTP draft graph reads the asked tokens' final hidden states
    if kind == STEP and options.step is not None and options.step.aux_layers:
        extra["aux_layers"] = options.step.aux_layers  # an EAGLE-3 draft reads these layers' outputs
    probed = probed_stack(backbone.language_model, backbone.parts)
    return (
        classes[kind]
        .from_language_model(
            backbone.language_model,
            backbone.lm_head,
            kv_layout=options.kv_layout,
            cache_keyword=upstream.decoder_protocol(probed, options.layer_kinds).cache_keyword,
            num_layers=num_layers,
            layer_kinds=options.layer_kinds,
            mla_attention=options.mla_attention,
            windows=options.windows,
            chunks=options.chunks,
            embedding_ops=options.structure.outside_ops("embeddings") if options.structure else (),
            logit_ops=options.structure.outside_ops("logits") if options.structure else (),
            rope_layer_types=upstream.rope_layer_types(probed),
            parts=backbone.parts.stated,
            **extra,
        )
        .eval()
    )


def step_example(
    options: ExtractionOptions, num_layers: int, device: str | torch.device
) -> tuple[torch.Tensor, ...]:
    """The step graph's example inputs at ``options``' sizes over the first ``num_layers`` layers: what
    its export traces, what the MTP graph's export takes its index inputs from and what verify's step
    replay starts its pools from (``runtime.step.step_inputs``)."""
    step, paged = options.step, options.paged
    assert step is not None and paged is not None, "the step graph reads a paged pool"
    return runtime_step.step_inputs(
        options.kv_dims,
        tokens=step.tokens,
        rows=step.rows,
        logits=step.logits,
        block_size=paged.block_size,
        num_blocks=paged.num_blocks,
        max_cache_len=options.max_cache_len,
        kinds=options.layer_kinds[:num_layers],
        dtype=getattr(torch, options.dtype),
        device=device,
        index_dim=options.index_dim,
        layer_kv_dims=None if options.layer_kv_dims is None else options.layer_kv_dims[:num_layers],
    )


def example_inputs(
    kind: str, backbone: Backbone, options: ExtractionOptions, num_layers: int
) -> tuple[Any, ...]:
    dtype = getattr(torch, options.dtype)
    if kind == STEP:
        return step_example(options, num_layers, backbone.device)
    if kind == "prefill":
        return runtime.prefill_inputs(
            batch=options.batch, prefill_len=options.prefill_len, dtype=dtype, device=backbone.device
        )
    if kind == MERGED:
        merged = options.merged_prefill
        assert merged is not None and merged.feature_rows is not None, "bind_merged_prefill first"
        return runtime.multimodal_prefill_inputs(
            batch=options.batch,
            prefill_len=merged.prefill_len,
            feature_rows=merged.feature_rows,
            hidden_size=backbone.language_model.get_input_embeddings().embedding_dim,
            dtype=dtype,
            device=backbone.device,
        )
    return runtime.decode_inputs(
        options.kv_dims,
        batch=options.batch,
        position=options.prefill_len,
        max_cache_len=options.max_cache_len,
        num_layers=num_layers,
        dtype=dtype,
        device=backbone.device,
        paged=None if options.paged is None else (options.paged.block_size, options.paged.num_blocks),
        kinds=options.layer_kinds[:num_layers],
        linear_states=options.linear_states,
        index_dim=options.index_dim,
        layer_kv_dims=None if options.layer_kv_dims is None else options.layer_kv_dims[:num_layers],
        compress_rates=options.compress_rates,
    )


def traced_for(kind: str, chosen: Plan, options: ExtractionOptions) -> Plan:
    """The layers ``kind``'s graph traces: ``chosen``'s, and for a step graph returning aux layers'
    hidden states one layer past the last of them (or every layer). A replicated layer has no nodes
    but its states' outputs, so an aux layer must be traced; and the final nodes' read of the last
    traced layer is re-pointed at the last layer's, so an aux layer must not be the last traced one."""
    if kind != STEP or options.step is None or not options.step.aux_layers:
        return chosen
    layers = chosen.prefix + len(chosen.templates)  # every layer after the prefix has a template
    return through(chosen, min(max(options.step.aux_layers) + 2, layers))


def dynamic_dims(kind: str, options: ExtractionOptions, num_inputs: int) -> dict[int, dict[int, str]]:
    """``{input position: {dim: ABI symbol}}`` of the wrapper's inputs for ``options.dynamic``.

    Prefill: ``input_ids``/``position_ids`` ``[batch, prefill_len]``, the mask ``[batch, 1,
    prefill_len, prefill_len]``. Decode: batch only (one token, a cache of fixed capacity), on every
    input (``cache_position`` and a paged ``block_table`` have one row per batch row) but the block
    pools of a paged cache (shared by all rows). Multimodal prefill: the prefill's, but the image
    features ``[image tokens, hidden]`` stay fixed (one image ABI for the whole batch).
    """
    if kind == STEP:  # static sizes: tokens, logits and requests per call are the spec's
        return {}
    batch = "batch" in options.dynamic
    length = "prefill_len" in options.dynamic and kind != "decode"
    mask = 2 if kind == MERGED else 1
    fixed = len(graph_names(kind, options).fixed_inputs)
    dims: dict[int, dict[int, str]] = {}
    roles = options.state_roles(len(options.layer_kinds)) if options.structure is not None else []
    for position in range(num_inputs):
        if kind == MERGED and position == 1:  # image features
            continue
        paged_pool = position >= fixed and roles[position - fixed] not in (*FIXED_ROLES, *COMPRESSED_ROLES)
        if kind == "decode" and options.paged is not None and paged_pool:  # block pools (per-row states stay)
            continue
        these = {0: "batch"} if batch else {}
        if length:
            these.update({1: "prefill_len"} if position != mask else {2: "prefill_len", 3: "prefill_len"})
        if these:
            dims[position] = these
    return dims


def _torch_dynamic_shapes(
    kind: str, dims: dict[int, dict[int, str]], num_inputs: int
) -> tuple[Any, ...] | None:
    """``dims`` as ``torch.export``'s ``dynamic_shapes`` (decode's ``*tensors`` after ``cache_position``,
    a paged block table included, is one nested tuple)."""
    if not dims:
        return None
    symbols = {name: torch.export.Dim(name, min=1) for d in dims.values() for name in d.values()}
    per_input = [
        {dim: symbols[name] for dim, name in dims[position].items()} if position in dims else None
        for position in range(num_inputs)
    ]
    if kind == "decode":
        return (*per_input[:4], tuple(per_input[4:]))
    return tuple(per_input)


def export_program(
    wrapper: nn.Module, inputs: tuple[Any, ...], kind: str, dynamic_shapes: tuple[Any, ...] | None = None
) -> ExportedProgram:
    """The functional ATen program of ``wrapper``: ``export(...).run_decompositions({})``, traced once
    where torch allows (``one_pass_export``)."""
    # torch 2.13's own pytree code trips its LeafSpec deprecation inside export; it is not ours to fix
    # and would only bury the progress lines.
    with torch.no_grad(), warnings.catch_warnings(), _without_node_stack_traces():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
        one_pass = one_pass_export()
        try:
            if one_pass is not None:
                return one_pass(wrapper, inputs, dynamic_shapes)
            program = torch.export.export(wrapper, inputs, dynamic_shapes=dynamic_shapes, strict=False)
        except Exception as exc:  # torch.export raises many types; the user needs the cause, not the type
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise KadaptError(f"torch.export failed on the {kind} wrapper: {first_line}") from exc
        return program.run_decompositions({})


OnePass = Callable[[nn.Module, tuple[Any, ...], Any], ExportedProgram]


@contextlib.contextmanager
def _without_node_stack_traces() -> Iterator[None]:
    """Trace without a Python stack trace on every graph node (``torch.fx.config``).

    torch's tracer records one per node for its own error messages and debugging; kadapt's IR never
    reads them (a node's scope comes from ``nn_module_stack``), so the artifacts are the same bytes,
    and an export is 8-14% faster (full-size Kimi-K2.5 with a dynamic prompt length: 9.7 -> 8.4 s).
    kadapt reports only the first line of an export error, which does not come from them. Restored
    after the trace, so a caller tracing in the same process keeps torch's default."""
    try:
        config = importlib.import_module("torch.fx.config")
    except ImportError:
        config = None
    if config is None or not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def load_export_machinery() -> None:
    """Import what ``torch.export`` imports the first time it runs (~17 MB and ~0.2 s; its autograd
    tracer pulls in all of networkx). Called before the export processes fork (``forked``), so they
    share one copy instead of each importing its own."""
    import torch._functorch.aot_autograd  # noqa: F401
    import torch.export._trace  # noqa: F401


def one_pass_export() -> OnePass | None:
    """``export(...).run_decompositions({})`` in one trace, or None where torch is not a tested release.

    ``torch.export.export`` traces the pre-dispatch (training) program, and ``run_decompositions``
    traces that program again to make it functional. torch's own post-dispatch export makes the
    functional program in one trace, and with the CompositeImplicitAutograd ops preserved the way
    ``run_decompositions({})`` preserves them (``linear`` stays ``linear``) it is the same program:
    every shipped family's artifacts are byte-identical either way (tested), and Kimi-K2.5's four
    exports take 1.8 s instead of 3.2 s. These are torch internals, so only on the torch minor
    releases kadapt is tested with (``upstream.TESTED_TORCH``); elsewhere the two public calls."""
    tested = {version.rsplit(".", 1)[0] for version in upstream.TESTED_TORCH}
    if torch.__version__.split("+")[0].rsplit(".", 1)[0] not in tested:
        return None
    try:
        from torch.export._trace import _export
        from torch.export.exported_program import (
            _override_composite_implicit_decomp,
            _split_decomp_table_to_cia_and_python_decomp,
        )
    except ImportError:
        return None

    def export(wrapper: nn.Module, inputs: tuple[Any, ...], dynamic_shapes: Any) -> ExportedProgram:
        preserved = _preserved_ops(_split_decomp_table_to_cia_and_python_decomp)
        with _installed(_override_composite_implicit_decomp, preserved):
            return _export(wrapper, inputs, dynamic_shapes=dynamic_shapes, strict=False, pre_dispatch=False)

    return export


class _Held(contextlib.ExitStack):
    """The preserved-ops override installed for a group of exports, and the table it installed."""

    table: Any = None


_TOGETHER: list[_Held] = []  # the innermost ``exports_together`` last


@contextlib.contextmanager
def exports_together() -> Iterator[None]:
    """The one-pass exports inside install their preserved-ops override once, not around each.

    Installing it patches every one of the ~525 preserved ops (~40 ms: a quarter of a small graph's
    trace), and a run traces two to four graphs in a row. Only exports and their conversion run
    inside (``forked.in_processes``' builds): the override changes what the Python dispatcher (on
    only while tracing) and FakeTensorMode do with those ops, not eager ones. Removed on the way out,
    also after an error; a newly registered op re-installs it with the new table."""
    held = _Held()
    _TOGETHER.append(held)
    try:
        yield
    finally:
        _TOGETHER.pop()
        held.close()


@contextlib.contextmanager
def _installed(override: Callable[[Any], Any], preserved: Any) -> Iterator[None]:
    """``override(preserved)`` around one export; inside ``exports_together`` the group's install,
    made at its first export and made again when the table changed (a newly registered op)."""
    if not _TOGETHER:
        with override(preserved):
            yield
        return
    held = _TOGETHER[-1]
    if held.table is not preserved:
        held.close()
        held.enter_context(override(preserved))
        held.table = preserved
    yield


# the namespaces and CompositeImplicitAutograd registrations -> run_decompositions({})'s kept-ops table
_PRESERVED: dict[tuple[tuple[str, ...], tuple[str, ...]], Any] = {}


def _preserved_ops(split: Callable[[dict[Any, Any]], tuple[Any, ...]]) -> Any:
    """``run_decompositions({})``'s table of CompositeImplicitAutograd ops to keep, built once per set
    of registered ops. torch rebuilds it on every call (~25 ms: it walks every op namespace) because
    a custom op may be registered between two exports; the namespaces and the ops registered for that
    key are this cache's key, so a newly registered op makes a new table."""
    key = (
        tuple(torch.ops._dir),
        tuple(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")),
    )
    if key not in _PRESERVED:
        _PRESERVED[key] = split({})[0]
    return _PRESERVED[key]


def _param_path(wrapper: nn.Module, model: nn.Module) -> Callable[[str], str]:
    """Wrapper tensor name -> the model's first name for the same tensor (tied weights: the source)."""
    paths: dict[int, str] = {}
    for path, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        paths.setdefault(id(tensor), path)

    def path_of(name: str) -> str:
        owner, _, leaf = name.rpartition(".")
        module = wrapper.get_submodule(owner)
        return paths[id(module._parameters.get(leaf, module._buffers.get(leaf)))]

    return path_of


def _constant_value(
    wrapper: nn.Module, program: ExportedProgram, model: nn.Module
) -> Callable[[str], torch.Tensor]:
    """Real value of a non-persistent buffer: the traced one, or on meta the value transformers' own
    ``_init_weights`` gives it (``upstream.rebuild_buffer``; a model buffer the wrapper holds under a
    module of its own, ``runtime.PositionTable``, by the model's name of the same tensor), else
    ``type(owner)(owner.config)``."""
    modules = {id(module): path for path, module in model.named_modules()}
    buffers = {id(tensor): path for path, tensor in model.named_buffers(remove_duplicate=False)}

    def value(name: str) -> torch.Tensor:
        tensor = program.constants.get(name)
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            return tensor.detach().cpu()
        owner_path, _, leaf = name.rpartition(".")
        owner = wrapper.get_submodule(owner_path)
        held = buffers.get(id(owner._buffers.get(leaf)))
        if id(owner) in modules or held is not None:
            path = f"{modules[id(owner)]}.{leaf}".lstrip(".") if id(owner) in modules else str(held)
            rebuilt = upstream.rebuild_buffer(model, path)
            if rebuilt is not None:
                return rebuilt.detach()
        try:
            with torch.device("cpu"):
                fresh = type(owner)(owner.config)
            return fresh.get_buffer(leaf).detach()
        except Exception as exc:
            raise KadaptError(
                f"buffer {name} has no value on the meta device: neither transformers' _init_weights nor "
                f"{type(owner).__name__}(config) computes it"
            ) from exc

    return value


def export_wrapper(
    kind: str, backbone: Backbone, options: ExtractionOptions, num_layers: int
) -> tuple[nn.Module, ExportedProgram]:
    """Export the ``kind`` wrapper over the first ``num_layers`` decoder layers."""
    wrapper = wrapper_for(kind, backbone, options, num_layers)
    inputs = example_inputs(kind, backbone, options, num_layers)
    dims = dynamic_dims(kind, options, len(inputs))
    return wrapper, export_program(wrapper, inputs, kind, _torch_dynamic_shapes(kind, dims, len(inputs)))


def to_graph(
    kind: str,
    wrapper: nn.Module,
    program: ExportedProgram,
    backbone: Backbone,
    options: ExtractionOptions,
    num_layers: int,
    *,
    device: str,
) -> Graph:
    """Convert an exported wrapper, naming weights by the full model's parameter paths."""
    num_inputs = len(program.graph_signature.user_inputs)
    symbols = Symbols(symbol_names(program, dynamic_dims(kind, options, num_inputs)))
    return convert(
        program,
        kind=kind,
        names=graph_names(kind, options),
        kinds=list(options.layer_kinds[:num_layers]),
        param_path=_param_path(wrapper, backbone.model),
        constant_value=_constant_value(wrapper, program, backbone.model),
        device=device,
        symbols=symbols,
    )
