"""Exporting the MTP draft graph (``runtime/mtp.py``) beside the step graph, named as the checkpoint is.

transformers builds a model without its MTP layer (``model.layers.61.*`` of DeepSeek-V3 is an ignored
key) and builds it apart, as ``MtpModel``, whose loader renames checkpoint layer ``num_hidden_layers + k``
to its depth ``k`` (``conversion_mapping``'s ``MtpModel`` entry: the decoder layer's tensors under
``mtp_block``, ``shared_head.norm`` as ``post_norm``). ``attached`` puts that layer back where the
checkpoint has it: one module at index ``num_hidden_layers`` of the stack's layer list holding the decoder
layer's parts and ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``. While it is attached, the
graph's weights take the model's own paths (``model.layers.3.eh_proj.weight`` on a three-layer model),
which are the checkpoint's names, and the weight map reads them through the main model's converters
(its fused experts stacked from per-expert tensors) like every other weight. The stack itself reads
only its first ``num_hidden_layers`` layers (``runtime.stack_layers``), so nothing else sees it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .... import upstream
from ....errors import KadaptError
from ..options import ExtractionOptions
from ..runtime import mtp as runtime_mtp
from ..runtime.abi import stack_part
from ..step_options import MTP
from .convert import Symbols, convert
from .export import _constant_value, _param_path, export_program, step_example
from .graph import Graph
from .stack import Backbone, probed_stack


def build_mtp(backbone: Backbone, where: str | None) -> nn.Module:
    """transformers' ``MtpModel`` of ``backbone``'s model (on its device: meta, no weights), or the located
    refusal when the installed transformers or the config has none."""
    refusal = runtime_mtp.mtp_refusal(backbone.model.config)
    if refusal is not None:
        raise KadaptError(f"no MTP draft graph: {refusal}", location=where)
    return runtime_mtp.mtp_model(backbone.model)


def checkpoint_layer(mtp: nn.Module) -> nn.Module:
    """MTP depth 0 as the checkpoint holds it: the decoder layer's parts beside the MTP projections."""
    layer = mtp.layers[0]
    held = nn.Module()
    for name, child in layer.mtp_block.named_children():
        held.add_module(name, child)
    for name in ("enorm", "hnorm", "eh_proj"):
        held.add_module(name, getattr(layer, name))
    if layer.use_post_norm:
        held.shared_head = nn.Module()
        held.shared_head.norm = layer.post_norm
    return held


@contextlib.contextmanager
def attached(backbone: Backbone, mtp: nn.Module | None) -> Iterator[nn.Module | None]:
    """``mtp``'s layer at index ``num_hidden_layers`` of the stack's layer list while inside (nothing
    with None), so that its tensors have the checkpoint's paths; yields that layer."""
    if mtp is None:
        yield None
        return
    layers = stack_part(backbone.language_model, "layers", backbone.parts.stated)
    count = backbone.config.num_hidden_layers
    if not isinstance(layers, nn.ModuleList) or len(layers) != count:
        raise KadaptError(
            f"the MTP layer needs a layer list of {count} layers to sit after, found {layers!r}"
        )
    layers.append(checkpoint_layer(mtp))
    try:
        yield layers[count]
    finally:
        del layers[count]


def mtp_wrapper(backbone: Backbone, mtp: nn.Module, options: ExtractionOptions) -> nn.Module:
    probed = probed_stack(backbone.language_model, backbone.parts)
    return runtime_mtp.MtpWrapper(
        mtp,
        kv_layout=options.kv_layout,
        cache_keyword=upstream.decoder_protocol(probed, options.layer_kinds).cache_keyword,
        mla_attention=options.mla_attention,
    ).eval()


def mtp_example_inputs(backbone: Backbone, options: ExtractionOptions) -> tuple[Any, ...]:
    paged = options.paged
    assert paged is not None
    return runtime_mtp.mtp_inputs(
        step_example(options, 0, backbone.device),  # its index inputs only: no layer's pools
        options.kv_dims,
        hidden_size=backbone.config.hidden_size,
        block_size=paged.block_size,
        num_blocks=paged.num_blocks,
        dtype=getattr(torch, options.dtype),
    )


def export_mtp(backbone: Backbone, mtp: nn.Module, options: ExtractionOptions, *, device: str) -> Graph:
    """The MTP draft graph, its weights named by the checkpoint (``attached``)."""
    assert options.step is not None and options.step.mtp is not None
    wrapper = mtp_wrapper(backbone, mtp, options)
    program = export_program(wrapper, mtp_example_inputs(backbone, options), MTP)
    with attached(backbone, mtp):
        return convert(
            program,
            kind=MTP,
            names=options.step.mtp,
            kinds=["attention"],
            param_path=_param_path(wrapper, backbone.model),
            constant_value=_constant_value(wrapper, program, backbone.model),
            device=device,
            symbols=Symbols({}),
        )
