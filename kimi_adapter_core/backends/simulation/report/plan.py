"""``kadapt plan`` rendered: the plan as a JSON document and as text tables.

The architecture, the KV cache per token and layer in each layout, the weights by group and format,
memory per device and the vision cache. Torch-free, like the planner: ``kadapt plan`` never imports
torch. Separate from ``simulation`` because a plan and a simulation share no field but the memory
figures (``blocks``).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ....vision.images import max_tokens_per_image
from ..estimate.planner import Plan, activation_formula
from .blocks import GB, MIB, memory_json, memory_text, text_table

_LAYOUT_LABELS = {"latent": "MLA latent", "expanded": "expanded", "heads": "K+V heads"}


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
        "bytes_per_sequence": kv.sequence_bytes(plan.seq_len, per_rank=False),
        "bytes_per_sequence_per_device": kv.sequence_bytes(plan.seq_len),
        "layouts_bytes_per_token_layer": kv.layouts(),
    }


def plan_json(plan: Plan) -> dict[str, Any]:
    p = plan.parallel
    return {
        "model_type": plan.arch.model_type,
        "architecture": {
            "description": plan.arch.structure.describe(),
            "structure": plan.arch.structure.to_dict(),
            "vision": asdict(plan.arch.vision) if plan.arch.vision else None,
        },
        "parallel": {"tp": p.tp, "dp": p.dp, "ep": p.ep, "devices": p.devices},
        "batch": plan.batch,
        "seq_len": plan.seq_len,
        "max_seq_len": plan.max_seq_len,
        "kv_cache": _kv_json(plan),
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
        rows.append((_LAYOUT_LABELS[layout], f"{elems} elems", f"{nbytes:>8} B{ratio}"))
    if p.tp > 1:
        if kv.layout == "latent":
            how = "latent replicated"
        else:
            heads = max(1, a.kv_dims(kv.layout)[0][0] // p.tp)
            how = f"{heads} KV head{'s' if heads > 1 else ''}/rank"
        rows.append(("per device", f"tp={p.tp}, {how}", f"{kv.rank_bytes_per_token_layer:>8} B"))
    rows.append((f"all {kv.layers} layers", "one token", f"{kv.bytes_per_token:>8} B"))
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"KV cache ({kv.dtype}, per token per layer; cached as {kv.layout})"]
    lines += [f"  {r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}" for r in rows]
    sliding = [w for w in kv.windows if w is not None]
    if sliding:
        spans = ", ".join(str(w) for w in sorted(set(sliding)))
        lines.append(f"  sliding window: {len(sliding)}/{kv.layers} layers keep only the last {spans} tokens")
    whole, device = kv.sequence_bytes(plan.seq_len, per_rank=False), kv.sequence_bytes(plan.seq_len)
    lines += [
        f"  one sequence of {plan.seq_len} tokens: {whole / GB:.3f} GB ({device / GB:.3f} GB per device)",
        f"  max sequence length  {plan.max_seq_len}",
    ]
    return lines


def plan_text(plan: Plan) -> str:
    s, p = plan.arch.structure, plan.parallel
    lines = [
        f"kadapt plan: {plan.arch.model_type}  tp={p.tp} dp={p.dp} ep={p.ep} ({p.devices} devices)  "
        f"batch={plan.batch} seq_len={plan.seq_len}  weights={plan.quant}"
        + (f"  device={plan.device.name}" if plan.device else ""),
        "",
        "Architecture",
        f"  {s.describe()}",
        f"  vocab {s.vocab_size}{' (tied embeddings)' if s.tie_word_embeddings else ''}, "
        f"max positions {s.max_positions}"
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
            w.group.shard,
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
