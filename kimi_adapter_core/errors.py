"""Errors that reach the user as a message, never as a traceback.

Anything raised as a ``KadaptError`` is a user-facing problem (bad spec, bad size, unwritable
directory, drifted upstream code). The CLI prints ``error: <message>`` and exits with
``exit_code``; everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import re


class KadaptError(Exception):
    """A user error: printed as one located message, exit status ``exit_code``."""

    exit_code = 1

    def __init__(self, message: str, *, location: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.location = location  # "file:line:col" when the error points at a spec node

    def __str__(self) -> str:
        return f"{self.location}: {self.message}" if self.location else self.message


class UsageError(KadaptError):
    """Bad command-line usage (exit 2, like click's own usage errors)."""

    exit_code = 2


_REFUSED = re.compile(r"refused \(([\w-]+)\): (.*)", re.DOTALL)  # what Refusal writes


def parse_refusal(message: str) -> tuple[str, str] | None:
    """``(code, reason)`` of a ``Refusal``'s message wherever it is reported as text (a diagnostic, a
    wrapped error), else None."""
    found = _REFUSED.search(message)
    return (found[1], found[2]) if found else None


class Refusal(KadaptError):
    """Something kadapt does not model, refused before any work: ``code`` is one of ``REFUSALS``.

    The message starts with ``refused (code):`` so a reader (and the family matrix) can tell a
    documented refusal from any other error.
    """

    def __init__(self, code: str, message: str, *, location: str | None = None) -> None:
        if code not in REFUSALS:
            raise ValueError(f"unknown refusal code {code!r}; known: {', '.join(REFUSALS)}")
        super().__init__(f"refused ({code}): {message}", location=location)
        self.code = code


# The documented list (docs/families.md explains each): what kadapt refuses, and why.
REFUSALS = {
    "outside-layers": "math outside the decoder layers (embedding scale, logit scale, soft-capping...) "
    "that the wrappers do not reproduce",
    "stack-differs": "the decoder layers, called by the wrappers with the ABI's masks, positions and cache, "
    "give other hidden states than the model's own forward gives them",
    "hybrid": "layers that are not attention (SSM, recurrence, convolution, linear attention other than "
    "gated DeltaNet, KDA, Mamba2, Mamba1, lightning attention and LFM2's short convolution): their state "
    "is neither a KV cache nor a conv window and recurrent state kadapt can size",
    "layer-types": "attention kinds other than full, sliding-window, chunked and DSA-indexed (compressed)",
    "per-layer-config": "per-layer config values other than each attention layer's KV heads and head "
    "width and a latent attention layer's query heads, latent rank and nope width (a per_layer_config "
    "overriding other attributes, a size listed per layer)",
    "kv-shared-layers": "layers that reuse an earlier layer's keys and values within one forward "
    "(num_kv_shared_layers) by a rule kadapt has not proven for the family (Gemma-4's it carries), or that "
    "all reuse another model's (an assistant model)",
    "per-layer-inputs": "a decoder layer input the model computes outside the layers from the tokens "
    "(per-layer embeddings) where the stack lacks the methods Gemma-4's wrappers compute them with",
    "layer-mlp": "an MLP kadapt does not describe: a dense MLP beside routed experts in one layer "
    "(Gemma-4's enable_moe_block)",
    "stack-layout": "a decoder stack without the layers, embeddings and final norm the wrappers call (the "
    "spec's module_paths name them), positions reaching its layers other than by a rotary embedding, "
    "absolute position embeddings the spec names (a table, or computed from the positions alone) or ALiBi "
    "built by the stack's own builder (a relative position bias), layers without an attention that knows "
    "its layer index (several attentions per layer) or that keeps a cache, or that take an input the "
    "model's forward computes and the wrappers do not; or a stack a spec cannot describe (layers the "
    "forward skips, several stacks, two-stream attention, a span per phase), each named",
    "cache-protocol": "decoder layers that use the cache beyond update(key, value, layer_idx), take it under "
    "no known keyword, or return something else than the hidden states",
    "rotary-form": "a rotary embedding that gives something else than (cos, sin) per position (complex "
    "frequencies: DeepSeek-V2 and Llama-4 without their builtin patches)",
    "routing": "a router scoring function kadapt does not know (it knows softmax and sigmoid)",
    "unknown-key": "a structural fact under a config key kadapt's table does not list: the spec names the "
    "key (architecture.fields)",
    "not-exportable": "a decoder layer that does not run on the meta device (it reads tensor values, which "
    "a static graph cannot)",
    "checkpoint-layout": "weights that transformers' loader builds with an operation the weight map cannot "
    "describe",
}
