"""``kadapt simulate --images``: price image prefill - vision encoder, projector, merged text prefill.

The vision side is traced the way the text side is (``rank_model``): the spec's own model is built on
meta inside ``applied(spec, backend="simulation")`` (``load_config`` + ``load_model``, the text model
cut to one rank's first layers of each kind by ``rank_config.rank_overrides`` so the build stays
cheap), and transformers' own vision tower and projector (``module_paths.vision_tower``,
``abi.vision.projector``) run under a ``tracer.Recorder`` at one rank's images. The grid constants
the encoder derives from ``grid_thw`` are computed by the extraction backend's ``VisionWrapper`` (the
same helpers ``kadapt apply`` bakes into the vision IR). Three places run the kernel a serving
runtime runs instead of the eager code:

- Attention. MoonViT attends within each image only (``cu_seqlens``); transformers' eager path calls
  the attention interface once per image, and ``VisionAttention`` (registered as an attention
  implementation while the trace runs) prices those calls as one variable-length FlashAttention
  kernel per layer whose work is the sum over images of full (non-causal) ``patches^2`` pairs -
  never the square of the concatenation.
- Layers. The encoder's layers are identical, so the first one is traced and its ops carry the layer
  count (``module_paths.vision_layers``), as the text layers do.
- Patch embedding. A ``Conv2d`` whose kernel covers the whole patch is a GEMM over the flattened
  patches (MAX and TensorCast run it so); priced as that GEMM, not as an M=1 convolution.

Parallel layout: the vision weights are replicated, so the images of a DP group are spread over its
TP ranks (vLLM's ``mm_encoder_tp_mode="data"``); one rank encodes ``ceil(images / tp)`` images, the
features are all-gathered over TP and scattered into the prompt's placeholder rows, and the text
prefill runs the prompt with ``tokens_per_image`` placeholders per image added (``simulator.simulate``).
Vision kernels are priced by the roofline with the device's efficiency tables (``cost.price``) under
either cost model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .... import upstream
from ....checkpoint.dtypes import cast_to_abi_dtype
from ....errors import KadaptError
from ....loading import applied, load_config, load_model, submodule
from ....spec.model import Spec
from ....structure.of_spec import text_config_key
from ....vision.images import FEATURE_BYTES, ImageBatch
from ....vision.options import vision_options
from ....vision.wrapper import VisionWrapper, vision_modules
from ..model.arch import read_config
from ..model.deployment import Deployment
from ..model.inputs import ModelInputs
from ..model.quant import NATIVE
from ..model.rank_config import BACKEND, rank_overrides
from ..model.tracer import Op, Recorder, fuse
from ..tables.device import Device
from .cost import Priced, kernel_table, price
from .simulator import Simulation, simulate

ATTENTION_IMPLEMENTATION = "kadapt_simulation_vision"  # registered with transformers while a trace runs

SCOPE_ENCODER = "vision_encoder"  # patch embedding, position embeddings, final norm, merge pooling
SCOPE_LAYER = "vision_layer"  # one encoder layer, repeated for all of them
SCOPE_PROJECTOR = "projector"
SCOPE_MERGE = "image_merge"  # feature all-gather over TP + scatter into the prompt embeddings
PARTS = {SCOPE_ENCODER: "encoder", SCOPE_LAYER: "encoder", SCOPE_PROJECTOR: "projector", SCOPE_MERGE: "merge"}


class VisionAttention:
    """Bidirectional attention within each image, priced as one variable-length fused kernel per layer.

    transformers calls it once per image of a layer (the eager / SDPA path splits the packed patches
    at ``cu_seqlens``); the calls of one module add up into the kernel recorded at its first call:
    FLOPs = 2 x pairs x (head_dim + v_head_dim) with pairs = heads x patches^2 per image, bytes = each
    image's q, k, v read and output written once."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.kernels: dict[int, Op] = {}  # id(attention module) -> its kernel

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **_: Any,
    ) -> tuple[torch.Tensor, None]:
        b, heads, s, hd = query.shape
        vd = value.shape[-1]
        pairs = b * heads * s * s
        flops = 2 * pairs * hd + 2 * pairs * vd
        nbytes = b * s * heads * (2 * hd + 2 * vd) * query.element_size()
        kernel = self.kernels.get(id(module))
        if kernel is None:
            self.rec.analytic(
                "flash_attention_vision(varlen)",
                "attention",
                flops=flops,
                nbytes=nbytes,
                shapes=f"images{b} H{heads} patches{s}",
                attrs={
                    "kernel": "gqa",
                    "decode": False,
                    "batch": b,
                    "seq": s,
                    "heads": heads,
                    "causal": False,
                },
            )
            self.kernels[id(module)] = self.rec.ops[-1]
        else:
            kernel.flops += flops
            kernel.bytes += nbytes
            kernel.attrs["batch"] += b
            kernel.attrs["seq"] = max(kernel.attrs["seq"], s)
            kernel.shapes = f"images{kernel.attrs['batch']} H{heads} patches{kernel.attrs['seq']}"
        return query.new_empty(b, s, heads, vd), None


def _encoder_configs(encoder: nn.Module) -> list[Any]:
    """Every distinct config an encoder module attends with (the ones the attention interface reads)."""
    configs = {id(m.config): m.config for m in encoder.modules() if hasattr(m, "config")}
    return [c for c in configs.values() if hasattr(c, "_attn_implementation")]


class _Scoped(nn.Module):
    """Runs ``inner`` with the recorder's scope set (a traced layer standing for ``repeat`` layers)."""

    def __init__(self, inner: nn.Module, rec: Recorder, scope: str, repeat: int) -> None:
        super().__init__()
        self.inner, self.rec, self.scope, self.repeat = inner, rec, scope, repeat

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.rec.scope(self.scope, self.repeat):
            return self.inner(*args, **kwargs)


class _PatchGemm(nn.Module):
    """A patch embedding ``Conv2d`` whose kernel covers the whole input patch, run as the GEMM it is
    (flattened patches x flattened kernel), as serving runtimes run it; other inputs use the conv."""

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        conv = self.conv
        if tuple(pixels.shape[-2:]) != tuple(conv.kernel_size) or conv.groups != 1:
            return conv(pixels)
        return F.linear(pixels.flatten(1), conv.weight.flatten(1), conv.bias)


def _swap_patch_conv(encoder: nn.Module) -> None:
    for path, module in list(encoder.named_modules()):
        if isinstance(module, nn.Conv2d) and module.kernel_size == module.stride:
            parent, _, leaf = path.rpartition(".")
            setattr(encoder.get_submodule(parent) if parent else encoder, leaf, _PatchGemm(module))


def images_per_rank(images: ImageBatch, dep: Deployment) -> int:
    """Images one rank encodes: its DP group's images spread over the group's TP ranks."""
    return math.ceil(images.images(dep.batch_per_rank) / dep.parallel.tp)


def trace_vision(spec: Spec, inputs: ModelInputs, dep: Deployment, images: ImageBatch) -> list[Op]:
    """The fused kernels one rank runs to turn its images into prompt rows: encoder, projector, merge."""
    if spec.abi is None or spec.abi.vision is None:
        raise KadaptError(
            f"spec {spec.name} declares no abi.vision: simulate --images needs its projector module "
            "(abi.vision.projector) next to module_paths.vision_tower",
            location=spec.locate("abi"),
        )
    s = inputs.arch.structure
    raw = read_config(spec)
    key = text_config_key(spec, isinstance(raw.get("text_config"), dict))
    rank = images_per_rank(images, dep)
    rows, cols = images.grid
    options = replace(vision_options(spec, spec.abi.vision), grid_thws=((1, rows, cols),) * rank)
    rec = Recorder()
    with applied(spec, backend=BACKEND):  # no meta device context: the grid constants are computed on CPU
        config = load_config(
            spec, backend=BACKEND, overrides=rank_overrides(key, s, dep, raw[key] if key else raw)
        )
        model = load_model(spec, device="meta", config=config)
        modules = vision_modules(spec, model, options)
        encoder, projector = modules.encoder, modules.projector
        cast_to_abi_dtype(model, [encoder, projector], torch.bfloat16)
        for param in [*encoder.parameters(), *projector.parameters()]:
            rec.mark_weight(param, NATIVE["fp32" if param.dtype == torch.float32 else "bf16"])
        layers = submodule(model, spec, "vision_layers")
        if not isinstance(layers, nn.ModuleList) or not len(layers):
            raise KadaptError(
                f"module_paths.vision_layers of spec {spec.name} is not a list of encoder layers",
                location=spec.locate("module_paths.vision_layers"),
            )
        patch_shape = modules.patch_shape  # read from the patch Conv2d before it becomes a GEMM
        _swap_patch_conv(encoder)
        rec.hook(encoder, spec.module_paths["vision_tower"].rpartition(".")[2])
        rec.hook(projector, options.projector.rpartition(".")[2])
        count = len(layers)
        first = layers[0]
        del layers[1:]
        layers[0] = _Scoped(first, rec, SCOPE_LAYER, count)
        wrapper = VisionWrapper(encoder, _Scoped(projector, rec, SCOPE_PROJECTOR, 1), options.grid_thws)
        pixels = torch.zeros((options.num_patches, *patch_shape), dtype=torch.bfloat16, device="meta")
        kernel = VisionAttention(rec)
        with (
            upstream.attention_kernel(ATTENTION_IMPLEMENTATION, kernel, _encoder_configs(encoder)),
            rec,
            torch.no_grad(),
            rec.scope(SCOPE_ENCODER, 1),
        ):
            features = wrapper(pixels)
        if not kernel.kernels:
            raise KadaptError(
                f"the attention of {type(encoder).__name__} never called transformers' attention interface "
                "(config._attn_implementation); simulate --images cannot price its attention"
            )
    return [*fuse(rec.ops), *_merge(dep, images, int(features.shape[-1]))]


def _merge(dep: Deployment, images: ImageBatch, hidden: int) -> list[Op]:
    """The DP group's features all-gathered over its TP ranks, then scattered into the prompt's
    placeholder rows of the input embeddings (each rank holds the whole group's prompt): kernels
    added after fusion, since a fused run's bytes are re-counted from traced tensors these lack."""
    tokens = images.images(dep.batch_per_rank) * images.tokens_per_image
    group_bytes = tokens * hidden * FEATURE_BYTES
    ops: list[Op] = []
    if dep.parallel.tp > 1:
        comm = {"collective": "all_gather", "bytes": group_bytes, "group": dep.parallel.tp}
        ops.append(Op("tp_all_gather(image_features)", "", SCOPE_MERGE, 1, "comm", comm=comm))
    # read the features, write them over the placeholder rows of the prompt's embeddings
    scatter = Op(
        "scatter(image_features)",
        "",
        SCOPE_MERGE,
        1,
        "vector",
        flops=tokens * hidden,
        bytes=2 * group_bytes,
        compute="vector",
        shapes=f"{tokens}x{hidden}",
    )
    ops.append(scatter)
    return ops


@dataclass(frozen=True)
class ImagePrefill:
    """One prefill step with images: the vision kernels of one rank, then the merged text prefill."""

    simulation: Simulation  # kernels: vision (scopes in PARTS) then the text prefill's
    images: ImageBatch
    text_tokens: int  # text tokens per query (the prompt adds images.tokens_per_query placeholders)
    images_per_rank: int
    vision_layers: int

    def part(self, kernel: Priced) -> str:
        return PARTS.get(kernel.op.scope, "text")

    def seconds(self, part: str) -> float:
        return sum(k.total for k in self.simulation.kernels if self.part(k) == part)

    def flops(self, part: str) -> float:
        return sum(k.op.flops * k.op.repeat for k in self.simulation.kernels if self.part(k) == part)

    @property
    def merged_prefill_s(self) -> float:
        """Features into the prompt plus the text prefill over text + placeholder tokens."""
        return self.seconds("merge") + self.seconds("text")

    @property
    def total_s(self) -> float:
        return self.simulation.step_time


def simulate_images(
    inputs: ModelInputs,
    spec: Spec,
    dep: Deployment,
    device: Device,
    images: ImageBatch,
    *,
    cost_model: str = "roofline",
    framework: str = "trtllm",
) -> ImagePrefill:
    """Price one prefill step of ``dep`` whose every query carries ``images``: encoder and projector
    for one rank's images, the feature merge, and the text prefill with the placeholder tokens added."""
    if dep.decode:
        raise KadaptError("images are encoded in a prefill step; a decode step has none")
    merged = replace(dep, query_len=dep.query_len + images.tokens_per_query)
    merged.check(inputs.arch.structure)
    table = kernel_table(device, framework)
    vision = [price(op, device, table) for op in trace_vision(spec, inputs, dep, images)]
    text = simulate(inputs, spec, merged, device, cost_model=cost_model, framework=framework)
    group_images = images.images(dep.batch_per_rank)
    memory = replace(text.memory, vision_cache=float(group_images * images.feature_bytes_per_image))
    stale = set(text.memory.warnings(device))
    notes = [w for w in text.warnings if w not in stale] + images.notes()
    if cost_model != "roofline":
        notes.append(
            f"the vision encoder and projector are priced by the roofline (--cost-model {cost_model} "
            "covers the text model)"
        )
    notes += memory.warnings(device)
    layers = next(k.op.repeat for k in vision if k.op.scope == SCOPE_LAYER)
    sim = replace(text, kernels=(*vision, *text.kernels), memory=memory, warnings=tuple(notes))
    return ImagePrefill(sim, images, dep.query_len, images_per_rank(images, dep), layers)
