"""Bridge to NVIDIA AIConfigurator (``aiconfigurator-core``, the optional ``measured`` extra).

Two uses, both through the package's public engine surface (``EngineHandle.compile`` and
``evaluate_ops_json``: AIConfigurator's per-op Python call is private and its distribution is being
renamed, so nothing else is touched):

- ``reference_step``: AIConfigurator's own estimate of one step for one of its models - the total and
  every op, each op also sorted into a component (attention, experts, communication, other) - which
  the benchmark and the accuracy tests compare kadapt with.
- ``MeasuredPricer``: the ``--cost-model measured`` back end: each kadapt GEMM, attention,
  routed-expert and communication op (TP all-reduce / all-gather, EP dispatch / combine) is turned
  into AIConfigurator's op description and looked up in its measured tables for the system; ``None``
  where it has no such op or table (the caller falls back to the roofline for that op).

The import is lazy: without the package ``require()`` raises a ``KadaptError`` naming the extra.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from ...errors import KadaptError
from .tracer import Op

EXTRA = "measured"
PACKAGE = "aiconfigurator-core"
# kadapt device profile -> AIConfigurator system (only systems it ships measured tables for)
SYSTEMS = {"h200": "h200_sxm", "h100": "h100_sxm", "a100": "a100_sxm"}
GPUS_PER_NODE = 8  # every system above: 8-GPU NVLink nodes (the all-to-all tables key node counts)
FRAMEWORKS = ("trtllm", "sglang", "vllm")
# kadapt weight kernel -> AIConfigurator quant mode (GEMM, MoE)
_GEMM_QUANT = {"bf16": "bfloat16", "fp8": "fp8", "fp8_block": "fp8_block", "int8": "fp8", "fp32": "bfloat16"}
_MOE_QUANT = {"bf16": "bfloat16", "fp8": "fp8", "fp8_block": "fp8_block", "w4a16": "int4_wo", "int8": "fp8"}
_KV = {"bf16": "bfloat16", "fp8": "fp8"}


def require() -> Any:
    """The ``aiconfigurator_core`` engine module, or a one-line error naming the extra to install."""
    try:
        from aiconfigurator_core.sdk import engine
    except ImportError as exc:
        raise KadaptError(
            f"--cost-model measured needs NVIDIA AIConfigurator's tables: pip install 'kadapt[{EXTRA}]' "
            f"(or {PACKAGE}==0.12.0); it is not installed ({exc})"
        ) from exc
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    return engine


def available() -> bool:
    try:
        require()
    except KadaptError:
        return False
    return True


def system_for(device_name: str) -> str:
    system = SYSTEMS.get(device_name)
    if system is None:
        raise KadaptError(
            f"--cost-model measured has no AIConfigurator tables for device {device_name!r} "
            f"(measured systems: {', '.join(f'{k} ({v})' for k, v in SYSTEMS.items())})"
        )
    return system


# --- AIConfigurator's own estimate ---------------------------------------------------------------
COMPONENTS = ("attention", "experts", "communication", "other")


def aic_component(name: str) -> str:
    """Component of one AIConfigurator op, by its name."""
    if any(key in name for key in ("dispatch", "_ar", "allreduce", "all_reduce", "p2p", "all_gather", "a2a")):
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
    decode: bool,
    batch: int,
    seq: int,
    **quant: str,
) -> Reference:
    """AIConfigurator's step time for ``model`` (its model name, e.g. ``deepseek-ai/DeepSeek-V3``):
    decode: ``batch`` queries at context ``seq``; prefill: ``batch`` x ``seq`` new tokens. The total
    is AIConfigurator's ``predict_*_latency``; components sum its ops (an op that falls back to its
    parts is split into them)."""
    engine = require()
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.models import get_model

    kwargs = {"tp_size": tp, "attention_dp_size": dp, "moe_tp_size": 1, "moe_ep_size": ep, **quant}
    handle = engine.EngineHandle.compile(model, system, framework, **kwargs)
    total = (
        handle.predict_decode_latency(batch, seq, 2) if decode else handle.predict_prefill_latency(batch, seq)
    )
    config = build_model_config(
        tp_size=tp,
        pp_size=1,
        attention_dp_size=dp,
        moe_tp_size=1,
        moe_ep_size=ep,
        gemm_quant_mode=quant.get("gemm_quant_mode"),
        kvcache_quant_mode=quant.get("kvcache_quant_mode"),
        fmha_quant_mode=quant.get("fmha_quant_mode"),
        moe_quant_mode=quant.get("moe_quant_mode"),
        comm_quant_mode=None,
        forward_model=None,
        attention_backend=None,
    )
    built = get_model(model, config, framework)
    ops = json.loads(engine.build_ops_json(built.generation_ops if decode else built.context_ops))
    components = dict.fromkeys(COMPONENTS, 0.0)
    rows = []
    shape = {"is_context": not decode, "batch_size": batch, "s": seq + 1 if decode else seq}
    for op in ops:
        for leaf in _leaves(op):
            ((name, ms, _energy, tier),) = handle.evaluate_ops_json(json.dumps([leaf]), **shape)
            components[aic_component(name)] += ms
            rows.append((name, ms, tier))
    label = f"AIConfigurator {framework} {system}, {model}"
    return Reference(total, components, tuple(rows), label)


# --- the measured cost model ---------------------------------------------------------------------
@dataclass
class MeasuredPricer:
    """Looks kadapt ops up in AIConfigurator's tables for ``system`` and ``framework``."""

    system: str
    framework: str = "trtllm"
    _handle: Any = field(default=None, repr=False)

    @property
    def source(self) -> str:
        return f"aiconfigurator:{self.system}/{self.framework}"

    def _engine(self) -> Any:
        if self._handle is None:
            self._handle = _database_handle(self.system, self.framework)
        return self._handle

    def _evaluate(
        self,
        spec: dict[str, Any],
        *,
        context: bool,
        batch: int,
        s: int,
        prefix: int = 0,
        x: int | None = None,
        measured_only: bool = False,
    ) -> float | None:
        """Seconds AIConfigurator gives ``spec``; None when it cannot price it, or (``measured_only``)
        when its answer is not read from a table measured at that shape (tier other than ``silicon``:
        e.g. an all-to-all at an EP size it never ran, which it prices as the nearest one it did)."""
        try:
            ((_, ms, _energy, tier),) = self._engine().evaluate_ops_json(
                json.dumps([spec]), is_context=context, batch_size=batch, s=s, prefix=prefix, x=x
            )
        except Exception:  # noqa: BLE001 - a shape or dtype the tables lack: the roofline prices it
            return None
        if measured_only and tier != "silicon":
            return None
        return ms * 1e-3 if ms > 0 else None

    def time(self, op: Op, *, decode: bool) -> float | None:
        """Seconds for one occurrence of ``op``, or None when AIConfigurator cannot price it."""
        attrs = op.attrs
        if op.kind == "matmul":
            return self._gemm(op, attrs)
        if op.kind == "attention" and "kernel" in attrs:
            return self._attention(attrs)
        if op.kind == "experts" and "tokens" in attrs:
            return self._experts(attrs)
        if op.kind == "comm" and op.comm is not None:
            if op.comm["collective"] == "all_to_all":
                return self._all_to_all(op, decode)
            return self._comm(op.comm)
        return None

    def _gemm(self, op: Op, attrs: dict[str, Any]) -> float | None:
        quant = _GEMM_QUANT.get(str(attrs.get("kernel")))
        if quant is None or "m" not in attrs:
            return None
        tag, batch, m = attrs.get("tag", ""), int(attrs.get("batch", 1)), int(attrs["m"])
        if tag.startswith("mla_bmm") and batch > 1:  # MLA's absorbed per-head bmm (decode)
            spec = {
                "MlaBmm": {
                    "name": tag,
                    "scale_factor": 1.0,
                    "num_heads": batch,
                    "quant_mode": "fp8" if quant.startswith("fp8") else quant,
                    "is_pre": tag.endswith("pre"),
                }
            }
            return self._evaluate(spec, context=False, batch=m, s=1)
        if batch > 1:
            return None
        spec = {
            "Gemm": {
                "name": op.name,
                "scale_factor": 1.0,
                "n": int(attrs["n"]),
                "k": int(attrs["k"]),
                "quant_mode": quant,
                "scale_num_tokens": 1,
                "low_precision_input": False,
                "seq_split": 1,
                "below_grid_sol": False,
            }
        }
        return self._evaluate(spec, context=True, batch=1, s=m, x=m)

    def _attention(self, attrs: dict[str, Any]) -> float | None:
        decode, batch, seq, past = (
            bool(attrs["decode"]),
            int(attrs["batch"]),
            int(attrs["seq"]),
            int(attrs["past"]),
        )
        kv = _KV.get(str(attrs["kv_dtype"]), "bfloat16")
        if attrs["kernel"] == "mla":
            if decode:
                spec = {
                    "GenerationMla": {
                        "name": "attention",
                        "scale_factor": 1.0,
                        "num_heads": int(attrs["heads"]),
                        "kv_cache_dtype": kv,
                    }
                }
                return self._evaluate(spec, context=False, batch=batch * seq, s=past + seq)
            spec = {
                "ContextMla": {
                    "name": "attention",
                    "scale_factor": 1.0,
                    "num_heads": int(attrs["heads"]),
                    "kv_cache_dtype": kv,
                    "fmha_quant_mode": "bfloat16",
                    "cp_size": 1,
                }
            }
            return self._evaluate(spec, context=True, batch=batch, s=seq, prefix=past)
        body = {
            "name": "attention",
            "scale_factor": 1.0,
            "n": int(attrs["heads"]),
            "n_kv": int(attrs["kv_heads"]),
            "head_size": int(attrs["head_dim"]),
            "window_size": int(attrs.get("window", 0)),
            "kv_cache_dtype": kv,
            "lane_order": ["default"],
        }
        if decode:
            return self._evaluate(
                {"GenerationAttention": body}, context=False, batch=batch * seq, s=past + seq
            )
        body["fmha_quant_mode"] = "bfloat16"
        return self._evaluate({"ContextAttention": body}, context=True, batch=batch, s=seq, prefix=past)

    def _experts(self, attrs: dict[str, Any]) -> float | None:
        quant = _MOE_QUANT.get(str(attrs["kernel"]))
        if quant is None:
            return None
        spec = {
            "Moe": {
                "name": "moe",
                "scale_factor": 1.0,
                "hidden_size": int(attrs["hidden"]),
                "inter_size": int(attrs["width"]),
                "topk": int(attrs["top_k"]),
                "num_experts": int(attrs["experts"]),
                "moe_tp_size": 1,
                "moe_ep_size": int(attrs["ep"]),
                "attention_dp_size": 1,
                "quant_mode": quant,
                "workload_distribution": "power_law_1.01"
                if attrs.get("routing") == "power_law"
                else "balanced",
                "is_gated": True,
                "moe_backend": None,
                "enable_eplb": False,
                "is_context": True,
            }
        }
        tokens = max(1, round(float(attrs["tokens"])))
        return self._evaluate(spec, context=True, batch=1, s=tokens, x=tokens)

    def _all_to_all(self, op: Op, decode: bool) -> float | None:
        """EP dispatch or combine in AIConfigurator's large-EP tables: DeepEP low-latency kernels in
        decode, high-throughput ones in prefill (TensorRT-LLM's own DeepEP builds for ``trtllm``), at
        the tokens one rank sends. DeepEP moves what the model's activations are (8-bit or bf16);
        TensorRT-LLM's high-throughput path sends bf16 either way (AIConfigurator's serving rule)."""
        comm = op.comm
        assert comm is not None
        if "hidden" not in comm or int(comm["group"]) <= 1:
            return None
        hidden, group = int(comm["hidden"]), int(comm["group"])
        eight_bit = comm["token_bytes"] < 2 * hidden and op.name.startswith("ep_dispatch")
        if self.framework == "trtllm":
            backend = "trtllm_deepep_ll" if decode else "trtllm_deepep_ht"
            dtype = "fp8" if eight_bit and decode else "bfloat16"
        else:
            backend, dtype = ("deepep_ll" if decode else "deepep_ht"), "default"
        spec = {
            "MoeAllToAll": {
                "name": op.name,
                "scale_factor": 1.0,
                "phase": "dispatch" if op.name.startswith("ep_dispatch") else "combine",
                "comm_backend": backend,
                "comm_dtype": dtype,
                "hidden_size": hidden,
                "topk": int(comm["top_k"]),
                "num_experts": int(comm["experts"]),
                "moe_ep_size": group,
                "node_num": -(-group // GPUS_PER_NODE),
                "sms": 20 if backend == "deepep_ht" else 0,  # AIConfigurator's default SM budget
                "attention_tp_size": 1,  # ``tokens`` is already what one rank sends
            }
        }
        tokens = max(1, round(float(comm["tokens"])))
        return self._evaluate(spec, context=not decode, batch=1, s=tokens, x=tokens, measured_only=True)

    def _comm(self, comm: dict[str, Any]) -> float | None:
        group, nbytes = int(comm["group"]), float(comm["bytes"])
        if group <= 1:
            return 0.0
        if comm["collective"] == "all_reduce":
            elements = max(1, round(nbytes / 2))  # bf16 message: AIConfigurator counts elements per token row
            spec = {
                "CustomAllReduce": {
                    "name": "all_reduce",
                    "scale_factor": 1.0,
                    "hidden_size": elements,
                    "tp_size": group,
                    "quant": "half",
                    "seq_split": 1,
                }
            }
            return self._evaluate(spec, context=True, batch=1, s=1, x=1)
        if comm["collective"] == "all_gather":
            elements = max(1, round(nbytes / 2))
            spec = {
                "Nccl": {
                    "name": "all_gather",
                    "scale_factor": 1.0,
                    "hidden_size": float(elements),
                    "num_gpus": group,
                    "dtype": "half",
                    "operation": "all_gather",
                    "seq_split": 1,
                }
            }
            return self._evaluate(spec, context=True, batch=1, s=1, x=1)
        return None


@cache
def _database_handle(system: str, framework: str) -> Any:
    """An AIConfigurator engine bound to one system's tables (no model: ad-hoc op lists only)."""
    engine = require()
    from aiconfigurator_core.sdk import perf_database

    version = perf_database.get_latest_database_version(system, framework)
    database = perf_database.get_database(system, framework, version) if version else None
    if database is None:
        raise KadaptError(f"AIConfigurator has no {framework} tables for {system}")
    return engine.EngineHandle.for_database(database)
