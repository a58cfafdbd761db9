"""What kadapt refuses in a config before deriving anything: families whose layers need an operation
it cannot express (``refused_families``, each naming it), layers whose state it does not carry
(``hybrid_keys``), layer features no spec can supply (``layer_features``: Gemma-4's dense MLP beside
routed experts), per-layer overrides of more than the KV shape, and math outside the layers the
wrappers would drop (``outside_layers``); each located at the spec's gate. Keys only such configs
have tell them apart, on the config object and the raw JSON alike (``derive`` runs these first).
"""

from __future__ import annotations

from ..errors import Refusal
from ..spec.model import Spec
from .layer_shapes import refuse_other_layer_attributes
from .reader import MISSING, Reader, locate, tables
from .shared_blocks import modelled_hybrid_keys


def refuse_unmodelled_layers(read: Reader, spec: Spec | None) -> None:
    """Hybrid stacks (SSM, linear attention, recurrence, convolution), layer features kadapt lacks
    (``layer_features``: Gemma-4's KV-shared layers, per-layer inputs) and per-layer overrides of more than
    the KV shape, told apart by keys only they have, on the config object and the raw JSON alike."""
    _refuse_known_family(read, spec)
    modelled = modelled_hybrid_keys(read.raw("model_type"))  # a shared-block rule's (Zamba2)
    for key in tables()["hybrid_keys"]:
        value = read.raw(key)
        if value is not MISSING and value is not None and key not in modelled:
            raise Refusal(
                "hybrid",
                f"{read.where} sets {key}, which only models with non-attention layers (SSM, linear "
                "attention, recurrence, convolution) have; kadapt carries KV caches, gated-DeltaNet, KDA, "
                "Mamba2 and Mamba1 states (conv window, recurrent state), lightning attention's "
                "recurrent state, short convolutions' windows and hybrid layers holding both (Falcon-H1, "
                "Zamba's shared blocks), and this family is not among those it reads",
                location=locate(spec, "gate"),
            )
    model_type = read.raw("model_type")
    for key, rule in tables()["layer_features"].items():
        value = read.raw(key)
        if "modelled" in rule and model_type in tables()[rule["modelled"]]:
            continue  # the family's rule models it (``kv_sharing``)
        if value is not MISSING and value not in rule["neutral"]:
            message = f"{read.where} sets {key} = {value!r}, which {rule['effect']}"
            raise Refusal(rule["code"], message, location=locate(spec, "gate"))
    refuse_other_layer_attributes(read)


def _refuse_known_family(read: Reader, spec: Spec | None) -> None:
    """A family whose layers need an operation kadapt cannot express (``refused_families``) is refused
    naming that operation and why no spec can supply it, rather than with the generic hybrid sentence."""
    rule = tables()["refused_families"].get(read.raw("model_type"))
    if rule is None:
        return
    value = read.raw(rule["key"])
    if value is not MISSING and value is not None:
        raise Refusal(
            rule.get("code", "hybrid"),
            f"{read.where} sets {rule['key']}: {rule['operation']}; {rule['why']}",
            location=locate(spec, "gate"),
        )


def refuse_outside_layer_features(read: Reader, spec: Spec | None) -> None:
    """Features outside the decoder layers would be dropped silently by the ABI wrappers."""
    where = spec.locate("gate") if spec is not None else None
    text_only = spec is None or spec.abi is None or spec.abi.vision is None
    for key, rule in tables()["outside_layers"].items():
        value = read.raw(key)
        neutral = [*rule["neutral"], *(rule.get("text_neutral", ()) if text_only else ())]
        if value is not MISSING and value not in neutral:
            message = (
                f"{read.where} sets {key} = {value!r}, which {rule['effect']}; kadapt's prefill/decode "
                "wrappers call the decoder layers directly and cannot honour it, so the model is refused "
                "rather than exported wrong"
            )
            raise Refusal("outside-layers", message, location=where)
