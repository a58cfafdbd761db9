"""The typed, bounded reading of config values: what a structural fact's value may be.

A config comes from the internet next to its checkpoint, and plain ``kadapt validate`` reads it on
untrusted specs. ``derive`` reads every fact through this table before it computes anything, so that a
size of ``0``, ``-4``, ``4096.5``, ``"abc"``, ``NaN`` or ``1e9`` is one located finding (config file and
key) instead of a ``ZeroDivisionError``, an 8 GB list of layers or a plan of a model that cannot exist.

Integers are what transformers' strict config classes take: ``int`` and nothing else (``4096.0`` and
``true`` are refused there too). Counts have upper bounds far above every published model (each is
justified beside it) so that ``validate`` and ``plan``, which do work per layer, stay fast and small.
Cross-field rules are the ones every family obeys (checked against the default config of every
decoder model type of the installed transformers and the shipped specs): a sliding window longer than
the positions, a hidden size that heads do not divide (when ``head_dim`` is set, or the family
rounds down), ``max_window_layers`` beyond the stack all occur in real configs and are not refused.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import KadaptError

# Upper bounds. Each is far above the largest published model (and every transformers default config),
# and low enough that work per layer / per expert stays well under a second.
# Llama-3.1-405B: 126 layers, PaLM: 118; default configs: at most 128. Plan prices every tensor of every
# layer by its checkpoint name (a quantization_config may single out layers): 1,024 layers of Kimi-K2.5
# cost it about 0.3 s, 10,000 layers 3 s.
MAX_LAYERS = 1024
# widths (hidden, MLP, head, latent ranks): PaLM 18,432 hidden, Llama-3.1-405B 53,248 FFN
MAX_WIDTH = 1 << 20
MAX_HEADS = 1 << 16  # 128 query heads (DeepSeek-V3, Llama-3.1-405B)
MAX_EXPERTS = 1 << 16  # Doge's default config: 16,384; Qwen3.5: 512; Kimi-K2: 384; DeepSeek-V3: 256
# per-expert weights of a quantized checkpoint (MoE layers x experts x 3 projections), each of which plan
# checks by name: Qwen3.5-397B-A17B-FP8 stores 92,160, Kimi-K2.5 69,120 (about 1 s of plan)
MAX_EXPERT_WEIGHTS = 1 << 17
# a linear-attention layer's short convolution: Qwen3-Next, Qwen3.5 and LFM2 use 3-4 taps
MAX_CONV_KERNEL = 1 << 10
MAX_VOCAB = 1 << 24  # Gemma-3: 262,144; transformers' default configs: at most 290,943
MAX_POSITIONS = 1 << 32  # Llama-4-Scout: 10,485,760 (10M tokens); default configs: at most 1,048,576


@dataclass(frozen=True)
class Rule:
    """What one value must be: ``kind`` int | number | bool | string | mapping | ints | strings, within
    ``[low, high]`` for numbers; ``what`` is how a finding names it (``a positive integer``)."""

    kind: str
    what: str
    low: float | None = None
    high: float | None = None
    exclusive_low: bool = False
    also: tuple[int, ...] = ()  # values outside the range that mean something (-1: no limit)

    def problem(self, value: Any) -> str | None:
        """Why ``value`` breaks the rule (``expected ..., found ...``), or None when it keeps it."""
        if _has_kind(self.kind, value) and value in self.also:
            return None
        if not _has_kind(self.kind, value):
            return f"expected {self.what}, found {shown(value)}"
        if self.kind in ("int", "number"):
            if not self._above_low(value) or (self.kind == "number" and not _finite(value)):
                return f"expected {self.what}, found {shown(value)}"
            if self.high is not None and value > self.high:
                return f"expected {self.what} of at most {self.high:,}, found {shown(value)}"
        if self.kind in LIST_ENTRIES:
            bad = next((v for v in value if not LIST_ENTRIES[self.kind](v)), _KEPT)
            if bad is not _KEPT:
                return f"expected {self.what}, found an entry {shown(bad)}"
        return None

    def _above_low(self, value: float) -> bool:
        if self.low is None:
            return True
        return value > self.low if self.exclusive_low else value >= self.low


def _finite(value: float) -> bool:
    """A float that is not NaN or infinite, or an int that a float can hold (``float(10**400)`` fails)."""
    return math.isfinite(value) if isinstance(value, float) else abs(value) <= sys.float_info.max


_KEPT = object()
# list kinds -> what each entry must be
LIST_ENTRIES: dict[str, Callable[[Any], bool]] = {
    "ints": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "strings": lambda v: isinstance(v, str),
}


def _has_kind(kind: str, value: Any) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)  # bool is an int to Python only
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "mapping":
        return isinstance(value, Mapping)
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))  # ints, strings


def _count(what: str, low: int, high: int) -> Rule:
    return Rule("int", what, low, high)


def _positive(high: int) -> Rule:
    return _count("a positive integer", 1, high)


def _non_negative(high: int) -> Rule:
    return _count("a non-negative integer", 0, high)


WIDTH = _positive(MAX_WIDTH)
POSITIVE_NUMBER = Rule("number", "a positive finite number", 0, None, exclusive_low=True)
FINITE_NUMBER = Rule("number", "a finite number")
# a rope's partial_rotary_factor: the share of each head's width it rotates (0 would rotate nothing)
FRACTION = Rule("number", "a positive fraction", 0, 1, exclusive_low=True)
FLAG = Rule("bool", "true or false")
STRINGS = Rule("strings", "a list of strings")
MAPPING = Rule("mapping", "a mapping")

# fact (``config_keys.yaml``) -> its rule. 0 means "none" where derive reads it so (no routed experts,
# no sliding window, no shared experts), so those facts are non-negative; every other size is positive.
FACT_RULES: dict[str, Rule] = {
    "num_layers": _positive(MAX_LAYERS),
    "hidden_size": WIDTH,
    "vocab_size": _positive(MAX_VOCAB),
    # -1: no limit (transformers' XLNet config says so); derive reads it as not stated, like a missing key
    "max_positions": Rule("int", "a positive integer (or -1: no limit)", 1, MAX_POSITIONS, also=(-1,)),
    "num_heads": _positive(MAX_HEADS),
    "num_kv_heads": _positive(MAX_HEADS),
    "head_dim": _positive(MAX_WIDTH),
    "intermediate_size": _positive(MAX_WIDTH),
    "q_lora_rank": _positive(MAX_WIDTH),
    "kv_lora_rank": _positive(MAX_WIDTH),
    "qk_nope_head_dim": _positive(MAX_WIDTH),
    "qk_rope_head_dim": _positive(MAX_WIDTH),
    "v_head_dim": _positive(MAX_WIDTH),
    "num_experts": _non_negative(MAX_EXPERTS),
    "top_k": _positive(MAX_EXPERTS),
    "expert_intermediate_size": _positive(MAX_WIDTH),
    "num_shared_experts": _non_negative(MAX_EXPERTS),
    "shared_expert_intermediate_size": _non_negative(MAX_WIDTH),
    "first_dense_layers": _non_negative(MAX_LAYERS),
    "dense_layer_list": Rule("ints", "a list of layer indices"),
    "moe_layer_list": Rule("ints", "a list of layer indices"),
    "dense_intermediate_size": _positive(MAX_WIDTH),
    "per_layer_input_width": _non_negative(MAX_WIDTH),  # 0: no per-layer embeddings
    "per_layer_input_vocab": _positive(MAX_VOCAB),
    "moe_layer_step": _positive(MAX_LAYERS),
    "norm_topk_prob": FLAG,
    "routed_scaling_factor": FINITE_NUMBER,
    "expert_groups": _positive(MAX_EXPERTS),
    "top_k_groups": _positive(MAX_EXPERTS),
    "layer_types": STRINGS,
    "sliding_window": _non_negative(MAX_POSITIONS),
    "use_sliding_window": FLAG,
    "max_window_layers": _non_negative(MAX_LAYERS),
    "sliding_window_pattern": _non_negative(MAX_LAYERS),
    "full_attention_interval": _positive(MAX_LAYERS),
    "attention_chunk_size": _positive(MAX_POSITIONS),
    "rope_layer_flags": Rule("ints", "a list of per-layer flags (1: the layer uses rope)"),
    "no_rope_interval": _positive(MAX_LAYERS),
    "tie_word_embeddings": FLAG,
    "rope_parameters": Rule("mapping", "a mapping of RoPE parameters"),
    "rope_theta": POSITIVE_NUMBER,
    "partial_rotary_factor": FRACTION,
    "original_positions": _positive(MAX_POSITIONS),
    "num_mtp_layers": _non_negative(MAX_LAYERS),
    "linear_num_key_heads": _positive(MAX_HEADS),
    "linear_num_value_heads": _positive(MAX_HEADS),
    "linear_key_head_dim": _positive(MAX_WIDTH),
    "linear_value_head_dim": _positive(MAX_WIDTH),
    "linear_conv_kernel_dim": _positive(MAX_CONV_KERNEL),
    "short_conv_kernel": _positive(MAX_CONV_KERNEL),
    "ffn_auto_adjust": FLAG,
    "ffn_dim_multiplier": POSITIVE_NUMBER,
    "ffn_multiple_of": _positive(MAX_WIDTH),
    "index_n_heads": _positive(MAX_HEADS),
    "index_head_dim": _positive(MAX_WIDTH),
    "index_topk": _positive(MAX_POSITIONS),
    # DeepSeek-V4's grouped output projection: o_groups groups of the heads, each to o_lora_rank
    "o_groups": _positive(MAX_HEADS),
    "o_lora_rank": _positive(MAX_WIDTH),
    # the linear-attention mixers' sizes (KDA, Mamba2, lightning attention); Mamba's head width and dt
    # rank may be "auto" (their config classes compute them), so ``linear_of`` reads those two
    "kda_num_heads": _positive(MAX_HEADS),
    "kda_head_dim": _positive(MAX_WIDTH),
    "mamba_num_heads": _positive(MAX_HEADS),
    "mamba_state_size": _positive(MAX_WIDTH),
    "mamba_groups": _positive(MAX_HEADS),
    "mamba_conv_kernel": _positive(MAX_CONV_KERNEL),
    "mamba_expand": POSITIVE_NUMBER,
    "mamba_inner": _positive(MAX_WIDTH),
    "mamba_gated_norm": FLAG,
    "lightning_block_size": _positive(MAX_POSITIONS),
}


@dataclass(frozen=True)
class Violation:
    """One config value that breaks its rule: ``key`` is its path in the config file."""

    key: str
    problem: str


class ConfigValueError(KadaptError):
    """Every violation of one config, one ``file: key: problem`` line each."""

    def __init__(self, origin: str, violations: Sequence[Violation]) -> None:
        self.origin = origin
        self.violations = tuple(violations)
        super().__init__("\n".join(render(origin, v) for v in self.violations))


def render(origin: str, violation: Violation) -> str:
    return f"{origin}: {violation.key}: {violation.problem}"


class Findings:
    """Values read against their rules one by one, every violation kept (a reader that computes from
    several values, like the vision tower's, reports them all at once with ``raise_any``)."""

    def __init__(self) -> None:
        self.violations: list[Violation] = []

    def take(self, key: str, value: Any, rule: Rule) -> Any:
        """``value`` when it keeps ``rule``, else None (and the violation, at ``key``, is kept)."""
        problem = rule.problem(value)
        if problem is None:
            return value
        self.violations.append(Violation(key, problem))
        return None

    def raise_any(self, origin: str) -> None:
        if self.violations:
            raise ConfigValueError(origin, self.violations)


def shown(value: Any, limit: int = 60) -> str:
    """``value`` as the config file spells it (JSON: ``NaN``, ``true``, ``"abc"``), cut to ``limit``."""
    try:
        text = json.dumps(value, default=repr)
    except (TypeError, ValueError, RecursionError):  # ints beyond str()'s digit limit, deep nesting
        text = type(value).__name__
        if isinstance(value, int):
            text = f"{'a negative' if value < 0 else 'an'} integer of {value.bit_length()} bits"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown_path(path: str | os.PathLike[str]) -> str:
    """A config file as findings name it: relative to the working directory when inside it."""
    absolute = Path(path).resolve()
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


# the rope types transformers builds: the ``_validate_<type>_rope_parameters`` methods of its
# ``RotaryEmbeddingConfigMixin`` (5.23 and 5.24 alike; ``test_rope_types`` holds them to the installed
# release). Its rotary classes look any other up in ``ROPE_INIT_FUNCTIONS`` and fail with a KeyError
# after kadapt has planned the model; remote code brings its own rope classes and names
ROPE_TYPES = ("axial", "default", "dynamic", "linear", "llama3", "longrope", "proportional", "yarn")
# the types that scale by a ``factor``: transformers' validation requires the key (a null one it only
# warns about, then rotates with a factor of nothing)
FACTOR_ROPE_TYPES = ("dynamic", "linear", "llama3", "yarn")
# the entries of a rope mapping ``rope_of`` reads: the type names it (and the label states it), the
# numbers are sizes or scales; any other number must be finite
ROPE_TYPE = Rule("string", "a rope type name (a string)")
ROPE_RULES: dict[str, Rule] = {
    "rope_type": ROPE_TYPE,
    "type": ROPE_TYPE,
    "rope_theta": POSITIVE_NUMBER,
    # the factor stretches a trained context of at least one position to at most MAX_POSITIONS
    "factor": Rule("number", "a positive finite number", 0, MAX_POSITIONS, exclusive_low=True),
    "partial_rotary_factor": FRACTION,
    "original_max_position_embeddings": _positive(MAX_POSITIONS),
}
# an entry of a rope mapping nested per layer type or label (Gemma-3's, DeepSeek-V4's): ``rope_of``
# reads each as that layer type's rope, null as none
LAYER_ROPE = Rule("mapping", "a layer type's or label's mapping of RoPE parameters (or null: no rope)")


def rope_violations(
    key: str,
    params: Mapping[str, Any],
    *,
    remote_code: bool = False,
    layer_types: frozenset[str] = frozenset(),
    nested: bool = True,
) -> list[Violation]:
    """Numbers of a ``rope_parameters`` mapping (and of its per-layer-type mappings, one level down)
    must be finite; the type, theta, the scaling factor, the rotated share of the head (at most all of
    it) and the original context are read as such (``ROPE_RULES``), a mapping or not. A mapping nested
    per layer type holds a mapping or null under every other key, as ``rope_of`` reads it (a string
    there would be dropped unread), and null (no rope) only in a mapping keyed by the config's
    ``layer_types``: in one keyed by labels none of which is a layer type (DeepSeek-V4's ``main`` and
    ``compress``) ``rope_of`` reads a null label as no entry at all, so the label's rope would vanish
    unsaid (a null layer type the config has no layer of, as in a truncated Beam, is harmless). Each
    rope mapping names a type transformers builds (not checked for ``remote_code``, whose classes name
    their own) and carries the factor its type scales by.
    ``key`` is the mapping's path in the config file."""
    per_layer_type = nested and any(
        isinstance(value, Mapping) for name, value in params.items() if name not in ROPE_RULES
    )
    found = []
    for name, value in params.items():
        path = f"{key}.{name}"
        if name in ROPE_RULES and value is not None:  # derive reads them as a name or numbers
            found += _violation(path, value, ROPE_RULES[name])
        elif isinstance(value, Mapping) and nested:
            found += rope_violations(path, value, remote_code=remote_code, nested=False)
        elif per_layer_type and value is not None:
            found += _violation(path, value, LAYER_ROPE)
        elif per_layer_type and layer_types and not layer_types & params.keys():
            what = "a mapping of RoPE parameters (keyed by labels, not layer types: null names no rope)"
            found.append(Violation(path, f"expected {what}, found null"))
        elif _has_kind("number", value):  # the rest may be strings or flags
            found += _violation(path, value, FINITE_NUMBER)
    return found if per_layer_type else found + _rope_type_violations(key, params, remote_code)


def _rope_type_violations(key: str, params: Mapping[str, Any], remote_code: bool) -> list[Violation]:
    """One rope mapping's type against the types transformers builds, and the factor its type needs.
    The type is read as transformers reads it (``rope_type``, else the legacy ``type``, else
    ``default``), so a null or empty one is refused (transformers' rotary embedding raises a bare
    ``KeyError`` on it) rather than read as ``default``; a type that is no string is ``ROPE_TYPE``'s."""
    name = "rope_type" if "rope_type" in params or "type" not in params else "type"
    kind = params.get(name, "default")
    if kind is not None and not isinstance(kind, str):
        return []
    if kind not in ROPE_TYPES and not remote_code:
        what = f"one of transformers' rope types ({', '.join(ROPE_TYPES)})"
        return [Violation(f"{key}.{name}", f"expected {what}, found {shown(kind)}")]
    if kind in FACTOR_ROPE_TYPES and params.get("factor") is None:
        found = shown(params["factor"]) if "factor" in params else "none"
        what = f"a positive number (rope type {kind!r} scales by it)"
        return [Violation(f"{key}.factor", f"expected {what}, found {found}")]
    return []


def _violation(key: str, value: Any, rule: Rule) -> list[Violation]:
    problem = rule.problem(value)
    return [] if problem is None else [Violation(key, problem)]


@dataclass(frozen=True)
class Facts:
    """What cross-field rules read: ``valid`` maps each fact that kept its own rule to ``(key, value)``;
    ``present`` names every fact the config sets, broken or not (an MLA config with a broken
    ``kv_lora_rank`` is still MLA)."""

    valid: Mapping[str, tuple[str, Any]]
    present: frozenset[str]

    def value(self, fact: str) -> Any:
        return self.valid[fact][1] if fact in self.valid else None

    def key(self, fact: str) -> str:
        return self.valid[fact][0]


CrossRule = Callable[[Facts], "tuple[str, str] | None"]  # -> (key of the finding, problem) or None


def cross_field(facts: Facts, prefix: str) -> list[Violation]:
    """Rules between facts that all kept their own (a broken fact's rules are left to its finding)."""
    rules: tuple[CrossRule, ...] = (
        _kv_heads_split,
        _width_per_head,
        _top_k_within,
        _top_k_groups_within,
        _linear_heads_split,
        _output_groups_split,
        _rope_flag_per_layer,
    )
    found = [rule(facts) for rule in rules]
    return [Violation(prefix + key, problem) for key, problem in filter(None, found)]


def _kv_heads_split(facts: Facts) -> tuple[str, str] | None:
    """GQA/MQA: the query heads split evenly over the KV heads (MLA keeps them equal: not read)."""
    heads, kv = facts.value("num_heads"), facts.value("num_kv_heads")
    if heads is None or kv is None or "kv_lora_rank" in facts.present or heads % kv == 0:
        return None
    problem = f"the {heads} attention heads ({facts.key('num_heads')}) do not split into {kv} KV heads"
    return facts.key("num_kv_heads"), problem


def _linear_heads_split(facts: Facts) -> tuple[str, str] | None:
    """Gated DeltaNet: the value heads split evenly over the key heads (the mixer groups them)."""
    keys, values = facts.value("linear_num_key_heads"), facts.value("linear_num_value_heads")
    if keys is None or values is None or values % keys == 0:
        return None
    key_heads = facts.key("linear_num_key_heads")
    problem = f"the {values} linear value heads do not split into {keys} key heads ({key_heads})"
    return facts.key("linear_num_value_heads"), problem


def _output_groups_split(facts: Facts) -> tuple[str, str] | None:
    """DeepSeek-V4: the grouped output projection splits the heads' channels (heads x head_dim) evenly
    into ``o_groups`` groups (transformers reshapes the attention output so)."""
    heads, width, groups = facts.value("num_heads"), facts.value("head_dim"), facts.value("o_groups")
    if heads is None or width is None or groups is None or (heads * width) % groups == 0:
        return None
    channels = f"{heads} x {width} attention channels ({facts.key('num_heads')} x {facts.key('head_dim')})"
    return facts.key("o_groups"), f"the {channels} do not split into {groups} output groups"


def _width_per_head(facts: Facts) -> tuple[str, str] | None:
    """Without ``head_dim`` a head is ``hidden // heads`` wide: more heads than hidden leaves it 0."""
    heads, hidden = facts.value("num_heads"), facts.value("hidden_size")
    mla_or_stated = {"head_dim", "kv_lora_rank"} & facts.present
    if heads is None or hidden is None or mla_or_stated or heads <= hidden:
        return None
    problem = f"{heads} heads leave no width per head of the {hidden} hidden ({facts.key('hidden_size')})"
    return facts.key("num_heads"), problem + " and no head_dim is set"


def _rope_flag_per_layer(facts: Facts) -> tuple[str, str] | None:
    """Llama-4's ``no_rope_layers``: a flag for every layer (transformers indexes it by layer; an empty
    list is the class's default)."""
    flags, layers = facts.value("rope_layer_flags"), facts.value("num_layers")
    if not flags or layers is None or len(flags) >= layers:
        return None
    expected = f"expected a flag for each of the {layers} layers ({facts.key('num_layers')})"
    return facts.key("rope_layer_flags"), f"{expected}, found {len(flags)}"


def _at_most(facts: Facts, fact: str, whole: str, what: str) -> tuple[str, str] | None:
    """``fact`` picks from ``whole``: at most all of them."""
    part, total = facts.value(fact), facts.value(whole)
    if not total or part is None or part <= total:
        return None
    return facts.key(fact), f"expected at most the {total} {what} ({facts.key(whole)}), found {part}"


def _top_k_within(facts: Facts) -> tuple[str, str] | None:
    return _at_most(facts, "top_k", "num_experts", "routed experts")


def _top_k_groups_within(facts: Facts) -> tuple[str, str] | None:
    return _at_most(facts, "top_k_groups", "expert_groups", "expert groups")
