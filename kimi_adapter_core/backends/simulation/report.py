"""Render plans and simulations as text tables, JSON documents and Chrome traces.

Kept apart from the arithmetic so that the numbers have one source: the JSON is what tests and
scripts read, the tables are the same fields for people. Warnings are printed as ``WARNING:`` lines.
Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .planner import Memory, Plan, activation_formula
from .vision_images import max_tokens_per_image

if TYPE_CHECKING:  # the simulator imports torch; ``kadapt plan`` renders through here without it
    from .simulator import Simulation
    from .vision import ImagePrefill

GB = 1e9
MIB = 2**20


def _table(headers: list[str], rows: list[list[str]], text_columns: int = 1) -> str:
    """Left-align the first ``text_columns`` columns, right-align the (numeric) rest."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))

    def cell(i: int, text: str) -> str:
        return text.ljust(widths[i]) if i < text_columns else text.rjust(widths[i])

    body = ["  ".join(cell(i, text) for i, text in enumerate(r)) for r in rows]
    return "\n".join([line, "  ".join("-" * w for w in widths), *body])


def _memory_json(mem: Memory) -> dict[str, Any]:
    return {
        "weights_bytes": mem.weights,
        "kv_cache_bytes": mem.kv_cache,
        "activation_bytes": mem.activations,
        "vision_cache_bytes": mem.vision_cache,
        "used_bytes": mem.used,
        "capacity_bytes": mem.capacity,
        "free_bytes": mem.free,
    }


def _memory_text(mem: Memory) -> list[str]:
    out = [
        f"  weights/device      {mem.weights / GB:10.2f} GB",
        f"  KV cache/device     {mem.kv_cache / GB:10.2f} GB",
        f"  activations/device  {mem.activations / GB:10.2f} GB",
    ]
    if mem.vision_cache:
        out.append(f"  vision cache/device {mem.vision_cache / GB:10.2f} GB")
    if mem.capacity is not None and mem.free is not None:
        out += [
            f"  capacity            {mem.capacity / GB:10.2f} GB",
            f"  free                {mem.free / GB:10.2f} GB",
        ]
    return out


# --- plan ------------------------------------------------------------------------------------------
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
        "memory_per_device": _memory_json(plan.memory),
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
    lines.append(_table(["group", "params (B)", "format", "GB", "shard", "GB/device"], rows))
    lines.append(f"active per token    {plan.active_params / 1e9:.3f} B parameters")
    lines += [
        "",
        "Memory per device (KV for batch x seq_len, activations for one prefill chunk)",
        *_memory_text(plan.memory),
        f"  activation formula: {activation_formula(plan.arch.structure)}",
    ]
    vision = _vision_cache_text(plan)
    if vision:
        lines += ["", *vision]
    lines += [f"WARNING: {w}" for w in plan.warnings]
    return "\n".join(lines)


# --- simulate --------------------------------------------------------------------------------------
def _phase(sim: Simulation) -> str:
    return "decode" if sim.deployment.decode else "prefill"


def sim_json(sim: Simulation) -> dict[str, Any]:
    d, p = sim.deployment, sim.deployment.parallel
    step = sim.step_time
    return {
        "phase": _phase(sim),
        "model": sim.model,
        "device": sim.device.name,
        "quantization": sim.quant,
        "parallel": {"tp": p.tp, "dp": p.dp, "ep": p.ep, "devices": p.devices},
        "batch": d.batch,
        "query_len": d.tokens_per_query,
        "context_len": d.context_len,
        "mtp": d.mtp,
        "mtp_acceptance": d.mtp_acceptance,
        "routing": d.routing,
        "cost_model": {
            "name": sim.cost_model,
            "sources": {
                source: {"kernels": count, "time_s": time, "percent": 100 * time / step}
                for source, (count, time) in sim.sources().items()
            },
        },
        "step_time_s": step,
        "output_tokens_per_step": d.output_tokens,
        "tokens_per_s": d.output_tokens / step,
        "tokens_per_s_per_device": sim.tokens_per_s_per_device,
        "ops": [
            {
                "scope": r.scope,
                "module": r.module,
                "op": r.name,
                "count": r.count,
                "time_s": r.time,
                "percent": 100 * r.time / step,
                "bound": r.bound,
                "flops": r.flops,
                "bytes": r.bytes,
                "source": r.source,
            }
            for r in sim.rows()
        ],
        "memory_per_device": _memory_json(sim.memory),
        "warnings": list(sim.warnings),
    }


def sim_text(sim: Simulation, top: int | None = None) -> str:
    d, p = sim.deployment, sim.deployment.parallel
    step = sim.step_time
    rows = sim.rows()
    shown = rows[:top] if top else rows
    table = [
        [
            r.scope,
            r.module or "-",
            r.name,
            str(r.count),
            f"{r.time * 1e3:.3f}",
            f"{100 * r.time / step:.1f}",
            r.bound,
            r.source,
        ]
        for r in shown
    ]
    lines = [
        f"kadapt simulate: {_phase(sim)} on {sim.device.name}  tp={p.tp} dp={p.dp} ep={p.ep} "
        f"({p.devices} devices)  batch={d.batch} query_len={d.tokens_per_query} context_len={d.context_len}"
        f"  weights={sim.quant}  routing={d.routing}"
        + (f"  mtp={d.mtp}@{d.mtp_acceptance:g}" if d.mtp else ""),
        f"model: {sim.model}",
        "",
        _table(["scope", "module", "op", "count", "ms", "%", "bound", "source"], table, text_columns=3),
    ]
    if top and len(rows) > top:
        rest = sum(r.time for r in rows[top:])
        lines.append(f"... {len(rows) - top} more rows, {rest * 1e3:.3f} ms ({100 * rest / step:.1f}%)")
    sources = ", ".join(
        f"{source} {count} kernels {100 * time / step:.1f}%"
        for source, (count, time) in sim.sources().items()
    )
    lines += [
        "",
        f"cost model           {sim.cost_model}: {sources}",
        f"step time            {step * 1e3:10.3f} ms",
        f"tokens per step      {d.output_tokens:10.1f}",
        f"tokens/s (total)     {d.output_tokens / step:10.1f}",
        f"tokens/s per device  {sim.tokens_per_s_per_device:10.1f}",
        "",
        "Memory per device",
        *_memory_text(sim.memory),
    ]
    lines += [f"WARNING: {w}" for w in sim.warnings]
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _image_parts(prefill: ImagePrefill) -> dict[str, float]:
    return {
        "encoder": prefill.seconds("encoder"),
        "projector": prefill.seconds("projector"),
        "merged_prefill": prefill.merged_prefill_s,
        "feature_merge": prefill.seconds("merge"),
        "text_prefill": prefill.seconds("text"),
        "total": prefill.total_s,
    }


def image_prefill_json(prefill: ImagePrefill) -> dict[str, Any]:
    """``sim_json`` of the whole step (vision kernels + merged prefill) plus ``image_prefill``."""
    im, dep = prefill.images, prefill.simulation.deployment
    return {
        **sim_json(prefill.simulation),
        "image_prefill": {
            **im.to_dict(),
            "text_tokens_per_query": prefill.text_tokens,
            "images": im.images(dep.batch),
            "images_per_rank": prefill.images_per_rank,
            "vision_layers": prefill.vision_layers,
            "time_s": _image_parts(prefill),
            "flops_per_rank": {part: prefill.flops(part) for part in ("encoder", "projector", "text")},
        },
    }


def image_prefill_text(prefill: ImagePrefill, top: int | None = None) -> str:
    """``sim_text`` of the whole step, then the image prefill's parts."""
    im, dep = prefill.images, prefill.simulation.deployment
    v, parts = im.vision, _image_parts(prefill)
    rows, cols = im.grid
    total = parts["total"]

    def line(label: str, seconds: float, detail: str) -> str:
        return f"  {label:<16} {seconds * 1e3:10.3f} ms {100 * seconds / total:5.1f}%  {detail}"

    return "\n".join(
        [
            sim_text(prefill.simulation, top),
            "",
            f"Image prefill: {im.per_query} image{'s' if im.per_query > 1 else ''} of {im.label} per query "
            f"({rows}x{cols} patches of {v.patch_size} px, merge {v.merge_h}x{v.merge_w} -> "
            f"{im.tokens_per_image} tokens each); {_count(im.images(dep.batch), 'image')} in the step, "
            f"{prefill.images_per_rank} encoded per rank (a DP group's images spread over its "
            f"{dep.parallel.tp} TP ranks)",
            line(
                "vision encoder",
                parts["encoder"],
                f"{prefill.vision_layers} layers, attention within each image",
            ),
            line("projector", parts["projector"], f"merge {v.merge_h}x{v.merge_w} -> {v.text_hidden} wide"),
            line(
                "merged prefill",
                parts["merged_prefill"],
                f"features into the prompt {parts['feature_merge'] * 1e3:.3f} ms + text prefill of "
                f"{prefill.text_tokens} text + {im.tokens_per_query} image tokens per query",
            ),
            f"  {'total':<16} {total * 1e3:10.3f} ms",
        ]
    )


def chrome_trace(sim: Simulation) -> dict[str, Any]:
    """One step laid out layer by layer: compute kernels on thread 0, collectives on thread 1."""
    events: list[dict[str, Any]] = []
    clock = 0.0
    kernels = list(sim.kernels)
    index = 0
    while index < len(kernels):  # consecutive kernels of one scope form a block repeated per layer
        scope, repeat = kernels[index].op.scope, kernels[index].op.repeat
        end = index
        while end < len(kernels) and (kernels[end].op.scope, kernels[end].op.repeat) == (scope, repeat):
            end += 1
        for layer in range(repeat):
            for k in kernels[index:end]:
                events.append(
                    {
                        "name": k.op.name,
                        "cat": k.op.kind,
                        "ph": "X",
                        "pid": 0,
                        "tid": 1 if k.op.kind == "comm" else 0,
                        "ts": clock * 1e6,
                        "dur": k.time * 1e6,
                        "args": {
                            "scope": scope,
                            "layer": layer,
                            "module": k.op.module,
                            "bound": k.bound,
                            "flops": k.op.flops,
                            "bytes": k.op.bytes,
                            "shapes": k.op.shapes,
                        },
                    }
                )
                clock += k.time
        index = end
    meta = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "compute"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "collectives"}},
    ]
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {"phase": _phase(sim), "device": sim.device.name, "step_time_s": sim.step_time},
    }
