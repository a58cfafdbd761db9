"""Falcon with ``alibi: true`` (issue 37): its forward builds BLOOM's bias with a function of its modelling
module and hands every layer both the bias (``alibi``) and a mask with the bias folded in (each visible
entry the bias over ``sqrt(head_dim)``); the wrappers do both (``runtime.AlibiBias``, ``FOLDING_STACKS``).

Proven on a tiny random Falcon of transformers' own classes against unpatched transformers: a ragged
batch prefilled by the wrappers and decoded over the static cache, each row at its own position, gives
every row the logits ``generate`` gives that row alone; without the fold it does not. The matrix's spec
for Falcon serves both configs (its row, rotary, is the family matrix's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from fixtures.ragged import ragged_greedy
from transformers import AutoConfig, AutoModelForCausalLM

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction.equivalence.reference import reference_run
from kimi_adapter_core.backends.extraction.ir.stack import Backbone, check_positions
from kimi_adapter_core.backends.extraction.runtime import abi
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import buildable_config, module_paths, write_spec
from kimi_adapter_core.loading import applied
from kimi_adapter_core.patching.gate import claim_model
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.spec.model import StackParts

CAPACITY = 32  # the static cache's positions
STEPS = 4  # decode steps after the prefill


def tiny(**over: Any) -> torch.nn.Module:
    """The family matrix's tiny Falcon (``over`` on top), random weights, eager."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**tiny_config("falcon"), **over})
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config).eval()


def matrix_spec(folder: Path) -> Path:
    """The spec the family matrix writes for Falcon (rotary config: the same spec serves ALiBi)."""
    found = buildable_config("falcon")
    assert not isinstance(found, str), found
    config, model = found
    return write_spec(folder, "falcon", config, module_paths(model))


def _decode(tmp_path: Path, fold: bool) -> float:
    """The largest logit difference, over rows and steps, between the wrappers (the bias folded into the
    mask, or not) and unpatched ``generate`` on each row alone."""
    spec = load_spec(matrix_spec(tmp_path))
    model = tiny(alibi=True)
    stack = model.transformer
    built = {
        "kv_layout": "heads",
        "cache_keyword": upstream.cache_keyword(stack.h[0]),
        "parts": spec.stack_parts().stated,
    }
    prompt = torch.randint(3, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([9, 6, 3])
    with applied(spec, backend="extraction"):
        claim_model(model, spec.name)
        prefill = abi.PrefillWrapper.from_language_model(stack, model.lm_head, **built)
        decode = abi.DecodeWrapper.from_language_model(stack, model.lm_head, **built)
        if not fold:
            prefill.alibi.fold = decode.alibi.fold = None
        steps = ragged_greedy(prefill, decode, prompt, lengths, CAPACITY, STEPS)
    worst = 0.0
    for row, length in enumerate(lengths.tolist()):
        _, _, expected = reference_run(model, prompt[row : row + 1, :length], STEPS)
        for ours, theirs in zip(steps, expected, strict=True):
            worst = max(worst, float((ours[row] - theirs[0]).abs().max()))
    return worst


def test_falcons_alibi_rows_decode_as_transformers_generates_each_row(tmp_path: Path) -> None:
    assert _decode(tmp_path, fold=True) <= 1e-4


def test_without_the_fold_into_the_mask_the_rows_depart(tmp_path: Path) -> None:
    """What the fold is for: the bias in the scores alone is not Falcon's forward."""
    assert _decode(tmp_path, fold=False) > 1e-3


def test_falcons_alibi_is_built_by_its_modules_builder_and_passes_the_position_check() -> None:
    """With ``alibi: true`` the stack's bias is its module's ``build_alibi_tensor``, folded over
    ``sqrt(head_dim)``, and the stack passes ``check_positions``; a rotary Falcon has none."""
    model = tiny(alibi=True)
    bias = abi.AlibiBias.of(model.transformer)
    assert bias is not None and bias.keyword == "alibi"
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert bias.fold == head_dim**-0.5
    check_positions(
        Backbone(
            model,
            model.transformer,
            model.lm_head,
            StackParts({"layers": "h", "embeddings": "word_embeddings"}),
        )
    )
    assert abi.AlibiBias.of(tiny().transformer) is None
