"""A reference engine written from the state mapping alone (examples/reference_engine.py) serves a
seeded trace of 50 requests through the packed step graph: arrivals over time, prompts of different
lengths, half of them opening with a shared prefix whose blocks later requests read from the prefix
cache, chunked prefill mixed with decode in each call, a block pool smaller than rows x context.
Every request's tokens must be transformers' own ``generate()`` of that request alone (unpatched,
fp32, tiny random model), with the binder's checks on, ownership included (issue 39 item 5).

Kimi-K2.5's text stack (no MTP layer in its config) serves it with speculative decoding: up to three
speculative tokens per step from a cheap proposer (here ``generate()``'s own tokens, each spoiled with
probability 0.3, so that drafts hold whole, in part and not at all), verified in the same step calls as
every other token, the longest confirmed prefix accepted. DeepSeek-V3 and GLM-4.5 serve it drafting
with their MTP graph in tests/test_reference_engine_mtp.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.engine_trace import REPO, check_served, serve_trace
from fixtures.modules import import_path


# GQA, a sliding window (4 on the tiny model: requests run past it), MoE
@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("llama", marks=pytest.mark.compat), "mistral", "qwen3_moe"])
def test_the_reference_engine_serves_a_trace_as_transformers_generates_each_request(
    name: str, tmp_path: Path
) -> None:
    served = serve_trace(name, tmp_path)
    check_served(served)
    assert served.engine.drafted == 0


@pytest.mark.slow
def test_speculative_tokens_verified_in_the_step_serve_kimi_k25_as_transformers_generates(
    tmp_path: Path,
) -> None:
    served = serve_trace("kimi_k25", tmp_path, "proposed")
    check_served(served)
    engine = served.engine
    assert engine.drafted > 50 and engine.drafted // 3 < engine.accepted < engine.drafted


def test_the_ngram_proposer_drafts_what_followed_the_last_tokens_before() -> None:
    engine_module = import_path(REPO / "examples" / "reference_engine.py", "reference_engine")
    propose = engine_module.ngram_proposer(2)
    assert propose([5, 6, 7, 9, 5, 6], 3) == [7, 9, 5]  # after the latest earlier "5 6"
    assert propose([1, 6, 2, 8, 6], 2) == [2, 8]  # no earlier "8 6": after the latest earlier "6"
    assert propose([1, 2, 3], 2) == [3, 3]  # nothing repeats: the last token again
