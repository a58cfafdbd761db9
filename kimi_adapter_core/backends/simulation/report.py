"""Render plans and simulations as text tables, JSON documents and Chrome traces.

Kept apart from the arithmetic so that the numbers have one source: the JSON is what tests and
scripts read, the tables are the same fields for people. Warnings are printed as ``WARNING:`` lines.
Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .planner import ACTIVATION_FORMULA, Memory, Plan

if TYPE_CHECKING:  # the simulator imports torch; ``kadapt plan`` renders through here without it
    from .simulator import Simulation

GB = 1e9


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
    if mem.capacity is not None and mem.free is not None:
        out += [
            f"  capacity            {mem.capacity / GB:10.2f} GB",
            f"  free                {mem.free / GB:10.2f} GB",
        ]
    return out


# --- plan ------------------------------------------------------------------------------------------
def plan_json(plan: Plan) -> dict[str, Any]:
    p = plan.parallel
    return {
        "model_type": plan.arch.model_type,
        "architecture": asdict(plan.arch),
        "parallel": {"tp": p.tp, "dp": p.dp, "ep": p.ep, "devices": p.devices},
        "batch": plan.batch,
        "seq_len": plan.seq_len,
        "max_seq_len": plan.max_seq_len,
        "kv_cache": {
            "dtype": plan.kv.dtype,
            "latent_elems_per_token_layer": plan.kv.latent_elems,
            "latent_bytes_per_token_layer": plan.kv.latent_bytes_per_token_layer,
            "expanded_elems_per_token_layer": plan.kv.expanded_elems,
            "expanded_bytes_per_token_layer": plan.kv.expanded_bytes_per_token_layer,
            "expanded_over_latent": plan.kv.ratio,
            "latent_bytes_per_token": plan.kv.bytes_per_token,
            "layers": plan.kv.layers,
        },
        "quantization": plan.quant,
        "weights": {
            "total_params": plan.total_params,
            "total_bytes": plan.weight_bytes,
            "bytes_by_format": plan.weight_bytes_by_format(),
            "groups": [
                {
                    "name": w.group.name,
                    "params": w.group.count,
                    "format": w.format,
                    "bytes": w.total_bytes,
                    "shard": w.group.shard,
                    "params_per_device": w.params_per_device,
                    "bytes_per_device": w.bytes_per_device,
                }
                for w in plan.weights
            ],
        },
        "activation_formula": ACTIVATION_FORMULA,
        "memory_per_device": _memory_json(plan.memory),
        "vision_cache_entry_bytes": plan.vision_cache_entry_bytes,
        "device": plan.device.name if plan.device else None,
        "warnings": list(plan.warnings),
    }


def plan_text(plan: Plan) -> str:
    t, p, kv = plan.arch.text, plan.parallel, plan.kv
    lines = [
        f"kadapt plan: {plan.arch.model_type}  tp={p.tp} dp={p.dp} ep={p.ep} ({p.devices} devices)  "
        f"batch={plan.batch} seq_len={plan.seq_len}  weights={plan.quant}"
        + (f"  device={plan.device.name}" if plan.device else ""),
        "",
        "Architecture",
        f"  layers {t.num_layers} ({t.n_dense_layers} dense + {t.n_moe_layers} MoE), hidden {t.hidden}, "
        f"heads {t.num_heads}, vocab {t.vocab}, max positions {t.max_positions}",
        f"  MLA q_lora {t.q_lora_rank} kv_lora {t.kv_lora_rank} qk_nope {t.qk_nope_head_dim} "
        f"qk_rope {t.qk_rope_head_dim} v_head {t.v_head_dim}",
        f"  MoE {t.n_routed_experts} routed (top-{t.top_k}) + {t.n_shared_experts} shared, "
        f"expert width {t.moe_intermediate}, dense width {t.intermediate}",
    ]
    if plan.arch.vision:
        v = plan.arch.vision
        lines.append(
            f"  vision {v.num_layers} layers, hidden {v.hidden}, heads {v.num_heads}, patch {v.patch_size}, "
            f"pos grid {v.pos_emb_height}x{v.pos_emb_width}, merge {v.merge_h}x{v.merge_w}"
        )
    lines += [
        "",
        f"KV cache ({kv.dtype}, per token per layer)",
        f"  MLA latent    ({t.kv_lora_rank}+{t.qk_rope_head_dim}) elems   "
        f"{kv.latent_bytes_per_token_layer:>8} B",
        f"  expanded      {t.num_heads}x({t.qk_head_dim}+{t.v_head_dim}) elems  "
        f"{kv.expanded_bytes_per_token_layer:>8} B   ({kv.ratio:.1f}x latent)",
        f"  all {kv.layers} layers (latent)         {kv.bytes_per_token:>8} B/token",
        f"  max sequence length  {plan.max_seq_len}",
        "",
        "Weights",
    ]
    rows = [
        [
            w.group.name,
            f"{w.group.count / 1e9:.3f}",
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
    lines += [
        "",
        "Memory per device (KV for batch x seq_len, activations for one prefill chunk)",
        *_memory_text(plan.memory),
        f"  activation formula: {ACTIVATION_FORMULA}",
    ]
    if plan.vision_cache_entry_bytes is not None:
        lines.append(
            f"\nVision cache entry  {plan.vision_cache_entry_bytes} B "
            f"({plan.vision_cache_entry_bytes / 2**20:.1f} MiB) per image"
        )
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
        "device": sim.device.name,
        "quantization": sim.quant,
        "parallel": {"tp": p.tp, "dp": p.dp, "ep": p.ep, "devices": p.devices},
        "batch": d.batch,
        "query_len": d.tokens_per_query,
        "context_len": d.context_len,
        "mtp": d.mtp,
        "mtp_acceptance": d.mtp_acceptance,
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
        ]
        for r in shown
    ]
    lines = [
        f"kadapt simulate: {_phase(sim)} on {sim.device.name}  tp={p.tp} dp={p.dp} ep={p.ep} "
        f"({p.devices} devices)  batch={d.batch} query_len={d.tokens_per_query} context_len={d.context_len}"
        f"  weights={sim.quant}" + (f"  mtp={d.mtp}@{d.mtp_acceptance:g}" if d.mtp else ""),
        "",
        _table(["scope", "module", "op", "count", "ms", "%", "bound"], table, text_columns=3),
    ]
    if top and len(rows) > top:
        rest = sum(r.time for r in rows[top:])
        lines.append(f"... {len(rows) - top} more rows, {rest * 1e3:.3f} ms ({100 * rest / step:.1f}%)")
    lines += [
        "",
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
