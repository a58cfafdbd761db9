"""The small kernels a serving engine launches around the traced ones, which the trace does not hold.

Why: at one request in flight nearly every kernel of a decode step runs at its floor, and a served
step launches kernels neither kadapt's trace nor AIConfigurator's graph holds as kernels of their own
(docs/cost_model.md, "What the anchors miss at one request at a time"). Which ones a framework runs
is read from that framework's published source, one rule each, never fitted; only their price has a
free parameter, the per-kernel floor (``FLOOR_US``). Each is priced as a memory roofline (the bytes
it moves at the device's flat memory efficiency) plus that floor, and its row says so (``source``).

Rules are written for SGLang and vLLM (``RULES``); TensorRT-LLM adds nothing until its source has
been read the same way. SGLang's were read at sgl-project/sglang's main branch and in older copies
of the same files; the served release itself (0.5.6 on the cookbook's B200 points) was not read, so
a rule may describe a path that release did not take yet (its Qwen3 rope + cache-write fusion
predates it: sgl-project/sglang PR 10985, merged, already gates it for mRoPE):
- ``act_quant``: one activation quantization before every FP8 block-scaled GEMM, one per distinct
  activation (a merged q_a + kv_a projection reads one): ``layers/quantization/fp8_utils.py``, every
  CUDA path of ``dispatch_w8a8_block_fp8_linear`` (DeepGEMM, FlashInfer TRT-LLM groupwise) calls
  ``sglang_per_token_group_quant_fp8`` and then the GEMM. ``bmm_quant``: MLA's absorbed bmms on FP8
  ``w_kc`` / ``w_vc`` quantize their input first too (``models/deepseek_v2.py``:
  ``per_tensor_quant_mla_fp8`` before ``bmm_fp8``, or DeepGEMM's masked group quantization), a
  kernel of the same kind. AIConfigurator's FP8-block GEMM rows time the GEMM on an already
  quantized input.
- ``mla_rope``, ``kv_write`` and ``mla_q_concat`` (MLA on the TRT-LLM MLA backend, SGLang's default
  for DeepSeek on Blackwell): ``models/deepseek_v2.py`` applies ``rotary_emb`` to q_pe and k_pe as a
  kernel of its own, the backend's ``forward_decode`` writes the new latent and rope key into the
  cache (``token_to_kv_pool.set_mla_kv_buffer``) and concatenates the absorbed q_nope and q_pe into
  one query (``_concat_mla_absorb_q_general``) before its decode kernel; ``fp8_q_in_rope``: with an
  FP8 cache ``layers/attention/trtllm_mla_backend.py`` replaces the rope by one
  ``mla_rope_quantize_fp8`` that also lays out the query, so there is no concatenation. The trace
  fuses the rope into the neighbouring norm's vector kernel, counts the cache write in the
  attention's bytes and has no concatenation.
- ``kv_write`` (GQA/MHA) unless ``bf16_kv_in_rope``: ``models/utils.py``
  ``enable_fused_set_kv_buffer`` (CUDA and a bf16 KV cache) lets the model's rope kernel write K and
  V into the cache (``gpt_oss.py``, ``qwen3_moe.py`` pass ``fused_set_kv_buffer_arg``); with another
  cache dtype the write is a kernel.
- ``rope`` after per-head q/k norms: ``models/qwen3_moe.py`` runs ``apply_qk_norm`` (the shared
  helper of ``models/utils.py``, its k norm on a second stream) and then ``rotary_emb`` (with the
  cache write above) as separate kernels, where the trace fuses the norms and the rope into one
  vector kernel (the fused q/k-norm + rope kernel is opt-in: ``--enable-fused-qk-norm-rope``). Any
  model whose attention has ``q_norm`` / ``k_norm`` modules gets it (Qwen3, GLM-4.5, Gemma 3/4).
Not added for SGLang (not read or not separable): the MoE routing, align/sort and finalize kernels
around the measured expert rows (which of them a measured row holds depends on the MoE runner the
server picked).

vLLM's were read in the releases the serving anchors name, from their PyPI wheels: 0.10.2 (GPUStack's
H100 runs) and 0.11.0 (its A100 runs); dstack's H200 runs name 0.7.4.dev181+gf35f8e22, a commit of
early March 2025 no release holds, read as the two releases around it, 0.7.3 and 0.8.0, which agree
on every rule below but MLA's query concatenation (read in 0.8.0 and 0.10.2: 0.7.3 has no FlashMLA
backend yet, which dstack's runs chose); paths are under ``vllm/``:
- ``act_quant``: ``model_executor/layers/quantization/utils/fp8_utils.py``
  ``apply_w8a8_block_fp8_linear`` calls ``per_token_group_quant_fp8`` (a Triton kernel) and then
  the GEMM on every path (CUTLASS ``cutlass_scaled_mm``, Triton ``w8a8_block_fp8_matmul``, DeepGEMM
  in 0.10.2). ``marlin_fp8``: none without FP8 tensor cores, where ``layers/quantization/fp8.py``
  ``Fp8LinearMethod`` serves FP8 weights with weight-only Marlin GEMMs (``use_marlin`` below compute
  capability 8.9). No ``bmm_quant``: from 0.8.0 MLA's ``process_weights_after_loading`` dequantizes
  ``kv_b_proj`` into bf16 ``W_UK_T`` / ``W_UV`` ("we currently do not have quantized bmm's": the bmms
  run in 16 bits; ``attention/backends/mla/common.py``, ``v1/attention/backends/mla/common.py``);
  0.7.3 has no bmm at all (``VLLM_MLA_PERFORM_MATRIX_ABSORPTION``, on by default, multiplies W_UK
  into q_b and W_UV into o_proj, FP8 GEMMs quantized as above). 0.7.3-0.8.0 project q_a and kv_a
  with two ``ReplicatedLinear`` (two quantizations of one activation, where the trace's merged GEMM
  gets one; 0.10.2 merges them into ``fused_qkv_a_proj``).
- ``mla_rope``, ``kv_write``, ``mla_q_concat`` (MLA): ``MLACommonImpl.forward`` applies
  ``self.rotary_emb`` to the decode q_pe and k_pe and writes the latent and rope key with
  ``ops.concat_and_cache_mla``; FlashMLA's ``_forward_decode`` concatenates q_nope and q_pe
  (``torch.cat``) before ``flash_mla_with_kvcache``, whatever the cache dtype.
- ``kv_write`` (GQA/MHA), for every cache dtype: the V1 backends' ``forward`` write K and V with a
  kernel of their own before the attention kernel (``v1/attention/backends/flash_attn.py``
  ``reshape_and_cache_flash``; ``triton_attn.py`` ``triton_reshape_and_cache_flash``, the backend
  ``platforms/cuda.py`` picks for attention sinks below compute capability 9: gpt-oss on A100).
  AIConfigurator's vLLM attention rows time the backend's ``impl.forward`` alone, at vLLM 0.24 (not
  read here: later backends move the write out of ``forward``, ``forward_includes_kv_cache_update``).
- ``marlin_moe``: ``model_executor/layers/quantization/mxfp4.py`` ``get_mxfp4_backend`` serves MXFP4
  experts with Marlin below compute capability 9 (here: a device without FP8 tensor cores). Its
  ``Mxfp4MoEMethod.apply`` routes with ``FusedMoE.select_experts``: ``fused_topk`` casts the logits
  to fp32 and renormalizes the top-k weights with a sum and a division
  (``layers/fused_moe/fused_moe.py``; three kernels beyond the top-k-softmax the trace holds), then
  ``fused_marlin_moe`` (``layers/fused_moe/fused_marlin_moe.py``) runs ``moe_align_block_size``,
  zeroes a new workspace (``marlin_make_workspace_new``), applies ``swigluoai_and_mul`` between its
  two GEMMs and sums the top-k outputs (``torch.sum``). The whole MoE is one custom op
  (``moe_forward``), opaque to torch.compile, so these run as kernels of their own. On Hopper
  (``triton_kernels`` installed) the experts are one ``triton_kernel_moe_forward`` whose routing
  AIConfigurator's MXFP4 rows hold (their collector times ``FusedMoE.forward`` from router logits).
Not added for vLLM: its rope after q/k norms (vLLM 0.10+ compiles the norms and the rope with
Inductor, which decides their fusion); the routing of DeepSeek's grouped top-k (0.7.3-0.8.0 run it
as a compiled torch function - three ``aten.topk`` and the pointwise kernels between them - where
0.10+ call one fused ``ops.grouped_topk``, and kadapt has no framework release to tell them apart);
the MoE kernels around the FP8 and bf16 expert rows (their collector times ``fused_experts``, which
holds the quantization, alignment, activation and sum).
"""

from __future__ import annotations

from ..model.quant import DTYPE_BYTES
from ..model.tracer import Op
from ..tables.device import Device

RULES = {
    "sglang": (
        "act_quant",
        "bmm_quant",
        "mla_rope",
        "mla_q_concat",
        "fp8_q_in_rope",
        "kv_write",
        "bf16_kv_in_rope",
        "rope",
    ),
    "vllm": ("act_quant", "marlin_fp8", "mla_rope", "mla_q_concat", "kv_write", "marlin_moe"),
}
# the per-kernel floor (us) of a small kernel under CUDA graphs, per device: chosen on the development
# source of benchmarks/serving_gap.py (SGLang Cookbook DeepSeek-R1, B200, concurrency 1), the median
# over its points of the floor that closes each one's gap (3.99 us), and scored once on the other
# points of that release; a device with none takes its profile's per-kernel overhead (op_overhead_us)
FLOOR_US = {"b200": 4.0}
SCALE_GROUP = 128  # channels per fp32 scale of the per-token-group FP8 quantization (both frameworks)


def floor(device: Device) -> float:
    """The per-kernel floor (s) of an engine kernel on ``device``."""
    return FLOOR_US[device.name] * 1e-6 if device.name in FLOOR_US else device.op_overhead


def _kernel(anchor: Op, rule: str, nbytes: float) -> Op:
    return Op(
        f"{rule}(engine)",
        anchor.module,
        anchor.scope,
        anchor.repeat,
        "vector",
        0.0,
        nbytes,
        "vector",
        attrs={"engine_kernel": rule},
    )


def _quant(op: Op) -> Op:
    """The FP8 group quantization of an FP8-block GEMM's input: bf16 read, fp8 and scales written."""
    elements = float(op.attrs.get("m", 1)) * float(op.attrs.get("k", 0))
    if "tag" in op.attrs:  # MLA's absorbed bmm: one matrix per head (``batch``)
        elements *= float(op.attrs.get("batch", 1))
    return _kernel(op, "act_quant", elements * 3 + elements / SCALE_GROUP * 4)


def _qk_normed(ops: list[Op]) -> set[tuple[str, str]]:
    """``(scope, module)`` of every module holding a per-head ``q_norm`` / ``k_norm`` vector kernel
    below it (each enclosing module of one): an attention there has q/k norms. One pass over the step,
    not one per attention op."""
    normed: set[tuple[str, str]] = set()
    for o in ops:
        parent, _, leaf = o.module.rpartition(".")
        if o.kind != "vector" or leaf not in ("q_norm", "k_norm"):
            continue
        while parent:
            normed.add((o.scope, parent))
            parent = parent.rpartition(".")[0]
    return normed


def _attention_kernels(op: Op, rules: tuple[str, ...], qk_norm: bool) -> list[Op]:
    """The rope and cache-write kernels the engine runs around an MLA or GQA attention op of a decode
    step (none around other attention kernels: their engines' source has not been read for them)."""
    a = op.attrs
    tokens = float(a["batch"]) * float(a["seq"])
    kv_bytes = DTYPE_BYTES.get(str(a["kv_dtype"]), 2)
    out = []
    if a.get("kernel") == "mla":  # one latent + rope key per token, never windowed
        elements = (
            float(a["kv_bytes"]) / (float(a["batch"]) * (float(a["past"]) + float(a["seq"]))) / kv_bytes
        )
        rope_dim = elements - next(g[1] for g in a["module_gemms"] if g[0] == "mla_bmm_pre")  # - kv_lora_rank
        if "mla_rope" in rules:  # q_pe of every head and k_pe, read and written in bf16
            out.append(_kernel(op, "mla_rope", tokens * (float(a["heads"]) + 1) * rope_dim * 2 * 2))
        if "kv_write" in rules:  # the new latent + rope key, read in bf16, written in the cache dtype
            out.append(_kernel(op, "kv_write", tokens * elements * (2 + kv_bytes)))
        folded = "fp8_q_in_rope" in rules and kv_bytes != 2  # the rope kernel lays out an FP8 query
        if "mla_q_concat" in rules and not folded:  # [q_nope W_UK, q_pe] into one bf16 query
            out.append(_kernel(op, "mla_q_concat", tokens * float(a["heads"]) * elements * 2 * 2))
    elif a.get("kernel") == "gqa":
        in_rope = "bf16_kv_in_rope" in rules and a["kv_dtype"] == "bf16"  # the rope kernel writes it
        if "kv_write" in rules and not in_rope:  # K and V of the rank's KV heads
            elements = 2 * float(a["kv_heads"]) * float(a["head_dim"])
            out.append(_kernel(op, "kv_write", tokens * elements * (2 + kv_bytes)))
        if "rope" in rules and qk_norm:  # q and k of the rank's heads, read and written in bf16
            heads = float(a["heads"]) + float(a["kv_heads"])
            out.append(_kernel(op, "rope", tokens * heads * float(a["head_dim"]) * 2 * 2))
    return out


def _marlin_moe(op: Op) -> list[Op]:
    """vLLM's kernels around Marlin's two MXFP4 expert GEMMs (``fused_marlin_moe`` and the routing
    of ``fused_topk``) beyond the experts op and the top-k kernel the trace holds; bf16 activations,
    fp32 routing weights, int32 ids."""
    a = op.attrs
    tokens, top_k, experts = float(a["tokens"]), float(a["top_k"]), float(a["experts"])
    pairs, hidden, width = tokens * top_k, float(a["hidden"]), float(a["width"])
    return [
        _kernel(op, "moe_logits_fp32", tokens * experts * (2 + 4)),
        _kernel(op, "moe_renorm_sum", pairs * 4 + tokens * 4),
        _kernel(op, "moe_renorm_div", pairs * 4 * 2 + tokens * 4),
        _kernel(op, "moe_align", pairs * 4 * 2 + experts * 4),  # ids read, sorted ids written
        _kernel(op, "moe_workspace", 0.0),  # a few KB of int32 zeros: its floor
        _kernel(op, "moe_act", pairs * width * 2 * 3),  # gate and up read, their product written
        _kernel(op, "moe_sum", pairs * hidden * 2 + tokens * hidden * 2),
    ]


def engine_kernels(ops: list[Op], framework: str, decode: bool, device: Device) -> list[Op]:
    """``ops`` with the engine's small kernels inserted before the op each belongs to (its anchor:
    the GEMM it feeds, the attention it prepares, the experts it routes and reduces), in the anchor's
    module so they overlap with it (a shared expert's quantization runs on the shared experts'
    stream). Decode steps only: a prefill's kernels are not at their floors. ``device`` picks vLLM's
    FP8 linear and MXFP4 MoE paths (Marlin without FP8 tensor cores)."""
    rules = RULES.get(framework, ())
    if not rules or not decode:
        return list(ops)
    fp8_cores = "fp8" in device.peak_flops
    quantizes = {"act_quant", "bmm_quant"} & set(rules) if fp8_cores or "marlin_fp8" not in rules else set()
    marlin = "marlin_moe" in rules and not fp8_cores
    normed = _qk_normed(ops)
    out: list[Op] = []
    quantized: set[tuple[str, int]] = set()
    for op in ops:
        if op.kind == "matmul" and op.attrs.get("kernel") == "fp8_block":
            bmm = "tag" in op.attrs
            key = (op.scope, int(op.attrs.get("activation", id(op))))
            if ("bmm_quant" if bmm else "act_quant") in quantizes and key not in quantized:
                quantized.add(key)
                out.append(_quant(op))
        if op.kind == "attention" and op.attrs.get("decode"):
            out += _attention_kernels(op, rules, (op.scope, op.module) in normed)
        if marlin and op.kind == "experts" and op.attrs.get("kernel") == "w4a16_mxfp4":
            out += _marlin_moe(op)
        out.append(op)
    return out
