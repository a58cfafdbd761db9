"""``verify``: extract a tiny random model of the spec's architecture and replay the saved files.

(Not named ``verify.py``: importing such a submodule would rebind the package's ``verify`` function.)

The check runs the real path end to end: the spec is applied, a tiny model is built on meta and
extracted by ``pipeline.run`` (tracing, layer replication, JSON writing), the JSON files are loaded
back with ``torch_ir.load_ir`` and executed by ``torch_ir``'s executor with the weights of an
identical CPU model renamed to checkpoint names. The reference is transformers itself with the
patches removed (its parameters in the dtypes ``from_pretrained`` loads them with, as the graphs'):
prefill logits, then a greedy generation of ``decode_steps`` tokens that the one decode graph produces
by being fed its own present KV, must equal ``model.generate(do_sample=False)``
token for token, logits within a tolerance relative to their magnitude (``tolerance.compare``, row by
row: the same float error grows with the logits). It runs twice: in float32 against the upstream eager
experts loop (``verify_tolerance``, 1e-4 x each row's largest |logit|, at least 1: the exported math is
upstream's), and in bfloat16 against transformers running the exported experts implementation
(``verify_tolerance_ulps``, 8 bf16 ulps at each row's largest |logit|; observed 0 on 24 steps: the
graph is bit-identical to bf16 eager). A spec with a vision graph also has it
checked against ``get_image_features`` (``vision_verify``), and one with a multimodal prefill has an
image prompt run pixels -> vision IR -> merged prefill IR -> decode IR against transformers given the
pixels (``multimodal_verify``); the verify cache then grows to hold that prompt. A step graph
(``abi.step``) is served as an engine serves it (``step_replay``).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ....checkpoint.dtypes import cast_to_abi_dtype
from ....errors import KadaptError
from ....spec.model import Spec
from ....structure.derive import (
    derive_structure,
)
from ....structure.model import ModelStructure
from ..ir.mtp_export import attached
from ..job.pipeline import backbone_of, run
from ..job.whole_model import one_thread
from ..options import ExtractionOptions, bind_structure
from ..runtime import abi as runtime
from ..tiny_model import random_mtp, randomize_constants, tiny_overrides
from . import multimodal as multimodal_verify
from .checkpoint_binding import check_weights, saved_and_loaded
from .comparisons import (
    MERGED_DECODE_STEPS,
    compare_dynamic,
    compare_joining,
    compare_merged,
    compare_prompt,
    compare_ragged,
    compare_states,
)
from .reference import ABSORBED_LOW_PRECISION, reference_experts
from .replay import Replay
from .step_replay import compare_step
from .tolerance import Tolerance
from .verdict import VerifyReport
from .vision import check_vision

# transformers' chunked gated-delta scan (``torch_chunk_gated_delta_rule``) works in 64-token chunks: a
# linear stack's verify prompt is longer, so the prefill's state crosses a chunk boundary.
LINEAR_VERIFY_PROMPT = 64 + 6


def relative_tolerance(options: ExtractionOptions, structure: ModelStructure) -> float:
    """The float32 bound: the spec's ``verify.tolerance``, else ``verify_tolerance_linear`` for a stack
    with linear-attention layers (their scan's own float32 resolution) and ``verify_tolerance`` otherwise."""
    if structure.linear is not None and not options.verify_tolerance_stated:
        return options.verify_tolerance_linear
    return options.verify_tolerance


def _small_options(
    spec: Spec,
    options: ExtractionOptions,
    structure: ModelStructure,
    output_dir: Path,
    dtype: str,
    model: nn.Module,
) -> ExtractionOptions:
    """The verify sizes: a short text prompt and, with a multimodal prefill, an image prompt of the
    vision graph's placeholder tokens plus ``verify_prefill_len`` text tokens, which the cache holds."""
    prefill_len, max_cache_len = options.verify_prefill_len, options.verify_max_cache_len
    if structure.linear is not None:
        prefill_len = max(prefill_len, LINEAR_VERIFY_PROMPT)
        max_cache_len = max(max_cache_len, prefill_len + 2 * options.batch + options.verify_decode_steps)
    small = dataclasses.replace(
        options,
        output_dir=output_dir,
        prefill_len=prefill_len,
        max_cache_len=max_cache_len,
        dtype=dtype,
        structure=None,
    )
    if options.merged_prefill is not None:
        length = multimodal_verify.image_tokens(spec, model, options) + options.verify_prefill_len
        small = dataclasses.replace(
            small,
            merged_prefill=dataclasses.replace(options.merged_prefill, prefill_len=length),
            max_cache_len=max(small.max_cache_len, length + MERGED_DECODE_STEPS),
        )
    if small.step is not None and small.step.aux_layers:  # the spec's layers, folded into the tiny stack
        aux = tuple(sorted({min(layer, structure.num_layers - 1) for layer in small.step.aux_layers}))
        small = dataclasses.replace(small, step=dataclasses.replace(small.step, aux_layers=aux))
    if small.paged is not None:  # whole blocks, and a spare row's worth so blocks land out of order
        size = small.paged.block_size
        per_row = -(-small.max_cache_len // size)
        small = dataclasses.replace(
            small,
            max_cache_len=per_row * size,
            paged=dataclasses.replace(small.paged, num_blocks=(small.batch + 1) * per_row),
        )
    return bind_structure(small, structure)


def _verify_in(
    spec: Spec,
    options: ExtractionOptions,
    config: Any,
    text_config: Any,
    structure: ModelStructure,
    dtype: str,
    report: VerifyReport,
    echo: Callable[[str], Any],
    processes: int,
    keep_in: Path | None,
) -> None:
    """One round trip with the tiny model, graphs and reference all in ``dtype``; the graphs go to
    ``keep_in`` (with apply's whole-model check first) when it is given, else to a temp folder."""
    from ....loading import applied, load_model

    bf16 = dtype != "float32"
    torch_dtype = getattr(torch, dtype)
    with tempfile.TemporaryDirectory(prefix="kadapt-verify-") as tmp:
        torch.manual_seed(0)
        with applied(spec, backend="extraction"):
            model = load_model(spec, device="cpu", config=config, dtype=torch_dtype).eval()
            # the reference holds what from_pretrained(dtype=...) loads, as the graphs do: transformers
            # 5.23 builds DeepSeek-V4's float32-kept parameters in the model's dtype, its loader in float32
            cast_to_abi_dtype(model, [model], torch_dtype)
            randomize_constants(model)
            meta = load_model(spec, device="meta", config=config, dtype=torch_dtype).eval()
            small = _small_options(spec, options, structure, keep_in or Path(tmp), dtype, meta)
            merged = f", image prompt {small.merged_prefill.prefill_len}" if small.merged_prefill else ""
            echo(
                f"verify: tiny {type(model).__name__}, {text_config.num_hidden_layers} layers, "
                f"{small.attention_label}, {dtype}, prefill {small.prefill_len}{merged}, "
                f"cache {small.max_cache_len}"
            )
            run(
                spec,
                meta,
                small,
                echo=lambda line: echo(f"  {line.strip()}"),
                check_whole=keep_in is not None,
                processes=processes,
            )
        if small.step is not None and small.step.mtp is not None:  # the MTP layer where checkpoints hold it
            with attached(backbone_of(spec, model), random_mtp(model)) as layer:
                cast_to_abi_dtype(model, [layer], torch_dtype)
                weights = saved_and_loaded(model, small, Path(tmp))
        else:
            weights = saved_and_loaded(model, small, Path(tmp))
        if not bf16:
            check_weights(report, small, weights)
        replay = Replay(small, weights)
        prompt = torch.randint(
            3,
            text_config.vocab_size,
            (small.batch, small.prefill_len),
            generator=torch.Generator().manual_seed(2),
        )
        ulps = options.verify_tolerance_ulps
        tolerance = Tolerance.of(dtype, relative=relative_tolerance(options, structure), ulps=ulps)
        if tolerance.in_ulps:
            report.tolerance_ulps = tolerance.limit
        suffix = f" ({dtype})" if bf16 else ""
        with reference_experts(text_config, bf16):
            compare_prompt(
                report, model, replay, prompt, options.verify_decode_steps, tolerance=tolerance, suffix=suffix
            )
            if small.dynamic:
                compare_dynamic(report, model, replay, prompt, small, tolerance=tolerance, suffix=suffix)
            # states beyond a KV cache, or KV caches of different shapes per layer (each is its own)
            if any(kind != "attention" for kind in small.layer_kinds) or small.layer_kv_dims is not None:
                steps = options.verify_decode_steps
                compare_states(report, model, replay, prompt, steps, tolerance=tolerance, suffix=suffix)
            # linear states take every prompt token, a compressor's ring is placed from the prompt's
            # length: rows join instead of padding
            if small.batch > 1:
                unpadded = (*runtime.UNPADDED_KINDS, *runtime.COMPRESSED_KINDS)
                linear = any(kind in unpadded for kind in small.layer_kinds)
                (compare_joining if linear else compare_ragged)(
                    report,
                    model,
                    replay,
                    prompt,
                    steps=options.verify_decode_steps,
                    tolerance=tolerance,
                    suffix=suffix,
                )
            if small.step is not None:  # the packed step graph, fed as an engine feeds it
                steps = options.verify_decode_steps
                compare_step(
                    report, model, small, weights, prompt, steps=steps, tolerance=tolerance, suffix=suffix
                )
        if small.vision is not None:
            check_vision(report, spec, model, small, weights, tolerance=tolerance, suffix=suffix)
        if small.merged_prefill is not None:  # the vision graph checked, then used for an image prompt
            with reference_experts(text_config, bf16):
                compare_merged(
                    report,
                    spec,
                    model,
                    replay,
                    small,
                    weights,
                    vocab_size=text_config.vocab_size,
                    tolerance=tolerance,
                    suffix=suffix,
                )


def verify(
    spec: Spec,
    options: ExtractionOptions,
    *,
    echo: Callable[[str], Any],
    processes: int = 1,
    keep_in: Path | None = None,
) -> VerifyReport:
    """Extract, save, reload and replay a tiny model of ``spec`` in each verify dtype; compare with
    transformers in the same dtype (``processes`` 2: its graphs traced in two forked children).

    ``keep_in``: the first dtype's extraction is an ``apply`` of the tiny model into that folder, with
    every check apply makes before exporting (the whole-model check too), and its files stay there.
    For a caller whose model is already tiny (the family trial) that is one extraction where apply
    then verify would make two of the same architecture."""
    from ....loading import load_config

    start = time.perf_counter()
    config = load_config(spec, backend="extraction", overrides=tiny_overrides(spec, options))
    text_config = getattr(config, spec.abi.config) if spec.abi is not None and spec.abi.config else config
    if text_config.num_hidden_layers < 2:
        raise KadaptError("verify needs a tiny model with at least 2 decoder layers")
    structure = derive_structure(text_config, spec)
    bound = bind_structure(dataclasses.replace(options, structure=None), structure)
    report = VerifyReport(
        bound.kv_layout or "",
        relative_tolerance(options, structure),
        bound.mla_attention,
        bound.attention_label,
    )
    for dtype in options.verify_dtypes:
        if dtype != "float32" and bound.mla_attention == "absorbed":
            report.notes.append(ABSORBED_LOW_PRECISION)
            continue
        with one_thread():  # tiny models: one intra-op thread, no spin-waiting pool
            kept = keep_in if dtype == options.verify_dtypes[0] else None
            _verify_in(spec, options, config, text_config, structure, dtype, report, echo, processes, kept)
    report.seconds = time.perf_counter() - start
    return report
