"""A reference serving engine written from kadapt's state mapping alone: continuous batching with
chunked prefill into the paged pool, prefix reuse and greedy decode, driving the packed step graph
(``<prefix>_step_ir.json``, ``abi.step``).

It is the loop a vLLM- or SGLang-style runtime runs, kept small enough to read in one sitting, and the
test of the contract (``tests/test_reference_engine.py`` serves a seeded trace of requests through it
and holds every request's tokens to transformers' ``generate()``). It knows the model only through
the mapping: ``step`` (the graph's inputs and their order), ``contract.paged`` (block size, blocks per
row, pool size, the slot rule and the sharing rule) and the pools' shapes and dtypes in ``layers``.
How a call is executed is the caller's (``execute``: torch_ir's executor on a bound IR, the generated
module's ``run_graph``, or a compiled graph), so the engine imports neither kadapt nor transformers.

Each step packs, within the graph's token and logits budgets: one decode token of every request that
is decoding, then prefill chunks of the requests still reading their prompts (oldest first), then
newly arrived requests that get a free block-table row. A prompt's full blocks are registered in a
prefix cache once written (keyed by every token up to the block's end); a later request whose prompt
starts with them points its block table at them (read-only, reference-counted) and prefills only the
rest - at least its last prompt token, whose logits pick its first output token. A request's own
blocks come from a free list as it reaches them and go back when it finishes; a cached block goes back
when no request reads it. Unused tokens of a call go to a scratch row whose only block no request
owns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Execute = Callable[[tuple[torch.Tensor, ...]], Sequence[torch.Tensor]]  # call -> (logits, *pools)


@dataclass
class Request:
    """One request of a trace: its prompt, how many tokens to generate, and the step it arrives at."""

    prompt: list[int]
    max_new: int
    arrival: int
    output: list[int] = field(default_factory=list)
    row: int | None = None  # its block-table row while it runs
    blocks: list[int] = field(default_factory=list)  # its logical blocks' physical ids
    shared: int = 0  # how many leading blocks are prefix-cache blocks it only reads
    computed: int = 0  # tokens whose KV its blocks hold

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new


class ReferenceEngine:
    """Serves requests through the packed step graph described by ``mapping`` (see the module
    docstring); ``execute`` runs one call's inputs and returns ``(logits, *pools)``."""

    def __init__(self, mapping: dict[str, Any], execute: Execute) -> None:
        step, paged = mapping["step"], mapping["contract"]["paged"]
        shapes = {entry["name"]: entry["shape"] for entry in step["inputs"]}
        ids, _, _, table, indices = (entry["name"] for entry in step["inputs"])
        self.tokens, self.logit_rows = shapes[ids][0], shapes[indices][0]
        self.rows, self.per_row = shapes[table]
        self.block_size, self.num_blocks = paged["block_size"], paged["num_blocks"]
        pools = [e for layer in mapping["layers"] for key, e in layer.items() if key.endswith("_input")]
        self.pools = [torch.zeros(e["shape"], dtype=getattr(torch, e["dtype"])) for e in pools]
        self.execute = execute
        self.scratch_row = self.rows - 1
        self.scratch_block, *free = range(self.num_blocks)
        self.free: list[int] = free[::-1]  # popped from the end: block 1 first
        self.cached: dict[tuple[int, ...], int] = {}  # prompt prefix up to a block's end -> its block
        self.readers: dict[int, int] = {}  # cached block -> requests reading it
        self.steps = 0
        self.shared_blocks = 0  # blocks a request read from the prefix cache instead of computing

    # -- blocks ----------------------------------------------------------------------------------
    def _admit(self, request: Request, row: int) -> None:
        """Give ``request`` a row and the prefix-cache blocks its prompt starts with (keeping at least
        its last prompt token to compute)."""
        request.row = row
        size = self.block_size
        for end in range(size, len(request.prompt), size):  # full blocks before the last prompt token
            block = self.cached.get(tuple(request.prompt[:end]))
            if block is None:
                break
            request.blocks.append(block)
            self.readers[block] += 1
        request.shared = request.computed = len(request.blocks)
        request.computed *= size
        self.shared_blocks += request.shared

    def _reach(self, request: Request, position: int) -> None:
        """Take blocks from the free list until ``request`` holds ``position``'s."""
        while len(request.blocks) <= position // self.block_size:
            if not self.free:
                raise RuntimeError("the pool is out of blocks: size it larger (--num-blocks)")
            request.blocks.append(self.free.pop())

    def _register(self, request: Request) -> None:
        """Put ``request``'s written, full prompt blocks it owns into the prefix cache."""
        size = self.block_size
        for index in range(request.shared, min(request.computed, len(request.prompt)) // size):
            key = tuple(request.prompt[: (index + 1) * size])
            if key not in self.cached:
                block = request.blocks[index]
                self.cached[key], self.readers[block] = block, 1
                request.shared = index + 1  # now read-only: another request may read it
            else:
                break

    def _release(self, request: Request) -> None:
        """Return ``request``'s own blocks; drop a cached block no request reads any more."""
        for index, block in enumerate(request.blocks):
            if index >= request.shared:
                self.free.append(block)
                continue
            self.readers[block] -= 1
            if self.readers[block] == 0:
                del self.readers[block]
                key = next(k for k, b in self.cached.items() if b == block)
                del self.cached[key]
                self.free.append(block)
        request.blocks, request.row = [], None

    # -- steps -----------------------------------------------------------------------------------
    def _plan(self, running: list[Request]) -> list[tuple[Request, int, int]]:
        """This step's ``(request, first position, token count)``: decode tokens first, then prefill
        chunks, within the token and logits budgets."""
        tokens, logits, plan = self.tokens, self.logit_rows, []
        for request in running:  # decoding: its next token
            if request.computed >= len(request.prompt) and tokens and logits:
                plan.append((request, request.computed, 1))
                tokens, logits = tokens - 1, logits - 1
        for request in running:  # prefilling: the next chunk of its prompt
            left = len(request.prompt) - request.computed
            if left > 0 and tokens and (left > tokens or logits):
                count = min(left, tokens)
                plan.append((request, request.computed, count))
                tokens -= count
                logits -= count == left
        return plan

    def _call(self, plan: list[tuple[Request, int, int]]) -> tuple[tuple[torch.Tensor, ...], list[Request]]:
        """The step graph's inputs for ``plan`` and the request of each logits row asked for."""
        table = torch.full((self.rows, self.per_row), self.scratch_block, dtype=torch.long)
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        indices: list[int] = []
        wanted: list[Request] = []
        for request, start, count in plan:
            assert request.row is not None
            self._reach(request, start + count - 1)
            table[request.row, : len(request.blocks)] = torch.tensor(request.blocks)
            sequence = request.tokens
            for position in range(start, start + count):
                ids.append(sequence[position])
                positions.append(position)
                rows.append(request.row)
            if start + count >= len(request.prompt):  # its last prompt token, or a decode token
                indices.append(len(ids) - 1)
                wanted.append(request)
        pad = self.tokens - len(ids)
        call = (
            torch.tensor(ids + [0] * pad),
            torch.tensor(positions + [0] * pad),
            torch.tensor(rows + [self.scratch_row] * pad),
            table,
            torch.tensor(indices + [0] * (self.logit_rows - len(indices))),
            *self.pools,
        )
        return call, wanted

    def serve(self, requests: Sequence[Request], max_steps: int = 10_000) -> int:
        """Serve ``requests`` to completion (each arrives at its ``arrival`` step); the steps taken."""
        waiting = sorted(requests, key=lambda r: r.arrival)
        running: list[Request] = []
        while waiting or running:
            if self.steps >= max_steps:
                raise RuntimeError(f"not done after {max_steps} steps")
            free_rows = sorted(set(range(self.scratch_row)) - {r.row for r in running})
            while waiting and waiting[0].arrival <= self.steps and free_rows:
                request = waiting.pop(0)
                self._admit(request, free_rows.pop(0))
                running.append(request)
            plan = self._plan(running)
            if plan:
                call, wanted = self._call(plan)
                logits, *self.pools = self.execute(call)
                for request, start, count in plan:
                    request.computed = start + count
                    self._register(request)
                for index, request in enumerate(wanted):
                    request.output.append(int(logits[index].argmax()))
                for request in [r for r in running if r.done]:
                    running.remove(request)
                    self._release(request)
            self.steps += 1
        return self.steps
