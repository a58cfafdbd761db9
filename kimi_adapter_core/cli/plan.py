"""``kadapt plan SPEC``: size a deployment before loading anything (KV cache, weights, activations,
vision cache per image and, with ``--images``, for the batch).

Pure Python from the spec's shipped config and the model structure derived from it (any decoder
family: MHA/GQA/MQA/MLA attention, dense or MoE, sliding windows, gated-DeltaNet hybrid stacks with
their constant per-request linear-attention state): never imports torch, so it
answers instantly. A device is
optional; with one, the report adds capacity and free memory, and a deployment that does not fit
prints a ``WARNING:`` line (exit 0: a plan is advice, not a launch). The plan is the answer, so
``-q`` still prints it; ``-v`` adds the resolved spec path and the device profile used.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..backends.simulation.estimate.planner import make_plan
from ..backends.simulation.model.inputs import model_inputs
from ..backends.simulation.model.parallel import Parallel, framework_moe_tp
from ..backends.simulation.report.plan import plan_json, plan_text
from ..backends.simulation.tables.device import get_device
from ..spec import load_spec
from .deployment_options import deployment_options, image_options, requested_images
from .output import format_option, reporter, verbosity_options
from .spec_argument import spec_argument


@click.command(name="plan")
@spec_argument()
@deployment_options
@click.option("--batch", type=int, default=1, show_default=True, help="Concurrent sequences (split over dp).")
@click.option(
    "--seq-len", type=int, default=None, help="Tokens per sequence to cache [default: max positions]."
)
@click.option(
    "--prefill-chunk",
    type=int,
    default=8192,
    show_default=True,
    help="Tokens per rank in the largest forward (for the activation estimate).",
)
@image_options
@format_option
@verbosity_options
def command(
    spec_path: Path,
    tp: int,
    dp: int,
    ep: int,
    moe_tp: int | None,
    batch: int,
    seq_len: int | None,
    prefill_chunk: int,
    kv_dtype: str,
    quant: str | None,
    device: str | None,
    device_file: Path | None,
    images: int | None,
    image_size: tuple[int, int] | None,
    fmt: str,
) -> None:
    """Size KV cache, max length, weights per device, activations and the vision cache.

    The vision cache is reported per image (MAX's entry for the largest image and, with --images, the
    features of one --image-size image) and for the batch (--batch sequences x --images images, total
    and per device).

    A hybrid stack (linear-attention or SSM layers beside attention: Qwen3-Next, Qwen3.5, Kimi-Linear,
    Nemotron-H, MiniMax-Text-01) caches KV in its attention layers only; each linear layer keeps its
    recurrent state (and a conv window where it has one) per request, constant in the context, sized
    beside the KV cache and counted in memory.

    A DSA stack (DeepSeek-V3.2, GLM-5) also caches one indexer key per token in each indexed layer
    (FP8 with an fp32 scale per 128 channels, as serving runtimes keep them; replicated over TP),
    growing with the context beside the latent KV cache (with --kv-dtype fp8 sized as sparse MLA
    runtimes store it: 512 fp8 + an fp32 scale per 128 + 64 bf16 rope, 656 B); the indexer's weights
    are counted in its layers. DeepSeek-V4's compressed layers keep their compressed entries (growing
    1/4 or 1/128 as fast as a KV cache) and a ring of the open window, beside a sliding-window KV cache.

    Sliding-window and chunked layers (Gemma, Llama-4) keep one window or chunk per request; layers
    of different shapes (Gemma-4) are sized each by its own.

    JSON (--format json): {"model_type", "architecture", "parallel", "batch", "seq_len",
    "max_seq_len", "kv_cache", "quantization", "weights", "activation_formula",
    "memory_per_device", "vision_cache_entry_bytes", "vision_cache", "device", "warnings"}; a stack
    with state beyond its KV cache adds "states": each state kind ("attention_kv",
    "linear_attention", "indexer_keys", "compressed_entries") with its layers, bytes and whether it
    grows with the context.

    \b
    Examples:
      kadapt plan kimi_k25 --tp 8 --ep 8 --device h200
      kadapt plan kimi_k25 --tp 8 --ep 8 --batch 4 --images 2 --image-size 896x896
      kadapt plan specs/llama.yaml --seq-len 32768 --format json
    """
    out = reporter(fmt)
    out.detail(f"spec: {spec_path.resolve()}")
    spec = load_spec(spec_path)
    for line in spec.deprecations:
        out.note(line)
    if quant is not None and ("," in quant or quant.strip().upper() == "ALL"):
        raise click.UsageError(f"--quant {quant}: a list of modes or 'all' applies to simulate --sweep")
    inputs = model_inputs(spec, quant)
    requested = requested_images(spec, inputs.arch, images, image_size)
    profile = get_device(device, device_file) if (device or device_file) else None
    out.detail(f"device: {device_file.resolve() if device_file else device or 'none'}")
    if moe_tp is None:
        moe_tp = framework_moe_tp(inputs.arch.structure, tp * dp, ep)
    plan = make_plan(
        inputs,
        Parallel(tp=tp, dp=dp, ep=ep, moe_tp=moe_tp),
        batch=batch,
        seq_len=seq_len,
        prefill_chunk=prefill_chunk,
        kv_dtype=kv_dtype,
        device=profile,
        images=requested,
    )
    if out.json:
        out.document(plan_json(plan))
    else:
        out.result(plan_text(plan))
