"""``python -m kimi_adapter_core.families.parts [MODEL_TYPE ...] [--write]``

Regenerates ``layer_parts.json``, the table of where each family's decoder layers keep their parts
(read by ``backends/simulation/model/layer_parts.py``, so ``kadapt plan`` names a family's tensors
without building it). Each model type's small config (``tiny``) is built on meta, as the family
matrix builds it, and the parameters of its first attention, dense and MoE layer are classified into
the roles the inventory prices: the layer's norms, the attention's fused q/k/v or output projection,
the MLP block and its projections (gated, fused ``gate_up`` or ungated), the router,
a sigmoid router's correction bias, the shared expert (its projections and gate) and whether the
routed experts are gated. An entry keeps only what departs from transformers' usual layer
(``layer_parts.USUAL``): most families have none. Without ``--write`` it prints the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from collections.abc import Iterable
from typing import Any

from ..atomic import atomic_write_text
from ..backends.simulation.model.layer_parts import PARTS_TABLE, USUAL
from ..errors import KadaptError
from .catalog import model_types

# class-name fragments of a layer's token mixer (LFM2's ``Lfm2ShortConv`` too); names of an attention's
# output projection; names of a fused q/k/v projection; name fragments of an MLP's gate projection
# (Llama's original ``w1``, which LFM2 keeps beside ``w3`` up and ``w2`` down)
MIXER_CLASSES = ("attn", "attention", "mixer", "shortconv")
ATTENTION_CLASSES = ("attn", "attention")
O_PROJ_NAMES = ("o_proj", "dense", "out_proj", "c_proj")
FUSED_QKV_NAMES = ("qkv", "query_key_value", "c_attn")  # GPT-2's, StarCoder's: c_attn
# an attention's own output gate (HY-V4: sigmoid(gate_proj(x)) scales each head's output before o_proj)
OUTPUT_GATE = "gate_proj"
GATE_NAMES = ("gate", "w1")


def _weights(module: Any) -> dict[str, tuple[int, ...]]:
    """``module``'s children's 2-D weights, by child name (``gate_proj`` for ``gate_proj.weight``), as
    ``[out, in]``: GPT-2's ``Conv1D`` keeps its weight ``[in, out]``, read transposed."""
    found = {}
    children = dict(module.named_children())
    for path, param in module.named_parameters():
        name, _, leaf = path.rpartition(".")
        if leaf == "weight" and name and "." not in name and param.dim() == 2:
            conv1d = type(children.get(name)).__name__ == "Conv1D"
            found[name] = tuple(param.shape)[::-1] if conv1d else tuple(param.shape)
    return found


def projections(module: Any, hidden: int) -> dict[str, str] | None:
    """An MLP's projections by role (``gate``, ``up``, ``down``; ``gate_up``, ``down``; or ``up``,
    ``down`` when ungated), told by shape: ``down`` maps back to ``hidden``, a fused ``gate_up`` is
    twice ``down``'s input wide, and of two inputs of one shape the one named ``GATE_NAMES`` gates. None
    when ``module`` holds other weights (not an MLP)."""
    weights = _weights(module)
    down = [name for name, (out, inp) in weights.items() if out == hidden and inp != hidden]
    if len(down) != 1:
        return None
    width = weights[down[0]][1]
    roles = {"down": down[0]}
    for name, (out, inp) in weights.items():
        if inp == hidden and out == 2 * width:
            roles["gate_up"] = name
        elif inp == hidden and out == width:
            roles["gate" if any(g in name for g in GATE_NAMES) else "up"] = name
    complete = {"gate_up", "down"} <= roles.keys() or {"up", "down"} <= roles.keys()
    return roles if complete and set(roles.values()) == weights.keys() else None


def _children(module: Any) -> list[tuple[str, Any]]:
    """``module``'s children that hold parameters."""
    return [(name, child) for name, child in module.named_children() if any(True for _ in child.parameters())]


def _norms(layer: Any) -> list[str]:
    """The layer's own norms that hold a weight (a non-parametric LayerNorm holds none: OLMo's)."""
    return [
        name
        for name, child in _children(layer)
        if "norm" in type(child).__name__.lower()
        and {n for n, _ in child.named_parameters()} <= {"weight", "bias"}
    ]


def _mixers(layer: Any) -> list[tuple[str, Any]]:
    """The layer's token mixers: one, or an attention and a Mamba2 mixer side by side (Falcon-H1)."""
    return [(n, c) for n, c in _children(layer) if any(k in type(c).__name__.lower() for k in MIXER_CLASSES)]


def _mixer(layer: Any) -> tuple[str, Any] | None:
    """The layer's token mixer; of two, its attention (Falcon-H1's ``self_attn``, not its ``mamba``)."""
    mixers = _mixers(layer)
    attending = [(n, c) for n, c in mixers if any(k in type(c).__name__.lower() for k in ATTENTION_CLASSES)]
    return next(iter(attending or mixers), None)


def attention_parts(layer: Any) -> dict[str, Any]:
    """The attention's name, the layer's norms, its output gate, and a fused q/k/v or another output
    projection."""
    found = _mixer(layer)
    if found is None:
        return {}
    name, module = found
    inner = [
        (n, c) for n, c in _children(module) if any(k in type(c).__name__.lower() for k in ATTENTION_CLASSES)
    ]
    if not _weights(module) and len(inner) == 1:  # a wrapper around the attention (GPT-Neo's attn.attention)
        name, module = f"{name}.{inner[0][0]}", inner[0][1]
    weights = _weights(module)
    parts: dict[str, Any] = {"attention": name, "norms": _norms(layer)}
    if OUTPUT_GATE in weights:  # a gate on the attention's output, projected from the layer's input
        parts["output_gate"] = OUTPUT_GATE
    if {"q_proj", "k_proj", "v_proj", "o_proj"} <= weights.keys():
        return parts
    fused = [w for w in weights if any(k in w for k in FUSED_QKV_NAMES)]
    out = [w for w in O_PROJ_NAMES if w in weights]
    if fused:
        parts["qkv"] = fused[0]
    if out:
        parts["o_proj"] = out[0]
    return parts


def moe_parts(name: str, module: Any, hidden: int) -> dict[str, Any]:
    """An MoE block's router, its correction bias (None: it keeps none; plan counts one only for a
    sigmoid router, which the spec may be the one to say), the shared expert (its projections and
    gate) and whether the routed experts are gated."""
    stacked = {n: tuple(p.shape) for n, p in module.get_submodule("experts").named_parameters()}
    count = next(iter(stacked.values()))[0]
    parts: dict[str, Any] = {"moe": name, "experts_gated": "gate_up_proj" in stacked, "correction_bias": None}
    for path, param in module.state_dict(keep_vars=True).items():  # a correction bias may be a buffer
        if path.startswith("experts."):
            continue
        if path.endswith(".weight") and tuple(param.shape) == (count, hidden):
            parts["router"] = path.removesuffix(".weight")
        if path.endswith("correction_bias"):
            parts["correction_bias"] = path
    for child_name, child in _children(module):
        if child_name == "experts" or parts.get("router", "").split(".")[0] == child_name:
            continue
        weight = getattr(child, "weight", None)
        if child_name.endswith("_gate") and weight is not None and tuple(weight.shape) == (1, hidden):
            parts["shared_gate"] = child_name
        elif (mlp := projections(child, hidden)) is not None:
            parts["shared"], parts["shared_mlp"] = child_name, mlp
    if "shared" in parts:
        parts.setdefault("shared_gate", None)
    else:
        parts.pop("shared_gate", None)
    return parts


def _block(layer: Any) -> tuple[str, Any] | None:
    """The layer's MLP block: its one child besides the norms (by name, or by class: GPT-J's ``ln_1``) and
    the token mixer that holds parameters."""
    mixer, mixers, norms = _mixer(layer), {n for n, _ in _mixers(layer)}, set(_norms(layer))
    blocks = [(n, c) for n, c in _children(layer) if "norm" not in n and n not in mixers | norms]
    if not blocks and mixer is not None:  # a one-sublayer block: its MLP is its ``mixer`` (Nemotron-H)
        return mixer
    return blocks[0] if len(blocks) == 1 else None


def observed_parts(model: Any, paths: dict[str, str | None], structure: Any) -> dict[str, Any]:
    """Every role ``model`` shows in the first attention, dense and MoE layer of ``structure``, and
    whether its final norm holds a weight."""
    stack = model.get_submodule(str(paths["language_model"]))
    layers = model.get_submodule(str(paths["language_layers"]))
    hidden = structure.hidden_size
    final_path = paths.get("final_norm", "norm")  # None: a post-norm stack with no final norm (TrOCR)
    final = stack.get_submodule(final_path) if final_path is not None else None
    parts: dict[str, Any] = {"final_norm": final is not None and any(True for _ in final.parameters())}
    if structure.attention_layer_ids:
        parts |= attention_parts(layers[structure.attention_layer_ids[0]])
    if structure.dense_layer_ids:
        dense = layers[structure.dense_layer_ids[0]]
        block = _block(dense)
        if block is not None and (mlp := projections(block[1], hidden)) is not None:
            parts |= {"mlp": block[0], "dense_mlp": mlp}
        elif block is None and (mlp := projections(dense, hidden)) is not None:
            parts |= {"mlp": "", "dense_mlp": mlp}  # the layer's own projections (OPT's fc1 / fc2)
    if structure.moe is not None and structure.moe_layer_ids:
        block = _block(layers[structure.moe_layer_ids[0]])
        if block is not None and "experts" in dict(block[1].named_children()):
            parts |= moe_parts(block[0], block[1], hidden)
            parts.setdefault("mlp", block[0])
    return parts


def departures(parts: dict[str, Any]) -> dict[str, Any]:
    """``parts`` less what equals the usual layer (``USUAL``), and less an MoE block where the dense
    MLP is. Norms that include the usual two are the usual: a family's extra norms (Gemma's sandwich
    norms) are under 0.01% of a real model, and the shipped specs' plans were recorded without them;
    the table names the norms of a family that lacks one of the usual two, whose names plan would invent."""
    kept = {key: value for key, value in parts.items() if key not in USUAL or USUAL[key] != value}
    if set(USUAL["norms"]) <= set(parts.get("norms", ())):
        kept.pop("norms", None)
    if parts.get("moe") == parts.get("mlp"):
        kept.pop("moe", None)
    return kept


def generate(model_type: str) -> dict[str, Any] | None:
    """``model_type``'s table entry (None: its small config builds no model, kadapt refuses its config,
    or it is the usual layer)."""
    from ..structure.derive import derive_structure
    from .trial import buildable_config, module_paths

    found = buildable_config(model_type)
    if isinstance(found, str):
        return None
    config, model = found
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    try:
        parts = observed_parts(model, module_paths(model), derive_structure(text))
    except (KadaptError, AttributeError, IndexError, StopIteration):  # refused, or no part where expected
        return None
    return departures(parts) or None


def table(types: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The entries of ``types`` that depart from the usual layer (the builds' warnings and log notices
    silenced while they run, and only then: a test process keeps its own settings)."""
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            entries = {t: generate(t) for t in types}
    finally:
        logging.disable(disabled)
    return {t: entry for t, entry in sorted(entries.items()) if entry}


def render(entries: dict[str, dict[str, Any]], version: str) -> str:
    return json.dumps({"transformers": version, "families": entries}, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kimi_adapter_core.families.parts", description=__doc__)
    parser.add_argument("model_types", nargs="*", help="only these (default: every decoder-only one)")
    parser.add_argument("--write", action="store_true", help=f"write {PARTS_TABLE.name}")
    args = parser.parse_args(argv)
    import transformers

    wanted = args.model_types or [m.name for m in model_types() if m.excluded is None]
    text = render(table(wanted), transformers.__version__)
    if args.write:
        atomic_write_text(PARTS_TABLE, text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
