"""The MTP draft graph (issue 39 item 3): DeepSeek-V3's and GLM-4.5's multi-token-prediction layer
exported as its own packed graph over a paged pool, fed the final hidden states the step graph returns.

Two requests of a tiny random model are served from the state mapping alone: their prompts prefilled in
one step call (every token's logits and hidden state asked for), then each step verifies the request's
last token and one draft (``k + 1 = 2`` tokens at consecutive positions); the longest matching prefix is
accepted, a rejected draft's KV is simply overwritten by the next call. After every call the accepted
positions are fed to the MTP graph (their hidden states and the tokens after them) and its last row is the
next draft. Every draft's logits must be transformers' own ``MtpModel``'s for the same verified prefix
(unpatched, fp32, 1e-4 of the row's largest) and the served tokens ``generate()``'s greedy ones; drafts
come from the MTP graph, or from an oracle (the greedy tokens themselves, so that every draft is accepted
and the MTP graph is fed two positions per call). transformers' own assisted generation with MTP
(``generate(use_mtp=True)``) gives the same tokens where it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.step_graph import (
    Sizes,
    StepGraph,
    extract_step,
    mtp_executor,
    mtp_reference_draft,
    step_executor,
)
from transformers import GenerationConfig

from kimi_adapter_core.backends.extraction import options_from_spec
from kimi_adapter_core.backends.extraction.ir.mtp_export import attached
from kimi_adapter_core.backends.extraction.job.pipeline import backbone_of
from kimi_adapter_core.backends.extraction.runtime.mtp import mtp_refusal
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import load_config
from kimi_adapter_core.spec import load_spec

# two request rows and a scratch row; 16 tokens per call, every one's logits (a prompt's hidden states
# all feed the MTP layer)
SIZES = Sizes(rows=3, cache=32, block=4, blocks=20, tokens=16, logits=16)
PROMPTS, NEW = (9, 5), 12
Item = tuple[int, Sequence[int], Sequence[int], Any]  # (row, positions, tokens, hidden rows or None)


class Server:
    """Packs step and MTP calls from the state mapping (``step``, ``mtp``, ``contract.paged``): each
    request row owns blocks of a scrambled pool, unused tokens go to the scratch row."""

    def __init__(self, graph: StepGraph) -> None:
        mapping = graph.mapping
        self.step, self.mtp = (
            step_executor(graph, check_ownership=True),
            mtp_executor(graph, check_ownership=True),
        )
        inputs = [e for layer in mapping["layers"] for key, e in layer.items() if key.endswith("_input")]
        self.pools = [torch.zeros(e["shape"], dtype=getattr(torch, e["dtype"])) for e in inputs]
        self.mtp_pools = [
            torch.zeros(p["shape"], dtype=getattr(torch, p["dtype"])) for p in mapping["mtp"]["pools"]
        ]
        paged = mapping["contract"]["paged"]
        order = torch.randperm(paged["num_blocks"], generator=torch.Generator().manual_seed(3)).tolist()
        per_row = paged["blocks_per_row"]
        self.table = torch.full((SIZES.rows, per_row), order[0], dtype=torch.long)  # the scratch block
        for row in range(SIZES.rows - 1):
            self.table[row] = torch.tensor(order[1 + row * per_row : 1 + (row + 1) * per_row])
        self.hidden_size = mapping["mtp"]["inputs"][0]["shape"][1]

    def _pack(self, items: list[Item]) -> tuple[list[torch.Tensor], list[slice]]:
        ids, positions, rows, spans = [], [], [], []
        for row, where, tokens, _ in items:
            spans.append(slice(len(ids), len(ids) + len(where)))
            ids += list(tokens)
            positions += list(where)
            rows += [row] * len(where)
        pad = SIZES.tokens - len(ids)
        indices = torch.arange(SIZES.logits)  # every token's row (padding rows are ignored)
        packed = [torch.tensor(ids + [0] * pad), torch.tensor(positions + [0] * pad)]
        return [*packed, torch.tensor(rows + [SIZES.rows - 1] * pad), self.table, indices], spans

    def run_step(self, items: list[Item]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each item's logits and final hidden states."""
        call, spans = self._pack(items)
        logits, hidden, *self.pools = self.step((*call, *self.pools))
        return [(logits[span], hidden[span]) for span in spans]

    def run_mtp(self, items: list[Item]) -> list[torch.Tensor]:
        """Each item's draft logits (row i: the token two after its position i)."""
        call, spans = self._pack(items)
        hidden = torch.zeros(SIZES.tokens, self.hidden_size)
        hidden[: spans[-1].stop] = torch.cat([item[3] for item in items])
        logits, *self.mtp_pools = self.mtp((hidden, *call, *self.mtp_pools))
        return [logits[span] for span in spans]


def _greedy(model: Any, prompt: list[int], new: int) -> list[int]:
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()


def serve(graph: StepGraph, prompts: list[list[int]], oracle: list[list[int]] | None) -> dict[str, Any]:
    """Greedy decode with one draft per step (module docstring); drafts from the MTP graph, or the
    ``oracle``'s tokens. Returns the outputs, the accepted drafts and every MTP draft with its prefix."""
    server = Server(graph)
    seqs = [list(prompt) for prompt in prompts]
    results = server.run_step([(row, range(len(p)), p, None) for row, p in enumerate(prompts)])
    feeds = []
    for row, (logits, hidden) in enumerate(results):
        seqs[row].append(int(logits[-1].argmax()))
        feeds.append((row, range(len(prompts[row])), seqs[row][1:], hidden))
    drafted: list[tuple[list[int], torch.Tensor]] = []  # (verified tokens, MTP draft logits)
    accepted = 0
    while True:
        drafts = {}
        for (row, *_), logits in zip(feeds, server.run_mtp(feeds), strict=True):
            drafted.append((list(seqs[row]), logits[-1]))
            done = len(seqs[row]) - len(prompts[row])
            drafts[row] = (
                oracle[row][done] if oracle and done < len(oracle[row]) else int(logits[-1].argmax())
            )
        live = [row for row in drafts if len(seqs[row]) - len(prompts[row]) < NEW]
        if not live:
            break
        items = [
            (row, [len(seqs[row]) - 1, len(seqs[row])], [seqs[row][-1], drafts[row]], None) for row in live
        ]
        feeds = []
        for row, (logits, hidden) in zip(live, server.run_step(items), strict=True):
            tokens = [int(logits[0].argmax())]
            if tokens[0] == drafts[row]:  # the draft holds: the token after it is verified too
                tokens.append(int(logits[1].argmax()))
                accepted += 1
            where = range(len(seqs[row]) - 1, len(seqs[row]) - 1 + len(tokens))
            seqs[row] += tokens
            feeds.append((row, where, tokens, hidden[: len(tokens)]))
    outputs = [seq[len(prompt) : len(prompt) + NEW] for seq, prompt in zip(seqs, prompts, strict=True)]
    return {"outputs": outputs, "accepted": accepted, "drafted": drafted}


@pytest.fixture(scope="module", params=[pytest.param("deepseek_v3", marks=pytest.mark.compat), "glm4_moe"])
def graph(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> StepGraph:
    return extract_step(request.param, tmp_path_factory.mktemp(request.param), SIZES, mtp=True)


def _prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for length in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("drafts", ["mtp", "oracle"])
def test_mtp_drafts_equal_transformers_and_greedy_output_is_unchanged(graph: StepGraph, drafts: str) -> None:
    prompts = _prompts(graph.text.vocab_size)
    expected = [_greedy(graph.model, prompt, NEW) for prompt in prompts]
    served = serve(graph, prompts, expected if drafts == "oracle" else None)
    assert served["outputs"] == expected
    for verified, logits in served["drafted"]:
        reference = mtp_reference_draft(graph, verified)
        assert (logits - reference).abs().max() <= 1e-4 * reference.abs().max(), verified
        assert int(logits.argmax()) == int(reference.argmax()), verified
    if drafts == "oracle":  # every draft accepted: two verified tokens and two MTP positions per call
        assert served["accepted"] >= NEW // 2 - 1


@pytest.mark.slow
def test_transformers_assisted_generation_with_mtp_gives_the_greedy_tokens(
    graph: StepGraph, tmp_path: Path
) -> None:
    """The reference itself: ``generate(use_mtp=True)`` loads ``MtpModel`` from the model's checkpoint
    (the MTP layer as checkpoint layer ``num_hidden_layers``, where the graph's weight map reads it)."""
    model = graph.model
    spec = load_spec(graph.mapping["model_name"])
    with attached(backbone_of(spec, model), graph.mtp):
        model.save_pretrained(tmp_path)
    model.config._name_or_path = str(tmp_path)
    model.config.dtype = torch.float32  # MtpModel.from_pretrained builds in config.dtype, here the string
    # transformers finds the MTP keys by the model class's ignored-key pattern of the full-size layer
    # index (DeepSeek-V3: model.layers.61); the tiny checkpoint's MTP layer is num_hidden_layers
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{model.config.num_hidden_layers}\..*"]
    prompt = _prompts(graph.text.vocab_size)[0]
    config = GenerationConfig(
        max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0, use_mtp=True
    )
    with torch.no_grad():
        assisted = model.generate(torch.tensor([prompt]), generation_config=config)
    assert assisted[0, len(prompt) :].tolist() == _greedy(model, prompt, NEW)


@pytest.mark.compat
def test_a_config_without_mtp_layers_is_refused_before_any_export(tmp_path: Path) -> None:
    with pytest.raises(KadaptError, match="no MTP draft graph: the deepseek_v3 config has no MTP layers"):
        extract_step("kimi_k25", tmp_path, SIZES, mtp=True)
    assert list(tmp_path.iterdir()) == []


def test_without_transformers_mtp_model_the_mtp_graph_is_refused_with_that_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import transformers.modeling_layers

    config = load_config(load_spec("deepseek_v3"))
    assert mtp_refusal(config) is None
    monkeypatch.delattr(transformers.modeling_layers, "MtpModel")
    assert "has no transformers.modeling_layers.MtpModel" in str(mtp_refusal(config))


def test_the_mtp_graph_needs_the_step_graph_that_feeds_it() -> None:
    with pytest.raises(KadaptError, match="--step-mtp: the MTP draft graph reads the step graph's hidden"):
        options_from_spec(load_spec("deepseek_v3"), step_mtp=True)
