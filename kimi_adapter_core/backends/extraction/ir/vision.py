"""The vision graph: the encoder (``module_paths.vision_tower``) and projector at the spec's fixed image ABI.

``abi.vision`` fixes the patch grid of every image one call packs (``grid_thws``), so everything
transformers derives from ``grid_thw`` at run time (bicubic position-embedding taps, frame indices,
rotary positions, the 2x2 merge gather) is computed here once, by transformers' own helpers, and
handed to the encoder through the keyword arguments those helpers pop. The graph then has one input,
the pixel patches, and one output, one projected feature row per image placeholder token; the grid
constants are written into the IR (``constants``), as the rotary frequencies are.

MoonViT's 27 encoder layers are identical, so, as for the text graphs (``stitch``), a shallow copy of
the encoder that runs only its first layers is exported (2 of 27: exporting all of them took ~12 s of
a ~21 s main job) and the template layer is cloned onto the other layers' weights; if the trace
cannot be replicated the whole encoder is exported. Only MoonViT (transformers'
``Kimi_K25VisionModel``) is supported: the precomputed tensors are the ones its forward consumes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
import transformers
from torch import nn

from .... import __version__
from ....checkpoint.dtypes import cast_to_abi_dtype
from ....errors import KadaptError
from ....spec.model import Spec
from ....vision.options import VisionOptions
from ....vision.wrapper import VisionModules, VisionWrapper, vision_modules
from ..names import GraphNames
from ..options import ExtractionOptions
from .convert import convert
from .encoding import enum_tables
from .export import _param_path, export_program
from .graph import Graph
from .irjson import ir_chunks
from .stitch import NotStitchable, Plan, plan, stitch
from .weights import model_tensor_types, tied_names, weight_entries

KIND = "vision"
ABI_PREFIX = "vision_abi"  # IR name prefix of the grid constants the wrapper owns
# where the encoder layers sit in VisionWrapper: node scopes encoder.layers.<i>...
LAYER_SCOPE = "encoder.layers"


def read_graph_names(abi: VisionOptions) -> GraphNames:
    # one fixed input, one output: GraphNames with no per-layer KV (converted with kinds=0)
    return GraphNames((abi.input_name,), None, None, abi.output_name, "", "")


def _constant_value(wrapper: VisionWrapper, program: Any) -> Any:
    """Real value of a constant: the wrapper's grid tensors, else the buffer rebuilt on CPU.

    On meta the model's non-persistent buffers have no values; they are rebuilt from their owner's
    class on CPU with the owner's config, or the encoder's config for owners that keep none
    (MoonViT's position embeddings), in the dtype the traced buffer has.
    """

    def value(name: str) -> torch.Tensor:
        if name in wrapper.values:
            return wrapper.values[name]
        tensor = program.constants.get(name)
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            return tensor.detach().cpu()
        owner_path, _, leaf = name.rpartition(".")
        owner = wrapper.get_submodule(owner_path)
        try:
            with torch.device("cpu"):
                fresh = type(owner)(getattr(owner, "config", wrapper.encoder.config))
            return fresh.get_buffer(leaf).detach().to(owner.get_buffer(leaf).dtype)
        except Exception as exc:
            raise KadaptError(
                f"buffer {name} has no value on the meta device and {type(owner).__name__} cannot rebuild it"
            ) from exc

    return value


def _first_layers(encoder: nn.Module, num_layers: int) -> nn.Module:
    """``encoder`` running only its first ``num_layers`` layers: a shallow copy sharing every submodule
    and parameter (so weights keep their model paths); the model itself is not touched."""
    if num_layers == len(encoder.layers):
        return encoder
    short = copy.copy(encoder)
    short._modules = {**encoder._modules, "layers": nn.ModuleList(list(encoder.layers)[:num_layers])}
    return short


def _traced_graph(modules: VisionModules, options: ExtractionOptions, device: str, num_layers: int) -> Graph:
    """Export and convert the vision wrapper over the first ``num_layers`` encoder layers."""
    encoder = _first_layers(modules.encoder, num_layers)
    wrapper = VisionWrapper(encoder, modules.projector, modules.abi.grid_thws).eval()
    dtype = getattr(torch, options.dtype)
    pixels = torch.zeros(
        (modules.abi.num_patches, *modules.patch_shape), dtype=dtype, device=modules.encoder.device
    )
    program = export_program(wrapper, (pixels,), KIND)
    model_path = _param_path(wrapper, modules.model)

    def path_of(name: str) -> str:
        return f"{ABI_PREFIX}.{name}" if name in wrapper.values else model_path(name)

    return convert(
        program,
        kind=KIND,
        names=read_graph_names(modules.abi),
        kinds=0,
        param_path=path_of,
        constant_value=_constant_value(wrapper, program),
        device=device,
    )


def build_vision_graph(
    modules: VisionModules,
    options: ExtractionOptions,
    device: str,
    *,
    echo: Callable[[str], Any] | None = None,
) -> Graph:
    """The vision graph at the fixed grid, weights named by model paths.

    With ``options.stitch`` the shortest prefix of encoder layers holding a template for the rest is
    traced and replicated (``stitch``); a trace that cannot be replicated is redone over every layer,
    and ``echo`` (the progress printer) says why.
    """
    layers = list(modules.encoder.layers)
    chosen = plan(layers) if options.stitch else Plan(len(layers))
    graph = _traced_graph(modules, options, device, chosen.prefix)
    if not chosen.templates:
        return graph
    module_paths = {id(m): p for p, m in modules.model.named_modules()}
    try:
        return stitch(
            graph,
            chosen,
            layer_paths=[module_paths[id(layer)] for layer in layers],
            tensor_types=model_tensor_types(modules.model),
            names=read_graph_names(modules.abi),
            layer_scope=LAYER_SCOPE,
        )
    except NotStitchable as exc:
        if echo is not None:
            echo(f"  cannot replicate vision layers ({exc}); tracing all {len(layers)} layers")
        return _traced_graph(modules, options, device, len(layers))


def prepare(spec: Spec, model: nn.Module, options: ExtractionOptions) -> VisionModules:
    """The vision modules of ``model``, checked, with parameters in the ABI dtype (free on meta)."""
    assert options.vision is not None
    modules = vision_modules(spec, model, options.vision)
    cast_to_abi_dtype(model, [modules.encoder, modules.projector], getattr(torch, options.dtype))
    return modules


def metadata(spec: Spec, modules: VisionModules, options: ExtractionOptions, device: str) -> dict[str, Any]:
    """The vision IR's metadata: the image ABI and how its features enter the text prefill."""
    abi = modules.abi
    tokens = modules.tokens_per_image
    config = modules.model.config
    return {
        "graph": KIND,
        "model_name": options.model_name,
        "model": (spec.raw.get("metadata") or {}).get("model"),
        "spec": spec.name,
        "model_class": type(modules.model).__name__,
        "abi": {
            "grid_thws": [list(grid) for grid in abi.grid_thws],
            "num_images": len(abi.grid_thws),
            "num_patches": abi.num_patches,
            "patch": list(modules.patch_shape),
            "merge_kernel": list(modules.merge_kernel),
            "num_image_tokens": sum(tokens),
            "tokens_per_image": tokens,
            "dtype": options.dtype,
            "pixel_layout": (
                "patches of all images in grid_thws order, each image's patches row-major over its "
                "(rows, columns) grid, frames outermost; each patch [channels, patch, patch], normalised "
                "as the image processor does"
            ),
        },
        "feature_mapping": {
            "placeholder_token_id": getattr(config, "image_token_id", None),
            "rule": (
                f"row i of {abi.output_name} replaces the input embedding of the i-th image placeholder "
                "token of the prompt (images in grid_thws order, tokens_per_image placeholders each); the "
                "placeholders keep their ordinary consecutive position_ids"
            ),
            "text_hidden_size": int(getattr(config.get_text_config(), "hidden_size", 0)) or None,
        },
        "num_layers": len(modules.encoder.layers),
        "attn_implementation": getattr(modules.config, "_attn_implementation", None),
        "device": device,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "kadapt": __version__,
        },
        "enums": enum_tables(),
    }


def vision_chunks(
    spec: Spec,
    modules: VisionModules,
    graph: Graph,
    options: ExtractionOptions,
    device: str,
    weight_map: Mapping[str, Any],
) -> Any:
    """The vision IR document as text chunks (same layout as the text graphs); ``weight_map`` is the
    extraction's one weight map, which the IR's per-weight quantization is read from."""
    weights = weight_entries(
        graph,
        renames=options.weight_renames,
        ties=tied_names(modules.model, graph.weights),
        weight_map=weight_map,
    )
    return ir_chunks(
        graph,
        model_name=f"{options.model_name}_{KIND}",
        pytorch_version=torch.__version__,
        metadata=metadata(spec, modules, options, device),
        weights=weights,
        renames=options.weight_renames,
    )


def describe(modules: VisionModules) -> str:
    """One summary line: the image ABI the vision graph was exported at."""
    grids = ", ".join(f"{t}x{h}x{w}" for t, h, w in modules.abi.grid_thws)
    rows, cols = modules.merge_kernel
    tokens = sum(modules.tokens_per_image)
    images = len(modules.abi.grid_thws)
    _, height, width = modules.patch_shape
    return (
        f"{images} image{'s' if images > 1 else ''}, t x h x w patch grid {grids} ({modules.abi.num_patches} "
        f"patches of {height}x{width} px), merge {rows}x{cols} -> {tokens} image tokens"
    )
