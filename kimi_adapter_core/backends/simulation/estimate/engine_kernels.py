"""The small kernels a serving engine launches around the traced ones, which the trace does not hold.

Why: at one request in flight nearly every kernel of a decode step runs at its floor, and a served
step launches kernels neither kadapt's trace nor AIConfigurator's graph holds as kernels of their own
(docs/cost_model.md, "What the anchors miss at one request at a time"). Which ones a framework runs
is read from that framework's published source, one rule each, never fitted; only their price has a
free parameter, the per-kernel floor (``FLOOR_US``). Each is priced as a memory roofline (the bytes
it moves at the device's flat memory efficiency) plus that floor, and its row says so (``source``).

Rules are written for SGLang only (``RULES``); another framework adds nothing until its source has
been read the same way. Read at sgl-project/sglang's main branch and in older copies of the same
files; the served release itself (0.5.6 on the cookbook's B200 points) was not read, so a rule may
describe a path that release did not take yet (its Qwen3 rope + cache-write fusion predates it:
sgl-project/sglang PR 10985, merged, already gates it for mRoPE):
- ``act_quant``: one activation quantization before every FP8 block-scaled GEMM, one per distinct
  activation (a merged q_a + kv_a projection reads one): ``layers/quantization/fp8_utils.py``, every
  CUDA path of ``dispatch_w8a8_block_fp8_linear`` (DeepGEMM, FlashInfer TRT-LLM groupwise) calls
  ``sglang_per_token_group_quant_fp8`` and then the GEMM; MLA's absorbed bmms on FP8 ``w_kc`` /
  ``w_vc`` quantize their input first too (``models/deepseek_v2.py``: ``per_tensor_quant_mla_fp8``
  before ``bmm_fp8``, or DeepGEMM's masked group quantization). AIConfigurator's FP8-block GEMM rows
  time the GEMM on an already quantized input.
- ``mla_rope``, ``kv_write`` and ``mla_q_concat`` (MLA on the TRT-LLM MLA backend, SGLang's default
  for DeepSeek on Blackwell): ``models/deepseek_v2.py`` applies ``rotary_emb`` to q_pe and k_pe as a
  kernel of its own (with an FP8 cache ``layers/attention/trtllm_mla_backend.py`` replaces it by one
  ``mla_rope_quantize_fp8``), the backend's ``forward_decode`` writes the new latent and rope key into
  the cache (``token_to_kv_pool.set_mla_kv_buffer``) and, with a bf16 cache, concatenates the
  absorbed q_nope and q_pe into one query (``_concat_mla_absorb_q_general``) before its decode
  kernel. The trace fuses the rope into the neighbouring norm's vector kernel, counts the cache write
  in the attention's bytes and has no concatenation.
- ``kv_write`` (GQA/MHA) unless fused: ``models/utils.py`` ``enable_fused_set_kv_buffer`` (CUDA and a
  bf16 KV cache) lets the model's rope kernel write K and V into the cache (``gpt_oss.py``,
  ``qwen3_moe.py`` pass ``fused_set_kv_buffer_arg``); with another cache dtype the write is a kernel.
- ``rope`` after per-head q/k norms: ``models/qwen3_moe.py`` runs ``apply_qk_norm`` (the shared
  helper of ``models/utils.py``, its k norm on a second stream) and then ``rotary_emb`` (with the
  cache write above) as separate kernels, where the trace fuses the norms and the rope into one
  vector kernel (the fused q/k-norm + rope kernel is opt-in: ``--enable-fused-qk-norm-rope``). Any
  model whose attention has ``q_norm`` / ``k_norm`` modules gets it (Qwen3, GLM-4.5, Gemma 3/4).
Not added (not read or not separable): the MoE routing, align/sort and finalize kernels around the
measured expert rows (which of them a measured row holds depends on the MoE runner the server picked).
"""

from __future__ import annotations

from ..model.quant import DTYPE_BYTES
from ..model.tracer import Op
from ..tables.device import Device

RULES = {"sglang": ("act_quant", "mla_rope", "mla_q_concat", "kv_write", "rope")}
# the per-kernel floor (us) of a small kernel under CUDA graphs, per device: chosen on the development
# source of benchmarks/serving_gap.py (SGLang Cookbook DeepSeek-R1, B200, concurrency 1), the median
# over its points of the floor that closes each one's gap (3.99 us), and scored once on the other
# points of that release; a device with none takes its profile's per-kernel overhead (op_overhead_us)
FLOOR_US = {"b200": 4.0}
SCALE_GROUP = 128  # channels per fp32 scale of SGLang's per-token-group FP8 quantization


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
        if "mla_q_concat" in rules and kv_bytes == 2:  # [q_nope W_UK, q_pe] into one bf16 query
            out.append(_kernel(op, "mla_q_concat", tokens * float(a["heads"]) * elements * 2 * 2))
    elif a.get("kernel") == "gqa":
        # enable_fused_set_kv_buffer: a bf16 cache is written by the rope kernel
        if "kv_write" in rules and a["kv_dtype"] != "bf16":  # K and V of the rank's KV heads
            elements = 2 * float(a["kv_heads"]) * float(a["head_dim"])
            out.append(_kernel(op, "kv_write", tokens * elements * (2 + kv_bytes)))
        if "rope" in rules and qk_norm:  # q and k of the rank's heads, read and written in bf16
            heads = float(a["heads"]) + float(a["kv_heads"])
            out.append(_kernel(op, "rope", tokens * heads * float(a["head_dim"]) * 2 * 2))
    return out


def engine_kernels(ops: list[Op], framework: str, decode: bool) -> list[Op]:
    """``ops`` with the engine's small kernels inserted before the op each belongs to (its anchor:
    the GEMM it feeds, the attention it prepares), in the anchor's module so they overlap with it
    (a shared expert's quantization runs on the shared experts' stream). Decode steps only: a
    prefill's kernels are not at their floors."""
    rules = RULES.get(framework, ())
    if not rules or not decode:
        return list(ops)
    out: list[Op] = []
    quantized: set[tuple[str, int]] = set()
    for op in ops:
        if "act_quant" in rules and op.kind == "matmul" and op.attrs.get("kernel") == "fp8_block":
            key = (op.scope, int(op.attrs.get("activation", id(op))))
            if key not in quantized:
                quantized.add(key)
                out.append(_quant(op))
        if op.kind == "attention" and op.attrs.get("decode"):
            qk_norm = any(
                o.kind == "vector"
                and o.scope == op.scope
                and o.module.startswith(op.module + ".")
                and o.module.rpartition(".")[2] in ("q_norm", "k_norm")
                for o in ops
            )
            out += _attention_kernels(op, rules, qk_norm)
        out.append(op)
    return out
