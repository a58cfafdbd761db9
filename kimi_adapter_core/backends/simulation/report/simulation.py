"""``kadapt simulate`` rendered: a simulated step as a JSON document and as a text table.

Every priced op (scope, module, time, bound, source), the cost model's sources, step time, tokens/s
and memory per device; with ``--images`` the image prefill's parts (encoder, projector, merged
prefill) after the step. Separate from ``plan`` (other fields) and ``trace`` (another format).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .blocks import MIB, memory_json, memory_text, text_table

if TYPE_CHECKING:  # the simulator imports torch; rendering a simulation does not
    from ..estimate.simulator import Simulation
    from ..estimate.vision import ImagePrefill


def phase(sim: Simulation) -> str:
    return "decode" if sim.deployment.decode else "prefill"


def sim_json(sim: Simulation) -> dict[str, Any]:
    d, p = sim.deployment, sim.deployment.parallel
    step = sim.step_time
    return {
        "phase": phase(sim),
        "model": sim.model,
        "device": sim.device.name,
        "quantization": sim.quant,
        "kv_dtype": d.kv_dtype,
        "parallel": {"tp": p.tp, "dp": p.dp, "ep": p.ep, "moe_tp": p.moe_tp, "devices": p.devices},
        "batch": d.batch,
        "query_len": d.tokens_per_query,
        "context_len": d.context_len,
        "mtp": d.mtp,
        "mtp_acceptance": d.mtp_acceptance,
        "routing": d.routing,
        **eager_json(d.eager_host),
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
        "memory_per_device": memory_json(sim.memory),
        **({"states": sim.states} if sim.states is not None else {}),
        "warnings": list(sim.warnings),
    }


def eager_json(host: float) -> dict[str, Any]:
    """The ``eager`` entry of a step or request price run without CUDA graphs (none when graphed)."""
    return {"eager": {"cuda_graphs": False, "host_us_per_kernel": host * 1e6}} if host else {}


def eager_text(host: float) -> list[str]:
    """The line saying a step was priced without CUDA graphs, and at what host time (none when graphed)."""
    if not host:
        return []
    return [
        f"priced eager (no CUDA graphs): every launched kernel takes at least {host * 1e6:g} us of host "
        "time (estimate/eager.py)"
    ]


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
        f"kadapt simulate: {phase(sim)} on {sim.device.name}  tp={p.tp} dp={p.dp} ep={p.ep}{p.moe_tp_label} "
        f"({p.devices} devices)  batch={d.batch} query_len={d.tokens_per_query} context_len={d.context_len}"
        f"  weights={sim.quant}  kv={d.kv_dtype}  routing={d.routing}"
        + (f"  mtp={d.mtp}@{d.mtp_acceptance:g}" if d.mtp else ""),
        f"model: {sim.model}",
        *eager_text(d.eager_host),
        "",
        text_table(["scope", "module", "op", "count", "ms", "%", "bound", "source"], table, text_columns=3),
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
        *memory_text(sim.memory),
        *_states_text(sim),
    ]
    lines += [f"WARNING: {w}" for w in sim.warnings]
    return "\n".join(lines)


def _states_text(sim: Simulation) -> list[str]:
    """A hybrid, DSA or compressed stack's state per request on one device, by kind, each saying
    whether it grows with the context (nothing for plain attention models)."""
    if sim.states is None:
        return []
    tokens = sim.deployment.context_len + sim.deployment.tokens_per_query
    kv = sim.states["attention_kv"]
    kept = f"{kv['layers']} attention layers, {tokens} tokens: {_trend(kv, 'grows')}"
    parts = [f"KV cache {_state_size(kv)} ({kept})"]
    for kind, label, layers in STATE_LINES:
        state = sim.states.get(kind)
        if state is not None:
            parts.append(
                f"{label} {_state_size(state)} ({state['layers']} {layers}, {_trend(state, 'grow')})"
            )
    return ["  state per request: " + " + ".join(parts)]


# The per-request states after the KV cache, in the order ``planner.state_kinds`` lists them
STATE_LINES = (
    ("linear_attention", "linear-attention state", "layers"),
    ("indexer_keys", "indexer keys", "indexed layers"),
    ("compressed_entries", "compressed entries", "compressed layers"),
)


def _state_size(state: dict[str, Any]) -> str:
    return f"{state['bytes_per_request_per_device'] / MIB:.2f} MiB"


def _trend(state: dict[str, Any], verb: str) -> str:
    return f"{verb} with context" if state["grows_with_context"] else "constant"


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
