"""What a generated TensorCast profile cannot declare, refused with the reason before anything renders.

msmodeling prices gated DeltaNet and DeepSeek sparse attention only inside its own builtin profiles;
a generated profile has no field for a linear-attention module, a sparse attention class, an
attention chunk (Llama-4) or a compressor (DeepSeek-V4), so a spec whose layers need one gets a located
refusal naming what TensorCast lacks."""

from __future__ import annotations

from ..config.source import resolve_source
from ..errors import KadaptError
from ..spec.model import Spec
from ..structure.model import ModelStructure
from ..structure.of_spec import structure_of_raw
from .common import cannot

TARGET = "simulation"  # the generate target these refusals belong to: the TensorCast profile

# Model types whose linear-attention layers TensorCast prices, each in its own builtin profile's
# patch_method (msmodeling 0.2.0, tensor_cast/transformers/builtin_model/): it routes the gated-DeltaNet
# mixer to its ``tensor_cast.linear_attention`` op. ModelProfile has no field that declares such a module.
TENSORCAST_LINEAR_BUILTINS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


# TensorCast's MLA module classes that price DeepSeek sparse attention (msmodeling 0.2.0), by the builtin
# profile that sets each as its ModelProfile.mla_module_class_type: the dsa_indexer op, the indexer cache
# its input generator allocates when the class asks for one (requires_indexer_cache), and the top-k
# mla_sparse_attention. No spec entry names a class, so only those builtin profiles use them.
TENSORCAST_DSA_CLASSES = {
    "deepseek_v32": "tensor_cast.layers.mla.DeepseekSparseAttention",
    "glm_moe_dsa": "tensor_cast.layers.glm5.Glm5SparseAttention",
}


def refuse_unpriced_layers(spec: Spec) -> None:
    """Refuse a profile TensorCast would price wrong: layers it models only in its builtin profiles."""
    try:
        raw = resolve_source(spec).raw
    except KadaptError:  # no config to read the layers from: nothing to refuse for
        return
    found = structure_of_raw(spec, raw)
    refuse_linear_attention(spec, found)
    refuse_sparse_attention(spec, found)
    refuse_chunked_attention(spec, found)
    refuse_compressed_attention(spec, found)


def refuse_compressed_attention(spec: Spec, found: ModelStructure) -> None:
    """A stack with compressed layers (DeepSeek-V4's hca and csa) cannot be profiled: TensorCast's
    attention sees a sliding window or every key, so it would price each compressed layer as its sliding
    window alone, without the compressor's entries (nor a csa layer's Lightning indexer and top-k)."""
    if not found.compressors:
        return
    counts = " and ".join(f"{found.layer_kinds.count(kind)} {kind}" for kind in found.compressors)
    raise cannot(
        spec,
        TARGET,
        f"{counts} of the {found.num_layers} layers are compressed attention (a compressor folds every "
        "rate tokens into an entry the layer attends over beside its sliding window; csa picks them with "
        "a Lightning indexer), and TensorCast's ModelProfile has no field that declares a compressor "
        "(msmodeling 0.2.0 knows a sliding window or full attention); a generated profile would price "
        "every compressed layer as its sliding window alone",
        "gate",
    )


def refuse_chunked_attention(spec: Spec, found: ModelStructure) -> None:
    """A stack with chunked-attention layers (Llama-4) cannot be profiled: TensorCast's attention sees a
    sliding window or every key, so it would price each chunked layer's query over the whole context
    instead of its own chunk's ``p % chunk + 1`` keys."""
    chunked = [chunk for chunk in found.chunks if chunk is not None]
    if not chunked:
        return
    raise cannot(
        spec,
        TARGET,
        f"{len(chunked)} of the {found.num_layers} layers use chunked attention (chunk "
        f"{'/'.join(str(c) for c in sorted(set(chunked)))}: a query sees only the keys of its own chunk), "
        "and TensorCast's ModelProfile has no field that declares an attention chunk (msmodeling 0.2.0 "
        "knows a sliding window or full attention); a generated profile would price every chunked layer "
        "as full attention",
        "gate",
    )


def refuse_sparse_attention(spec: Spec, found: ModelStructure) -> None:
    """A DSA stack's profile cannot be generated: a spec names no TensorCast module class, so the MLA swap
    would take TensorCast's dense MLA module, which allocates no indexer cache and attends to every key."""
    if found.indexer is None:
        return
    raise cannot(
        spec,
        TARGET,
        f"the {found.layer_kinds.count('indexed')} layers use DeepSeek sparse attention "
        f"({found.indexer.describe()}), which msmodeling 0.2.0 prices only through the sparse MLA module "
        "class its builtin profiles set as ModelProfile.mla_module_class_type ("
        + ", ".join(f"{model_type}: {cls}" for model_type, cls in TENSORCAST_DSA_CLASSES.items())
        + "): no spec entry names that class, and a generated profile's MLA swap would take the dense "
        "MultiheadLatentAttentionTensorCast, which allocates no indexer cache and attends to every key. "
        "Use TensorCast's builtin profile for this model",
        "gate",
    )


def refuse_linear_attention(spec: Spec, found: ModelStructure) -> None:
    """A hybrid stack's profile cannot be generated: TensorCast models linear attention only in its own
    builtin profiles, which a generated profile would replace, leaving the layers to transformers' scan."""
    if found.linear is None:
        return
    raise cannot(
        spec,
        TARGET,
        f"{len(found.linear_layer_ids)} of the {found.num_layers} layers are linear attention "
        f"({found.linear.describe()}), and TensorCast's ModelProfile has no field that declares a "
        "linear-attention module: msmodeling 0.2.0 prices gated DeltaNet only inside its own builtin "
        f"profiles ({', '.join(TENSORCAST_LINEAR_BUILTINS)}), whose patch_method routes the mixer to "
        "its tensor_cast.linear_attention op; a generated profile would replace that and leave the layers "
        "to transformers' chunked scan. Use TensorCast's builtin profile for this model",
        "gate",
    )
