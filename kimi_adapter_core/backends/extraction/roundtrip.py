"""``verify``: extract a tiny random model of the spec's architecture and replay the saved files.

(Not named ``verify.py``: importing such a submodule would rebind the package's ``verify`` function.)

The check runs the real path end to end: the spec is applied, a tiny model is built on meta and
extracted by ``pipeline.run`` (tracing, layer replication, JSON writing), the JSON files are loaded
back with ``torch_ir.load_ir`` and executed by ``torch_ir``'s executor with the weights of an
identical CPU model renamed to checkpoint names. The reference is transformers itself with the
patches removed: prefill logits, then a greedy generation of ``decode_steps`` tokens that the one
decode graph produces by being fed its own present KV, must equal ``model.generate(do_sample=False)``
token for token, logits within a tolerance relative to their magnitude (``tolerance.compare``, row by
row: the same float error grows with the logits). It runs twice: in float32 against the upstream eager
experts loop (``verify_tolerance``, 1e-4 x each row's largest |logit|, at least 1: the exported math is
upstream's), and in bfloat16 against transformers running the exported experts implementation
(``verify_tolerance_ulps``, 8 bf16 ulps at each row's largest |logit|; observed 0 on 24 steps: the
graph is bit-identical to bf16 eager). A spec with a vision graph also has it
checked against ``get_image_features`` (``vision_verify``), and one with a multimodal prefill has an
image prompt run pixels -> vision IR -> merged prefill IR -> decode IR against transformers given the
pixels (``multimodal_verify``); the verify cache then grows to hold that prompt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from ... import upstream
from ...errors import KadaptError
from ...spec.model import Spec
from ...structure.derive import (
    derive_structure,
    pattern_period,
    shorten_layers,
    structure_of_raw,
    text_config_key,
)
from ...structure.model import ModelStructure
from . import multimodal_verify, runtime
from .naming import rename_weight
from .options import MERGED, ExtractionOptions, bind_structure
from .pipeline import run
from .symbolic import bind_ir, decode_value_ranges
from .tolerance import Tolerance, compare
from .vision_verify import check_vision
from .whole_model import one_thread

# Sizes of the tiny text backbone, by structural fact: each is written to whichever config key the
# model's structure read that fact from (``ModelStructure.keys``), so any family shrinks the same way.
TINY_FACTS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_layers": 3,
    "first_dense_layers": 1,
    "num_experts": 8,
    "top_k": 2,
    "expert_groups": 1,
    "top_k_groups": 1,
    "num_shared_experts": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "vocab_size": 128,
    "num_heads": 4,
    "head_dim": 16,
    # shorter than the verify prompt, so sliding-window masks decide the result
    "sliding_window": 4,
}
# With group-limited routing (DeepSeek's n_group/topk_group), the tiny router keeps groups: 4 groups of
# 2 experts, the top 2 groups chosen, so the group mask decides which experts can win.
TINY_EXPERT_GROUPS = {"expert_groups": 4, "top_k_groups": 2}
# The tiny stack holds at least one whole period of the layer pattern (sliding/full), up to this many.
TINY_MAX_LAYERS = 8
# KV heads of the tiny model keep the attention kind: 4 of 4 (MHA, MLA), 2 of 4 (GQA), 1 (MQA).
TINY_KV_HEADS = {"mha": 4, "mla": 4, "gqa": 2, "mqa": 1}
# Random weights at the default 0.02 give near-uniform logits whose argmax float noise could flip;
# wider weights make greedy tokens a meaningful comparison.
TINY_INITIALIZER_RANGE = 0.2
# Other sub-models (a vision tower) are built but not extracted: only make them small.
TINY_OTHER = {
    "hidden_size": 32,
    "vt_hidden_size": 32,
    "mm_hidden_size": 32,
    "num_hidden_layers": 1,
    "vt_num_hidden_layers": 1,
    "num_attention_heads": 2,
    "vt_num_attention_heads": 2,
    "intermediate_size": 64,
    "vt_intermediate_size": 64,
    "text_hidden_size": TINY_FACTS["hidden_size"],
}
# Root-config sizes of a vision-language model's projector, set when the spec exports the vision graph:
# the projector's input width lives on the root config (Kimi_K25Config.projection_hidden_size, absent
# from the shipped config, default 1152) and must match the tiny encoder's.
TINY_PROJECTOR = {"projection_hidden_size": TINY_OTHER["vt_hidden_size"]}
TINY_VISION_LAYERS = 3
VISION_LAYER_KEYS = (".num_hidden_layers", ".vt_num_hidden_layers")
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "media_placeholder_token_id": 3}
# Greedy steps after the multimodal prefill: the decode graph itself is checked over the full
# decode_steps by the text prompt; these show the image prompt's KV continues into it.
MERGED_DECODE_STEPS = 8


def tiny_layer_count(structure: ModelStructure) -> int:
    """Layers of the tiny stack: ``TINY_FACTS["num_layers"]``, or one whole period of the model's
    sliding/full pattern when that is longer (a 5:1 pattern needs 6 layers to have a full one), or,
    for a pattern with no short period, enough layers to hold every kind once (at most
    ``TINY_MAX_LAYERS``); never more than the model has."""
    period = pattern_period([(layer.attention, layer.window) for layer in structure.layers], TINY_MAX_LAYERS)
    return min(max(TINY_FACTS["num_layers"], min(period, TINY_MAX_LAYERS)), structure.num_layers)


def _tiny_text(structure: ModelStructure, section: dict[str, Any]) -> dict[str, Any]:
    """Overrides of the text config that keep ``structure``'s kinds at tiny sizes: the attention kind,
    a whole period of the sliding/full pattern, dense and MoE layers, the router's expert groups."""
    tiny = {structure.keys[fact]: value for fact, value in TINY_FACTS.items() if fact in structure.keys}
    if "num_kv_heads" in structure.keys:
        tiny[structure.keys["num_kv_heads"]] = TINY_KV_HEADS[structure.attention.kind]
    layers = tiny_layer_count(structure)
    tiny[structure.keys["num_layers"]] = layers
    tiny.update(shorten_layers(section, structure.num_layers, layers))
    if "max_window_layers" in structure.keys and structure.has_sliding_layers:
        tiny[structure.keys["max_window_layers"]] = 1  # layers from 1 on slide: full and sliding both present
    if structure.moe is not None and structure.moe.expert_groups > 1:
        tiny.update({structure.keys[f]: v for f, v in TINY_EXPERT_GROUPS.items() if f in structure.keys})
    tiny["initializer_range"] = TINY_INITIALIZER_RANGE
    return tiny


def tiny_overrides(spec: Spec, options: ExtractionOptions) -> dict[str, Any]:
    """Dotted config overrides that shrink the spec's model; the spec's own ``config_overrides`` win."""
    from ...config.source import resolve_source

    raw = resolve_source(spec).raw
    text_key = text_config_key(spec, isinstance(raw.get("text_config"), dict))
    structure = structure_of_raw(spec, raw)
    overrides: dict[str, Any] = {}
    for key, section in [(None, raw), *((k, v) for k, v in raw.items() if isinstance(v, dict))]:
        prefix = f"{key}." if key else ""
        if key == text_key:
            sizes = _tiny_text(structure, section)
        else:
            sizes = {name: value for name, value in TINY_OTHER.items() if key and name in section}
        sizes.update({name: value for name, value in TOKEN_IDS.items() if name in section})
        overrides.update({prefix + name: value for name, value in sizes.items()})
    if options.vision is not None:
        overrides.update(TINY_PROJECTOR)
        # an exported vision encoder gets 3 layers, so the check runs a stitched one (2 traced, 1 copied)
        for name in list(overrides):
            section = name.partition(".")[0]
            if name.endswith(VISION_LAYER_KEYS) and "." in name and section != text_key:
                overrides[name] = TINY_VISION_LAYERS
    overrides.update(options.verify_overrides)
    return overrides


# Why absorbed MLA has no bf16 round trip: transformers has no absorbed attention to compare with, and
# the two orders round differently. Measured on the tiny verify models (32-token prefill, logits vs the
# fp32 model): upstream reexpand in bf16 is off by 2.17 (DeepSeek-V3) / 0.27 (Kimi-K2.5), absorbed in
# bf16 by 2.43 / 0.22 - the same size, so it is rounding, not a defect (fp32 absorbed: 6e-6 / 8e-6).
ABSORBED_LOW_PRECISION = (
    "absorbed MLA is checked in float32 only: in bf16 it rounds in another order than transformers' "
    "re-expanding attention (its error against fp32 matches upstream bf16's: "
    "2.43 vs 2.17 on tiny DeepSeek-V3)"
)


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class VerifyReport:
    kv_layout: str
    tolerance: float  # float32: fraction of each row's largest |logit|
    mla_attention: str = "reexpand"
    attention_label: str = ""
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tokens_ir: list[list[int]] = field(default_factory=list)
    tokens_reference: list[list[int]] = field(default_factory=list)
    max_logit_diff: float = 0.0
    seconds: float = 0.0
    tolerance_ulps: float | None = None  # bfloat16/float16: ulps at each row's largest |logit| (if run)
    # where the replay first departs from transformers (graph, layer, output), found once a text
    # prompt's logits or tokens check failed; None on a pass
    first_departure: str | None = None

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(check.passed for check in self.checks)

    def add(self, name: str, passed: bool, detail: str) -> None:
        self.checks.append(Check(name, bool(passed), detail))

    def render(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        ulps = "" if self.tolerance_ulps is None else f", {self.tolerance_ulps:g} ulps in low precision"
        lines = [
            f"verify ({self.attention_label}, tolerance {self.tolerance:g} x |logit| in float32{ulps}): "
            f"{verdict} in {self.seconds:.1f} s"
        ]
        lines += [f"  [{'ok' if c.passed else 'FAIL'}] {c.name}: {c.detail}" for c in self.checks]
        if self.first_departure is not None:
            lines.append(f"  first departure: {self.first_departure}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "kv_layout": self.kv_layout,
            "mla_attention": self.mla_attention,
            "tolerance": self.tolerance,
            "tolerance_ulps": self.tolerance_ulps,
            "max_logit_diff": self.max_logit_diff,
            "tokens_ir": self.tokens_ir,
            "tokens_reference": self.tokens_reference,
            "checks": [dataclasses.asdict(c) for c in self.checks],
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
            **({"first_departure": self.first_departure} if self.first_departure is not None else {}),
        }


@contextlib.contextmanager
def _upstream_experts(config: Any) -> Iterator[None]:
    """Run the reference with transformers' own eager experts loop, not the export-friendly one."""
    saved = getattr(config, "_experts_implementation", None)
    config._experts_implementation = "eager"
    try:
        yield
    finally:
        config._experts_implementation = saved


def _reference_experts(text_config: Any, low_precision: bool) -> contextlib.AbstractContextManager[None]:
    """The experts transformers runs as the reference.

    fp32 checks the exported experts' math against transformers' eager loop; bf16 checks the graph
    against transformers running the exported experts implementation (eager and batched_mm round
    differently in bf16: on tiny Kimi-K2.5 their own outputs drift apart by up to 8 logits).
    """
    return contextlib.nullcontext() if low_precision else _upstream_experts(text_config)


# Relative spread given to every tensor transformers initialises to one constant value.
CONSTANT_SPREAD = 0.1


def randomize_constants(model: nn.Module) -> list[str]:
    """Give every parameter and persistent buffer that holds one constant value (biases and the MoE
    router's correction bias at 0, norm weights at 1) random values around it; return their names.

    transformers' init leaves them constant, so a graph that dropped a bias or a norm scale would still
    equal the reference: with them random, ``--verify`` is a proof for every weight, not only the
    matrices. Non-persistent buffers (rotary frequencies) are computed, not loaded, and stay as built.
    """
    generator = torch.Generator().manual_seed(1)
    changed = []
    with torch.no_grad():
        for module_name, module in model.named_modules():
            tensors = list(module.named_parameters(recurse=False)) + [
                (n, b)
                for n, b in module.named_buffers(recurse=False)
                if n not in module._non_persistent_buffers_set
            ]
            for name, tensor in tensors:
                if not tensor.is_floating_point() or tensor.numel() < 2 or tensor.min() != tensor.max():
                    continue
                value = float(tensor.flatten()[0])
                noise = torch.randn(tensor.shape, generator=generator).to(tensor.dtype) * CONSTANT_SPREAD
                tensor.copy_(noise if value == 0 else value * (1 + noise))
                changed.append(f"{module_name}.{name}" if module_name else name)
    return changed


def _reference(
    model: nn.Module, prompt: torch.Tensor, steps: int, **inputs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Unpatched transformers: prefill logits, greedy tokens and per-token logits of ``generate``;
    ``inputs`` go to both (``pixel_values``/``image_grid_thw`` for an image prompt)."""
    from transformers import GenerationConfig

    generation = GenerationConfig(
        max_new_tokens=steps + 1,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    # generate() merges None with the model's own generation config, whose eos (the tiny config's 2)
    # would end the reference early; the IR decodes a fixed number of steps.
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        prefill_logits = model(input_ids=prompt, **inputs).logits
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), generation_config=generation, **inputs
        )
    return prefill_logits, out.sequences[:, prompt.shape[1] :], list(out.logits)


class _Replay:
    """Runs the saved IR files with torch_ir's executor, the way another tool would.

    Every call goes through ``symbolic.bind_ir`` first: inputs the graph was not made for (a prompt
    outside a dynamic range or longer than a static one, a wrong batch, dtype or cache shape) are refused
    there, before execution, and dynamic sizes are bound to this call's shapes.
    """

    def __init__(self, options: ExtractionOptions, weights: dict[str, torch.Tensor]) -> None:
        import torch_ir

        self.irs = {kind: torch_ir.load_ir(options.path(kind)) for kind in ("prefill", "decode")}
        mapping = json.loads(options.path("kv_mapping").read_text())
        self.values = {"decode": decode_value_ranges(self.irs["decode"], mapping)}
        self.weights = weights
        self.ranges = options.dynamic_ranges
        self.dtype = getattr(torch, options.dtype)
        self.max_cache_len = options.max_cache_len
        self.paged = options.paged
        self.kv_dims = options.kv_dims
        self.kv_layout = options.kv_layout or "heads"
        self.block_table: torch.Tensor | None = None  # paged: the rows' blocks, out of order in the pool

    def execute(self, kind: str, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        import torch_ir

        ir = bind_ir(self.irs[kind], inputs, self.ranges, graph=kind, values=self.values.get(kind))
        return list(torch_ir.IRExecutor(ir, self.weights).execute(inputs))

    def run_prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Prefill a prompt whose every row is real tokens (no padding)."""
        return self.run_ragged_prefill(prompt, torch.full((prompt.shape[0],), prompt.shape[1]))

    def run_ragged_prefill(
        self, padded: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Prefill rows of ``lengths`` real tokens, right padded to ``padded``'s width: each row's mask
        hides its own pad slots (the KV mapping's padding rule)."""
        logits, present = self.prefill_outputs(padded, lengths)
        return logits, self.place(present, lengths)

    def prefill_outputs(
        self, padded: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The prefill graph's logits and per-layer present KV as it returns them (not yet placed)."""
        _, causal, positions = runtime.prefill_inputs(
            batch=padded.shape[0], prefill_len=padded.shape[1], dtype=self.dtype, device="cpu"
        )
        pad = torch.arange(padded.shape[1]).view(1, 1, 1, -1) >= lengths.view(-1, 1, 1, 1)
        mask = causal.masked_fill(pad, torch.finfo(self.dtype).min)
        logits, *present = self.execute("prefill", (padded, mask, positions))
        return logits, present

    def written_at(self, present: list[torch.Tensor], position: int) -> list[torch.Tensor]:
        """What a decode step wrote at ``position`` in each present cache, ``[B, heads, 1, dim]`` (a paged
        pool read through the rows' block table)."""
        if self.block_table is not None:
            present = [runtime.paged_view(pool, self.block_table) for pool in present]
        return [tensor[:, :, position : position + 1] for tensor in present]

    def output_name(self, kind: str, index: int) -> str:
        """The name of output ``index`` of the ``kind`` graph (0 is the logits, then key/value by layer)."""
        return str(self.irs[kind].graph_outputs[index].name)

    def place(self, present: list[torch.Tensor], lengths: torch.Tensor) -> list[torch.Tensor]:
        """Prefill KV (rows of ``lengths`` real tokens) as the decode graph takes it: per-row caches,
        or with a paged cache the rows' blocks scattered out of order through the pool."""
        if self.paged is None:
            return runtime.place_prefill_kv(present, self.max_cache_len)
        per_row = self.max_cache_len // self.paged.block_size
        order = torch.randperm(self.paged.num_blocks, generator=torch.Generator().manual_seed(7))
        self.block_table = order[: len(lengths) * per_row].view(len(lengths), per_row)
        shapes = runtime.paged_shapes(self.kv_dims, self.paged.block_size, self.paged.num_blocks)
        return runtime.place_prefill_kv_paged(
            present, self.block_table, lengths, shapes * (len(present) // 2)
        )

    def run_decode(
        self, token: torch.Tensor, position: int | torch.Tensor, cache: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list]:
        """One decode step; ``position`` one for every row or ``[B]``, each row's own (ragged)."""
        rows = torch.full((token.shape[0],), position) if isinstance(position, int) else position
        positions = rows.view(-1, 1).to(torch.long)
        mask = runtime.additive_causal_mask(positions, self.max_cache_len, self.dtype)
        table = () if self.block_table is None else (self.block_table,)
        logits, *present = self.execute(
            "decode", (token, mask, positions, positions.view(-1), *table, *cache)
        )
        return logits, present


class _RecordingCache(DynamicCache):
    """transformers' own cache for the reference run, keeping also what each layer handed
    ``Cache.update`` in the latest forward: what the saved graphs' presents hold in the ``heads`` and
    ``latent`` layouts (``runtime``'s KV layouts), whatever the layer then keeps (a sliding window)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        self.written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.written[layer_idx] = (key_states.detach().clone(), value_states.detach().clone())
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _expected_kv(
    model: nn.Module, written: dict[int, tuple[torch.Tensor, torch.Tensor]], layout: str
) -> list[torch.Tensor]:
    """What the graph's presents must hold, layer by layer (key, value, key, ...): what transformers'
    layers wrote, per head through the layer's own ``expand_kv`` for the ``expanded`` MLA layout."""
    attentions = {
        m.layer_idx: m for m in model.modules() if hasattr(m, "expand_kv") and hasattr(m, "layer_idx")
    }
    flat = []
    for layer in sorted(written):
        key, value = written[layer]
        if layout == "expanded":
            with torch.no_grad():
                key, value = attentions[layer].expand_kv(key, value)
        flat += [key, value]
    return flat


def _first_position(logits: torch.Tensor, reference: torch.Tensor, tolerance: Tolerance) -> int | None:
    """The first position (dim -2) whose logits are outside ``tolerance``, None if none is."""
    if logits.shape != reference.shape:
        return 0
    for position in range(logits.shape[-2]):
        if not compare([(logits[..., position, :], reference[..., position, :])], tolerance).passed:
            return position
    return None


def _layer_hint(layer: int, parts: list[str], kind: str) -> str:
    """What a departing cache suggests: one of key/value off points at that path of the layer, both at
    the layer's input (the previous layer's output, or the embeddings), a projection both come from
    (MLA's kv_a_proj), or in a decode step the cache slot the step wrote."""
    if len(parts) == 1:
        other, path = ("value", "(projection, norm, rope)") if parts[0] == "key" else ("key", "(projection)")
        return f"its {other} is within the bound: layer {layer}'s {parts[0]} path {path}"
    source = "the embeddings" if layer == 0 else f"layer {layer - 1}'s attention or MLP"
    slot = ", or the cache slot the step wrote" if kind == "decode" else ""
    return f"key and value both: layer {layer}'s input ({source}), a projection both come from{slot}"


def _departure(
    replay: _Replay,
    kind: str,
    ours: list[torch.Tensor],
    expected: list[torch.Tensor],
    logits: tuple[torch.Tensor, torch.Tensor, int],
    tolerance: Tolerance,
) -> str | None:
    """The first layer (in order) whose cached key or value departs from transformers', and where the
    logits do, said together; None when every cache and every logit is within ``tolerance``."""
    actual, reference, offset = logits
    at = _first_position(actual, reference, tolerance)
    logit_text = "logits within the bound" if at is None else f"logits differ from position {offset + at}"
    if len(ours) != len(expected):
        return f"the graph returns {len(ours)} cache tensors, transformers' layers wrote {len(expected)}"
    for layer in range(len(ours) // 2):
        pair = [compare([(ours[i], expected[i])], tolerance) for i in (2 * layer, 2 * layer + 1)]
        parts = [part for part, close in zip(("key", "value"), pair, strict=True) if not close.passed]
        if not parts:
            continue
        first = pair[0] if parts[0] == "key" else pair[1]
        output = replay.output_name(kind, 1 + 2 * layer + (parts[0] == "value"))
        return (
            f"layer {layer} {parts[0]} cache departs first (output {output!r}: {first.detail()}; "
            f"{_layer_hint(layer, parts, kind)}); {logit_text}"
        )
    if at is None:
        return None
    return (
        f"every layer's KV cache is within the bound, {logit_text}: the departure is after the last cache "
        "write (the last layer's attention output or MLP, the final norm, the LM head or the logits' "
        "outside ops)"
    )


def _localise(
    model: nn.Module, replay: _Replay, prompt: torch.Tensor, steps: int, tolerance: Tolerance
) -> str:
    """Where the replay first departs from transformers: the prefill's presents layer by layer, then
    each decode step's written row, both models fed the replay's own greedy tokens so they stay on one
    path. Only run after a logits or token check failed: the passing path never pays for it.

    A diagnosis, not a check: if it cannot be made (a model whose forward takes no cache object, a
    layer without ``expand_kv``), the report says why and the failed checks stand as they are."""
    try:
        return _first_departure(model, replay, prompt, steps, tolerance)
    except Exception as exc:  # noqa: BLE001 - any failure of the diagnosis must not hide the verdict
        return f"not localised: comparing layer by layer failed ({type(exc).__name__}: {exc})"


def _first_departure(
    model: nn.Module, replay: _Replay, prompt: torch.Tensor, steps: int, tolerance: Tolerance
) -> str:
    """``_localise``'s comparison, layer by layer in order, prefill then each decode step."""
    layout = replay.kv_layout
    cache = _RecordingCache(model.config)
    keyword = upstream.cache_keyword(model)  # 5.24: ``cache``, before: ``past_key_values``
    lengths = torch.full((prompt.shape[0],), prompt.shape[1])
    with torch.no_grad():
        reference = model(input_ids=prompt, **{keyword: cache}, use_cache=True).logits
    logits, present = replay.prefill_outputs(prompt, lengths)
    expected = _expected_kv(model, cache.written, layout)
    found = _departure(replay, "prefill", present, expected, (logits, reference, 0), tolerance)
    if found is not None:
        return f"prefill: {found}"
    kv = replay.place(present, lengths)
    for step in range(steps):
        token, position = logits[:, -1:].argmax(-1), prompt.shape[1] + step
        with torch.no_grad():
            reference = model(input_ids=token, **{keyword: cache}, use_cache=True).logits
        logits, kv = replay.run_decode(token, position, kv)
        expected = _expected_kv(model, cache.written, layout)
        ours = replay.written_at(kv, position)
        found = _departure(replay, "decode", ours, expected, (logits, reference, position), tolerance)
        if found is not None:
            return f"decode step {step + 1}: {found}"
    return (
        f"not localised: fed the same tokens, every layer's KV cache and the logits stay within the bound "
        f"for the prefill and {steps} decode steps (a near tie decided a greedy token differently)"
    )


def _compare(
    report: VerifyReport,
    model: nn.Module,
    replay: _Replay,
    prompt: torch.Tensor,
    steps: int,
    *,
    tolerance: Tolerance,
    suffix: str = "",
    prefill: multimodal_verify.Prefill | None = None,
    reference_inputs: dict[str, torch.Tensor] | None = None,
    label: str = "",
) -> None:
    """Prefill ``prompt`` (with ``prefill``, default the saved text prefill), decode ``steps`` greedy
    tokens with the saved decode graph, and compare each with transformers given ``reference_inputs``;
    check names start with ``label``."""
    ref_prefill, ref_tokens, ref_logits = _reference(model, prompt, steps, **(reference_inputs or {}))
    logits, cache = (prefill or replay.run_prefill)(prompt)
    first = compare([(logits, ref_prefill)], tolerance)
    report.add(
        f"{label}prefill logits{suffix}", first.passed, f"over {tuple(logits.shape)}: {first.detail()}"
    )
    token = logits[:, -1].argmax(-1, keepdim=True)
    tokens = [token]
    steps_logits = [(logits[:, -1], ref_logits[0])]
    for step in range(steps):
        logits, cache = replay.run_decode(token, prompt.shape[1] + step, cache)
        steps_logits.append((logits[:, -1], ref_logits[step + 1]))
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    ir_tokens = torch.cat(tokens, dim=1)
    decoded = compare(steps_logits, tolerance)
    equal = torch.equal(ir_tokens, ref_tokens)
    if prefill is None and report.first_departure is None and not (first.passed and equal and decoded.passed):
        where = _localise(model, replay, prompt, steps, tolerance)
        report.first_departure = f"{where} ({tolerance.dtype}, prompt {tuple(prompt.shape)})"
    if not suffix and not label:  # the fp32 text run is the one the report's tokens and max diff describe
        report.tokens_ir = ir_tokens.tolist()
        report.tokens_reference = ref_tokens.tolist()
        report.max_logit_diff = max(first.max_diff, decoded.max_diff)
    last = prompt.shape[1] + steps - 1
    report.add(
        f"{label}greedy generation{suffix}",
        equal,
        f"{ir_tokens.shape[1]} tokens (1 prefill + {steps} decode steps, "
        f"positions {prompt.shape[1]}..{last}) {'equal' if equal else 'DIFFER'} to model.generate",
    )
    report.add(
        f"{label}decode logits{suffix}", decoded.passed, f"over {steps + 1} tokens: {decoded.detail()}"
    )


def _compare_dynamic(
    report: VerifyReport,
    model: nn.Module,
    replay: _Replay,
    prompt: torch.Tensor,
    options: ExtractionOptions,
    *,
    tolerance: Tolerance,
    suffix: str,
) -> None:
    """The same graphs at smaller sizes inside their ranges, and a refusal just outside them."""
    rows = 1 if "batch" in options.dynamic else prompt.shape[0]
    length = max(1, prompt.shape[1] // 2 - 1) if "prefill_len" in options.dynamic else prompt.shape[1]
    smaller = prompt[:rows, :length]
    where = f" (batch {rows}, prompt {length}{', ' + suffix.strip(' ()') if suffix else ''})"
    _compare(report, model, replay, smaller, 4, tolerance=tolerance, suffix=where)
    for name, allowed in options.dynamic_ranges.items():
        shape = {"batch": prompt.shape[0], "prefill_len": prompt.shape[1], name: allowed.max + 1}
        check = f"{name} {allowed.max + 1} refused before execution{suffix}"
        try:
            replay.run_prefill(torch.zeros(shape["batch"], shape["prefill_len"], dtype=torch.long))
        except KadaptError as exc:
            report.add(check, f"({name})" in str(exc), str(exc))
        else:
            report.add(check, False, f"a {shape['batch']}x{shape['prefill_len']} prompt ran")


def _compare_ragged(
    report: VerifyReport,
    model: nn.Module,
    replay: _Replay,
    prompt: torch.Tensor,
    *,
    steps: int,
    tolerance: Tolerance,
    suffix: str,
) -> None:
    """Rows of different lengths in one batch, each decoding from its own position in every step (and,
    paged, through blocks out of order): every row's tokens equal ``generate`` on that row alone and its
    logits are within ``tolerance`` of generate's at every step."""
    rows, width = prompt.shape
    lengths = torch.tensor([max(1, width - 2 * row) for row in range(rows)])
    padded = torch.stack(
        [prompt[row].masked_fill(torch.arange(width) >= lengths[row], 0) for row in range(rows)]
    )
    logits, cache = replay.run_ragged_prefill(padded, lengths)
    step_logits = [logits[torch.arange(rows), lengths - 1]]  # [rows, vocab] per step
    token = step_logits[0].argmax(-1, keepdim=True)
    tokens = [token]
    for step in range(steps):
        logits, cache = replay.run_decode(token, lengths + step, cache)
        step_logits.append(logits[:, -1])
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    ours = torch.cat(tokens, dim=1)
    differ, pairs = [], []
    for row in range(rows):
        _, expected, expected_logits = _reference(model, prompt[row : row + 1, : int(lengths[row])], steps)
        if not torch.equal(ours[row : row + 1], expected):
            differ.append(row)
        pairs += [
            (ours_step[row : row + 1], ref)
            for ours_step, ref in zip(step_logits, expected_logits, strict=True)
        ]
    close = compare(pairs, tolerance)
    paged = "" if replay.block_table is None else ", paged, blocks out of order"
    report.add(
        f"ragged batch{suffix}",
        not differ and close.passed,
        f"{rows} rows of lengths {lengths.tolist()}{paged}: {steps + 1} tokens each "
        + (f"DIFFER from model.generate on rows {differ}" if differ else "equal to model.generate row by row")
        + f"; logits {close.detail()}",
    )


def _compare_merged(
    report: VerifyReport,
    spec: Spec,
    model: nn.Module,
    replay: _Replay,
    options: ExtractionOptions,
    weights: dict[str, torch.Tensor],
    *,
    vocab_size: int,
    tolerance: Tolerance,
    suffix: str,
) -> None:
    """An image prompt through the saved vision, multimodal prefill and decode graphs vs transformers."""
    case = multimodal_verify.merged_case(
        spec,
        model,
        options,
        weights,
        text_len=options.verify_prefill_len,
        vocab_size=vocab_size,
        place=replay.place,
    )
    compare = functools.partial(
        _compare,
        report,
        model,
        replay,
        tolerance=tolerance,
        prefill=case.prefill,
        reference_inputs=case.reference_inputs,
        label="multimodal ",
    )
    compare(case.prompt, MERGED_DECODE_STEPS, suffix=suffix)
    if options.dynamic:  # a shorter image prompt (and batch 1) through the same files
        rows = 1 if "batch" in options.dynamic else case.prompt.shape[0]
        text = 2 if "prefill_len" in options.dynamic else options.verify_prefill_len
        prompt = multimodal_verify.image_prompt(
            batch=rows,
            text_len=text,
            image_tokens=case.replay.feature_rows,
            placeholder=case.replay.placeholder,
            vocab_size=vocab_size,
        )
        where = f" (batch {rows}, prompt {prompt.shape[1]}{', ' + suffix.strip(' ()') if suffix else ''})"
        compare(prompt, 4, suffix=where)
    multimodal_verify.check_placeholder_refusal(report, case, suffix=suffix)


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
    small = dataclasses.replace(
        options,
        output_dir=output_dir,
        prefill_len=options.verify_prefill_len,
        max_cache_len=options.verify_max_cache_len,
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
    if small.paged is not None:  # whole blocks, and a spare row's worth so blocks land out of order
        size = small.paged.block_size
        per_row = -(-small.max_cache_len // size)
        small = dataclasses.replace(
            small,
            max_cache_len=per_row * size,
            paged=dataclasses.replace(small.paged, num_blocks=(small.batch + 1) * per_row),
        )
    return bind_structure(small, structure)


def _check_weights(
    report: VerifyReport, options: ExtractionOptions, weights: dict[str, torch.Tensor]
) -> None:
    """Every IR weight must bind to a checkpoint tensor of the same shape and dtype."""
    import torch_ir
    from torch_ir.weight_loader import validate_weights_against_ir

    problems = []
    for kind in ("prefill", "decode", *((MERGED,) if options.merged_prefill is not None else ())):
        problems += validate_weights_against_ir(weights, torch_ir.load_ir(options.path(kind)))
    report.add(
        "weights bind to checkpoint names", not problems, "; ".join(problems) or "all names, shapes, dtypes"
    )


def _saved_and_loaded(model: nn.Module, options: ExtractionOptions, tmp: Path) -> dict[str, torch.Tensor]:
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

    from .weight_loader import load_weights

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
    return load_weights(doc, checkpoint)


def _in_spec_names(model: nn.Module, saved: Path, renames: tuple[tuple[str, str], ...], out: Path) -> Path:
    """``saved`` rewritten with every tensor under the name the spec's layout gives it: transformers'
    loading renames (not its converters: fused tensors stay split, as on disk), then ``renames``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from .checkpoint_layout import loading_renamer

    loaded_name = loading_renamer(model)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(saved.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                tensors[rename_weight(loaded_name(name), renames)] = handle.get_tensor(name)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    return out


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
    from ...loading import applied, load_model

    bf16 = dtype != "float32"
    torch_dtype = getattr(torch, dtype)
    with tempfile.TemporaryDirectory(prefix="kadapt-verify-") as tmp:
        torch.manual_seed(0)
        with applied(spec, backend="extraction"):
            model = load_model(spec, device="cpu", config=config, dtype=torch_dtype).eval()
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
        weights = _saved_and_loaded(model, small, Path(tmp))
        if not bf16:
            _check_weights(report, small, weights)
        replay = _Replay(small, weights)
        prompt = torch.randint(
            3,
            text_config.vocab_size,
            (small.batch, small.prefill_len),
            generator=torch.Generator().manual_seed(2),
        )
        ulps = options.verify_tolerance_ulps
        tolerance = Tolerance.of(dtype, relative=options.verify_tolerance, ulps=ulps)
        if tolerance.in_ulps:
            report.tolerance_ulps = tolerance.limit
        suffix = f" ({dtype})" if bf16 else ""
        with _reference_experts(text_config, bf16):
            _compare(
                report, model, replay, prompt, options.verify_decode_steps, tolerance=tolerance, suffix=suffix
            )
            if small.dynamic:
                _compare_dynamic(report, model, replay, prompt, small, tolerance=tolerance, suffix=suffix)
            if small.batch > 1:
                _compare_ragged(
                    report,
                    model,
                    replay,
                    prompt,
                    steps=options.verify_decode_steps,
                    tolerance=tolerance,
                    suffix=suffix,
                )
        if small.vision is not None:
            check_vision(report, spec, model, small, weights, tolerance=tolerance, suffix=suffix)
        if small.merged_prefill is not None:  # the vision graph checked, then used for an image prompt
            with _reference_experts(text_config, bf16):
                _compare_merged(
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
    from ...loading import load_config

    start = time.perf_counter()
    config = load_config(spec, backend="extraction", overrides=tiny_overrides(spec, options))
    text_config = getattr(config, spec.abi.config) if spec.abi is not None and spec.abi.config else config
    if text_config.num_hidden_layers < 2:
        raise KadaptError("verify needs a tiny model with at least 2 decoder layers")
    structure = derive_structure(text_config, spec)
    bound = bind_structure(dataclasses.replace(options, structure=None), structure)
    report = VerifyReport(
        bound.kv_layout or "", options.verify_tolerance, bound.mla_attention, bound.attention_label
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
