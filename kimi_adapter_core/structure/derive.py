"""Derive a ``ModelStructure`` from a config (transformers object or raw JSON dict) and a spec.

The lookup is data: ``config_keys.yaml`` lists, for every structural fact, the keys families use
for it; the spec's ``architecture`` section adds keys (``fields``) or states facts outright
(``attention``, ``dense_layers``, ``router``); the older ``moe.num_experts_key`` and
``moe.routing.scoring_func`` are honoured too. No ``model_type`` branches: a family kadapt has never
seen works when its keys are in the table or the spec names them.

Every contradiction between the spec and the config (an ``mla`` section on a GQA model, a stated kind
the config lacks, a missing ``fields`` key) is a ``KadaptError`` located at the spec entry, up front.
"""

from __future__ import annotations

from typing import Any

from ..errors import KadaptError, Refusal
from ..spec.model import Spec
from . import bounds
from .around_layers import OutsideOp, PerLayerInputs
from .attention_form import attention_form_of
from .compressor_of import compressor_of, legacy_layer_types
from .indexer_of import indexer_of, topk_sources
from .kv_sharing import kv_sources, mlp_widths
from .layer_pattern import PATTERN_KEY, layout_types
from .layer_shapes import layer_attentions
from .linear_of import linear_of
from .mlp_of import dense_width_of
from .model import (
    ATTENTION_KINDS,
    Attention,
    Layer,
    ModelStructure,
    Moe,
)
from .moe_of import moe_layer_kinds, moe_of
from .reader import MISSING, Reader, locate, mlp_block_types, outside_modelled, tables
from .refusals import refuse_outside_layer_features, refuse_unmodelled_layers
from .residual_streams import residual_streams_of
from .rope_of import named_layer_types, rope_flags, rope_of
from .shared_blocks import hybrid_layer_type, mlp_kinds, shared_blocks_of


def _attention(read: Reader, spec: Spec | None, hidden: int) -> Attention:
    heads = int(read.require("num_heads"))
    kv_lora = read.get("kv_lora_rank")
    if kv_lora is not None:
        nope, rope = int(read.require("qk_nope_head_dim")), int(read.require("qk_rope_head_dim"))
        q_lora = read.get("q_lora_rank")
        read.get("num_kv_heads")  # MLA keeps it equal to the heads; recorded so tiny models keep it so
        attention = Attention(
            "mla",
            heads,
            heads,
            nope + rope,
            int(read.require("v_head_dim")),
            q_lora_rank=int(q_lora) if q_lora is not None else None,
            kv_lora_rank=int(kv_lora),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
        )
    else:
        # FalconAttention caches one KV head (multi_query), or every head (its new decoder architecture)
        every = read.get("new_decoder_architecture") is True
        one = read.get("multi_query") is True and not every
        kv_heads = heads if every else 1 if one else int(read.get("num_kv_heads", heads))
        head_dim = int(read.get("head_dim") or hidden // heads)
        kind = "mha" if kv_heads == heads else "mqa" if kv_heads == 1 else "gqa"
        # values narrower than keys where the config says so (MiMo-V2-Flash: 192-wide keys, 128 values)
        v_head_dim = int(read.get("v_head_dim") or head_dim)
        attention = Attention(
            kind, heads, kv_heads, head_dim, v_head_dim, form=attention_form_of(read, head_dim)
        )
    _check_attention_claims(attention, read, spec)
    return attention


# Layer spans that attend (keep a KV cache)
ATTENDING_SPANS = ("full", "sliding", "chunked", "indexed", "hybrid", "hca", "csa")
# Layer spans that slide (a compressed layer slides too, beside its entries)
SLIDING_SPANS = ("sliding", "hca", "csa")


def _attends(read: Reader, spans: list[tuple[str, int | None]]) -> bool:
    """Whether the stack's attention is read from the config: some layer attends, or the config states
    attention heads all the same (Mamba2's SSM heads, which its structure has always described)."""
    return any(span in ATTENDING_SPANS for span, _ in spans) or read.get("num_heads") is not None


def _nominal_attention(hidden: int) -> Attention:
    """The attention of a stack no layer of which attends and whose config states no heads (Mamba,
    Falcon-Mamba): one head of the hidden width, which sizes nothing (no layer caches a key or a value:
    the mapping has no KV entry, the plan no KV bytes) but keeps one ``Attention`` per structure."""
    return Attention("mha", 1, 1, hidden, hidden)


def _check_attention_claims(attention: Attention, read: Reader, spec: Spec | None) -> None:
    """What the spec says about attention must be what the config has."""
    if spec is None:
        return
    stated = (spec.architecture or {}).get("attention")
    if stated is not None and stated != attention.kind:
        raise KadaptError(
            f"architecture.attention is {stated!r} but {read.where} describes {attention.kind.upper()} "
            f"attention ({attention.describe()}); valid: {', '.join(ATTENTION_KINDS)}",
            location=locate(spec, "architecture.attention"),
        )
    if spec.mla and not attention.is_mla:
        raise KadaptError(
            f"the spec has an `mla` section but {read.where} has no multi-head latent attention "
            f"(no kv_lora_rank; it describes {attention.describe()}); drop the section",
            location=spec.locate("mla"),
        )


def _per_layer_inputs(read: Reader) -> PerLayerInputs | None:
    """The per-layer embeddings the config gives the layers (None: a width of 0 or none stated); their
    table's vocabulary defaults to the model's, as Gemma-4's config does."""
    width = int(read.get("per_layer_input_width", 0) or 0)
    if width <= 0:
        return None
    return PerLayerInputs(width, int(read.get("per_layer_input_vocab") or read.require("vocab_size")))


def _layer_types(read: Reader, num_layers: int) -> list[Any] | None:
    """Each layer's type as the config lists it (``layer_types``, Nemotron-H's ``layers_block_type``),
    else as the family's config class fixes it (``uniform_layer_types``: Falcon-H1), else as a raw layout
    builds the list (``layer_pattern.layout_types``, Llama-4's chunk rule); None:
    none of them."""
    types = read.get("layer_types")
    uniform = tables()["uniform_layer_types"].get(read.raw("model_type"))
    if types is None and uniform is not None:  # a property of the family's config class (Falcon-H1)
        types = [uniform] * num_layers
    if types is None:
        types = layout_types(read.raw, num_layers, read.get("mamba_state_size") is not None)
    if types is None:
        types = _chunked_types(read, num_layers)
    if types is None:  # DeepSeek-V4's published config.json: a compress ratio per layer
        types = legacy_layer_types(read, num_layers)
    return types


def _num_layers(read: Reader) -> int:
    """The stack's depth: its key, else the length of the per-layer list that defines it (a Nemotron-H
    ``config.json`` saved by transformers 5.24 has ``layers_block_type`` and no ``num_hidden_layers``, a
    property of its class; an older one ``hybrid_override_pattern``)."""
    if read.get("num_layers") is None:
        types = read.get("layer_types")
        pattern = read.raw(PATTERN_KEY)
        listed = types if isinstance(types, list) else pattern if isinstance(pattern, str) else None
        if listed:
            return len(listed)
    return int(read.require("num_layers"))


def _lists_blocks(read: Reader) -> bool:
    """Whether the config lists one-sublayer blocks (``mlp_blocks.keys``: Nemotron-H's)."""
    return any(read.raw(key) not in (MISSING, None) for key in tables()["mlp_blocks"]["keys"])


def _known_types(read: Reader) -> dict[str, str]:
    """Layer type -> how kadapt models it (``layer_types``), and in a stack of one-sublayer blocks its MLP
    blocks too (no mixer: ``none``)."""
    known = {**tables()["layer_types"], **hybrid_layer_type(read.raw("model_type"))}
    if _lists_blocks(read):
        known.update(dict.fromkeys(mlp_block_types(), "none"))
    return known


def _block_mlps(read: Reader, types: list[Any] | None, num_layers: int, moe: Moe | None) -> list[str] | None:
    """Per layer the MLP kind of a stack of one-sublayer blocks (``mlp_blocks``: Nemotron-H), where an MLP
    block's type says its kind and a mixer block has no MLP (``none``); None: not such a stack."""
    blocks = mlp_block_types()
    if types is None or not _lists_blocks(read) or not any(t in blocks for t in types[:num_layers]):
        return None  # Granite-4.0-H lists its blocks too, each a mixer and an MLP
    kinds = [blocks.get(t, "none") for t in types[:num_layers]]
    if "moe" in kinds and moe is None:
        raise KadaptError(
            f"{read.where}: layer {kinds.index('moe')} is a moe block but the config declares no routed "
            f"experts (looked for: {', '.join(read.candidates['num_experts'])})"
        )
    return kinds


def _spans(read: Reader, num_layers: int, types: list[Any] | None) -> list[tuple[str, int | None]]:
    """Per layer ``(kind, span)``: ``("sliding", window)``, ``("chunked", chunk)`` or ``(kind, None)``
    (full, linear, indexed, none); from ``types`` when the config lists them, else one rule."""
    window = read.get("sliding_window")
    if read.get("use_sliding_window", True) is False:
        window = None
    if types is not None:
        if len(types) < num_layers:
            raise KadaptError(
                f"{read.where}: layer_types lists {len(types)} layers, the model has {num_layers}"
            )
        known = _known_types(read)
        _check_layer_types(read, types[:num_layers])
        spans: list[tuple[str, int | None]] = []
        for i, kind in enumerate(types[:num_layers]):
            spans.append(_span(read, i, kind, known[kind], window))
        return spans
    interval = read.get("full_attention_interval")
    # Qwen3-Next's and Qwen3.5's rule (their config classes build layer_types from it): layer i is full
    # attention iff (i + 1) % N == 0, the others linear attention
    if interval:
        return [
            ("full", None) if (i + 1) % int(interval) == 0 else ("linear", None) for i in range(num_layers)
        ]
    # DeepSeek-V3.2's and GLM-5's rule (their config classes' default layer_types): with an indexer's
    # sizes and no list, every layer is DSA attention
    if read.get("index_topk") is not None:
        return [("indexed", None)] * num_layers
    if read.get("linear_conv_kernel_dim") is not None:
        raise KadaptError(
            f"{read.where}: the config sizes linear-attention layers (linear_conv_kernel_dim) but says "
            "neither which layers they are (layer_types) nor how often a full-attention layer comes "
            "(full_attention_interval); transformers would fill in a default kadapt does not guess"
        )
    if not window:
        return [("full", None)] * num_layers
    pattern = read.get("sliding_window_pattern")
    # Gemma-3's rule (its config class builds layer_types from it): layer i is full iff (i + 1) % N == 0
    if pattern:
        return [
            ("full", None) if (i + 1) % int(pattern) == 0 else ("sliding", int(window))
            for i in range(num_layers)
        ]
    first_sliding = read.get("max_window_layers")  # Qwen2-style: layers from this index on slide
    if first_sliding is not None and read.keys.get("use_sliding_window"):
        return [("sliding", int(window)) if i >= first_sliding else ("full", None) for i in range(num_layers)]
    return [("sliding", int(window))] * num_layers


def _span(read: Reader, index: int, kind: str, modelled: str, window: Any) -> tuple[str, int | None]:
    """One listed layer's ``(kind, span)``: a sliding layer takes the config's window, a chunked layer
    its ``attention_chunk_size`` (a located error when the config has none)."""
    if modelled in SLIDING_SPANS:
        if not window:
            raise KadaptError(f"{read.where}: layer {index} is {kind} but the config sets no sliding_window")
        return modelled, int(window)
    if modelled == "chunked":
        chunk = read.get("attention_chunk_size")
        if not chunk:
            raise KadaptError(
                f"{read.where}: layer {index} is {kind} but the config sets no attention_chunk_size"
            )
        return "chunked", int(chunk)
    return modelled, None


def _chunked_types(read: Reader, num_layers: int) -> list[str] | None:
    """Llama-4's rule (its config class builds ``layer_types`` from it when the JSON has none): with an
    ``attention_chunk_size``, layers that use rope are chunked and the NoPE layers full attention, the
    NoPE layers as ``rope_of.rope_flags`` reads them. None: no chunk size, no such rule."""
    if not read.get("attention_chunk_size"):
        return None
    flags = rope_flags(read, num_layers)  # never None with a chunk size: the class's interval at least
    return ["chunked_attention" if flag else "full_attention" for flag in flags or ()]


def _check_layer_types(read: Reader, types: list[Any]) -> None:
    """Every entry of ``layer_types`` must be a layer kind kadapt models (full, sliding, linear, indexed;
    in a stack of one-sublayer blocks also MLP blocks); a type ``unmodelled_layer_types`` lists is refused
    naming its operation and why no spec supplies it."""
    known = _known_types(read)
    for i, kind in enumerate(types):
        if not isinstance(kind, str) or kind in known:  # not a string: the value check reports it
            continue
        unmodelled = tables()["unmodelled_layer_types"].get(kind)
        if unmodelled is not None:  # a kind whose operation and reason the table names
            raise Refusal(
                "layer-types",
                f"{read.where}: layer {i} is {kind!r}: {unmodelled['operation']}; {unmodelled['why']}",
                location=locate(read.spec, "gate"),
            )
        hybrid = kind in tables()["hybrid_layer_types"]
        *others, last = [repr(k) for k in known]
        raise Refusal(
            "hybrid" if hybrid else "layer-types",
            f"{read.where}: layer {i} is {kind!r}"
            + (" (its state is neither a KV cache nor a linear-attention state)" if hybrid else "")
            + f"; kadapt models {', '.join(others)} and {last} layers",
            location=locate(read.spec, "gate"),
        )


def _outside(read: Reader) -> tuple[OutsideOp, ...]:
    """The modelled math outside the layers that this config switches on (``outside_modelled``), after
    what the family's modelling code always does (``outside_fixed``: CTRL's sqrt(n_embd) scale)."""
    ops = []
    for rule in tables()["outside_fixed"].get(read.raw("model_type"), ()):
        value = float(read.get("hidden_size")) ** 0.5  # the one value the table states: sqrt_hidden_size
        ops.append(OutsideOp(rule["site"], rule["op"], value, rule["source"]))
    for key, rule in outside_modelled().items():
        value = read.raw(key)
        if value is MISSING or value in rule["neutral"]:
            continue
        ops.append(OutsideOp(rule["site"], rule["op"], float(value), key))
    return tuple(ops)


def _value_violations(read: Reader) -> list[bounds.Violation]:
    """Every present fact's value against its rule (``bounds.FACT_RULES``), the RoPE parameters and the
    math outside the layers against theirs, then the rules between the facts that kept their own."""
    found: list[bounds.Violation] = []
    valid: dict[str, tuple[str, Any]] = {}
    present = set()
    for fact, rule in bounds.FACT_RULES.items():
        answer = read.peek(fact)
        if answer is None:
            continue
        key, value = answer
        present.add(fact)
        if isinstance(value, (list, tuple)) and rule.kind not in bounds.LIST_ENTRIES:
            continue  # one value per layer: derive refuses it as a per-layer config
        problem = rule.problem(value)
        if problem is None:
            valid[fact] = answer
        else:
            found.append(bounds.Violation(read.prefix + key, problem))
    if "rope_parameters" in valid:
        key, params = valid["rope_parameters"]
        remote_code = bool(read.spec and read.spec.source.trust_remote_code)
        named = named_layer_types(read)
        found += bounds.rope_violations(read.prefix + key, params, remote_code=remote_code, layer_types=named)
    for key, rule in outside_modelled().items():  # a scale or a soft-cap: applied as a positive factor
        answer = read.peek(key)
        if answer is not None and answer[1] not in rule["neutral"]:
            problem = bounds.POSITIVE_NUMBER.problem(answer[1])
            found += [bounds.Violation(read.prefix + key, problem)] if problem else []
    return found + bounds.cross_field(bounds.Facts(valid, frozenset(present)), read.prefix)


def _check_values(read: Reader) -> None:
    """Raise every value finding of the config at once, before anything is computed from a value."""
    found = _value_violations(read)
    if found:
        raise bounds.ConfigValueError(read.origin, found)


def value_violations(
    config: Any, spec: Spec | None, where: str, origin: str, prefix: str = ""
) -> tuple[str, list[bounds.Violation]]:
    """``(origin, findings)``: every value of ``config`` that breaks its rule (``structure.bounds``),
    checked exactly as ``derive_structure`` checks them, without deriving anything."""
    read = Reader(config, spec, where, origin, prefix)
    return read.origin, _value_violations(read)


def refuse_unmodelled(config: Any, spec: Spec | None = None, *, where: str = "text config") -> None:
    """The refusals alone (hybrid layers, layer features kadapt lacks, unknown layer types, unmodelled
    math outside the layers), without the facts a bare config.json may leave to its class's defaults:
    what runs on the raw JSON before any config class sees it, and in plain ``validate``."""
    read = Reader(config, spec, where)
    refuse_unmodelled_layers(read, spec)
    types = read.raw("layer_types")
    if isinstance(types, list):
        read.keys["layer_types"] = "layer_types"
        _check_layer_types(read, types)
    refuse_outside_layer_features(read, spec)


def derive_structure(
    config: Any,
    spec: Spec | None = None,
    *,
    where: str = "text config",
    origin: str | None = None,
    prefix: str = "",
) -> ModelStructure:
    """The structure of the text backbone whose config (object or dict) is ``config``.

    Every value is typed and bounded first (``bounds``), so nothing below divides by a zero head count
    or builds a list per layer of a billion layers; ``origin`` (the config file) and ``prefix`` (its
    text section, ``text_config.``) locate those findings."""
    read = Reader(config, spec, where, origin, prefix)
    refuse_unmodelled_layers(read, spec)
    _check_values(read)
    num_layers = _num_layers(read)
    hidden = int(read.require("hidden_size"))
    moe = moe_of(read, spec)
    types = _layer_types(read, num_layers)
    spans = _spans(read, num_layers, types)
    attends = _attends(read, spans)
    attention = _attention(read, spec, hidden) if attends else _nominal_attention(hidden)
    shapes = layer_attentions(read, attention, types, num_layers) if attends else (None,) * num_layers
    sources = kv_sources(read, types, num_layers)
    kinds = _block_mlps(read, types, num_layers, moe) or moe_layer_kinds(read, spec, num_layers, moe)
    if not attends and moe is None:  # SSM mixers alone (MambaBlock: a norm and its mixer), no MLP
        kinds = ["none"] * num_layers
    blocks = shared_blocks_of(read, spans)
    kinds = mlp_kinds(blocks, spans, kinds)
    refuse_outside_layer_features(read, spec)
    dense_width = dense_width_of(read) if "dense" in kinds else 0
    widths = mlp_widths(read, sources, kinds, dense_width)
    model_type = read.raw("model_type")
    return ModelStructure(
        model_type=str(model_type if model_type is not MISSING else ""),
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=int(read.require("vocab_size")),
        max_positions=max(int(read.get("max_positions", 0) or 0), 0),  # -1 (no limit): not stated
        attention=attention,
        intermediate_size=dense_width,
        moe=moe,
        layers=tuple(
            Layer(
                index=i,
                attention=span,
                window=size if span in SLIDING_SPANS else None,
                mlp=kind,
                chunk=size if span == "chunked" else None,
                attention_shape=shape if span in ATTENDING_SPANS else None,
                kv_source=source,
                mlp_width=mlp_width,
                topk_source=topk_source,
            )
            for i, ((span, size), kind, shape, source, mlp_width, topk_source) in enumerate(
                zip(spans, kinds, shapes, sources, widths, topk_sources(read, spans), strict=True)
            )
        ),
        rope=rope_of(read, num_layers),
        tie_word_embeddings=bool(read.get("tie_word_embeddings", False)),
        num_mtp_layers=int(read.get("num_mtp_layers", 0) or 0),
        outside=_outside(read),
        linear=linear_of(read, spans),
        indexer=indexer_of(read, spans),
        per_layer_inputs=_per_layer_inputs(read),
        shared_blocks=blocks,
        residual_streams=residual_streams_of(read),
        compressor=compressor_of(read, spans, attention, "hca"),
        sparse_compressor=compressor_of(read, spans, attention, "csa"),
        keys=dict(read.keys),
    )
