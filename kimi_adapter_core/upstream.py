"""transformers' internals kadapt relies on: every contact point, feature-detected, probed once.

kadapt calls decoder layers itself, hands them its own static KV cache, reads transformers' loading
converters and dtype plan, precomputes MoonViT's grid tensors with transformers' helpers and plugs
kernels into its attention interface. None of that is public API, and a minor release moves it
(5.24 renamed the layers' ``past_key_values`` to ``cache`` and made ``get_vision_temporal_merge_index``
return a tuple). This module is the one place that touches those internals: each contact point is a
``ContactPoint`` with a probe that detects the current shape of the internal (by signature or by
calling it on something tiny), never by comparing version strings. A probe that finds a shape kadapt
does not know raises ``ContactPointMoved``: one message naming the contact point, what kadapt expected,
what it found and the versions kadapt is tested with, before any export starts.

Two kinds of probe:
- library probes (``check``) need no model: signatures and tiny behavioural calls, milliseconds each;
- ``probe_decoder_layers`` runs the model's own decoder layers (on whatever device they are, meta
  included) once per layer structure with a recording cache: which keyword takes the cache, how the
  attention calls ``Cache.update``, what the layer returns, what the rotary embedding returns. A result
  answers only for layers whose classes hold the same methods (``_layer_key``): a probe made under one
  spec's patches is never reused without them or under others.

Self-contained on purpose (the standard library at import; torch and transformers inside functions):
``kadapt generate`` embeds this module verbatim in standalone extraction modules, which run the same
checks at import and when they build their wrappers. Keep it free of kadapt imports, and of
dataclasses (they need their module in ``sys.modules``, which an ``exec``'d generated module is not).

Why one module: it is embedded as one body into generated extraction modules (above), and its one
concern is the list of transformers internals kadapt touches; a reader looks for a contact point
here, and ``kadapt doctor`` and docs/compatibility.md list them in this order.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

# The releases this kadapt is tested with (CI runs the suite on each; constraints.txt pins the newest).
TESTED_TRANSFORMERS = ("5.23.0", "5.24.0")
TESTED_TORCH = ("2.13.0",)
# Where a user reads what each contact point is and what to do when one moves.
COMPATIBILITY_DOC = "docs/compatibility.md"


def untested_release() -> str | None:
    """A sentence when the installed transformers is not a release kadapt is tested with, else None."""
    version = _version("transformers")
    if version in TESTED_TRANSFORMERS:
        return None
    return (
        f"transformers {version} is not a release kadapt is tested with ({', '.join(TESTED_TRANSFORMERS)}); "
        "its contact points hold, and --verify checks the artifacts against it"
    )


class ContactPointMoved(RuntimeError):
    """An internal of transformers kadapt relies on is not where (or not what) kadapt expects.

    ``findings`` holds one ``Finding`` per moved contact point; the message names each with what was
    expected and what was found, then the tested versions.
    """

    def __init__(self, findings: Sequence[Finding]) -> None:
        self.findings = tuple(findings)
        lines = [
            f"transformers {_version('transformers')} moved "
            + ("a contact point" if len(self.findings) == 1 else f"{len(self.findings)} contact points")
            + " kadapt relies on:"
        ]
        for finding in self.findings:
            lines.append(
                f"  {finding.name} ({finding.symbol}): expected {finding.expected}; found {finding.found}"
            )
        lines.append(
            f"kadapt is tested with transformers {', '.join(TESTED_TRANSFORMERS)} and torch "
            f"{', '.join(TESTED_TORCH)}; install a tested release (pip install "
            f"'transformers=={TESTED_TRANSFORMERS[-1]}') or see {COMPATIBILITY_DOC}"
        )
        super().__init__("\n".join(lines))


class LayersUnsupported(ContactPointMoved):
    """The model's own decoder layers, probed with the ABI's cache, do not fit kadapt's ABI.

    A family trait (an attention that asks the cache for its length, a complex rotary embedding, a
    layer that reads tensor values) or a release that changed a tested family: the message says both,
    with the contact point, what was expected and found, and the tested versions. ``code`` is the
    refusal code kadapt documents for it (``cache-protocol``, ``rotary-form``, ``not-exportable``).
    """

    def __init__(self, code: str, layer: str, finding: Finding) -> None:
        self.code = code
        self.findings = (finding,)
        RuntimeError.__init__(
            self,
            f"refused ({code}): {layer} does not fit kadapt's prefill/decode ABI:\n"
            f"  {finding.name} ({finding.symbol}): expected {finding.expected}; found {finding.found}\n"
            f"kadapt is tested with transformers {', '.join(TESTED_TRANSFORMERS)} and torch "
            f"{', '.join(TESTED_TORCH)}; a family that exported with those and fails here was moved by "
            f"transformers {_version('transformers')}: install a tested release (pip install "
            f"'transformers=={TESTED_TRANSFORMERS[-1]}') or see {COMPATIBILITY_DOC}",
        )


class _Moved(Exception):
    """Raised by a probe: the internal exists in a shape kadapt does not know."""

    def __init__(self, expected: str, found: str) -> None:
        super().__init__(found)
        self.expected = expected
        self.found = found


class Finding(NamedTuple):
    """What one probe saw: ``ok`` with what was found, or moved (``expected`` vs ``found``)."""

    name: str
    symbol: str
    ok: bool
    found: str
    expected: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "symbol": self.symbol,
            "status": "ok" if self.ok else "moved",
            "found": self.found,
            "expected": self.expected,
        }


class ContactPoint(NamedTuple):
    """One internal of transformers: what it is, why kadapt needs it, who uses it, how it is probed."""

    name: str
    symbol: str  # the transformers symbol or behaviour, as a reader would search for it
    expected: str  # the shape kadapt knows, as the error states it
    why: str
    used_by: tuple[str, ...]  # kadapt parts that rely on it
    probe: Callable[[], str]  # returns what it found; raises _Moved


def _version(package: str) -> str:
    try:
        return str(importlib.import_module(package).__version__)
    except Exception:  # noqa: BLE001 - a report, not a dependency
        return "(not importable)"


def _signature(func: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(inspect.unwrap(func))


def _describe(func: Callable[..., Any], name: str) -> str:
    return f"{name}{_signature(func)}".replace("torch.", "")


def _attr(module: str, name: str, expected: str) -> Any:
    """``module.name``, or _Moved saying which of the two is gone."""
    try:
        owner = importlib.import_module(module)
    except ImportError as exc:
        raise _Moved(expected, f"module {module} does not import ({exc})") from exc
    if not hasattr(owner, name):
        raise _Moved(expected, f"{module} has no {name}")
    return getattr(owner, name)


def _leading_parameters(func: Callable[..., Any], names: Sequence[str]) -> tuple[bool, bool]:
    """Whether ``func``'s parameters after ``self`` start with ``names``, and whether it takes more."""
    params = list(_signature(func).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    leading = [p.name for p in params[: len(names)]] == list(names)
    extra = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)
    return leading, extra


# -- library probes ---------------------------------------------------------------------------------

CACHE_UPDATE = ("key_states", "value_states", "layer_idx")


def _probe_cache_update() -> str:
    expected = "Cache.update(key_states, value_states, layer_idx, *args, **kwargs)"
    cache = _attr("transformers.cache_utils", "Cache", expected)
    update = getattr(cache, "update", None)
    if update is None:
        raise _Moved(expected, "Cache has no update")
    leading, extra = _leading_parameters(update, CACHE_UPDATE)
    if not (leading and extra):
        raise _Moved(expected, _describe(update, "Cache.update"))
    return _describe(update, "Cache.update")


# Cache's linear-attention API (transformers 5.23+): name -> its leading parameters after ``self``
LINEAR_CACHE_METHODS = {
    "get_conv_state": ("layer_idx", "state_idx"),
    "update_conv_state": ("conv_states", "layer_idx", "state_idx"),
    "get_recurrent_state": ("layer_idx", "state_idx"),
    "update_recurrent_state": ("recurrent_states", "layer_idx", "state_idx"),
    "is_recording_past": ("layer_idx",),
}


def _probe_linear_attention_cache() -> str:
    expected = ", ".join(
        f"Cache.{name}({', '.join(params)}, ...)" for name, params in LINEAR_CACHE_METHODS.items()
    )
    cache = _attr("transformers.cache_utils", "Cache", expected)
    for name, params in LINEAR_CACHE_METHODS.items():
        method = getattr(cache, name, None)
        if method is None:
            raise _Moved(expected, f"Cache has no {name}")
        if not _leading_parameters(method, params)[0]:
            raise _Moved(expected, _describe(method, f"Cache.{name}"))
    return "Cache." + ", ".join(LINEAR_CACHE_METHODS)


def _probe_short_conv_cache() -> str:
    """The linear-attention API (``linear_attention_cache``), and a ``DynamicCache`` built for one ``conv``
    layer (LFM2's layer type) keeping its window alone: a two-channel kernel-3 window updated by a
    one-token prefill and a one-token decode returns the padded inputs, then the window plus the token,
    keeps the last 3 inputs and no recurrent state (what the equivalence check reads back)."""
    import torch

    expected = (
        "DynamicCache(config with layer_types ['conv']).update_conv_state(inputs, 0, conv_kernel_size=3) "
        "returns the inputs behind zeros (prefill), then behind the window (decode); get_conv_state(0) "
        "is the last 3 inputs and get_recurrent_state(0) None"
    )
    _probe_linear_attention_cache()
    config_class = _attr("transformers", "PretrainedConfig", expected)
    cache = _attr("transformers.cache_utils", "DynamicCache", expected)(
        config=config_class(layer_types=["conv"], num_hidden_layers=1)
    )
    before = cache.get_conv_state(0)
    prefill = cache.update_conv_state(torch.ones(1, 2, 1), 0, conv_kernel_size=3)
    decode = cache.update_conv_state(torch.full((1, 2, 1), 2.0), 0, conv_kernel_size=3)
    window, recurrent = cache.get_conv_state(0), cache.get_recurrent_state(0)
    row = lambda *values: [list(values)] * 2  # noqa: E731 - both channels hold the same inputs
    found = (
        before,
        prefill.tolist() == [row(0.0, 0.0, 1.0)],
        decode.tolist() == [row(0.0, 0.0, 1.0, 2.0)],
        window is not None and window.tolist() == [row(0.0, 1.0, 2.0)],
        recurrent,
    )
    if found != (None, True, True, True, None):
        raise _Moved(expected, f"(state before, prefill, decode, window, recurrent state) checks: {found}")
    return "DynamicCache keeps a conv layer's window alone (LinearAttentionLayer.conv_states)"


# MiniMax's cache (``MiniMaxCache``, a DynamicCache subclass the model's forward insists on) and the
# lightning-attention API on it: name -> its leading parameters after ``self``
MINIMAX_CACHE = ("transformers.models.minimax.modeling_minimax", "MiniMaxCache")
LIGHTNING_CACHE_METHODS = {
    "get_linear_cache": ("layer_idx",),
    "set_linear_cache": ("layer_idx", "linear_cache"),
}


def _probe_lightning_attention_cache() -> str:
    import torch

    expected = (
        "MiniMaxCache.get_linear_cache(layer_idx) -> None before the layer's first "
        "set_linear_cache(layer_idx, linear_cache), then that state"
    )
    cache_class = _attr(*MINIMAX_CACHE, expected)
    for name, params in LIGHTNING_CACHE_METHODS.items():
        method = getattr(cache_class, name, None)
        if method is None:
            raise _Moved(expected, f"MiniMaxCache has no {name}")
        if not _leading_parameters(method, params)[0]:
            raise _Moved(expected, _describe(method, f"MiniMaxCache.{name}"))
    cache, state = cache_class(), torch.zeros(1, 1, 1, 1)
    before = cache.get_linear_cache(0)
    cache.set_linear_cache(0, state)
    if before is not None or cache.get_linear_cache(0) is not state:
        raise _Moved(expected, f"get_linear_cache(0) returns {type(before).__name__} before a state is set")
    return "MiniMaxCache." + ", ".join(LIGHTNING_CACHE_METHODS)


# The CausalLMs whose forward casts the final hidden states to the LM head's dtype (their
# ``residual_in_fp32`` residual stream reaches the final norm in float32): module, class, config class
HEAD_CASTING_MODELS = (
    ("transformers.models.mamba.modeling_mamba", "MambaForCausalLM", "MambaConfig"),
    ("transformers.models.falcon_mamba.modeling_falcon_mamba", "FalconMambaForCausalLM", "FalconMambaConfig"),
)


def _probe_head_input_cast() -> str:
    """Each model in bfloat16 with its float32 residual stream runs a two-token forward on CPU: the
    LM head takes the final norm's float32 output only through the cast (without it, the bf16 head's
    matmul raises a dtype mismatch)."""
    import torch
    from transformers.utils import logging as transformers_logging

    expected = "lm_head(hidden_states.to(lm_head.weight.dtype)) in the CausalLM forward"
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # the probe's forward is not the user's: no kernel notices
    try:
        for module, name, config_name in HEAD_CASTING_MODELS:
            model_class, config_class = _attr(module, name, expected), _attr(module, config_name, expected)
            config = config_class(
                vocab_size=8, hidden_size=8, state_size=2, num_hidden_layers=1, residual_in_fp32=True
            )
            model = model_class(config).to(torch.bfloat16).eval()
            try:
                with torch.no_grad():
                    model(torch.zeros(1, 2, dtype=torch.long), use_cache=False)
            except RuntimeError as exc:
                found = f"{name} in bfloat16 with a float32 residual stream raises: {exc}"
                raise _Moved(expected, found) from exc
    finally:
        transformers_logging.set_verbosity(verbosity)
    return ", ".join(f"{name}.forward" for _, name, _ in HEAD_CASTING_MODELS) + " cast to the head's dtype"


def model_cache_class(model: Any) -> Any:
    """The cache class a model's forward accepts: ``MiniMaxCache`` for MiniMax (its forward refuses any
    other), else ``DynamicCache``; the equivalence check records transformers' states in a subclass."""
    if getattr(getattr(model, "config", None), "model_type", None) == "minimax":
        return _attr(*MINIMAX_CACHE, "MiniMaxCache")
    return _attr("transformers.cache_utils", "DynamicCache", "DynamicCache")


def _probe_indexer_cache() -> str:
    expected = "Cache.update_indexer(indexer_key_states, layer_idx) returning every cached indexer key"
    cache = _attr("transformers.cache_utils", "Cache", expected)
    method = getattr(cache, "update_indexer", None)
    if method is None:
        raise _Moved(expected, "Cache has no update_indexer")
    if not _leading_parameters(method, ("indexer_key_states", "layer_idx"))[0]:
        raise _Moved(expected, _describe(method, "Cache.update_indexer"))
    return _describe(method, "Cache.update_indexer")


def _probe_cache_seq_length() -> str:
    expected = "Cache.get_seq_length(layer_idx=0) -> the tokens cached before the current call"
    cache = _attr("transformers.cache_utils", "Cache", expected)
    method = getattr(cache, "get_seq_length", None)
    if method is None:
        raise _Moved(expected, "Cache has no get_seq_length")
    if not _leading_parameters(method, ("layer_idx",))[0]:
        raise _Moved(expected, _describe(method, "Cache.get_seq_length"))
    return _describe(method, "Cache.get_seq_length")


GEMMA4 = "transformers.models.gemma4.modeling_gemma4"
# what kadapt's wrappers read of a stack with per-layer embeddings (the runtime's ``PerLayerInputs``):
# the language model's methods (name -> leading parameters after ``self``) and the attributes they read
PER_LAYER_INPUT_METHODS = {
    "get_per_layer_inputs": ("input_ids", "inputs_embeds"),
    "project_per_layer_inputs": ("inputs_embeds", "per_layer_inputs"),
}
PER_LAYER_INPUT_ATTRIBUTES = (
    "embed_tokens_per_layer",
    "per_layer_model_projection",
    "per_layer_projection_norm",
    "hidden_size_per_layer_input",
    "per_layer_model_projection_scale",
    "per_layer_input_scale",
)


def _probe_per_layer_inputs() -> str:
    expected = (
        "Gemma4TextModel.get_per_layer_inputs(input_ids, inputs_embeds) and project_per_layer_inputs("
        "inputs_embeds, per_layer_inputs) reading only the PLE parts __init__ sets; "
        "Gemma4TextDecoderLayer.forward takes per_layer_input and shared_kv_states"
    )
    model = _attr(GEMMA4, "Gemma4TextModel", expected)
    layer = _attr(GEMMA4, "Gemma4TextDecoderLayer", expected)
    for name, leading in PER_LAYER_INPUT_METHODS.items():
        method = getattr(model, name, None)
        if method is None or not _leading_parameters(method, leading)[0]:
            raise _Moved(expected, _describe(method, name) if method else f"Gemma4TextModel has no {name}")
    source = inspect.getsource(model.__init__)
    missing = [name for name in PER_LAYER_INPUT_ATTRIBUTES if f"self.{name} =" not in source]
    if missing:
        raise _Moved(expected, f"Gemma4TextModel.__init__ no longer sets {', '.join(missing)}")
    taken = _signature(layer.forward).parameters
    if not {"per_layer_input", "shared_kv_states"} <= set(taken):
        raise _Moved(expected, _describe(layer.forward, "Gemma4TextDecoderLayer.forward"))
    return "; ".join(_describe(getattr(model, name), name) for name in PER_LAYER_INPUT_METHODS)


# the stacks with hyper-connections (the runtime's ``ResidualStreams``): module -> their decoder model
RESIDUAL_STREAM_MODELS = {
    "transformers.models.hy_v4.modeling_hy_v4": "HYV4Model",
    "transformers.models.deepseek_v4.modeling_deepseek_v4": "DeepseekV4Model",
}


def _probe_residual_streams() -> str:
    expected = (
        "HYV4Model / DeepseekV4Model.forward copies the input embeddings into config.hc_mult streams "
        "(inputs_embeds.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1)) and computes "
        "self.norm(self.hc_head(hidden_states)) after the last layer"
    )
    found = []
    for module, name in RESIDUAL_STREAM_MODELS.items():
        model = _attr(module, name, expected)
        source = " ".join(inspect.getsource(model.forward).split())
        for step in (".unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1)", "self.norm(self.hc_head("):
            if step not in source:
                raise _Moved(expected, f"{name}.forward no longer has {step}")
        if "self.hc_head =" not in inspect.getsource(model.__init__):
            raise _Moved(expected, f"{name}.__init__ no longer sets hc_head")
        found.append(name)
    return f"{' and '.join(found)}: embeddings expanded to hc_mult streams, hc_head before the final norm"


DEEPSEEK_V4 = "transformers.models.deepseek_v4.modeling_deepseek_v4"
# the stacks whose rope is keyed by labels, not layer types (the runtime's rope keys, ``rope_labels``):
# module -> their decoder model
ROPE_BY_LABEL_MODELS = {DEEPSEEK_V4: "DeepseekV4Model"}


def _probe_rope_by_label() -> str:
    expected = (
        "DeepseekV4Model.forward hands every layer position_embeddings = {label: self.rotary_emb("
        "inputs_embeds, position_ids=position_ids, layer_type=label)} for each label of "
        "config.rope_parameters (DeepseekV4RotaryEmbedding.layer_types), and DeepseekV4Attention.forward "
        "picks position_embeddings[self.rope_layer_type]"
    )
    model = _attr(DEEPSEEK_V4, "DeepseekV4Model", expected)
    attention = _attr(DEEPSEEK_V4, "DeepseekV4Attention", expected)
    rotary = _attr(DEEPSEEK_V4, "DeepseekV4RotaryEmbedding", expected)
    source = " ".join(inspect.getsource(model.forward).split())
    for step in (
        "position_embeddings = {",
        "self.rotary_emb(inputs_embeds, position_ids=position_ids, layer_type=",
    ):
        if step not in source:
            raise _Moved(expected, f"DeepseekV4Model.forward no longer has {step}")
    if "position_embeddings[self.rope_layer_type]" not in inspect.getsource(attention.forward):
        raise _Moved(
            expected, "DeepseekV4Attention.forward no longer picks position_embeddings[self.rope_layer_type]"
        )
    if "self.layer_types = [k for k, v in config.rope_parameters.items()" not in inspect.getsource(
        rotary.__init__
    ):
        raise _Moved(
            expected, "DeepseekV4RotaryEmbedding no longer keeps the rope_parameters labels as layer_types"
        )
    if "layer_type" not in _signature(rotary.forward).parameters:
        raise _Moved(expected, _describe(rotary.forward, "DeepseekV4RotaryEmbedding.forward"))
    return "DeepseekV4Model: every layer takes {label: (cos, sin)} of config.rope_parameters' labels"


def _probe_layer_input_ids() -> str:
    expected = (
        "DeepseekV4Model.forward hands every layer input_ids=input_ids; DeepseekV4DecoderLayer.forward "
        "takes input_ids and DeepseekV4HashRouter picks the experts of tid2eid[input_ids]"
    )
    model = _attr(DEEPSEEK_V4, "DeepseekV4Model", expected)
    layer = _attr(DEEPSEEK_V4, "DeepseekV4DecoderLayer", expected)
    router = _attr(DEEPSEEK_V4, "DeepseekV4HashRouter", expected)
    if "input_ids=input_ids" not in " ".join(inspect.getsource(model.forward).split()):
        raise _Moved(expected, "DeepseekV4Model.forward no longer hands its layers input_ids=input_ids")
    if "input_ids" not in _signature(layer.forward).parameters:
        raise _Moved(expected, _describe(layer.forward, "DeepseekV4DecoderLayer.forward"))
    if "self.tid2eid[input_ids" not in inspect.getsource(router.forward):
        raise _Moved(expected, "DeepseekV4HashRouter.forward no longer reads self.tid2eid[input_ids]")
    return "DeepseekV4DecoderLayer.forward takes the call's input_ids (hash routing: tid2eid[input_ids])"


# what the ``deepseek_v4_hca_compressor`` builtin reads of upstream's HCA compressor besides the pinned
# forward it replaces: its modules and sizes, and the attention's call of it (the static cache's
# ``compressed_window``/``write_compressed`` protocol stands in for DeepseekV4HCACache's)
HCA_COMPRESSOR_PARTS = (
    "self.compress_rate", "self.kv_proj", "self.gate_proj", "self.position_bias", "self.kv_norm",
    "self.rotary_emb",
)  # fmt: skip
# the attention hands its compressor all five by position; the cache is ``cache`` on 5.24 and
# ``past_key_values`` on 5.23, the builtins' fourth positional parameter on both
COMPRESSOR_CACHE_NAMES = ("cache", "past_key_values")
HCA_COMPRESSOR_CALL = tuple(
    f"self.compressor(hidden_states, q_residual, position_ids, {name}, self.layer_idx)"
    for name in COMPRESSOR_CACHE_NAMES
)
# what the ``deepseek_v4_csa_compressor`` and ``deepseek_v4_indexer`` builtins read besides: the csa
# compressor's indexer, the indexer's query projection, scorer and top-k (its own compressor's parts too)
COMPRESSOR_PARTS = {
    "DeepseekV4HCACompressor": HCA_COMPRESSOR_PARTS,
    "DeepseekV4CSACompressor": (*HCA_COMPRESSOR_PARTS, "self.head_dim", "self.indexer"),
    "DeepseekV4Indexer": (
        *HCA_COMPRESSOR_PARTS,
        "self.head_dim",
        "self.index_topk",
        "self.q_b_proj",
        "self.scorer",
    ),
}


def _probe_compressor_cache() -> str:
    expected = (
        "DeepseekV4Attention.forward calls self.compressor(hidden_states, q_residual, position_ids, cache, "
        "self.layer_idx) and concatenates the entries it returns after the sliding keys, with its "
        "block_bias after the mask; DeepseekV4HCACompressor, DeepseekV4CSACompressor and DeepseekV4Indexer "
        "keep compress_rate, kv_proj, gate_proj, position_bias, kv_norm and rotary_emb (the csa compressor "
        "its indexer, the indexer q_b_proj, scorer and index_topk) and take (hidden_states, q_residual, "
        "position_ids, cache, layer_idx) (5.23: past_key_values for cache), and the module has "
        "apply_rotary_pos_emb"
    )
    attention = _attr(DEEPSEEK_V4, "DeepseekV4Attention", expected)
    _attr(DEEPSEEK_V4, "apply_rotary_pos_emb", expected)
    source = " ".join(inspect.getsource(attention.forward).split()).replace("( ", "(").replace(" )", ")")
    if not any(call in source for call in HCA_COMPRESSOR_CALL):
        raise _Moved(expected, f"DeepseekV4Attention.forward no longer has {HCA_COMPRESSOR_CALL[0]}")
    concatenations = ("torch.cat([kv, compressed_kv], dim=2)", "torch.cat([attention_mask, block_bias")
    for step in concatenations:
        if step not in source:
            raise _Moved(expected, f"DeepseekV4Attention.forward no longer has {step}")
    for name, parts in COMPRESSOR_PARTS.items():
        module = _attr(DEEPSEEK_V4, name, expected)
        init = inspect.getsource(module.__init__)
        missing = [part for part in parts if f"{part} =" not in init]
        if missing:
            raise _Moved(expected, f"{name}.__init__ no longer sets {', '.join(missing)}")
        names = ("hidden_states", "q_residual", "position_ids")
        if not any(
            _leading_parameters(module.forward, (*names, cache, "layer_idx"))[0]
            for cache in COMPRESSOR_CACHE_NAMES
        ):
            raise _Moved(expected, _describe(module.forward, f"{name}.forward"))
    return (
        "DeepseekV4HCACompressor, DeepseekV4CSACompressor, DeepseekV4Indexer(hidden_states, q_residual, "
        "position_ids, cache, layer_idx)"
    )


# the model types whose learned absolute position tables keep rows before position 0, and those tables
# (their ``offset``): module -> class
OFFSET_POSITION_MODEL_TYPES = ("opt", "biogpt", "trocr")
OFFSET_POSITION_TABLES = {
    "transformers.models.opt.modeling_opt": "OPTLearnedPositionalEmbedding",
    "transformers.models.biogpt.modeling_biogpt": "BioGptLearnedPositionalEmbedding",
    "transformers.models.trocr.modeling_trocr": "TrOCRLearnedPositionalEmbedding",
}


def _probe_learned_positions() -> str:
    import torch

    expected = (
        "an nn.Embedding of num_embeddings + offset rows whose forward looks up "
        "super().forward(position_ids + self.offset)"
    )
    found = []
    for module, name in OFFSET_POSITION_TABLES.items():
        table = _attr(module, name, expected)(4, 2)
        offset = getattr(table, "offset", None)
        if not isinstance(table, torch.nn.Embedding) or not isinstance(offset, int):
            raise _Moved(expected, f"{name} is no nn.Embedding with an int offset")
        source = " ".join(inspect.getsource(type(table).forward).split())
        if table.num_embeddings != 4 + offset or "super().forward(position_ids + self.offset)" not in source:
            raise _Moved(expected, f"{name}.forward no longer looks up position_ids + self.offset")
        found.append(f"{name} (offset {offset})")
    return ", ".join(found)


XGLM = "transformers.models.xglm.modeling_xglm"
# the model types whose position embeddings a module computes from the positions (runtime
# add_learned_positions calls it)
COMPUTED_POSITION_MODEL_TYPES = ("xglm",)


def _probe_sinusoidal_positions() -> str:
    import torch

    expected = (
        "XGLMSinusoidalPositionalEmbedding(num_positions, embedding_dim, padding_idx).forward(position_ids, "
        "cache_length=0) -> [B, Q, dim], its weights buffer's rows at position_ids + offset, no parameters"
    )
    table = _attr(XGLM, "XGLMSinusoidalPositionalEmbedding", expected)(6, 4, 1)
    offset = getattr(table, "offset", None)
    if not isinstance(offset, int) or any(True for _ in table.parameters()):
        raise _Moved(expected, "no int offset, or parameters of its own")
    positions = torch.tensor([[0, 3, 5]])
    found = table(positions)
    if tuple(found.shape) != (1, 3, 4) or not torch.equal(found[0], table.weights[positions[0] + offset]):
        raise _Moved(expected, f"{tuple(found.shape)} of {found.flatten().tolist()}")
    return f"XGLMSinusoidalPositionalEmbedding(position_ids): weights[position_ids + {offset}]"


BLOOM = "transformers.models.bloom.modeling_bloom"
MPT = "transformers.models.mpt.modeling_mpt"
FALCON = "transformers.models.falcon.modeling_falcon"
# the model types whose stack builds its ALiBi bias (runtime.AlibiBias; Falcon's where its config says)
ALIBI_MODEL_TYPES = ("bloom", "mpt", "falcon")


def _probe_alibi_bias() -> str:
    import torch

    expected = (
        "BloomModel.build_alibi_tensor(attention_mask [B, K], num_heads, dtype) -> [B * heads, 1, K], "
        "each head's slope times the visible keys before each key; BloomBlock.forward(alibi=)"
    )
    model = _attr(BLOOM, "BloomModel", expected)
    block = _attr(BLOOM, "BloomBlock", expected)
    if "alibi" not in _signature(block.forward).parameters:
        raise _Moved(expected, f"BloomBlock.forward{_signature(block.forward)}")
    mask = torch.tensor([[1, 1, 1, 0]])
    bias = model.build_alibi_tensor(None, mask, 2, torch.float32)
    slopes = bias[:, 0, 1]
    if tuple(bias.shape) != (2, 1, 4) or not torch.equal(bias[:, 0, :3], slopes[:, None] * torch.arange(3)):
        raise _Moved(expected, f"a [2, 1, 4] bias of slope * key; got {bias.flatten().tolist()}")
    expected = (
        "MptModel.build_mpt_alibi_tensor(num_heads, sequence_length, device=) -> [heads, 1, "
        "sequence_length], each head's slope times each key's distance to the last; "
        "MptBlock.forward(position_bias=)"
    )
    model = _attr(MPT, "MptModel", expected)
    block = _attr(MPT, "MptBlock", expected)
    if "position_bias" not in _signature(block.forward).parameters:
        raise _Moved(expected, f"MptBlock.forward{_signature(block.forward)}")
    bias = model.build_mpt_alibi_tensor(None, 2, 3, device="cpu")
    distances = torch.arange(-2, 1)  # each key's distance to the last
    if tuple(bias.shape) != (2, 1, 3) or not torch.equal(bias[:, 0, :], -bias[:, :1, 1] * distances):
        raise _Moved(expected, f"a [2, 1, 3] bias of slope * (key - last); got {bias.flatten().tolist()}")
    expected = (
        "modeling_falcon.build_alibi_tensor(attention_mask [B, K], num_heads, dtype) -> [B * heads, 1, K], "
        "each head's slope times the visible keys before each key; FalconDecoderLayer.forward(alibi=)"
    )
    builder = _attr(FALCON, "build_alibi_tensor", expected)
    layer = _attr(FALCON, "FalconDecoderLayer", expected)
    if "alibi" not in _signature(layer.forward).parameters:
        raise _Moved(expected, f"FalconDecoderLayer.forward{_signature(layer.forward)}")
    bias = builder(mask, 2, torch.float32)
    slopes = bias[:, 0, 1]
    if tuple(bias.shape) != (2, 1, 4) or not torch.equal(bias[:, 0, :3], slopes[:, None] * torch.arange(3)):
        raise _Moved(expected, f"a [2, 1, 4] bias of slope * key; got {bias.flatten().tolist()}")
    return (
        "BloomModel.build_alibi_tensor: [B * heads, 1, K] of slope * visible keys before each key; "
        "MptModel.build_mpt_alibi_tensor: [heads, 1, max_seq_len] of slope * (key - last); "
        "modeling_falcon.build_alibi_tensor: as BLOOM's"
    )


BEAM = "transformers.models.beam.modeling_beam"
# the model types whose forward hands its NoPE layers a query scale of the positions
# (runtime.AttentionScaling)
ATTENTION_SCALING_MODEL_TYPES = ("beam",)


def _probe_attention_scaling() -> str:
    import torch

    expected = (
        "modeling_beam.compute_attention_scaling(position_ids [B, Q]) -> [B, 1, Q, 1] of "
        "(1 + (position + 1) / 2048) ** 0.1, handed by BeamModel.forward to the layer types whose "
        "rope_parameters is None; BeamDecoderLayer.forward(attention_scaling=)"
    )
    builder = _attr(BEAM, "compute_attention_scaling", expected)
    layer = _attr(BEAM, "BeamDecoderLayer", expected)
    model = _attr(BEAM, "BeamModel", expected)
    if "attention_scaling" not in _signature(layer.forward).parameters:
        raise _Moved(expected, f"BeamDecoderLayer.forward{_signature(layer.forward)}")
    source = " ".join(inspect.getsource(model.forward).split())
    needs = ("rope_parameters[layer_type] is None", "compute_attention_scaling(position_ids)")
    if not all(text in source for text in needs):
        raise _Moved(expected, "BeamModel.forward no longer scales the layer types without rope parameters")
    positions = torch.tensor([[0, 5, 4095]])
    scale = builder(positions)
    want = (1 + (positions[0].double() + 1) / 2048) ** 0.1
    if tuple(scale.shape) != (1, 1, 3, 1) or not torch.allclose(scale.flatten().double(), want, atol=1e-6):
        raise _Moved(expected, f"{tuple(scale.shape)} of {scale.flatten().tolist()}")
    return "compute_attention_scaling: [B, 1, Q, 1] of (1 + (position + 1) / 2048) ** 0.1, the NoPE types'"


# the stacks whose forward computes some layer types' rotary embedding from float32 embeddings, which
# makes their DSA indexer keys float32 in a bfloat16 model (extraction refuses such a graph below float32:
# ``pipeline.check_rope_input_dtype``): module -> (decoder model, the expression it uses)
FLOAT32_ROPE_MODEL_TYPES = ("dots3_note", "dots3_note_text")  # the model types whose stacks these are
FLOAT32_ROPE_MODELS = {
    "transformers.models.dots3_note.modeling_dots3_note": (
        "Dots3NoteTextModel",
        'inputs_embeds.float() if layer_type == "indexed_attention" else inputs_embeds',
    ),
}


def _probe_rope_input_dtype() -> str:
    found = []
    for module, (name, expression) in FLOAT32_ROPE_MODELS.items():
        expected = f"{name}.forward computes the rotary embedding from {expression}"
        source = " ".join(inspect.getsource(_attr(module, name, expected).forward).split())
        if expression not in source:
            raise _Moved(expected, f"{name}.forward no longer has {expression}")
        found.append(f"{name}: {expression}")
    return "; ".join(found)


def _probe_dtype_plan() -> str:
    expected = "PreTrainedModel._get_dtype_plan(dtype) and core_model_loading.build_glob_alternation(globs)"
    model = _attr("transformers.modeling_utils", "PreTrainedModel", expected)
    if not callable(getattr(model, "_get_dtype_plan", None)):
        raise _Moved(expected, "PreTrainedModel has no _get_dtype_plan")
    alternation = _attr("transformers.core_model_loading", "build_glob_alternation", expected)
    matcher = _fp32_matcher(alternation, ["gate.weight", "e_score_correction_bias"])
    if not (matcher("model.layers.1.mlp.gate.weight") and not matcher("model.layers.1.mlp.up_proj.weight")):
        raise _Moved(expected + " matching parameter names by regex search", "another matching rule")
    return "dtype plan patterns matched by regex search over parameter names"


def _probe_model_classes() -> str:
    expected = (
        "AutoModelForCausalLM._model_mapping[config class] and PreTrainedModel._from_config(config, dtype=)"
    )
    transformers = importlib.import_module("transformers")
    mapping = getattr(getattr(transformers, "AutoModelForCausalLM", None), "_model_mapping", None)
    if mapping is None or not hasattr(mapping, "__contains__"):
        raise _Moved(expected, "AutoModelForCausalLM has no _model_mapping")
    model = _attr("transformers.modeling_utils", "PreTrainedModel", expected)
    from_config = getattr(model, "_from_config", None)
    if from_config is None:
        raise _Moved(expected, "PreTrainedModel has no _from_config")
    params = _signature(from_config).parameters
    if "dtype" not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        raise _Moved(expected, _describe(from_config, "PreTrainedModel._from_config"))
    return "lazy auto mappings and _from_config(config, dtype=)"


def _probe_experts() -> str:
    expected = "ALL_EXPERTS_FUNCTIONS with 'batched_mm'; experts modules marked _is_expert_parallel"
    functions = _attr("transformers.integrations.moe", "ALL_EXPERTS_FUNCTIONS", expected)
    decorate = _attr("transformers.integrations.moe", "use_experts_implementation", expected)
    if "batched_mm" not in functions:
        raise _Moved(expected, f"experts implementations {sorted(functions)}")
    from torch import nn

    class _Experts(nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()

        def forward(self, hidden_states: Any, *args: Any) -> Any:
            return hidden_states

    experts = decorate(_Experts)(type("Config", (), {"_experts_implementation": "batched_mm"})())
    if not is_experts_module(experts):
        raise _Moved(expected, "use_experts_implementation no longer sets _is_expert_parallel")
    return f"experts implementations {', '.join(sorted(functions))}"


def _probe_attention_interface() -> str:
    expected = "modeling_utils.ALL_ATTENTION_FUNCTIONS: item set/delete, get_interface(name, default)"
    functions = _attr("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS", expected)
    name = "kadapt_probe"

    def kernel(*args: Any, **kwargs: Any) -> Any:
        return None

    try:
        functions[name] = kernel
        found = functions.get_interface(name, None)
        del functions[name]
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        raise _Moved(expected, f"{type(exc).__name__}: {exc}") from exc
    if found is not kernel or name in functions:
        raise _Moved(expected, "a registered kernel is not returned, or not removed")
    return "registered kernels are looked up by config._attn_implementation"


def _probe_loading() -> str:
    expected = (
        "core_model_loading: WeightConverter/WeightRenaming/PrefixChange with source/target patterns, "
        "operations, scope_prefix; rename_source_key(key, renamings, converters, prefix, meta_state) -> "
        "(key, pattern); conversion_mapping.get_model_conversion_mapping(model, ..., add_legacy=); "
        "convert_and_load_state_dict_in_model keeps a key the model has under its own name when its "
        "renamed key is not the model's"
    )
    api = loading_api()
    converter = api.WeightConverter(
        source_patterns=["mlp.experts.*.w1.weight"],
        target_patterns="mlp.experts.gate_up_proj",
        operations=[api.MergeModulelist(dim=0)],
    )
    missing = [
        a
        for a in ("target_patterns", "_original_source_patterns", "operations", "scope_prefix")
        if not hasattr(converter, a)
    ]
    if missing:
        raise _Moved(expected, f"WeightConverter has no {', '.join(missing)}")
    leading, _ = _leading_parameters(
        api.rename_source_key, ("source_key", "weight_renamings", "weight_converters")
    )
    if not leading:
        raise _Moved(expected, _describe(api.rename_source_key, "rename_source_key"))
    target = "model.layers.0.mlp.experts.gate_up_proj"
    loaded, _ = api.rename_source_key(
        "model.layers.0.mlp.experts.3.w1.weight", [], [converter], "model", {target: 1}
    )
    if loaded != target:
        raise _Moved(expected + " renaming a converter's source to its target", f"it renamed to {loaded}")
    if "add_legacy" not in _signature(api.get_model_conversion_mapping).parameters:
        raise _Moved(expected, _describe(api.get_model_conversion_mapping, "get_model_conversion_mapping"))
    load = _attr("transformers.core_model_loading", "convert_and_load_state_dict_in_model", expected)
    if LOADER_KEEPS_OWN_NAMES not in " ".join(inspect.getsource(load).split()):
        raise _Moved(expected, "convert_and_load_state_dict_in_model no longer has " + LOADER_KEEPS_OWN_NAMES)
    return "converters rename their sources to their targets; a model's own key stays when renaming misses"


# transformers' loader loads a checkpoint key the model has under that name when its renamings lead to no
# key of the model (DeepSeek-V4's ``\.norm\.`` -> ``.kv_norm.`` would take the final ``model.norm.weight``)
LOADER_KEEPS_OWN_NAMES = (
    "if renamed_key not in meta_model_state_dict and original_key in meta_model_state_dict:"
)


def _probe_vision_grid() -> str:
    layout = temporal_merge_layout()
    return f"MoonViT grid helpers pop precomputed kwargs; temporal merge index is {layout}"


def _probe_remote_code() -> str:
    expected = "get_class_in_module(class_name, module_path, ...) and get_class_from_dynamic_module"
    loader = _attr("transformers.dynamic_module_utils", "get_class_in_module", expected)
    _attr("transformers.dynamic_module_utils", "get_class_from_dynamic_module", expected)
    leading, _ = _leading_parameters(loader, ("class_name", "module_path"))
    if not leading:
        raise _Moved(expected, _describe(loader, "get_class_in_module"))
    return _describe(loader, "get_class_in_module")


# What kadapt's absorbed MLA (runtime.absorbed_mla_forward) and simulated MLA kernels read from a
# DeepSeek-style attention module, besides its projections.
MLA_FIELDS = (
    "num_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
MLA_MODULES = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


def mla_attention_drift(attention: Any) -> str | None:
    """What ``attention`` (an MLA attention instance) lacks of what kadapt reads, or None.

    Fields, projections (``q_proj``, or ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` with a query
    LoRA), ``expand_kv`` (the expanded KV layout), ``scaling``, ``layer_idx`` and the rope helper its
    own module defines for ``config.rope_interleave`` (or DeepSeek-V2's complex ``apply_rotary_emb``, whose
    pairs the runtime rotates itself from the ``(cos, sin)`` of its builtins).
    """
    import sys

    lora = getattr(attention, "q_lora_rank", None) is not None
    wanted = (*MLA_FIELDS, *MLA_MODULES, "scaling", "layer_idx", "expand_kv")
    wanted += ("q_a_proj", "q_a_layernorm", "q_b_proj") if lora else ("q_proj",)
    missing = [name for name in wanted if not hasattr(attention, name)]
    interleave = bool(getattr(getattr(attention, "config", None), "rope_interleave", False))
    rope = "apply_rotary_pos_emb_interleave" if interleave else "apply_rotary_pos_emb"
    module = sys.modules.get(type(attention).__module__)
    # DeepSeek-V2 rotates complex pairs (apply_rotary_emb); under its builtins the runtime does that itself
    if not hasattr(module, rope) and not hasattr(module, "apply_rotary_emb"):
        missing.append(f"{type(attention).__module__}.{rope}")
    return f"{type(attention).__name__} has no {', '.join(missing)}" if missing else None


def require_mla_attention(attention: Any) -> None:
    """``ContactPointMoved`` (``mla_attention``) when ``attention`` lacks what kadapt reads."""
    found = mla_attention_drift(attention)
    if found is not None:
        require("mla_attention", BY_NAME["mla_attention"].expected, found)


def _probe_mla() -> str:
    expected = "DeepseekV3Attention with MLA fields, projections, expand_kv and its module's rope helpers"
    module = "transformers.models.deepseek_v3.modeling_deepseek_v3"
    attention_class = _attr(module, "DeepseekV3Attention", expected)
    config_class = _attr(module, "DeepseekV3Config", expected)
    import torch

    config = config_class(
        hidden_size=64, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, num_hidden_layers=1,
    )  # fmt: skip
    with torch.device("meta"):
        attention = attention_class(config, 0)
    found = mla_attention_drift(attention)
    if found is not None:
        raise _Moved(expected, found)
    return "DeepseekV3Attention: fields, projections, expand_kv and rope helpers as kadapt reads them"


def rebuild_buffer(model: Any, path: str) -> Any:
    """The value of non-persistent buffer ``path`` of ``model`` (built on meta), computed on CPU by
    transformers' own ``_init_weights``, the way a meta-built model gets its buffers when it loads.

    Only the owning module's own buffers are materialised: a shallow copy of it holds CPU buffers and
    fresh meta parameters (so the 1T-parameter model is never touched and nothing is allocated for
    its weights), and the nearest ``PreTrainedModel`` above it initialises that copy. Some models set a
    buffer from an ancestor's init instead (FalconH1Model's ``_init_weights`` writes every mixer's
    ``mup_vector``): then the copy is handed to it inside copies of its ancestors, each holding only the
    child on the path, nearest first. None when no init gives the buffer a value (it stays as
    ``torch.empty`` left it: checked by NaN fill).
    """
    import torch

    owner_path, _, leaf = path.rpartition(".")
    parts = owner_path.split(".") if owner_path else []
    pretrained = next(
        (
            candidate
            for candidate in (
                model.get_submodule(".".join(parts[:depth])) for depth in range(len(parts), -1, -1)
            )
            if callable(getattr(candidate, "_init_weights", None)) and hasattr(candidate, "config")
        ),
        None,
    )
    if pretrained is None:
        return None
    owner = _ghost(model.get_submodule(owner_path))
    ghost = owner
    for depth in range(len(parts), -1, -1):
        if depth < len(parts):  # one level up: the ancestor, holding only the path's child
            parent = _ghost(model.get_submodule(".".join(parts[:depth])))
            parent._modules = {parts[depth]: ghost}
            ghost = parent
        try:
            with torch.no_grad():
                pretrained._init_weights(ghost)
        except Exception:  # noqa: BLE001 - an ancestor's init that reads what its copy lacks: not it
            if ghost is owner:
                raise
            continue
        value = owner._buffers.get(leaf)
        if value is not None and not (value.is_floating_point() and bool(value.isnan().any())):
            return value
    return None


def _ghost(module: Any) -> Any:
    """A shallow copy of ``module`` without children, its own buffers NaN (zero) on CPU, its own parameters
    fresh on meta (``rebuild_buffer``)."""
    import copy

    import torch

    ghost = copy.copy(module)
    ghost._modules = {}
    ghost._parameters = {
        name: None if p is None else torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        for name, p in module._parameters.items()
    }
    ghost._buffers = {
        name: None
        if b is None
        else torch.full_like(b, float("nan") if b.is_floating_point() else 0, device="cpu")
        for name, b in module._buffers.items()
    }
    return ghost


def _probe_generation() -> str:
    expected = "GenerationConfig(max_new_tokens, do_sample, output_logits, return_dict_in_generate)"
    config_class = _attr("transformers", "GenerationConfig", expected)
    config = config_class(max_new_tokens=1, do_sample=False, output_logits=True, return_dict_in_generate=True)
    if not (getattr(config, "output_logits", False) and getattr(config, "return_dict_in_generate", False)):
        raise _Moved(expected, "GenerationConfig drops output_logits or return_dict_in_generate")
    return "greedy generate() returns sequences and per-step logits"


CONTACT_POINTS: tuple[ContactPoint, ...] = (
    ContactPoint(
        "cache_update",
        "transformers.cache_utils.Cache.update",
        "update(key_states, value_states, layer_idx, *args, **kwargs)",
        "kadapt's static KV cache stands in for transformers' Cache: the attention hands it the new "
        "key/value states (MLA: the latents) and attends over what it returns",
        ("extraction", "generated modules"),
        _probe_cache_update,
    ),
    ContactPoint(
        "linear_attention_cache",
        "transformers.cache_utils.Cache.get_conv_state/update_conv_state/get_recurrent_state/"
        "update_recurrent_state/is_recording_past",
        "the linear-attention cache API: get_*_state(layer_idx) is None before the first update, "
        "update_conv_state returns the window plus the new inputs, is_recording_past selects the "
        "out-of-place decode path",
        "kadapt's static cache stands in for Cache in linear-attention / SSM layers (gated DeltaNet, KDA, "
        "Mamba2, Mamba1): they read their conv and recurrent states from it and hand it the new ones",
        ("extraction (hybrid stacks)", "generated modules"),
        _probe_linear_attention_cache,
    ),
    ContactPoint(
        "short_conv_cache",
        "transformers.cache_utils.Cache.get_conv_state/update_conv_state/is_recording_past; "
        "DynamicCache's 'conv' layers (LinearAttentionLayer)",
        "a conv layer's window alone: get_conv_state(layer_idx) is None before the first "
        "update_conv_state(inputs, layer_idx, conv_kernel_size=K), which returns the window plus the new "
        "inputs; the window is the last K inputs, and there is no recurrent state",
        "kadapt's static cache stands in for Cache in LFM2's gated short convolutions: they read their "
        "window [B, hidden, K] from it and hand it the new inputs; the equivalence check reads "
        "transformers' windows back from DynamicCache",
        ("extraction (LFM2, LFM2-MoE, LFM3)",),
        _probe_short_conv_cache,
    ),
    ContactPoint(
        "lightning_attention_cache",
        "transformers.models.minimax.modeling_minimax.MiniMaxCache.get_linear_cache/set_linear_cache",
        "get_linear_cache(layer_idx) is None before the layer's first set_linear_cache(layer_idx, state); "
        "the lightning layer prefills from zeros in blocks when it is None, else recurs token by token",
        "kadapt's static cache stands in for MiniMaxCache in MiniMax's lightning-attention layers: they "
        "read their recurrent state [B, heads, head_dim, head_dim] from it and hand it the new one",
        ("extraction (MiniMax)", "generated modules"),
        _probe_lightning_attention_cache,
    ),
    ContactPoint(
        "head_input_cast",
        "transformers.models.mamba.modeling_mamba.MambaForCausalLM.forward, "
        "falcon_mamba.modeling_falcon_mamba.FalconMambaForCausalLM.forward",
        "lm_head(hidden_states.to(lm_head.weight.dtype)): the final hidden states cast to the head's dtype",
        "the wrappers cast the final norm's output to the LM head's dtype as these forwards do: with "
        "residual_in_fp32 a bfloat16 Mamba1 stack's residual stream, and so its final norm, is float32",
        ("extraction (Mamba, Falcon-Mamba)", "generated modules"),
        _probe_head_input_cast,
    ),
    ContactPoint(
        "indexer_cache",
        "transformers.cache_utils.Cache.update_indexer",
        "update_indexer(indexer_key_states [B, S, dim], layer_idx) returning every cached indexer key",
        "kadapt's static cache stands in for Cache in DeepSeek sparse attention: the indexer hands it its "
        "new keys and scores every cached one",
        ("extraction (DSA stacks)", "generated modules"),
        _probe_indexer_cache,
    ),
    ContactPoint(
        "cache_seq_length",
        "transformers.cache_utils.Cache.get_seq_length",
        "get_seq_length(layer_idx=0): the tokens cached before the current call",
        "kadapt's static cache answers it for Llama-4's NoPE layers (attention temperature tuning): 0 in "
        "prefill, each row's cache_position as a [batch] tensor in decode, read per row only by the "
        "llama4_attention_forward builtin",
        ("extraction (Llama-4)", "generated modules"),
        _probe_cache_seq_length,
    ),
    ContactPoint(
        "per_layer_inputs",
        f"{GEMMA4}.Gemma4TextModel.get_per_layer_inputs/project_per_layer_inputs, "
        "Gemma4TextDecoderLayer.forward(per_layer_input, shared_kv_states)",
        "the language model computes every layer's per-layer embedding [B, Q, layers, width] from the "
        "token ids and the input embeddings; a layer takes its slice as per_layer_input and the call's "
        "shared_kv_states dict",
        "the wrappers compute the per-layer embeddings once per call with the model's own two methods "
        "(run on a holder of the parts they read, so the graph keeps the weights' names) and hand each "
        "layer its slice and one shared_kv_states dict per call, as Gemma4TextModel.forward does",
        ("extraction (Gemma-4)", "generated modules"),
        _probe_per_layer_inputs,
    ),
    ContactPoint(
        "residual_streams",
        "models.hy_v4.modeling_hy_v4.HYV4Model.forward, models.deepseek_v4.modeling_deepseek_v4."
        "DeepseekV4Model.forward",
        "the input embeddings copied into config.hc_mult streams [B, Q, hc_mult, hidden] before the first "
        "layer; self.norm(self.hc_head(hidden_states)) after the last",
        "the wrappers copy the embeddings into the streams and merge them with the stack's own hc_head "
        "before the final norm (runtime.ResidualStreams); the layers mix the streams themselves",
        ("extraction (HY-V4)", "simulation", "generated modules"),
        _probe_residual_streams,
    ),
    ContactPoint(
        "rope_by_label",
        "models.deepseek_v4.modeling_deepseek_v4.DeepseekV4Model.forward, DeepseekV4Attention.forward, "
        "DeepseekV4RotaryEmbedding",
        "every layer handed position_embeddings = {label: rotary_emb(x, position_ids, layer_type=label)} "
        "for the labels of config.rope_parameters ({main, compress}); each attention picks its own",
        "the wrappers compute every label's (cos, sin) once per call and hand each layer the dict "
        "(upstream.rope_labels, the runtime's rope keys), as DeepseekV4Model.forward does",
        ("extraction (DeepSeek-V4)", "simulation", "generated modules"),
        _probe_rope_by_label,
    ),
    ContactPoint(
        "layer_input_ids",
        "models.deepseek_v4.modeling_deepseek_v4.DeepseekV4Model.forward, DeepseekV4DecoderLayer.forward, "
        "DeepseekV4HashRouter.forward",
        "every layer handed the call's input_ids; a hash_moe layer's router picks tid2eid[input_ids]",
        "the wrappers hand every layer that takes input_ids the call's token ids (runtime STACK_INPUTS), "
        "as DeepseekV4Model.forward does",
        ("extraction (DeepSeek-V4)", "simulation", "generated modules"),
        _probe_layer_input_ids,
    ),
    ContactPoint(
        "compressor_cache",
        "models.deepseek_v4.modeling_deepseek_v4.DeepseekV4HCACompressor, DeepseekV4CSACompressor, "
        "DeepseekV4Indexer, DeepseekV4Attention.forward, "
        "DeepseekV4HCACache/DeepseekV4CSACache.store_compression_weights/update_compressor_states",
        "the attention calls its compressor (hidden_states, q_residual, position_ids, cache, layer_idx) and "
        "attends over the entries it returns after the sliding keys, masked by its block_bias",
        "kadapt's static cache keeps the compressor's open window (a ring) and its entries per row "
        "(compressed_window/write_compressed), through the pinned deepseek_v4_hca_compressor builtin (a "
        "csa layer's two-window ring, entries and its indexer's through deepseek_v4_csa_compressor and "
        "deepseek_v4_indexer, a static top-k over every slot), which read the compressor's own "
        "projections, norm, position bias and compress rope (the indexer's query projection and scorer)",
        ("extraction (DeepSeek-V4)", "generated modules"),
        _probe_compressor_cache,
    ),
    ContactPoint(
        "learned_positions",
        "models.opt.modeling_opt.OPTLearnedPositionalEmbedding, models.biogpt.modeling_biogpt."
        "BioGptLearnedPositionalEmbedding, models.trocr.modeling_trocr.TrOCRLearnedPositionalEmbedding",
        "an nn.Embedding of num_embeddings + offset rows whose forward looks up position_ids + self.offset",
        "the wrappers add a stack's learned absolute position embeddings (module_paths.position_embeddings) "
        "by the nn.Embedding lookup of each row's positions plus the table's offset, since each of these "
        "forwards takes the positions another way (runtime.add_learned_positions)",
        ("extraction (GPT-2, OPT, BioGPT, ...)", "generated modules"),
        _probe_learned_positions,
    ),
    ContactPoint(
        "sinusoidal_positions",
        "models.xglm.modeling_xglm.XGLMSinusoidalPositionalEmbedding.forward(position_ids, cache_length)",
        "a module without parameters whose forward(position_ids) returns its sinusoidal weights buffer's "
        "rows at position_ids + offset",
        "the wrappers add the position embeddings a module computes from each row's positions "
        "(module_paths.position_embeddings naming it: runtime.add_learned_positions calls it), as "
        "XGLMModel.forward does; plan counts no table for it",
        ("extraction (XGLM)", "generated modules"),
        _probe_sinusoidal_positions,
    ),
    ContactPoint(
        "alibi_bias",
        "models.bloom.modeling_bloom.BloomModel.build_alibi_tensor, BloomBlock.forward(alibi); "
        "models.mpt.modeling_mpt.MptModel.build_mpt_alibi_tensor, MptBlock.forward(position_bias); "
        "models.falcon.modeling_falcon.build_alibi_tensor, FalconDecoderLayer.forward(alibi)",
        "build_alibi_tensor(attention_mask [B, K], num_heads, dtype) -> [B * heads, 1, K]: each head's slope "
        "times the visible keys before each key, taken as alibi; build_mpt_alibi_tensor(num_heads, "
        "max_seq_len) -> [heads, 1, max_seq_len]: the slope times each key's distance to the last, taken "
        "as position_bias",
        "the wrappers build BLOOM's, MPT's and Falcon's ALiBi biases once per call with the stack's own "
        "builder (BLOOM's and Falcon's from the keys each row's last query sees) and hand every layer the "
        "result (runtime.AlibiBias; Falcon's also folded into the mask over sqrt(head_dim), as "
        "FalconModel.forward does)",
        ("extraction (BLOOM, MPT, Falcon with alibi)", "generated modules"),
        _probe_alibi_bias,
    ),
    ContactPoint(
        "attention_scaling",
        "models.beam.modeling_beam.compute_attention_scaling, BeamModel.forward, "
        "BeamDecoderLayer.forward(attention_scaling)",
        "compute_attention_scaling(position_ids) -> [B, 1, Q, 1] of (1 + (position + 1) / 2048) ** 0.1, "
        "handed to the layer types whose rope_parameters is None (the others get None)",
        "the wrappers compute the query scale once per call with the stack's modelling module's own "
        "function and hand it to every layer given no rotary embedding (runtime.AttentionScaling), as "
        "BeamModel.forward does",
        ("extraction (Beam)", "generated modules"),
        _probe_attention_scaling,
    ),
    ContactPoint(
        "rope_input_dtype",
        "models.dots3_note.modeling_dots3_note.Dots3NoteTextModel.forward",
        'the rotary embedding of "indexed_attention" layers computed from inputs_embeds.float() (float32 '
        "cos and sin in a bfloat16 model), the other layer types' from the embeddings as they are",
        "in a bfloat16 model those layers' indexer keys are float32, which kadapt's ABI (every indexer "
        "key in abi.dtype) does not state: extraction refuses dots3 graphs below float32 "
        "(pipeline.check_rope_input_dtype), and this probe says when the rule moves",
        ("extraction (dots3)",),
        _probe_rope_input_dtype,
    ),
    ContactPoint(
        "loader_dtype_plan",
        "PreTrainedModel._get_dtype_plan, core_model_loading.build_glob_alternation",
        "patterns matched by regex search",
        "the IR states the dtype each weight loads with: parameters the loader keeps in float32 "
        "(_keep_in_fp32_modules[_strict], e.g. the MoE router) stay float32 in a bf16 graph",
        ("extraction", "simulation", "generated modules"),
        _probe_dtype_plan,
    ),
    ContactPoint(
        "model_classes",
        "AutoModelForCausalLM._model_mapping, PreTrainedModel._from_config",
        "lazy auto mappings and _from_config(config, dtype=)",
        "models are built from a config without weights (meta device) in float32",
        ("apply", "simulation", "generated modules"),
        _probe_model_classes,
    ),
    ContactPoint(
        "experts_implementation",
        "transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS, use_experts_implementation",
        "'batched_mm' registered; experts modules marked _is_expert_parallel",
        "MoE experts export as batched_mm (static shapes); kadapt finds experts modules by the marker "
        "to refuse the eager loop before export",
        ("extraction", "simulation"),
        _probe_experts,
    ),
    ContactPoint(
        "attention_interface",
        "transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS",
        "item set/delete and get_interface(name, default)",
        "simulation points the traced layers' attention at an analytic kernel for the trace only",
        ("simulation",),
        _probe_attention_interface,
    ),
    ContactPoint(
        "loading_converters",
        "transformers.core_model_loading, conversion_mapping.get_model_conversion_mapping",
        "converters with source/target patterns and operations; rename_source_key renames a source to "
        "its target; the loader keeps a key the model has when its renamed key is not the model's",
        "the weight map names, for every graph weight, the checkpoint tensors transformers' own loader "
        "builds it from, and checks each name loads back through rename_source_key",
        ("extraction (weight map)",),
        _probe_loading,
    ),
    ContactPoint(
        "vision_grid_helpers",
        "transformers.vision_utils, modeling_kimi_k25.get_vision_frame_index/get_vision_temporal_merge_index",
        "helpers that pop a precomputed value from kwargs; merge index a tensor or "
        "(destination_index, frame_weight, num_merged_tokens)",
        "the vision graph precomputes MoonViT's grid tensors once and passes them as the kwargs its "
        "helpers pop",
        ("extraction (vision)", "simulation (--images)"),
        _probe_vision_grid,
    ),
    ContactPoint(
        "mla_attention",
        "DeepseekV3Attention (fields, projections, expand_kv), apply_rotary_pos_emb[_interleave]",
        "the MLA fields, projections, expand_kv and rope helper kadapt reads",
        "the expanded KV layout caches expand_kv's output; absorbed MLA and the simulated MLA kernels run "
        "the attention's own projections and rope helper around kadapt's kernels",
        ("extraction (expanded, absorbed)", "simulation"),
        _probe_mla,
    ),
    ContactPoint(
        "remote_code_loader",
        "transformers.dynamic_module_utils.get_class_in_module",
        "get_class_in_module(class_name, module_path, ...)",
        "remote-code patches follow the module transformers really imported (and re-imports)",
        ("apply (remote code)",),
        _probe_remote_code,
    ),
    ContactPoint(
        "generation",
        "transformers.GenerationConfig, GenerationMixin.generate",
        "greedy generate() with output_logits and return_dict_in_generate",
        "--verify compares the saved graphs with transformers' own generate()",
        ("verify",),
        _probe_generation,
    ),
)
# What every export needs; the rest is checked by the part that uses it.
EXPORT_POINTS = ("cache_update", "loader_dtype_plan", "model_classes", "experts_implementation")
BY_NAME = {point.name: point for point in CONTACT_POINTS}


@functools.cache
def _run(name: str) -> Finding:
    point = BY_NAME[name]
    try:
        found = point.probe()
    except _Moved as moved:
        return Finding(name, point.symbol, False, moved.found, moved.expected)
    return Finding(name, point.symbol, True, found, point.expected)


def findings(names: Sequence[str] | None = None) -> list[Finding]:
    """Probe ``names`` (default: every contact point), each once per process; nothing raised."""
    unknown = sorted(set(names or ()) - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown contact points {unknown}; known: {', '.join(BY_NAME)}")
    return [_run(name) for name in (names or BY_NAME)]


def check(names: Sequence[str] | None = None) -> list[Finding]:
    """``findings(names)``, raising one ``ContactPointMoved`` that lists every moved point."""
    found = findings(names)
    moved = [f for f in found if not f.ok]
    if moved:
        raise ContactPointMoved(moved)
    return found


def require(name: str, expected: str, found: str) -> None:
    """Raise ``ContactPointMoved`` for ``name`` from a check made outside a probe."""
    raise ContactPointMoved([Finding(name, BY_NAME[name].symbol, False, found, expected)])


# -- accessors: what the rest of kadapt reads through this module ------------------------------------


class LoadingApi(NamedTuple):
    """transformers' loading conversions, as ``checkpoint_layout`` reads them."""

    get_model_conversion_mapping: Callable[..., Any]
    rename_source_key: Callable[..., Any]
    WeightConverter: type
    WeightRenaming: type
    PrefixChange: type
    MergeModulelist: type


@functools.cache
def loading_api() -> LoadingApi:
    """The loading symbols, or ``ContactPointMoved`` naming the one that is gone."""
    expected = BY_NAME["loading_converters"].expected
    names = ("rename_source_key", "WeightConverter", "WeightRenaming", "PrefixChange", "MergeModulelist")
    try:
        found = {name: _attr("transformers.core_model_loading", name, expected) for name in names}
        mapping = _attr("transformers.conversion_mapping", "get_model_conversion_mapping", expected)
    except _Moved as moved:
        require("loading_converters", moved.expected, moved.found)
    return LoadingApi(get_model_conversion_mapping=mapping, **found)


def is_experts_module(module: Any) -> bool:
    """transformers' ``@use_experts_implementation`` marks every experts module it builds."""
    return hasattr(module, "_is_expert_parallel")


def _fp32_matcher(alternation: Callable[..., Any], patterns: list[str]) -> Callable[[str], bool]:
    if not patterns:
        return lambda name: False
    regex = alternation(patterns)[0]
    return lambda name: regex.search(name) is not None


def loader_keeps_fp32(model: Any, dtype: Any) -> Callable[[str], bool]:
    """Predicate on a parameter's path in ``model``: does ``from_pretrained(dtype=dtype)`` keep it float32?

    transformers' own dtype plan (``_keep_in_fp32_modules_strict`` for fp16/bf16,
    ``_keep_in_fp32_modules`` for fp16 only), matched the way its loader matches it.
    """
    check(("loader_dtype_plan",))
    from transformers.core_model_loading import build_glob_alternation

    plan = model._get_dtype_plan(dtype)
    import torch

    return _fp32_matcher(build_glob_alternation, [p for p, d in plan.items() if d == torch.float32])


@contextmanager
def attention_kernel(name: str, kernel: Callable[..., Any], configs: Sequence[Any]) -> Iterator[None]:
    """Register ``kernel`` as attention implementation ``name`` and point ``configs`` at it, in the block."""
    check(("attention_interface",))
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS[name] = kernel
    previous = [(config, config._attn_implementation) for config in configs]
    for config in configs:
        config._attn_implementation = name
    try:
        yield
    finally:
        for config, value in previous:
            config._attn_implementation = value
        del ALL_ATTENTION_FUNCTIONS[name]


# MoonViT's precomputable grid tensors: the kwargs its forward hands to the helper that pops each.
VISION_GRID_KWARGS = (
    "interp_indices",
    "interp_weights",
    "frame_index",
    "position_ids",
    "temporal_merge_index",
)


@functools.cache
def temporal_merge_layout() -> str:
    """``tensor`` (5.23: a gather index) or ``scatter`` (5.24: destination index, frame weight, count).

    Probed by calling ``get_vision_temporal_merge_index`` on one 1x2x2 grid, and by checking that the
    helpers pop a precomputed value from ``kwargs`` (the protocol the vision graph relies on).
    """
    name = "vision_grid_helpers"
    expected = BY_NAME[name].expected
    import torch

    kimi = "transformers.models.kimi_k25.modeling_kimi_k25"
    merge = _attr(kimi, "get_vision_temporal_merge_index", expected)
    frames = _attr(kimi, "get_vision_frame_index", expected)
    interpolation = _attr(
        "transformers.vision_utils", "get_vision_interpolation_indices_and_weights", expected
    )
    positions = _attr("transformers.vision_utils", "get_vision_position_ids", expected)
    grid = torch.tensor([[1, 2, 2]])
    sentinel = object()
    popped = {
        "get_vision_temporal_merge_index": lambda kw: merge(grid, 2, 2, kwargs=kw),
        "get_vision_frame_index": lambda kw: frames(grid, kwargs=kw),
        "get_vision_position_ids": lambda kw: positions(grid, spatial_merge_size=1, kwargs=kw),
    }
    keys = {
        "get_vision_temporal_merge_index": "temporal_merge_index",
        "get_vision_frame_index": "frame_index",
        "get_vision_position_ids": "position_ids",
    }
    for helper, call in popped.items():
        kwargs = {keys[helper]: sentinel}
        try:
            result = call(kwargs)
        except TypeError as exc:
            raise _Moved(expected, f"{helper}: {exc}") from exc
        if result is not sentinel or kwargs:
            raise _Moved(expected, f"{helper} does not pop {keys[helper]!r} from kwargs")
    if "kwargs" not in _signature(interpolation).parameters:
        raise _Moved(expected, _describe(interpolation, "get_vision_interpolation_indices_and_weights"))
    value = merge(grid, 2, 2)
    if isinstance(value, torch.Tensor):
        return "tensor"
    if (
        isinstance(value, tuple)
        and len(value) == 3
        and all(isinstance(v, torch.Tensor) for v in value[:2])
        and isinstance(value[2], int)
    ):
        return "scatter"
    raise _Moved(expected, f"get_vision_temporal_merge_index returns {type(value).__name__}")


# -- model probe: the decoder layers, called on what they run on ------------------------------------

# newest first: 5.24 renamed past_key_values to cache; GPT-NeoX's and Falcon's layers take it as
# layer_past (the last stays the fallback of a **kwargs-only forward)
CACHE_KEYWORDS = ("cache", "layer_past", "past_key_values")


class LayerProtocol(NamedTuple):
    """How a model's decoder layers take kadapt's cache (what the ABI wrappers call them with), and
    what they cache: attention layers per token ``((key_heads, key_dim), (value_heads, value_dim))`` of
    what the attention hands to ``update`` (per-head K/V; MLA: its latents; None: no attention layer);
    linear-attention / SSM layers per request ``linear_states``: the conv window's and the recurrent
    state's shape (without the batch) and dtype, as the layer handed them over (a lightning layer: its
    recurrent state alone)."""

    cache_keyword: str
    kv_dims: tuple[tuple[int, int], tuple[int, int]] | None
    linear_states: tuple[tuple[tuple[int, ...], str], ...] | None = None
    index_dim: int | None = None  # a DSA indexer's key width (None: no indexed layer)
    # per probed layer what it caches per token (``kv_dims`` of that layer; None: it caches no KV), so
    # that layers of other KV heads or widths (MiMo-V2-Flash, Gemma-4) are checked one by one
    layer_kv_dims: tuple[tuple[tuple[int, int], tuple[int, int]] | None, ...] | None = None


class _UpdateCall:
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args, self.kwargs = args, kwargs

    def states(self) -> tuple[Any, Any, Any]:
        """(key, value, layer_idx) from positional or named arguments (missing: None)."""
        named = dict(zip(CACHE_UPDATE, self.args, strict=False))
        named.update({k: v for k, v in self.kwargs.items() if k in CACHE_UPDATE})
        return named.get("key_states"), named.get("value_states"), named.get("layer_idx")

    def describe(self) -> str:
        def show(value: Any) -> str:
            shape = getattr(value, "shape", None)
            return f"Tensor{list(shape)}" if shape is not None else repr(value)

        parts = [show(a) for a in self.args] + [f"{k}={show(v)}" for k, v in self.kwargs.items()]
        return f"update({', '.join(parts)})"


class _RecordingCache:
    """The ABI cache's protocol for one layer kind, recording each call and each other attribute asked for.

    ``attention``: ``update`` only. ``indexed``: ``update`` and the DSA indexer's ``update_indexer``.
    ``linear``: the linear-attention API a prefill uses (no previous state: ``get_*_state`` return
    None), each state update recorded with the layer index it names; ``short_conv``: its conv half
    (``get_conv_state``, ``update_conv_state``, ``is_recording_past``). ``lightning``: MiniMaxCache's
    ``get_linear_cache`` (None: a prefill) and ``set_linear_cache``, recorded alike. ``hybrid``
    (Falcon-H1): ``update`` and the linear-attention API, both under the layer's one index."""

    def __init__(self, kind: str = "attention") -> None:
        self.kind = kind
        self.calls: list[_UpdateCall] = []
        self.missing: list[str] = []
        self.state_calls: dict[str, tuple[Any, Any]] = {}  # method -> (layer_idx, tensor or kernel)

    def update(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if self.kind in FIXED_STATE_KINDS:
            return self.__getattr__("update")
        call = _UpdateCall(args, kwargs)
        self.calls.append(call)
        key, value, _ = call.states()
        return key, value

    def compressed_window(self, layer_idx: Any, kv: Any, gate: Any, rate: Any, series: str = "comp") -> Any:
        """The static cache's prefill answer (``compressed_window``): the prompt's closed windows (the
        runtime's ``CompressorWindows`` fields) and, for a csa layer's overlapping series, each window's
        previous one (window 0's weighs nothing: a gate of -inf)."""
        import types

        import torch

        if self.kind not in COMPRESSOR_SERIES:
            return self.__getattr__("compressed_window")
        self.state_calls[f"compressed_window:{series}"] = (layer_idx, kv)
        batch, length, dim = kv.shape
        windows = length // rate
        start = (torch.arange(windows, device=kv.device) * rate).unsqueeze(0).expand(batch, -1)
        shape = (batch, windows, rate, dim)
        chunk_kv, chunk_gate = (
            kv[:, : windows * rate].reshape(shape),
            gate[:, : windows * rate].reshape(shape),
        )
        if self.kind == "hca":
            return types.SimpleNamespace(
                kv=chunk_kv, gate=chunk_gate, start=start, prior_kv=None, prior_gate=None
            )
        prior_kv = torch.cat([torch.zeros_like(chunk_kv[:, :1]), chunk_kv[:, :-1]], dim=1)
        prior_gate = torch.cat([torch.full_like(chunk_gate[:, :1], float("-inf")), chunk_gate[:, :-1]], dim=1)
        return types.SimpleNamespace(
            kv=chunk_kv, gate=chunk_gate, start=start, prior_kv=prior_kv, prior_gate=prior_gate
        )

    def write_compressed(self, layer_idx: Any, entries: Any, rate: Any, series: str = "comp") -> Any:
        if self.kind not in COMPRESSOR_SERIES:
            return self.__getattr__("write_compressed")
        self.state_calls[f"write_compressed:{series}"] = (layer_idx, entries)
        return entries.unsqueeze(1)

    def update_indexer(self, indexer_key_states: Any, layer_idx: Any) -> Any:
        if self.kind != "indexed":
            return self.__getattr__("update_indexer")
        self.state_calls["update_indexer"] = (layer_idx, indexer_key_states)
        return indexer_key_states

    def _linear_call(
        self, name: str, layer_idx: Any, value: Any, kinds: tuple[str, ...] | None = None
    ) -> None:
        """Record a state call, or count it missing for a kind that has no such call (``kinds``; None: the
        kinds with a conv window, ``CONV_KINDS``)."""
        if self.kind not in (kinds or CONV_KINDS):
            self.__getattr__(name)
        self.state_calls[name] = (layer_idx, value)

    def get_linear_cache(self, layer_idx: Any) -> None:
        self._linear_call("get_linear_cache", layer_idx, None, ("lightning",))

    def set_linear_cache(self, layer_idx: Any, linear_cache: Any) -> None:
        self._linear_call("set_linear_cache", layer_idx, linear_cache, ("lightning",))

    def get_conv_state(self, layer_idx: Any, state_idx: int = 0) -> None:
        self._linear_call("get_conv_state", layer_idx, None)

    def get_recurrent_state(self, layer_idx: Any, state_idx: int = 0) -> None:
        self._linear_call("get_recurrent_state", layer_idx, None, RECURRENT_KINDS)

    def is_recording_past(self, layer_idx: Any) -> bool:
        self._linear_call("is_recording_past", layer_idx, None)
        return True

    def update_conv_state(self, conv_states: Any, layer_idx: Any, state_idx: int = 0, **kwargs: Any) -> Any:
        import torch

        kernel = kwargs.get("conv_kernel_size")
        self._linear_call("update_conv_state", layer_idx, (conv_states, kernel))
        if isinstance(kernel, int) and conv_states.shape[-1] < kernel:
            conv_states = torch.nn.functional.pad(conv_states, (kernel - conv_states.shape[-1], 0))
        return conv_states

    def update_recurrent_state(
        self, recurrent_states: Any, layer_idx: Any, state_idx: int = 0, **kw: Any
    ) -> Any:
        self._linear_call("update_recurrent_state", layer_idx, recurrent_states, RECURRENT_KINDS)
        return recurrent_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The probe is a prefill from position 0 (``StaticStateCache.get_seq_length``: 0 in prefill)."""
        return 0

    def __getattr__(self, name: str) -> Any:
        self.missing.append(name)
        raise AttributeError(f"kadapt's static cache has no {name!r} for {self.kind} layers")


def cache_keyword(layer: Any, attention: str | None = None) -> str:
    """The keyword ``type(layer).forward`` takes the cache under (signature; 5.24: ``cache``); a
    ``**kwargs``-only forward hands it on to its attention, whose signature then says (DeepSeek-V4's
    takes ``cache`` in 5.24, ``past_key_values`` only through a deprecation shim). ``attention``: where
    the layer keeps its attention (``_attention_of``)."""
    params = _signature(type(layer).forward).parameters
    module = _attention_of(layer, attention)
    inner = _signature(type(module).forward).parameters if module is not None else {}
    for taken in (params, inner):
        for keyword in CACHE_KEYWORDS:
            if keyword in taken:
                return keyword
    return CACHE_KEYWORDS[-1]  # no signature names it: the behavioural probe decides


def _installed(cls: type, base: type) -> tuple[Any, ...]:
    """The methods and other descriptors ``cls`` and its bases below ``base`` (torch's ``Module``) hold
    now: where a spec's patches install their dispatchers (a ``forward``, or a helper such as
    DeepSeek-V3's ``expand_kv``) and gated attributes. The objects themselves, not their ids: a key
    keeps them alive, so a later dispatcher cannot take a freed one's id."""
    return tuple(
        (name, value)
        for klass in cls.__mro__
        if klass not in base.__mro__
        for name, value in vars(klass).items()
        if hasattr(type(value), "__get__") and type(value).__hash__ is not None
    )


def _layer_key(layer: Any, rotary_emb: Any, layer_type: str | tuple[str, ...] | None) -> tuple[Any, ...]:
    """What a layer's probe depends on: the classes of its modules and of the rotary embedding with the
    methods installed on them now (a result probed under one spec's patches must not answer for the
    layers without them, or under other patches: Llama-4's rotary embedding returns (cos, sin) only
    under Scout's builtins), their parameter shapes and dtypes (layers of one class can differ in size:
    MiMo-V2-Flash's sliding layers have other KV heads; a linear layer's conv state has the dtype the
    layer runs in), and the layer type the rotary embedding is called with."""
    from torch.nn import Module

    modules = [*layer.modules(), *([rotary_emb] if rotary_emb is not None else [])]
    methods = {cls: _installed(cls, Module) for cls in {type(m) for m in modules}}
    return (
        layer_type,
        *(
            (type(m), methods[type(m)], tuple((tuple(p.shape), p.dtype) for p in m.parameters(recurse=False)))
            for m in modules
        ),
    )


_protocols: dict[tuple[Any, ...], LayerProtocol] = {}
# Probe results kept at most: every patch session installs new dispatchers, so a key holding them is
# new each session (``_layer_key``) and a long-lived process (a test run, the family matrix) would keep
# every session's layers and methods alive; the oldest results are dropped first (a re-probe is cheap).
MAX_PROTOCOLS = 256


def probe_decoder_layers(
    layers: Sequence[Any],
    rotary_emb: Any,
    layer_types: Sequence[str | tuple[str, ...] | None] | None = None,
    kinds: Sequence[str] | None = None,
    streams: int = 1,
    attention: str | None = None,
) -> LayerProtocol:
    """Call one layer of each structure in ``layers`` with a recording cache; their shared protocol.

    ``kinds`` gives each layer's kind (``attention``, or ``linear`` for a linear-attention / SSM mixer;
    None: every layer is attention). Checked: the layer accepts the cache under ``cache_keyword``; an
    attention layer calls ``update(key_states, value_states, layer_idx, ...)`` exactly once with its own
    ``layer_idx``, a linear layer reads and updates its conv and recurrent states once each under its
    own ``layer_idx``, and neither uses anything else of the cache; the layer returns the hidden states
    tensor; the rotary embedding returns ``(cos, sin)`` (given the layer's type from ``layer_types``
    when it takes one; a layer whose type it keeps no frequencies for gets none). Runs on the layers' own
    device: free on meta, tiny elsewhere. The attention layers may cache different KV shapes
    (``layer_kv_dims``, one per layer): the caller holds each against what the config says of that layer.
    ``streams``: the residual streams each layer takes (``hc_mult``: hidden states ``[B, Q, streams,
    hidden]``, as the runtime's ``ResidualStreams`` hands them; 1: ``[B, Q, hidden]``). ``attention``:
    where each layer keeps its attention, the one that calls ``update`` (``_attention_of``).
    """
    import torch

    protocols = []
    for index, layer in enumerate(layers):
        kind = kinds[index] if kinds is not None else "attention"
        layer_type = layer_types[index] if layer_types is not None else None
        roped = rotary_emb if layer_types is None or layer_type is not None else None
        key = (kind, streams, attention, *_layer_key(layer, roped, layer_type))
        if key not in _protocols:
            with torch.no_grad():
                _protocols[key] = _probe_layer(layer, roped, layer_type, kind, index, streams, attention)
            while len(_protocols) > MAX_PROTOCOLS:  # dicts keep insertion order: the oldest first
                del _protocols[next(iter(_protocols))]
        protocols.append(_protocols[key])
    for field, what in (
        ("linear_states", "one conv and recurrent state shape for every linear layer"),
        ("index_dim", "one indexer key width for every DSA layer"),
    ):
        seen = {getattr(p, field) for p in protocols} - {None}
        if len(seen) > 1:
            _unsupported(
                "per-layer-config",
                "the decoder layers",
                what,
                f"the layers cache {sorted(seen)}",
            )
    keywords = {p.cache_keyword for p in protocols}
    if len(keywords) != 1:
        _unsupported(
            "cache-protocol",
            "the decoder layers",
            "one cache keyword for every decoder layer",
            f"decoder layers take the cache as {sorted(keywords) or 'nothing (no layers)'}",
        )

    def first(field: str) -> Any:
        return next((getattr(p, field) for p in protocols if getattr(p, field) is not None), None)

    return LayerProtocol(
        protocols[0].cache_keyword,
        first("kv_dims"),
        first("linear_states"),
        first("index_dim"),
        tuple(p.kv_dims for p in protocols),
    )


def rope_layer_types(language_model: Any) -> tuple[str | tuple[str, ...] | None, ...] | None:
    """Each layer's type, when the stack's rotary embedding takes one (``rotary_emb(x, position_ids,
    layer_type)``: Gemma-3, OLMo-3 give sliding and full layers their own frequencies), else None. A
    layer whose type the embedding keeps no frequencies for (not in its ``layer_types``: LFM3's ``conv``
    layers, which take none) or whose ``rope_parameters`` entry is None (Beam's NoPE full-attention
    layers) is None: it gets no position embeddings, as the model's forward gives it. A stack whose
    rope is keyed by labels rather than layer types (``rope_labels``: DeepSeek-V4) gives every layer
    the tuple of labels: each layer takes ``{label: (cos, sin)}`` of all of them."""
    rotary_emb = getattr(language_model, "rotary_emb", None)
    if rotary_emb is None or "layer_type" not in _signature(type(rotary_emb).forward).parameters:
        return None
    types = getattr(language_model.config, "layer_types", None)
    if not types:
        _unsupported(
            "rotary-form",
            type(language_model).__name__,
            "config.layer_types for a rotary embedding that takes a layer_type",
            f"{type(language_model.config).__name__} has no layer_types",
        )
    kept = getattr(rotary_emb, "layer_types", None)
    count = language_model.config.num_hidden_layers
    labels = rope_labels(language_model)
    if labels is not None:
        return (labels,) * count
    rope = getattr(language_model.config, "rope_parameters", None)
    unroped = {t for t, parameters in rope.items() if parameters is None} if isinstance(rope, dict) else set()
    return tuple(
        t if (not isinstance(kept, (list, tuple)) or t in kept) and t not in unroped else None
        for t in types[:count]
    )


def rope_labels(language_model: Any) -> tuple[str, ...] | None:
    """The labels a stack's rotary embedding keeps its frequencies by, when they are not layer types and
    the model's forward hands every layer ``{label: rotary_emb(x, position_ids, layer_type=label)}``
    (DeepSeek-V4: ``{"main", "compress"}``, each attention picking its own; contact point
    ``rope_by_label``); None for any other stack."""
    model = type(language_model).__name__
    if model not in ROPE_BY_LABEL_MODELS.values():
        return None
    kept = getattr(getattr(language_model, "rotary_emb", None), "layer_types", None)
    types = set(getattr(language_model.config, "layer_types", None) or ())
    if not isinstance(kept, (list, tuple)) or not kept or types & set(kept):
        return None
    return tuple(kept)


def decoder_protocol(language_model: Any, kinds: Sequence[str] | None = None) -> LayerProtocol:
    """``probe_decoder_layers`` over a transformers decoder model (``layers``, ``rotary_emb``), its
    layers of ``kinds`` (by layer; None: every layer is attention); a view of it (the runtime's
    ``ProbedStack``) may say where a layer keeps its attention (``layer_attention``)."""
    layers = list(language_model.layers)[: language_model.config.num_hidden_layers]
    rotary_emb = getattr(language_model, "rotary_emb", None)  # None: no rope (NoPE, SSM stacks)
    streams = getattr(language_model.config, "hc_mult", None) or 1  # the runtime's ResidualStreams
    attention = language_model.layer_attention if isinstance(language_model, tuple) else None
    return probe_decoder_layers(
        layers, rotary_emb, rope_layer_types(language_model), kinds, streams, attention
    )


def forget() -> None:
    """Drop every probe result, so the next check probes again: the library probes are cached by name
    alone (a layer's result is keyed by the methods its classes hold, ``_layer_key``)."""
    _run.cache_clear()
    loading_api.cache_clear()
    temporal_merge_layout.cache_clear()
    _protocols.clear()


def _rope_of(rotary_emb: Any, hidden: Any, positions: Any, layer_type: Any, layer_name: str) -> Any:
    """The stack's ``(cos, sin)`` for the probe's tokens, or the located refusal of a rotary embedding that
    does not run on the model's device or returns another form (DeepSeek-V2's complex frequencies); for
    rope labels (a tuple: ``rope_labels``) the dict of each label's."""
    if isinstance(layer_type, tuple):
        return {label: _rope_of(rotary_emb, hidden, positions, label, layer_name) for label in layer_type}
    try:
        embeddings = (
            rotary_emb(hidden, positions) if layer_type is None else rotary_emb(hidden, positions, layer_type)
        )
    except Exception as exc:  # noqa: BLE001 - meta buffers read as values, mixed devices, ...
        _unsupported(
            "not-exportable",
            type(rotary_emb).__name__,
            f"rotary_emb(hidden_states, position_ids) runs on the {hidden.device.type} device",
            f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}{_failed_at(exc)}",
        )
    if not (isinstance(embeddings, tuple) and len(embeddings) == 2):
        _unsupported(
            "rotary-form",
            layer_name,
            "rotary_emb(hidden_states, position_ids) -> (cos, sin)",
            f"{type(rotary_emb).__name__} returns {type(embeddings).__name__}",
        )
    return embeddings


# Where a decoder layer keeps its attention (the runtime ABI's ``MIXER_ATTRIBUTES["attention"]``; this module
# stays self-contained): ``self_attn``, or ``mixer`` in a stack of one-sublayer blocks (Nemotron-H), or
# the older names (GPT-J, CodeGen: ``attn``; GPT-NeoX: ``attention``; Falcon: ``self_attention``)
ATTENTION_ATTRIBUTES = ("self_attn", "mixer", "attn", "attention", "self_attention")
# The attribute an attention keeps the index it caches under in: ``layer_idx``, or GPT-Neo's ``layer_id``
# (the runtime ABI's ``INDEX_ATTRIBUTES``)
CACHE_INDEX_ATTRIBUTES = ("layer_idx", "layer_id")
# Layer kinds with no token mixer and no state (an MLP alone): called with neither a mask nor a cache
MIXERLESS_KINDS = ("none",)
# Layer kinds whose states are fixed-size per request (the runtime's ``LINEAR_LAYER_KINDS``; its own
# name, as both modules are embedded in one generated module): no mask
FIXED_STATE_KINDS = ("linear", "lightning", "short_conv")
# The layer kinds that keep a conv window through the linear-attention API (a short convolution alone;
# a hybrid layer beside its attention's KV: Falcon-H1, Zamba), and those that keep a recurrent state
# through it
CONV_KINDS = ("linear", "short_conv", "hybrid")
RECURRENT_KINDS = ("linear", "hybrid")
# Compressed layer kinds (DeepSeek-V4) and the series their compressors hand the static cache (the
# runtime's ``COMPRESSED_SERIES``, named apart: the generated modules embed both files): a csa layer's
# indexer compresses keys of its own
COMPRESSOR_SERIES = {"hca": ("comp",), "csa": ("comp", "index")}
# The contact point each kind's cache protocol is (the rest: cache_update; a hybrid layer's attention
# also calls ``update``)
STATE_POINTS = {
    "hca": "compressor_cache",
    "csa": "compressor_cache",
    "linear": "linear_attention_cache",
    "hybrid": "linear_attention_cache",
    "lightning": "lightning_attention_cache",
    "short_conv": "short_conv_cache",
}
# Mixer kinds whose stacks keep a float32 residual stream the CausalLM casts before its head (Mamba1's:
# ``head_input_cast``)
HEAD_CAST_MIXERS = ("mamba1",)


def _attention_of(layer: Any, path: str | None = None) -> Any:
    """The layer's attention module: at ``path`` (a spec's ``module_paths.layer_attention``, dotted,
    relative to the layer: GPT-Neo's ``attn.attention``), else the first of ``ATTENTION_ATTRIBUTES``
    (None: it has none there)."""
    if path is not None:
        module = layer
        for name in path.split("."):
            module = getattr(module, name, None)
        return module
    return next((m for m in (getattr(layer, n, None) for n in ATTENTION_ATTRIBUTES) if m is not None), None)


def attention_index(attention: Any) -> Any:
    """The index ``attention`` caches under (``CACHE_INDEX_ATTRIBUTES``; None: it keeps none)."""
    return next(
        (i for i in (getattr(attention, n, None) for n in CACHE_INDEX_ATTRIBUTES) if i is not None), None
    )


class SharedKeysValues(dict):  # type: ignore[type-arg]
    """A ``shared_kv_states`` for a KV-sharing layer called without its producer (the layer probe, the
    simulation's per-rank trace): every layer type it asks for reads zero keys and values of
    ``length`` positions shaped by the layer's own attention (its KV heads: heads / groups; its head
    width); the types read are recorded."""

    def __init__(self, attention: Any, hidden: Any, length: int) -> None:
        super().__init__()
        self.attention, self.hidden, self.length = attention, hidden, length
        self.read: list[Any] = []

    def __missing__(self, layer_type: Any) -> tuple[Any, Any]:
        self.read.append(layer_type)
        a = self.attention
        heads = a.config.num_attention_heads // a.num_key_value_groups
        zeros = self.hidden.new_zeros(self.hidden.shape[0], heads, self.length, a.head_dim)
        return zeros, zeros


def stack_inputs(
    layer: Any,
    hidden: Any,
    kind: str = "attention",
    length: int = 0,
    index: int = 0,
    original: Any = None,
    attention: str | None = None,
) -> dict[str, Any]:
    """The inputs the model's forward builds once per call that the layer's forward takes (the runtime's
    ``STACK_INPUTS``), as the wrappers hand them to the first layer of a call: an empty
    ``shared_kv_states`` (Gemma-4; a ``shared`` layer's reads zeros of ``length`` positions, default the
    call's tokens: ``SharedKeysValues``), a zero ``per_layer_input`` of the layer's width (None where it
    has none; contact point ``per_layer_inputs``), ``original_hidden_states`` (Zamba, Zamba2: what entered
    the first layer, ``original``; zeros like ``hidden`` where not given), the layer's ``index`` as
    ``layer_idx``, and ALiBi biases of zeros for a layer that requires them (BLOOM's ``alibi`` ``[B *
    heads, 1, length]``, MPT's ``position_bias`` ``[heads, 1, length]``: contact point ``alibi_bias``; a
    bias of zeros leaves the scores as they are), else none (Falcon's rotary configs). ``attention``: where
    the layer keeps its attention (``_attention_of``)."""
    params = _signature(type(layer).forward).parameters
    module = _attention_of(layer, attention)
    inputs: dict[str, Any] = {}
    if "original_hidden_states" in params:
        inputs["original_hidden_states"] = hidden.new_zeros(hidden.shape) if original is None else original
    if "layer_idx" in params:
        inputs["layer_idx"] = index
    if "shared_kv_states" in params:
        inputs["shared_kv_states"] = (
            SharedKeysValues(module, hidden, length or hidden.shape[1]) if kind == "shared" else {}
        )
    if "per_layer_input" in params:
        width = getattr(layer, "hidden_size_per_layer_input", None)
        inputs["per_layer_input"] = hidden.new_zeros(*hidden.shape[:2], width) if width else None
    heads = getattr(layer, "num_heads", None) or getattr(module, "num_heads", None)
    for name in ("alibi", "position_bias"):  # BLOOM's [B * heads, 1, K], MPT's [heads, 1, K]
        if name in params:
            required = params[name].default is inspect.Parameter.empty
            rows = heads * hidden.shape[0] if name == "alibi" and heads else heads
            inputs[name] = hidden.new_zeros(rows, 1, length or hidden.shape[1]) if required and rows else None
    if "input_ids" in params:  # DeepSeek-V4's hash-routed MoE: token 0 (a valid row of tid2eid)
        import torch

        inputs["input_ids"] = torch.zeros(*hidden.shape[:2], dtype=torch.long, device=hidden.device)
    return inputs


def _probe_layer(
    layer: Any,
    rotary_emb: Any,
    layer_type: str | tuple[str, ...] | None,
    kind: str,
    index: int,
    streams: int = 1,
    attention: str | None = None,
) -> LayerProtocol:
    import torch

    expected = BY_NAME[STATE_POINTS.get(kind, "cache_update")].expected
    layer_name = type(layer).__name__
    layer_idx = attention_index(_attention_of(layer, attention))
    parameter = next(layer.parameters())
    dtype = _compute_dtype(layer)
    hidden = torch.zeros(1, 2, _hidden_size(layer, attention), dtype=dtype, device=parameter.device)
    # the layer's input: one residual stream, or the stack's hc_mult copies of it
    taken = hidden if streams == 1 else hidden.unsqueeze(2).expand(-1, -1, streams, -1).contiguous()
    positions = torch.arange(2, device=parameter.device).unsqueeze(0)
    # a linear layer's state takes every token it is given, a block with no mixer keeps none: the
    # wrappers hand them no mask
    unmasked = kind in FIXED_STATE_KINDS or kind in MIXERLESS_KINDS
    mask = torch.zeros(1, 1, 2, 2, dtype=dtype, device=parameter.device) if not unmasked else None
    # no rotary_emb (NoPE, SSM stacks): the layers get no position embeddings, as the ABI's wrappers pass
    embeddings = (
        None if rotary_emb is None else _rope_of(rotary_emb, hidden, positions, layer_type, layer_name)
    )
    keyword = cache_keyword(layer, attention)
    cache = _RecordingCache(kind)
    inputs = stack_inputs(
        layer, hidden, kind, index=index, attention=attention
    )  # a KV-sharing layer's reads are checked below
    takes = _signature(type(layer).forward).parameters
    if "causal_mask" in takes:  # runtime.CAUSAL_MASK_INPUT (Zamba)
        inputs["causal_mask"], mask = mask, None
    if kind == "hybrid":  # its attention caches under the layer's index (Zamba's: the one handed it)
        layer_idx = index
    if "prev_topk_indices" in takes:
        # what an earlier DSA layer hands on (the runtime's CARRIED_INPUTS; a layer with an indexer of its
        # own ignores it, one that reuses the top-k attends over it): every query's first key
        inputs["prev_topk_indices"] = hidden.new_zeros(1, 2, 1, dtype=torch.long)
    failure: Exception | None = None
    try:
        out = layer(
            taken,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            position_embeddings=embeddings,
            **inputs,
            **{keyword: cache if kind not in MIXERLESS_KINDS else None},
        )
    except Exception as exc:  # noqa: BLE001 - a protocol mismatch explains what failed after it
        failure, out = exc, None
    if isinstance(out, tuple) and out:  # (hidden_states, what it hands the next layer): GLM-5's top-k
        out = out[0]
    # how the layer used the cache first: whatever failed after a malformed call is its consequence
    if cache.missing:
        _unsupported(
            "cache-protocol",
            layer_name,
            expected + " and nothing else of the cache",
            f"{layer_name} reads cache.{cache.missing[0]}",
        )
    for call in cache.calls:
        key, value, index = call.states()
        if not (isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor) and index == layer_idx):
            _unsupported(
                "cache-protocol",
                layer_name,
                f"update(key_states, value_states, layer_idx={layer_idx}, ...)",
                f"{layer_name}'s attention calls {call.describe()}",
            )
    if isinstance(failure, TypeError) and keyword in str(failure):
        _unsupported(
            "cache-protocol", layer_name, f"{layer_name}.forward takes the cache as {keyword}=", str(failure)
        )
    if failure is not None:
        _unsupported(
            "not-exportable",
            layer_name,
            f"{layer_name} runs on the {parameter.device.type} device with the ABI's inputs",
            f"{type(failure).__name__}: {' '.join(str(failure).split())[:300]}{_failed_at(failure)}",
        )
    if kind == "linear":
        return _linear_protocol(layer_name, keyword, cache, index, out, taken)
    if kind == "lightning":
        return _lightning_protocol(layer_name, keyword, cache, index, out, taken)
    if kind == "short_conv":
        return LayerProtocol(keyword, None, (_conv_window(layer_name, keyword, cache, index, out, taken),))
    if kind in MIXERLESS_KINDS:  # given no cache: it must return the hidden states and keep nothing
        _check_hidden_states(layer_name, out, taken)
        return LayerProtocol(keyword, None)
    if kind == "shared":  # attends over its producer's keys and values: it must read them, cache nothing
        shared = inputs.get("shared_kv_states")
        if cache.calls or not isinstance(shared, SharedKeysValues) or not shared.read:
            found = "calls cache.update" if cache.calls else "never reads shared_kv_states"
            _unsupported(
                "kv-shared-layers",
                layer_name,
                f"{layer_name} reads its keys and values from shared_kv_states and never updates the cache",
                f"{layer_name} {found}",
                point="per_layer_inputs",
            )
        _check_hidden_states(layer_name, out, taken)
        return LayerProtocol(keyword, None)
    _check_hidden_states(layer_name, out, taken)
    kv_dims = _one_update(layer_name, keyword, cache)
    if kind == "hybrid":  # its mixer's states too, through the linear-attention API, under the same index
        mixed = _linear_protocol(layer_name, keyword, cache, index, out, taken)
        return LayerProtocol(keyword, kv_dims, mixed.linear_states)
    if kind in COMPRESSOR_SERIES:
        _check_compressor_calls(layer_name, cache, layer_idx, COMPRESSOR_SERIES[kind])
    if kind != "indexed":
        return LayerProtocol(keyword, kv_dims)
    indexed_idx, index_keys = cache.state_calls.get("update_indexer", (None, None))
    if indexed_idx != layer_idx or not (isinstance(index_keys, torch.Tensor) and index_keys.dim() == 3):
        found = "never calls it" if index_keys is None else f"calls it with layer_idx={indexed_idx!r}"
        _unsupported(
            "cache-protocol",
            layer_name,
            f"{layer_name}'s DSA indexer calls cache.update_indexer(keys [batch, tokens, dim], "
            f"layer_idx={layer_idx}) once",
            f"{layer_name} {found}",
            point="indexer_cache",
        )
    return LayerProtocol(keyword, kv_dims, index_dim=int(index_keys.shape[-1]))


def _check_compressor_calls(
    layer_name: str, cache: _RecordingCache, layer_idx: Any, series: tuple[str, ...]
) -> None:
    """A compressed layer's compressor (a csa layer's indexer too: ``series``) hands the static cache its
    window and its entries, once each per series, under the attention's index (the
    ``deepseek_v4_hca_compressor``, ``deepseek_v4_csa_compressor`` and ``deepseek_v4_indexer`` builtins: a
    spec without them runs upstream's, which reads ``cache.layers`` and is refused as a cache read
    above)."""
    for name in series:
        for call in (f"compressed_window:{name}", f"write_compressed:{name}"):
            called = cache.state_calls.get(call, (None, None))[0]
            if called != layer_idx:
                found = "never calls it" if call not in cache.state_calls else f"calls it with {called!r}"
                method, _, which = call.partition(":")
                _unsupported(
                    "cache-protocol",
                    layer_name,
                    f"{layer_name}'s compressor calls cache.{method}(layer_idx={layer_idx}, ..., series="
                    f"{which!r}) once",
                    f"{layer_name} {found}",
                    point="compressor_cache",
                )


def _failed_at(failure: BaseException) -> str:
    """Where in transformers' modelling code ``failure`` was raised (the innermost frame of a
    ``models/`` file, and its line: JetMoE's ``expert_size.tolist()``, which reads tensor values a
    meta model has none of), or nothing when it was raised elsewhere."""
    import traceback

    frames = [f for f in traceback.extract_tb(failure.__traceback__) if "/transformers/models/" in f.filename]
    if not frames:
        return ""
    frame = frames[-1]
    where = frame.filename.rsplit("/transformers/", 1)[1].removesuffix(".py").replace("/", ".")
    return f", at {where}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


def _one_update(
    layer_name: str, keyword: str, cache: _RecordingCache
) -> tuple[tuple[int, int], tuple[int, int]]:
    """What the layer's one ``update`` call caches per token: ``((key_heads, key_dim), (value_heads,
    value_dim))``."""
    if len(cache.calls) != 1:
        _unsupported(
            "cache-protocol",
            layer_name,
            f"{layer_name}(..., {keyword}=cache) calls cache.update once",
            f"{len(cache.calls)} calls",
        )
    key, value, _ = cache.calls[0].states()
    return (key.shape[1], key.shape[-1]), (value.shape[1], value.shape[-1])


def _check_hidden_states(layer_name: str, out: Any, hidden: Any) -> None:
    """A decoder layer returns the hidden states tensor (of the input's shape)."""
    import torch

    if not (isinstance(out, torch.Tensor) and out.shape == hidden.shape):
        _unsupported(
            "cache-protocol",
            layer_name,
            f"{layer_name} returns the hidden states tensor",
            f"it returns {type(out).__name__}",
        )


def _linear_protocol(
    layer_name: str, keyword: str, cache: _RecordingCache, index: int, out: Any, hidden: Any
) -> LayerProtocol:
    """A linear layer's states from its recorded prefill: its conv window (``_conv_window``) and its
    recurrent state, updated under its own index."""
    import torch

    conv = _conv_window(layer_name, keyword, cache, index, out, hidden)
    _called_once(cache, "update_recurrent_state", layer_name, keyword, index, "linear_attention_cache")
    recurrent = cache.state_calls["update_recurrent_state"][1]
    if not isinstance(recurrent, torch.Tensor):
        _unsupported(
            "cache-protocol",
            layer_name,
            "a recurrent state tensor",
            f"state {type(recurrent).__name__}",
            point="linear_attention_cache",
        )
    dtype = str(recurrent.dtype).removeprefix("torch.")
    return LayerProtocol(keyword, None, (conv, (tuple(int(d) for d in recurrent.shape[1:]), dtype)))


def _called_once(
    cache: _RecordingCache, name: str, layer_name: str, keyword: str, index: int, point: str
) -> None:
    """The layer called ``cache.name`` under its own index, or the protocol mismatch saying how not."""
    layer_idx, _ = cache.state_calls.get(name, (None, None))
    if layer_idx != index:
        found = f"calls it with layer_idx={layer_idx!r}" if name in cache.state_calls else "never calls it"
        _unsupported(
            "cache-protocol",
            layer_name,
            f"{layer_name}(..., {keyword}=cache) calls cache.{name}(..., layer_idx={index}) once",
            f"{layer_name} {found}",
            point=point,
        )


def _conv_window(
    layer_name: str, keyword: str, cache: _RecordingCache, index: int, out: Any, hidden: Any
) -> tuple[tuple[int, ...], str]:
    """A layer's conv window ``((channels, kernel), dtype)`` from its recorded prefill: it updated the
    window under its own index giving the kernel, and returned the hidden states (a linear layer's, or a
    short convolution's, which keeps nothing else)."""
    import torch

    point = STATE_POINTS[cache.kind]
    _called_once(cache, "update_conv_state", layer_name, keyword, index, point)
    conv, kernel = cache.state_calls["update_conv_state"][1]
    if not (isinstance(conv, torch.Tensor) and conv.dim() == 3 and isinstance(kernel, int) and kernel > 0):
        _unsupported(
            "cache-protocol",
            layer_name,
            "update_conv_state(inputs [batch, channels, tokens], layer_idx, conv_kernel_size=int)",
            f"{layer_name} hands over {type(conv).__name__} with conv_kernel_size={kernel!r}",
            point=point,
        )
    if not (isinstance(out, torch.Tensor) and out.shape == hidden.shape):
        _unsupported(
            "cache-protocol",
            layer_name,
            "the hidden states tensor returned",
            f"returns {type(out).__name__}",
            point=point,
        )
    return (int(conv.shape[1]), kernel), str(conv.dtype).removeprefix("torch.")


def _lightning_protocol(
    layer_name: str, keyword: str, cache: _RecordingCache, index: int, out: Any, hidden: Any
) -> LayerProtocol:
    """A lightning layer's one state from its recorded prefill: it asked for its state under its own index
    (None: the prefill path), set the new one ``[batch, heads, head_dim, head_dim]`` and returned the
    hidden states."""
    import torch

    point = "lightning_attention_cache"
    for name in LIGHTNING_CACHE_METHODS:
        layer_idx, _ = cache.state_calls.get(name, (None, None))
        if layer_idx != index:
            found = f"calls it with layer_idx={layer_idx!r}"
            if name not in cache.state_calls:
                found = "never calls it"
            _unsupported(
                "cache-protocol",
                layer_name,
                f"{layer_name}(..., {keyword}=cache) calls cache.{name}(layer_idx={index}, ...) once",
                f"{layer_name} {found}",
                point=point,
            )
    state = cache.state_calls["set_linear_cache"][1]
    if not (isinstance(state, torch.Tensor) and state.dim() == 4) or not (
        isinstance(out, torch.Tensor) and out.shape == hidden.shape
    ):
        _unsupported(
            "cache-protocol",
            layer_name,
            "a recurrent state tensor [batch, heads, head_dim, head_dim], and the hidden states returned",
            f"state {type(state).__name__}, returns {type(out).__name__}",
            point=point,
        )
    shape = tuple(int(d) for d in state.shape[1:])
    return LayerProtocol(keyword, None, ((shape, str(state.dtype).removeprefix("torch.")),))


def _unsupported(code: str, layer: str, expected: str, found: str, *, point: str = "cache_update") -> None:
    point = BY_NAME[point]
    raise LayersUnsupported(code, layer, Finding(point.name, point.symbol, False, found, expected))


def _compute_dtype(layer: Any) -> Any:
    """The dtype a layer's hidden states have: that of most of its parameters (a bfloat16 layer keeps
    some small ones in float32, which may come first: HY-V4's attention sinks, hyper-connections)."""
    sizes: dict[Any, int] = {}
    for param in layer.parameters():
        sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
    return max(sizes, key=sizes.__getitem__)


def _hidden_size(layer: Any, attention: str | None = None) -> int:
    """The width a layer takes: its (attention's) config's, else the first module that states one (a
    linear-attention mixer keeps ``hidden_size`` but no config; LFM2's short convolution a config), else
    the input width of its first linear projection."""
    config = getattr(_attention_of(layer, attention), "config", None) or getattr(layer, "config", None)
    if config is not None:
        return int(config.hidden_size)
    for module in layer.modules():
        size = getattr(module, "hidden_size", None)
        if not isinstance(size, int):  # BART-style layers (TrOCR): embed_dim
            size = getattr(module, "embed_dim", None)
        if not isinstance(size, int):
            size = getattr(getattr(module, "config", None), "hidden_size", None)
        if isinstance(size, int):
            return size
    # BERT-style layers (GIT) state no width: their first projection reads the hidden states
    first = next((m for m in layer.modules() if type(m).__name__ == "Linear"), None)
    if first is not None:
        return int(first.in_features)
    _unsupported(
        "cache-protocol", type(layer).__name__, "a layer whose config or mixer states hidden_size", "none"
    )
    raise AssertionError("unreachable")
