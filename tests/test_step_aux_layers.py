"""The step graph's auxiliary hidden states (``abi.step.aux_layers``): an EAGLE-3 draft's features.

One step graph call packs a prompt chunk of one request beside another request's whole prompt, the next
call the first request's last chunk beside two speculative tokens of the second; the graph returns,
for every token asked, the hidden states after the named decoder layers, concatenated in layer order.
Each must equal unpatched transformers' ``hidden_states[i + 1]`` of ``model(..., output_hidden_states=
True)`` over the request's whole sequence at that position (fp32, tiny random model), and the last
layer's the output of transformers' own last decoder layer (before the final norm, where
``hidden_states[-1]`` is after it). Llama's layer 0 is read from the traced layers 0 and 1 while
layer 2 is replicated (stitching); DeepSeek-V3's layers 1 and 2 (its last) make the export trace every
layer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures.step_graph import Sizes, StepGraph, extract_step, layer_outputs, step_executor

from kimi_adapter_core.backends.extraction import options_from_spec, run
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import applied, load_config, load_model
from kimi_adapter_core.spec import load_spec

ROWS, CACHE, BLOCK, BLOCKS, TOKENS, LOGITS = 4, 24, 4, 17, 12, 8
SIZES = Sizes(ROWS, CACHE, BLOCK, BLOCKS, TOKENS, LOGITS)
LONG, SHORT = 10, 6  # request 0: chunks of 6 and 4; request 1: a 4-token prompt, then 2 speculative tokens


def _call(
    graph: StepGraph, table: torch.Tensor, pools: list[torch.Tensor], items: list[tuple[int, list[int], Any]]
) -> tuple[tuple[torch.Tensor, ...], list[tuple[int, int]]]:
    """One call of ``(row, positions, sequence)`` items, every token's logits and aux rows asked for
    but the first (the budget is ``LOGITS``); ``(row, position)`` of each asked row."""
    ids, positions, rows, wanted = [], [], [], []
    for row, where, sequence in items:
        for index, position in enumerate(where):
            if index or len(where) == 1:
                wanted.append((len(ids), row, position))
            ids.append(sequence[position]), positions.append(position), rows.append(row)
    assert len(wanted) <= LOGITS and len(ids) <= TOKENS
    pad = TOKENS - len(ids)
    call = (
        torch.tensor(ids + [0] * pad),
        torch.tensor(positions + [0] * pad),
        torch.tensor(rows + [ROWS - 1] * pad),  # the scratch row
        table,
        torch.tensor([i for i, _, _ in wanted] + [0] * (LOGITS - len(wanted))),
        *pools,
    )
    return call, [(row, position) for _, row, position in wanted]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "aux"),
    [pytest.param("llama", (0,), marks=pytest.mark.compat), ("deepseek_v3", (1, 2))],
)
def test_aux_hidden_states_of_chunks_and_speculative_tokens_equal_transformers(
    name: str, aux: tuple[int, ...], tmp_path: Path
) -> None:
    graph = extract_step(name, tmp_path, SIZES, aux_layers=aux)
    width = graph.text.hidden_size
    section = graph.mapping["step"]["aux_hidden_states"]
    assert (section["name"], section["layers"], section["shape"]) == (
        "aux_hidden_states",
        list(aux),
        [LOGITS, len(aux) * width],
    )
    generator = torch.Generator().manual_seed(6)
    sequences = [
        torch.randint(3, graph.text.vocab_size, (n,), generator=generator).tolist() for n in (LONG, SHORT)
    ]
    order = torch.randperm(BLOCKS, generator=generator)
    table = torch.full((ROWS, CACHE // BLOCK), int(order[0]), dtype=torch.long)  # order[0]: scratch block
    table[0, :3], table[1, :2] = order[1:4], order[4:6]  # blocks out of order in the pool
    pools = [
        torch.zeros(entry["shape"], dtype=torch.float32)
        for layer in graph.mapping["layers"]
        for key, entry in layer.items()
        if key.endswith("_input")
    ]
    execute = step_executor(graph, check_ownership=True)
    long, short = sequences
    got: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for items in (
        [(0, list(range(6)), long), (1, list(range(4)), short)],  # a chunk beside a whole prompt
        [(0, list(range(6, LONG)), long), (1, [4, 5], short)],  # the last chunk, 2 speculative tokens
    ):
        call, wanted = _call(graph, table, pools, items)
        logits, hidden, *pools = execute(call)
        assert tuple(hidden.shape) == (LOGITS, len(aux) * width)
        got |= {key: (logits[i], hidden[i]) for i, key in enumerate(wanted)}
    assert len(got) == 5 + 3 + 3 + 1
    outputs = [layer_outputs(graph.model, sequence) for sequence in sequences]
    with torch.no_grad():
        references = [graph.model(torch.tensor([s])).logits[0] for s in sequences]
    for (row, position), (logits, hidden) in got.items():
        expected = torch.cat([outputs[row][layer][position] for layer in aux])
        bound = 1e-4 * max(1.0, float(expected.abs().max()))
        assert float((hidden - expected).abs().max()) <= bound, (row, position)
        reference = references[row][position]
        assert float((logits - reference).abs().max()) <= 1e-4 * max(1.0, float(reference.abs().max()))
    metadata = json.loads((graph.out / graph.mapping["step"]["graph"]).read_text())["metadata"]
    assert metadata["abi"]["step"]["aux_layers"] == list(aux)
    # Llama: aux layer 0 read in the traced layers 0 and 1, layer 2 replicated from layer 1;
    # DeepSeek-V3: its last layer is an aux layer, so every layer is traced
    assert metadata["stitching"] == (
        {"traced_layers": 2, "replicated_from": {"2": 1}} if name == "llama" else None
    )


def test_aux_layers_past_the_stack_are_refused_before_export(tmp_path: Path) -> None:
    """``--step-aux-layers`` naming a layer the model does not have: refused naming the ids and the
    layer count, before any file is written (``validate`` says the same against the shipped config)."""
    spec = load_spec("llama")
    options = options_from_spec(
        spec,
        output_dir=tmp_path,
        prefill_len=8,
        max_cache_len=CACHE,
        block_size=BLOCK,
        step_tokens=TOKENS,
        step_aux_layers=(1, 3),
    )
    config = load_config(spec, overrides=tiny_overrides(spec, options))
    with (
        applied(spec),
        pytest.raises(
            KadaptError,
            match=r"^no packed step graph: aux_layers \[3\] outside 0\.\.2: the model has 3 decoder",
        ),
    ):
        run(spec, load_model(spec, device="meta", config=config), options, echo=lambda _: None)
    assert not list(tmp_path.iterdir())
    with pytest.raises(KadaptError, match=r"^--step-aux-layers: aux_layers \[2, 0\] must be increasing"):
        options_from_spec(spec, output_dir=tmp_path, step_tokens=TOKENS, step_aux_layers=(2, 0))
    with pytest.raises(
        KadaptError, match=r"^--step-aux-layers: the step graph returns the aux layers' hidden states: give"
    ):
        options_from_spec(spec, output_dir=tmp_path, step_aux_layers=(0,))
