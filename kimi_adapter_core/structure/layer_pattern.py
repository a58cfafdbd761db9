"""Per-layer patterns of a config (``layer_types``, per-layer lists): their period, and a shorter stack.

The tiny verify models and ``validate --resolve`` keep a whole period of a model's layer pattern
(Gemma-3's 5 sliding : 1 full, Qwen3-Next's 3 linear : 1 full) while shrinking the stack.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .kv_sharing import shared_in_prefix


def pattern_period(sequence: Sequence[Any], limit: int) -> int:
    """Layers that hold one whole period of a per-layer pattern: the shortest ``p`` with ``sequence[i] ==
    sequence[i % p]`` (6 for Gemma-3's 5 sliding : 1 full), or, when that is longer than ``limit``, the
    shortest prefix holding every distinct value once. Values are compared by ``repr`` (lists allowed)."""
    values = [repr(v) for v in sequence]
    period = next(
        p for p in range(1, len(values) + 1) if all(v == values[i % p] for i, v in enumerate(values))
    )
    if period > limit:
        kinds = set(values)
        period = next(i + 1 for i in range(len(values)) if set(values[: i + 1]) == kinds)
    return period


# List-valued config keys that are never per layer, whatever their length (a two-layer stack's
# Falcon-H1 [gate, down] MLP multipliers, a Mamba2 time_step_limit [low, high]): never cut
NOT_PER_LAYER = ("architectures", "mlp_multipliers", "ssm_multipliers", "time_step_limit")


def shorten_layers(section: Mapping[str, Any], total: int, keep: int) -> dict[str, Any]:
    """Overrides that cut every per-layer list of a text config section (``layer_types``,
    ``mlp_layer_types``, ``activation_sparsity_pattern``, ...: any list with one entry per layer) to
    its first ``keep`` layers, as config classes require once the stack is shortened, the per-layer
    overrides of a heterogeneous config (``per_layer_config``) to those layers, a KV-sharing count
    (Gemma-4's ``num_kv_shared_layers``) to the sharing layers among them, and a layout of one
    letter per layer (``PATTERN_KEY``: Nemotron-H's config class builds its stack from the letters, whatever
    ``num_hidden_layers`` says)."""
    cut: dict[str, Any] = {
        key: list(value[:keep])
        for key, value in section.items()
        if isinstance(value, list) and len(value) == total and key not in NOT_PER_LAYER
    }
    pattern = section.get(PATTERN_KEY)
    if isinstance(pattern, str) and len(pattern) == total:
        cut[PATTERN_KEY] = pattern[:keep]
    cut.update(shared_in_prefix(section.get("model_type"), section, total, keep))  # its own sharing tail
    overrides = section.get("per_layer_config")
    if isinstance(overrides, Mapping):  # heterogeneous configs: overrides keyed by layer index
        cut["per_layer_config"] = {
            layer: values for layer, values in overrides.items() if int(str(layer)) < keep
        }
    return cut


# Nemotron-H's older ``hybrid_override_pattern``, one letter per layer (its config class builds
# ``layers_block_type`` from it): Mamba2, attention, MLP and MoE blocks
PATTERN_KEY = "hybrid_override_pattern"
PATTERN_LETTERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def layout_types(raw: Callable[[str], Any], num_layers: int, ssm: bool) -> list[Any] | None:
    """Each layer's type from a layout a raw ``config.json`` keeps instead of a ``layer_types`` list,
    as the config classes build the list: Nemotron-H's ``hybrid_override_pattern``; with SSM sizes
    (``ssm``) and no list, every layer an SSM but Bamba's ``attn_layer_indices`` or Jamba's every
    ``attn_layer_period``-th from ``attn_layer_offset`` (Mamba's and Mamba2's own configs: all of them).
    None: the config has no such layout."""
    pattern = raw(PATTERN_KEY)
    if isinstance(pattern, str):
        return [PATTERN_LETTERS.get(letter, letter) for letter in pattern]
    if not ssm:
        return None
    attending = raw("attn_layer_indices")
    attending = set(attending) if isinstance(attending, list) else set()
    period, offset = raw("attn_layer_period"), raw("attn_layer_offset")
    if isinstance(period, int) and period > 0 and isinstance(offset, int):
        attending |= {i for i in range(num_layers) if i % period == offset}
    return ["full_attention" if i in attending else "linear_attention" for i in range(num_layers)]
