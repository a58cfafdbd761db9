"""The ``--cost-model measured`` back end: kadapt's ops looked up in AIConfigurator's measured tables.

``MeasuredPricer`` turns each kadapt GEMM (and MLA's absorbed bmm), attention kernel (or, under
cross-node wide EP on SGLang, its whole measured MLA module), gated-DeltaNet kernel (conv and scan of a
hybrid stack's linear layers), routed-expert op and collective (TP all-reduce / all-gather, EP
dispatch / combine) into AIConfigurator's op description and prices it
through ``evaluate_ops_json`` on the system's tables, the way AIConfigurator's own graph for the
layout queries them; ``None`` where it has no such op or table, and the roofline prices that op.

Which graph an attention-DP layout gets is AIConfigurator's rule for an exact layout
(``resolve_model_config_moe_comm`` in its ``sdk/moe_comm_resolver.py``, outside the
``aiconfigurator-core`` wheel): an EP group wider than a node of the system file builds its large-EP
graph (DeepEP all-to-all, ``MoeExpertCompute``, SGLang's attention-DP MLA module); one inside a node
keeps its fused graph (``MoeDispatch`` of the framework's flavour around the ``Moe`` table at every
attention-DP rank's tokens, the standalone MLA tables).

Separate from ``aiconfigurator`` (the package, its systems and tables) and ``reference``
(AIConfigurator's own step estimate) because this is kadapt's op vocabulary translated into
AIConfigurator's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..model.tracer import Op
from . import ep_dispatch
from .aic_modes import GEMM_QUANT, kv_dtype, moe_quant
from .aiconfigurator import _database_handle, _gpus_per_node, broken_moe_eps

_DSA_KERNELS = ("dsa", "dsa_indexer", "dsa_topk")  # sparse MLA, indexer scoring, top-k (one DSA module)
# a DSA kernel's sizes -> the key of AIConfigurator's DSA_MODEL_DIMS they must equal
_DSA_DIMS = {"hidden": "hidden_size", "topk": "index_topk", "index_dim": "index_head_dim"}
_DSA_DIMS |= {"index_heads": "index_n_heads", "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank"}


def _dsa_architecture(attrs: dict[str, Any]) -> str | None:
    """The AIConfigurator DSA architecture whose sizes are this layer's (its tables are keyed by the
    measured model: DeepSeek-V3.2 or GLM-5); None for any other sizes."""
    try:
        from aiconfigurator_core.sdk.operations.dsa import DSA_MODEL_DIMS
    except ImportError:  # a release that moved it: the roofline prices the layer
        return None
    for architecture, dims in DSA_MODEL_DIMS.items():
        if all(key in attrs and int(attrs[key]) == dims.get(name) for key, name in _DSA_DIMS.items()):
            return str(architecture)
    return None


def _module_projection_quant(attrs: dict[str, Any]) -> str | None:
    """The quant mode of a module's projections (its q_b_proj's), as AIConfigurator keys the module."""
    kernels = [kernel for tag, _n, _k, kernel, _h, _m in attrs.get("module_gemms", ()) if tag == "proj"]
    return GEMM_QUANT.get(kernels[0]) if kernels else None


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

    def large_ep(self, attention_dp: int, ep: int, *, all_to_all: bool) -> bool:
        """Whether AIConfigurator prices this layout with its large-EP graph: attention DP whose
        tokens reach the experts by all-to-all (kadapt's ``ep > tp``) over an EP group wider than one
        node of its system file (``ep_dispatch.wide_ep``). Its exact estimate keeps an EP group
        inside a node on the fused graph, which prices DeepSeek-V3's prefill of 8 x 4k on 8 H200
        (SGLang) 2.4x above its large-EP graph (SGLang's fused MoE against the DeepEP-path expert
        tables)."""
        return ep_dispatch.wide_ep(attention_dp, ep, all_to_all=all_to_all, node_size=self.gpus_per_node())

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
        if op.kind == "linear_attention" and "source_kernel" in attrs:
            return self._gated_delta_net(attrs)
        if op.kind == "experts" and "tokens" in attrs:
            return self._experts(attrs, decode)
        if op.kind == "comm" and op.comm is not None:
            if op.comm["collective"] == "all_to_all":
                return self._all_to_all(op, decode)
            if "moe_tp" in op.comm:  # expert TP's all-gather / reduce-scatter around the experts
                return self._gathered(op, decode)
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
        quant = GEMM_QUANT.get(kernel)
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
        if attrs["kernel"] in _DSA_KERNELS:
            return self._dsa(attrs)
        module = self.whole_mla(attrs)
        return module if module is not None else self._attention_kernel(attrs)

    def whole_mla(self, attrs: dict[str, Any]) -> float | None:
        """An attention kernel's price as SGLang's whole MLA module measured under attention DP across
        nodes (``_wide_ep_mla``), or None: not such a layout, or the standalone tables price it."""
        dp, ep, tp = (int(attrs.get(key, 1)) for key in ("attention_dp", "ep", "tp"))
        all_to_all = bool(attrs["all_to_all"]) if "all_to_all" in attrs else ep > tp
        if attrs.get("kernel") != "mla" or not self.large_ep(dp, ep, all_to_all=all_to_all):
            return None
        return self._wide_ep_mla(attrs)

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
            "kv_cache_dtype": kv_dtype(str(attrs["kv_dtype"])),
            "attn_backend": "flashinfer",  # AIConfigurator's default for the SGLang module
        }
        if decode:
            body["fmha_quant_mode"] = "fp8"
            spec = {"WideEpGenerationMla": body}
            return self._evaluate(spec, context=False, batch=batch, s=past + seq, measured_only=True)
        body |= {"fmha_quant_mode": "fp8_block", "cp_size": 1}
        spec = {"WideEpContextMla": body}
        return self._evaluate(spec, context=True, batch=batch, s=seq, prefix=past, measured_only=True)

    def _dsa(self, attrs: dict[str, Any]) -> float | None:
        """A DSA layer's kernels (indexer scoring, top-k, sparse MLA) where AIConfigurator measured
        the whole DSA attention module (``DsaGeneration`` / ``DsaContext``: every projection of the
        MLA and the indexer, the fp8 MQA logits, the top-k, the sparse MLA and the absorbed bmms,
        o_proj). kadapt traces the module's GEMMs as kernels of their own, priced from
        AIConfigurator's GEMM tables, so the sparse attention kernel takes the row less them and the
        scoring and top-k are priced 0 (inside the row): the module sums to the measured row. None
        (all three on the roofline) where the module was not measured at this shape, dtype and
        architecture, or the GEMMs alone exceed the row."""
        row = self.dsa_module_row(attrs)
        if row is None:
            return None
        batch, seq, past = int(attrs["batch"]), int(attrs["seq"]), int(attrs["past"])
        rows = {"new": batch * seq, "context": batch * (past + seq)}
        gemms = 0.0
        for tag, n, k, kernel, heads, m in attrs["module_gemms"]:
            seconds = self._gemm_shape("module_gemm", kernel, tag, heads, rows[m], n, k)
            if seconds is None:
                return None
            gemms += seconds
        if row <= gemms:
            return None
        return row - gemms if attrs["kernel"] == "dsa" else 0.0

    def dsa_module_row(self, attrs: dict[str, Any]) -> float | None:
        """Seconds of AIConfigurator's measured DSA attention module for a DSA kernel's ``attrs``; None
        where no measured row holds it (a model whose sizes are not one of its DSA architectures, a
        KV dtype or projection format it did not measure, a framework without the table)."""
        architecture = _dsa_architecture(attrs)
        gemm = _module_projection_quant(attrs)
        if architecture is None or gemm is None or "module_gemms" not in attrs:
            return None
        decode, batch, seq, past = (
            bool(attrs["decode"]),
            int(attrs["batch"]),
            int(attrs["seq"]),
            int(attrs["past"]),
        )
        body = {
            "name": "attention",
            "scale_factor": 1.0,
            "num_heads": int(attrs["heads"]),
            "kv_cache_dtype": kv_dtype(str(attrs["kv_dtype"])),
            "fmha_quant_mode": "bfloat16",
            "gemm_quant_mode": gemm,
            "architecture": architecture,
            "index_topk": int(attrs["topk"]),
            "cp_size": 1,
            "full_frac": 1.0,
            "attn_projection_quant_modes": dict.fromkeys(("q", "kv", "o", "indexer"), gemm),
        }
        if decode:
            spec = {"DsaGeneration": body}
            return self._evaluate(spec, context=False, batch=batch * seq, s=past + seq, measured_only=True)
        spec = {"DsaContext": body}
        return self._evaluate(spec, context=True, batch=batch, s=seq, prefix=past, measured_only=True)

    def _attention_kernel(self, attrs: dict[str, Any]) -> float | None:
        """One attention kernel in AIConfigurator's standalone MLA / attention tables."""
        decode, batch, seq, past = (
            bool(attrs["decode"]),
            int(attrs["batch"]),
            int(attrs["seq"]),
            int(attrs["past"]),
        )
        kv = kv_dtype(str(attrs["kv_dtype"]))
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

    def _gated_delta_net(self, attrs: dict[str, Any]) -> float | None:
        """A gated-DeltaNet kernel in AIConfigurator's ``gdn_perf`` tables (its ``Gdn`` op, as its
        Qwen3.5 graph queries it: this rank's heads, the model's hidden size): prefill
        ``causal_conv1d_fn`` / ``chunk_gated_delta_rule`` at the batch's sequences of ``seq`` tokens,
        decode ``causal_conv1d_update`` / ``fused_sigmoid_gating_delta_rule_update`` at one row per
        new token. Measured rows only: where it has none (TensorRT-LLM's decode scan) it extrapolates
        a speed-of-light figure, and the roofline prices the kernel instead."""
        decode, batch, seq = bool(attrs["decode"]), int(attrs["batch"]), int(attrs["seq"])
        spec = {
            "Gdn": {
                "name": str(attrs["source_kernel"]),
                "scale_factor": 1.0,
                "kernel_source": str(attrs["source_kernel"]),
                "phase": "generation" if decode else "context",
                "d_model": int(attrs["hidden"]),
                "d_conv": int(attrs["conv"]),
                "num_k_heads": int(attrs["key_heads"]),
                "head_k_dim": int(attrs["key_dim"]),
                "num_v_heads": int(attrs["value_heads"]),
                "head_v_dim": int(attrs["value_dim"]),
                "mamba_ssm_dtype": "float32",
            }
        }
        if decode:
            return self._evaluate(spec, context=False, batch=batch * seq, s=1, measured_only=True)
        return self._evaluate(spec, context=True, batch=batch, s=seq, measured_only=True)

    def _experts(self, attrs: dict[str, Any], decode: bool) -> float | None:
        """The routed experts' grouped GEMMs. In a layout AIConfigurator prices with its large-EP
        graph (``large_ep``: cross-node wide EP) they are looked up as that graph does:
        ``MoeExpertCompute`` (its DeepEP-path expert tables) at the tokens of one attention-DP rank
        and the attention-DP size; its regular ``Moe`` table (SGLang's fused MoE, measured inside one
        TP group) priced SGLang's DP64 EP64 decode experts 9.6x higher. Otherwise (or where that
        table lacks the shape) ``Moe`` at every rank's tokens, as its fused graphs query it (the
        ``Moe`` table at attention-DP size ``dp`` and ``s`` tokens is its row at ``dp x s``). None
        (the roofline prices it) where the ``Moe`` table's balanced rows of the shape at its EP size
        are a broken measurement by the calibration's rule (``calibrate_rows.broken_ep_sizes``; H100
        rc20, bf16 4096 x 1,024, 512 experts, EP4: 5.08 ms at 64 tokens, EP2 2.14), power-law routing
        included (the calibration's routing factors are joined to the balanced rows it keeps)."""
        kernel = str(attrs["kernel"])
        quant = moe_quant(self.framework, kernel)
        if quant is None:
            return None
        distribution = "power_law_1.01" if attrs.get("routing") == "power_law" else "balanced"
        moe_tp = int(attrs.get("moe_tp", 1))  # its tables key the whole width and the expert-TP size
        shape = {
            "name": "moe",
            "scale_factor": 1.0,
            "hidden_size": int(attrs["hidden"]),
            "inter_size": int(attrs["width"]) * moe_tp,
            "topk": int(attrs["top_k"]),
            "num_experts": int(attrs["experts"]),
            "moe_ep_size": int(attrs["ep"]),
            "quant_mode": quant,
            "workload_distribution": distribution,
            "is_gated": True,
            "enable_eplb": False,
        }
        dp = int(attrs.get("attention_dp", 1))
        large = self.large_ep(dp, int(attrs["ep"]), all_to_all=bool(attrs.get("all_to_all")))
        if large and "rank_tokens" in attrs:
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
        key = (shape["topk"], shape["num_experts"], shape["hidden_size"], shape["inter_size"], moe_tp)
        if shape["moe_ep_size"] in broken_moe_eps(self.system, self.framework, quant, key):
            return None
        moe |= {"moe_tp_size": moe_tp, "moe_backend": None, "is_context": True}
        return self._evaluate({"Moe": moe}, context=True, batch=1, s=tokens, x=tokens)

    def _all_to_all(self, op: Op, decode: bool) -> float | None:
        """EP dispatch or combine as AIConfigurator's graph for the layout moves tokens: inside a
        node its fused graph's ``MoeDispatch``, across nodes (or without attention DP) its large-EP
        tables (``deepep_all_to_all``)."""
        comm = op.comm
        assert comm is not None
        if "hidden" not in comm or int(comm["group"]) <= 1:
            return None
        if not self.large_ep(int(comm.get("attention_dp", 1)), int(comm["group"]), all_to_all=True):
            fused = ep_dispatch.fused_dispatch(op, self.framework, decode=decode)
            if fused is not None:
                spec, tokens = fused
                phase = {"context": not decode, "batch": 1, "s": tokens, "x": tokens}
                seconds = self._evaluate(spec, **phase, measured_only=True)
                if seconds is not None:
                    return seconds
        return self.deepep_all_to_all(op, decode)

    def _gathered(self, op: Op, decode: bool) -> float | None:
        """Expert TP's token gather (reduce-scatter after) across attention-DP groups: its fused
        graph's ``MoeDispatch`` at the layout's MoE-TP and EP sizes, where its tables measured it."""
        fused = ep_dispatch.fused_dispatch(op, self.framework, decode=decode)
        if fused is None:
            return None
        spec, tokens = fused
        return self._evaluate(spec, context=not decode, batch=1, s=tokens, x=tokens, measured_only=True)

    def deepep_all_to_all(self, op: Op, decode: bool) -> float | None:
        """EP dispatch or combine in AIConfigurator's DeepEP tables (``ep_dispatch.deepep_all_to_all``),
        where they measured that EP size and node count."""
        spec, tokens = ep_dispatch.deepep_all_to_all(
            op, self.framework, decode=decode, gpus_per_node=self.gpus_per_node()
        )
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
