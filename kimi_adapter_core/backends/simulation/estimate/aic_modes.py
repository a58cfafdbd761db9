"""kadapt's weight kernels and KV dtypes as AIConfigurator's quant modes: the names its measured tables
are keyed by. Data apart from ``measured`` (which translates kadapt's ops): a new checkpoint format
adds a row here, not a branch there."""

from __future__ import annotations

# kadapt weight kernel -> AIConfigurator quant mode (GEMM, MoE)
GEMM_QUANT = {"bf16": "bfloat16", "fp8": "fp8", "fp8_block": "fp8_block", "int8": "fp8", "fp32": "bfloat16"}
MOE_QUANT = {
    "bf16": "bfloat16",
    "fp8": "fp8",
    "fp8_block": "fp8_block",
    "w4a16": "int4_wo",  # int4 group-quantized experts (Kimi-K2.5)
    "w4a16_mxfp4": "w4a16_mxfp4",  # MXFP4 experts (gpt-oss): their own kernels' rows, not int4's
    "w4a8_mxfp4": "w4a8_mxfp4_mxfp8",  # FP4 experts on FP8 activations (DeepSeek-V4), Blackwell only
    "int8": "fp8",
}
# a framework's own mode: SGLang's DeepSeek-V4 FP4 experts are AIConfigurator's ``w4a8_mxfp4_mxfp8_trtllm``
# (its sdk/models/helpers.py ``resolve_dsv4_moe_arch_mode``); no Hopper rows (roofline prices those)
FRAMEWORK_MOE_QUANT = {"sglang": {"w4a8_mxfp4": "w4a8_mxfp4_mxfp8_trtllm"}}
KV_DTYPE = {"bf16": "bfloat16", "fp8": "fp8"}


def moe_quant(framework: str, kernel: str) -> str | None:
    """The MoE quant mode of ``kernel``'s rows on ``framework``'s tables (None: AIConfigurator has none)."""
    return FRAMEWORK_MOE_QUANT.get(framework, {}).get(kernel, MOE_QUANT.get(kernel))


def kv_dtype(name: str) -> str:
    """The KV cache quant mode of kadapt's KV dtype (bf16 for any other)."""
    return KV_DTYPE.get(name, "bfloat16")
