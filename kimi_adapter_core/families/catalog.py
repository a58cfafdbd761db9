"""Which model types of the installed transformers the family matrix covers.

Decoder-only ``*ForCausalLM`` model types: the entries of transformers' causal-LM auto mapping,
except the decoder halves of encoder-decoder models (their config is encoder-decoder, or the type is
in a seq2seq mapping, or the class is a ``*Decoder``) and BERT-family encoders that only run causally
in their ``is_decoder`` mode (in the masked-LM mapping).
"""

from __future__ import annotations

from typing import NamedTuple


class ModelType(NamedTuple):
    name: str
    causal_lm_class: str
    excluded: str | None  # why it is not a decoder-only model (None: it is)


def model_types() -> list[ModelType]:
    """Every entry of transformers' causal-LM mapping, sorted, each with its exclusion reason if any."""
    from transformers.models.auto import configuration_auto, modeling_auto

    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    seq2seq = set(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES) | set(
        modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES
    )
    masked = set(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    rows = []
    for name in sorted(causal):
        cls = causal[name]
        cls = cls[0] if isinstance(cls, (list, tuple)) else cls
        excluded = None
        if name in seq2seq:
            excluded = "the decoder half of an encoder-decoder model"
        elif name in masked:
            excluded = "a bidirectional encoder that runs causally only as a decoder (masked-LM family)"
        elif cls.endswith("Decoder"):
            excluded = "the decoder of an encoder-decoder composite"
        elif name not in configuration_auto.CONFIG_MAPPING_NAMES:
            excluded = "no config class"
        elif _encoder_decoder(name):
            excluded = "an encoder-decoder model (its default config says is_encoder_decoder)"
        rows.append(ModelType(name, cls, excluded))
    return rows


def decoder_only() -> list[ModelType]:
    return [row for row in model_types() if row.excluded is None]


def _encoder_decoder(name: str) -> bool:
    from transformers import CONFIG_MAPPING

    try:
        return bool(getattr(CONFIG_MAPPING[name](), "is_encoder_decoder", False))
    except Exception:  # noqa: BLE001 - a default that does not build is the trial's finding
        return False
