"""The packed step graph (issue 39): chunked prefill, decode and speculative tokens in one call.

An engine written from the state mapping alone drives ``<prefix>_step_ir.json`` in torch_ir's executor:
each call packs a long prompt's next prefill chunk (chunks of 5, 3 and 6 tokens), other requests'
prompts and decode tokens, and ``k + 1`` speculative tokens of a third request, every token at its
own position, reading and writing a pool smaller than ``batch x max_cache_len`` through block tables
drawn out of order from a free list. Every logit the engine asks for must be transformers' own at that
position of the request (unpatched, fp32, tiny random model), and its argmax the token ``generate()``
picks. Then prefix reuse: a request whose block table points at another's full prompt blocks gives the
logits of an unshared copy, and the binder's ownership check refuses two rows writing one block.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch_ir
from fixtures.modules import import_path
from fixtures.step_graph import Sizes, StepGraph, extract_step
from torch_ir.executor import ExecutionError
from transformers import GenerationConfig

from kimi_adapter_core.backends.extraction import options_from_spec, run
from kimi_adapter_core.backends.extraction.runtime.step import step_mapping
from kimi_adapter_core.backends.extraction.runtime.step_bind import bind_step
from kimi_adapter_core.backends.extraction.runtime.symbolic import position_inputs
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import applied, load_config, load_model
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
# batch is the block table's rows: 3 requests and a scratch row for the padding tokens
ROWS, CACHE, BLOCK, BLOCKS, TOKENS, LOGITS, PREFILL = 4, 24, 4, 17, 12, 6, 8
PROMPTS, NEW = (14, 4, 3), 8  # request 0 is prefilled in chunks, 1 and 2 in one call each
CHUNKS = (5, 3, 6)
SPECULATIVE = 3  # request 2 verifies k + 1 = 3 tokens in one call


def _extract(name: str, tmp_path: Path) -> StepGraph:
    return extract_step(name, tmp_path, Sizes(ROWS, CACHE, BLOCK, BLOCKS, TOKENS, LOGITS, PREFILL))


class Engine:
    """Packs each call's tokens from ``(request, positions, tokens, want logits)`` items, allocating
    blocks from a scrambled free list as requests reach them; unused tokens go to the scratch row."""

    def __init__(self, mapping: dict[str, Any], out: Path, weights: dict[str, torch.Tensor]) -> None:
        self.mapping, self.step = mapping, mapping["step"]
        self.ir = torch_ir.load_ir(str(out / self.step["graph"]))
        self.weights = weights
        paged = mapping["contract"]["paged"]
        self.size, per_row = paged["block_size"], paged["blocks_per_row"]
        inputs = [e for layer in mapping["layers"] for key, e in layer.items() if key.endswith("_input")]
        self.pools = [torch.zeros(e["shape"], dtype=getattr(torch, e["dtype"])) for e in inputs]
        order = torch.randperm(paged["num_blocks"], generator=torch.Generator().manual_seed(5)).tolist()
        self.scratch, self.free = order[0], order[1:]
        self.table = torch.full((ROWS, per_row), self.scratch, dtype=torch.long)
        self.owned = [0] * ROWS  # blocks each row holds

    def share(self, row: int, source: int, blocks: int) -> None:
        """Point ``row``'s first ``blocks`` logical blocks at ``source``'s (prefix reuse: one copy)."""
        self.table[row, :blocks] = self.table[source, :blocks]
        self.owned[row] = blocks

    def inputs(
        self, items: list[tuple[int, list[int], list[int], int]]
    ) -> tuple[tuple[torch.Tensor, ...], list[tuple[int, int]]]:
        """The call of ``(row, positions, tokens, logits of the last n)`` items, and the ``(row,
        position)`` of each logit row asked for; a row's blocks are taken as it reaches them."""
        ids, positions, rows, wanted = [], [], [], []
        for row, where, tokens, logits in items:
            for index, (position, token) in enumerate(zip(where, tokens, strict=True)):
                while self.owned[row] <= min(position // self.size, self.table.shape[1] - 1):
                    self.table[row, self.owned[row]] = self.free.pop()
                    self.owned[row] += 1
                if index >= len(where) - logits:
                    wanted.append((len(ids), row, position))
                ids.append(token), positions.append(position), rows.append(row)
        pad = TOKENS - len(ids)
        indices = [index for index, _, _ in wanted] + [0] * (LOGITS - len(wanted))
        call = (
            torch.tensor(ids + [0] * pad),
            torch.tensor(positions + [0] * pad),
            torch.tensor(rows + [ROWS - 1] * pad),
            self.table.clone(),
            torch.tensor(indices),
            *self.pools,
        )
        return call, [(row, position) for _, row, position in wanted]

    def call(
        self, items: list[tuple[int, list[int], list[int], int]], **bind: Any
    ) -> dict[tuple[int, int], Any]:
        """One step (``inputs``), bound through ``bind_step``; ``{(row, position): logits}`` asked for."""
        call, wanted = self.inputs(items)
        bound = bind_step(self.ir, call, self.mapping, **bind)
        logits, *self.pools = torch_ir.IRExecutor(bound, self.weights).execute(call)
        return {key: logits[i] for i, key in enumerate(wanted)}


def _reference(model: Any, sequence: list[int]) -> torch.Tensor:
    """transformers' logits at every position of ``sequence`` (one forward, no cache)."""
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0]


def _generate(model: Any, prompt: list[int]) -> list[int]:
    generation = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=generation)
    return out[0].tolist()


def _check(
    got: dict[tuple[int, int], Any], sequences: list[list[int]], references: list[torch.Tensor]
) -> None:
    for (row, position), logits in got.items():
        reference = references[row][position]
        bound = 1e-4 * max(1.0, float(reference.abs().max()))
        assert float((logits - reference).abs().max()) <= bound, (row, position)
        if position >= PROMPTS[row] - 1:  # a generated token: generate()'s greedy pick
            assert int(logits.argmax()) == sequences[row][position + 1], (row, position)


# GQA, MLA latent, MoE, a sliding window (4 on the tiny model), DSA's indexer keys paged like keys
# (top-4 of the visible keys), per-type rope and sliding layers, chunked attention with NoPE layers,
# attention sinks, DSA with MLA, Kimi-K2.5's text stack (a multimodal spec); GQA and MLA also on every
# supported transformers release
FAMILIES = [
    pytest.param("llama", marks=pytest.mark.compat),
    pytest.param("deepseek_v3", marks=pytest.mark.compat),
    "qwen3_moe",
    "mistral",
    "deepseek_v32",
    "gemma3_text",
    "llama4_scout",
    "gpt_oss",
    "glm5",
    "kimi_k25",
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    """The tiny Llama step graph, its state mapping, weights, model and text config."""
    return _extract("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prefill_decode_and_speculative_tokens_in_one_step_equal_transformers(
    name: str, tmp_path: Path
) -> None:
    mapping, out, weights, model, text, _ = _extract(name, tmp_path)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, text.vocab_size, (n,), generator=generator).tolist() for n in PROMPTS]
    sequences = [_generate(model, prompt) for prompt in prompts]
    references = [_reference(model, sequence) for sequence in sequences]
    engine = Engine(mapping, out, weights)
    got: dict[tuple[int, int], Any] = {}
    long, short, spec = sequences
    # call 0: the long prompt's first chunk beside the two short prompts (all asking their last logits)
    got |= engine.call(
        [
            (0, list(range(CHUNKS[0])), long[: CHUNKS[0]], 1),
            (1, list(range(PROMPTS[1])), short[: PROMPTS[1]], 1),
            (2, list(range(PROMPTS[2])), spec[: PROMPTS[2]], 1),
        ]
    )
    start, decoded = CHUNKS[0], PROMPTS[1]
    # call 1: the next chunk, a decode token, and k + 1 speculative tokens (every logit verified)
    end = start + CHUNKS[1]
    drafted = range(PROMPTS[2], PROMPTS[2] + SPECULATIVE)
    got |= engine.call(
        [
            (0, list(range(start, end)), long[start:end], 1),
            (1, [decoded], [short[decoded]], 1),
            (2, list(drafted), [spec[p] for p in drafted], SPECULATIVE),
        ]
    )
    start, decoded, verified = end, decoded + 1, drafted[-1] + 1
    # call 2: the last chunk (6 tokens) with a decode token of each other request
    got |= engine.call(
        [
            (0, list(range(start, PROMPTS[0])), long[start : PROMPTS[0]], 1),
            (1, [decoded], [short[decoded]], 1),
            (2, [verified], [spec[verified]], 1),
        ]
    )
    position = [PROMPTS[0], decoded + 1, verified + 1]
    for _ in range(3):  # then plain decode of all three
        got |= engine.call([(row, [position[row]], [sequences[row][position[row]]], 1) for row in range(3)])
        position = [p + 1 for p in position]
    assert len(got) == 3 + 2 + SPECULATIVE + 3 + 9
    assert len({tuple(s[-NEW:]) for s in sequences}) == 3  # the requests really differ
    _check(got, sequences, references)


def test_rows_reading_a_shared_prefix_block_get_the_logits_of_unshared_copies(llama: tuple[Any, ...]) -> None:
    """Request 1's prompt starts with request 0's two full blocks: its block table points at them (read
    only) and it computes only its own tokens. Its logits equal those of an unshared copy that prefilled
    the whole prompt itself, and transformers'; the ownership check lets the sharing through."""
    mapping, out, weights, model, text, _ = llama
    generator = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, text.vocab_size, (2 * BLOCK,), generator=generator).tolist()
    own = torch.randint(3, text.vocab_size, (3,), generator=generator).tolist()
    first, second = prefix + [prefix[0]], prefix + own
    shared = Engine(mapping, out, weights)
    shared.call([(0, list(range(len(prefix))), prefix, 1)], check_ownership=True)
    shared.share(1, 0, 2)
    tail = list(range(len(prefix), len(second)))
    got = shared.call([(1, tail, own, len(own)), (0, [len(prefix)], [first[-1]], 1)], check_ownership=True)
    alone = Engine(mapping, out, weights)
    copies = alone.call([(1, list(range(len(second))), second, len(own))])
    reference = _reference(model, second)
    for position in tail:
        torch.testing.assert_close(got[(1, position)], copies[(1, position)], rtol=0, atol=1e-5)
        torch.testing.assert_close(got[(1, position)], reference[position], rtol=0, atol=1e-4)
    assert shared.table[1, :2].tolist() == shared.table[0, :2].tolist()  # really one copy


def test_two_rows_writing_one_block_are_refused_by_the_ownership_check(llama: tuple[Any, ...]) -> None:
    mapping, out, weights, *_ = llama
    engine = Engine(mapping, out, weights)
    engine.call([(0, [0, 1], [5, 6], 1)])
    engine.share(1, 0, 1)  # row 1's first block is row 0's, and row 1 writes into it
    with pytest.raises(
        KadaptError, match=r"^step: token 1 of request row 1 writes block \d+, which request row 0"
    ):
        engine.call([(0, [2], [7], 1), (1, [0], [5], 1)], check_ownership=True)
    engine.call([(0, [2], [7], 1), (1, [0], [5], 1)])  # unchecked (the default): the graph runs anyway
    with pytest.raises(
        KadaptError, match=r"reads as its logical block 0: a shared prefix block is read-only"
    ):
        engine.call([(0, [3], [8], 1), (1, [4], [9], 1)], check_ownership=True)


def test_a_step_token_past_the_cache_is_refused_by_default(llama: tuple[Any, ...]) -> None:
    """``bind_ir`` reads the step graph's limit from its own declaration (block table blocks x block
    size), as ``bind_step`` does from the mapping; the other index inputs are checked by the mapping."""
    mapping, out, weights, *_ = llama
    engine = Engine(mapping, out, weights)
    engine.call([(0, [CACHE - 1], [5], 1)])  # the last slot of the cache is fine
    with pytest.raises(
        KadaptError,
        match=rf"^step input positions: row 1 holds {CACHE}, outside 0\.\.{CACHE - 1}: a position",
    ):
        engine.call([(0, [CACHE - 2, CACHE], [5, 6], 1)])
    call = engine.inputs([(0, [0], [5], 1)])[0]
    assert position_inputs(engine.ir, graph="step") == ([1], CACHE)
    bad_row = (*call[:2], torch.full_like(call[2], ROWS), *call[3:])
    with pytest.raises(
        KadaptError, match=rf"^step input token_rows: row 0 holds {ROWS}, outside 0\.\.{ROWS - 1}$"
    ):
        bind_step(engine.ir, bad_row, mapping)
    bind_step(engine.ir, bad_row, mapping, check_values=False)  # the switch: shapes and dtypes only


@pytest.mark.parametrize(
    ("name", "refused"),
    [
        ("qwen3_next", r"layer \d+ keeps linear state: the packed step graph writes attention KV token by"),
        ("gemma4_e2b", r"layer \d+ shares another layer's KV: the packed step graph"),
    ],
)
def test_stacks_a_step_cannot_serve_are_refused_before_export(
    name: str, refused: str, tmp_path: Path
) -> None:
    """A linear mixer's state takes a request's tokens as one scan and a KV-sharing layer reads another
    layer's keys of the same rows: no step graph, refused naming the layer before anything is written."""
    spec = load_spec(name)
    options = options_from_spec(
        spec,
        output_dir=tmp_path,
        prefill_len=PREFILL,
        max_cache_len=CACHE,
        block_size=BLOCK,
        step_tokens=TOKENS,
    )
    options = dataclasses.replace(options, vision=None, merged_prefill=None)
    config = load_config(spec, overrides=tiny_overrides(spec, options))
    with applied(spec), pytest.raises(KadaptError, match=rf"^no packed step graph: {refused}"):
        run(spec, load_model(spec, device="meta", config=config), options, echo=lambda _: None)
    assert not list(tmp_path.iterdir())


def test_a_multimodal_spec_gets_a_step_graph_that_refuses_image_placeholders(
    llama: tuple[Any, ...], tmp_path: Path
) -> None:
    """Kimi-K2.5 keeps its vision graphs and gets the step graph too (its text requests, and every
    request's decode, run in it); a prompt with images is prefilled by the merged prefill graph. The
    step mapping then names the placeholder, and the binder refuses a call whose token ids hold it: the
    graph would embed it as a token where the model puts image features."""
    options = options_from_spec(load_spec("kimi_k25"), output_dir=tmp_path, step_tokens=TOKENS)
    assert options.step is not None and options.vision is not None and options.merged_prefill is not None
    mapping, out, weights, *_ = llama
    with_placeholder = {**mapping, "step": {**mapping["step"], "placeholder_token_id": 7}}
    engine = Engine(with_placeholder, out, weights)
    engine.call([(0, [0, 1], [5, 6], 1)])  # no placeholder: runs
    with pytest.raises(
        KadaptError, match=r"^step input input_ids: token 1 is the image placeholder \(id 7\)"
    ):
        engine.call([(0, [2, 3], [8, 7], 1)])
    engine.call([(0, [2, 3], [8, 7], 1)], check_values=False)  # the switch turns it off with the others


@pytest.mark.filterwarnings("ignore:Skipping .* meta-device constant:UserWarning")
def test_the_generated_module_extracts_runs_and_binds_the_step_graph(tmp_path: Path) -> None:
    """The shipped Llama module (kadapt not imported by it) builds the step wrapper and its example
    inputs; torch_ir extracts a graph that replays the wrapper exactly; its ``run_graph`` refuses a token
    past the cache by default (unchecked, the block-table gather fails), and with the state mapping and
    ``check_ownership`` two requests writing one block."""
    module = import_path(REPO / "adapters" / "llama" / "extraction.py", "generated_llama_step")
    spec = load_spec("llama")
    tiny = tiny_overrides(
        spec, options_from_spec(spec, output_dir=tmp_path, prefill_len=PREFILL, max_cache_len=CACHE)
    )
    model = module.build_model(device="meta", overrides=tiny)
    config = module.text_config(model.config)
    sizes = {"rows": 2, "max_cache_len": CACHE, "block_size": BLOCK, "num_blocks": BLOCKS}
    with torch.no_grad(), module.patches_applied():
        step = torch_ir.extract_ir(
            module.step_wrapper(model), module.step_example_inputs(config, tokens=6, logits=2, **sizes)
        )
    torch.manual_seed(0)
    cpu = module.build_model(device="cpu", overrides=tiny)
    dtype = getattr(torch, module.DTYPE)
    generator = torch.Generator().manual_seed(3)
    pools = [torch.randn(tuple(meta.shape), generator=generator).to(dtype) for meta in step.graph_inputs[5:]]
    table = torch.randperm(BLOCKS, generator=generator)[: 2 * CACHE // BLOCK].view(2, CACHE // BLOCK)
    # request 0: a 4-token chunk at positions 3..6; request 1: two speculative tokens at positions 9, 10
    positions, rows = torch.tensor([3, 4, 5, 6, 9, 10]), torch.tensor([0, 0, 0, 0, 1, 1])
    call = (torch.tensor([7, 8, 9, 10, 11, 12]), positions, rows, table, torch.tensor([3, 4]), *pools)
    with torch.no_grad(), module.patches_applied():
        wrapper = module.step_wrapper(cpu)
        eager = wrapper(*call)
        weights = module.graph_weights(wrapper)
        replayed = module.run_graph(step, weights, call, "step")
    assert eager[0].shape == (2, config.vocab_size)
    for a, b in zip(eager, replayed, strict=True):
        assert torch.equal(a, b)
    late = (*call[:1], torch.tensor([3, 4, 5, 6, 9, CACHE]), *call[2:])
    with pytest.raises(
        module.KadaptError, match=rf"^step input positions: row 5 holds {CACHE}, outside 0\.\.{CACHE - 1}"
    ):
        module.run_graph(step, weights, late, "step")
    with pytest.raises(ExecutionError, match="out of bounds"):  # unchecked: the gather past the block table
        module.run_graph(step, weights, late, "step", check=False)
    names = [meta.name for meta in step.graph_inputs[:5]]
    mapping = {
        "max_cache_len": CACHE,
        "contract": {"paged": {"block_size": BLOCK, "num_blocks": BLOCKS}},
        "step": step_mapping(
            graph="step_ir.json",
            inputs=names,
            logits="logits",
            tokens=6,
            rows=2,
            logit_count=2,
            max_cache_len=CACHE,
            block_size=BLOCK,
        ),
    }
    shared = table.clone()
    shared[1, 2] = shared[0, 1]  # request 1's block of position 9 is request 0's block of positions 4..7
    clash = (*call[:3], shared, *call[4:])
    module.run_graph(step, weights, clash, "step", mapping=mapping)  # the debug check is off by default
    with pytest.raises(module.KadaptError, match=r"^step: token 4 of request row 1 writes block"):
        module.run_graph(step, weights, clash, "step", mapping=mapping, check_ownership=True)
