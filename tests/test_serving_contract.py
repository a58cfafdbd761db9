"""A serving runtime written from the KV mapping alone: ragged batches, contiguous and paged caches.

The driver reads nothing of kadapt's at run time: names, shapes, the slot rule, the paged block
rule and the capacity come from the saved ``*_kv_mapping.json``; the graphs run in torch_ir's
executor. One batch holds rows of different prompt lengths (right padded, each row masking its own
pad slots), every decode step has the rows at different positions, and with ``kv_cache: paged``
each row's blocks are scattered through the shared pool out of order. Midway one row finishes and
a new request takes its place (its own prefill call, fresh blocks) while the others keep decoding:
continuous batching. Every request must equal transformers' ``generate()`` on its prompt alone, for
the shipped specs that hold every feature (``fixtures/archetypes.py``; sliding-window layers included:
the tiny models' window is 4, shorter than the prompts).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch_ir
from fixtures.archetypes import covering
from transformers import GenerationConfig

from kimi_adapter_core.backends.extraction import options_from_spec, run
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.checkpoint.naming import rename_weight
from kimi_adapter_core.loading import applied, load_config, load_model
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.stem for p in (REPO / "specs").glob("*.yaml") if p.stem != "kimi_k25_remote")
# GQA, MLA latent and sliding windows also run in .ci/compat on every supported transformers release:
# the write goes through each release's own attention and cache protocol
COMPAT = ("deepseek_v3", "gemma3_text", "llama")
FAMILIES = [
    pytest.param(name, marks=pytest.mark.compat) if name in COMPAT else name
    for name in covering(SHIPPED, first=COMPAT)  # every feature a shipped spec has: fixtures/archetypes.py
]
LENGTHS, PREFILL, CACHE, BLOCK, STEPS, JOIN = (3, 8, 5), 8, 24, 4, 12, 5


def _mask(dtype: torch.dtype, positions: torch.Tensor, key_len: int, real: torch.Tensor) -> torch.Tensor:
    """The contract's rule, per row: slot k visible to position p iff k <= p and slot k holds a real token."""
    keys = torch.arange(key_len).view(1, 1, 1, -1)
    visible = (keys <= positions.view(len(real), 1, -1, 1)) & (keys < real.view(-1, 1, 1, 1))
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)


class Server:
    """A continuous-batching runtime written from the KV mapping alone: ``admit`` prefills new requests
    into free rows (their own prefill call, its KV placed into the rows' caches or freshly allocated
    blocks), ``step`` decodes every row at its own position."""

    def __init__(self, out: Path, prefix: str, weights: dict) -> None:
        self.mapping = mapping = json.loads((out / f"{prefix}_kv_mapping.json").read_text())
        self.contract, self.dtype = mapping["contract"], getattr(torch, mapping["dtype"])
        self.prefill = torch_ir.IRExecutor(torch_ir.load_ir(str(out / mapping["prefill_graph"])), weights)
        self.decode = torch_ir.IRExecutor(torch_ir.load_ir(str(out / mapping["decode_graph"])), weights)
        self.rows, self.width = mapping["batch"], mapping["prefill_len"]
        self.paged = self.contract.get("paged")
        # every state in ABI order, as each layer's entry lists them (key, value[, index_key]; conv,
        # recurrent)
        states = [
            (key.removeprefix("decode_").removesuffix("_input"), e)
            for layer in mapping["layers"]
            for key, e in layer.items()
            if key.endswith("_input")
        ]
        inputs = [e for _, e in states]
        self.cache = [torch.zeros(e["shape"], dtype=getattr(torch, e["dtype"])) for e in inputs]
        # a linear layer's states are one row per request: no slots, never paged (contract.linear_states);
        # so is a compressor's ring (contract.compressed: comp_src, a csa layer's index_src), and its
        # entries are per request too: the prompt's placed at slots 0.., never paged
        compressed = self.contract.get("compressed", {})
        sparse = {"index_src", "index_comp"} if "sparse" in compressed else set()
        fixed = (
            set(self.contract.get("linear_states", ()))
            | ({"comp_src"} & set(compressed))
            | ({"index_src"} & sparse)
        )
        entries = ({"comp"} & set(compressed)) | ({"index_comp"} & sparse)
        self.fixed = [state in fixed for state, _ in states]
        self.entries = [state in entries for state, _ in states]
        self.position = torch.zeros(self.rows, dtype=torch.long)
        self.token = torch.zeros(self.rows, 1, dtype=torch.long)
        if self.paged is not None:  # a free list in scrambled order: every row's blocks out of order
            order = torch.randperm(self.paged["num_blocks"], generator=torch.Generator().manual_seed(5))
            self.free = order.tolist()
            self.block_table = torch.zeros(self.rows, self.paged["blocks_per_row"], dtype=torch.long)

    def admit(self, requests: dict[int, torch.Tensor]) -> None:
        """Prefill ``{row: prompt}`` in one call (other rows of the call are padding) and seat them."""
        lengths = torch.ones(self.rows, dtype=torch.long)
        padded = torch.zeros(self.rows, self.width, dtype=torch.long)
        for row, prompt in requests.items():
            lengths[row] = prompt.shape[1]
            padded[row, : prompt.shape[1]] = prompt[0]
        positions = torch.arange(self.width).repeat(self.rows, 1)
        logits, *present = self.prefill.execute(
            (padded, _mask(self.dtype, positions, self.width, lengths), positions)
        )
        for row in requests:
            n = int(lengths[row])
            for index in (i for i, fixed in enumerate(self.fixed) if fixed):  # the state after the prompt
                self.cache[index][row] = present[index][row]
            for index in (i for i, entry in enumerate(self.entries) if entry):  # the prompt's closed windows
                self.cache[index][row] = 0
                self.cache[index][row, :, : present[index].shape[2]] = present[index][row]
            grown = [
                i
                for i, (fixed, entry) in enumerate(zip(self.fixed, self.entries, strict=True))
                if not fixed | entry
            ]
            if self.paged is None:  # prefill_to_decode: the row's cache is zeros with the prefill KV placed
                for index in grown:
                    self.cache[index][row] = 0
                    self.cache[index][row, :, : self.width] = present[index][row]
            else:  # give back the row's old blocks, take fresh ones, write real tokens by the slot rule
                size = self.paged["block_size"]
                self.free += self.block_table[row].tolist()
                self.block_table[row] = torch.tensor(self.free[: self.paged["blocks_per_row"]])
                del self.free[: self.paged["blocks_per_row"]]
                for index in grown:
                    for p in range(n):  # pad slots are not the row's to write
                        source = present[index]
                        self.cache[index][self.block_table[row, p // size], p % size] = source[row, :, p]
            self.position[row] = n
            self.token[row] = logits[row, n - 1].argmax()

    def step(self) -> torch.Tensor:
        """One decode step of every row at its own position; returns each row's next token."""
        assert int(self.position.max()) <= self.contract["capacity"]["max_position"]
        pos = self.position.view(-1, 1)
        mask = _mask(self.dtype, pos, self.mapping["max_cache_len"], self.position + 1)
        table = () if self.paged is None else (self.block_table,)
        logits, *self.cache = self.decode.execute((self.token, mask, pos, self.position, *table, *self.cache))
        self.token = logits[:, -1].argmax(-1, keepdim=True)
        self.position = self.position + 1
        return self.token[:, 0]


def _serve(
    out: Path, prefix: str, weights: dict, prompts: list[torch.Tensor], joining: torch.Tensor
) -> list[list[int]]:
    """Greedy tokens of a ragged batch of ``prompts``; after ``JOIN`` steps row 1 is done and ``joining``
    takes its place while the other rows go on (continuous batching)."""
    server = Server(out, prefix, weights)
    server.admit(dict(enumerate(prompts)))
    tokens = [[int(t)] for t in server.token[:, 0]]
    for step in range(STEPS):
        if step == JOIN:
            server.admit({1: joining})
            tokens.append([int(server.token[1, 0])])
        for row, token in enumerate(server.step()):
            tokens[len(tokens) - 1 if row == 1 and step >= JOIN else row].append(int(token))
    return tokens


def _generate(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> list[int]:
    generation = GenerationConfig(
        max_new_tokens=steps + 1, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    model.generation_config.eos_token_id = None  # else the tiny config's eos ends generate() early
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=generation)
    return out[0, prompt.shape[1] :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_ragged_paged_continuous_batch_matches_generate_row_by_row(name: str, tmp_path: Path) -> None:
    spec = load_spec(name)
    base = options_from_spec(
        spec, output_dir=tmp_path, batch=len(LENGTHS), prefill_len=PREFILL, max_cache_len=CACHE
    )
    config = load_config(spec, overrides=tiny_overrides(spec, base))
    torch.manual_seed(0)
    served = {}
    with applied(spec):
        model = load_model(spec, device="cpu", config=config, dtype=torch.float32).eval()
        for kv_cache in ("contiguous", "paged"):
            options = options_from_spec(
                spec,
                output_dir=tmp_path / kv_cache,
                batch=len(LENGTHS),
                prefill_len=PREFILL,
                max_cache_len=CACHE,
                kv_cache=kv_cache,
                block_size=BLOCK if kv_cache == "paged" else None,
            )
            options = dataclasses.replace(options, dtype="float32", vision=None, merged_prefill=None)
            if options.paged is not None:  # a spare row of blocks: the joining request gets fresh ones
                blocks = (len(LENGTHS) + 1) * CACHE // BLOCK
                options = dataclasses.replace(
                    options, paged=dataclasses.replace(options.paged, num_blocks=blocks)
                )
            meta = load_model(spec, device="meta", config=config, dtype=torch.float32).eval()
            run(spec, meta, options, echo=lambda _: None)
            served[kv_cache] = options
    weights = {rename_weight(k, base.weight_renames): v for k, v in model.state_dict().items()}
    text = config.text_config if hasattr(config, "text_config") else config
    generator = torch.Generator().manual_seed(3)
    # a stack whose states take pads too (contract.padding: none) gets whole prompts; rows still decode
    # at different positions once a request joins
    mapping = json.loads(next(tmp_path.glob("contiguous/*_kv_mapping.json")).read_text())
    padding = mapping["contract"]["padding"]
    lengths = LENGTHS if padding["supported"] != "none" else (PREFILL,) * len(LENGTHS)
    prompts = [torch.randint(3, text.vocab_size, (1, n), generator=generator) for n in lengths]
    if hasattr(text, "_experts_implementation"):
        text._experts_implementation = "eager"
    joining_len = 6 if lengths == LENGTHS else PREFILL
    joining = torch.randint(3, text.vocab_size, (1, joining_len), generator=generator)
    expected = [_generate(model, prompt, STEPS) for prompt in prompts]
    expected[1] = expected[1][: JOIN + 1]  # row 1 leaves after JOIN steps; the joining request takes it
    expected.append(_generate(model, joining, STEPS - JOIN))
    assert len({tuple(row[:JOIN]) for row in expected}) == len(expected)  # the rows really differ
    for kv_cache, options in served.items():
        served_tokens = _serve(options.output_dir, options.file_prefix, weights, prompts, joining)
        assert served_tokens == expected, kv_cache
