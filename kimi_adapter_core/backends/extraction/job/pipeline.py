"""``run``: prefill + decode graphs of an applied model -> IR JSON files + KV mapping, with progress.

With ``abi.vision`` also the vision graph, and with ``abi.vision.merged_prefill`` the multimodal prefill
(``prefill_mm``: the prefill wrapper whose embeddings take image features at placeholder tokens, traced
and stitched like the text prefill, so its KV continues into the same decode graph), and with
``abi.step`` the packed step graph (``step``: prefill chunks, decode and speculative tokens of many
requests in one call over the paged pool, ``runtime/step.py``) and with ``abi.step.mtp`` the MTP draft
graph (``mtp``: the model's MTP layer, ``ir/mtp_export.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import pickle
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from .... import upstream
from ....checkpoint.dtypes import cast_to_abi_dtype
from ....checkpoint.tensors import TensorType
from ....checkpoint.weight_map import same_document, weight_map_document
from ....errors import KadaptError, Refusal
from ....patching.gate import uncounted
from ....patching.session import active_session
from ....spec.against_config import aux_layer_range_problem
from ....spec.model import Spec
from ....structure.derive import derive_structure
from ..ir import vision
from ..ir.export import (
    export_wrapper,
    exports_together,
    graph_names,
    load_export_machinery,
    to_graph,
    traced_for,
)
from ..ir.graph import Graph
from ..ir.irjson import ir_chunks
from ..ir.mtp_export import attached, build_mtp, export_mtp
from ..ir.stack import Backbone, check_exportable, check_stack, probed_stack
from ..ir.stitch import NotStitchable, Plan, plan, stitch
from ..ir.weights import buffer_value, model_tensor_types, tied_names, weight_entries
from ..options import MERGED, ExtractionOptions, bind_merged_prefill, bind_structure
from ..runtime.step import step_refusal
from ..step_options import MTP, STEP
from . import forked
from .contact_points import check_upstream
from .documents import EXEC_DEVICE, kv_mapping_document, metadata
from .summary import ExtractionSummary, GraphStats
from .whole_model import check_whole_model
from .write import Staging

GRAPHS = ("prefill", "decode")

Echo = Callable[[str], None]
STEP_WIDTH = 38  # "replicate prefill_mm (process 2)" with room to spare: the seconds line up


class Clock:
    """Times named steps and echoes each as it finishes."""

    def __init__(self, echo: Echo) -> None:
        self.echo = echo
        self.steps: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.record(name, time.perf_counter() - start)

    def record(self, name: str, seconds: float) -> None:
        """A step timed elsewhere (``forked``: an export process's, the wait for them)."""
        self.steps.append((name, seconds))
        self.echo(f"  {name:<{STEP_WIDTH}} {seconds:6.2f} s")


def backbone_of(spec: Spec, model: nn.Module) -> Backbone:
    from ....loading import submodule

    return Backbone(
        model, submodule(model, spec, "language_model"), submodule(model, spec, "lm_head"), spec.stack_parts()
    )


def bound_to(spec: Spec, backbone: Backbone, options: ExtractionOptions) -> ExtractionOptions:
    """``options`` bound to the structure of ``backbone``'s config (unchanged if already bound)."""
    if options.structure is not None:
        return options
    return bind_structure(options, derive_structure(backbone.config, spec))


def build_graph(
    kind: str, backbone: Backbone, options: ExtractionOptions, chosen: Plan, clock: Clock
) -> Graph:
    """Trace ``chosen.prefix`` layers of ``kind``, convert, and replicate to every layer."""
    with clock.step(f"export {kind}"):
        wrapper, program = export_wrapper(kind, backbone, options, chosen.prefix)
    with clock.step(f"convert {kind}"):
        graph = to_graph(kind, wrapper, program, backbone, options, chosen.prefix, device=EXEC_DEVICE)
    del program
    if not chosen.templates:
        return graph
    module_paths = {id(m): p for p, m in backbone.model.named_modules()}
    try:
        with clock.step(f"replicate {kind}"):
            return stitch(
                graph,
                chosen,
                layer_paths=[module_paths[id(layer)] for layer in backbone.layers],
                tensor_types=model_tensor_types(backbone.model),
                names=graph_names(kind, options),
                constant_values=lambda path: buffer_value(backbone.model, path),
                tail_reads=options.step.aux_layers if kind == STEP and options.step is not None else (),
            )
    except NotStitchable as exc:
        clock.echo(f"  cannot replicate layers ({exc}); tracing all {len(backbone.layers)} layers")
        return build_graph(kind, backbone, options, Plan(len(backbone.layers)), clock)


def graph_stats(graph: Graph, options: ExtractionOptions, size: int, layers: int) -> GraphStats:
    return GraphStats(
        kind=graph.kind,
        path=options.path(graph.kind),
        nodes=len(graph.nodes),
        inputs=len(graph.inputs),
        outputs=len(graph.outputs),
        weights=len(graph.weights),
        parameters=sum(math.prod(t.shape) for t in graph.weights.values()),
        ops=Counter(node.op for node in graph.nodes),
        bytes=size,
        traced_layers=int(graph.notes.get("traced_layers", layers)),
        layers=layers,
    )


def check_kv_dims(options: ExtractionOptions, protocol: upstream.LayerProtocol) -> None:
    """What the layers hand the cache must be what kadapt read from the config (the KV mapping and the
    ABI's input shapes say it): the attention layers' KV per token, the linear layers' states."""
    if options.structure is None:
        return
    check_linear_states(options, protocol)
    indexer = options.structure.indexer
    if indexer is not None and protocol.index_dim != indexer.head_dim:
        raise Refusal(
            "stack-differs",
            f"the config describes a {indexer.describe()} (index_head_dim), but the DSA layers' indexers "
            f"hand the cache keys of width {protocol.index_dim}",
        )
    structure = options.structure
    layout = structure.attention.default_kv_layout
    cached = protocol.layer_kv_dims
    if cached is None:  # a protocol that states one shape for the stack: every attention layer holds it
        attending = set(structure.attention_layer_ids)
        cached = tuple(protocol.kv_dims if i in attending else None for i in range(structure.num_layers))
    for layer, found in enumerate(cached):
        if found is None:  # no KV cache: a linear or mixerless layer
            continue
        read = structure.kv_dims(layer, layout)
        if tuple(map(tuple, read)) != found:
            keys = ", ".join(f"{f}={k}" for f, k in sorted(structure.keys.items()) if "head" in f)
            raise Refusal(
                "stack-differs",
                f"the config describes layer {layer}'s {structure.layer_attention(layer).describe()}, {read} "
                f"((heads, dim) of key and value per token, from {keys}), but the layer caches {found}",
            )


def check_rope_input_dtype(spec: Spec, options: ExtractionOptions) -> None:
    """Refuse a graph in a dtype below float32 of a stack whose forward computes its DSA layers' rotary
    embedding from float32 embeddings (dots3; contact point ``rope_input_dtype``): their indexer keys
    are float32 then (transformers' ``DynamicIndexedLayer`` keeps them so), and the ABI types every
    indexer key in its own dtype; in float32 the two agree."""
    s = options.structure
    if s is None or s.indexer is None or options.dtype == "float32":
        return
    if s.model_type not in upstream.FLOAT32_ROPE_MODEL_TYPES:
        return
    raise Refusal(
        "outside-layers",
        f"{s.model_type}'s forward computes its DSA layers' rotary embedding from float32 embeddings, so "
        f"in a {options.dtype} model their indexer keys are float32 while kadapt's ABI types every indexer "
        "key in abi.dtype; export it in float32",
        location=spec.locate("abi.dtype"),
    )


def check_linear_states(options: ExtractionOptions, protocol: upstream.LayerProtocol) -> None:
    """The linear layers' conv and recurrent state shapes the config implies (``structure.linear``)
    must be the ones the layers hand over (then the mapping states what the graphs carry)."""
    assert options.structure is not None
    linear = options.structure.linear
    if linear is None or protocol.linear_states is None:
        return
    read = tuple(state.shape() for _, state in linear.states)
    found = tuple(shape for shape, _ in protocol.linear_states)
    if read != found:
        raise Refusal(
            "stack-differs",
            f"the config describes {linear.describe()}, {' and '.join(linear.state_names)} states {read} per "
            f"request, but the linear-attention layers hand over {found}",
        )


def check_checkpoint_layout(
    spec: Spec, model: nn.Module, backbone: Backbone, chosen: Plan, options: ExtractionOptions
) -> None:
    """The weight map of what will be traced (the template layers, embeddings, norm, head), before any
    export: a loading converter or a storage the map cannot describe refuses the run up front.

    An error that points at a spec node (a ``quantization`` scheme the config contradicts) is the
    spec's to fix, not a model kadapt cannot describe, so it passes through with its location rather
    than becoming a ``checkpoint-layout`` refusal."""
    layers = {id(layer) for layer in backbone.layers[chosen.prefix :]}
    skipped = {
        path for path, module in model.named_modules() if id(module) in layers
    }  # the layers stitching replicates: same converters, same storage, other numbers
    stack = {
        path for path, m in model.named_modules() if m is backbone.language_model or m is backbone.lm_head
    }
    weights = {
        path: tensor
        for path, tensor in model_tensor_types(model).items()
        if any(path.startswith(f"{s}.") or not s for s in stack)
        and not any(path.startswith(f"{s}.") for s in skipped)
    }
    try:
        weight_map_document(
            spec, model, weights, model_name=options.model_name, renames=options.weight_renames
        )
    except KadaptError as exc:
        if isinstance(exc, Refusal) or exc.location is not None:
            raise
        raise Refusal("checkpoint-layout", exc.message) from exc


def graph_weights(graphs: Iterable[Graph]) -> dict[str, TensorType]:
    """The weights ``graphs`` read, by model path, in graph order (what the weight map describes)."""
    return {path: tensor for graph in graphs for path, tensor in graph.weights.items()}


def export_mtp_graph(backbone: Backbone, mtp: nn.Module, options: ExtractionOptions, clock: Clock) -> Graph:
    with clock.step("export mtp"):
        return export_mtp(backbone, mtp, options, device=EXEC_DEVICE)


def export_vision(modules: vision.VisionModules, options: ExtractionOptions, clock: Clock) -> Graph:
    with clock.step("export vision"):
        return vision.build_vision_graph(modules, options, EXEC_DEVICE, echo=clock.echo)


class Prepared(NamedTuple):
    """What the exports need, once every check before them has passed."""

    backbone: Backbone
    options: ExtractionOptions  # bound to the model's structure (and the merged prefill's image tokens)
    chosen: Plan
    vision_modules: vision.VisionModules | None
    mtp: nn.Module | None = None  # transformers' MtpModel of the model (abi.step.mtp), on meta


def prepare(
    spec: Spec, model: nn.Module, options: ExtractionOptions, clock: Clock, *, check_whole: bool
) -> Prepared:
    """Every check ``run`` makes before it exports (a refusal here has written nothing), in its order:
    the stack, the exporter, the KV dims, the checkpoint layout, then the whole model (``check_whole``)."""
    echo = clock.echo
    backbone = backbone_of(spec, model)
    options = bound_to(spec, backbone, options)
    ranges = options.dynamic_ranges

    def size(name: str) -> str:
        return f"1..{ranges[name].max}" if name in ranges else str(getattr(options, name))

    echo(
        f"extracting {options.model_name}: {options.attention_label}, batch {size('batch')}, "
        f"prefill {size('prefill_len')}, cache {options.max_cache_len}, {options.dtype}"
    )
    for note in options.notes:
        echo(f"  note: {note}")
    vision_modules = None
    with clock.step("prepare"):
        check_upstream(options)
        check_rope_input_dtype(spec, options)
        check_stack(backbone, options.layer_kinds)
        if options.step is not None and (refusal := step_refusal(options.layer_kinds)) is not None:
            raise KadaptError(f"no packed step graph: {refusal}", location=options.step.where)
        if options.step is not None and options.step.aux_layers:
            problem = aux_layer_range_problem(options.step.aux_layers, len(backbone.layers))
            if problem is not None:
                raise KadaptError(f"no packed step graph: {problem}", location=options.step.where)
        mtp = build_mtp(backbone, options.step.where) if options.step and options.step.mtp else None
        check_exportable(backbone)
        load_export_machinery()
        dtype = getattr(torch, options.dtype)
        cast_to_abi_dtype(model, [backbone.language_model, backbone.lm_head], dtype)
        with attached(backbone, mtp) as layer:  # the MTP layer as the loader would load it
            cast_to_abi_dtype(model, [layer] if layer is not None else [], dtype)
        with uncounted():  # the layers themselves, before any export (a check, not an artifact)
            protocol = upstream.decoder_protocol(
                probed_stack(backbone.language_model, backbone.parts), options.layer_kinds
            )
        check_kv_dims(options, protocol)
        options = dataclasses.replace(options, linear_states=protocol.linear_states)
        # the expanded layout caches expand_kv's output and absorbed MLA runs the attention's projections
        # itself; the latent layout with re-expansion runs the attention's own forward as it is
        reads_mla = options.kv_layout == "expanded" or options.mla_attention == "absorbed"
        if options.structure is not None and options.structure.attention.is_mla and reads_mla:
            first = next(i for i, kind in enumerate(options.layer_kinds) if kind in ("attention", "indexed"))
            upstream.require_mla_attention(backbone.layers[first].self_attn)
        chosen = plan(backbone.layers) if options.stitch else Plan(len(backbone.layers))
        if options.vision is not None:
            vision_modules = vision.prepare(spec, model, options)
            if options.merged_prefill is not None:  # checked before any export
                image_token_id = getattr(model.config, "image_token_id", None)
                options = bind_merged_prefill(options, image_token_id, sum(vision_modules.tokens_per_image))
    with clock.step("checkpoint layout"):
        check_checkpoint_layout(spec, model, backbone, chosen, options)
    if check_whole:  # verify, which replays the saved files against transformers, does more
        with clock.step("whole model"), uncounted():
            check_whole_model(spec, options)
    return Prepared(backbone, options, chosen, vision_modules, mtp)


def run(
    spec: Spec,
    model: nn.Module,
    options: ExtractionOptions,
    *,
    echo: Echo,
    check_whole: bool = True,
    processes: int = 1,
) -> ExtractionSummary:
    """Extract prefill and decode IR of ``model`` (built by ``load_model`` under ``applied``).

    The text backbone's parameters are brought to the ABI dtype in place (free on meta), keeping
    transformers' fp32 modules in fp32, so the IR states the dtypes the checkpoint loads with.
    With ``processes`` 2 the graphs are traced and written half each in two forked children
    (``forked``; same bytes), and this process renames the files once both succeeded.
    """
    clock = Clock(echo)
    backbone, options, chosen, vision_modules, mtp = prepare(
        spec, model, options, clock, check_whole=check_whole
    )
    kinds = [*GRAPHS, *([MERGED] if options.merged_prefill is not None else [])]
    kinds += [STEP] if options.step is not None else []
    tasks: list[forked.Task] = [
        (
            kind,
            functools.partial(build_graph, kind, backbone, options, traced_for(kind, chosen, options), clock),
        )
        for kind in kinds
    ]
    if vision_modules is not None:
        tasks.append(("vision", functools.partial(export_vision, vision_modules, options, clock)))
    if mtp is not None:
        tasks.append((MTP, functools.partial(export_mtp_graph, backbone, mtp, options, clock)))
    session = active_session(spec)
    layers = {kind: len(backbone.layers) for kind in kinds}
    if vision_modules is not None:
        layers["vision"] = len(vision_modules.encoder.layers)
    if mtp is not None:
        layers[MTP] = 1
    weight_map_path = options.path("weight_map")
    staging = Staging([*(options.path(kind) for kind in layers), options.path("kv_mapping"), weight_map_path])
    mapped_here: list[dict[str, Any]] = []  # the run's weight map, when this process made it

    def weight_map_of(weights: dict[str, TensorType]) -> dict[str, Any]:
        with attached(backbone, mtp):  # the MTP graph's weights are the attached layer's
            return weight_map_document(
                spec, model, weights, model_name=options.model_name, renames=options.weight_renames
            )

    def report(built: Mapping[str, Graph], group: int, groups: int) -> tuple[dict[str, Any], Any]:
        """The weights a group's graphs read; the last group also maps them ahead (while the others
        may still trace): every graph of a run usually reads the same text weights, so it is often
        the run's map. Sent pickled, so that this process passes it on without building it."""
        reads, own = graph_weights(built.values()), None
        if group == groups - 1:
            with contextlib.suppress(KadaptError), clock.step("weight map"):
                own = weight_map_of(reads)  # on an error this process maps (and reports) them all
        shared = (
            pickle.dumps(own, protocol=pickle.HIGHEST_PROTOCOL) if own is not None and groups > 1 else None
        )
        return {"reads": reads, "mapped": own is not None, "map": shared}, own

    def decide(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The run's one weight map for every group (each IR's per-weight quantization is read from
        it), and which group writes it: the last group's own map when it is the run's."""
        read = {path: tensor for sent in reports for path, tensor in sent["reads"].items()}
        last = reports[-1]
        if last["mapped"] and same_document(last["reads"], read):
            others = [{"map": last["map"], "writes_map": False} for _ in reports[:-1]]
            return [*others, {"map": None, "writes_map": True}]
        with clock.step("weight map"):
            mapped_here.append(weight_map_of(read))
        shared = pickle.dumps(mapped_here[0], protocol=pickle.HIGHEST_PROTOCOL)
        return [{"map": shared, "writes_map": False} for _ in reports]

    def finish(built: Mapping[str, Graph], own: Any, decision: dict[str, Any]) -> dict[str, Any]:
        """Write the group's graphs (and the weight map, when it is the group's to write) to their
        temp files; their stats, and the map's size and notes when written."""
        weight_map = own if decision["map"] is None else pickle.loads(decision["map"])  # noqa: S301
        with clock.step("write graphs"):
            text = {kind: graph for kind, graph in built.items() if kind != "vision"}
            with attached(backbone, mtp):
                ties = tied_names(model, {path for graph in text.values() for path in graph.weights})
            files: dict[Path, Iterable[str]] = {}
            for kind, graph in text.items():
                weights = weight_entries(
                    graph, renames=options.weight_renames, ties=ties, weight_map=weight_map
                )
                files[options.path(kind)] = ir_chunks(
                    graph,
                    model_name=f"{options.model_name}_{kind}",
                    pytorch_version=torch.__version__,
                    metadata=metadata(spec, backbone, options, graph),
                    weights=weights,
                    renames=options.weight_renames,
                )
            if vision_modules is not None and "vision" in built:
                files[options.path("vision")] = vision.vision_chunks(
                    spec, vision_modules, built["vision"], options, EXEC_DEVICE, weight_map
                )
            if decision["writes_map"]:
                files[weight_map_path] = [json.dumps(weight_map, indent=1)]
            sizes = staging.write(files)
        return {
            "stats": {
                kind: graph_stats(graph, options, sizes[options.path(kind)], layers[kind])
                for kind, graph in built.items()
            },
            "weight_map": (sizes[weight_map_path], weight_map["notes"]) if decision["writes_map"] else None,
        }

    try:
        results = forked.in_processes(
            tasks,
            processes=processes,
            clock=clock,
            reach=session.reach if session is not None else {},
            report=report,
            decide=decide,
            finish=finish,
            around=exports_together,
        )
        with clock.step("write"):
            kv_mapping = kv_mapping_document(options, backbone)
            files = {options.path("kv_mapping"): [json.dumps(kv_mapping, indent=1)]}
            if mapped_here:
                files[weight_map_path] = [json.dumps(mapped_here[0], indent=1)]
            sizes = staging.write(files)
            staging.commit()
    finally:
        staging.discard()
    if mapped_here:
        map_bytes, map_notes = sizes[weight_map_path], mapped_here[0]["notes"]
    else:
        ((map_bytes, map_notes),) = (r["weight_map"] for r in results if r["weight_map"] is not None)
    summary = ExtractionSummary(
        model_name=options.model_name,
        kv_layout=options.kv_layout,
        mla_attention=options.mla_attention,
        attention_label=options.attention_label,
        sizes={
            "batch": options.batch,
            "prefill_len": options.prefill_len,
            "max_cache_len": options.max_cache_len,
        },
        steps=clock.steps,
        top_ops=options.top_ops,
        notes=[*options.notes, *map_notes],  # the CLI says them on its notes channel too
    )
    for result in results:
        summary.graphs.update(result["stats"])
    if vision_modules is not None:
        summary.vision = vision.describe(vision_modules)
    summary.kv_mapping = options.path("kv_mapping")
    summary.kv_mapping_bytes = sizes[summary.kv_mapping]
    summary.weight_map = weight_map_path
    summary.weight_map_bytes = map_bytes
    return summary
