"""The reference engine (examples/reference_engine.py) serves tests/test_reference_engine.py's trace with
MTP drafting (issue 39 items 3 and 5): DeepSeek-V3 (latent MLA) and GLM-4.5 (GQA MoE, partial rope)
draft one token per step with their MTP draft graph (``abi.step.mtp``: every verified position fed to
it, prompt positions included, its pools paged through the same block table, its prefix blocks shared
with the main pools'). The drafts are verified in the same step calls as every other token, the longest
confirmed prefix accepted; every request's tokens stay ``generate()``'s, and every draft is transformers'
``MtpModel``'s after the tokens before it (tiny random MTP layers rarely agree with their model, so
acceptance itself is exercised by Kimi-K2.5's proposed drafts in tests/test_reference_engine.py and by
tests/test_mtp_graph.py's drafts that always hold)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.engine_trace import check_served, serve_trace
from fixtures.step_graph import mtp_reference_draft


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("deepseek_v3", marks=pytest.mark.compat), "glm4_moe"])
def test_mtp_drafts_serve_a_trace_as_transformers_generates_each_request(name: str, tmp_path: Path) -> None:
    served = serve_trace(name, tmp_path, "mtp")
    check_served(served)
    assert served.engine.drafted > 50  # drafts verified in the step calls
    for request in served.requests:  # each one MtpModel's, shared prefix blocks' MTP KV included
        for position, token in request.drafts:
            reference = mtp_reference_draft(served.graph, request.tokens[:position])
            assert token == int(reference.argmax()), (request.prompt, position)
