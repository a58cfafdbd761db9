"""AIConfigurator's own estimate of one step, the reference kadapt's estimates are compared with.

``reference_step`` builds AIConfigurator's graph for one of its models and layouts (its TP/EP graph,
or with ``comm_backends`` its large-EP one) and returns its total and every op, each op sorted into a
component (``aic_component``); ``kadapt_component`` sorts kadapt's kernels the same way. Used by the
benchmark and the accuracy tests only. Separate from ``measured`` (the ``--cost-model measured`` back
end) because this prices AIConfigurator's model of the step, not kadapt's ops; both reach the package
through ``aiconfigurator``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..model.tracer import Op
from .aiconfigurator import _database, _gpus_per_node, require

COMPONENTS = ("attention", "experts", "communication", "other")


def aic_component(name: str) -> str:
    """Component of one AIConfigurator op, by its name."""
    comm = ("dispatch", "combine", "_ar", "allreduce", "all_reduce", "p2p", "all_gather", "a2a")
    if any(key in name for key in comm):
        return "communication"
    if name.endswith("_moe") and "shared" not in name:
        return "experts"
    if "ffn" in name or "shared" in name or "router" in name or "logits" in name or "act_gate" in name:
        return "other"
    if any(
        key in name
        for key in ("mla", "attention", "qkv", "proj_gemm", "downscale", "bmm", "q_b_proj", "kv_b")
    ):
        return "attention"
    return "other"


def kadapt_component(op: Op) -> str:
    """Component of one kadapt kernel, on the same split as ``aic_component``."""
    if op.kind == "comm":
        return "communication"
    if op.kind == "experts":
        return "experts"
    return "attention" if op.kind == "attention" or ".self_attn" in op.module else "other"


@dataclass(frozen=True)
class Reference:
    """AIConfigurator's estimate of one step: the total (ms) and ms per component."""

    total_ms: float
    components: dict[str, float]
    ops: tuple[tuple[str, float, str], ...]  # (op, ms, AIConfigurator's source tier)
    label: str = ""


def _leaves(op: dict[str, Any]) -> list[dict[str, Any]]:
    ((kind, body),) = op.items()
    if kind == "Fallback":
        return [x for f in body["fallback"] for x in _leaves(f)]
    if kind == "Overlap":
        return [x for f in body["group_a"] + body["group_b"] for x in _leaves(f)]
    return [op]


def reference_step(
    model: str,
    system: str,
    framework: str,
    *,
    tp: int,
    ep: int,
    dp: int = 1,
    moe_tp: int = 1,
    decode: bool,
    batch: int,
    seq: int,
    comm_backends: dict[str, str] | None = None,
    **quant: str,
) -> Reference:
    """AIConfigurator's step time for ``model`` (its model name, e.g. ``deepseek-ai/DeepSeek-V3``):
    decode: ``batch`` queries per attention-DP rank at context ``seq``; prefill: ``batch`` x ``seq``
    new tokens per attention-DP rank. ``comm_backends`` (``{"context": "deepep_ht", "generation":
    "deepep_ll"}``) builds its large-EP graph - the MoE all-to-all, DeepEP-path expert tables and,
    for SGLang, the wide-EP MLA module - which its own layout search picks for a cross-node EP; else
    its TP/EP graph; ``moe_tp`` shards each expert's width (its rule: ``tp x dp = moe_tp x ep``).
    The total is AIConfigurator's ``predict_*_latency``; components sum its ops (an op that falls
    back to its parts is split into them)."""
    engine = require()
    import aiconfigurator_core
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.models import get_model

    database = _database(system, framework)
    config = build_model_config(
        tp_size=tp,
        pp_size=1,
        attention_dp_size=dp,
        moe_tp_size=moe_tp,
        moe_ep_size=ep,
        gemm_quant_mode=quant.get("gemm_quant_mode"),
        kvcache_quant_mode=quant.get("kvcache_quant_mode"),
        fmha_quant_mode=quant.get("fmha_quant_mode"),
        moe_quant_mode=quant.get("moe_quant_mode"),
        comm_quant_mode=None,
        forward_model=None,
        attention_backend=None,
    )
    if comm_backends:  # what AIConfigurator's layout search sets for a large-EP candidate
        config.moe_comm_backend = dict(comm_backends)
        config.num_gpus_per_node = _gpus_per_node(system, framework)
        config.system = system
    built = get_model(model, config, framework)
    spec = engine.build_engine_spec_json(
        built,
        model_path=model,
        system=system,
        backend=framework,
        backend_version=database.version,
        kv_block_size=None,
        systems_path=None,
        nextn=0,
        database=database,
    )
    handle = engine.EngineHandle(bytes(aiconfigurator_core.engine_spec_bincode_from_json(spec)))
    total = (
        handle.predict_decode_latency(batch, seq, 2) if decode else handle.predict_prefill_latency(batch, seq)
    )
    ops = json.loads(engine.build_ops_json(built.generation_ops if decode else built.context_ops))
    components = dict.fromkeys(COMPONENTS, 0.0)
    rows = []
    shape = {"is_context": not decode, "batch_size": batch, "s": seq + 1 if decode else seq}
    for op in ops:
        for leaf in _leaves(op):
            ((name, ms, _energy, tier),) = handle.evaluate_ops_json(json.dumps([leaf]), **shape)
            components[aic_component(name)] += ms
            rows.append((name, ms, tier))
    layout = f"TP{tp} DP{dp} EP{ep}" + (f" MoE-TP{moe_tp}" if moe_tp > 1 else "")
    layout += " large-EP" if comm_backends else ""
    label = f"AIConfigurator {framework} {system} {layout}, {model}"
    return Reference(total, components, tuple(rows), label)
