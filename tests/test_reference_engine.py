"""A reference engine written from the state mapping alone (examples/reference_engine.py) serves a
seeded trace of 50 requests through the packed step graph: arrivals over time, prompts of different
lengths, half of them opening with a shared prefix whose blocks later requests read from the prefix
cache, chunked prefill mixed with decode in each call, a block pool smaller than rows x context.
Every request's tokens must be transformers' own ``generate()`` of that request alone (unpatched,
fp32, tiny random model), with the binder's checks on, ownership included (issue 39 item 5; MTP
drafting is not in it: no MTP graph is exported yet)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from fixtures.modules import import_path
from fixtures.step_graph import Sizes, extract_step, step_executor
from transformers import GenerationConfig

REPO = Path(__file__).resolve().parents[1]
# 8 request rows and the padding row; a pool of 40 blocks where 8 rows x 8 blocks would take 64
SIZES = Sizes(rows=9, cache=32, block=4, blocks=40, tokens=16, logits=8)
REQUESTS, PREFIX = 50, 8  # a shared prefix of two full blocks


def _trace(vocab: int) -> list[tuple[list[int], int, int]]:
    """``(prompt, new tokens, arrival step)`` of each request, seeded: prompts of 3-18 tokens (half
    opening with the shared prefix), 1-8 new tokens, arrivals spread over the first 60 steps."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, vocab) for _ in range(PREFIX)]
    trace = []
    for _ in range(REQUESTS):
        own = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 10))]
        prompt = prefix + own if rng.random() < 0.5 else own
        trace.append((prompt, rng.randint(1, 8), rng.randrange(60)))
    return trace


def _generate(model, prompt: list[int], new: int) -> list[int]:
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()


# GQA, a sliding window (4 on the tiny model: requests run past it), MoE, MLA latent KV with MoE, GQA MoE
# with partial rope (GLM-4.5), Kimi-K2.5's text stack (its spec keeps its vision graphs)
FAMILIES = [
    pytest.param("llama", marks=pytest.mark.compat),
    "mistral",
    "qwen3_moe",
    "deepseek_v3",
    "glm4_moe",
    "kimi_k25",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_the_reference_engine_serves_a_trace_as_transformers_generates_each_request(
    name: str, tmp_path: Path
) -> None:
    engine_module = import_path(REPO / "examples" / "reference_engine.py", "reference_engine")
    graph = extract_step(name, tmp_path, SIZES)
    trace = _trace(graph.text.vocab_size)
    requests = [engine_module.Request(prompt, new, arrival) for prompt, new, arrival in trace]
    engine = engine_module.ReferenceEngine(graph.mapping, step_executor(graph, check_ownership=True))
    steps = engine.serve(requests)
    for index, request in enumerate(requests):
        assert request.output == _generate(graph.model, request.prompt, request.max_new), index
    assert len({tuple(r.output) for r in requests}) > REQUESTS // 2  # the requests really differ
    assert engine.shared_blocks >= 10  # later requests read the prefix from the cache
    served = sum(len(r.prompt) + r.max_new for r in requests)
    assert steps < served / 4  # calls carried many requests' tokens at once
    assert sorted(engine.free + [engine.scratch_block]) == list(range(SIZES.blocks))  # all returned
