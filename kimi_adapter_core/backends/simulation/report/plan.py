"""``kadapt plan`` rendered: the plan as a JSON document and as text tables.

The architecture, the KV cache per token and layer in each layout (and a hybrid stack's
linear-attention state per request, a DSA stack's indexer keys per token), the weights by group and
format, memory per device and the vision cache. Torch-free, like the planner: ``kadapt plan`` never
imports torch. Separate from ``simulation`` because a plan and a simulation share no field but the memory
figures (``blocks``).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ....errors import KadaptError
from ....structure.states import ConvState
from ....vision.images import max_tokens_per_image
from ..estimate.compressed_sizing import CompressedSizing
from ..estimate.planner import KvSizing, Plan, activation_formula
from ..estimate.state_sizing import STATE_CONV_DTYPE, IndexKeySizing, LinearStateSizing
from ..model.arch import indexed_layer_ids
from ..model.mixer_params import PRICED_MIXERS
from ..model.quant import DTYPE_BYTES, INDEX_KEY_DTYPE, INDEX_REFERENCE_DTYPE, INDEX_SCALE_BLOCK
from .blocks import GB, MIB, memory_json, memory_text, text_table

_SHORT_DTYPES = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_LAYOUT_LABELS = {"latent": "MLA latent", "expanded": "expanded", "heads": "K+V heads"}


def _chunks_json(chunks: tuple[int | None, ...]) -> dict[str, Any]:
    """The chunked layers (Llama-4) and their chunks; nothing for a stack without them."""
    chunked = [c for c in chunks if c is not None]
    return {"chunked_layers": len(chunked), "chunks": sorted(set(chunked))} if chunked else {}


def _kv_json(plan: Plan) -> dict[str, Any]:
    kv = plan.kv
    return {
        "dtype": kv.dtype,
        "layout": kv.layout,
        "elems_per_token_layer": kv.elems_per_token_layer,
        "bytes_per_token_layer": kv.bytes_per_token_layer,
        "bytes_per_token_layer_per_device": kv.rank_bytes_per_token_layer,
        "bytes_per_token": kv.bytes_per_token,
        "layers": kv.layers,
        "sliding_layers": sum(1 for w in kv.windows if w is not None),
        "windows": sorted({w for w in kv.windows if w is not None}),
        **_chunks_json(kv.chunks),
        "bytes_per_sequence": kv.kv_bytes(plan.seq_len, per_rank=False),
        "bytes_per_sequence_per_device": kv.kv_bytes(plan.seq_len),
        "layouts_bytes_per_token_layer": kv.layouts(),
        # the layers cache different KV shapes: each attention layer's bytes per token (else the key is
        # absent and the per-layer figures above are every layer's)
        **({"layer_bytes_per_token": list(kv.layer_bytes_per_token())} if kv.layer_attentions else {}),
        # a key that is also the value (DeepSeek-V4): what a runtime storing it once needs
        **({"bytes_per_token_value_is_key": _value_is_key_bytes(kv)} if _value_is_key(kv) else {}),
    }


def _value_is_key(kv: Any) -> bool:
    form = kv.attention.form
    return form is not None and form.value_is_key and kv.layout == "heads"


def _value_is_key_bytes(kv: Any) -> int:
    """Bytes per token of every attention layer with its shared key/value head cached once: the key."""
    (_, key), (_, value) = kv.attention.kv_dims(kv.layout)
    return kv.bytes_per_token * key // (key + value)


def _states_json(plan: Plan) -> dict[str, Any]:
    """Each state kind a hybrid or DSA stack keeps (added to the JSON only for those stacks, so the
    plan of a plain attention model is what it always was): the attention layers' KV cache and a DSA
    stack's indexer keys grow with the context, the linear layers' state is constant per request."""
    kv, state, index = plan.kv, plan.kv.state, plan.kv.index
    s = plan.arch.structure
    states: dict[str, Any] = {
        "attention_kv": {
            "layers": kv.layers,
            "layer_ids": list(s.attention_layer_ids),
            "grows_with_context": True,
            "bytes_per_token": kv.bytes_per_token,
            "bytes_per_sequence": kv.kv_bytes(plan.seq_len, per_rank=False),
            "bytes_per_sequence_per_device": kv.kv_bytes(plan.seq_len),
        }
    }
    if state is not None:
        states["linear_attention"] = {
            "layers": state.layers,
            "layer_ids": list(s.linear_layer_ids),
            "mixer": state.linear.kind,
            "grows_with_context": False,
            **{name: _state_tensor(state, name) for name in state.linear.state_names},
            "bytes_per_layer": state.bytes_per_layer(per_rank=False),
            "bytes_per_request": state.bytes_per_request(per_rank=False),
            "bytes_per_request_per_device": state.bytes_per_request(),
        }
    if index is not None:
        states["indexer_keys"] = _index_json(plan, index)
    if kv.compressed is not None:
        states["compressed_entries"] = _compressed_json(plan, kv.compressed)
    states["bytes_per_sequence"] = kv.sequence_bytes(plan.seq_len, per_rank=False)
    states["bytes_per_sequence_per_device"] = kv.sequence_bytes(plan.seq_len)
    return states


def _index_json(plan: Plan, index: IndexKeySizing) -> dict[str, Any]:
    """A DSA stack's indexer keys: one FP8 key (and its fp32 block scale) per token and indexed layer,
    replicated on every TP rank."""
    ix = index.indexer
    return {
        "layers": index.layers,
        "layer_ids": list(indexed_layer_ids(plan.arch.structure)),
        "grows_with_context": True,
        "indexer": {"n_heads": ix.n_heads, "head_dim": ix.head_dim, "topk": ix.topk},
        "shape_per_token": [ix.head_dim],
        "dtype": INDEX_KEY_DTYPE,
        "scale": {"dtype": "fp32", "block": INDEX_SCALE_BLOCK},
        "bytes_per_token_layer": index.bytes_per_token_layer,
        "bytes_per_token_layer_per_device": index.bytes_per_token_layer,
        "reference_dtype": INDEX_REFERENCE_DTYPE,
        "reference_bytes_per_token_layer": index.reference_bytes_per_token_layer,
        "bytes_per_token": index.bytes_per_token,
        "bytes_per_sequence": index.bytes(plan.seq_len),
        "bytes_per_sequence_per_device": index.bytes(plan.seq_len),
    }


def _compressed_json(plan: Plan, compressed: CompressedSizing) -> dict[str, Any]:
    """A compressed stack's compressor states: per kind ``floor(T / rate)`` entries of ``head_dim`` per
    layer (a csa layer's indexer keys beside them: both grow with the context) and a ring of the open
    windows (constant), replicated on every TP rank."""
    kinds = {}
    for k in compressed.kinds:
        c = k.compressor
        index = c.indexer
        kinds[k.kind] = {
            "layers": len(k.layer_ids),
            "layer_ids": list(k.layer_ids),
            "rate": c.rate,
            "entry_shape": [c.head_dim],
            "ring_shape": [c.overlap * c.rate, 2 * c.overlap * c.head_dim],
            "entries_per_sequence": plan.seq_len // c.rate,
            **(
                {
                    "indexer": {"n_heads": index.n_heads, "head_dim": index.head_dim, "topk": index.topk},
                    "index_entry_shape": [index.head_dim],
                    "index_ring_shape": [c.overlap * c.rate, 2 * c.overlap * index.head_dim],
                }
                if index is not None
                else {}
            ),
        }
    return {
        "layers": compressed.layers,
        "layer_ids": sorted(i for k in compressed.kinds for i in k.layer_ids),
        "grows_with_context": True,
        "kinds": kinds,
        "ring_bytes_per_request": compressed.ring_bytes(),
        "bytes_per_sequence": compressed.bytes(plan.seq_len),
        "bytes_per_sequence_per_device": compressed.bytes(plan.seq_len),
    }


def _state_tensor(state: LinearStateSizing, which: str) -> dict[str, Any]:
    whole, rank = (
        (state.conv(per_rank=False), state.conv())
        if which == "conv"
        else (state.recurrent(per_rank=False), state.recurrent())
    )
    assert whole is not None and rank is not None, f"a {state.linear.kind} layer keeps no {which} state"
    model_dtype = DTYPE_BYTES[STATE_CONV_DTYPE]  # the conv window's; the recurrent state has its own
    # (or the model's: lightning attention keeps it in its values' dtype, RecurrentState.dtype None)
    own = isinstance(whole, ConvState) or whole.dtype is None
    dtype = STATE_CONV_DTYPE if own else _SHORT_DTYPES[whole.dtype]
    return {
        "shape": list(whole.shape()),
        "shape_per_device": list(rank.shape()),
        "dtype": dtype,
        "bytes_per_layer": whole.bytes_per_request(model_dtype),
        "bytes_per_layer_per_device": rank.bytes_per_request(model_dtype),
    }


def _has_states(plan: Plan) -> bool:
    """Whether the model keeps state besides its KV cache (linear-attention state, DSA indexer keys)."""
    return plan.kv.state is not None or plan.kv.index is not None or plan.kv.compressed is not None


def check_priced(plan: Plan) -> None:
    """Refuse a stack whose linear layers the weight table cannot price (a mixer kind the structure
    knows and ``model/params.py`` has no tensor list for), rather than print weights of another
    mixer's tensors."""
    linear = plan.arch.structure.linear
    if linear is not None and linear.kind not in PRICED_MIXERS:
        raise KadaptError(
            f"plan: {plan.arch.model_type}'s {len(plan.arch.structure.linear_layer_ids)} linear layers are "
            f"{linear.kind} mixers ({linear.describe()}); the plan prices the weights of "
            f"{', '.join(PRICED_MIXERS)} linear layers only and cannot price {linear.kind} weights yet"
        )


def plan_json(plan: Plan) -> dict[str, Any]:
    check_priced(plan)
    p = plan.parallel
    return {
        "model_type": plan.arch.model_type,
        "architecture": {
            "description": plan.arch.structure.describe(),
            "structure": plan.arch.structure.to_dict(),
            "vision": asdict(plan.arch.vision) if plan.arch.vision else None,
        },
        "parallel": {"tp": p.tp, "dp": p.dp, "ep": p.ep, "moe_tp": p.moe_tp, "devices": p.devices},
        "batch": plan.batch,
        "seq_len": plan.seq_len,
        "max_seq_len": plan.max_seq_len,
        "kv_cache": _kv_json(plan),
        **({"states": _states_json(plan)} if _has_states(plan) else {}),
        "quantization": plan.quant,
        "weights": {
            "total_params": plan.total_params,
            "active_params": plan.active_params,
            "total_bytes": plan.weight_bytes,
            "bytes_by_format": plan.weight_bytes_by_format(),
            "groups": [
                {
                    "name": w.name,
                    "group": w.group.name,
                    "checkpoint_name": w.group.checkpoint_name,
                    "params": w.params,
                    "format": w.format,
                    "bytes": w.total_bytes,
                    "shard": w.group.shard,
                    "params_per_device": w.params_per_device,
                    "bytes_per_device": w.bytes_per_device,
                }
                for w in plan.weights
            ],
        },
        "activation_formula": activation_formula(plan.arch.structure),
        "memory_per_device": memory_json(plan.memory),
        "vision_cache_entry_bytes": plan.vision_cache_entry_bytes,
        "vision_cache": _vision_cache_json(plan),
        "device": plan.device.name if plan.device else None,
        "warnings": list(plan.warnings),
    }


def _vision_cache_json(plan: Plan) -> dict[str, Any] | None:
    """Per image (MAX's entry for the largest image, and the features of ``--image-size``) and for the
    batch (``--batch`` sequences x ``--images``; per device: one DP group's sequences)."""
    v, entry = plan.arch.vision, plan.vision_cache_entry_bytes
    if v is None or entry is None:
        return None
    out: dict[str, Any] = {
        "entry_bytes": entry,
        "max_tokens_per_image": max_tokens_per_image(v),
        "feature_bytes_per_token": v.text_hidden * 2,
        "images": None,
    }
    im = plan.images
    if im is not None:
        images, per_device = im.images(plan.batch), im.images(plan.batch // plan.parallel.dp)
        out["images"] = {
            **im.to_dict(),
            "sequences": plan.batch,
            "images": images,
            "batch_bytes": images * im.feature_bytes_per_image,
            "batch_entry_bytes": images * entry,
            "images_per_device": per_device,
            "batch_bytes_per_device": per_device * im.feature_bytes_per_image,
        }
    return out


def _vision_cache_text(plan: Plan) -> list[str]:
    v, entry = plan.arch.vision, plan.vision_cache_entry_bytes
    if v is None or entry is None:
        return []

    def row(label: str, nbytes: float, detail: str) -> str:
        return f"  {label:<20} {nbytes / MIB:8.1f} MiB   {detail}"

    lines = [
        f"Vision cache (bf16 image features, {v.text_hidden} wide per token)",
        row(
            "entry per image",
            entry,
            f"MAX's estimate: up to {max_tokens_per_image(v)} tokens ({v.pos_emb_height}x{v.pos_emb_width} "
            f"position grid / merge {v.merge_h}x{v.merge_w}); {entry} B",
        ),
    ]
    im = plan.images
    if im is not None:
        rows, cols = im.grid
        images, dp = im.images(plan.batch), plan.parallel.dp
        per_device = im.images(plan.batch // dp)
        lines += [
            row(
                f"one {im.label} image",
                im.feature_bytes_per_image,
                f"{rows}x{cols} patches of {v.patch_size} px -> {im.tokens_per_image} tokens",
            ),
            row(
                "batch",
                images * im.feature_bytes_per_image,
                f"{images} images ({plan.batch} sequences x {im.per_query}); "
                f"{images * entry / MIB:.1f} MiB in MAX-sized entries",
            ),
            row(
                "per device",
                per_device * im.feature_bytes_per_image,
                f"{per_device} images (one DP group's sequences, dp={dp})",
            ),
        ]
    return lines


def _kv_text(plan: Plan) -> list[str]:
    kv, a, p = plan.kv, plan.kv.attention, plan.parallel
    layouts = kv.layouts()
    rows: list[tuple[str, str, str]] = []
    for layout, nbytes in layouts.items():
        (kh, kd), (vh, vd) = a.kv_dims(layout)
        elems = (
            f"({kd}+{vd})" if kh == vh == 1 else f"{kh}x({kd}+{vd})" if kh == vh else f"{kh}x{kd}+{vh}x{vd}"
        )
        ratio = "" if layout == kv.layout else f"   ({nbytes / layouts[kv.layout]:.1f}x {kv.layout})"
        if layout == kv.layout and kv.sparse_fp8:  # FlashMLA's sparse FP8 layout (KvSizing.sparse_fp8)
            ratio = f"   ({kd} fp8 + an fp32 scale per 128 + {vd} bf16 rope, as sparse MLA runtimes keep it)"
        rows.append((_LAYOUT_LABELS[layout], f"{elems} elems", f"{nbytes:>8} B{ratio}"))
    if p.tp > 1:
        if kv.layout == "latent":
            how = "latent replicated"
        else:
            heads = max(1, a.kv_dims(kv.layout)[0][0] // p.tp)
            how = f"{heads} KV head{'s' if heads > 1 else ''}/rank"
        rows.append(("per device", f"tp={p.tp}, {how}", f"{kv.rank_bytes_per_token_layer:>8} B"))
    attention = " attention" if kv.state is not None else ""
    rows.append((f"all {kv.layers}{attention} layers", "one token", f"{kv.bytes_per_token:>8} B"))
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    scope = f"{kv.layers} attention layers, grows with context; " if kv.state is not None else ""
    lines = [f"KV cache ({scope}{kv.dtype}, per token per layer; cached as {kv.layout})"]
    lines += [f"  {r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}" for r in rows]
    if _value_is_key(kv):
        lines.append(
            "  shared key/value head: the ABI caches its key and value (the same values); a runtime "
            f"storing it once needs {_value_is_key_bytes(kv)} B per token"
        )
    lines += _shapes_text(kv)
    sliding = [w for w in kv.windows if w is not None]
    if sliding:
        spans = ", ".join(str(w) for w in sorted(set(sliding)))
        lines.append(f"  sliding window: {len(sliding)}/{kv.layers} layers keep only the last {spans} tokens")
    chunked = [c for c in kv.chunks if c is not None]
    if chunked:
        spans = ", ".join(str(c) for c in sorted(set(chunked)))
        lines.append(
            f"  chunked attention: {len(chunked)}/{kv.layers} layers keep at most the last {spans} tokens "
            "(a query sees its own chunk: p % chunk + 1 keys)"
        )
    whole, device = kv.sequence_bytes(plan.seq_len, per_rank=False), kv.sequence_bytes(plan.seq_len)
    if kv.state is not None:
        lines += _state_text(plan)
    if kv.index is not None:
        lines += _index_text(plan, kv.index)
    if kv.compressed is not None:
        lines.append(
            f"  compressed entries: {kv.compressed.describe(plan.seq_len)} = "
            f"{kv.compressed.bytes(plan.seq_len) / MIB:.2f} MiB per request, grows "
            f"{' and '.join(f'1/{k.compressor.rate} ({k.kind})' for k in kv.compressed.kinds)} as fast as "
            "a KV cache (replicated over "
            f"tp={plan.parallel.tp}, one shared head)"
        )
    what = f"{plan.seq_len} tokens" + (" (KV + linear-attention state)" if kv.state is not None else "")
    what += " (KV + indexer keys)" if kv.index is not None else ""
    what += " (KV + compressed entries)" if kv.compressed is not None else ""
    lines += [
        f"  one sequence of {what}: {whole / GB:.3f} GB ({device / GB:.3f} GB per device)",
        f"  max sequence length  {plan.max_seq_len}",
    ]
    return lines


def _shapes_text(kv: KvSizing) -> list[str]:
    """The layers whose KV shape is not the stack's (the rows above size the stack's): how many, their
    attention and their bytes per token (nothing when every layer caches one shape)."""
    sized = zip(kv.attentions, kv.layer_bytes_per_token(), strict=True)
    others = [(a, nbytes) for a, nbytes in sized if a != kv.attention]
    return [
        f"  per-layer shape: {sum(1 for a, _ in others if a == shape)}/{kv.layers} layers cache "
        f"{shape.describe()}, {nbytes} B per token per layer"
        for shape, nbytes in dict(others).items()
    ]


def _state_text(plan: Plan) -> list[str]:
    """The linear layers' state: its tensors per layer (a conv window, a recurrent state or both), and the
    constant total per request."""
    state = plan.kv.state
    assert state is not None

    def tensor(label: str, t: dict[str, Any]) -> str:
        shape = "x".join(map(str, t["shape"]))
        return f"    {label:<10} [{shape}] {t['dtype']}  {t['bytes_per_layer']:>10} B per layer"

    per_layer = state.bytes_per_layer(per_rank=False) / MIB
    return [
        f"  linear-attention state: {state.layers} layers x {per_layer:.2f} MiB per request, constant in "
        f"context ({state.linear.describe()})",
        *(tensor(name, _state_tensor(state, name)) for name in state.linear.state_names),
        f"    per request {state.bytes_per_request(per_rank=False) / MIB:.1f} MiB "
        f"({state.bytes_per_request() / MIB:.2f} MiB per device, heads split over tp={plan.parallel.tp})",
    ]


def _index_text(plan: Plan, index: IndexKeySizing) -> list[str]:
    """The DSA indexer keys: per token and layer, their dtype, and the whole model."""
    ix = index.indexer
    return [
        f"  indexer keys: {index.layers} indexed layers x {index.bytes_per_token_layer} B per token, "
        f"grows with context ({ix.describe()})",
        f"    key        [{ix.head_dim}] {INDEX_KEY_DTYPE} e4m3 + fp32 scale per {INDEX_SCALE_BLOCK}  "
        f"{index.bytes_per_token_layer:>6} B per layer   ({index.reference_bytes_per_token_layer} B in "
        f"transformers' {INDEX_REFERENCE_DTYPE} reference)",
        f"    all {index.layers} indexed layers, one token {index.bytes_per_token} B "
        f"(replicated over tp={plan.parallel.tp}, as the indexer is)",
    ]


def plan_text(plan: Plan) -> str:
    check_priced(plan)
    s, p = plan.arch.structure, plan.parallel
    lines = [
        f"kadapt plan: {plan.arch.model_type}  tp={p.tp} dp={p.dp} ep={p.ep}{p.moe_tp_label} "
        f"({p.devices} devices)  "
        f"batch={plan.batch} seq_len={plan.seq_len}  weights={plan.quant}"
        + (f"  device={plan.device.name}" if plan.device else ""),
        "",
        "Architecture",
        f"  {s.describe()}",
        f"  vocab {s.vocab_size}{' (tied embeddings)' if s.tie_word_embeddings else ''}"
        + (f", max positions {s.max_positions}" if s.max_positions else ", no position limit stated")
        + (f", MTP layers {s.num_mtp_layers} (not counted)" if s.num_mtp_layers else ""),
    ]
    if plan.arch.vision:
        v = plan.arch.vision
        lines.append(
            f"  vision {v.num_layers} layers, hidden {v.hidden}, heads {v.num_heads}, patch {v.patch_size}, "
            f"pos grid {v.pos_emb_height}x{v.pos_emb_width}, merge {v.merge_h}x{v.merge_w}"
        )
    lines += ["", *_kv_text(plan), "", "Weights"]
    rows = [
        [
            w.name,
            f"{w.params / 1e9:.3f}",
            w.format,
            f"{w.total_bytes / GB:.2f}",
            "ep x moe_tp" if w.group.shard == "ep" and p.moe_tp > 1 else w.group.shard,
            f"{w.bytes_per_device / GB:.3f}",
        ]
        for w in plan.weights
    ]
    rows.append(
        [
            "total",
            f"{plan.total_params / 1e9:.3f}",
            "",
            f"{plan.weight_bytes / GB:.2f}",
            "",
            f"{plan.memory.weights / GB:.3f}",
        ]
    )
    lines.append(text_table(["group", "params (B)", "format", "GB", "shard", "GB/device"], rows))
    lines.append(f"active per token    {plan.active_params / 1e9:.3f} B parameters")
    lines += [
        "",
        "Memory per device (KV for batch x seq_len, activations for one prefill chunk)",
        *memory_text(plan.memory),
        f"  activation formula: {activation_formula(plan.arch.structure)}",
    ]
    vision = _vision_cache_text(plan)
    if vision:
        lines += ["", *vision]
    lines += [f"WARNING: {w}" for w in plan.warnings]
    return "\n".join(lines)
