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
# kadapt's B200 and GB200 profiles are AIConfigurator's b200_sxm and gb200 (8 and 4 GPUs per node in
# its system files); all five carry trtllm 1.3.0rc20, sglang 0.5.14 and vllm 0.24.0 tables (a100_sxm:
# trtllm 1.0.0, sglang 0.5.10, vllm 0.14.0)
SYSTEMS = {
    "h200": "h200_sxm",
    "h100": "h100_sxm",
    "a100": "a100_sxm",
    "b200": "b200_sxm",
    "gb200": "gb200",
}
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
    its TP/EP graph. The total is AIConfigurator's ``predict_*_latency``; components sum its ops (an
    op that falls back to its parts is split into them)."""
    engine = require()
    import aiconfigurator_core
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.models import get_model

    database = _database(system, framework)
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
    layout = f"TP{tp} DP{dp} EP{ep}" + (" large-EP" if comm_backends else "")
    label = f"AIConfigurator {framework} {system} {layout}, {model}"
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

    def gpus_per_node(self) -> int:
        """GPUs per node in AIConfigurator's system file: its all-to-all tables key node counts
        (GB200 NVL72 is 4 per node there, the others 8)."""
        return _gpus_per_node(self.system, self.framework)

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
            return self._experts(attrs, decode)
        if op.kind == "comm" and op.comm is not None:
            if op.comm["collective"] == "all_to_all":
                return self._all_to_all(op, decode)
            return self._comm(op.comm)
        return None

    def _gemm(self, op: Op, attrs: dict[str, Any]) -> float | None:
        if "m" not in attrs:
            return None
        return self._gemm_shape(
            op.name,
            str(attrs.get("kernel")),
            str(attrs.get("tag", "")),
            int(attrs.get("batch", 1)),
            int(attrs["m"]),
            int(attrs["n"]),
            int(attrs["k"]),
        )

    def _gemm_shape(
        self, name: str, kernel: str, tag: str, batch: int, m: int, n: int, k: int
    ) -> float | None:
        """A dense GEMM (``Gemm``) or, tagged ``mla_bmm_*`` with ``batch`` heads, MLA's absorbed
        per-head bmm (``MlaBmm``), at M = ``m`` rows."""
        quant = _GEMM_QUANT.get(kernel)
        if quant is None:
            return None
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
                "name": name,
                "scale_factor": 1.0,
                "n": n,
                "k": k,
                "quant_mode": quant,
                "scale_num_tokens": 1,
                "low_precision_input": False,
                "seq_split": 1,
                "below_grid_sol": False,
            }
        }
        return self._evaluate(spec, context=True, batch=1, s=m, x=m)

    def _attention(self, attrs: dict[str, Any]) -> float | None:
        if attrs["kernel"] == "mla" and int(attrs.get("attention_dp", 1)) > 1:
            module = self._wide_ep_mla(attrs)
            if module is not None:
                return module
        return self._attention_kernel(attrs)

    def _wide_ep_mla(self, attrs: dict[str, Any]) -> float | None:
        """Attention-DP MLA as AIConfigurator's SGLang large-EP graph prices it: SGLang's whole MLA
        module (``wide_ep_module_row``). kadapt traces the module's GEMMs as kernels of their own and
        prices them from AIConfigurator's GEMM tables, so the attention kernel takes the row less
        them, and the module sums to the measured row. None (the standalone tables price it) where
        the module was not measured or the GEMMs alone exceed the row."""
        module = self.wide_ep_module_row(attrs)
        if module is None:
            return None
        batch, seq, past = int(attrs["batch"]), int(attrs["seq"]), int(attrs["past"])
        rows = {"new": batch * seq, "context": batch * (past + seq)}
        gemms = 0.0
        for tag, n, k, kernel, heads, m in attrs["module_gemms"]:
            seconds = self._gemm_shape("module_gemm", kernel, tag, heads, rows[m], n, k)
            if seconds is None:
                return None
            gemms += seconds
        return module - gemms if module > gemms else None

    def wide_ep_module_row(self, attrs: dict[str, Any]) -> float | None:
        """Seconds of SGLang's MLA module under DP attention for an MLA kernel's ``attrs``
        (``WideEpGenerationMla`` / ``WideEpContextMla``: q_b, the attention, the absorbed bmm or the
        kv_b expansion, o_proj, measured as one); None off SGLang or where it was not measured (its
        rows hold an FP8 KV cache and FP8-block projections only)."""
        if self.framework != "sglang" or "module_gemms" not in attrs:
            return None
        decode, batch, seq, past = (
            bool(attrs["decode"]),
            int(attrs["batch"]),
            int(attrs["seq"]),
            int(attrs["past"]),
        )
        body: dict[str, Any] = {
            "name": "attention",
            "scale_factor": 1.0,
            "num_heads": int(attrs["heads"]),
            "kv_cache_dtype": _KV.get(str(attrs["kv_dtype"]), "bfloat16"),
            "attn_backend": "flashinfer",  # AIConfigurator's default for the SGLang module
        }
        if decode:
            body["fmha_quant_mode"] = "fp8"
            spec = {"WideEpGenerationMla": body}
            return self._evaluate(spec, context=False, batch=batch, s=past + seq, measured_only=True)
        body |= {"fmha_quant_mode": "fp8_block", "cp_size": 1}
        spec = {"WideEpContextMla": body}
        return self._evaluate(spec, context=True, batch=batch, s=seq, prefix=past, measured_only=True)

    def _attention_kernel(self, attrs: dict[str, Any]) -> float | None:
        """One attention kernel in AIConfigurator's standalone MLA / attention tables."""
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

    def _experts(self, attrs: dict[str, Any], decode: bool) -> float | None:
        """The routed experts' grouped GEMMs. Where tokens reach the experts by all-to-all under
        attention DP (wide EP: ``ep > tp`` and DP > 1) they are looked up as AIConfigurator's own
        large-EP graph does: ``MoeExpertCompute`` (its DeepEP-path expert tables) at the tokens of
        one attention-DP rank and the attention-DP size; its regular ``Moe`` table (SGLang's fused
        MoE, measured inside one TP group) priced SGLang's DP64 EP64 decode experts 9.6x higher.
        Otherwise (or where that table lacks the shape) ``Moe`` at the same tokens, as its TP/EP
        graphs query it."""
        quant = _MOE_QUANT.get(str(attrs["kernel"]))
        if quant is None:
            return None
        distribution = "power_law_1.01" if attrs.get("routing") == "power_law" else "balanced"
        shape = {
            "name": "moe",
            "scale_factor": 1.0,
            "hidden_size": int(attrs["hidden"]),
            "inter_size": int(attrs["width"]),
            "topk": int(attrs["top_k"]),
            "num_experts": int(attrs["experts"]),
            "moe_ep_size": int(attrs["ep"]),
            "quant_mode": quant,
            "workload_distribution": distribution,
            "is_gated": True,
            "enable_eplb": False,
        }
        dp = int(attrs.get("attention_dp", 1))
        if dp > 1 and attrs.get("all_to_all") and "rank_tokens" in attrs:
            tokens = max(1, round(float(attrs["rank_tokens"])))
            wide = shape | {
                "attention_dp_size": dp,
                "inference_phase": "generation" if decode else "context",
                "num_slots": int(attrs["experts"]),
                "kernel_source": None,
            }
            spec = {"MoeExpertCompute": wide}
            phase = {"context": not decode, "batch": 1, "s": tokens, "x": tokens}
            seconds = self._evaluate(spec, **phase, measured_only=True)
            if seconds is not None:
                return seconds
            moe = shape | {"attention_dp_size": dp}
        else:
            tokens = max(1, round(float(attrs["tokens"])))
            moe = shape | {"attention_dp_size": 1}
        moe |= {"moe_tp_size": 1, "moe_backend": None, "is_context": True}
        return self._evaluate({"Moe": moe}, context=True, batch=1, s=tokens, x=tokens)

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
                "node_num": -(-group // self.gpus_per_node()),
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
def _database(system: str, framework: str) -> Any:
    """AIConfigurator's newest tables for one system and framework."""
    require()
    from aiconfigurator_core.sdk import perf_database

    version = perf_database.get_latest_database_version(system, framework)
    database = perf_database.get_database(system, framework, version) if version else None
    if database is None:
        raise KadaptError(f"AIConfigurator has no {framework} tables for {system}")
    return database


@cache
def _database_handle(system: str, framework: str) -> Any:
    """An AIConfigurator engine bound to one system's tables (no model: ad-hoc op lists only)."""
    return require().EngineHandle.for_database(_database(system, framework))


def _gpus_per_node(system: str, framework: str) -> int:
    return int(_database(system, framework).system_spec["node"]["num_gpus_per_node"])
