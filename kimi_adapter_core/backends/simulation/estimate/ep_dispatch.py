"""AIConfigurator's op descriptions of an MoE layer's token movement (kadapt's EP dispatch / combine).

Its two graphs for an attention-DP layout move tokens differently: the fused graph (an EP group inside
a node) wraps its ``Moe`` table in ``MoeDispatch`` ops of the framework's flavour, the large-EP graph
(across nodes) runs DeepEP's ``MoeAllToAll``. ``MeasuredPricer`` picks the graph and prices the
description; this module spells each one, in AIConfigurator's op vocabulary, from the comm
description ``RoutedExperts`` records (each returns the op and the token count to query it at, or
None where that graph has no such op), and holds the rule that tells the two layouts apart
(``wide_ep``), which both cost models apply with their own node size.
"""

from __future__ import annotations

from typing import Any

from ..model.tracer import Op


def wide_ep(attention_dp: int, ep: int, *, all_to_all: bool, node_size: int) -> bool:
    """Whether a layout runs the wide-EP path: attention DP whose tokens reach the experts by
    all-to-all (kadapt's ``ep > tp``) over an EP group wider than ``node_size`` GPUs. There the
    routed experts run DeepEP's dispatch and DeepGEMM's grouped GEMMs (SGLang measures them apart,
    AIConfigurator builds its large-EP graph); an EP group inside a node keeps the fused path
    (AIConfigurator's exact estimate: "intra-node EP on the fused path"). One rule, two node sizes:
    the roofline's kernel table takes the device's NVLink domain (``cost.table_shape``: 72 GPUs on
    GB200), the measured cost model the node of AIConfigurator's system file, whose tables key node
    counts (``MeasuredPricer.large_ep``: 4 on GB200)."""
    return all_to_all and attention_dp > 1 and ep > node_size


def fused_dispatch(op: Op, framework: str, *, decode: bool) -> tuple[dict[str, Any], int] | None:
    """``MoeDispatch`` before (dispatch) or after (combine) the experts at the tokens of one
    attention-DP rank: TensorRT-LLM's own all-to-all for ``trtllm``, SGLang's and vLLM's all-reduce
    based gather / scatter otherwise. None without attention DP (its graph has no such op there)."""
    comm = op.comm
    assert comm is not None
    dp = int(comm.get("attention_dp", 1))
    if dp <= 1 or "rank_tokens" not in comm:
        return None
    body = {
        "name": op.name,
        "scale_factor": 1.0,
        "hidden_size": int(comm["hidden"]),
        "topk": int(comm["top_k"]),
        "num_experts": int(comm["experts"]),
        "moe_tp_size": int(comm.get("moe_tp", 1)),
        "moe_ep_size": int(comm.get("ep", comm["group"])),  # expert TP's gather: its group is DP's
        "attention_dp_size": dp,
        "pre_dispatch": op.name.startswith("ep_dispatch"),
        "attn_ar_modeled": False,
        "backend": framework,
        "flavor": "TrtllmAlltoall" if framework == "trtllm" else "CustomAllReduce",
        "comm_quant": "half",
        "moe_quant": "fp8_block",  # its graph passes the experts' mode; the tables do not key it
        "attn_cp_size": 1,
        "is_context": not decode,
        "sms": 12,
        "scale_num_tokens": 1,
    }
    return {"MoeDispatch": body}, max(1, round(float(comm["rank_tokens"])))


def deepep_all_to_all(
    op: Op, framework: str, *, decode: bool, gpus_per_node: int
) -> tuple[dict[str, Any], int]:
    """``MoeAllToAll`` over the large-EP tables: DeepEP low-latency kernels in decode, high-throughput
    ones in prefill (TensorRT-LLM's own DeepEP builds for ``trtllm``), at the tokens one rank sends.
    DeepEP moves what the model's activations are (8-bit or bf16); TensorRT-LLM's high-throughput
    path sends bf16 either way (AIConfigurator's serving rule)."""
    comm = op.comm
    assert comm is not None
    hidden, group = int(comm["hidden"]), int(comm["group"])
    eight_bit = comm["token_bytes"] < 2 * hidden and op.name.startswith("ep_dispatch")
    if framework == "trtllm":
        backend = "trtllm_deepep_ll" if decode else "trtllm_deepep_ht"
        dtype = "fp8" if eight_bit and decode else "bfloat16"
    else:
        backend, dtype = ("deepep_ll" if decode else "deepep_ht"), "default"
    body = {
        "name": op.name,
        "scale_factor": 1.0,
        "phase": "dispatch" if op.name.startswith("ep_dispatch") else "combine",
        "comm_backend": backend,
        "comm_dtype": dtype,
        "hidden_size": hidden,
        "topk": int(comm["top_k"]),
        "num_experts": int(comm["experts"]),
        "moe_ep_size": group,
        "node_num": -(-group // gpus_per_node),
        "sms": 20 if backend == "deepep_ht" else 0,  # AIConfigurator's default SM budget
        "attention_tp_size": 1,  # ``tokens`` is already what one rank sends
    }
    return {"MoeAllToAll": body}, max(1, round(float(comm["tokens"])))
