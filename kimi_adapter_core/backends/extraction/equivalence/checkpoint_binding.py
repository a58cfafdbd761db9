"""The tiny model's weights as a runtime gets them: saved by save_pretrained, bound through the weight map.

Verify does not hand the graphs the model's tensors: it writes a real checkpoint with transformers'
``save_pretrained`` (in the spec's published names when it renames weights) and reads it back with
the weight map's reference loader, so the map, the layout and the loader are proven with the graphs."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ....checkpoint.naming import rename_weight
from ..options import MERGED, ExtractionOptions
from .verdict import VerifyReport


def check_weights(report: VerifyReport, options: ExtractionOptions, weights: dict[str, torch.Tensor]) -> None:
    """Every IR weight must bind to a checkpoint tensor of the same shape and dtype."""
    import torch_ir
    from torch_ir.weight_loader import validate_weights_against_ir

    problems = []
    for kind in ("prefill", "decode", *((MERGED,) if options.merged_prefill is not None else ())):
        problems += validate_weights_against_ir(weights, torch_ir.load_ir(options.path(kind)))
    report.add(
        "weights bind to checkpoint names", not problems, "; ".join(problems) or "all names, shapes, dtypes"
    )


def saved_and_loaded(model: nn.Module, options: ExtractionOptions, tmp: Path) -> dict[str, torch.Tensor]:
    """The graph weights as a serving runtime gets them: the tiny model written by transformers'
    ``save_pretrained`` (the layout checkpoints have: per-expert tensors, upstream's names), read back
    through the weight map the export wrote. A weight map naming a tensor the checkpoint lacks, or
    rebuilding one wrongly, fails here or in the replay.

    A spec that states ``weight_renames`` describes a published layout ``save_pretrained`` does not
    write (for Kimi-K2.5 it writes ``language_model.model.blocks.N``, which its loader accepts but no
    published checkpoint has): the saved names are then put through transformers' own loading renames
    and the spec's, the path every name of such a checkpoint takes into the model. The tiny checkpoint
    is dense, so the map's ``storage`` blocks (int4 packing, FP8 block scales, MXFP4 of the full-size
    checkpoint) are left out; tests/test_weight_map.py loads those formats."""
    from transformers.utils import logging as hf_logging

    from ....checkpoint.loader import load_weights

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" is not verify's output
    try:
        model.save_pretrained(tmp / "checkpoint")
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    checkpoint = tmp / "checkpoint"
    if options.weight_renames:
        checkpoint = _in_spec_names(model, checkpoint, options.weight_renames, tmp / "renamed")
    doc = json.loads(options.path("weight_map").read_text())
    for entry in doc["weights"].values():
        for group in entry["sources"]:
            group.pop("storage", None)
    return in_torch_memory(load_weights(doc, checkpoint))


def in_torch_memory(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` copied into tensors torch allocates (64-byte aligned), as the model's parameters are.

    safetensors hands out each tensor where it lies in the file, right after the tensors before it (so
    aligned to its element size only), and CPU GEMM kernels (MKL's on AVX-512 here) sum in another order
    for an operand that is not 64-byte aligned: the same float32 ``linear`` then differs from
    transformers' in the last bit. A bf16 graph can round that into a logit ulp many steps later
    (DeepSeek-V4-Flash's hyper-connection ``attn_hc.fn``, fp32: tokens parted from ``generate`` after
    178 of 200 decode steps), which verify would blame on the graph. Where a runtime puts its weights
    is its own affair; verify compares the graphs' math."""
    return {name: tensor.clone() for name, tensor in weights.items()}


def _in_spec_names(model: nn.Module, saved: Path, renames: tuple[tuple[str, str], ...], out: Path) -> Path:
    """``saved`` rewritten with every tensor under the name the spec's layout gives it: transformers'
    loading renames (not its converters: fused tensors stay split, as on disk), then ``renames``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ....checkpoint.layout import loading_renamer

    loaded_name = loading_renamer(model)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(saved.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                tensors[rename_weight(loaded_name(name), renames)] = handle.get_tensor(name)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    return out
