"""The transformers contact points an extraction relies on, probed before any export.

``stack_points`` is the one list of what exporting a stack through the ABI wrappers relies on: kadapt's
own run checks it (with what only the run does: the weight map, the vision tower) and a generated
extraction module checks exactly it at import, so the two cannot disagree about a model.
"""

from __future__ import annotations

from .... import upstream
from ....structure.model import ModelStructure
from ....structure.rope import BY_LABEL
from ..options import ExtractionOptions

# What only kadapt's own run relies on: the loader's converters (the weight map); ``EXPORT_POINTS``'s
# experts marker too for any model, since ``check_exportable`` finds experts modules by it.
RUN_POINTS = (*upstream.EXPORT_POINTS, "loading_converters")


def stack_points(structure: ModelStructure) -> tuple[str, ...]:
    """The contact points the ABI wrappers rely on to export a stack of ``structure``: the cache, the
    loader's dtype plan and the model classes; a linear stack's state cache (its layer kind's protocol)
    and, for Mamba1, the head's input cast; a DSA stack's indexer cache; per-layer embeddings' methods;
    a rope by label and layers that take the token ids (DeepSeek-V4); an offset learned position
    table's lookup (OPT), XGLM's sinusoidal one; BLOOM's ALiBi builder; Beam's query scale; MoE
    experts' implementation."""
    linear = structure.linear
    points = ["cache_update"]
    if linear is not None:  # the linear layers read and update their states through the cache
        points.append(upstream.STATE_POINTS[linear.layer_kind])
    if structure.indexer is not None:  # the DSA indexer writes and reads its keys through the cache
        points.append("indexer_cache")
    if structure.per_layer_inputs is not None:  # computed by the language model's own methods
        points.append("per_layer_inputs")
    if structure.model_type in upstream.FLOAT32_ROPE_MODEL_TYPES:  # a layer type's rope from float32 input
        points.append("rope_input_dtype")
    if structure.residual_streams is not None:  # copied from the embeddings, merged by the stack's head
        points.append("residual_streams")
    if structure.rope.type == BY_LABEL:  # every layer handed each label's rope
        points.append("rope_by_label")
    if structure.moe is not None and structure.moe.hash_layers:  # the layers take the call's token ids
        points.append("layer_input_ids")
    if structure.model_type in upstream.OFFSET_POSITION_MODEL_TYPES:  # looked up past the table's offset
        points.append("learned_positions")
    if structure.model_type in upstream.COMPUTED_POSITION_MODEL_TYPES:  # computed from the positions
        points.append("sinusoidal_positions")
    if structure.model_type in upstream.ALIBI_MODEL_TYPES:  # built by the stack's build_alibi_tensor
        points.append("alibi_bias")
    if structure.model_type in upstream.ATTENTION_SCALING_MODEL_TYPES:  # its NoPE layers' query scale
        points.append("attention_scaling")
    points += ["loader_dtype_plan", "model_classes"]
    if linear is not None and linear.kind in upstream.HEAD_CAST_MIXERS:
        points.append("head_input_cast")  # the wrappers cast the final hidden states as it does
    if structure.moe is not None:
        points.append("experts_implementation")
    return tuple(points)


def run_points(options: ExtractionOptions) -> tuple[str, ...]:
    """What one run relies on: ``RUN_POINTS``, the stack's (once its structure is bound) and, with a
    vision tower, transformers' grid helpers; each once, in that order."""
    points = (*RUN_POINTS, *(stack_points(options.structure) if options.structure is not None else ()))
    if options.vision is not None:
        points = (*points, "vision_grid_helpers")
    return tuple(dict.fromkeys(points))


def check_upstream(options: ExtractionOptions) -> None:
    """Probe every transformers contact point this extraction relies on (``upstream.ContactPointMoved``
    names what moved); ``run`` probes the model's own decoder layers after it is built."""
    upstream.check(run_points(options))
