"""What a run writes besides the graphs: each IR's metadata and the KV mapping.

The metadata says what a graph is (spec, model, structure, sizes, dynamic ranges, the multimodal
prompt) and the KV mapping says how its caches are fed and read, so that a runtime can be written
from the files alone."""

from __future__ import annotations

from typing import Any

import torch
import transformers

from .... import __version__
from ....spec.model import Spec
from ..ir.encoding import enum_tables
from ..ir.graph import Graph
from ..ir.irjson import FORMAT_VERSION
from ..ir.stack import Backbone
from ..names import kv_names
from ..options import MERGED, ExtractionOptions
from ..runtime import abi as runtime
from ..runtime.mtp import mtp_mapping
from ..runtime.step import step_mapping
from ..step_options import MTP, STEP

EXEC_DEVICE = "cpu"  # factory ops traced on meta get this device (the executors run on CPU)


def metadata(spec: Spec, backbone: Backbone, options: ExtractionOptions, graph: Graph) -> dict[str, Any]:
    config = backbone.config
    merged = graph.kind == MERGED
    step = options.step
    aux_layers = (
        {"aux_layers": list(step.aux_layers)} if step and step.aux_layers and graph.kind == STEP else {}
    )
    return {
        "graph": graph.kind,
        "model_name": options.model_name,
        "model": (spec.raw.get("metadata") or {}).get("model"),
        "spec": spec.name,
        "model_class": type(backbone.model).__name__,
        "abi": {
            "batch": options.batch,
            "prefill_len": options.merged_prefill.prefill_len
            if merged and options.merged_prefill is not None
            else options.prefill_len,
            "max_cache_len": options.max_cache_len,
            "dtype": options.dtype,
            "kv_layout": options.kv_layout,
            **({} if options.mla_attention == "reexpand" else {"mla_attention": options.mla_attention}),
            **({"dynamic": dynamic_sizes(options, graph.kind)} if options.dynamic else {}),
            **(
                {"kv_cache": {"kind": "paged", **paged_kv(options)._asdict()}}  # type: ignore[union-attr]
                if options.paged is not None and graph.kind in ("decode", STEP, MTP)
                else {}
            ),
            **(
                {"step": {"tokens": options.step.tokens, "logits": options.step.logits, **aux_layers}}
                if options.step is not None and graph.kind in (STEP, MTP)
                else {}
            ),
        },
        **({"multimodal": multimodal_metadata(options)} if merged else {}),
        "structure": options.structure.to_dict() if options.structure is not None else None,
        "num_layers": len(backbone.layers),
        "stitching": graph.notes or None,
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "experts_implementation": getattr(config, "_experts_implementation", None),
        "device": EXEC_DEVICE,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "kadapt": __version__,
        },
        "enums": enum_tables(),
    }


def dynamic_sizes(options: ExtractionOptions, kind: str = "prefill") -> dict[str, tuple[int, int]]:
    """``{"prefill_len": (1, 64)}``: each dynamic size's range in the ``kind`` graph, as the IR metadata
    and KV mapping state it."""
    return {name: (r.min, r.max) for name, r in options.graph_ranges(kind).items()}


def multimodal_metadata(options: ExtractionOptions) -> dict[str, Any]:
    """The multimodal prefill IR's own metadata: which input takes the features, and the placeholder."""
    merged, vision_abi = options.merged_prefill, options.vision
    assert merged is not None and vision_abi is not None
    return {
        "feature_input": merged.feature_input,
        "feature_rows": merged.feature_rows,
        "placeholder_token_id": merged.image_token_id,
        "features_from": {"graph": options.path("vision").name, "output": vision_abi.output_name},
        "rule": runtime.MERGED_PREFILL_RULE,
    }


def paged_kv(options: ExtractionOptions) -> runtime.PagedKV | None:
    """The runtime's description of a paged cache (``abi.kv_cache: paged``), None when contiguous."""
    paged = options.paged
    return None if paged is None else runtime.PagedKV(paged.block_size, paged.num_blocks, paged.block_table)


def kv_mapping_document(options: ExtractionOptions, backbone: Backbone) -> dict[str, Any]:
    prefill, decode = options.prefill_names, options.decode_names
    mapping = runtime.build_kv_mapping(
        options.kv_dims,
        kv_layout=options.kv_layout,
        batch=options.batch,
        prefill_len=options.prefill_len,
        max_cache_len=options.max_cache_len,
        num_layers=len(backbone.layers),
        dtype=options.dtype,
        names=kv_names(prefill, decode),
        mla_attention=options.mla_attention,
        dynamic=dynamic_sizes(options),
        paged=paged_kv(options),
        kinds=options.layer_kinds,
        linear_states=options.linear_states,
        index_dim=options.index_dim,
        chunked=options.structure is not None and options.structure.has_chunked_layers,
        layer_kv_dims=options.layer_kv_dims,
        kv_sources=[layer.kv_source for layer in options.structure.layers] if options.structure else None,
        compress_rates=options.compress_rates,
    )
    graphs = {"prefill_graph": options.path("prefill").name, "decode_graph": options.path("decode").name}
    assert options.structure is not None
    attention = {
        "attention": options.structure.attention.kind,
        "sliding_windows": list(options.windows) if options.structure.has_sliding_layers else None,
        # only a stack with chunked layers names them: other mappings are what they always were
        **({"attention_chunks": list(options.chunks)} if options.structure.has_chunked_layers else {}),
    }
    merged = options.merged_prefill
    extra: dict[str, Any] = {}
    if merged is not None and merged.image_token_id is not None and merged.feature_rows is not None:
        assert options.vision is not None
        hidden = backbone.language_model.get_input_embeddings().embedding_dim
        extra["merged_prefill"] = runtime.build_merged_prefill_mapping(
            options.kv_dims,
            graph=options.path(MERGED).name,
            inputs=merged.names.fixed_inputs,
            batch=options.batch,
            prefill_len=merged.prefill_len,
            num_layers=len(backbone.layers),
            dtype=options.dtype,
            names=kv_names(merged.names, decode),
            feature_input=merged.feature_input,
            feature_shape=(merged.feature_rows, hidden),
            placeholder_token_id=merged.image_token_id,
            features_from={"graph": options.path("vision").name, "output": options.vision.output_name},
            dynamic=dynamic_sizes(options, MERGED),
            layer_kv_dims=options.layer_kv_dims,
        )
    step = options.step
    if step is not None and options.paged is not None:
        extra["step"] = step_mapping(
            graph=options.path(STEP).name,
            inputs=step.names.fixed_inputs,
            logits=step.names.logits,
            tokens=step.tokens,
            rows=step.rows,
            logit_count=step.logits,
            max_cache_len=options.max_cache_len,
            block_size=options.paged.block_size,
            placeholder_token_id=merged.image_token_id if merged is not None else None,
            hidden=(step.names.hidden, backbone.config.hidden_size) if step.names.hidden else None,
            aux=(step.names.aux, step.aux_layers, backbone.config.hidden_size) if step.names.aux else None,
        )
    if step is not None and step.mtp is not None and options.paged is not None:
        extra["mtp"] = mtp_document(options, backbone)
    return {
        "format_version": FORMAT_VERSION,
        "model_name": options.model_name,
        **graphs,
        **attention,
        **mapping,
        **extra,
    }


def mtp_document(options: ExtractionOptions, backbone: Backbone) -> dict[str, Any]:
    """The state mapping's ``mtp`` section: the draft graph, its inputs and its paged pools."""
    step, paged = options.step, options.paged
    assert step is not None and step.mtp is not None and step.names.hidden is not None and paged is not None
    shapes = runtime.decode_kv_shapes(options.kv_dims, 1, 1, (paged.block_size, paged.num_blocks))
    pools = [
        {"role": role, "input": step.mtp.inputs(1)[len(step.mtp.fixed_inputs) + index],
         "output": step.mtp.outputs(1)[1 + index], "shape": list(shape), "dtype": options.dtype}
        for index, (role, shape) in enumerate(zip(("key", "value"), shapes, strict=True))
    ]  # fmt: skip
    return mtp_mapping(
        graph=options.path(MTP).name,
        inputs=step.mtp.fixed_inputs,
        outputs=step.mtp.outputs(1),
        hidden_size=backbone.config.hidden_size,
        hidden_output=step.names.hidden,
        tokens=step.tokens,
        rows=step.rows,
        blocks_per_row=options.max_cache_len // paged.block_size,
        logit_count=step.logits,
        pools=pools,
        layer=backbone.config.num_hidden_layers,
        dtype=options.dtype,
    )
